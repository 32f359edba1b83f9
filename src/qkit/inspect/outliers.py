"""Residual-stream outliers: which hidden dimensions reach huge magnitudes, in which layers, and what a
tensor-wide INT8 scale makes of the rest.

Notation. ``h[l]`` is the residual stream after decoder layer ``l`` (the output of ``model.layers.l``,
captured with a forward hook; layers are numbered from 0 as in the checkpoint names), fp32 ``[T, H]``
for ``T`` prompt tokens and ``H`` hidden dimensions.

* per-dimension maximum: ``m[l, d] = max_t |h[l][t, d]|``;
* dimension ``d`` is an *outlier* at layer ``l`` when ``m[l, d] >= threshold * median_d m[l, d]``
  (default 20: twenty times the typical dimension's maximum);
* octave histogram of ``m[l, :]``: bins ``[0, 1), [1, 2), [2, 4), ...`` up to the bin that holds the
  largest value;
* tensor-wide INT8 of ``h[l]``: the symmetric absmax of ``qkit.schemes.absmax`` with one fp32 scale,
  ``s = max|h| / 127``, ``q = clamp(round(h / s), -128, 127)``; a dimension "gets" as many levels as
  ``q[:, d]`` has distinct values. The same after dropping the ``k`` dimensions with the largest ``m``
  gives ``s'`` and the shrink factor ``s / s'``.

The linears' own inputs under W8A8 rows are measured in ``qkit.inspect.linear_inputs``.

Layer 7 (``inspect``): above ``models`` (4), ``methods`` and ``serving`` (5).
"""

from __future__ import annotations

import contextlib
import math
from importlib import resources
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkit.bounds import MAX_COUNT, real, whole
from qkit.errors import InputError
from qkit.granularity import PerTensor
from qkit.inspect.linear_inputs import linear_inputs_report
from qkit.methods.experts import FusedExperts, expert_views, fused_experts
from qkit.models import LoadedModel, ModelRef, check_device_map, load, parse_device, read_config, resolve
from qkit.schemes.absmax import quantize_absmax
from qkit.serving.kv import context_length
from qkit.texts import load_corpus

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PROMPT_NAME = "outliers_prompt.txt"  # in corpora/, installed as the package ``qkit.corpora``
OUTLIER_THRESHOLD = 20.0
MAX_THRESHOLD = 1e6  # --threshold: a dimension a million times the median one is past any measured outlier
EXCLUDE_TOP = 4
TOP_DIMS = 5
PLATEAU = 0.05  # "almost the same value": within 5% of the dimension's peak
QUANTILES = (0.25, 0.5, 0.75)  # the "typical" dimensions: quartile- and median-sized maxima


# --------------------------------------------------------------------------- prompts


def default_prompt(option: str = "--prompt") -> str:
    """The fixed English paragraph (about 80 tokens) in ``corpora/outliers_prompt.txt``; ``option``: the
    command's own text option, which the message for a broken install suggests."""
    try:
        text = (resources.files("qkit.corpora") / PROMPT_NAME).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, OSError) as exc:
        raise InputError(f"the default prompt corpora/{PROMPT_NAME} is missing from this install; pass {option} TEXT") from exc
    return " ".join(text.split())


def corpus_text() -> str:
    """The pinned evaluation corpus's text (``qkit.texts.load_corpus``)."""
    return load_corpus().text


def encode(tokenizer: PreTrainedTokenizerBase | None, text: str, max_tokens: int | None = None, what: str = "--prompt") -> torch.Tensor:
    """``text`` -> token ids ``[1, T]`` (int64), cut to the first ``max_tokens``. ``what``: how the command
    takes the text (``--prompt``, ``--text``, the ``TEXT`` argument), for the messages."""
    if tokenizer is None:
        raise InputError("this model has no tokenizer files; pass a model directory that includes its tokenizer")
    if not text.strip():
        raise InputError(f"the text ({what}) is empty; pass some text as {what}")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : max_tokens or None]
    if ids.shape[1] == 0:
        raise InputError(f"the text ({what}) encodes to no tokens; pass a longer {what}")
    return ids


def model_context(model: PreTrainedModel | dict[str, Any]) -> int | None:
    """The longest sequence a loaded transformers model (or a config dict) takes: ``max_position_embeddings``
    or its gpt-2 style equivalent (``qkit.serving.kv.context_length``); None when the config does not say."""
    return context_length(model if isinstance(model, dict) else model.config.to_dict())


