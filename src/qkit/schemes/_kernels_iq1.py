"""The numba kernel of :mod:`qkit.schemes.iquants1` (imported on first use: numba is heavy to import).

``quantize_row_iq1_s_impl`` and ``quantize_row_iq1_m_impl`` of ``ggml-quants.c``, statement for statement,
one super-block of 256 at a time; read :mod:`qkit.schemes.iquants1` first. Every operation is fp32 in the C
order (no fast-math), ``nearest_int`` is the C trick, the fp16 values are rounded as ``GGML_FP32_TO_FP16``.

Both sort a block's weights (``qsort`` with ``iq1_sort_helper``: glibc's ``qsort`` below 2.37 is a merge
sort, so equal weights keep their order; here a stable insertion sort) and try every split of the sorted
weights into the levels ``-1, 0, 1`` shifted by ``+-IQ1S_DELTA`` (0.125), keeping the one of the largest
``sumqx**2 / sumq2``. A group of 8 whose levels are not on the grid takes the nearest of its neighbours
(``iq1_find_best_neighbour2``, nwant 3). They differ where marked:

* **s**: blocks of 32, one shift per block, an importance matrix required, ``GROUP_MAX_EPS_IQ1_S`` (1e-12),
  ``d = max_scale / 15 * 1.125`` in fp16, 3-bit block scales with the shift's sign in ``qh`` bit 15.
* **m**: blocks of 16 with a shift per half (four combinations, searched over prefix sums kept per half),
  weights ``x**2`` without a matrix, ``GROUP_MAX_EPS_IQ1_M`` (1e-7); the super-block scale is refitted over
  every block's decoded values and stored, times 1.1125, as fp16 bits spread over the top nibbles of the
  four scale words.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_fp16 import fp16_bits
from qkit.schemes._kernels_search import nearest_int

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

_F0, _F1, _F2 = np.float32(0.0), np.float32(1.0), np.float32(2.0)
_HALF = np.float32(0.5)
_DELTA = np.float32(0.125)  # IQ1S_DELTA, IQ1M_DELTA
_EPS_S, _EPS_M = np.float32(1e-12), np.float32(1e-7)
_FLT_MAX = np.float32(3.4028234663852886e38)
_FIFTEEN = np.float32(15.0)
_FUDGE_S, _FUDGE_M = np.float32(1.125), np.float32(1.1125)
_QK_K = np.float32(256.0)


@_inline
def _sort(xb, order, n):
    """``order[:n]``: the indices of ``xb[:n]`` sorted ascending, equal values in their order (stable)."""
    for j in range(n):
        order[j] = j
    for j in range(1, n):
        k = order[j]
        v = xb[k]
        i = j - 1
        while i >= 0 and v < xb[order[i]]:
            order[i + 1] = order[i]
            i -= 1
        order[i + 1] = k


@_inline
def _best_neighbour(neigh, at, grid, xb, weight, o, scale, xx, L):
    """``iq1_find_best_neighbour2`` over the neighbour list at ``neigh[at]`` for the group ``xb[o:o+8]``
    (signed), levels ``xx``; writes ``L[o:o+8]``, returns the grid index (-1: none closer than FLT_MAX,
    where the C's fallback loop reads out of bounds and then aborts)."""
    best = _FLT_MAX
    index = -1
    for j in range(1, neigh[at] + 1):
        g = neigh[at + j]
        d2 = _F0
        for i in range(8):
            q = xx[(grid[g, i] - 1) // 2]
            w = weight[o + i]
            diff = scale * q - xb[o + i]
            d2 += w * diff * diff
        if d2 < best:
            best = d2
            index = g
    if index >= 0:
        for i in range(8):
            L[o + i] = (grid[index, i] - 1) // 2
    return index


@_inline
def _levels(xx, shift, x_p, x_m):
    if shift:
        for i in range(3):
            xx[i] = x_p[i]
    else:
        for i in range(3):
            xx[i] = x_m[i]


@_compiled
def run_iq1(x, qw, cols, m, grid, kmap, neigh, lo, hi, out, bad):  # noqa: C901 (two C functions, kept whole)
    """Super-blocks ``lo..hi`` of ``x`` (fp32, rows of ``cols`` flattened) into ``out`` (uint8 ``[n, 50 | 56]``).
    ``qw``: the importance of each column (fp32 ``[cols]``) or empty (``m`` only). ``m``: IQ1_M, else IQ1_S.
    ``grid``, ``kmap``, ``neigh``: ``iq2xs_init_impl``'s for the 2048-point grid. ``bad[b] = 1`` where the C aborts."""
    per_row = cols // 256
    bs = 16 if m else 32
    nblk = 256 // bs
    weight = np.empty(32, np.float32)
    xb = np.empty(32, np.float32)
    order = np.empty(32, np.int64)
    sumx = np.empty(33, np.float32)
    sumw = np.empty(33, np.float32)
    px = np.empty((2, 17), np.float32)
    pw = np.empty((2, 17), np.float32)
    L = np.zeros(32, np.int32)
    index = np.zeros(4, np.int64)
    scales = np.zeros(16, np.float32)
    shifts = np.zeros(16, np.int64)
    xx = np.empty(3, np.float32)
    x_p = np.array([-_F1 + _DELTA, _DELTA, _F1 + _DELTA], np.float32)
    x_m = np.array([-_F1 - _DELTA, -_DELTA, _F1 - _DELTA], np.float32)
    sqx = np.empty(4, np.float32)
    sq2 = np.empty(4, np.float32)
    one = np.empty(1, np.int32)
    sc = np.zeros(4, np.int64)
    weighted = qw.shape[0] > 0
    eps = _EPS_M if m else _EPS_S
    for b in range(lo, hi):
        xo = b * 256
        qo = (b % per_row) * 256
        o = out[b]
        o[:] = 0
        sumx2 = _F0
        for i in range(256):
            sumx2 += x[xo + i] * x[xo + i]
        sigma2 = _F2 * sumx2 / _QK_K
        max_scale = _F0
        for ib in range(nblk):
            for i in range(bs):
                xb[i] = x[xo + bs * ib + i]
                weight[i] = qw[qo + bs * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i]) if weighted else xb[i] * xb[i]
            mx = abs(xb[0])
            for i in range(1, bs):
                mx = mx if mx > abs(xb[i]) else abs(xb[i])
            if mx < eps:
                scales[ib] = _F0
                shifts[ib] = 0 if m else 1
                continue
            _sort(xb, order, bs)
            best = -_FLT_MAX
            scale = mx
            b1, b2, bk = -1, -1, -1  # bk: s: 1 (x_p) / 0 (x_m); m: the combination 0..3
            if not m:
                sumx[0] = _F0
                sumw[0] = _F0
                for j in range(bs):
                    i = order[j]
                    sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                    sumw[j + 1] = sumw[j] + weight[i]
                for i1 in range(bs + 1):
                    for i2 in range(i1, bs + 1):
                        a, c, e = sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[bs] - sumx[i2]
                        wa, wc, we = sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[bs] - sumw[i2]
                        for k in range(2):
                            v0, v1, v2 = (x_p[0], x_p[1], x_p[2]) if k == 0 else (x_m[0], x_m[1], x_m[2])
                            sumqx = a * v0 + c * v1 + e * v2
                            sumq2 = wa * v0 * v0 + wc * v1 * v1 + we * v2 * v2
                            if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                                scale = sumqx / sumq2
                                best = scale * sumqx
                                b1, b2, bk = i1, i2, 1 - k
            else:
                for h in range(2):
                    px[h, 0] = _F0
                    pw[h, 0] = _F0
                for j in range(bs):
                    i = order[j]
                    h = 0 if i < bs // 2 else 1
                    px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                p2, m2 = x_p[2], x_m[2]
                cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1]
                cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2]
                cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1]
                cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2]
                for i1 in range(bs + 1):
                    for i2 in range(i1, bs + 1):
                        sx0 = px[0, i1] + px[0, i2]
                        sx1 = px[1, i1] + px[1, i2]
                        qxp0, qxm0 = px[0, bs] * p2 - sx0, px[0, bs] * m2 - sx0
                        qxp1, qxm1 = px[1, bs] * p2 - sx1, px[1, bs] * m2 - sx1
                        q2p0 = pw[0, bs] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                        q2m0 = pw[0, bs] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                        q2p1 = pw[1, bs] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                        q2m1 = pw[1, bs] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                        sqx[0], sqx[1], sqx[2], sqx[3] = qxp0 + qxp1, qxp0 + qxm1, qxm0 + qxp1, qxm0 + qxm1
                        sq2[0], sq2[1], sq2[2], sq2[3] = q2p0 + q2p1, q2p0 + q2m1, q2m0 + q2p1, q2m0 + q2m1
                        for k in range(4):
                            if sq2[k] > _F0 and sqx[k] * sqx[k] > best * sq2[k]:
                                scale = sqx[k] / sq2[k]
                                best = scale * sqx[k]
                                b1, b2, bk = i1, i2, k
            if b1 < 0 or b2 < 0 or bk < 0:
                scales[ib] = _F0
                shifts[ib] = 0 if m else 1
                continue
            for j in range(bs):
                L[order[j]] = 0 if j < b1 else (1 if j < b2 else 2)
            if scale < _F0:
                for j in range(bs):
                    L[j] = 2 - L[j]
                scale = -scale
                bk = 3 - bk if m else 1 - bk
            on = True
            for k in range(bs // 8):
                _levels(xx, (bk < 2 if k == 0 else bk % 2 == 0) if m else bk == 1, x_p, x_m)
                u = 0
                for j in range(8):
                    u |= L[8 * k + j] << (2 * j)
                g = kmap[u]
                if g < 0:
                    on = False
                    g = _best_neighbour(neigh, -g - 1, grid, xb, weight, 8 * k, scale, xx, L)
                    if g < 0:
                        bad[b] = 1
                        g = 0
                index[k] = g
            if not on:
                sumqx = _F0
                sumq2 = _F0
                for k in range(bs // 8):
                    _levels(xx, (bk < 2 if k == 0 else bk % 2 == 0) if m else bk == 1, x_p, x_m)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[(grid[index[k], j] - 1) // 2]
                        sumqx += w * q * xb[8 * k + j]
                        sumq2 += w * q * q
                if sumqx > _F0 and sumq2 > _F0:
                    scale = sumqx / sumq2
            if m:
                o[2 * ib] = index[0] & 255
                o[2 * ib + 1] = index[1] & 255
                o[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            else:
                h = 0
                for k in range(4):
                    o[2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                o[34 + 2 * ib] = h & 255
                o[35 + 2 * ib] = h >> 8
            scales[ib] = scale
            shifts[ib] = bk if m else (1 if bk == 1 else -1)
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _F0:
            continue
        d = max_scale / _FIFTEEN
        id_ = _F1 / d
        if not m:
            h16 = fp16_bits(d * _FUDGE_S, one)
            o[0] = h16 & 255
            o[1] = h16 >> 8
            for ib in range(nblk):
                l = max(0, min(7, nearest_int(_HALF * (id_ * scales[ib] - _F1))))
                if shifts[ib] == -1:
                    l |= 8
                o[35 + 2 * ib] |= l << 4  # bits 12..15 of qh[ib]
            continue
        sumqx = _F0
        sumq2 = _F0
        sc[:] = 0
        for ib in range(nblk):
            l = max(0, min(7, nearest_int(_HALF * (id_ * scales[ib] - _F1))))
            sc[ib // 4] |= l << (3 * (ib % 4))
            o[32 + ib] |= (0x00, 0x80, 0x08, 0x88)[shifts[ib]]
            for i in range(bs):
                xb[i] = x[xo + bs * ib + i]
                weight[i] = qw[qo + bs * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i]) if weighted else xb[i] * xb[i]
            for k in range(2):
                _levels(xx, shifts[ib] < 2 if k == 0 else shifts[ib] % 2 == 0, x_p, x_m)
                g = o[2 * ib + k] + ((np.int64(o[32 + ib]) << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[(grid[g, j] - 1) // 2] * np.float32(2 * l + 1)
                    sumqx += w * q * xb[8 * k + j]
                    sumq2 += w * q * q
        if sumq2 > _F0:
            d = sumqx / sumq2
        s = fp16_bits(d * _FUDGE_M, one)
        sc[0] |= (s & 0x000F) << 12
        sc[1] |= (s & 0x00F0) << 8
        sc[2] |= (s & 0x0F00) << 4
        sc[3] |= s & 0xF000
        for j in range(4):
            o[48 + 2 * j] = sc[j] & 255
            o[49 + 2 * j] = (sc[j] >> 8) & 255
