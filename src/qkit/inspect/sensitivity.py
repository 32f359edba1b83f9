"""Sensitivity: which matrices' quantization actually moves the model's output.

One reference forward pass over ``T`` tokens gives ``log p_ref [T, V]`` (log-softmax, computed once). Then,
for each unit (one decoder layer's projections, or one matrix), its weights are swapped in place for
``dequantize(quantize_tensor(W, scheme))`` (exactly what ``qkit quantize`` writes), the model runs again,
and the weights are restored (a mixture-of-experts model's expert matrices too, each under the name the
checkpoint stores it with, a slice of its fused parameter: ``evaluation.swap.model_tensors``; the router
stays as it is, as ``qkit quantize`` keeps it)::

    KL(unit) = 1/T sum_t sum_v p_ref[t, v] (log p_ref[t, v] - log p_unit[t, v])      (nats, float64 sums)

A unit whose dequantized weights equal the originals gives bit-identical logits and a KL of exactly 0.
Next to each unit: its relative weight error (``sqrt(sum ||W - W_hat||^2 / sum ||W||^2)`` over the unit's
matrices), its largest ``max|w| / std`` (see ``qkit.inspect.errors``), and whether the input of its
matrices carries one of the residual stream's outlier dimensions (``qkit.inspect.outliers``): an input
channel is an outlier when its max ``|x|`` over the tokens is at least ``threshold`` times the median
channel's.

The suggestion keeps the top ``N`` units at ``keep`` (int8 per-row by default) and measures, with two
more forward passes, the KL of the whole model quantized with ``scheme`` and of the mixed model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.evaluation.swap import model_tensors
from qkit.evaluation.token_scores import MIN_SCORED
from qkit.inspect.matrix_stats import matrix_stats
from qkit.inspect.outliers import (
    check_context,
    check_threshold,
    model_context,
    resolve_with_context,
    OUTLIER_THRESHOLD,
    capture,
    corpus_text,
    decoder_layers,
    default_prompt,
    dim_maxima,
    encode,
    outlier_mask,
)
from qkit.models import LoadedModel, load, parse_device
from qkit.schemes import Scheme, get_scheme, quantize_tensor
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.transform import _KEEP_ALIASES, is_block_projection

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedTokenizerBase

BY = ("layer", "matrix")
DEFAULT_TOKENS = 256
KEEP_SCHEME = "int8"  # the alias of --keep: int8 per-row
# What the ranking does not say: each KL is one measurement on these tokens (no standard error, no
# confidence interval), so a close ranking may change with the text.
NO_UNCERTAINTY = ("each KL is one measurement on {tokens} tokens, with no standard error: check a close ranking "
                  "on another --text or more --tokens")
SUGGEST_SHARE = 0.5  # auto N: the fewest top units whose individual KLs sum to half the total ...
SUGGEST_MAX_SHARE = 0.1  # ... but at most a tenth of the units
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks)\.\d+)\.")


@dataclass
class Unit:
    name: str  # "model.layers.3" (by layer) or a matrix name (by matrix)
    matrices: list[str]
    kl: float = 0.0
    rel_error: float = 0.0
    max_over_std: float = 0.0
    bytes_scheme: int = 0
    bytes_keep: int = 0
    input_outlier_dims: list[int] = field(default_factory=list)  # outlier input channels (hidden-sized inputs)
    residual_outlier_dims: list[int] = field(default_factory=list)  # ... of them, those that are residual outliers

    @property
    def glob(self) -> str:
        return self.name if len(self.matrices) == 1 and self.name == self.matrices[0] else f"{self.name}.*"

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "glob": self.glob}


@dataclass
class SensitivityReport:
    model: str
    scheme: str
    keep_scheme: str
    by: str
    tokens: int
    source: str
    units: list[Unit]  # ranked, largest KL first
    residual_outlier_dims: list[int]
    kl_all: float = 0.0  # the whole model at ``scheme``
    kl_mixed: float = 0.0  # the top ``len(kept)`` units at ``keep_scheme``, the rest at ``scheme``
    kept: list[str] = field(default_factory=list)
    bytes_all: int = 0
    bytes_mixed: int = 0

    @property
    def recovered(self) -> float:
        """Share of the whole-model KL that keeping the suggested units recovers."""
        return (self.kl_all - self.kl_mixed) / self.kl_all if self.kl_all > 0 else 0.0

    @property
    def extra_bytes(self) -> float:
        """Relative growth of the quantized matrices' bytes in the mixed model."""
        return self.bytes_mixed / self.bytes_all - 1 if self.bytes_all else 0.0

    def keep_args(self) -> list[str]:
        globs = {u.name: u.glob for u in self.units}
        return [f"{KEEP_SCHEME if self.keep_scheme == _KEEP_ALIASES[KEEP_SCHEME] else self.keep_scheme}:{globs[k]}"
                for k in self.kept]

    def command(self, model: str | None = None) -> str:
        keeps = " ".join(f"--keep '{k}'" for k in self.keep_args())
        m = f"{model} " if model else ""
        return f"qkit quantize {m}--scheme {self.scheme} {keeps} -o OUT"

    def sentence(self) -> str:
        n = len(self.kept)
        what = {("matrix", True): "this matrix", ("matrix", False): f"these {n} matrices",
                ("layer", True): "this layer", ("layer", False): f"these {n} layers"}[(self.by, n == 1)]
        if n == 0:
            return f"no {self.by} moves the output (whole model at {self.scheme}: {self.kl_all:.4g} nats/token)"
        return (
            f"keeping {what} at {self.keep_scheme} recovers "
            f"{100 * self.recovered:.0f}% of the KL divergence (whole model at {self.scheme}: {self.kl_all:.4g} -> "
            f"{self.kl_mixed:.4g} nats/token) for {100 * self.extra_bytes:.1f}% more bytes; {NO_UNCERTAINTY.format(tokens=self.tokens)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "scheme": self.scheme,
            "keep_scheme": self.keep_scheme,
            "by": self.by,
            "tokens": self.tokens,
            "source": self.source,
            "units": [u.to_dict() for u in self.units],
            "standard_error": None,  # one measurement per unit: see NO_UNCERTAINTY
            "note": NO_UNCERTAINTY.format(tokens=self.tokens),
            "residual_outlier_dims": self.residual_outlier_dims,
            "suggestion": {
                "kept": self.kept,
                "keep": self.keep_args(),
                "kl_all": self.kl_all,
                "kl_mixed": self.kl_mixed,
                "recovered": self.recovered,
                "bytes_all": self.bytes_all,
                "bytes_mixed": self.bytes_mixed,
                "extra_bytes": self.extra_bytes,
                "sentence": self.sentence(),
            },
        }


