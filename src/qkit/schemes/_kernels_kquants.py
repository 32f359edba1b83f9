"""The numba code of q5_k and of the importance-matrix paths of q4_k / q5_k (imported on first use, as
:mod:`qkit.schemes._kernels_jit`: numba is heavy).

Read :mod:`qkit.schemes.kernels` first (what the kernels compute, why they are exact) and
:mod:`qkit.schemes.kquants` (the formulas and layouts). The sub-block searches run in the 64-lane
searches of :mod:`qkit.schemes._kernels_lanes` (``make_qkx3_quants`` with weights, the weights filled
here, eight super-blocks a tile; q6_k's ``make_qx_quants`` with ``qw`` is ``run_qx`` of
:mod:`qkit.schemes._kernels_rows`); the per-super-block rest of ``quantize_row_q{4,5}_K_impl`` (``make_qp_quants`` of
:mod:`qkit.schemes._kernels_search` on the eight scales and the eight minimums, the packing, the fp16
``d`` / ``dmin`` and the final codes) is scalar, as the C. Every constant is ``np.float32``, every sum
sequential in the C order, no fast-math. ``d`` and ``dmin`` are rounded to fp16 here
(:mod:`qkit.schemes._kernels_fp16`) because the C code recomputes the codes from the rounded values; the
fp32 values are handed back so that the caller can refuse a scale beyond fp16's range with the torch
encoders' message.

numba's on-disk cache keys a compiled function by its own source file only: after editing a module
these kernels call, remove ``__pycache__/*.nbi`` / ``*.nbc``, or the old code stays.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_fp16 import fp16_bits, fp16_value
from qkit.schemes._kernels_lanes import LANES, qkx_lanes, scratch
from qkit.schemes._kernels_search import make_qp_quants, nearest_int

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

_F0 = np.float32(0.0)
_SUPER = LANES // 8  # super-blocks per tile of q4_k / q5_k's 64 sub-blocks of 32


# --------------------------------------------------------------------------- q4_k / q5_k: the _impl paths


@_inline
def _pack_scales(ls, lm, clip, out, b):  # noqa: ANN001
    """``y.scales`` (``out[b, 4:16]``) from the 6-bit codes ``ls`` / ``lm`` (uint8, as the C stores them:
    ``uint8_t`` arithmetic, so a shifted value keeps its low 8 bits), with q5_k's ``MIN(63, .)`` if ``clip``."""
    for j in range(8):
        a = np.int32(ls[j])
        c = np.int32(lm[j])
        if clip:
            a = 63 if a > 63 else a
            c = 63 if c > 63 else c
        if j < 4:
            out[b, 4 + j] = np.uint8(a)
            out[b, 8 + j] = np.uint8(c)
        else:
            out[b, 8 + j] = np.uint8(((a & 0xF) | ((c & 0xF) << 4)) & 0xFF)
            out[b, j] = np.uint8((np.int32(out[b, j]) | ((a >> 4) << 6)) & 0xFF)
            out[b, 4 + j] = np.uint8((np.int32(out[b, 4 + j]) | ((c >> 4) << 6)) & 0xFF)


@_inline
def _scale_min_k4(j, out, b):  # noqa: ANN001
    """``get_scale_min_k4(j, y.scales, &sc, &m)`` on ``out[b, 4:16]``."""
    if j < 4:
        return np.int32(out[b, 4 + j]) & 63, np.int32(out[b, 8 + j]) & 63
    q0, q1, q2 = np.int32(out[b, j]), np.int32(out[b, 4 + j]), np.int32(out[b, 8 + j])
    return (q2 & 0xF) | ((q0 >> 6) << 4), (q2 >> 4) | ((q1 >> 6) << 4)


@_inline
def _pack_k45(L, nmax, out, b):  # noqa: ANN001
    """The codes ``L`` (int32 ``[256]``) into ``qs`` (q4_k: ``out[b, 16:144]``) or ``qh`` + ``qs`` (q5_k:
    ``out[b, 16:48]``, ``out[b, 48:176]``): two sub-blocks of 32 per 32 bytes, low and high nibble; q5_k's
    bit 4 of element ``64n + j`` (``+ 32``) is bit ``2n`` (``2n + 1``) of ``qh[j]``."""
    if nmax == 15:
        for p in range(4):
            for t in range(32):
                out[b, 16 + 32 * p + t] = np.uint8(L[64 * p + t] | (L[64 * p + 32 + t] << 4))
        return
    for t in range(32):
        out[b, 16 + t] = 0
    for p in range(4):
        for t in range(32):
            l1, l2 = L[64 * p + t], L[64 * p + 32 + t]
            h = np.int32(out[b, 16 + t])
            if l1 > 15:
                l1 -= 16
                h |= 1 << (2 * p)
            if l2 > 15:
                l2 -= 16
                h |= 2 << (2 * p)
            out[b, 16 + t] = np.uint8(h)
            out[b, 48 + 32 * p + t] = np.uint8(l1 | (l2 << 4))


