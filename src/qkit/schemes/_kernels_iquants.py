"""The numba kernel of :mod:`qkit.schemes.iquants` (imported on first use: numba is heavy to import).

Read :mod:`qkit.schemes.iquants` first: what ``quantize_row_iq4_nl_impl`` computes and why the torch code
is exact. This is the same C, statement for statement, one (super-)block at a time, with two changes
that give the same result faster:

**best_index_int8 without a search.** The C function returns, for ``x`` between grid values ``v[m] <=
x < v[m+1]``, ``m`` if ``x - v[m] < v[m+1] - x`` (fp32) else ``m + 1``; that is the number of midpoints
``(v[k] + v[k+1]) / 2`` (integers or half-integers, exact in fp32) at or below ``x``: the fp32
subtractions never flip the comparison (near a midpoint they are exact). Checked for every fp32 value,
both signs, inf and NaN (which the C sends to 15) included; ``tests/test_iquants.py`` repeats it near
every midpoint and on random values. The grid value itself is ``v[0]`` plus the steps
``v[k+1] - v[k]`` of the midpoints passed (small integers: the sum is exact), which is branch-free.

**The 16 candidate scales side by side.** Each candidate's ``sumqx`` / ``sumq2`` is its own sequence of
additions over ``j = 0..31`` in the C order; the loop over the candidates is the inner one, so LLVM
runs them as vector lanes instead of one dependent chain at a time. The choice among them (the first
pass, then ``itry = -7..7``, strictly better wins) stays sequential, as in the C.

No fast-math: no FMA contraction, no reassociation, IEEE division and square root; constants are fp32.
"""

from __future__ import annotations

import numpy as np
from numba import njit

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
MIDPOINTS = ((KVALUES[:-1].astype(np.float64) + KVALUES[1:]) / 2).astype(np.float32)  # exact: halves
STEPS = KVALUES[1:] - KVALUES[:-1]
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: nearest_int's constant
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_NTRY = 7  # quantize_iq4_nl / quantize_iq4_xs pass ntry = 7, with or without an importance matrix

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")


@_inline
def _best_index(x):
    """``best_index_int8(16, kvalues_iq4nl, x)``: the midpoints at or below ``x``; 15 for NaN."""
    if np.isnan(x):
        return 15
    n = 0
    for k in range(15):
        n += 1 if x >= MIDPOINTS[k] else 0
    return n


@_inline
def _search(x, o, weight, iscale, sqx, sq2):
    """``sumqx``, ``sumq2`` of the 32 elements ``x[o:o+32]`` for each of the 16 inverse scales ``iscale``
    (the first pass, then ``itry = -7..7``) into ``sqx``, ``sq2``: per candidate in the C order (``w*q*x``
    is ``(w*q)*x``, added for ``j = 0..31``). ``q = kvalues[best_index(iscale * x)]`` for the finite
    products the search makes."""
    for c in range(16):
        sqx[c] = _F0
        sq2[c] = _F0
    for j in range(32):
        xj = x[o + j]
        wj = weight[j]
        for c in range(16):
            a = iscale[c] * xj
            q = KVALUES[0]
            for k in range(15):
                q += STEPS[k] if a >= MIDPOINTS[k] else _F0
            wq = wj * q
            sqx[c] += wq * xj
            sq2[c] += wq * q