# --------------------------------------------------------------------------- pieces


def group_units(names: list[str], by: str) -> dict[str, list[str]]:
    """``{unit name: [matrix names]}``: one unit per matrix, or per decoder layer (``model.layers.N``)."""
    if by not in BY:
        raise InputError(f"--by must be one of {', '.join(BY)}, got {by!r}")
    if by == "matrix":
        return {n: [n] for n in names}
    units: dict[str, list[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        units.setdefault(m.group(1) if m else n, []).append(n)
    return units


def mean_kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of ``KL(p_ref || p)``; ``ref_logp`` and ``logits`` ``[T, V]`` (any float)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1, dtype=torch.float64)
    return float(kl.mean())


class _Runner:
    """Forward passes that start at decoder layer ``l``: the input of every layer is recorded once (with the
    keyword arguments the model passes it: position embeddings, mask), so quantizing layer ``l`` re-runs only
    layers ``l..L-1``, the final norm and the head. Layers before ``l`` see unchanged weights and would
    produce the recorded input bit for bit.

    Falls back to full forward passes when the model's structure is not the usual ``model.norm`` +
    output embeddings, or when the partial path does not reproduce the full logits exactly.
    """

    def __init__(self, lm: torch.nn.Module, ids: torch.Tensor, layers: torch.nn.ModuleList):
        self.lm, self.ids, self.layers = lm, ids, layers
        self.calls: list[tuple[tuple, dict]] = []
        self.partial_ok = False

    def record(self):
        def hook(_mod, args, kwargs):
            self.calls.append((args, dict(kwargs)))

        return [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self.layers]

    def full(self) -> torch.Tensor:
        with torch.no_grad():
            return self.lm(self.ids, use_cache=False).logits[0].float()

    def check(self, reference: torch.Tensor) -> None:
        norm = getattr(getattr(self.lm, "model", None), "norm", None)
        head = self.lm.get_output_embeddings()
        if norm is None or head is None or len(self.calls) != len(self.layers):
            return
        self.norm, self.head = norm, head
        try:
            self.partial_ok = torch.equal(self._partial(0), reference)
        except (TypeError, RuntimeError, KeyError, IndexError):
            self.partial_ok = False

    def logits(self, start: int | None = 0) -> torch.Tensor:
        """Logits ``[T, V]`` fp32 with the current weights, re-running layers from ``start`` on."""
        if start is None or not self.partial_ok:
            return self.full()
        return self._partial(start)

    def _partial(self, start: int) -> torch.Tensor:
        args, kwargs = self.calls[start]
        h = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            for j in range(start, len(self.layers)):
                a, kw = self.calls[j]
                kw = {k: v for k, v in kw.items() if k != "hidden_states"}
                out = self.layers[j](h, *a[1:], **kw)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h))[0].float()


