"""llama.cpp's scale searches in numba: straight scalar ports of the ``static`` helpers of ``ggml-quants.c``
(at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``), and the bounded ones again across sub-blocks for speed.
Imported on first use (numba costs ~0.2 s to import), as :mod:`qkit.schemes._kernels_jit`.

**Scalar ports**, one sub-block per call, callable from other ``@njit`` code (fp32 1-D views; ``L`` is
written as the C writes it):

==============================================================================  =====================================
function                                                                        returns
==============================================================================  =====================================
``nearest_int(f)``                                                              int32: the ``+ 12582912.f`` bit trick
``make_qx_quants(n, nmax, x, L, rmse_type, qw, has_qw)``, ``L`` int8             float32 scale
``make_q3_quants(n, nmax, x, L, do_rmse)``, ``L`` int8                           float32 scale
``make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad)``  ``(scale, the_min)``, ``L`` uint8
``make_qkx3_quants(n, nmax, x, weights, has_weights, L, Laux, rmin, rdelta,      ``(scale, the_min)``, ``L`` uint8
nstep, use_mad)``
``make_qp_quants(n, nmax, x, L, quant_weights)``, ``L`` uint8                   float32 scale
==============================================================================  =====================================

``the_min`` is the C ``*the_min``, i.e. ``-min`` (``>= 0``): ``x ~ scale * L - the_min``. ``qw`` /
``weights`` are used only when ``has_qw`` / ``has_weights`` (the C ``NULL`` test; pass any fp32 array
otherwise). ``rmin`` and ``rdelta`` are rounded to fp32 here, as the C ``float`` parameters are.

**Across sub-blocks** (``make_qx_quants`` with weights and ``make_qkx2/3_quants``: the searches of the
importance-matrix paths): :func:`qx_tile` / :func:`qkx_tile` run the same statements on 64 sub-blocks at
once, element-major, so each C statement is a loop over the lanes that LLVM vectorises without
reordering anything (4-9x faster than the C); :func:`run_qx`, :func:`run_qkx` drive them over rows
``lo..hi`` of ``[S, n]`` arrays, :func:`qx_rows`, :func:`qkx_rows` over torch tensors with the threads
of :func:`qkit.schemes.kernels._split`. :func:`row_weights` is the 32-block types' ``qw[j] *
sqrtf(sigma2 + x[j]**2)``.

**Exactness.** Every statement is the C one in its order and association, in fp32: each ``int`` that
C converts to ``float`` is converted with ``np.float32`` (numba would otherwise promote to float64),
sums are sequential, divisions IEEE, no fast-math (no FMA contraction: ggml-base is built without
``-march``). ``nearest_int`` is the bit trick itself: ``(bits(f + 12582912.f) & 0x7fffff) - 0x400000``;
for ``|f| <= 4194303`` that is ``(f + 12582912.f) - 12582912.f`` (round half to even), and outside
(``assert`` is compiled out in a release build) the mantissa bits are read with ``frexp``: ``inf`` gives
``-4194304``, a NaN (only the default NaN ``0xffc00000`` arises, from ``inf * 0``) gives 0. The lane
kernels see only bounded arguments and use the ``(f + M) - M`` form, with an overflowed inverse scale
replaced by 0 (code 0, as the trick gives once clamped). The ``(int8_t)`` / ``(uint8_t)`` stores of ``L``
wrap, as numba's integer stores do. ``MAX`` / ``MIN`` are ``a > b ? a : b`` / ``a < b ? a : b``.
``tests/test_ggml_weighted.py`` compares the scalar ports with the C functions themselves (cut out of
the pinned source and compiled alone), and the lane kernels with the torch searches.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from qkit.schemes import kernels

_jit = njit(nogil=True, cache=True, error_model="numpy")

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_TENTH = np.float32(0.1)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
_FAST = np.float32(4194303.0)  # nearest_int's assert bound: there the trick is (f + M) - M
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS


@_jit
def _mantissa_bits(v):  # numba
    """The 23 mantissa bits of the fp32 ``v`` (``bits & 0x7fffff``), without reinterpreting memory."""
    if np.isnan(v):
        return np.int32(0x400000)  # the default NaN, 0xffc00000 (a NaN here only comes from inf * 0)
    a = abs(np.float64(v))
    if a == np.inf or a == 0.0:
        return np.int32(0)
    if a < 2.0**-126:  # subnormal: the field is the value in units of 2**-149
        return np.int32(a * 2.0**149)
    m, _ = math.frexp(a)  # a = m * 2**e, m in [0.5, 1): the field is (2m - 1) * 2**23, exact in fp64
    return np.int32(m * 2.0**24) - np.int32(0x800000)


@_jit
def nearest_int(f):
    """C ``nearest_int``: ``f + 12582912.f`` reinterpreted, ``(bits & 0x7fffff) - 0x400000`` (int32)."""
    val = np.float32(f) + _MAGIC
    if abs(f) <= _FAST:
        return np.int32(val - _MAGIC)  # val in [2**23, 2**24): an integer, so exact
    return _mantissa_bits(val) - np.int32(0x400000)


@_jit
def _imax(a, b):  # MAX(a, b)
    return a if a > b else b


@_jit
def _imin(a, b):  # MIN(a, b)
    return a if a < b else b


@_jit
def _qx_weight(xi, rmse_type, qw, i, has_qw):
    """``qw ? qw[i] : rmse_type == 1 ? x*x : rmse_type == 2 ? 1 : rmse_type == 3 ? fabsf(x) : sqrtf(fabsf(x))``."""
    if has_qw:
        return qw[i]
    if rmse_type == 1:
        return xi * xi
    if rmse_type == 2:
        return _F1
    if rmse_type == 3:
        return abs(xi)
    return np.sqrt(abs(xi))


@_jit
def make_qx_quants(n, nmax, x, L, rmse_type, qw, has_qw):
    """``make_qx_quants``: symmetric codes ``L = l + nmax`` (int8, ``l`` in ``-nmax..nmax-1``), 18 more
    inverse scales ``-(nmax + 0.1*is) / max`` tried for the weighted ``sum w*x*l`` fit; returns the scale
    (``x ~ scale * l``)."""
    mx = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:  # all zero
        for i in range(n):
            L[i] = 0
        return _F0
    fn = np.float32(nmax)
    iscale = np.float32(-nmax) / mx
    if rmse_type == 0:
        for i in range(n):
            l = nearest_int(iscale * x[i])
            L[i] = nmax + _imax(-nmax, _imin(nmax - 1, l))
        return _F1 / iscale
    return_early = False
    if rmse_type < 0:
        rmse_type = -rmse_type
        return_early = True
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = _imax(-nmax, _imin(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = _qx_weight(x[i], rmse_type, qw, i, has_qw)
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != _F0 else _F0
    if return_early:
        return _HALF * (scale + _F1 / iscale) if suml2 > _F0 else _F1 / iscale
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(fn + _TENTH * np.float32(is_)) / mx
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            l = _imax(-nmax, _imin(nmax - 1, nearest_int(iscale * x[i])))
            w = _qx_weight(x[i], rmse_type, qw, i, has_qw)
            fl = np.float32(l)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > _F0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + _imax(-nmax, _imin(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_jit
def make_q3_quants(n, nmax, x, L, do_rmse):
    """``make_q3_quants``: codes from ``-nmax / max``, then (``do_rmse``) up to 5 rounds of coordinate
    descent on the ``x*x``-weighted fit. ``L`` (int8) ends as ``l + nmax``, except 0 for an all-zero
    sub-block; returns the scale."""
    mx = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:  # all zero
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = np.float32(-nmax) / mx
    if do_rmse:
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            l = _imax(-nmax, _imin(nmax - 1, nearest_int(iscale * x[i])))
            L[i] = l
            w = x[i] * x[i]
            fl = np.float32(l)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        for _itry in range(5):
            n_changed = 0
            for i in range(n):
                w = x[i] * x[i]
                Li = np.float32(L[i])
                slx = sumlx - w * x[i] * Li
                if slx > _F0:
                    sl2 = suml2 - w * Li * Li
                    new_l = _imax(-nmax, _imin(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                    if new_l != L[i]:
                        fl = np.float32(new_l)
                        slx += w * x[i] * fl
                        sl2 += w * fl * fl
                        if sl2 > _F0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[i] = new_l
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
            if n_changed == 0:
                break
        for i in range(n):
            L[i] += nmax
        return sumlx / suml2 if suml2 > _F0 else _F0
    for i in range(n):
        L[i] = _imax(-nmax, _imin(nmax - 1, nearest_int(iscale * x[i]))) + nmax
    return _F1 / iscale


@_jit
def _qkx(n, nmax, x, weights, has_weights, L, Laux, rmin, rdelta, nstep, use_mad, strict):
    """The body shared by make_qkx2_quants (``strict``: early return when ``max == min``) and
    make_qkx3_quants (``max <= min``; ``weights`` may be ``NULL``: then ``x*x``)."""
    rmin = np.float32(rmin)
    rdelta = np.float32(rdelta)
    mn = x[0]
    mx = x[0]
    sum_w = weights[0] if has_weights else x[0] * x[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i] if has_weights else x[i] * x[i]
        sum_w += w
        sum_x += w * x[i]
    if mn > _F0:
        mn = _F0
    if (mx == mn) if strict else (mx <= mn):
        for i in range(n):
            L[i] = 0
        return _F0, -mn
    fn = np.float32(nmax)
    iscale = fn / (mx - mn)
    scale = _F1 / iscale
    best_error = _F0
    for i in range(n):
        L[i] = _imax(0, _imin(nmax, nearest_int(iscale * (x[i] - mn))))
        diff = scale * np.float32(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        w = weights[i] if has_weights else x[i] * x[i]
        best_error += w * diff
    if nstep < 1:
        return scale, -mn
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(is_) + fn) / (mx - mn)
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            l = _imax(0, _imin(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            w = weights[i] if has_weights else x[i] * x[i]
            fl = np.float32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F0:
                this_min = _F0
                this_scale = sum_xl / sum_l2
            cur_error = _F0
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                w = weights[i] if has_weights else x[i] * x[i]
                cur_error += w * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@_jit
def make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """``make_qkx2_quants``: ``x ~ scale * L - the_min`` (``L`` uint8 in ``0..nmax``), the weighted
    least-squares fit over the inverse scales ``(rmin + rdelta*is + nmax) / (max - min)``, ``is = 0..nstep``
    (squared error, or absolute with ``use_mad``). Returns ``(scale, the_min)``."""
    return _qkx(n, nmax, x, weights, True, L, Laux, rmin, rdelta, nstep, use_mad, True)


@_jit
def make_qkx3_quants(n, nmax, x, weights, has_weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """``make_qkx3_quants``: as :func:`make_qkx2_quants`, with ``x*x`` weights when ``not has_weights``
    and the early return for ``max <= min``. Returns ``(scale, the_min)``."""
    return _qkx(n, nmax, x, weights, has_weights, L, Laux, rmin, rdelta, nstep, use_mad, False)


@_jit
def make_qp_quants(n, nmax, x, L, quant_weights):
    """``make_qp_quants``: non-negative codes ``L`` (uint8, ``<= nmax``) for non-negative ``x`` (the
    scales and mins of q2_k / q3_k), 8 more inverse scales ``(0.1*is + nmax) / max`` tried on the
    weighted squared error, then up to 5 rounds of coordinate descent. Returns the scale."""
    mx = _F0
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < _EPS:  # all zero
        for i in range(n):
            L[i] = 0
        return _F0
    fn = np.float32(nmax)
    iscale = fn / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i])
    scale = _F1 / iscale
    best_mse = _F0
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        w = quant_weights[i]
        best_mse += w * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (_TENTH * np.float32(is_) + fn) / mx
        scale_is = _F1 / iscale_is
        mse = _F0
        for i in range(n):
            l = _imin(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * np.float32(l)
            w = quant_weights[i]
            mse += w * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = _imin(nmax, nearest_int(iscale * x[i]))
        L[i] = l
        w = quant_weights[i]
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _itry in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            Li = np.float32(L[i])
            slx = sumlx - w * x[i] * Li
            sl2 = suml2 - w * Li * Li
            if slx > _F0 and sl2 > _F0:
                new_l = _imin(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fl = np.float32(new_l)
                    slx += w * x[i] * fl
                    sl2 += w * fl * fl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > _F0 else _F0


# --------------------------------------------------------------------------- the searches across sub-blocks
#
# The same statements, run on LANES sub-blocks at once: a tile is element-major (element i of lane k at
# i * LANES + k), so every C statement becomes a loop over the lanes that LLVM vectorises without
# reordering anything (each lane adds its own terms in the C order). The codes of these bounded searches
# are (v + 12582912.f) - 12582912.f clamped (nearest_int for |v| <= 4194303); an inverse scale that
# overflows (max - min below ~4e-38) is replaced by 0 first: code 0, as nearest_int gives for inf / NaN
# once clamped to 0..nmax.

LANES = 64
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")
_ROUND_BOUND = np.float32(4.0e6)  # under nearest_int's exact range 4194303, with room for the bound's rounding


@_inline
def _rc(v, lo, hi):
    v = (v + _MAGIC) - _MAGIC
    v = lo if v < lo else v
    return hi if v > hi else v


@_jit
def qx_tile(X, W, La, V, n, nmax):
    """``make_qx_quants(n, nmax, x, L, 1, W)`` on LANES sub-blocks (``X``, ``W`` element-major tiles).
    Out: ``V[2]`` the scales, ``La`` the stored codes ``l + nmax`` (fp32; 0 for an all-zero lane)."""
    amax, mx, scale, best, isc, best_is, sumlx, suml2 = V[0], V[1], V[2], V[3], V[4], V[5], V[6], V[7]
    lo, hi = np.float32(-nmax), np.float32(nmax - 1)
    fn = np.float32(nmax)
    for k in range(LANES):
        amax[k] = _F0
        mx[k] = _F0
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            ax = abs(x)
            big = ax > amax[k]
            amax[k] = ax if big else amax[k]
            mx[k] = x if big else mx[k]
    for si in range(-10, 10):
        if si == 0:
            continue
        c = -fn if si == -10 else -(fn + _TENTH * np.float32(si))
        for k in range(LANES):
            v = c / mx[k]
            isc[k] = v if np.isfinite(v) else _F0
            sumlx[k] = _F0
            suml2[k] = _F0
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                v = _rc(isc[k] * x, lo, hi)
                w = W[b + k]
                sumlx[k] += w * x * v
                suml2[k] += w * v * v
        if si == -10:
            for k in range(LANES):
                scale[k] = sumlx[k] / suml2[k] if suml2[k] != _F0 else _F0
                best[k] = scale[k] * sumlx[k]
                best_is[k] = isc[k]
        else:
            for k in range(LANES):
                if suml2[k] > _F0 and sumlx[k] * sumlx[k] > best[k] * suml2[k]:
                    scale[k] = sumlx[k] / suml2[k]
                    best[k] = scale[k] * sumlx[k]
                    best_is[k] = isc[k]
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            v = _rc(best_is[k] * X[b + k], lo, hi)
            La[b + k] = (v + fn) if amax[k] >= _EPS else _F0
    for k in range(LANES):
        if amax[k] < _EPS:
            scale[k] = _F0


@_inline
def _qkx_sums(X, W, iscale, shift, hi, S):
    """Codes of one candidate and their sums ``sum w*l``, ``sum w*l*l``, ``sum w*l*x`` (C order)."""
    for k in range(3 * LANES):
        S[k] = _F0
    for i in range(X.shape[0] // LANES):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            v = _rc(iscale[k] * (x - shift[k]), _F0, hi)
            wl = W[b + k] * v
            S[k] += wl
            S[LANES + k] += wl * v
            S[2 * LANES + k] += wl * x


@_inline
def _qkx_error(X, W, iscale, shift, hi, a, m, E, use_mad):
    """``sum w * (a*l + m - x)**2`` (``use_mad``: ``|.|``) per lane, the codes recomputed from ``iscale``/``shift``."""
    for k in range(LANES):
        E[k] = _F0
    for i in range(X.shape[0] // LANES):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            v = _rc(iscale[k] * (x - shift[k]), _F0, hi)
            d = a[k] * v + m[k] - x
            E[k] += W[b + k] * (abs(d) if use_mad else d * d)


@_jit
def qkx_tile(X, W, La, V, n, nmax, steps, use_mad):
    """``make_qkx2_quants`` / ``make_qkx3_quants(n, nmax, x, W, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad)`` on LANES sub-blocks; ``steps`` fp32: the numerators ``rmin + rdelta*is + nmax`` (empty for
    ``nstep < 1``). Out: ``V[5]`` scale, ``V[0]`` min (the_min = -min), ``La`` the codes, ``V[17]`` 1 for
    a lane whose codes left nearest_int's exact range (to be redone by the scalar port). A lane with
    ``max == min`` gets scale ``1/inf = 0``, codes 0 and no candidate (``D = 0``): the early return."""
    hi = np.float32(nmax)
    mn, mx, sum_w, sum_x, isc, scale = V[0], V[1], V[2], V[3], V[4], V[5]
    best_is, best_sh, best_err, ts, tm, ce, dd = V[6], V[7], V[8], V[9], V[10], V[11], V[12]
    S = V[13:16].ravel()
    lo, flag = V[16], V[17]
    for k in range(LANES):
        x0, w0 = X[k], W[k]
        mn[k] = x0
        mx[k] = x0
        sum_w[k] = w0
        sum_x[k] = w0 * x0
    for i in range(1, n):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            mn[k] = x if x < mn[k] else mn[k]
            mx[k] = x if x > mx[k] else mx[k]
        for k in range(LANES):
            sum_w[k] += W[b + k]
            sum_x[k] += W[b + k] * X[b + k]
    for k in range(LANES):
        lo[k] = mn[k]
        flag[k] = _F0
        if mn[k] > _F0:
            mn[k] = _F0
        v = hi / (mx[k] - mn[k])
        scale[k] = _F1 / v
        v = v if np.isfinite(v) else _F0
        isc[k] = v
        best_is[k] = v
        best_sh[k] = mn[k]
    _qkx_error(X, W, isc, mn, hi, scale, mn, best_err, use_mad)
    for c in steps:
        for k in range(LANES):
            v = c / (mx[k] - mn[k])
            v = v if np.isfinite(v) else _F0
            isc[k] = v
            # after a fitted min, |v * (x - min)| can pass nearest_int's exact range: the caller redoes the lane
            reach = abs(v) * max(abs(mx[k] - mn[k]), abs(lo[k] - mn[k]))
            flag[k] = _F1 if reach > _ROUND_BOUND else flag[k]
        _qkx_sums(X, W, isc, mn, hi, S)
        for k in range(LANES):
            sl, sl2, sxl = S[k], S[LANES + k], S[2 * LANES + k]
            D = sum_w[k] * sl2 - sl * sl
            a = (sum_w[k] * sxl - sum_x[k] * sl) / D
            m = (sl2 * sum_x[k] - sl * sxl) / D
            if m > _F0:
                m = _F0
                a = sxl / sl2
            ts[k] = a
            tm[k] = m
            dd[k] = D
        _qkx_error(X, W, isc, mn, hi, ts, tm, ce, use_mad)
        for k in range(LANES):
            if dd[k] > _F0 and ce[k] < best_err[k]:
                best_err[k] = ce[k]
                scale[k] = ts[k]
                best_is[k] = isc[k]
                best_sh[k] = mn[k]
                mn[k] = tm[k]
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            La[b + k] = _rc(best_is[k] * (X[b + k] - best_sh[k]), _F0, hi)


@_inline
def _load(src, s0, t, n, dst):
    """Rows ``s0..s0+t`` of ``src`` ``[S, n]`` into the element-major tile ``dst`` (lanes past ``t`` zero)."""
    for k in range(LANES):
        for i in range(n):
            dst[i * LANES + k] = src[s0 + k, i] if k < t else _F0


@_jit
def run_qx(x, w, lo, hi, nmax, scale, L):
    """Sub-blocks ``lo..hi`` of ``x``, ``w`` fp32 ``[S, n]`` (a sub-block a row): ``make_qx_quants(n, nmax,
    x, L, 1, w)``; ``scale`` fp32 ``[S]``, ``L`` uint8 ``[S, n]`` the stored codes ``l + nmax``."""
    n = x.shape[1]
    X = np.zeros(n * LANES, np.float32)
    W = np.zeros(n * LANES, np.float32)
    La = np.empty(n * LANES, np.float32)
    V = np.empty((8, LANES), np.float32)
    for s0 in range(lo, hi, LANES):
        t = min(LANES, hi - s0)
        _load(x, s0, t, n, X)
        _load(w, s0, t, n, W)
        qx_tile(X, W, La, V, n, nmax)
        for k in range(t):
            scale[s0 + k] = V[2, k]
            for i in range(n):
                L[s0 + k, i] = np.uint8(La[i * LANES + k])


@_jit
def run_qkx(x, w, lo, hi, nmax, rmin, rdelta, nstep, use_mad, scale, the_min, L):
    """Sub-blocks ``lo..hi`` of ``x``, ``w`` fp32 ``[S, n]``: ``make_qkx2_quants`` / ``make_qkx3_quants(n,
    nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)``; ``scale``, ``the_min`` fp32 ``[S]``,
    ``L`` uint8 ``[S, n]``. Lanes flagged by :func:`qkx_tile` are redone by the scalar port."""
    n = x.shape[1]
    fr, fd, fn = np.float32(rmin), np.float32(rdelta), np.float32(nmax)
    steps = np.empty(nstep + 1 if nstep >= 1 else 0, np.float32)
    for i in range(steps.shape[0]):
        steps[i] = fr + fd * np.float32(i) + fn
    X = np.zeros(n * LANES, np.float32)
    W = np.zeros(n * LANES, np.float32)
    La = np.empty(n * LANES, np.float32)
    V = np.empty((18, LANES), np.float32)
    Laux = np.empty(n, np.uint8)
    for s0 in range(lo, hi, LANES):
        t = min(LANES, hi - s0)
        _load(x, s0, t, n, X)
        _load(w, s0, t, n, W)
        qkx_tile(X, W, La, V, n, nmax, steps, use_mad)
        for k in range(t):
            s = s0 + k
            if V[17, k] != _F0:
                scale[s], the_min[s] = _qkx(n, nmax, x[s], w[s], True, L[s], Laux, fr, fd, nstep, use_mad, True)
                continue
            scale[s] = V[5, k]
            the_min[s] = -V[0, k]
            for i in range(n):
                L[s, i] = np.uint8(La[i * LANES + k])


@_jit
def row_weights(x, qw, lo, hi, W):
    """Rows ``lo..hi``: ``W[r, j] = qw[j] * sqrtf(sigma2 + x[r, j]**2)``, ``sigma2`` the row's ``x*x``
    summed in order over the whole row, divided by ``(float)cols`` (the 32-block ``quantize_row_*_impl``)."""
    cols = x.shape[1]
    n_f = np.float32(cols)
    for r in range(lo, hi):
        s = _F0
        for j in range(cols):
            s += x[r, j] * x[r, j]
        sigma2 = s / n_f
        for j in range(cols):
            W[r, j] = qw[j] * np.sqrt(sigma2 + x[r, j] * x[r, j])


# --------------------------------------------------------------------------- torch-facing drivers


def qx_rows(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, 1, w)`` on every row of ``x``, ``w`` fp32 CPU tensors ``[S, n]`` (a
    sub-block a row), the rows split over the threads: ``(scale fp32 [S], L uint8 [S, n])``, ``L`` the
    stored codes ``l + nmax``; equal to :func:`qkit.schemes.kquant_search.make_qx_quants` with ``qw``."""
    S, n = x.shape
    xn, wn = x.detach().contiguous().numpy(), w.detach().contiguous().numpy()
    scale, L = np.empty(S, np.float32), np.empty((S, n), np.uint8)
    kernels._split(lambda lo, hi: run_qx(xn, wn, lo, hi, nmax, scale, L), S, 4096 // n)
    return torch.from_numpy(scale), torch.from_numpy(L)


def qkx_rows(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` / ``make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad)`` on every row of ``x``, ``w`` fp32 CPU tensors ``[S, n]``: ``(scale [S], the_min [S], L
    uint8 [S, n])``, equal to :func:`qkit.schemes.kquant_search.make_qkx2_quants` (the two C functions
    differ only where ``weights`` is ``NULL``: pass ``w = x*x`` for that)."""
    S, n = x.shape
    xn, wn = x.detach().contiguous().numpy(), w.detach().contiguous().numpy()
    scale, the_min, L = np.empty(S, np.float32), np.empty(S, np.float32), np.empty((S, n), np.uint8)
    unit = max(1, 16384 // (n * (max(nstep, 0) + 2)))  # sub-blocks of about half a millisecond
    kernels._split(lambda lo, hi: run_qkx(xn, wn, lo, hi, nmax, float(rmin), float(rdelta), int(nstep), bool(use_mad), scale, the_min, L), S, unit)
    return torch.from_numpy(scale), torch.from_numpy(the_min), torch.from_numpy(L)
