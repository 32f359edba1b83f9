"""The numba code of :mod:`qkit.schemes.kquants_low`: ``quantize_row_q2_K_ref`` / ``_impl`` and
``quantize_row_q3_K_ref`` / ``_impl`` (imported on first use: numba is heavy).

Read :mod:`qkit.schemes.kquants_low` first (the formulas and layouts). :func:`run_q2_k` / :func:`run_q3_k`
take a tile of 64 super-blocks at a time: its sub-blocks are searched in 16 groups of 64 lanes (4
super-blocks each) by the lane searches of :mod:`qkit.schemes._kernels_lanes` (the C statements across
64 sub-blocks at once, vectorised), then the second-level searches over each super-block's 16 scales
(``make_qp_quants`` / ``make_qx_quants``) run across the tile's 64 super-blocks the same way, and then
each super-block's scales are quantized, its codes recomputed from the stored values and packed, as
the C's per-super-block loops do. The caller splits the super-blocks over threads in whole tiles
(:func:`qkit.schemes.kernels._split`).

**Exactness.** fp32 in the C's order (every constant ``np.float32``, no fast-math); ``nearest_int`` the
C's bit trick (:func:`qkit.schemes._kernels_lanes.ni`, exact for every input); ``(uint8_t)`` /
``(int8_t)`` stores wrap as the C's do. ``d`` / ``dmin`` are rounded to fp16 here as
``GGML_FP32_TO_FP16`` does (:mod:`qkit.schemes._kernels_fp16`: round to nearest even), because the
C recomputes the codes from the rounded values; their fp32 values are handed back so that the caller
can refuse a scale beyond fp16's range with the torch encoders' message.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_fp16 import fp16_bits, fp16_value
from qkit.schemes._kernels_lanes import LANES, ni, q3_lanes, qkx_lanes, qp_lanes, qx_lanes, scratch

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_QK = 256  # QK_K


# --------------------------------------------------------------------------- tiles of 64 super-blocks


@_inline
def _load_group(x, b0, nt, g, X):
    """The 64 sub-blocks of super-blocks ``b0 + 4g .. b0 + 4g + 3`` (those below ``b0 + nt``; zeros past it)
    into the element-major lanes ``X``: lane ``k`` is sub-block ``k % 16`` of super-block ``4g + k // 16``."""
    for k in range(LANES):
        sb = 4 * g + k // 16
        j = k % 16
        for i in range(16):
            X[i * LANES + k] = x[b0 + sb, 16 * j + i] if sb < nt else _F0


@_inline
def _sigma2(x, b0, nt, factor, sig):
    """``sigma2 = factor*sumx2/QK_K`` (``sumx2`` added in order from 0) for the tile's super-blocks."""
    for s in range(LANES):
        acc = _F0
        if s < nt:
            for j in range(_QK):
                acc += x[b0 + s, j] * x[b0 + s, j]
        sig[s] = factor * acc / np.float32(_QK)


@_inline
def _impl_weights(X, qw, b0, nt, g, sig, W, SW):
    """``weight[l] = qw[l] * sqrtf(sigma2 + x[l]*x[l])`` per lane, and ``sw[j]``, their sum from 0, into the
    second-level lanes ``SW`` (``SW[j * 64 + super-block]``)."""
    nbpr = qw.shape[0]
    for k in range(LANES):
        sb = 4 * g + k // 16
        j = k % 16
        row = (b0 + sb) % nbpr
        s2 = sig[sb]
        acc = _F0
        for i in range(16):
            xv = X[i * LANES + k]
            w = qw[row, 16 * j + i] * np.sqrt(s2 + xv * xv)
            W[i * LANES + k] = w
            acc += w
        SW[j * LANES + sb] = acc


