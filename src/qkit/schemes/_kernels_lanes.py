"""llama.cpp's scale searches (``ggml-quants.c`` at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``) run across 64
sub-blocks at once: the one implementation every compiled encoder uses (q2_k / q3_k in
:mod:`qkit.schemes._kernels_low`, q4_k / q5_k / q6_k through the row drivers of
:mod:`qkit.schemes._kernels_rows` and :mod:`qkit.schemes._kernels_kquants`, the 32-element types with an
importance matrix through :mod:`qkit.schemes.ggml_weighted`). Imported on first use: numba is heavy.

The C searches one sub-block at a time, scalar (:mod:`qkit.schemes._kernels_search` ports it so). Here 64
sub-blocks of ``n`` (16 or 32; or, for the second-level searches over a super-block's 16 scales, 64
super-blocks) are laid out element-major: element ``i`` of lane ``k`` at ``i * 64 + k``, so that every C
statement is one loop over the lanes, which LLVM vectorises without reordering any lane's operations.
Data-dependent control flow becomes per-lane selects: a candidate that wins; the coordinate-descent
rounds of ``make_q3_quants`` / ``make_qp_quants``, run until no lane changes (a round that changes
nothing in a lane would change nothing in a further one, so each lane ends where the C's ``break``
leaves it).

==============================================  ===============================  =============================
function                                        C                                returns
==============================================  ===============================  =============================
``qkx_lanes(X, W, n, nmax, rmin, rdelta,        ``make_qkx2_quants`` /           ``S[0]`` scale, ``S[1]``
nstep, use_mad, L, S)``                         ``make_qkx3_quants``             the_min, ``L`` codes
``q3_lanes(X, n, nmax, L, S)``                  ``make_q3_quants(.., true)``     ``S[0]``, ``L = l + nmax``
``qx_lanes(X, Q, n, nmax, L, S)``               ``make_qx_quants(.., 1, qw)``    ``S[0]``, ``L = l + nmax``
``qp_lanes(X, Q, n, nmax, L, S)``               ``make_qp_quants``               ``S[0]``, ``L`` (uint8 wrap)
==============================================  ===============================  =============================

``X``, ``W``, ``Q`` fp32 ``[n * 64]`` (element-major), ``L`` int32 ``[n * 64]``, ``S`` the lane rows of
:func:`scratch` (18 separately allocated fp32 ``[64]``: rows of one 2-D array measured ~15x slower in
the coordinate descents, as LLVM's vectorised loops over several rows of one array fell back to their
scalar versions). Integer arithmetic stays int32 (int64 lanes measured ~7x slower).

**Exactness.** The C statements in the C's order and association, in fp32: every constant
``np.float32``, sums sequential per lane, no fast-math (no FMA contraction, IEEE division and square
root). The candidate codes of ``qkx_lanes`` / ``qx_lanes`` are rounded by :func:`_rc`, ``(v + 12582912.f)
- 12582912.f`` clamped in fp32 (``nearest_int`` for ``|v| <= 4194303``; measured ~1.4x faster than the
int form): ``qx``'s arguments are bounded by ``nmax + 0.9``; a ``qkx`` lane that could leave the range
(after a fitted min) is redone by the scalar port. The coordinate descents use :func:`ni`,
``nearest_int``'s bit trick itself, exact for every input (inf and NaN included, as their ``x * sl2 /
slx`` can be). The ``(uint8_t)`` codes of ``make_qp_quants`` wrap (``& 0xFF``) and are read back
wrapped, as the C reads its array.

numba's on-disk cache keys a compiled function by its own source file only: the kernels of the modules
above (and the row drivers of :mod:`qkit.schemes._kernels_rows`) compile these functions into themselves,
so after editing this module (or :mod:`qkit.schemes._kernels_search`) remove the ``__pycache__`` index
files (``*.nbi`` / ``*.nbc``), or they keep the old code.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_search import _qkx

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

LANES = 64
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_TENTH = np.float32(0.1)
_MAGIC = np.float32(12582912.0)  # nearest_int's 1.5 * 2**23
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_ROUND_BOUND = np.float32(4.0e6)  # under nearest_int's exact range 4194303, with room for the bound's rounding


@_inline
def ni(f):
    """C ``nearest_int(f)``: the bits of ``f + 12582912.f``, ``(bits & 0x7fffff) - 0x400000`` (int32)."""
    return (np.float32(f + _MAGIC).view(np.int32) & np.int32(0x7FFFFF)) - np.int32(0x400000)


@_inline
def scratch():
    """18 lane rows, fp32 ``[64]`` each, each its own allocation (see the module docstring)."""
    return (
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
        np.zeros(LANES, np.float32), np.zeros(LANES, np.float32),
    )


@_inline
def first_max_abs(X, n, amax, mx):
    """``if (ax > amax) { amax = ax; max = x[i]; }`` from 0, per lane."""
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


@_inline
def _rc(v, lo, hi):
    """``clamp(nearest_int(v), lo, hi)`` in fp32 for ``|v| <= 4194303`` (there ``(v + 12582912.f) - 12582912.f``
    is the trick's integer: round half to even); measured ~1.4x faster than :func:`ni` and int clamps."""
    v = (v + _MAGIC) - _MAGIC
    v = lo if v < lo else v
    return hi if v > hi else v


@_compiled
def qkx_lanes(X, W, n, nmax, rmin, rdelta, nstep, use_mad, L, S):
    """``make_qkx2_quants`` / ``make_qkx3_quants`` with weights ``W`` (the two differ only in ``max == min``
    vs ``max <= min``, the same test once ``min <= max``) on 64 sub-blocks of ``n``: ``S[0]`` scale,
    ``S[1]`` the_min (``-min``), ``L`` the codes. A candidate's codes are recomputed where the C reads its
    ``Laux``, and the winner's (or the first fit's) once at the end: the same fp32 operations give the
    same codes. They are rounded as :func:`_rc`, an overflowed inverse scale replaced by 0 first (code 0,
    as ``nearest_int`` gives for inf / NaN once clamped); a lane whose codes could leave ``_rc``'s exact
    range (after a fitted min, ``|iscale * (x - min)|`` can) is redone by the scalar port at the end."""
    scale, the_min, mn, mx, mn0, sw, sx, best, isc = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7], S[8]
    s_l, s_l2, s_xl, bis, bsh, err, lo, flag = S[9], S[10], S[11], S[12], S[13], S[14], S[15], S[16]
    fn, fr, fd = np.float32(nmax), np.float32(rmin), np.float32(rdelta)
    for k in range(LANES):
        x0, w0 = X[k], W[k]
        mn[k] = x0
        mx[k] = x0
        sw[k] = w0
        sx[k] = w0 * x0
    for i in range(1, n):
        b = i * LANES
        for k in range(LANES):
            x, w = X[b + k], W[b + k]
            mn[k] = x if x < mn[k] else mn[k]
            mx[k] = x if x > mx[k] else mx[k]
            sw[k] += w
            sx[k] += w * x
    for k in range(LANES):
        lo[k] = mn[k]
        flag[k] = _F0
        mn[k] = _F0 if mn[k] > _F0 else mn[k]
        mn0[k] = mn[k]
        v = fn / (mx[k] - mn[k])
        scale[k] = _F1 / v
        v = v if np.isfinite(v) else _F0
        isc[k] = v
        best[k] = _F0
        bis[k] = v
        bsh[k] = mn[k]
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            x = X[b + k]
            l = _rc(isc[k] * (x - mn[k]), _F0, fn)
            diff = scale[k] * l + mn[k] - x
            diff = abs(diff) if use_mad else diff * diff
            best[k] += W[b + k] * diff
    for is_ in range(nstep + 1 if nstep >= 1 else 0):  # the C returns after the first fit if nstep < 1
        c = fr + fd * np.float32(is_) + fn
        for k in range(LANES):
            v = c / (mx[k] - mn[k])
            v = v if np.isfinite(v) else _F0
            isc[k] = v
            reach = abs(v) * max(abs(mx[k] - mn[k]), abs(lo[k] - mn[k]))
            flag[k] = _F1 if reach > _ROUND_BOUND else flag[k]
            s_l[k] = _F0
            s_l2[k] = _F0
            s_xl[k] = _F0
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = _rc(isc[k] * (x - mn[k]), _F0, fn)
                wl = W[b + k] * l
                s_l[k] += wl
                s_l2[k] += wl * l
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
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                l = _rc(isc[k] * (x - mn[k]), _F0, fn)
                diff = s_l2[k] * l + s_l[k] - x
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
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            L[b + k] = np.int32(_rc(bis[k] * (X[b + k] - bsh[k]), _F0, fn))
    redo = False
    for k in range(LANES):
        redo = redo or flag[k] != _F0
    if redo:  # rare: the scalar port, exact for every argument of nearest_int
        xs, ws = np.empty(n, np.float32), np.empty(n, np.float32)
        Ls, Laux = np.empty(n, np.uint8), np.empty(n, np.uint8)
        for k in range(LANES):
            if flag[k] != _F0:
                for i in range(n):
                    xs[i] = X[i * LANES + k]
                    ws[i] = W[i * LANES + k]
                scale[k], the_min[k] = _qkx(n, nmax, xs, ws, True, Ls, Laux, fr, fd, nstep, use_mad, True)
                for i in range(n):
                    L[i * LANES + k] = np.int32(Ls[i])


