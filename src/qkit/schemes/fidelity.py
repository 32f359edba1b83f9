"""The check every quantized tensor passes before a writer stores it: it must still be its source.

A file that decodes to garbage and exits 0 is the worst thing a quantizer can do: nothing downstream
says so until a user's model talks nonsense. Inputs that pass every check of their own can still do it
(an importance matrix of zeros or of 3e38s, weights below what a scale dtype resolves, a solve fed
overflowed activations), so the written tensor itself is checked against the weight it was made from.

For a finite source ``W`` that is not all zeros, the decoded ``Ŵ`` must be

* finite;
* not all zeros;
* not one constant value, unless ``W`` is one;
* within a relative error ``rel = ||Ŵ - W||_F / ||W||_F < 1``.

Why 1: rounding to the nearest point of a grid that holds 0 moves no weight further than to 0, so
``|ŵ - w| <= |w|`` element by element and ``rel <= 1``, with equality only when every weight rounds to
0. Writing zeros everywhere scores exactly 1, so a tensor at 1 or beyond carries no information about
its source. On the default model's 210 projections every scheme's RTN stays below: int4-tensor, the
coarsest, peaks at 0.985 on one matrix (a scheme that collapses the model is still what was asked for),
q2_k at 0.31, int4-g128 at 0.16, q4_k at 0.05 (``benchmarks/bench_fidelity.py``). A source of all zeros
must decode to zeros.

:func:`check_written` raises ``DegenerateOutputError`` naming the tensor, what its codes decode to and
the likely cause; the caller refuses the whole run before anything is renamed into place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from qkit.errors import DegenerateOutputError
from qkit.schemes.base import as_2d
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.quantized import QuantizedTensor

MAX_RELATIVE_ERROR = 1.0
_CHUNK = 1 << 20  # elements per step of the norms: bounded temporaries however large the tensor


def _pieces(qt: QuantizedTensor, decoded: torch.Tensor | None) -> Iterator[tuple[int, torch.Tensor, bool]]:
    """``(offset, decoded fp32 values, owned)`` over the flattened tensor, in pieces of about ``_CHUNK``
    elements (``owned``: a fresh tensor the caller may overwrite). A llama.cpp block type (rows of whole
    blocks, ``qweight [rows, bytes]``) is decoded a slice of rows at a time, so the check holds no float32
    copy of a large tensor; other schemes are decoded whole."""
    if decoded is None and isinstance(qt.scheme, GGMLScheme):
        rows, cols = as_2d(qt.shape)
        step = max(1, _CHUNK // max(cols, 1))
        for r in range(0, rows, step):
            parts = {"qweight": qt.qweight[r : r + step], "scales": qt.scales}
            yield r * cols, qt.scheme.decode(parts, (min(step, rows - r), cols), torch.float32).reshape(-1), True
        return
    owned = decoded is None
    flat = (qt.dequantize(torch.float32) if owned else decoded).reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        piece = flat[i : i + _CHUNK]
        yield i, (piece if piece.dtype == torch.float32 else piece.float()), owned or piece.dtype != torch.float32


def _sums(source: torch.Tensor, qt: QuantizedTensor, decoded: torch.Tensor | None) -> tuple[float, float, float, float]:
    """``(||W||², ||Ŵ - W||², the decoded values' min, max)``, a piece at a time. Each piece is scaled by a
    power of two that brings its largest magnitude near 1 (exact: only exponents change), so its sums in
    float32 (BLAS dot products, one pass each) neither flush (weights of 1e-30: squares below float32's
    range) nor overflow (3e38); they are scaled back and added up in Python's double. The check compares
    with 1 and reports three digits: float32 partial sums of at most ``_CHUNK`` terms are far finer."""
    s = source.reshape(-1)
    num = den = 0.0
    lo, hi = math.inf, -math.inf
    for i, piece, owned in _pieces(qt, decoded):
        a = s[i : i + piece.numel()].to(device=piece.device, dtype=torch.float32)
        small, big = (float(v) for v in torch.aminmax(piece))
        lo, hi = min(lo, small), max(hi, big)
        if not (math.isfinite(small) and math.isfinite(big)):
            return den, math.inf, lo, hi
        top = max(abs(small), abs(big), float(a.abs().max()))
        if top == 0.0:  # this piece is zeros on both sides
            continue
        # 2^-e with top = m 2^e, 0.5 <= m < 1, applied as two factors: 2^149 (a denormal's) is no float32
        e = -math.frexp(top)[1]
        halves = (math.ldexp(1.0, e // 2), math.ldexp(1.0, e - e // 2))
        diff = piece.sub_(a) if owned else piece - a
        a = a.mul(halves[0]).mul_(halves[1])
        diff.mul_(halves[0]).mul_(halves[1])
        squared = math.ldexp(1.0, 2 * e)  # a double: 2^298 at most
        den += float(torch.dot(a, a)) / squared
        num += float(torch.dot(diff, diff)) / squared
    return den, num, lo, hi


def _generic_cause(source: torch.Tensor, qt: QuantizedTensor) -> str:
    """The cause in words when the caller knows none: weights too small for a free scale dtype (its scales
    would be below the dtype's smallest normal number, 6.1e-5 for fp16), else the scheme itself."""
    amax = float(source.abs().max())
    scheme = qt.scheme
    if not scheme.fixed_scale_dtype and scheme.scale_dtype != torch.float32 and amax < torch.finfo(scheme.scale_dtype).tiny:
        dtype = str(scheme.scale_dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
        return f"its weights (max |w| = {amax:.3g}) are below what {dtype} scales resolve; pass --scale-dtype fp32"
    return (f"{scheme.name} cannot represent this tensor (max |w| = {amax:.3g}); keep it unquantized "
            f"(--exclude) or choose another scheme")


def check_written(name: str, source: torch.Tensor, qt: QuantizedTensor, *, decoded: torch.Tensor | None = None,
                  cause: str | None = None) -> float:
    """The relative error ``||Ŵ - W||_F / ||W||_F`` of ``qt`` (decoded: ``Ŵ``) against ``source`` (``W``, the
    weight it was quantized from, any float dtype and the same number of elements); ``decoded``: ``Ŵ``
    when the caller has it already (a solver's own dequantized weights), else ``qt`` is decoded here in fp32
    (a llama.cpp block type a slice of rows at a time).

    Raises ``DegenerateOutputError`` (one line naming ``name``, what the codes decode to, and ``cause``,
    else a generic one) for a degenerate output (module docstring). A source that is not finite is not
    checked: the quantizer refuses it before (``NonFiniteWeightError``).
    """
    if source.numel() != qt.numel or (decoded is not None and decoded.numel() != qt.numel):
        raise ValueError(f"{name}: a source of {source.numel()} values for a quantized tensor of {qt.numel}")
    den, num, lo, hi = _sums(source, qt, decoded)
    if not math.isfinite(den):  # the quantizer refuses non-finite sources itself
        return 0.0
    what = None
    if not (math.isfinite(num) and math.isfinite(lo) and math.isfinite(hi)):
        what = "decode to NaN or infinite values"
    elif den == 0.0:
        if num == 0.0:
            return 0.0
        what = "decode to non-zero values for a source of zeros"
    elif lo == hi == 0.0:
        what = "decode to all zeros"
    elif lo == hi and float(source.amin()) != float(source.amax()):
        what = f"decode to the one value {lo:.4g} everywhere"
    rel = math.sqrt(num / den) if den > 0 and math.isfinite(num) else math.inf
    if what is None and rel >= MAX_RELATIVE_ERROR:
        what = f"decode with a relative error of {rel:.3g} (>= {MAX_RELATIVE_ERROR:g}: worse than writing zeros)"
    if what is not None:
        raise DegenerateOutputError(f"tensor {name}: its {qt.scheme.name} codes {what}; likely cause: "
                                    f"{cause or _generic_cause(source, qt)}; nothing was written")
    return rel


__all__ = ["MAX_RELATIVE_ERROR", "check_written"]