@_compiled
def _run_iq4(x, qw, per_row, sbs, lo, hi, out, dout, bad):
    """``quantize_row_iq4_nl_impl(sbs, 32, ..., ntry=7)`` for the super-blocks ``lo..hi`` of ``x`` (fp32,
    flat, super-block ``s`` at ``s * sbs``). ``qw``: the importance of each column of a row (fp32
    ``[per_row * sbs]``; super-block ``s`` reads ``qw[(s % per_row) * sbs ...]``), or empty for the path
    without one (weights ``x*x``). Writes the block bytes after the fp16 ``d`` into ``out`` (uint8
    ``[n, size]``: iq4_nl ``qs`` at 2, iq4_xs ``scales_h`` at 2, ``scales_l`` at 4, ``qs`` at 8), the fp32
    value whose fp16 is ``d`` into ``dout`` (the caller converts it), and ``bad[s] = 1`` where a
    sub-block scale is not finite (weights near fp32's limit; the caller refuses them)."""
    nsub = sbs // 32
    has_qw = qw.shape[0] > 0
    weight = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    L = np.empty(256, np.uint8)
    iscale = np.empty(16, np.float32)
    sqx = np.empty(16, np.float32)
    sq2 = np.empty(16, np.float32)
    for s in range(lo, hi):
        base = s * sbs
        qbase = (s % per_row) * sbs if has_qw else 0
        sigma2 = _F0
        if has_qw:
            for j in range(sbs):
                sigma2 += x[base + j] * x[base + j]
            sigma2 *= _F2 / np.float32(sbs)
        max_scale = _F0
        amax_scale = _F0
        flag = 0
        for ib in range(nsub):
            o = base + 32 * ib
            if has_qw:
                for j in range(32):
                    xj = x[o + j]
                    weight[j] = qw[qbase + 32 * ib + j] * np.sqrt(sigma2 + xj * xj)
            else:
                for j in range(32):
                    weight[j] = x[o + j] * x[o + j]
            amax = _F0
            mx = _F0
            for j in range(32):
                ax = abs(x[o + j])
                if ax > amax:
                    amax = ax
                    mx = x[o + j]
            if amax < _EPS:
                scales[ib] = _F0
                continue
            d = -mx / KVALUES[0]
            iscale[0] = _F1 / d
            for t in range(2 * _NTRY + 1):
                iscale[1 + t] = np.float32(t - _NTRY - 127) / mx
            _search(x, o, weight, iscale, sqx, sq2)
            sumqx, sumq2 = sqx[0], sq2[0]
            d = sumqx / sumq2 if sumq2 > _F0 else _F0
            best = d * sumqx
            for c in range(1, 2 * _NTRY + 2):
                sumqx, sumq2 = sqx[c], sq2[c]
                if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                    d = sumqx / sumq2
                    best = d * sumqx
            scales[ib] = d
            if not np.isfinite(d):
                flag = 1
            abs_d = abs(d)
            if abs_d > amax_scale:
                amax_scale = abs_d
                max_scale = d
        bad[s] = flag
        if nsub > 1:  # iq4_xs: 6-bit sub-block scales, then the codes again with the rounded scales
            d = -max_scale / np.float32(32)
            dout[s] = d
            idd = _F1 / d if d != _F0 else _F0
            sh = 0
            for ib in range(nsub):
                v = (idd * scales[ib] + _MAGIC) - _MAGIC  # nearest_int: |v| <= 32 here
                l = np.int64(v) if flag == 0 else 0
                l = max(-32, min(31, l))
                dl = d * np.float32(l)
                idl = _F1 / dl if dl != _F0 else _F0
                o = base + 32 * ib
                for j in range(32):
                    L[32 * ib + j] = _best_index(idl * x[o + j])
                l += 32
                if ib % 2 == 0:
                    out[s, 4 + ib // 2] = np.uint8(l & 0xF)
                else:
                    out[s, 4 + ib // 2] |= np.uint8((l & 0xF) << 4)
                sh |= (l >> 4) << (2 * ib)
            out[s, 2] = np.uint8(sh & 0xFF)
            out[s, 3] = np.uint8(sh >> 8)
            qs = 8
        else:  # iq4_nl: the codes again with the chosen (fp32) scale
            dout[s] = scales[0]
            ids = _F1 / scales[0] if scales[0] != _F0 else _F0
            for j in range(32):
                L[j] = _best_index(ids * x[base + j])
            qs = 2
        for i in range(nsub):
            for j in range(16):
                out[s, qs + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


@_compiled
def best_index_many(x, out):
    """``out[i] = best_index_int8(x[i])`` as the kernel computes it (the tests compare it with the C rule)."""
    for i in range(x.shape[0]):
        out[i] = _best_index(x[i])
