"""The row drivers of the 64-lane scale searches of :mod:`qkit.schemes._kernels_lanes`: rows of an
``[S, n]`` array (a sub-block a row) tiled 64 at a time into the lanes' element-major layout, the
weights made or gathered per tile, and the codes and scales stored back. :func:`run_qkx` and
:func:`run_qx` are what :mod:`qkit.schemes.kernels` splits over the threads (q4_k / q5_k / q6_k and
their weighted forms); the other kernel modules tile their own super-blocks and call the lane
searches directly. Imported on first use: numba is heavy.

==============================================  ===============================  =============================
function                                        C                                returns
==============================================  ===============================  =============================
``run_qx(x, w, first, mode, lo, hi, nmax,       ``make_qx_quants(.., 1, qw)``    ``scale``, ``L`` (``l + nmax``)
scale, L)``                                     over rows of ``[S, n]``
``run_qkx(x, w, first, mode, lo, hi, nmax,      ``make_qkx2_quants`` /           ``scale``, ``the_min``, ``L``
rmin, rdelta, nstep, use_mad, scale,            ``make_qkx3_quants`` over rows
the_min, L)``                                   of ``[S, n]``
==============================================  ===============================  =============================

Loading and storing only move values (the lanes past the last row are zero and never stored); the
weights of ``W_REF`` are the C's ``av_x + fabsf(x)`` in its order, in fp32. numba's on-disk cache keys a
compiled function by its own source file only: the lane searches are inlined or compiled into this
module's drivers, so after editing :mod:`qkit.schemes._kernels_lanes` remove the ``__pycache__`` index
files (``*.nbi`` / ``*.nbc``), or they keep the old code.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_lanes import LANES, qkx_lanes, qx_lanes, scratch

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

_F0 = np.float32(0.0)


W_GIVEN, W_SQUARE, W_REF = 0, 1, 2  # the weights of run_qx / run_qkx: see _load_weights


@_inline
def _load_rows(x, s0, t, n, X):
    """Rows ``s0..s0+t`` of ``x`` ``[S, n]`` into the element-major lanes ``X`` (lanes past ``t`` zero)."""
    for k in range(LANES):
        for i in range(n):
            X[i * LANES + k] = x[s0 + k, i] if k < t else _F0


@_inline
def _load_weights(X, w, first, mode, s0, t, n, W, acc):
    """The weights of the tile ``X`` into ``W``: ``W_GIVEN``, row ``(first + s) % P`` of ``w`` ``[P, n]`` for
    sub-block ``s`` (0 past ``t``); ``W_SQUARE``, ``x*x`` (``make_qx_quants``' weights for ``qw == NULL``);
    ``W_REF``, ``av_x + |x|`` with ``av_x = sqrtf(sum x*x / n)`` (``quantize_row_q4_K_ref`` /
    ``quantize_row_q5_K_ref``). ``acc``: a scratch lane row."""
    if mode == W_SQUARE:
        for i in range(n * LANES):
            W[i] = X[i] * X[i]
    elif mode == W_REF:
        for k in range(LANES):
            acc[k] = _F0
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                acc[k] += X[b + k] * X[b + k]
        for k in range(LANES):
            acc[k] = np.sqrt(acc[k] / np.float32(n))
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                W[b + k] = acc[k] + abs(X[b + k])
    else:
        P = w.shape[0]
        for k in range(LANES):
            q = (first + s0 + k) % P
            for i in range(n):
                W[i * LANES + k] = w[q, i] if k < t else _F0


@_inline
def _tile_buffers(n):
    """One tile's element-major lanes (values and weights fp32, codes int32, ``[n * 64]`` each) and the
    lane searches' scratch rows."""
    return np.zeros(n * LANES, np.float32), np.zeros(n * LANES, np.float32), np.zeros(n * LANES, np.int32), scratch()


@_inline
def _load_tile(x, w, first, mode, s0, t, n, X, W, acc):
    """Rows ``s0..s0+t`` of ``x`` into ``X`` and their weights into ``W`` (:func:`_load_rows`, then
    :func:`_load_weights`)."""
    _load_rows(x, s0, t, n, X)
    _load_weights(X, w, first, mode, s0, t, n, W, acc)


@_inline
def _store_codes(La, s0, t, n, L):
    """The lanes' codes ``La`` back into rows ``s0..s0+t`` of ``L`` ``[S, n]`` (uint8)."""
    for k in range(t):
        for i in range(n):
            L[s0 + k, i] = np.uint8(La[i * LANES + k])


@_compiled
def run_qx(x, w, first, mode, lo, hi, nmax, scale, L):
    """``make_qx_quants(n, nmax, x, L, 1, qw)`` on rows ``lo..hi`` of ``x`` fp32 ``[S, n]`` (a sub-block a row),
    the weights as :func:`_load_weights` (``w`` fp32 ``[P, n]``; any 2-D fp32 array for ``W_SQUARE``):
    ``scale`` fp32 ``[S]``, ``L`` uint8 ``[S, n]`` the stored codes ``l + nmax`` (0 for an all-zero row)."""
    n = x.shape[1]
    X, W, La, S = _tile_buffers(n)
    for s0 in range(lo, hi, LANES):
        t = min(LANES, hi - s0)
        _load_tile(x, w, first, mode, s0, t, n, X, W, S[17])
        qx_lanes(X, W, n, nmax, La, S)
        for k in range(t):
            scale[s0 + k] = S[0][k]
        _store_codes(La, s0, t, n, L)


@_compiled
def run_qkx(x, w, first, mode, lo, hi, nmax, rmin, rdelta, nstep, use_mad, scale, the_min, L):
    """``make_qkx2_quants`` / ``make_qkx3_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad)`` on rows ``lo..hi`` of ``x`` fp32 ``[S, n]``, the weights as :func:`_load_weights`:
    ``scale``, ``the_min`` fp32 ``[S]``, ``L`` uint8 ``[S, n]``."""
    n = x.shape[1]
    X, W, La, S = _tile_buffers(n)
    for s0 in range(lo, hi, LANES):
        t = min(LANES, hi - s0)
        _load_tile(x, w, first, mode, s0, t, n, X, W, S[17])
        qkx_lanes(X, W, n, nmax, rmin, rdelta, nstep, use_mad, La, S)
        for k in range(t):
            scale[s0 + k] = S[0][k]
            the_min[s0 + k] = S[1][k]
        _store_codes(La, s0, t, n, L)
