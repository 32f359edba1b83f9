"""Per-matrix weight statistics and the relative error each scheme leaves behind.

For a weight ``W`` (any float dtype, read as fp32) and a scheme ``s``, the error is measured on exactly
the transform ``qkit quantize`` writes (``quantize_tensor`` then ``QuantizedTensor.dequantize``)::

    W_hat     = dequantize(quantize_tensor(W, s))           fp32
    rel_error = ||W - W_hat||_F / ||W||_F                   both sums of squares accumulated in float64

(Sums run over blocks of 1024 consecutive terms in fp32, whose relative error is below 1e-6, and the
block totals are accumulated in float64: as accurate as a float64 pass at a fraction of the cost.)

Statistics of one matrix (population moments, float64)::

    mean_abs = mean |w|        std = sqrt(mean (w - mean w)^2)        max_abs = max |w|
    max_over_std  = max_abs / std
    beyond_6sigma = #{ w : |w - mean w| > 6 std }

Everything streams from memory-mapped safetensors: one matrix (and its dequantized copy) in memory at a
time, never a second copy of the model.

Layer 7 (``inspect``). The statistics of one matrix are in ``matrix_stats``; the output-side error of a
calibrated method (``--method gptq``) in ``method_errors``.
"""

from __future__ import annotations

import difflib
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import open_safetensors, tensor_shapes, weight_files
from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.granularity import PerGroup, PerRow, PerTensor
from qkit.inspect.matrix_stats import MatrixStats, int4_tensor_levels, matrix_stats, reconstruct, relative_error, sumsq64
from qkit.models import ModelRef, check_complete, read_config, resolve
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.schemes import DEFAULT_SCHEMES, AbsmaxScheme, NF4Scheme, Scheme, get_scheme, is_fp4
from qkit.transform import is_block_projection

TOP_MATRICES = 10


# --------------------------------------------------------------------------- reading matrices


def _ref_for(model: str | Path | None, ref: ModelRef | None) -> ModelRef:
    ref = ref or resolve(model)
    if ref.is_quantized:
        raise InputError(f"{ref.spec} is a qkit checkpoint; inspect the original model it was made from instead")
    check_complete(ref)  # a missing matrix would silently drop out of every mean
    return ref


def projection_names(directory: Path) -> list[str]:
    """Names of the block projections (the tensors ``qkit quantize`` targets by default), in file order."""
    return [n for n, shape in tensor_shapes(directory) if is_block_projection(n, shape)]


