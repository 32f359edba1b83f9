"""llama.cpp's scale searches (``ggml-quants.c`` at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``) run across 64
sub-blocks at once, for the compiled q2_k / q3_k kernels (:mod:`qkit.schemes._kernels_low`; imported on
first use: numba is heavy).

The C searches one sub-block of 16 at a time, scalar (:mod:`qkit.schemes._kernels_search` ports it
so). Here 64 sub-blocks (or, for the second-level searches over a super-block's 16 scales, 64
super-blocks) are laid out element-major: element ``i`` of lane ``k`` at ``i * 64 + k``, so that every C
statement is one loop over the lanes, which LLVM vectorises without reordering any lane's operations.
Data-dependent control flow becomes per-lane selects: a candidate that wins; the coordinate-descent
rounds of ``make_q3_quants`` / ``make_qp_quants``, run until no lane changes (a round that changes
nothing in a lane would change nothing in a further one, so each lane ends where the C's ``break``
leaves it).

==========================================  ===============================  =============================
function                                    C                                returns
==========================================  ===============================  =============================
``qkx_lanes(X, W, nmax, rmin, rdelta,       ``make_qkx2_quants`` /           ``S[0]`` scale, ``S[1]``
nstep, use_mad, L, S)``                     ``make_qkx3_quants``             the_min, ``L`` codes
``q3_lanes(X, nmax, L, S)``                 ``make_q3_quants(.., true)``     ``S[0]``, ``L = l + nmax``
``qx_lanes(X, Q, nmax, L, S)``              ``make_qx_quants(.., 1, qw)``    ``S[0]``, ``L = l + nmax``
``qp_lanes(X, Q, nmax, L, S)``              ``make_qp_quants``               ``S[0]``, ``L`` (uint8 wrap)
==========================================  ===============================  =============================

``X``, ``W``, ``Q`` fp32 ``[16 * 64]`` (element-major), ``L`` int32 ``[16 * 64]``, ``S`` the lane rows of
:func:`scratch` (16 separately allocated fp32 ``[64]``: rows of one 2-D array measured ~15x slower, as
LLVM's vectorised loops over several rows of one array fell back to their scalar versions). Integer
arithmetic stays int32 (int64 lanes measured ~7x slower).

**Exactness.** The C statements in the C's order and association, in fp32: every constant
``np.float32``, sums sequential per lane, no fast-math (no FMA contraction, IEEE division and square
root). :func:`ni` is ``nearest_int``'s bit trick itself, exact for every input (inf and NaN included,
as the coordinate descents' ``x * sl2 / slx`` can be). The ``(uint8_t)`` codes of ``make_qp_quants``
wrap (``& 0xFF``) and are read back wrapped, as the C reads its array.

numba's on-disk cache keys a compiled function by its own source file only: the kernels of
:mod:`qkit.schemes._kernels_low` compile these functions into themselves, so after editing this module
touch ``_kernels_low.py`` too (or remove the ``__pycache__`` index files), or they keep the old code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

LANES = 64
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_TENTH = np.float32(0.1)
_MAGIC = np.float32(12582912.0)  # nearest_int's 1.5 * 2**23
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS


@_inline
def ni(f):
    """C ``nearest_int(f)``: the bits of ``f + 12582912.f``, ``(bits & 0x7fffff) - 0x400000`` (int32)."""
    return (np.float32(f + _MAGIC).view(np.int32) & np.int32(0x7FFFFF)) - np.int32(0x400000)


@_inline
def scratch():
    """16 lane rows, fp32 ``[64]`` each, each its own allocation (see the module docstring)."""
    return (
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
    )


@_inline
def first_max_abs(X, amax, mx):
    """``if (ax > amax) { amax = ax; max = x[i]; }`` from 0, per lane."""
    for k in range(LANES):
        amax[k] = _F0
        mx[k] = _F0
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            ax = abs(x)
            big = ax > amax[k]
            amax[k] = ax if big else amax[k]
            mx[k] = x if big else mx[k]


@_compiled
def qkx_lanes(X, W, nmax, rmin, rdelta, nstep, use_mad, L, S):
    """``make_qkx2_quants`` / ``make_qkx3_quants`` with weights ``W`` (the two differ only in ``max == min``
    vs ``max <= min``, the same test once ``min <= max``) on 64 sub-blocks of 16: ``S[0]`` scale, ``S[1]``
    the_min (``-min``), ``L`` the codes. A candidate's codes are recomputed where the C reads its ``Laux``,
    and the winner's (or the first fit's) once at the end: the same fp32 operations give the same codes."""
    scale, the_min, mn, mx, mn0, sw, sx, best, isc = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7], S[8]
    s_l, s_l2, s_xl, bis, bsh, err = S[9], S[10], S[11], S[12], S[13], S[14]
    fn = np.float32(nmax)
    z, top = np.int32(0), np.int32(nmax)
    for k in range(LANES):
        x0, w0 = X[k], W[k]
        mn[k] = x0
        mx[k] = x0
        sw[k] = w0
        sx[k] = w0 * x0
    for i in range(1, 16):
        b = i * LANES
        for k in range(LANES):
            x, w = X[b + k], W[b + k]
            mn[k] = x if x < mn[k] else mn[k]
            mx[k] = x if x > mx[k] else mx[k]
            sw[k] += w
            sx[k] += w * x
    for k in range(LANES):
        mn[k] = _F0 if mn[k] > _F0 else mn[k]
        mn0[k] = mn[k]
        isc[k] = fn / (mx[k] - mn[k])
        scale[k] = _F1 / isc[k]
        best[k] = _F0
        bis[k] = isc[k]
        bsh[k] = mn[k]
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            l = ni(isc[k] * (x - mn[k]))
            l = z if l < z else (top if l > top else l)
            diff = scale[k] * np.float32(l) + mn[k] - x
            diff = abs(diff) if use_mad else diff * diff
            best[k] += W[b + k] * diff
    for is_ in range(nstep + 1):
        c = rmin + rdelta * np.float32(is_) + fn
        for k in range(LANES):
            isc[k] = c / (mx[k] - mn[k])
            s_l[k] = _F0
            s_l2[k] = _F0
            s_xl[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = ni(isc[k] * (x - mn[k]))
                l = z if l < z else (top if l > top else l)
                wl = W[b + k] * np.float32(l)
                s_l[k] += wl
                s_l2[k] += wl * np.float32(l)
                s_xl[k] += wl * x
        for k in range(LANES):
            D = sw[k] * s_l2[k] - s_l[k] * s_l[k]
            a = (sw[k] * s_xl[k] - sx[k] * s_l[k]) / D
            m = (s_l2[k] * sx[k] - s_l[k] * s_xl[k]) / D
            pos = m > _F0
            s_l[k] = _F0 if pos else m  # the sums' rows are reused: this_min, this_scale, D
            s_l2[k] = s_xl[k] / s_l2[k] if pos else a
            s_xl[k] = D
            err[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = ni(isc[k] * (x - mn[k]))
                l = z if l < z else (top if l > top else l)
                diff = s_l2[k] * np.float32(l) + s_l[k] - x
                diff = abs(diff) if use_mad else diff * diff
                err[k] += W[b + k] * diff
        for k in range(LANES):
            win = (s_xl[k] > _F0) & (err[k] < best[k])
            best[k] = err[k] if win else best[k]
            scale[k] = s_l2[k] if win else scale[k]
            bis[k] = isc[k] if win else bis[k]
            bsh[k] = mn[k] if win else bsh[k]
            mn[k] = s_l[k] if win else mn[k]
    for k in range(LANES):
        same = mx[k] == mn0[k]  # the C's early return: codes 0, scale 0, the_min = -min
        scale[k] = _F0 if same else scale[k]
        the_min[k] = -(mn0[k] if same else mn[k])
        bis[k] = _F0 if same else bis[k]
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            l = ni(bis[k] * (X[b + k] - bsh[k]))
            L[b + k] = z if l < z else (top if l > top else l)


@_compiled
def q3_lanes(X, nmax, L, S):
    """``make_q3_quants(16, nmax, x, L, true)`` on 64 sub-blocks: ``S[0]`` scale, ``L`` the codes
    ``l + nmax`` (0 for an all-zero sub-block)."""
    scale, amax, mx, isc, sumlx, suml2, nch = S[0], S[1], S[2], S[3], S[4], S[5], S[6]
    lo, hi, off, z = np.int32(-nmax), np.int32(nmax - 1), np.int32(nmax), np.int32(0)
    first_max_abs(X, amax, mx)
    for k in range(LANES):
        isc[k] = np.float32(-nmax) / mx[k]
        sumlx[k] = _F0
        suml2[k] = _F0
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            l = ni(isc[k] * x)
            l = lo if l < lo else (hi if l > hi else l)
            L[b + k] = l
            w = x * x
            sumlx[k] += w * x * np.float32(l)
            suml2[k] += w * np.float32(l) * np.float32(l)
    for _itry in range(5):
        for k in range(LANES):
            nch[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                w = x * x
                Li = L[b + k]
                fL = np.float32(Li)
                slx = sumlx[k] - w * x * fL
                sl2 = suml2[k] - w * fL * fL
                nl = ni(x * sl2 / slx)
                nl = lo if nl < lo else (hi if nl > hi else nl)
                fl = np.float32(nl)
                slx2 = slx + w * x * fl
                sl22 = sl2 + w * fl * fl
                ok = (slx > _F0) & (nl != Li) & (sl22 > _F0) & (slx2 * slx2 * suml2[k] > sumlx[k] * sumlx[k] * sl22)
                L[b + k] = nl if ok else Li
                sumlx[k] = slx2 if ok else sumlx[k]
                suml2[k] = sl22 if ok else suml2[k]
                nch[k] = _F1 if ok else nch[k]
        changed = _F0
        for k in range(LANES):
            changed = changed + nch[k]
        if changed == _F0:
            break
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            L[b + k] = L[b + k] + off if amax[k] >= _EPS else z
    for k in range(LANES):
        scale[k] = (sumlx[k] / suml2[k] if suml2[k] > _F0 else _F0) if amax[k] >= _EPS else _F0


@_compiled
def qx_lanes(X, Q, nmax, L, S):
    """``make_qx_quants(16, nmax, x, L, 1, qw)`` (weights ``Q``) on 64 lanes: ``S[0]`` scale, ``L`` the codes
    ``l + nmax`` (0 for an all-zero lane). The winning inverse scale is kept and its codes recomputed
    once at the end (the same fp32 operations give the same codes)."""
    scale, amax, mx, isc, sumlx, suml2, best, best_is = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7]
    lo, hi, off, z = np.int32(-nmax), np.int32(nmax - 1), np.int32(nmax), np.int32(0)
    fn = np.float32(nmax)
    first_max_abs(X, amax, mx)
    for si in range(19):
        c = np.float32(-nmax) if si == 0 else -(fn + _TENTH * np.float32(si - 10 if si < 10 else si - 9))
        for k in range(LANES):
            isc[k] = c / mx[k]
            sumlx[k] = _F0
            suml2[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = ni(isc[k] * x)
                fl = np.float32(lo if l < lo else (hi if l > hi else l))
                w = Q[b + k]
                sumlx[k] += w * x * fl
                suml2[k] += w * fl * fl
        if si == 0:
            for k in range(LANES):
                scale[k] = sumlx[k] / suml2[k] if suml2[k] != _F0 else _F0
                best[k] = scale[k] * sumlx[k]
                best_is[k] = isc[k]
        else:
            for k in range(LANES):
                win = (suml2[k] > _F0) & (sumlx[k] * sumlx[k] > best[k] * suml2[k])
                scale[k] = sumlx[k] / suml2[k] if win else scale[k]
                best[k] = scale[k] * sumlx[k] if win else best[k]
                best_is[k] = isc[k] if win else best_is[k]
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            l = ni(best_is[k] * X[b + k])
            l = lo if l < lo else (hi if l > hi else l)
            L[b + k] = l + off if amax[k] >= _EPS else z
    for k in range(LANES):
        scale[k] = scale[k] if amax[k] >= _EPS else _F0


@_compiled
def qp_lanes(X, Q, nmax, L, S):
    """``make_qp_quants(16, nmax, x, L, qw)`` on 64 lanes: ``S[0]`` scale, ``L`` the codes as the C's
    ``uint8_t`` array holds them (``& 0xFF``; the C reads them back so)."""
    scale, mx, isc, best, iis, sis, mse, sumlx, suml2, nch = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7], S[8], S[9]
    fn = np.float32(nmax)
    top, z, byte = np.int32(nmax), np.int32(0), np.int32(0xFF)
    for k in range(LANES):
        mx[k] = _F0
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            mx[k] = mx[k] if mx[k] > X[b + k] else X[b + k]  # MAX(max, x[i])
    for k in range(LANES):
        isc[k] = fn / mx[k]
        scale[k] = _F1 / isc[k]
        best[k] = _F0
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            lw = ni(isc[k] * x) & byte  # L[i] = nearest_int(...): no MIN, a uint8 store
            L[b + k] = lw
            diff = x - scale[k] * np.float32(lw)
            best[k] += Q[b + k] * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        for k in range(LANES):
            iis[k] = (_TENTH * np.float32(is_) + fn) / mx[k]
            sis[k] = _F1 / iis[k]
            mse[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = ni(iis[k] * x)
                l = top if l > top else l
                diff = x - sis[k] * np.float32(l)
                mse[k] += Q[b + k] * diff * diff
        for k in range(LANES):
            win = mse[k] < best[k]
            best[k] = mse[k] if win else best[k]
            isc[k] = iis[k] if win else isc[k]
    for k in range(LANES):
        sumlx[k] = _F0
        suml2[k] = _F0
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            l = ni(isc[k] * x)
            l = top if l > top else l
            L[b + k] = l & byte
            w = Q[b + k]
            sumlx[k] += w * x * np.float32(l)
            suml2[k] += w * np.float32(l) * np.float32(l)
    for _itry in range(5):
        for k in range(LANES):
            nch[k] = _F0
        for i in range(16):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                w = Q[b + k]
                Li = L[b + k]
                fL = np.float32(Li)
                slx = sumlx[k] - w * x * fL
                sl2 = suml2[k] - w * fL * fL
                nl = ni(x * sl2 / slx)
                nl = top if nl > top else nl
                fl = np.float32(nl)
                slx2 = slx + w * x * fl
                sl22 = sl2 + w * fl * fl
                ok = (slx > _F0) & (sl2 > _F0) & (nl != Li) & (slx2 * slx2 * suml2[k] > sumlx[k] * sumlx[k] * sl22)
                L[b + k] = (nl & byte) if ok else Li
                sumlx[k] = slx2 if ok else sumlx[k]
                suml2[k] = sl22 if ok else suml2[k]
                nch[k] = _F1 if ok else nch[k]
        changed = _F0
        for k in range(LANES):
            changed = changed + nch[k]
        if changed == _F0:
            break
    for i in range(16):
        b = i * LANES
        for k in range(LANES):
            L[b + k] = L[b + k] if mx[k] >= _EPS else z
    for k in range(LANES):
        scale[k] = (sumlx[k] / suml2[k] if suml2[k] > _F0 else _F0) if mx[k] >= _EPS else _F0