def check_context(tokens: int, context: int | None, what: str, model: str) -> None:
    """Refuse a forward pass over more tokens than the model's context, before it runs (positions past the
    context are beyond what the model was built for, and the attention's memory grows with the length)."""
    if context is not None and tokens > context:
        raise InputError(
            f"{what} gives {tokens:,} tokens, more than the {context:,}-token context of {model} "
            f"(max_position_embeddings); pass {context:,} tokens or fewer"
        )


def resolve_with_context(model: str | Path | ModelRef | None) -> tuple[ModelRef, int | None]:
    """``(ModelRef, context)`` from the config alone: a command can bound its token counts before loading
    (``model`` may already be a ``ModelRef``, returned as it is)."""
    ref = resolve(model)
    return ref, model_context(read_config(ref.directory))


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase | None, *, prompt: str | None = None, corpus_tokens: int | None = None
) -> tuple[torch.Tensor, str]:
    """``(ids [1, T], source)``: ``prompt``, else the first ``corpus_tokens`` of the pinned corpus, else the
    default paragraph."""
    if prompt is not None and corpus_tokens is not None:
        raise InputError("pass either --prompt or --corpus-tokens, not both")
    if prompt is not None:
        return encode(tokenizer, prompt), "--prompt"
    if corpus_tokens is not None:
        if corpus_tokens < 1:
            raise InputError(f"--corpus-tokens must be at least 1, got {corpus_tokens}")
        return encode(tokenizer, corpus_text(), corpus_tokens), f"pinned corpus, first {corpus_tokens} tokens"
    return encode(tokenizer, default_prompt()), f"corpora/{PROMPT_NAME}"


# --------------------------------------------------------------------------- capturing the residual stream


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM (``model.model.layers`` for llama/qwen/mistral, found otherwise)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return layers
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise InputError(f"cannot find the decoder layers of {type(model).__name__}; inspect supports decoder-only LMs")