@_compiled
def _run_k45_impl(x, qw, first, lo, hi, nmax, out, dm_out):  # noqa: ANN001
    """``quantize_row_q4_K_impl`` (``nmax`` 15) / ``quantize_row_q5_K_impl`` (31) for super-blocks ``lo..hi``
    of ``x`` ``[nb, 256]``; super-block ``s`` is number ``(first + s) % P`` of its row and takes the
    importance ``qw[(first + s) % P]`` (``qw`` ``[P, 256]``, one row's worth). Writes ``out`` ``[nb, 144 or
    176]`` and the fp32 ``d`` / ``dmin`` before rounding into ``dm_out`` ``[nb, 2]``."""
    P = qw.shape[0]
    X = np.zeros(32 * LANES, np.float32)
    W = np.zeros(32 * LANES, np.float32)
    La = np.zeros(32 * LANES, np.int32)
    V = scratch()
    SW = np.empty(LANES, np.float32)
    scales, mins, sw = np.empty(8, np.float32), np.empty(8, np.float32), np.empty(8, np.float32)
    Ls, Lm = np.empty(8, np.uint8), np.empty(8, np.uint8)
    L = np.empty(256, np.int32)
    one = np.empty(1, np.int32)
    for b0 in range(lo, hi, _SUPER):
        t = min(_SUPER, hi - b0)
        for bb in range(t):  # lane 8*bb + j holds sub-block j of super-block b0 + bb, element i at i*LANES
            s = b0 + bb
            sum_x2 = _F0
            for i in range(256):
                sum_x2 += x[s, i] * x[s, i]
            sigma2 = np.float32(2) * sum_x2 / np.float32(256)
            q = (first + s) % P
            for j in range(8):
                k = 8 * bb + j
                sumw = _F0
                for i in range(32):
                    v = x[s, 32 * j + i]
                    w = qw[q, 32 * j + i] * np.sqrt(sigma2 + v * v)
                    X[i * LANES + k] = v
                    W[i * LANES + k] = w
                    sumw += w
                SW[k] = sumw
        for k in range(8 * t, LANES):  # lanes past the last super-block: zeros (max == min, no candidate)
            for i in range(32):
                X[i * LANES + k] = _F0
                W[i * LANES + k] = _F0
        qkx_lanes(X, W, 32, nmax, np.float32(-0.9), np.float32(0.05), 36, False, La, V)  # make_qkx3_quants
        for bb in range(t):
            s = b0 + bb
            for j in range(8):
                scales[j] = V[0][8 * bb + j]
                mins[j] = V[1][8 * bb + j]
                sw[j] = SW[8 * bb + j]
            d_block = make_qp_quants(8, 63, scales, Ls, sw)
            m_block = make_qp_quants(8, 63, mins, Lm, sw)
            dm_out[s, 0] = d_block
            dm_out[s, 1] = m_block
            _pack_scales(Ls, Lm, nmax == 31, out, s)
            dh, mh = fp16_bits(d_block, one), fp16_bits(m_block, one)
            out[s, 0], out[s, 1] = np.uint8(dh & 0xFF), np.uint8(dh >> 8)
            out[s, 2], out[s, 3] = np.uint8(mh & 0xFF), np.uint8(mh >> 8)
            if (dh & 0x7C00) == 0x7C00 or (mh & 0x7C00) == 0x7C00:
                continue  # inf / NaN: the caller refuses the tensor
            d16, m16 = fp16_value(dh, one), fp16_value(mh, one)
            for j in range(8):
                sc, m = _scale_min_k4(j, out, s)
                d = d16 * np.float32(sc)
                k = 8 * bb + j
                if d == _F0:  # if (!d) continue;  make_qkx3_quants' codes stay
                    for i in range(32):
                        L[32 * j + i] = La[i * LANES + k]
                    continue
                dm = m16 * np.float32(m)
                for i in range(32):
                    l = nearest_int((x[s, 32 * j + i] + dm) / d)
                    L[32 * j + i] = 0 if l < 0 else (nmax if l > nmax else l)
            _pack_k45(L, nmax, out, s)


# --------------------------------------------------------------------------- q5_k: the _ref path's last loop


@_compiled
def _run_q5_k_codes(x, L, dd, dm, lo, hi, out):  # noqa: ANN001
    """``quantize_row_q5_K_ref``'s last loops for super-blocks ``lo..hi``: ``l = nearest_int((x + dm) / dd)``
    clamped to 0..31 (the search's codes ``L`` where ``dd == 0``), packed into ``qh`` / ``qs``
    (``out[:, 16:176]`` of ``block_q5_K``)."""
    q = np.empty(256, np.int32)
    for b in range(lo, hi):
        for j in range(8):
            d, m = dd[b, j], dm[b, j]
            for i in range(32):
                e = 32 * j + i
                if d == _F0:
                    q[e] = np.int32(L[b, e])
                else:
                    l = nearest_int((x[b, e] + m) / d)
                    q[e] = 0 if l < 0 else (31 if l > 31 else l)
        _pack_k45(q, 31, out, b)
