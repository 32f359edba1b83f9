"""llama.cpp's scale searches in numba: straight scalar ports of the ``static`` helpers of ``ggml-quants.c``
(at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``), one sub-block per call. Imported on first use (numba
costs ~0.2 s to import), as :mod:`qkit.schemes._kernels_jit`.

**Scalar ports**, callable from other ``@njit`` code (fp32 1-D views; ``L`` is
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

The same searches across 64 sub-blocks at once (vectorised; what the encoders run) are
:mod:`qkit.schemes._kernels_lanes`; these ports are the reference the tests hold them to and the
scalar parts of the kernels (``make_qp_quants`` over a super-block's eight scales in q4_k / q5_k).

**Exactness.** Every statement is the C one in its order and association, in fp32: each ``int`` that
C converts to ``float`` is converted with ``np.float32`` (numba would otherwise promote to float64),
sums are sequential, divisions IEEE, no fast-math (no FMA contraction: ggml-base is built without
``-march``). ``nearest_int`` is the bit trick itself: ``(bits(f + 12582912.f) & 0x7fffff) - 0x400000``;
for ``|f| <= 4194303`` that is ``(f + 12582912.f) - 12582912.f`` (round half to even), and outside
(``assert`` is compiled out in a release build) the mantissa bits are read with ``frexp``: ``inf`` gives
``-4194304``, a NaN (only the default NaN ``0xffc00000`` arises, from ``inf * 0``) gives 0. The
``(int8_t)`` / ``(uint8_t)`` stores of ``L`` wrap, as numba's integer stores do. ``MAX`` / ``MIN`` are ``a > b ? a : b`` / ``a < b ? a : b``.
``tests/test_ggml_weighted.py`` compares the scalar ports with the C functions themselves (cut out of
the pinned source and compiled alone).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_jit = njit(nogil=True, cache=True, error_model="numpy")

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_TENTH = np.float32(0.1)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
_FAST = np.float32(4194303.0)  # nearest_int's assert bound: there the trick is (f + M) - M
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS


_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")
_FLT_MAX = np.float32(3.4028234663852886e38)


@_inline
def best_neighbour(neigh, at, grid, xval, waux, o, scale, L):
    """``iq2_find_best_neighbour`` / ``iq3_find_best_neighbour`` (one loop, the group width ``grid.shape[1]``:
    8 / 4): the neighbour list at ``neigh[at]`` (count, then grid indices), the group ``xval[o:o+n]`` weighted
    by ``waux``; writes ``L[o:o+n]`` and returns the grid index (-1: none found, where the C aborts)."""
    n = grid.shape[1]
    best_d2 = _FLT_MAX
    index = -1
    for j in range(1, neigh[at] + 1):
        g = neigh[at + j]
        d2 = _F0
        for i in range(n):
            diff = scale * np.float32(grid[g, i]) - xval[o + i]
            d2 += waux[o + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            index = g
    if index >= 0:
        for i in range(n):
            L[o + i] = (grid[index, i] - 1) // 2
    return index


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