def check_tokens(tokens: int) -> None:
    """The same minimum as ``qkit eval``: ``MIN_SCORED`` per-token values (eval's ``--tokens 3`` is 2 scored
    positions, its first token predicting nothing; here every position's distribution is compared)."""
    if tokens < MIN_SCORED:
        raise InputError(f"--tokens must be at least {MIN_SCORED}, got {tokens}: a mean KL over fewer per-token "
                         "values cannot vary at all, so a ranking on it says nothing")


def sensitivity_ids(tokenizer: PreTrainedTokenizerBase | None, *, tokens: int, text: str | None) -> tuple[torch.Tensor, str]:
    """Token ids ``[1, <= tokens]``: ``text``, else the pinned corpus, else the default paragraph."""
    check_tokens(tokens)
    if text is not None:
        return encode(tokenizer, text, tokens, what="--text"), "--text"
    try:
        return encode(tokenizer, corpus_text(), tokens), f"pinned corpus, first {tokens} tokens"
    except InputError:  # no corpus module in this qkit: the fixed paragraph stands in
        return encode(tokenizer, default_prompt("--text"), tokens), "corpora/outliers_prompt.txt"


# --------------------------------------------------------------------------- the analysis


def check_options(
    *,
    scheme: str,
    by: str = "layer",
    tokens: int = DEFAULT_TOKENS,
    keep: str = KEEP_SCHEME,
    suggest: int | None = None,
    threshold: float = OUTLIER_THRESHOLD,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    device: str | None = None,
) -> tuple[Scheme, Scheme]:
    """Every check of ``rank_sensitivity``' options that needs no model; returns (scheme, keep scheme).

    The upper bound of ``suggest`` (the number of units) is checked once the model is loaded.
    """
    s = get_scheme(scheme, scale_dtype)
    k = get_scheme(_KEEP_ALIASES.get(keep.strip().lower(), keep), scale_dtype)
    if by not in BY:
        raise InputError(f"--by must be one of {', '.join(BY)}, got {by!r}")
    check_tokens(tokens)
    if suggest is not None and suggest < 0:
        raise InputError(f"--suggest must be at least 0, got {suggest}")
    if suggest is not None:
        whole(suggest, "--suggest", 0, MAX_COUNT)
    check_threshold(threshold, "channel")
    parse_device(device)
    return s, k


