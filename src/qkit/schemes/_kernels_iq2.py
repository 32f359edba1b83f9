"""The numba kernel of :mod:`qkit.schemes.iquants2` (imported on first use: numba is heavy to import).

``quantize_row_iq2_xxs_impl``, ``quantize_row_iq2_xs_impl`` and ``quantize_row_iq2_s_impl`` of
``ggml-quants.c``, statement for statement, one super-block of 256 at a time; read
:mod:`qkit.schemes.iquants2` first. Every operation is fp32 in the C order (no fast-math: no FMA
contraction, no reassociation), ``nearest_int`` and ``make_qp_quants`` are the C ones
(:mod:`qkit.schemes._kernels_search`), the fp16 ``d`` is rounded as ``GGML_FP32_TO_FP16``.

The three C functions share one search over groups of 8 weights; they differ where marked:

* **xxs**: blocks of 32 (four groups), ``sigma2 = mean x**2``, the start scale from
  ``make_qp_quants(32, 4, ...)`` and ``is = -6..6`` around ``eff_max = 3 * scale``, no on-grid tracking (the
  second pass redoes every group), 7-bit signs (an even count; the 8th is their parity).
* **xs**: blocks of 16 (two groups), ``sigma2 = mean x**2``, ``is = -9..9`` around the block's maximum, the
  second pass only for groups off the grid, 7-bit signs.
* **s**: as xs, but ``sigma2 = 2 mean x**2``, weights ``0.25 sigma2 + x**2`` without an importance matrix
  (xxs and xs assert one), all 8 signs stored, ``GROUP_MAX_EPS_IQ2_S`` (1e-8, not 1e-15), ``d`` times 0.9875.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_fp16 import fp16_bits
from qkit.schemes._kernels_search import best_neighbour, make_qp_quants, nearest_int

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

XXS, XS, S = 0, 1, 2  # the ``kind`` argument of run_iq2
_F0, _F1 = np.float32(0.0), np.float32(1.0)
_HALF, _QUARTER = np.float32(0.5), np.float32(0.25)
_TENTH = np.float32(0.1)
_FIVE = np.float32(5.0)  # 2*kMaxQ - 1
_THREE = np.float32(3.0)  # kMaxQ
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_EPS_S = np.float32(1e-8)  # GROUP_MAX_EPS_IQ2_S
_FUDGE_S = np.float32(0.9875)
_THIRTY_ONE = np.float32(31.0)
_QK_K = np.float32(256.0)


@_inline
def _code(id_, xval, o, L):
    """``u``: the 2-bit codes ``nearest_int(0.5f*(id*xval-1))`` clamped to 0..2 of the group at ``o``, packed
    (also written to ``L[o:o+8]``)."""
    u = 0
    for i in range(8):
        l = max(0, min(2, nearest_int(_HALF * (id_ * xval[o + i] - _F1))))
        L[o + i] = l
        u |= l << (2 * i)
    return u


@_inline
def _sums(weight, xval, L, bs):
    sumqx = _F0
    sumq2 = _F0
    for i in range(bs):
        w = weight[i]
        q = np.float32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@_compiled
def run_iq2(x, qw, cols, kind, grid, kmap, neigh, lo, hi, out, bad):  # noqa: C901 (three C functions, kept whole)
    """Super-blocks ``lo..hi`` of ``x`` (fp32, rows of ``cols`` flattened) into ``out`` (uint8 ``[n, 66 | 74 |
    82]``). ``qw``: the importance of each column (fp32 ``[cols]``) or empty (``s`` only). ``kind``: ``XXS``,
    ``XS`` or ``S``. ``grid``: int8 ``[G, 8]`` of ``2l + 1``; ``kmap``, ``neigh``: ``iq2xs_init_impl``'s map and
    neighbour lists. ``bad[b] = 1`` where the C would abort (no neighbour closer than FLT_MAX)."""
    per_row = cols // 256
    bs = 32 if kind == XXS else 16  # weights per block with one scale
    ng = bs // 8  # groups of 8 per block
    nblk = 256 // bs
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int32)
    Laux = np.zeros(32, np.int32)
    Lqp = np.zeros(32, np.uint8)
    on = np.zeros(4, np.bool_)
    on_aux = np.zeros(4, np.bool_)
    signs = np.zeros(4, np.int32)
    scales = np.zeros(16, np.float32)
    one = np.empty(1, np.int32)
    weighted = qw.shape[0] > 0
    eps = _EPS_S if kind == S else _EPS
    lo_is, hi_is = (-6, 6) if kind == XXS else (-9, 9)
    for b in range(lo, hi):
        xo = b * 256
        qo = (b % per_row) * 256
        o = out[b]
        o[:] = 0
        sumx2 = _F0
        for i in range(256):
            sumx2 += x[xo + i] * x[xo + i]
        sigma2 = (np.float32(2.0) * sumx2 if kind == S else sumx2) / _QK_K
        max_scale = _F0
        for ib in range(nblk):
            xb = xo + bs * ib
            for i in range(bs):
                v = x[xb + i]
                weight[i] = qw[qo + bs * ib + i] * np.sqrt(sigma2 + v * v) if weighted else _QUARTER * sigma2 + v * v
            for i in range(bs):
                waux[i] = np.sqrt(weight[i])
            for k in range(ng):
                nflip = 0
                s = 0
                for i in range(8):
                    v = x[xb + 8 * k + i]
                    if v >= _F0:
                        xval[8 * k + i] = v
                    else:
                        xval[8 * k + i] = -v
                        nflip += 1
                        s |= 1 << i
                if kind != S and nflip % 2:  # xxs, xs: an even number of signs (the 8th is implied by parity)
                    imin = 0
                    v = x[xb + 8 * k]
                    least = weight[8 * k] * v * v
                    for i in range(1, 8):
                        v = x[xb + 8 * k + i]
                        ax = weight[8 * k + i] * v * v
                        if ax < least:
                            least = ax
                            imin = i
                    xval[8 * k + imin] = -xval[8 * k + imin]
                    s ^= 1 << imin
                signs[k] = s if kind == S else s & 127
            mx = xval[0]
            for i in range(1, bs):
                mx = mx if mx > xval[i] else xval[i]
            for i in range(bs):
                L[i] = 0
            if mx < eps:
                scales[ib] = _F0
                continue
            best = _F0
            if kind == XXS:
                scale = make_qp_quants(32, 4, xval, Lqp, weight)
                top = scale * _THREE  # eff_max
                if top <= _F0:
                    scales[ib] = _F0
                    continue
            else:
                scale = mx / _FIVE
                top = mx
            for k in range(ng):
                on[k] = True
            for is_ in range(lo_is, hi_is + 1):
                id_ = (_FIVE + np.float32(is_) * _TENTH) / top
                this_scale = _F1 / id_
                for k in range(ng):
                    u = _code(id_, xval, 8 * k, Laux)
                    on_aux[k] = True
                    if kmap[u] < 0:
                        on_aux[k] = False
                        if best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, 8 * k, this_scale, Laux) < 0:
                            bad[b] = 1
                sumqx, sumq2 = _sums(weight, xval, Laux, bs)
                if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    for i in range(bs):
                        L[i] = Laux[i]
                    for k in range(ng):
                        on[k] = on_aux[k]
            n_off = 0
            for k in range(ng):
                n_off += 0 if on[k] else 1
            if scale > _F0 and (kind == XXS or n_off > 0):  # xxs: every group again (xs, s: those off the grid)
                id_ = _F1 / scale
                for k in range(ng):
                    if kind != XXS and on[k]:
                        continue
                    u = _code(id_, xval, 8 * k, L)
                    if kmap[u] < 0:
                        if best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, 8 * k, scale, L) < 0:
                            bad[b] = 1
                sumqx, sumq2 = _sums(weight, xval, L, bs)
                if sumq2 > _F0:
                    scale = sumqx / sumq2
            if scale < _F0:  # "should never happen": a positive scale, the signs flipped
                scale = -scale
                for k in range(ng):
                    signs[k] = (~signs[k]) & (255 if kind == S else 127)
            for k in range(ng):
                u = 0
                for i in range(8):
                    u |= L[8 * k + i] << (2 * i)
                g = kmap[u]
                if g < 0:  # the C aborts ("Oops: found point not on grid")
                    bad[b] = 1
                    g = 0
                if kind == XXS:
                    o[2 + 8 * ib + k] = g  # byte k of q2[2*ib]
                    sg = signs[k] << (7 * k)  # q2[2*ib+1] |= signs << 7k
                    for j in range(4):
                        o[6 + 8 * ib + j] |= (sg >> (8 * j)) & 255
                elif kind == XS:
                    word = g | (signs[k] << 9)
                    o[2 + 4 * ib + 2 * k] = word & 255
                    o[3 + 4 * ib + 2 * k] = (word >> 8) & 255
                else:
                    i8 = 2 * ib + k
                    o[2 + i8] = g & 255
                    o[66 + i8 // 4] |= (g >> 8) << (2 * (i8 % 4))
                    o[34 + i8] = signs[k]
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _F0:
            if kind != S:
                o[:] = 0  # memset(qs, 0): the blocks' codes and signs of a super-block with no scale
            continue
        d = max_scale / _THIRTY_ONE
        h = fp16_bits(d * _FUDGE_S if kind == S else d, one)
        o[0] = h & 255
        o[1] = (h >> 8) & 255
        id_ = _F1 / d
        for ib in range(nblk):
            l = max(0, min(15, nearest_int(_HALF * (id_ * scales[ib] - _F1))))
            if kind == XXS:
                o[9 + 8 * ib] |= l << 4  # bits 28..31 of q2[2*ib+1]
            else:
                o[(66 if kind == XS else 74) + ib // 2] |= l << (4 * (ib % 2))
