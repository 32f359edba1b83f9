"""A quantized KV cache, simulated where attention reads it: keys (after the rotary embedding) and values.

Mechanism. ``install`` registers an attention function with transformers (``AttentionInterface``, named
``qkit_kv_<original>``, with the original's mask function in ``AttentionMaskInterface``) and points the
model's config at it; ``remove`` points it back. A llama-style attention layer calls the function with
``key``/``value`` ``[B, kv_heads, S, head_dim]`` *after* RoPE and, when a cache is used, after
``cache.update``: in the perplexity pass (``use_cache=False``, one full-sequence forward) ``S`` is the
sequence, in generation ``S`` is every cached token. The function fake-quantizes them and calls the
original attention (sdpa or eager), so both paths see the quantized cache.

The quantizer is ``qkit.simulate.activations.fake_quantize`` (symmetric, ``qmax = 7`` or ``127``, clamp
``[-qmax, qmax]``, fp32) with these units:

* per token (``token``): one scale per token per kv head, over its ``head_dim`` channels;
* per channel (``channel``, KIVI arXiv:2402.02750: keys per channel, values per token): one key scale per
  kv head and channel over a group of ``kv_group`` consecutive tokens (positions ``[gG, (g+1)G)`` from the
  start of the sequence); values per token.

What a query sees, exactly as a cache that quantizes tokens when they arrive would hold them: the query
at position ``t`` sees key/value ``j`` quantized when ``j < bound(t)``, in full precision otherwise, with

    per token:    bound(t) = t + 1 - R
    per channel:  bound(t) = floor((t + 1 - R) / G) * G     (a key group is quantized once it is complete
                                                             and has left the full-precision window)

``R = kv_residual`` (default 0: everything a query reads is quantized, in per-token layouts including its
own token). So with KIVI keys the tokens of the group still being filled stay in full precision, as in
KIVI. A group's scale is computed over its ``G`` tokens once, so the cached path (at step ``t``) and the
no-cache path (query ``t`` of a full sequence) give the same numbers: in the no-cache path, where queries
of one forward see different bounds, the queries are cut into runs that see the same cache (runs of ``G``
with KIVI keys and ``R = 0``) and the original kernel runs once per run on that cache (``_State._runs``);
where runs are short (under ``MIN_RUN`` queries on average: per-token layouts with ``R > 0``) attention is
computed in fp32 by ``mixed_attention`` (scores against quantized and full-precision keys, selected per
query-key pair; slower). When every query sees a fully quantized cache (per token, ``R = 0``) or there
is one query (decoding), the original kernel runs once on the quantized (or mixed) tensors.

Positions come from the attention mask: a key slot masked for every query (left padding of a batch) is
absent: it is in no group and does not count towards positions, so a padded prompt is quantized as the
same prompt unpadded would be.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.simulate.base import SimulationContext, register_simulation
from qkit.simulate.activations import fake_quantize, qmax_for
from qkit.simulate.options import build, register_options

LAYOUTS = ("token", "channel")
KV_BITS = (8, 4)
DEFAULT_GROUP = 32  # KIVI's group size G for per-channel key scales (arXiv:2402.02750, Sec. 4)
# A no-cache forward whose queries fall into runs of at least this many (on average) that see the same
# cache calls the original attention once per run; shorter runs (per-token layouts with a residual) use
# ``mixed_attention`` instead, one fp32 pass whatever the runs.
MIN_RUN = 8
_STATE = "_qkit_kv"


@dataclass(frozen=True)
class KVCacheOptions:
    """``kv_residual``: the most recent tokens kept in full precision (>= 0); ``kv_group``: tokens per
    per-channel key scale (>= 1; per-token layouts ignore it)."""

    kv_residual: int = 0
    kv_group: int = DEFAULT_GROUP

    def __post_init__(self) -> None:
        for key, low in (("kv_residual", 0), ("kv_group", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(f"--{key.replace('_', '-')} must be an integer >= {low}, got {v!r}")
            whole(v, f"--{key.replace('_', '-')}", low, MAX_COUNT)


register_options("kv-cache", KVCacheOptions)


def check_layout(bits: int, layout: str) -> None:
    if bits not in KV_BITS:
        raise InputError(f"KV-cache bits must be 8 or 4, got {bits!r}")
    if layout not in LAYOUTS:
        raise InputError(f"unknown KV-cache layout {layout!r}; use token (one scale per token and head) or channel (KIVI: keys per channel, values per token)")


# --------------------------------------------------------------------------- maths (tensors in, tensors out)


def quantize_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [B, H, S, D]``: one scale per ``(b, h, s)`` over ``D``; fake-quantized, ``x.dtype``."""
    scale = x.detach().abs().amax(dim=-1, keepdim=True).float() / qmax_for(bits)
    return fake_quantize(x, scale, bits)