@_inline
def _store_scales(g, V0, V1, SC, MN):
    """A group's scales (and mins) into the second-level lanes ``SC`` / ``MN`` (``[j * 64 + super-block]``)."""
    for k in range(LANES):
        sb = 4 * g + k // 16
        j = k % 16
        SC[j * LANES + sb] = V0[k]
        MN[j * LANES + sb] = V1[k]


@_compiled
def _recode(X, L, g, DD, DM, q3, Lbuf):
    """The C's last pass over a group's 64 sub-blocks, in lanes: with the stored scale ``d = DD`` (and min
    ``m = DM``) of each, ``l = clamp(nearest_int((x + m) / d), 0, 3)`` (q2) or ``clamp(nearest_int(x / d),
    -4, 3) + 4`` (q3), the search's codes ``L`` kept where ``d == 0`` (``if (!d) continue;``); the codes go
    to ``Lbuf[super-block]`` in element order. A function of its own: inlined, LLVM left it scalar."""
    dl, ml = np.empty(LANES, np.float32), np.empty(LANES, np.float32)
    for k in range(LANES):
        c = (k % 16) * LANES + 4 * g + k // 16
        dl[k] = DD[c]
        ml[k] = DM[c]
    lo, hi, off = (np.int32(-4), np.int32(3), np.int32(4)) if q3 else (np.int32(0), np.int32(3), np.int32(0))
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            d = dl[k]
            l = ni(X[b + k] / d) if q3 else ni((X[b + k] + ml[k]) / d)
            l = (lo if l < lo else (hi if l > hi else l)) + off
            L[b + k] = L[b + k] if d == _F0 else l
    for k in range(LANES):
        sb = 4 * g + k // 16
        j = k % 16
        for i in range(16):
            Lbuf[sb, 16 * j + i] = L[i * LANES + k]