def iter_projections(directory: Path, names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, fp32 tensor)`` for the block projections (or ``names``), one memory-mapped matrix at a time."""
    wanted = None if names is None else set(names)
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                if wanted is None:
                    if not is_block_projection(key, tuple(f.get_slice(key).get_shape())):
                        continue
                elif key not in wanted:
                    continue
                t = f.get_tensor(key)
                yield key, (t if t.dtype == torch.float32 else t.float())


def find_matrix(directory: Path, name: str) -> str:
    """The stored tensor name for ``name`` (``.weight`` optional); a close-match suggestion otherwise."""
    names = [n for n, _ in tensor_shapes(directory)]
    for candidate in (name, f"{name}.weight"):
        if candidate in names:
            return candidate
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "; run `qkit inspect matrix` to list the matrices"
    raise InputError(f"no tensor named {name!r} in {directory}{hint}")


def split_model_and_name(args: Sequence[str]) -> tuple[str | None, str | None]:
    """``[MODEL] [NAME]`` positionals: with one argument it is a MODEL only if it looks like one.

    A tensor name never contains ``/`` and is not an existing path; a model (directory, .gguf, hub id) does
    or is.
    """
    if len(args) > 2:
        raise InputError(f"expected at most MODEL and NAME, got {len(args)} arguments: {' '.join(args)}")
    if len(args) == 2:
        return args[0], args[1]
    if len(args) == 1:
        a = args[0]
        if "/" in a or Path(a).expanduser().exists() or a.endswith(".gguf"):
            return a, None
        return None, a
    return None, None


# --------------------------------------------------------------------------- inspect errors


@dataclass(frozen=True)
class MatrixError:
    name: str
    scheme: str
    shape: tuple[int, ...]
    rel_error: float
    nbytes: int  # stored bytes (codes + scales) under this scheme

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scheme": self.scheme,
            "shape": list(self.shape),
            "rel_error": self.rel_error,
            "parameters": self.numel,
            "bytes": self.nbytes,
        }


@dataclass(frozen=True)
class SchemeSummary:
    scheme: str
    matrices: int
    parameters: int
    bits_per_weight: float
    mean: float
    median: float
    worst: float
    worst_matrix: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ErrorsReport:
    model: str
    schemes: list[str]
    matrices: list[MatrixError] = field(default_factory=list)
    stats: dict[str, MatrixStats] = field(default_factory=dict)
    seconds: float = 0.0

    def for_scheme(self, scheme: str) -> list[MatrixError]:
        return [m for m in self.matrices if m.scheme == scheme]

    def summaries(self) -> list[SchemeSummary]:
        out = []
        for s in self.schemes:
            rows = self.for_scheme(s)
            if not rows:
                continue
            errs = [m.rel_error for m in rows]
            worst = max(rows, key=lambda m: (m.rel_error, m.name))
            params = sum(m.numel for m in rows)
            out.append(
                SchemeSummary(
                    s, len(rows), params, 8 * sum(m.nbytes for m in rows) / params,
                    statistics.fmean(errs), statistics.median(errs), worst.rel_error, worst.name,
                )
            )
        return out

    def granularity_ratios(self) -> list[dict[str, Any]]:
        """Chains coarse -> fine within one bit width: mean error of the coarser / mean error of the finer.

        The 4-bit chain ends with NF4 (blocks of 64 with a normal codebook) after the finest absmax scheme.
        """
        means = {s.scheme: s.mean for s in self.summaries()}
        out = []
        for chain in _chains([get_scheme(s) for s in means]):
            for a, b in zip(chain, chain[1:]):
                if means[b.name] > 0:
                    out.append({"from": a.name, "to": b.name, "factor": means[a.name] / means[b.name]})
        return out

    def ratio_sentence(self) -> str:
        """One line stating the ratios, e.g. "int4: per-row divides the per-tensor mean error by 3.4x; ..."."""
        parts: dict[str, list[str]] = {}
        for r in self.granularity_ratios():
            a, b = get_scheme(r["from"]), get_scheme(r["to"])
            key = f"int{b.bits}"
            words = parts.setdefault(key, [])
            if not words:
                words.append(f"{_granularity_word(b)} divides the {_granularity_word(a)} mean error by {r['factor']:.1f}x")
            else:
                words.append(f"{_granularity_word(b)} by a further {r['factor']:.1f}x")
        fp4 = _fp4_sentence({s.scheme: s.mean for s in self.summaries()})
        return " ".join([f"{k}: {'; '.join(v)}." for k, v in parts.items()] + ([fp4] if fp4 else []))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "schemes": [s.to_dict() for s in self.summaries()],
            "matrices": [
                {**m.to_dict(), "max_over_std": self.stats[m.name].max_over_std} for m in self.matrices
            ],
            "granularity_ratios": self.granularity_ratios(),
            "seconds": self.seconds,
        }


def _granularity_word(s: Scheme) -> str:
    if isinstance(s, NF4Scheme):
        return f"NF4 (blocks of {s.block_size})"
    g = s.granularity
    return "per-tensor" if isinstance(g, PerTensor) else "per-row" if isinstance(g, PerRow) else f"per-group-{g.size}"


def _fineness(s: Scheme) -> tuple[int, int]:
    if isinstance(s, NF4Scheme):
        return (3, 0)
    g = s.granularity
    return (0, 0) if isinstance(g, PerTensor) else (1, 0) if isinstance(g, PerRow) else (2, -g.size)


def _fp4_sentence(means: dict[str, float]) -> str:
    """Where each FP4 scheme's non-uniform grid lands: its mean error against the int4 group of the same
    block size (else the finest int4 absmax scheme present) and NF4, e.g. "fp4: mxfp4 (E2M1 in blocks of 32,
    power-of-two scales) mean error 0.093, between int4-g32's 0.081 and nf4's 0.097."; "" without peers."""
    schemes = {n: get_scheme(n) for n in means}
    int4 = [s for s in schemes.values() if isinstance(s, AbsmaxScheme) and s.bits == 4]
    nf4 = [s for s in schemes.values() if isinstance(s, NF4Scheme)]
    words = []
    for name, s in schemes.items():
        if not is_fp4(s):
            continue
        same = [t for t in int4 if isinstance(t.granularity, PerGroup) and t.granularity.size == s.block_size]
        peers = sorted((means[p.name], p.name) for p in (same or sorted(int4, key=_fineness)[-1:]) + nf4)
        if not peers:
            continue
        scales = "power-of-two scales" if s.to_dict().get("scale_dtype") == "e8m0" else "E4M3 scales and a tensor scale"
        named = " and ".join(f"{p}'s {m:.4g}" for m, p in peers)
        m, lo, hi, both = means[name], peers[0][0], peers[-1][0], " both" if len(peers) > 1 else ""
        where = "between" if both and lo <= m <= hi else f"below{both}" if m < lo else f"above{both}"
        words.append(f"{name} (E2M1 in blocks of {s.block_size}, {scales}) mean error {m:.4g}, {where} {named}")
    return f"fp4: {'; '.join(words)}." if words else ""


