"""Per-input-channel scale folding, shared by AWQ and SmoothQuant.

Both methods pick a positive scale ``s[j]`` per input channel ``j`` of a group of linears that read the
same input ``X``, and rewrite ``Y = X Wᵀ`` as ``Y = (X / s) (W · s)ᵀ`` (``W · s`` multiplies column ``j`` of
every linear by ``s[j]``). The ``1 / s`` is folded into whatever produced ``X``, so the saved model is an
ordinary model whose full-precision outputs are unchanged (to fp32 rounding):

* a norm (``input_layernorm`` before q/k/v, ``post_attention_layernorm`` before gate/up): RMSNorm's
  ``y = w ⊙ x / rms(x)`` is linear in ``w``, so its weight (and bias, for a LayerNorm) is divided by ``s``;
* a linear (``up_proj`` before ``down_proj``: the MLP computes ``down(act(gate(x)) ⊙ up(x))``, linear in
  ``up``'s output; ``v_proj`` before ``o_proj``: attention mixes value rows linearly): the preceding
  linear's output rows (and bias) are divided by ``s``.

Grouped-query attention (``num_key_value_heads < num_attention_heads``, as the default model: 3 kv heads
for 9 query heads). ``o_proj``'s input column ``(h, d)`` is value channel ``(h // r, d)`` of the kv head
that query head ``h`` reads (``r = heads / kv_heads``). Scaling ``v_proj``'s output row ``(g, d)`` by
``1 / s`` therefore scales the ``r`` columns ``(g·r .. g·r+r-1, d)`` of ``o_proj``; the v→o group is
folded with scales *tied* across those ``r`` heads: ``s`` has ``kv_heads · head_dim`` entries and
``o_proj``'s columns get ``s`` repeated per kv head (``FoldGroup.expand``). Statistics of ``o_proj``'s
input are reduced to the kv channels the same way (``FoldGroup.reduce``: max for max|X|, mean for
mean|X|). AutoAWQ folds v→o only when v and o have the same shape (no GQA); qkit handles both.

Everything here takes and returns tensors (or edits the given module's parameters in place, for
``fold`` on a model); nothing reads files or prints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qkit.checkpoint import tensor_dtypes
from qkit.dtypes import check_finite
from qkit.errors import InputError
from qkit.methods.experts import LAYOUTS, ExpertLayout
from qkit.schemes.recipes import expert_count

if TYPE_CHECKING:  # annotations only
    from qkit.methods.calibration import ModelConfig

# Model families whose blocks have the llama layout (pre-norm RMSNorm, q/k/v/o, gate/up/down), and the
# mixture-of-experts ones whose sparse MLP ``qkit.methods.experts`` lays out (``moe_groups``).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *sorted(LAYOUTS))
# SmoothQuant's reference clamps both absmax statistics and the scales at 1e-5 (smoothquant/smooth.py).
SMOOTH_EPS = 1e-5

_LAYER = re.compile(r"^(?P<prefix>.*?\blayers)\.(?P<index>\d+)\.input_layernorm\.weight$")


@dataclass(frozen=True)
class FoldGroup:
    """Linears that read one input, and what produced that input.

    ``name``: a label (``model.layers.3.self_attn.qkv``); ``prev``: the module whose output is the input
    (a norm, or a linear when ``prev_is_linear``); ``linears``: the modules reading it (module names,
    tensors are ``NAME.weight``); ``output``: the module whose output AWQ's search measures (the attention
    block for q/k/v, the MLP for gate/up, the linear itself for down and o). ``repeat`` > 1 only for v→o
    under grouped-query attention: the input channels of ``linears`` are ``repeat`` copies per kv head
    (``head_dim`` wide) of ``prev``'s output rows.
    """

    name: str
    kind: str  # "qkv" | "o" | "gate_up" | "down" | "experts_gate_up" (every reader of a sparse MLP's norm)
    prev: str
    prev_is_linear: bool
    linears: tuple[str, ...]
    output: str
    repeat: int = 1
    head_dim: int = 0

    @property
    def weight_names(self) -> tuple[str, ...]:
        return tuple(f"{n}.weight" for n in self.linears)

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Scales of ``prev``'s output channels ``[c]`` -> scales of the linears' input columns."""
        if self.repeat == 1:
            return s
        kv = s.numel() // self.head_dim
        return s.reshape(kv, 1, self.head_dim).expand(kv, self.repeat, self.head_dim).reshape(-1)

    def reduce(self, stat: torch.Tensor, how: str = "max") -> torch.Tensor:
        """A per-input-column statistic of the linears ``[in]`` -> per ``prev`` channel ``[c]`` (``max`` or
        ``mean`` over the ``repeat`` query heads that read one kv channel)."""
        if self.repeat == 1:
            return stat
        v = stat.reshape(-1, self.repeat, self.head_dim)
        return (v.amax(dim=1) if how == "max" else v.mean(dim=1)).reshape(-1)