def quantize_per_channel(x: torch.Tensor, bits: int, group: int, positions: torch.Tensor | None = None,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, H, S, D]``: one scale per ``(b, h, d)`` and group of ``group`` positions.

    ``positions``: long ``[B, S]``, each slot's token position (default ``0..S-1``); ``valid``: bool
    ``[B, S]``, slots that hold a token (default all). Slot ``s`` is in group ``positions[b, s] // group``;
    invalid slots are in no group (their output is still fake-quantized, with their own scale)."""
    b, h, s, d = x.shape
    if positions is None:
        positions = torch.arange(s, device=x.device).expand(b, s)
    n_groups = (s + group - 1) // group
    gid = torch.div(positions.clamp(min=0), group, rounding_mode="floor")
    if valid is not None:
        gid = torch.where(valid, gid, torch.full_like(gid, n_groups))
    idx = gid.reshape(b, 1, s, 1).expand(b, h, s, d)
    a = x.detach().abs().float()
    amax = torch.zeros(b, h, n_groups + 1, d, dtype=torch.float32, device=x.device)
    amax = amax.scatter_reduce(2, idx, a, reduce="amax", include_self=False)
    scale = amax.gather(2, idx) / qmax_for(bits)
    if valid is not None:  # an absent slot keeps a per-token scale of its own (it is masked anyway)
        own = a.amax(dim=-1, keepdim=True) / qmax_for(bits)
        scale = torch.where(valid.reshape(b, 1, s, 1), scale, own)
    return fake_quantize(x, scale, bits)


def quantized_bound(query_positions: torch.Tensor, residual: int, group: int | None) -> torch.Tensor:
    """Positions ``< bound`` are read quantized by a query at ``query_positions`` (long, any shape)."""
    base = (query_positions + 1 - residual).clamp(min=0)
    if group is not None:
        base = torch.div(base, group, rounding_mode="floor") * group
    return base


def _share_bounds(bound: torch.Tensor, query_pos: torch.Tensor, s: int) -> torch.Tensor:
    """A query whose bound lies past its own position sees everything quantized; any bound past it says the
    same, so it takes the bound of the next query that does see full-precision keys (bounds never decrease
    along the queries), or ``s + 1`` if none does: queries that differ only there fall into one run."""
    q = bound.shape[1]
    sees_fp = bound <= query_pos
    idx = torch.where(sees_fp, torch.arange(q, device=bound.device).expand_as(bound), q)
    nxt = idx.flip(1).cummin(dim=1).values.flip(1)  # the next query (itself included) that sees fp keys
    padded = torch.cat([bound, torch.full_like(bound[:, :1], s + 1)], dim=1)
    return padded.gather(1, nxt)


def run_starts(key_bound: torch.Tensor, value_bound: torch.Tensor) -> list[int]:
    """Query indices where a run of queries seeing the same cache begins: ``key_bound``, ``value_bound``
    ``[B, q]``; a run ends where either bound changes for any sequence of the batch."""
    change = (key_bound[:, 1:] != key_bound[:, :-1]) | (value_bound[:, 1:] != value_bound[:, :-1])
    return [0, *(torch.nonzero(change.any(dim=0)).flatten() + 1).tolist()]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, kv_heads, S, D]`` -> ``[B, kv_heads * n_rep, S, D]`` (each kv head serves ``n_rep`` query heads)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def mixed_attention(query: torch.Tensor, key: torch.Tensor, key_hat: torch.Tensor, value: torch.Tensor,
                    value_hat: torch.Tensor, allowed: torch.Tensor, key_quantized: torch.Tensor,
                    value_quantized: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention where each query-key pair reads the quantized or the full-precision key/value.

    ``query [B, Hq, q, D]``; ``key, key_hat, value, value_hat [B, Hkv, S, D]``; ``allowed``,
    ``key_quantized``, ``value_quantized``: bool broadcastable to ``[B, 1, q, S]``. Scores in fp32:
    ``scaling * q·k`` with ``k = key_hat`` where ``key_quantized`` else ``key``; softmax over the allowed keys
    (a query with none gets zeros); output ``sum_j p_j v_j`` likewise. Returns ``[B, q, Hq, D]``.
    """
    n_rep = query.shape[1] // key.shape[1]
    qf = query.float()
    s_hat = qf @ repeat_kv(key_hat.float(), n_rep).transpose(-1, -2)
    s_full = qf @ repeat_kv(key.float(), n_rep).transpose(-1, -2)
    scores = torch.where(key_quantized, s_hat, s_full).mul_(scaling)
    scores = scores.masked_fill_(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    v = repeat_kv(value.float(), n_rep)
    out = p @ v + (p * value_quantized) @ (repeat_kv(value_hat.float(), n_rep) - v)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def _allowed_mask(mask: torch.Tensor | None, b: int, q: int, s: int, device) -> torch.Tensor:
    """The attention mask as bool ``[B, 1, q, S]`` (True: attend); None means causal (bottom-right)."""
    if mask is None:
        i = torch.arange(q, device=device)[:, None] + (s - q)
        return (torch.arange(s, device=device)[None, :] <= i).reshape(1, 1, q, s).expand(b, 1, q, s)
    if mask.dtype == torch.bool:
        m = mask
    else:  # additive: 0 where allowed, a large negative number where not
        m = mask > torch.finfo(mask.dtype).min / 2
    return m[..., -s:].expand(b, m.shape[1], q, s)[:, :1]


# --------------------------------------------------------------------------- the simulation


@dataclass
class _Stats:
    calls_no_cache: int = 0  # several queries at once (the perplexity pass, agreement, a prompt's prefill)
    calls_decode: int = 0  # one query reading the cache (generation)
    calls_runs: int = 0  # of the no-cache calls, those computed as runs of queries that see one cache
    calls_mixed: int = 0  # of the no-cache calls, those computed by ``mixed_attention``
    tokens: int = 0  # key/value slots quantized, summed over layers and calls


@dataclass
class _State:
    bits: int
    key_layout: str
    residual: int
    group: int
    original: Callable[..., Any]
    original_name: str
    stats: _Stats
    quantizer: Callable[[torch.Tensor, str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def quantize(self, x: torch.Tensor, layout: str, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if self.quantizer is not None:
            return self.quantizer(x, layout, positions, valid)
        if layout == "channel":
            return quantize_per_channel(x, self.bits, self.group, positions, valid)
        return quantize_per_token(x, self.bits)

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        b, _, s, _ = key.shape
        q = query.shape[2]
        allowed = _allowed_mask(attention_mask, b, q, s, key.device)
        valid = allowed.any(dim=2)[:, 0]  # [B, S]: slots some query attends to
        positions = valid.long().cumsum(dim=1) - 1
        query_pos = positions[:, s - q :]
        key_hat = self.quantize(key, self.key_layout, positions, valid)
        value_hat = self.quantize(value, "token", positions, valid)
        self.stats.tokens += b * s
        kb = quantized_bound(query_pos, self.residual, self.group if self.key_layout == "channel" else None)
        vb = quantized_bound(query_pos, self.residual, None)
        kb, vb = _share_bounds(kb, query_pos, s), _share_bounds(vb, query_pos, s)
        kq = positions[:, None, None, :] < kb[:, None, :, None]  # [B, 1, q, S]
        vq = positions[:, None, None, :] < vb[:, None, :, None]
        if q == 1:
            self.stats.calls_decode += 1
        else:
            self.stats.calls_no_cache += 1
        all_quantized = not bool(((~kq | ~vq) & allowed).any())
        if all_quantized:
            return self.original(module, query, key_hat, value_hat, attention_mask, **kwargs)
        if q == 1:
            k = torch.where(kq[:, 0, 0, :, None].unsqueeze(1), key_hat, key)
            v = torch.where(vq[:, 0, 0, :, None].unsqueeze(1), value_hat, value)
            return self.original(module, query, k, v, attention_mask, **kwargs)
        starts = run_starts(kb, vb)
        if len(starts) - 1 <= q // MIN_RUN:  # (a run that begins one query in does not count)
            self.stats.calls_runs += 1
            return self._runs(module, query, key, key_hat, value, value_hat, attention_mask, allowed, positions,
                              kb, vb, starts, **kwargs)
        self.stats.calls_mixed += 1
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return mixed_attention(query, key, key_hat, value, value_hat, allowed, kq, vq, scaling), None

    def _runs(self, module, query, key, key_hat, value, value_hat, attention_mask, allowed, positions, kb, vb, starts, **kwargs):
        """The original attention once per run of queries that see the same cache: each run reads the keys
        and values up to its last query, quantized below the run's bounds, with its rows of the mask."""
        b, _, s, _ = key.shape
        q = query.shape[2]
        outs = []
        for i0, i1 in zip(starts, [*starts[1:], q]):
            end = s - q + i1  # keys after the run's last query are masked for every query of the run
            p = positions[:, :end].reshape(b, 1, end, 1)
            k = torch.where(p < kb[:, i0].reshape(b, 1, 1, 1), key_hat[:, :, :end], key[:, :, :end])
            v = torch.where(p < vb[:, i0].reshape(b, 1, 1, 1), value_hat[:, :, :end], value[:, :, :end])
            if attention_mask is not None and attention_mask.dtype != torch.bool:
                mask = attention_mask[:, :, i0:i1, :end]
            else:
                mask = allowed[:, :, i0:i1, :end]
                if self.original_name == "eager":  # eager adds its mask to the scores
                    mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, torch.finfo(query.dtype).min)
            out, _ = self.original(module, query[:, :, i0:i1], k, v, mask, **kwargs)
            outs.append(out)
        return torch.cat(outs, dim=1), None


def _kv_attention(module, query, key, value, attention_mask, **kwargs):
    state: _State | None = getattr(module, _STATE, None)
    if state is None:
        raise InputError(f"{type(module).__name__} runs qkit's KV-cache attention without a simulation installed; reload the model")
    return state.attend(module, query, key, value, attention_mask, **kwargs)


def _register(original: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = f"qkit_kv_{original}"
    if original not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise InputError(f"KV-cache simulation wraps sdpa or eager attention, not {original!r}; load the model with attn_implementation='sdpa'")
    AttentionInterface.register(name, _kv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[original])
    return name


def _original_function(module: torch.nn.Module, original: str) -> Callable[..., Any]:
    if original == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise InputError(f"{type(module).__name__} has no eager_attention_forward; load the model with attn_implementation='sdpa'")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[original]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention layers (modules with ``num_key_value_groups`` and a ``layer_idx``)."""
    found = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]
    if not found:
        raise InputError(f"{type(model).__name__} has no llama-style attention layers; KV-cache simulation supports transformers decoder LMs")
    return found


@dataclass
class _Handle:
    configs: list[tuple[Any, Any]]
    modules: list[torch.nn.Module]
    stats_: _Stats
    facts: dict[str, Any] = field(default_factory=dict)

    def remove(self) -> None:
        for config, value in self.configs:
            config._attn_implementation_internal = value
        for m in self.modules:
            m.__dict__.pop(_STATE, None)
        self.configs.clear()
        self.modules.clear()

    def stats(self) -> dict[str, Any]:
        f, c = self.facts, self.stats_
        keys = f"keys per channel in groups of {f['group']} tokens" if f["keys"] == "channel" else "keys per token"
        summary = (f"int{f['bits']} cache, {keys}, values per token, {f['residual']} recent tokens in full precision; "
                   f"attention calls: {c.calls_no_cache} without cache ({c.calls_runs} in runs, {c.calls_mixed} mixed), "
                   f"{c.calls_decode} decoding")
        return {**f, **c.__dict__, "summary": summary}


@dataclass(frozen=True)
class KVCacheSimulation:
    """Fake-quantize the keys and values every attention layer reads (see the module doc).

    ``quantizer``: replaces the fake quantization (``(x, layout, positions, valid) -> x``); tests use an
    identity to show that the mechanism alone changes nothing."""

    name: str
    bits: int
    key_layout: str
    options: KVCacheOptions = KVCacheOptions()
    quantizer: Callable[..., torch.Tensor] | None = None
    act_bits: None = None

    def __post_init__(self) -> None:
        check_layout(self.bits, self.key_layout)

    @property
    def kv_bits(self) -> int:
        return self.bits

    def calibration_options(self) -> None:
        return None  # nothing calibrated

    def install(self, model: torch.nn.Module, context: SimulationContext) -> _Handle:
        configs = {id(model.config): model.config}
        for m in model.modules():
            c = getattr(m, "config", None)
            if c is not None and hasattr(c, "_attn_implementation_internal"):
                configs.setdefault(id(c), c)
        original = model.config._attn_implementation or "eager"
        if str(original).startswith("qkit_kv_"):
            raise InputError("a KV-cache simulation is already installed on this model; a row takes one KV layout")
        name = _register(original)
        modules = attention_modules(model)
        stats = _Stats()
        for m in modules:
            setattr(m, _STATE, _State(self.bits, self.key_layout, self.options.kv_residual, self.options.kv_group,
                                      _original_function(m, original), original, stats, self.quantizer))
        saved = [(c, c._attn_implementation_internal) for c in configs.values()]
        for c in configs.values():
            c._attn_implementation_internal = name
        facts = {"bits": self.bits, "keys": self.key_layout, "values": "token", "residual": self.options.kv_residual,
                 "group": self.options.kv_group if self.key_layout == "channel" else None, "attention": original,
                 "layers": len(modules)}
        return _Handle(saved, modules, stats, facts)


def make_kv_simulation(bits: int, layout: str, given: Mapping[str, Any] | None = None) -> KVCacheSimulation:
    """The simulation ``kv-int{bits}-{layout}`` with options from ``given`` (``kv_residual``, ``kv_group``)."""
    check_layout(bits, layout)
    return KVCacheSimulation(f"kv-int{bits}-{layout}", bits, layout, build(KVCacheOptions, given))


for _bits in KV_BITS:
    for _layout in LAYOUTS:
        register_simulation(f"kv-int{_bits}-{_layout}", lambda given, b=_bits, l=_layout: make_kv_simulation(b, l, given))

__all__ = [
    "DEFAULT_GROUP", "KVCacheOptions", "KVCacheSimulation", "LAYOUTS", "attention_modules", "check_layout",
    "make_kv_simulation", "mixed_attention", "quantize_per_channel", "quantize_per_token", "quantized_bound", "repeat_kv",
]
