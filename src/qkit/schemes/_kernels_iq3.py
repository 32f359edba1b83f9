"""The numba kernel of :mod:`qkit.schemes.iquants3` (imported on first use: numba is heavy to import).

``quantize_row_iq3_xxs_impl`` (``grid_size`` 256) and ``quantize_row_iq3_s_impl`` (``block_size`` 32, the
512-point grid) of ``ggml-quants.c``, statement for statement, one super-block of 256 at a time; read
:mod:`qkit.schemes.iquants3` first. Every operation is fp32 in the C order (no fast-math: no FMA
contraction, no reassociation; ggml-base is built without ``-march``), ``nearest_int`` is the C trick
(:func:`qkit.schemes._kernels_search.nearest_int`), the fp16 ``d`` is rounded as ``GGML_FP32_TO_FP16``
(:func:`qkit.schemes._kernels_fp16.fp16_bits`).

The two C functions differ in four places, each marked ``xxs`` below: IQ3_XXS makes the number of
negative weights in each group of 8 even (flipping the least important one, ``weight * x * x``), skips
a block of 32 whose largest magnitude is below ``1e-8`` (IQ3_S: exactly 0), tries ``is = -15..15`` (IQ3_S:
``-9..9``) starting with every group on the grid (IQ3_S: none), and in the second pass redoes only the
groups off the grid (IQ3_S: all). IQ3_S also advances its ``qs`` and ``signs`` pointers only for blocks
it does not skip, so after an all-zero block of 32 the later blocks' indices and signs land one block
early (as llama.cpp writes them; its ``qh`` bits and scales stay in place).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_fp16 import fp16_bits
from qkit.schemes._kernels_search import best_neighbour, nearest_int

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

_F0, _F1, _F2 = np.float32(0.0), np.float32(1.0), np.float32(2.0)
_HALF = np.float32(0.5)
_FIFTEEN = np.float32(15.0)  # 2*kMaxQ - 1
_FIFTH = np.float32(0.2)
_EPS_XXS = np.float32(1e-8)  # GROUP_MAX_EPS_IQ3_XXS
_FUDGE_XXS, _FUDGE_S = np.float32(1.0125), np.float32(1.033)
_THIRTY_ONE = np.float32(31.0)
_QK_K = np.float32(256.0)


@_inline
def _sums(weight, xval, L):
    sumqx = _F0
    sumq2 = _F0
    for i in range(32):
        w = weight[i]
        q = np.float32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@_inline
def _codes(id_, xval, o):
    """``u``, the 3-bit codes ``nearest_int(0.5f*(id*xval-1))`` clamped to 0..7 of the group at ``o``, packed."""
    u = 0
    for i in range(4):
        l = nearest_int(_HALF * (id_ * xval[o + i] - _F1))
        u |= max(0, min(7, l)) << (3 * i)
    return u


@_compiled
def run_iq3(x, qw, cols, xxs, grid, kmap, neigh, lo, hi, out, bad):  # noqa: C901 (one C function, kept whole)
    """Super-blocks ``lo..hi`` of ``x`` (fp32, rows of ``cols`` flattened) into ``out`` (uint8 ``[n, 98 | 110]``).
    ``qw``: the importance of each column (fp32 ``[cols]``) or empty. ``xxs``: IQ3_XXS, else IQ3_S. ``grid``:
    int8 ``[G, 4]`` of ``2l + 1``; ``kmap``, ``neigh``: ``iq3xs_init_impl``'s map and neighbour lists.
    ``bad[b] = 1`` where the C would abort (no neighbour closer than FLT_MAX: weights that overflow)."""
    per_row = cols // 256
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int32)
    Laux = np.zeros(32, np.int32)
    on = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    signs = np.zeros(4, np.int32)
    scales = np.zeros(8, np.float32)
    one = np.empty(1, np.int32)
    weighted = qw.shape[0] > 0
    lo_is, hi_is = (-15, 15) if xxs else (-9, 9)
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
        qpos = 2  # iq3_s: where the next block's grid indices go (advanced for a block not skipped)
        spos = 74  # iq3_s: where its signs go
        for ib in range(8):
            xb = xo + 32 * ib
            for i in range(32):
                v = x[xb + i]
                weight[i] = qw[qo + 32 * ib + i] * np.sqrt(sigma2 + v * v) if weighted else v * v
            for i in range(32):
                waux[i] = np.sqrt(weight[i])
            for k in range(4):
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
                if xxs and nflip % 2:  # xxs: an even number of signs (the 8th is implied by parity)
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
                signs[k] = s & 127 if xxs else s
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            for i in range(32):
                L[i] = 0
            if (mx < _EPS_XXS) if xxs else (mx == _F0):
                scales[ib] = _F0
                continue
            best = _F0
            scale = mx / _FIFTEEN
            for k in range(8):
                on[k] = xxs
            for is_ in range(lo_is, hi_is + 1):
                id_ = (_FIFTEEN + np.float32(is_) * _FIFTH) / mx
                this_scale = _F1 / id_
                for k in range(8):
                    u = 0
                    for i in range(4):
                        l = max(0, min(7, nearest_int(_HALF * (id_ * xval[4 * k + i] - _F1))))
                        Laux[4 * k + i] = l
                        u |= l << (3 * i)
                    on_aux[k] = True
                    if kmap[u] < 0:
                        on_aux[k] = False
                        if best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, 4 * k, this_scale, Laux) < 0:
                            bad[b] = 1
                sumqx, sumq2 = _sums(weight, xval, Laux)
                if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    for i in range(32):
                        L[i] = Laux[i]
                    for k in range(8):
                        on[k] = on_aux[k]
            n_off = 0
            for k in range(8):
                n_off += 0 if on[k] else 1
            if n_off > 0 and scale > _F0:
                id_ = _F1 / scale
                for k in range(8):
                    if xxs and on[k]:  # xxs: only the groups off the grid (iq3_s: every group)
                        continue
                    u = _codes(id_, xval, 4 * k)
                    g = kmap[u]
                    if g < 0:
                        g = best_neighbour(neigh, -g - 1, grid, xval, waux, 4 * k, scale, L)
                        if g < 0:
                            bad[b] = 1
                            g = 0
                    for i in range(4):
                        L[4 * k + i] = (grid[g, i] - 1) // 2
                sumqx, sumq2 = _sums(weight, xval, L)
                if sumq2 > _F0:
                    scale = sumqx / sumq2
            if scale < _F0:  # "should never happen": a positive scale, the signs flipped
                scale = -scale
                for k in range(4):
                    signs[k] = (~signs[k]) & (127 if xxs else 255)
            for k in range(8):
                u = 0
                for i in range(4):
                    u |= L[4 * k + i] << (3 * i)
                g = kmap[u]
                if g < 0:  # the C aborts ("Oops: found point not on grid")
                    bad[b] = 1
                    g = 0
                if xxs:
                    o[2 + 8 * ib + k] = g
                else:
                    o[qpos + k] = g & 255
                    o[66 + ib] |= (g >> 8) << k
            if xxs:
                word = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                for j in range(4):
                    o[66 + 4 * ib + j] = (word >> (8 * j)) & 255
            else:
                qpos += 8
                for k in range(4):
                    o[spos + k] = signs[k]
                spos += 4
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == _F0:
            if xxs:
                o[:] = 0
            continue
        d = max_scale / _THIRTY_ONE
        h = fp16_bits(d * (_FUDGE_XXS if xxs else _FUDGE_S), one)
        o[0] = h & 255
        o[1] = (h >> 8) & 255
        id_ = _F1 / d
        for ib in range(8):
            l = max(0, min(15, nearest_int(_HALF * (id_ * scales[ib] - _F1))))
            if xxs:
                o[66 + 4 * ib + 3] |= l << 4  # bits 28..31 of the block's word
            else:
                o[106 + ib // 2] |= l << (4 * (ib % 2))