def _config_get(config: ModelConfig, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def _config_dict(config: ModelConfig) -> dict[str, Any]:
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def fold_groups(config: ModelConfig, names: Iterable[str], *, linear_groups: bool = True) -> list[FoldGroup]:
    """The fold groups of a llama-layout model, block by block, in the order they are folded.

    ``config``: the model config (a ``PretrainedConfig`` or its dict); ``names``: the model's tensor names
    (to find the block prefix, e.g. ``model.layers``). Per block: q/k/v after ``input_layernorm``; o after
    v (``linear_groups``); gate/up after ``post_attention_layernorm``; down after up (``linear_groups``); a
    mixture-of-experts block's MLP as ``moe_groups`` gives it (its experts named one linear per matrix).
    Raises ``InputError`` for a model type whose blocks are not laid out this way.
    """
    model_type = _config_get(config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(
            f"scale folding supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}; use --method rtn or gptq"
        )
    heads = int(_config_get(config, "num_attention_heads"))
    kv_heads = int(_config_get(config, "num_key_value_heads") or heads)
    head_dim = int(_config_get(config, "head_dim") or _config_get(config, "hidden_size") // heads)
    names = list(names)
    layers: dict[int, str] = {}
    for n in names:
        m = _LAYER.match(n)
        if m:
            layers[int(m["index"])] = f"{m['prefix']}.{m['index']}"
    if not layers:
        raise InputError("no transformer blocks with an input_layernorm were found; scale folding needs a llama-layout model")
    groups: list[FoldGroup] = []
    for i in sorted(layers):
        b = layers[i]
        attn, mlp = f"{b}.self_attn", f"{b}.mlp"
        groups.append(FoldGroup(f"{attn}.qkv", "qkv", f"{b}.input_layernorm", False,
                                (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), attn))
        if linear_groups:
            groups.append(FoldGroup(f"{attn}.o", "o", f"{attn}.v_proj", True, (f"{attn}.o_proj",), f"{attn}.o_proj",
                                    repeat=heads // kv_heads, head_dim=head_dim))
        layout = LAYOUTS.get(model_type) if expert_count(_config_dict(config)) > 1 else None
        if layout is not None and any(n.startswith((f"{b}.{layout.moe}.experts.", f"{b}.{layout.stored}.experts."))
                                      for n in names):
            groups += moe_groups(config, layout, b, names, linear_groups=linear_groups)
            continue
        groups.append(FoldGroup(f"{mlp}.gate_up", "gate_up", f"{b}.post_attention_layernorm", False,
                                (f"{mlp}.gate_proj", f"{mlp}.up_proj"), mlp))
        if linear_groups:
            groups.append(FoldGroup(f"{mlp}.down", "down", f"{mlp}.up_proj", True, (f"{mlp}.down_proj",), f"{mlp}.down_proj"))
    return groups


def moe_groups(config: ModelConfig, layout: ExpertLayout, block: str, names: Iterable[str], *,
               linear_groups: bool = True) -> list[FoldGroup]:
    """The MLP groups of a sparse block ``block`` (``model.layers.3``), named as the loaded model names its
    modules while ``qkit.methods.experts.unfused_experts`` holds one linear per expert matrix (llm-compressor's
    mixture-of-experts AWQ mappings, with the router folded too):

    * ``experts_gate_up``: every reader of ``post_attention_layernorm``'s output: the router first (its input is
      every token), qwen2_moe's ``shared_expert_gate`` and shared expert's gate/up, then each expert's gate and
      up. The norm holds one scale per channel, so all of them take the same ``s``: the router's and the shared
      expert gate's weights absorb it (their columns times ``s``, unquantized: the routing and the function
      stay exact), and the group's output is the whole sparse MLP;
    * per expert, ``down`` after its own ``up`` (its statistics are the tokens routed to it), and the shared
      expert's ``down`` after its ``up``.
    """
    mlp, moe = f"{block}.mlp", f"{block}.{layout.moe}"
    names = set(names)
    shared = f"{mlp}.shared_expert.gate_proj.weight" in names or f"{mlp}.shared_expert.gate_proj" in names
    experts = expert_count(_config_dict(config))
    each = [f"{moe}.experts.{e}" for e in range(experts)]
    readers = (f"{moe}.{layout.router}",
               *((f"{mlp}.shared_expert_gate", f"{mlp}.shared_expert.gate_proj", f"{mlp}.shared_expert.up_proj")
                 if shared else ()),
               *(f"{x}.{m}" for x in each for m in (layout.gate, layout.up)))
    groups = [FoldGroup(f"{moe}.experts.gate_up", "experts_gate_up", f"{block}.post_attention_layernorm", False,
                        readers, moe)]
    if linear_groups:
        downs = [(f"{mlp}.shared_expert", "up_proj", "down_proj")] if shared else []
        downs += [(x, layout.up, layout.down) for x in each]
        groups += [FoldGroup(f"{x}.down", "down", f"{x}.{up}", True, (f"{x}.{down}",), f"{x}.{down}")
                   for x, up, down in downs]
    return groups


def model_fold_groups(model: torch.nn.Module, *, linear_groups: bool = True) -> list[FoldGroup]:
    """``fold_groups`` of a loaded transformers model."""
    return fold_groups(model.config, (n for n, _ in model.named_parameters()), linear_groups=linear_groups)


# --------------------------------------------------------------------------- scales


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's migration scales (Xiao et al., arXiv:2211.10438, eq. 4)::

        s[j] = max|X_j|^α / max|W_j|^(1-α)

    ``act_absmax``, ``weight_absmax``: float ``[in]``, each clamped to ≥ 1e-5 first (a dead channel must not
    give 0 or inf), and ``s`` clamped to ≥ 1e-5 as the reference's ``smooth_ln_fcs`` does. Returns fp32
    ``[in]``. After folding, channel ``j`` of the activations peaks at ``max|X_j|^(1-α) · max|W_j|^(1-α)``
    and of the weights at ``max|X_j|^α · max|W_j|^α``: α = 0.5 balances them.
    """
    check_alpha(alpha)
    if act_absmax.shape != weight_absmax.shape or act_absmax.dim() != 1:
        raise InputError(
            f"smoothing needs two 1-D statistics of one length, got {list(act_absmax.shape)} and {list(weight_absmax.shape)}"
        )
    a = act_absmax.float().clamp(min=SMOOTH_EPS)
    w = weight_absmax.float().clamp(min=SMOOTH_EPS)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=SMOOTH_EPS)


def check_alpha(alpha: float) -> None:
    if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise InputError(f"--alpha must be in [0, 1] (0.5 balances activations and weights), got {alpha!r}")


def weight_absmax(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per-input-column max|W| over several linears' weights ``[out_i, in]`` -> fp32 ``[in]``."""
    cols = [w.detach().abs().amax(dim=0).float() for w in weights]
    return torch.stack(cols).amax(dim=0)


def outlier_ratio(absmax: torch.Tensor) -> float:
    """max over channels / median over channels of a per-channel max|X| ``[in]``: how far the largest
    channel sits above a typical one (the INT8 levels a per-token scale leaves the typical channels are
    about ``127 / ratio``)."""
    a = absmax.float()
    med = a.median()
    return float(a.max() / med) if med > 0 else float("inf")


# --------------------------------------------------------------------------- folding


def folded_tensors(tensors: Mapping[str, torch.Tensor], group: FoldGroup, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``group`` after folding ``scales`` (``[c]``, ``c`` = ``prev``'s output channels).

    ``prev.weight`` (a norm's ``[c]``, or a linear's ``[c, in]`` rows) and ``prev.bias`` if present are
    divided by ``s``; every following linear's weight ``[out, in]`` has its columns multiplied by
    ``group.expand(s)``. Computed in fp32 and returned in each tensor's dtype; the input is not changed.
    Raises ``InputError`` for non-positive or non-finite scales or a shape that does not match.
    """
    s = scales.detach().float()
    if s.dim() != 1 or not torch.isfinite(s).all() or (s <= 0).any():
        raise InputError(f"fold scales of {group.name} must be a 1-D tensor of finite positive numbers")
    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        key = f"{group.prev}.{suffix}"
        if key not in tensors or tensors[key] is None:
            continue
        t = tensors[key]
        if t.shape[0] != s.numel():
            raise InputError(f"fold scales of {group.name} have {s.numel()} entries but {key} has {t.shape[0]} rows")
        div = s.to(t.device).reshape(-1, *([1] * (t.dim() - 1)))
        out[key] = (t.float() / div).to(t.dtype)
    cols = group.expand(s)
    for key in group.weight_names:
        w = tensors[key]
        if w.shape[-1] != cols.numel():
            raise InputError(f"fold scales of {group.name} expand to {cols.numel()} columns but {key} has {w.shape[-1]}")
        out[key] = (w.float() * cols.to(w.device)).to(w.dtype)
    return out


def group_tensors(model: torch.nn.Module, group: FoldGroup) -> dict[str, torch.Tensor]:
    """The parameters ``folded_tensors`` reads for ``group``, from a loaded model."""
    out: dict[str, torch.Tensor] = {}
    for module_name in (group.prev, *group.linears):
        m = model.get_submodule(module_name)
        out[f"{module_name}.weight"] = m.weight.data
        if getattr(m, "bias", None) is not None:
            out[f"{module_name}.bias"] = m.bias.data
    return out


def fold(target: torch.nn.Module | MutableMapping[str, torch.Tensor], group: FoldGroup, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fold ``scales`` into ``target`` (a loaded model, edited in place, or a state dict, whose entries are
    replaced) and return the changed tensors by name (see ``folded_tensors``)."""
    if isinstance(target, torch.nn.Module):
        new = folded_tensors(group_tensors(target, group), group, scales)
        with torch.no_grad():
            for key, value in new.items():
                module_name, _, attr = key.rpartition(".")
                getattr(target.get_submodule(module_name), attr).copy_(value)
        return new
    new = folded_tensors(target, group, scales)
    target.update(new)
    return new


# --------------------------------------------------------------------------- activation statistics


class ChannelStats:
    """Running per-channel ``max|x|`` and ``mean|x|`` over the last dimension of every tensor given to
    ``update`` (all leading dimensions are tokens). Accumulates in fp32 (fp64 for the sum)."""

    def __init__(self) -> None:
        self.absmax: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1, x.shape[-1]).abs().float()
        mx, sm = a.amax(dim=0), a.sum(dim=0, dtype=torch.float64)
        if self.absmax is None:
            self.absmax, self._sum = mx, sm
        else:
            self.absmax = torch.maximum(self.absmax, mx)
            self._sum += sm
        self.count += a.shape[0]

    @property
    def absmean(self) -> torch.Tensor:
        if self._sum is None or self.count == 0:
            raise InputError("no activations were recorded; give at least one calibration sample")
        return (self._sum / self.count).float()


def collect_channel_stats(
    model: torch.nn.Module, groups: Iterable[FoldGroup], batches: Iterable[torch.Tensor]
) -> dict[str, ChannelStats]:
    """Run ``model`` on each batch of token ids ``[b, seqlen]`` and record the input statistics of every
    group (the input of its first linear: all linears of a group read the same tensor). Keyed by group name;
    statistics are per input column of the linears (``FoldGroup.reduce`` maps them to ``prev``'s channels)."""
    groups = list(groups)
    stats = {g.name: ChannelStats() for g in groups}
    hooks = []
    try:
        for g in groups:
            st = stats[g.name]
            hooks.append(model.get_submodule(g.linears[0]).register_forward_pre_hook(lambda _m, args, st=st: st.update(args[0])))
        device = next(model.parameters()).device
        # The decoder alone when the model has one: the LM head (49152 x 576 on the default model, a fifth of
        # the flops) is not needed for statistics of the blocks' inputs.
        runner = model.get_decoder() if hasattr(model, "get_decoder") else model
        with torch.no_grad():
            for ids in batches:
                runner(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for g in groups:  # scales from NaN or inf maxima would fold garbage into the norms: refused, never written
        if stats[g.name].absmax is not None:
            check_finite(stats[g.name].absmax, f"the input of {g.linears[0]}")
    return stats


# --------------------------------------------------------------------------- method plumbing (AWQ, SmoothQuant)


def options_record(options: Any) -> dict[str, Any]:
    """A method's options as JSON-able facts for the manifest (nested dataclasses as dicts)."""
    return json_safe(dataclasses.asdict(options))


def json_safe(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return round(obj, 8) if obj == obj and abs(obj) != float("inf") else str(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def source_dtypes(directory: Any) -> dict[str, torch.dtype]:
    """The stored dtype of every tensor of a model directory (headers only), to give quantized tensors the
    source's dtype although methods compute on an fp32 copy."""
    return {k: v for k, v in tensor_dtypes(directory).items() if v is not None}


def in_source_dtypes(quantized: dict[str, Any], directory: Any) -> dict[str, Any]:
    """``quantized`` ({name: QuantizedTensor}) each with its tensor's stored dtype (``source_dtypes``): the
    dtype a dequantize gives back, the source's although the method computed in fp32."""
    dtypes = source_dtypes(directory)
    return {n: qt if dtypes.get(n, qt.dtype) == qt.dtype else dataclasses.replace(qt, dtype=dtypes[n])
            for n, qt in quantized.items()}



__all__ = [
    "SMOOTH_EPS",
    "SUPPORTED_MODEL_TYPES",
    "ChannelStats",
    "FoldGroup",
    "check_alpha",
    "json_safe",
    "options_record",
    "source_dtypes",
    "in_source_dtypes",
    "collect_channel_stats",
    "fold",
    "fold_groups",
    "folded_tensors",
    "moe_groups",
    "group_tensors",
    "model_fold_groups",
    "outlier_ratio",
    "smoothing_factors",
    "weight_absmax",
]