@_inline
def _recode_tile(x, b0, nt, X, Lg, DD, DM, q3, Lbuf):
    """:func:`_recode` over the tile's groups that hold a super-block below ``b0 + nt``."""
    for g in range(LANES // 4):
        if 4 * g < nt:
            _load_group(x, b0, nt, g, X)
            _recode(X, Lg[g], g, DD, DM, q3, Lbuf)


@_inline
def _pack_2bit(L, ob, at):
    """``qs[j/4 + l] = L[j + l] | L[j + l + 32] << 2 | L[j + l + 64] << 4 | L[j + l + 96] << 6``,
    ``j = 0, 128``, into ``ob[at:at + 64]``."""
    for h in range(2):
        j = 128 * h
        for t in range(32):
            ob[at + 32 * h + t] = np.uint8(L[j + t] | (L[j + t + 32] << 2) | (L[j + t + 64] << 4) | (L[j + t + 96] << 6))


@_compiled
def run_q2_k(x, qw, impl, lo, hi, out, d_out, m_out):
    """``quantize_row_q2_K_ref`` (``impl`` False) or ``quantize_row_q2_K_impl`` (block ``b`` weighted by
    ``qw[b % len(qw)]``, ``qw`` ``[blocks per row, 256]``) for super-blocks ``lo..hi`` of ``x`` ``[nb, 256]``
    into ``out`` ``[nb, 84]``; the fp32 ``d`` / ``dmin`` before rounding into ``d_out`` / ``m_out``."""
    n = 16 * LANES
    X, W = np.zeros(n, np.float32), np.zeros(n, np.float32)
    Lg = np.zeros((LANES // 4, n), np.int32)  # each group's codes, in lanes
    Ls, Lm = np.zeros(n, np.int32), np.zeros(n, np.int32)
    SC, MN, SW = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    DD, DM = np.zeros(n, np.float32), np.zeros(n, np.float32)
    V, P = scratch(), scratch()
    Lbuf = np.zeros((LANES, _QK), np.int32)
    sig = np.zeros(LANES, np.float32)
    dms, mms = np.zeros(LANES, np.float32), np.zeros(LANES, np.float32)
    one = np.empty(1, np.int32)
    q4scale = np.float32(15.0)
    for b0 in range(lo, hi, LANES):
        nt = min(LANES, hi - b0)
        if impl:
            _sigma2(x, b0, nt, _F1, sig)
        for g in range(LANES // 4):
            _load_group(x, b0, nt, g, X)
            if impl:
                _impl_weights(X, qw, b0, nt, g, sig, W, SW)
                qkx_lanes(X, W, 16, 3, np.float32(-0.9), np.float32(0.05), 36, False, Lg[g], V)
            else:
                for t in range(n):
                    W[t] = abs(X[t])
                qkx_lanes(X, W, 16, 3, np.float32(-0.5), np.float32(0.1), 15, True, Lg[g], V)
            _store_scales(g, V[0], V[1], SC, MN)
        if impl:
            qp_lanes(SC, SW, 16, 15, Ls, P)
            for s in range(LANES):
                dms[s] = P[0][s]
            qp_lanes(MN, SW, 16, 15, Lm, P)
            for s in range(LANES):
                mms[s] = P[0][s]
        for s in range(LANES):  # lanes past the tile's end are computed (their inputs are zeros), never written
            if impl:
                d, dmin = dms[s], mms[s]
                for j in range(16):
                    Ls[j * LANES + s] = (Ls[j * LANES + s] | (Lm[j * LANES + s] << 4)) & 0xFF
            else:  # max_scale / max_min from 0 (as we are deducting the min, scales are always positive)
                max_scale, max_min = _F0, _F0
                for j in range(16):
                    v, m = SC[j * LANES + s], MN[j * LANES + s]
                    max_scale = v if v > max_scale else max_scale
                    max_min = m if m > max_min else max_min
                d, dmin = _F0, _F0
                iscale = q4scale / max_scale
                imin = q4scale / max_min
                for j in range(16):
                    l = ni(iscale * SC[j * LANES + s]) if max_scale > _F0 else 0
                    m = ni(imin * MN[j * LANES + s]) if max_min > _F0 else 0
                    Ls[j * LANES + s] = (l | (m << 4)) & 0xFF  # y.scales[j] = l; y.scales[j] |= (l << 4)
                if max_scale > _F0:
                    d = max_scale / q4scale
                if max_min > _F0:
                    dmin = max_min / q4scale
            hd, hm = fp16_bits(d, one), fp16_bits(dmin, one)
            dv, mv = fp16_value(hd, one), fp16_value(hm, one)
            for j in range(16):
                sc = Ls[j * LANES + s]
                DD[j * LANES + s] = dv * np.float32(sc & 0xF)
                DM[j * LANES + s] = mv * np.float32(sc >> 4)
            if s < nt:
                ob = out[b0 + s]
                for j in range(16):
                    ob[j] = np.uint8(Ls[j * LANES + s])
                ob[80] = np.uint8(hd & 0xFF)
                ob[81] = np.uint8(hd >> 8)
                ob[82] = np.uint8(hm & 0xFF)
                ob[83] = np.uint8(hm >> 8)
                d_out[b0 + s] = d
                m_out[b0 + s] = dmin
        _recode_tile(x, b0, nt, X, Lg, DD, DM, False, Lbuf)
        for s in range(nt):
            _pack_2bit(Lbuf[s], out[b0 + s], 16)


@_inline
def _q3_pack_scale(sb, j, l):
    """The 6-bit scale ``l`` of sub-block ``j`` into the 12 ``scales`` bytes ``sb`` (zeroed before)."""
    if j < 8:
        sb[j] = np.uint8(l & 0xF)
    else:
        sb[j - 8] = np.uint8(sb[j - 8] | ((l & 0xF) << 4))
    sb[8 + j % 4] = np.uint8(sb[8 + j % 4] | ((l >> 4) << (2 * (j // 4))))


@_inline
def _q3_pack_codes(L, ob, hm):
    """Codes ``0..7`` in element order: the high bit of code ``32k + m`` into bit ``k`` of ``hmask[m]``
    (``ob[0:32]``; the C's ``if (L[j] > 3) { hmask[m] |= hm; L[j] -= 4; }``), the low two into ``qs``."""
    for m in range(32):
        hm[m] = 0
    for k in range(8):
        for m in range(32):
            q = L[32 * k + m]
            h = np.int32(q > 3)
            hm[m] |= h << k
            L[32 * k + m] = q - 4 * h
    for m in range(32):
        ob[m] = np.uint8(hm[m])
    _pack_2bit(L, ob, 32)


@_compiled
def run_q3_k(x, qw, impl, lo, hi, out, d_out):
    """``quantize_row_q3_K_ref`` (``impl`` False) or ``quantize_row_q3_K_impl`` (weighted by
    ``qw[b % len(qw)]``) for super-blocks ``lo..hi`` of ``x`` ``[nb, 256]`` into ``out`` ``[nb, 110]``; the
    fp32 ``d`` before rounding into ``d_out``."""
    n = 16 * LANES
    X, W = np.zeros(n, np.float32), np.zeros(n, np.float32)
    Lg = np.zeros((LANES // 4, n), np.int32)
    Ls = np.zeros(n, np.int32)
    SC, MN, SW = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    DD = np.zeros(n, np.float32)
    V = scratch()
    Lbuf = np.zeros((LANES, _QK), np.int32)
    sig = np.zeros(LANES, np.float32)
    hmk = np.zeros(32, np.int32)
    sb12 = np.zeros(12, np.uint8)
    one = np.empty(1, np.int32)
    for b0 in range(lo, hi, LANES):
        nt = min(LANES, hi - b0)
        if impl:
            _sigma2(x, b0, nt, np.float32(2.0), sig)
        for g in range(LANES // 4):
            _load_group(x, b0, nt, g, X)
            if impl:
                _impl_weights(X, qw, b0, nt, g, sig, W, SW)
                qx_lanes(X, W, 16, 4, Lg[g], V)
            else:
                q3_lanes(X, 16, 4, Lg[g], V)
            _store_scales(g, V[0], V[0], SC, MN)
        if impl:
            qx_lanes(SC, SW, 16, 32, Ls, V)
        for s in range(LANES):
            for t in range(12):
                sb12[t] = 0
            d = _F0
            if impl:
                d = V[0][s]
                for j in range(16):
                    _q3_pack_scale(sb12, j, Ls[j * LANES + s])
            else:
                max_scale, amax = _F0, _F0
                for j in range(16):
                    v = SC[j * LANES + s]
                    big = abs(v) > amax
                    amax = abs(v) if big else amax
                    max_scale = v if big else max_scale
                if max_scale != _F0:
                    iscale = np.float32(-32.0) / max_scale
                    for j in range(16):
                        l = ((ni(iscale * SC[j * LANES + s]) + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
                        _q3_pack_scale(sb12, j, (-32 if l < -32 else (31 if l > 31 else l)) + 32)
                    d = _F1 / iscale
            h = fp16_bits(d, one)
            dv = fp16_value(h, one)
            for j in range(16):  # the stored scale, read back as the C does
                sc = (np.int32(sb12[j]) & 0xF) if j < 8 else (np.int32(sb12[j - 8]) >> 4)
                sc = (sc | (((np.int32(sb12[8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
                DD[j * LANES + s] = dv * np.float32(sc)
            if s < nt:
                ob = out[b0 + s]
                for t in range(12):
                    ob[96 + t] = sb12[t]
                ob[108] = np.uint8(h & 0xFF)
                ob[109] = np.uint8(h >> 8)
                d_out[b0 + s] = d
        _recode_tile(x, b0, nt, X, Lg, DD, DD, True, Lbuf)
        for s in range(nt):
            _q3_pack_codes(Lbuf[s], out[b0 + s], hmk)
