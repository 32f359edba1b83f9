"""The 32-element block types with an importance matrix: ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` through
llama.cpp's ``quantize_q4_0`` ... ``quantize_q5_1`` with ``quant_weights`` (``quantize_row_*_impl`` row by
row), registered for :class:`qkit.schemes.ggml.GGMLScheme` (``encode(w, quant_weights=qw)``).

Formula (``ggml-quants.c`` at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``): every element of a row gets the
weight ``qw[j] * sqrtf(sigma2 + x[j]**2)``, ``sigma2`` the mean of ``x*x`` over the whole row (summed in
order, divided by ``(float)n_per_row``), and each block's scale is searched: q4_0 / q5_0 take ``d`` and
the codes of ``make_qx_quants(32, 8 / 16, x, L, 1, weight)``; q4_1 / q5_1 take ``d``, ``m = -the_min`` and
the codes of ``make_qkx3_quants(32, 15 / 31, x, weight, .., -0.9, 0.05, 36, false)``. ``d`` and ``m`` are
stored as fp16 (round to nearest even); the codes are the search's, packed as ``quantize_row_*_ref``
packs them (the layouts: :mod:`qkit.schemes.ggml`). q8_0 ignores the matrix (``quantize_q8_0``), as
llama.cpp does.

Exactness: the bytes equal ``ggml_quantize_chunk`` with the matrix bit for bit, on both paths: the torch
oracle :func:`encode_weighted_torch` (the searches of :mod:`qkit.schemes.kquant_search`) and, on CPU, the
compiled kernels (:func:`qkit.schemes.kernels.row_weights`, then the 64-lane searches of
:mod:`qkit.schemes._kernels_lanes` across blocks, 3-9x faster than llama.cpp's C on one thread).
NaN / inf weights are refused (``NonFiniteWeightError``), a ``d`` or ``m`` beyond fp16 too
(``SchemeError``); :meth:`GGMLScheme.encode` refuses a bad importance vector first
(:func:`qkit.schemes.ggml.check_importance`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from qkit.schemes import kernels
from qkit.schemes.ggml import QK, T, register_weighted
from qkit.schemes.ggml_blocks import check_finite, fp16_bytes, fp16_scale, high_bits, pack_low_high, pack_nibbles_or
from qkit.schemes.kquant_search import make_qkx3_quants, make_qx_quants, seq_sum, sqrtf

if TYPE_CHECKING:  # annotations only: the gguf package is imported by qkit.schemes.ggml
    import gguf


def row_weights(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """The weights of the 32-block ``quantize_row_*_impl``: ``qw[j] * sqrtf(sigma2 + x[j]**2)`` fp32
    ``[rows, cols]`` for ``x`` ``[rows, cols]``, ``qw`` ``[cols]``; ``sigma2`` is the row's mean square, its
    ``x*x`` summed in order over the whole row (the C loop) and divided by ``(float)n_per_row``."""
    sq = x * x
    sum_x2 = seq_sum(sq.t().contiguous())
    sigma2 = sum_x2.div_(torch.full_like(sum_x2, float(x.shape[1])))
    return sqrtf(sq.add_(sigma2.unsqueeze(1))).mul_(qw)


_W_NMAX = {T.Q4_0: 8, T.Q5_0: 16, T.Q4_1: 15, T.Q5_1: 31}
_W_SIZE = {T.Q4_0: 18, T.Q5_0: 22, T.Q4_1: 20, T.Q5_1: 24}
_W_ROWS = 2**15  # sub-blocks per pass of the torch code (its [32, S] intermediates stay a few MB)


def encode_weighted_torch(ggml_type: gguf.GGMLQuantizationType, x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """``quantize_row_<type>_impl`` with ``quant_weights`` for every row of ``x`` fp32 ``[rows, cols]``
    (``qw`` fp32 ``[cols]``) -> uint8 ``[rows, cols/32 * type_size]``: the torch oracle. q4_0 / q5_0:
    ``d, L = make_qx_quants(32, nmax, x, L, 1, weight)`` (``nmax`` 8 / 16); q4_1 / q5_1:
    ``d, the_min = make_qkx3_quants(32, nmax, x, weight, L, .., -0.9, 0.05, 36, false)`` (15 / 31),
    ``m = fp16(-the_min)``; the codes are the search's ``L``, packed as ``quantize_row_*_ref`` packs."""
    rows, cols = x.shape
    size, nmax, nb = _W_SIZE[ggml_type], _W_NMAX[ggml_type], cols // QK
    out = torch.empty(rows, nb * size, dtype=torch.uint8, device=x.device)
    if rows == 0:
        return out
    check_finite(x.amax(), x.amin())
    step = max(1, _W_ROWS // max(1, nb))
    for r0 in range(0, rows, step):
        xr = x[r0 : r0 + step]
        xs = xr.reshape(-1, QK).t().contiguous()  # [32, blocks]: element i of block k at [i, k]
        ws = row_weights(xr, qw).reshape(-1, QK).t().contiguous()
        if ggml_type in (T.Q4_0, T.Q5_0):
            d, L = make_qx_quants(xs, nmax, 1, ws)
            the_min = None
        else:
            d, the_min, L = make_qkx3_quants(xs, ws, nmax, -0.9, 0.05, 36, False)
        _write_weighted(ggml_type, out[r0 : r0 + step].view(-1, size), d, the_min, L.t().contiguous().to(torch.uint8), xr)
    return out


def _write_weighted(ggml_type: gguf.GGMLQuantizationType, blocks: torch.Tensor, d: torch.Tensor, the_min: torch.Tensor | None, q: torch.Tensor, peak: torch.Tensor) -> None:
    """Fill ``blocks`` uint8 ``[nb, size]``: ``fp16(d)``, ``fp16(-the_min)`` (q4_1 / q5_1), and the codes
    ``q`` uint8 ``[nb, 32]`` packed (``peak``: the weights, for the refusal message of an fp16 overflow)."""
    head = 2
    if the_min is not None:
        blocks[:, 2:4] = fp16_bytes(fp16_scale(the_min.neg(), "minimum", peak))
        head = 4
    blocks[:, :2] = fp16_bytes(fp16_scale(d, "scale", peak))
    if ggml_type in (T.Q4_0, T.Q4_1):
        pack_nibbles_or(q, blocks[:, head:])
    else:
        high_bits(q, blocks[:, head : head + 4])
        pack_low_high(q, blocks[:, head + 4 :])


def weighted_encoder(ggml_type: gguf.GGMLQuantizationType) -> Any:
    """The importance-weighted encoder of a 32-block type: compiled kernels where
    :func:`qkit.schemes.kernels.available` (the weights row by row, then the search across blocks, 64 at
    a time, the work split over the threads), else :func:`encode_weighted_torch`. The kernels return
    ``d``, ``the_min`` in fp32 and the codes; the fp16 rounding, the refusals and the packing are shared
    with the torch encoder."""
    size, nmax = _W_SIZE[ggml_type], _W_NMAX[ggml_type]

    def run(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        if rows == 0 or not kernels.available(x):
            return encode_weighted_torch(ggml_type, x, qw)
        check_finite(x.amax(), x.amin())
        S, x = rows * cols // QK, x.contiguous()
        with kernels.owning_the_cores():
            w = kernels.row_weights(x, qw)
            if ggml_type in (T.Q4_0, T.Q5_0):
                d, L = kernels.qx_weighted(x.view(S, QK), w.view(S, QK), 0, nmax)
                the_min = None
            else:
                d, the_min, L = kernels.qkx_rows(x.view(S, QK), w.view(S, QK), nmax, -0.9, 0.05, 36, False)
        out = torch.empty(rows, cols // QK * size, dtype=torch.uint8)
        _write_weighted(ggml_type, out.view(-1, size), d, the_min, L, x)
        return out

    run.__name__ = run.__qualname__ = f"encode_{ggml_type.name.lower()}_weighted"
    return run


for _t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):  # q8_0: quantize_q8_0 ignores the importance matrix
    register_weighted(_t, weighted_encoder(_t))