@contextlib.contextmanager
def capture(
    model: torch.nn.Module, *, residual: bool = True, linears: Sequence[str] = ()
) -> Iterator[dict[str, Any]]:
    """Record, during the forward passes inside the ``with``: ``"residual"``, a list of ``[T, H]`` fp32
    outputs of each decoder layer (batch 1), and ``"inputs"``, ``{linear name: per-input-channel
    max |x| [in_features]}`` for the named ``nn.Linear`` modules (names without ``.weight``). An expert
    matrix of a mixture-of-experts model is named as the checkpoint stores it (``mlp.experts.3.gate_proj``;
    its weight is a slice of a fused parameter: ``methods.experts``), and its input is taken over the tokens
    the router sent that expert: the fused module's input rows whose top-k holds it for gate and up,
    ``act(x gate^T) * (x up^T)`` of them for down. An expert no token reached gets no entry."""
    out: dict[str, Any] = {"residual": [], "inputs": {}}
    handles = []

    def on_layer(_mod, _args, output):
        h = output[0] if isinstance(output, tuple) else output
        out["residual"].append(h.detach()[0].float())

    def on_linear(name):
        def hook(_mod, args):
            x = args[0].detach()
            out["inputs"][name] = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()

        return hook

    def on_experts(found: FusedExperts, wanted: dict[int, list[tuple[str, int]]]):
        def hook(_mod, args):  # (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])
            hidden, top_k = args[0].detach(), args[1]
            views = expert_views(found.module)
            for e, names in wanted.items():
                x = hidden[(top_k == e).any(dim=-1)]
                if not len(x):
                    continue
                gate, up, _down = views[e]
                inputs = [x, x, None]
                if any(i == 2 for _, i in names):
                    inputs[2] = found.module.act_fn(x @ gate.T) * (x @ up.T)
                for name, i in names:
                    out["inputs"][name] = inputs[i].abs().amax(dim=0).float()

        return hook

    try:
        if residual:
            handles += [layer.register_forward_hook(on_layer) for layer in decoder_layers(model)]
        modules = dict(model.named_modules())
        experts = {f"{f.stored}.{e}.{m}": (f, e, i) for f in fused_experts(model, model.config.to_dict())
                   for e in range(len(expert_views(f.module))) for i, m in enumerate(f.layout.names)} if linears else {}
        by_module: dict[str, dict[int, list[tuple[str, int]]]] = {}
        for name in linears:
            if name in modules:
                handles.append(modules[name].register_forward_pre_hook(on_linear(name)))
            else:  # an expert matrix, or a KeyError naming what the model lacks
                found, e, i = experts[name]
                by_module.setdefault(found.path, {}).setdefault(e, []).append((name, i))
        fused = {f.path: f for f, _, _ in experts.values()}
        handles += [fused[path].module.register_forward_pre_hook(on_experts(fused[path], wanted))
                    for path, wanted in by_module.items()]
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def residual_stream(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``h`` fp32 ``[L, T, H]``: the residual stream after each decoder layer for one sequence ``[1, T]``."""
    device = next(model.parameters()).device
    with capture(model) as cap:
        model(input_ids.to(device))
    return torch.stack(cap["residual"]).cpu()


# --------------------------------------------------------------------------- analyses (tensors in, data out)


def dim_maxima(hidden: torch.Tensor) -> torch.Tensor:
    """``[L, T, H]`` -> ``m [L, H]``: the largest ``|h|`` each dimension reaches over the tokens."""
    return hidden.abs().amax(dim=1)


def outlier_mask(maxima: torch.Tensor, threshold: float = OUTLIER_THRESHOLD) -> torch.Tensor:
    """``m [L, H]`` -> bool ``[L, H]``: ``m[l, d] >= threshold * median_d m[l, d]``."""
    med = maxima.median(dim=-1, keepdim=True).values
    return maxima >= threshold * med


def octave_bins(values: torch.Tensor) -> list[dict[str, float]]:
    """Counts of ``values`` (>= 0) in ``[0, 1), [1, 2), [2, 4), ...``, up to the bin of the largest value."""
    top = float(values.max()) if values.numel() else 0.0
    n_bins = 1 if top < 1 else int(math.floor(math.log2(top))) + 2
    edges = [0.0] + [2.0**i for i in range(n_bins)]
    # bucketize(right=True): a value equal to an edge opens the next bin, [lo, hi).
    idx = torch.bucketize(values.double(), torch.tensor(edges[1:], dtype=torch.float64), right=True)
    counts = torch.bincount(idx, minlength=n_bins)[:n_bins]
    return [{"lo": edges[i], "hi": edges[i + 1], "count": int(counts[i])} for i in range(n_bins)]


def _int8_block(h: torch.Tensor, dim_ids: Sequence[int], maxima: torch.Tensor, typical: Sequence[int]) -> dict[str, Any]:
    """INT8 of the columns ``dim_ids`` of ``h [T, H]``; per-typical-dimension level counts."""
    cols = torch.as_tensor(list(dim_ids), dtype=torch.long)
    sub = h[:, cols]
    q, scale = quantize_absmax(sub.float(), 8, PerTensor(), torch.float32)
    pos = {d: i for i, d in enumerate(cols.tolist())}
    s = float(scale.reshape(()))
    return {
        "scale": s,
        "levels_total": 256,
        "levels_used": int(torch.unique(q).numel()),
        "typical": [
            {"dim": int(d), "max_abs": float(maxima[d]), "levels": int(torch.unique(q[:, pos[int(d)]]).numel())}
            for d in typical
        ],
    }


def typical_dims(maxima: torch.Tensor, quantiles: Sequence[float] = QUANTILES) -> list[int]:
    """The dimensions whose maximum sits at each quantile of ``maxima [H]`` (sorted index ``round(q (H-1))``)."""
    order = torch.argsort(maxima, stable=True)
    return [int(order[round(q * (maxima.numel() - 1))]) for q in quantiles]


def int8_analysis(h: torch.Tensor, *, exclude_top: int = EXCLUDE_TOP) -> dict[str, Any]:
    """Tensor-wide INT8 of one layer's ``h [T, H]``, with all dimensions and without the top ``exclude_top``.

    Also the median and 99th percentile of ``|h|``, in absolute terms and in steps of each scale.
    """
    if not 0 <= exclude_top < h.shape[-1]:
        raise InputError(f"--exclude-top must be between 0 and {h.shape[-1] - 1}, got {exclude_top}")
    maxima = h.abs().amax(dim=0)
    typical = typical_dims(maxima)
    top = torch.argsort(maxima, descending=True, stable=True)[:exclude_top].tolist()
    rest = [d for d in range(h.shape[-1]) if d not in set(top)]
    full = _int8_block(h, range(h.shape[-1]), maxima, typical)
    reduced = _int8_block(h, rest, maxima, typical)
    a = h.abs().reshape(-1).double()
    median, p99 = (float(v) for v in torch.quantile(a, torch.tensor([0.5, 0.99], dtype=torch.float64)))
    return {
        "all": full,
        "excluded_dims": [int(d) for d in top],
        "without_top": reduced,
        "scale_shrink": full["scale"] / reduced["scale"] if reduced["scale"] > 0 else math.inf,
        "abs_median": median,
        "abs_p99": p99,
        "median_in_steps": median / full["scale"] if full["scale"] > 0 else 0.0,
        "p99_in_steps": p99 / full["scale"] if full["scale"] > 0 else 0.0,
        "median_in_steps_without_top": median / reduced["scale"] if reduced["scale"] > 0 else 0.0,
        "p99_in_steps_without_top": p99 / reduced["scale"] if reduced["scale"] > 0 else 0.0,
    }


def _ranges(layers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, start, prev = [], None, None
    for x in layers:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = x
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def persistent_outliers(maxima: torch.Tensor, mask: torch.Tensor) -> list[dict[str, Any]]:
    """Per outlier dimension (outlier in at least one layer): in how many and which layers, and its value
    there; the layers where it stays within ``PLATEAU`` of its peak. Sorted by layer count, then peak."""
    out = []
    for d in torch.nonzero(mask.any(dim=0)).flatten().tolist():
        layers = torch.nonzero(mask[:, d]).flatten().tolist()
        values = maxima[:, d]
        peak_layer = int(torch.argmax(values))
        peak = float(values[peak_layer])
        near = torch.nonzero(values >= (1 - PLATEAU) * peak).flatten().tolist()
        out.append(
            {
                "dim": d,
                "layers": layers,
                "n_layers": len(layers),
                "layer_ranges": _ranges(layers),
                "first_layer": layers[0],
                "value_first": float(values[layers[0]]),
                "last_layer": layers[-1],
                "value_last": float(values[layers[-1]]),
                "peak_layer": peak_layer,
                "peak": peak,
                "near_peak_layers": _ranges(near),
                "values": [float(v) for v in values],
            }
        )
    return sorted(out, key=lambda r: (-r["n_layers"], -r["peak"], r["dim"]))


@dataclass
class OutliersReport:
    model: str
    source: str
    tokens: int
    hidden: int
    threshold: float
    layer: int
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    outlier_dims: list[dict[str, Any]] = field(default_factory=list)
    histogram: list[dict[str, float]] = field(default_factory=list)
    int8: dict[str, Any] = field(default_factory=dict)
    linear_inputs: list[dict[str, Any]] = field(default_factory=list)  # linear_input_levels per norm, in layer order

    @property
    def layers(self) -> int:
        return len(self.per_layer)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def analyse_hidden(
    hidden: torch.Tensor,
    *,
    layer: int | None = None,
    exclude_top: int = EXCLUDE_TOP,
    threshold: float = OUTLIER_THRESHOLD,
    top: int = TOP_DIMS,
    model: str = "",
    source: str = "",
) -> OutliersReport:
    """Every analysis of the module doc on a residual stream ``hidden`` fp32 ``[L, T, H]``."""
    if hidden.dim() != 3 or hidden.shape[0] == 0:
        raise InputError(f"expected hidden states [layers, tokens, hidden], got shape {list(hidden.shape)}")
    n_layers, n_tokens, n_hidden = hidden.shape
    layer = n_layers // 2 if layer is None else layer
    if not -n_layers <= layer < n_layers:
        raise InputError(f"--layer must be between 0 and {n_layers - 1}, got {layer}")
    layer %= n_layers
    if not threshold > 1:  # NaN too
        raise InputError(f"--threshold must be above 1 (a multiple of the median dimension), got {threshold}")
    top = max(1, min(top, n_hidden))
    maxima = dim_maxima(hidden)
    mask = outlier_mask(maxima, threshold)
    med = maxima.median(dim=-1).values
    vals, dims = maxima.topk(top, dim=-1)
    per_layer = [
        {
            "layer": l,
            "max": float(vals[l, 0]),
            "median_dim_max": float(med[l]),
            "top": [{"dim": int(d), "value": float(v)} for d, v in zip(dims[l], vals[l])],
            "outliers": torch.nonzero(mask[l]).flatten().tolist(),
        }
        for l in range(n_layers)
    ]
    return OutliersReport(
        model=model,
        source=source,
        tokens=n_tokens,
        hidden=n_hidden,
        threshold=threshold,
        layer=layer,
        per_layer=per_layer,
        outlier_dims=persistent_outliers(maxima, mask),
        histogram=octave_bins(maxima[layer]),
        int8=int8_analysis(hidden[layer], exclude_top=exclude_top),
    )


def check_options(
    *,
    prompt: str | None = None,
    corpus_tokens: int | None = None,
    exclude_top: int = EXCLUDE_TOP,
    threshold: float = OUTLIER_THRESHOLD,
    top: int = TOP_DIMS,
    device: str | None = None,
    device_map: str | None = None,
    layer: int | None = None,
) -> None:
    """Every check of ``residual_outliers``' options that needs no model (``--layer`` and the upper bound
    of ``--exclude-top`` depend on the model and are checked again once it is loaded; here each number's
    finite range)."""
    if prompt is not None and corpus_tokens is not None:
        raise InputError("pass either --prompt or --corpus-tokens, not both")
    if corpus_tokens is not None and corpus_tokens < 1:
        raise InputError(f"--corpus-tokens must be at least 1, got {corpus_tokens}")
    if exclude_top < 0:
        raise InputError(f"--exclude-top must be at least 0, got {exclude_top}")
    if not threshold > 1:  # NaN too
        raise InputError(f"--threshold must be above 1 (a multiple of the median dimension), got {threshold}")
    if top < 1:
        raise InputError(f"--top must be at least 1, got {top}")
    if corpus_tokens is not None:
        whole(corpus_tokens, "--corpus-tokens", 1, MAX_COUNT)
    whole(exclude_top, "--exclude-top", 0, MAX_COUNT)
    check_threshold(threshold, "dimension")
    whole(top, "--top", 1, MAX_COUNT)
    if layer is not None:  # negative counts from the last layer, as a Python index
        whole(layer, "--layer", -MAX_COUNT, MAX_COUNT)
    parse_device(device)
    if device_map is not None:
        check_device_map(device_map)


def check_threshold(threshold: float, unit: str) -> float:
    """``--threshold``, a multiple of the median ``unit`` (dimension, channel): above 1, at most ``MAX_THRESHOLD``."""
    if not threshold > 1:  # NaN too
        raise InputError(f"--threshold must be above 1 (a multiple of the median {unit}), got {threshold}")
    return real(threshold, "--threshold", 1, MAX_THRESHOLD, above=True)


def residual_outliers(
    model: str | Path | None = None,
    *,
    prompt: str | None = None,
    corpus_tokens: int | None = None,
    layer: int | None = None,
    exclude_top: int = EXCLUDE_TOP,
    threshold: float = OUTLIER_THRESHOLD,
    top: int = TOP_DIMS,
    device: str | None = None,
    device_map: str | None = None,
    loaded: LoadedModel | None = None,
) -> OutliersReport:
    """Run a prompt through MODEL, capture the residual stream after every layer and analyse it.

    ``loaded``: an already loaded ``qkit.models.LoadedModel`` (skips loading). ``device_map``: spread the
    model over several devices (see ``qkit.models.load``).
    """
    check_options(prompt=prompt, corpus_tokens=corpus_tokens, exclude_top=exclude_top, threshold=threshold, top=top,
                  device=device if loaded is None else None, device_map=device_map if loaded is None else None)
    if loaded is None:
        ref, context = resolve_with_context(model)
        if corpus_tokens is not None:
            check_context(corpus_tokens, context, "--corpus-tokens", ref.spec)
        loaded = load(ref, device=device, device_map=device_map)
    ids, source = prompt_ids(loaded.tokenizer, prompt=prompt, corpus_tokens=corpus_tokens)
    context = model_context(loaded.model)
    if prompt is None and corpus_tokens is None and context is not None and ids.shape[1] > context:
        # the built-in prompt is longer than a small model's context: use what fits (a text the user gave
        # is refused instead, below, since cutting it would measure something other than what was asked)
        ids, source = ids[:, :context], f"{source} (its first {context:,} tokens: the model's context)"
    check_context(ids.shape[1], context, "--prompt" if prompt is not None else source, loaded.ref.spec)
    hidden = residual_stream(loaded.model, ids)
    report = analyse_hidden(
        hidden, layer=layer, exclude_top=exclude_top, threshold=threshold, top=top,
        model=loaded.ref.spec, source=source,
    )
    report.linear_inputs = linear_inputs_report(loaded.model, ids)
    return report