@_compiled
def q3_lanes(X, n, nmax, L, S):
    """``make_q3_quants(n, nmax, x, L, true)`` on 64 sub-blocks: ``S[0]`` scale, ``L`` the codes
    ``l + nmax`` (0 for an all-zero sub-block)."""
    scale, amax, mx, isc, sumlx, suml2, nch = S[0], S[1], S[2], S[3], S[4], S[5], S[6]
    lo, hi, off, z = np.int32(-nmax), np.int32(nmax - 1), np.int32(nmax), np.int32(0)
    first_max_abs(X, n, amax, mx)
    for k in range(LANES):
        isc[k] = np.float32(-nmax) / mx[k]
        sumlx[k] = _F0
        suml2[k] = _F0
    for i in range(n):
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
        for i in range(n):
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
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            L[b + k] = L[b + k] + off if amax[k] >= _EPS else z
    for k in range(LANES):
        scale[k] = (sumlx[k] / suml2[k] if suml2[k] > _F0 else _F0) if amax[k] >= _EPS else _F0


@_compiled
def qx_lanes(X, Q, n, nmax, L, S):
    """``make_qx_quants(n, nmax, x, L, 1, qw)`` (weights ``Q``) on 64 lanes: ``S[0]`` scale, ``L`` the codes
    ``l + nmax`` (0 for an all-zero lane). The winning inverse scale is kept and its codes recomputed
    once at the end (the same fp32 operations give the same codes)."""
    scale, amax, mx, isc, sumlx, suml2, best, best_is = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7]
    lo, hi = np.float32(-nmax), np.float32(nmax - 1)
    fn = np.float32(nmax)
    first_max_abs(X, n, amax, mx)
    for si in range(19):
        c = np.float32(-nmax) if si == 0 else -(fn + _TENTH * np.float32(si - 10 if si < 10 else si - 9))
        for k in range(LANES):
            v = c / mx[k]  # |v * x| <= nmax + 0.9 where amax >= GROUP_MAX_EPS: _rc is exact; others are masked
            isc[k] = v if np.isfinite(v) else _F0
            sumlx[k] = _F0
            suml2[k] = _F0
        for i in range(n):
            b = i * LANES
            for k in range(LANES):
                x = X[b + k]
                fl = _rc(isc[k] * x, lo, hi)
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
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            v = _rc(best_is[k] * X[b + k], lo, hi) + fn
            L[b + k] = np.int32(v) if amax[k] >= _EPS else np.int32(0)
    for k in range(LANES):
        scale[k] = scale[k] if amax[k] >= _EPS else _F0


@_compiled
def qp_lanes(X, Q, n, nmax, L, S):
    """``make_qp_quants(n, nmax, x, L, qw)`` on 64 lanes: ``S[0]`` scale, ``L`` the codes as the C's
    ``uint8_t`` array holds them (``& 0xFF``; the C reads them back so)."""
    scale, mx, isc, best, iis, sis, mse, sumlx, suml2, nch = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7], S[8], S[9]
    fn = np.float32(nmax)
    top, z, byte = np.int32(nmax), np.int32(0), np.int32(0xFF)
    for k in range(LANES):
        mx[k] = _F0
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            mx[k] = mx[k] if mx[k] > X[b + k] else X[b + k]  # MAX(max, x[i])
    for k in range(LANES):
        isc[k] = fn / mx[k]
        scale[k] = _F1 / isc[k]
        best[k] = _F0
    for i in range(n):
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
        for i in range(n):
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
    for i in range(n):
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
        for i in range(n):
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
    for i in range(n):
        b = i * LANES
        for k in range(LANES):
            L[b + k] = L[b + k] if mx[k] >= _EPS else z
    for k in range(LANES):
        scale[k] = (sumlx[k] / suml2[k] if suml2[k] > _F0 else _F0) if mx[k] >= _EPS else _F0