def rank_sensitivity(
    model: str | Path | None = None,
    *,
    scheme: str,
    by: str = "layer",
    tokens: int = DEFAULT_TOKENS,
    text: str | None = None,
    input_ids: torch.Tensor | None = None,
    keep: str = KEEP_SCHEME,
    suggest: int | None = None,
    threshold: float = OUTLIER_THRESHOLD,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    device: str | None = None,
    loaded: LoadedModel | None = None,
    on_start: Callable[[int], None] | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> SensitivityReport:
    """Rank MODEL's layers (``by="layer"``) or matrices (``by="matrix"``) by the KL divergence their
    quantization with ``scheme`` alone causes (formulas: module doc).

    ``input_ids`` ``[1, T]`` overrides ``text`` and the default corpus; ``loaded`` is an already loaded
    ``qkit.models.LoadedModel``; ``suggest`` fixes the number of units the suggestion keeps at ``keep``.
    """
    s, k = check_options(scheme=scheme, by=by, tokens=tokens, keep=keep, suggest=suggest, threshold=threshold,
                         scale_dtype=scale_dtype, device=device if loaded is None else None)
    if loaded is None:
        ref, context = resolve_with_context(model)
        check_context(tokens, context, "--tokens", ref.spec)  # before the model loads
        loaded = load(ref, device=device)
    else:
        check_context(tokens, model_context(loaded.model), "--tokens", loaded.ref.spec)
    if loaded.ref.is_quantized:
        raise InputError(f"{loaded.ref.spec} is already quantized; run sensitivity on the original model")
    lm = loaded.model
    dev = next(lm.parameters()).device
    if input_ids is not None:
        ids, source = input_ids.reshape(1, -1)[:, :tokens], "input_ids"
    else:
        ids, source = sensitivity_ids(loaded.tokenizer, tokens=tokens, text=text)
    ids = ids.to(dev)
    params = model_tensors(lm)  # an expert matrix under its stored name: a view of its fused parameter
    names = [n for n, p in params.items() if is_block_projection(n, tuple(p.shape))]
    if not names:
        raise InputError(f"{loaded.ref.spec} has no block projection matrices (layers.N.*.weight)")
    groups = group_units(names, by)
    if on_start:
        on_start(len(groups) + 2)

    # The reference: logits, residual stream, and the per-channel max |x| entering every projection.
    layers = decoder_layers(lm)
    runner = _Runner(lm, ids, layers)
    hooks = runner.record()
    try:
        with capture(lm, residual=True, linears=[n.removesuffix(".weight") for n in names]) as cap:
            ref_logits = runner.full()
    finally:
        for h in hooks:
            h.remove()
    runner.check(ref_logits)
    ref_logp = torch.log_softmax(ref_logits, dim=-1)
    del ref_logits
    maxima = dim_maxima(torch.stack(cap["residual"]))
    residual_dims = sorted(torch.nonzero(outlier_mask(maxima, threshold).any(dim=0)).flatten().tolist())
    hidden = maxima.shape[-1]
    inputs = cap["inputs"]

    units = []
    for unit_name, members in groups.items():
        u = Unit(unit_name, members)
        saved, num, den = {}, 0.0, 0.0
        for n in members:
            p = params[n]
            w = p.detach()
            qt = quantize_tensor(w, s, name=n)
            w_hat = qt.dequantize(w.dtype)
            num += float(torch.linalg.vector_norm((w - w_hat).float(), dtype=torch.float64)) ** 2
            den += float(torch.linalg.vector_norm(w.float(), dtype=torch.float64)) ** 2
            u.max_over_std = max(u.max_over_std, matrix_stats(w, n).max_over_std)
            u.bytes_scheme += qt.nbytes
            u.bytes_keep += quantize_tensor(w, k, name=n).nbytes
            x = inputs.get(n.removesuffix(".weight"))
            if x is not None and x.numel() == hidden:
                dims = torch.nonzero(x >= threshold * x.median()).flatten().tolist()
                u.input_outlier_dims = sorted(set(u.input_outlier_dims) | set(dims))
            saved[n] = w.clone()
            with torch.no_grad():
                p.copy_(w_hat)
        u.rel_error = math.sqrt(num / den) if den > 0 else 0.0
        u.residual_outlier_dims = [d for d in u.input_outlier_dims if d in set(residual_dims)]
        u.kl = mean_kl(ref_logp, runner.logits(_layer_index(members, len(layers))))
        with torch.no_grad():
            for n, w in saved.items():
                params[n].copy_(w)
        units.append(u)
        if on_unit:
            on_unit(unit_name)
    units.sort(key=lambda u: (-u.kl, u.name))

    report = SensitivityReport(
        model=loaded.ref.spec, scheme=s.name, keep_scheme=k.name, by=by, tokens=int(ids.shape[1]),
        source=source, units=units, residual_outlier_dims=residual_dims,
    )
    n_keep = _suggest_count(units, suggest)
    report.kept = [u.name for u in units[:n_keep]]
    kept = {n for u in units[:n_keep] for n in u.matrices}
    report.bytes_all = sum(u.bytes_scheme for u in units)
    report.bytes_mixed = sum(u.bytes_keep if u.name in report.kept else u.bytes_scheme for u in units)

    # Whole model at ``scheme``, then the mixed model; originals restored at the end.
    saved = {n: params[n].detach().clone() for n in names}

    def apply(which, scheme) -> None:  # quantize the original weights of ``which`` in place
        with torch.no_grad():
            for n in which:
                params[n].copy_(quantize_tensor(saved[n], scheme, name=n).dequantize(saved[n].dtype))

    try:
        apply(names, s)
        report.kl_all = mean_kl(ref_logp, runner.logits(0))
        if on_unit:
            on_unit("all")
        apply(kept, k)
        report.kl_mixed = mean_kl(ref_logp, runner.logits(0))
        if on_unit:
            on_unit("mixed")
    finally:
        with torch.no_grad():
            for n, w in saved.items():
                params[n].copy_(w)
    return report


def _layer_index(members: list[str], n_layers: int) -> int | None:
    """The first decoder layer any of ``members`` lives in (``None``: unknown, run the full model)."""
    found = [re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.", n) for n in members]
    idx = [int(m.group(1)) for m in found if m]
    return min(idx) if len(idx) == len(members) and max(idx) < n_layers else None


def _suggest_count(units: list[Unit], suggest: int | None) -> int:
    if suggest is not None:
        if not 0 <= suggest <= len(units):
            raise InputError(f"--suggest must be between 0 and {len(units)}, got {suggest}")
        return suggest
    total = sum(u.kl for u in units)
    if total <= 0:
        return 0
    cap = max(1, int(len(units) * SUGGEST_MAX_SHARE))
    acc = 0.0
    for i, u in enumerate(units, start=1):
        acc += u.kl
        if acc >= SUGGEST_SHARE * total or i >= cap:
            return i
    return cap