def _chains(schemes: list[Scheme]) -> list[list[Scheme]]:
    out = []
    for bits in (8, 4):
        chain = sorted(
            (s for s in schemes if s.bits == bits and (isinstance(s, AbsmaxScheme) or isinstance(s, NF4Scheme) and bits == 4)),
            key=_fineness,
        )
        if len(chain) > 1:
            out.append(chain)
    return out


def check_schemes(schemes: Sequence[str], scale_dtype: str = DEFAULT_SCALE_DTYPE) -> list[Scheme]:
    """The schemes named, or an ``InputError`` (unknown name, bad scale dtype, none at all): before any work."""
    parsed = [get_scheme(s, scale_dtype) for s in schemes]
    if not parsed:
        raise InputError("no scheme given; pass --scheme NAME (repeatable) or omit it for all six")
    return parsed


def check_top(top: int) -> None:
    if top < 1:
        raise InputError(f"--top must be at least 1, got {top}")
    whole(top, "--top", 1, MAX_COUNT)


def weight_errors(
    model: str | Path | None = None,
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    names: Sequence[str] | None = None,
    ref: ModelRef | None = None,
    on_start: Callable[[int], None] | None = None,
    on_matrix: Callable[[str], None] | None = None,
) -> ErrorsReport:
    """Relative error of every block projection (or ``names``) under every scheme (formula: module doc).

    Streams one memory-mapped matrix at a time; peak memory is one matrix, its dequantized copy and a
    float64 copy for the statistics, whatever the model size.
    """
    import time

    t0 = time.perf_counter()
    parsed = check_schemes(schemes, scale_dtype)
    ref = _ref_for(model, ref)
    todo = list(names) if names is not None else projection_names(ref.directory)
    if not todo:
        raise InputError(f"{ref.spec} has no block projection matrices (layers.N.*.weight); pass a decoder LM")
    if on_start:
        on_start(len(todo))
    # A recipe (q4_k_m) chooses each tensor's type from facts of the model (its layer count): bound as
    # ``qkit quantize`` binds it, so the errors are those of the file quantize writes.
    config = read_config(ref.directory)
    parsed = [s.bind(config) for s in parsed]
    report = ErrorsReport(ref.spec, [s.name for s in parsed])
    for name, w in iter_projections(ref.directory, todo if names is not None else None):
        report.stats[name] = matrix_stats(w, name)
        norm_w = math.sqrt(sumsq64(w))
        for s in parsed:
            w_hat, nbytes = reconstruct(w, s, name)
            err = relative_error(w, w_hat, norm_w)
            report.matrices.append(MatrixError(name, s.name, tuple(w.shape), err, nbytes))
            del w_hat
        if on_matrix:
            on_matrix(name)
    report.seconds = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------- inspect matrix


@dataclass
class MatrixReport:
    model: str
    stats: MatrixStats
    errors: dict[str, float]
    int4_tensor: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            **self.stats.to_dict(),
            "rel_error": dict(self.errors),
            "int4_tensor_levels": dict(self.int4_tensor),
        }


def inspect_matrix(
    model: str | Path | None = None,
    *,
    name: str,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    ref: ModelRef | None = None,
) -> MatrixReport:
    """Statistics, per-scheme relative error and int4 per-tensor level usage of one matrix."""
    parsed = check_schemes(schemes, scale_dtype)
    ref = _ref_for(model, ref)
    key = find_matrix(ref.directory, name)
    _, w = next(iter_projections(ref.directory, [key]))
    errors = {s.name: relative_error(w, reconstruct(w, s, key)[0]) for s in parsed}
    levels = int4_tensor_levels(w, get_scheme("int4-tensor", scale_dtype).scale_dtype)
    return MatrixReport(ref.spec, matrix_stats(w, key), errors, levels)


def top_matrices(
    model: str | Path | None = None, *, top: int = TOP_MATRICES, ref: ModelRef | None = None
) -> list[MatrixStats]:
    """The ``top`` block projections by ``max|w| / std`` (ties by name), streamed."""
    check_top(top)
    ref = _ref_for(model, ref)
    stats = [matrix_stats(w, n) for n, w in iter_projections(ref.directory)]
    return sorted(stats, key=lambda s: (-s.max_over_std, s.name))[:top]
