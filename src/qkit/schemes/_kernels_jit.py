"""The numba code of :mod:`qkit.schemes.kernels` (imported on first use: numba costs ~0.2 s to import):
the 32-element blocks (with an importance matrix, their weights), the final codes of q4_k / q6_k, FP4.
The sub-block scale searches are :mod:`qkit.schemes._kernels_lanes`.

Read :mod:`qkit.schemes.kernels` first: what the kernels compute, and why they are exact.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qkit.schemes._kernels_search import nearest_int

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")


# --------------------------------------------------------------------------- llama.cpp's 32-element blocks

Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 = 0, 1, 2, 3, 4  # ``kind`` of _run_blocks32
_ABS = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)
_HALF_BELOW = np.float32(np.nextafter(np.float32(0.5), np.float32(0)))  # roundf(v) = trunc(v + copysign(this, v))


@_inline
def _key(bits):  # noqa: ANN001
    """A signed int32 ordered as the fp32 values of ``bits`` (``-0`` just below ``+0``); its own inverse."""
    return bits ^ ((bits >> 31) & _ABS)


@_compiled
def _run_blocks32(x, xi, lo, hi, kind, out, d_out, m_out, flags):  # noqa: ANN001
    """Blocks ``lo..hi`` of ``x`` ``[nb, 32]`` (``xi`` its int32 view) -> codes into ``out[:, header:]``,
    the fp32 ``d`` (and ``min`` of q4_1/q5_1) into ``d_out`` / ``m_out``; the caller writes them as fp16.

    The extremes are integer reductions over the fp32 bits (exact, vectorised without reordering any
    float operation): ``max |x|`` over ``bits & 0x7fffffff``, signed max / min over :func:`_key`; where
    the C loops' answer depends on the order (a ``+a`` / ``-a`` tie for q4_0 / q5_0's first element of
    largest magnitude, a zero extreme's sign for q4_1 / q5_1) the block is scanned in order. Then the C
    statements per block, in fp32. ``flags[b]``: 2 for a block holding NaN or inf, 1 for a ``d`` below
    fp32's normal range (``x/d`` unbounded there); the caller re-encodes those blocks with the torch code.
    """
    one = np.empty(1, np.int32)
    onef = one.view(np.float32)
    for b in range(lo, hi):
        amax = np.int32(0)
        kmax = np.int32(-(2**31))
        kmin = np.int32(2**31 - 1)
        for j in range(32):
            bits = xi[b, j]
            a = bits & _ABS
            amax = a if a > amax else amax
            k = _key(bits)
            kmax = k if k > kmax else kmax
            kmin = k if k < kmin else kmin
        flags[b] = 0
        if amax >= _INF_BITS:
            flags[b] = 2
            continue
        if kind >= Q4_1:  # first_extremes: min / max as the C loop from x[0] finds them
            one[0] = _key(kmin)
            mn = onef[0]
            one[0] = _key(kmax)
            mx = onef[0]
            if mn == _F0 or mx == _F0:  # a zero extreme: the sign of the first zero
                for j in range(32):
                    if x[b, j] == _F0:
                        z = x[b, j]
                        mn = z if mn == _F0 else mn
                        mx = z if mx == _F0 else mx
                        break
            d = (mx - mn) / np.float32(15 if kind == Q4_1 else 31)
            m_out[b] = mn
        else:
            one[0] = amax
            fa = onef[0]
            if kind == Q8_0:
                d = fa / np.float32(127)
                mn = _F0
            else:  # the first element of largest magnitude, signed (+0 for a block of zeros)
                neg = _key(amax | np.int32(-(2**31)))
                sm = fa
                if amax != 0 and kmax == amax and kmin == neg:
                    for j in range(32):
                        if (xi[b, j] & _ABS) == amax:
                            sm = x[b, j]
                            break
                elif amax != 0 and kmin == neg:
                    sm = -fa
                d = sm / np.float32(-8 if kind == Q4_0 else -16)
                mn = _F0
        d_out[b] = d
        ad = abs(d)
        if ad != _F0 and ad < np.float32(2.0**-126):
            flags[b] = 1
            continue
        idv = _F1 / d if d != _F0 else _F0
        if kind == Q8_0:
            for j in range(32):
                v = x[b, j] * idv
                s = _HALF_BELOW if v >= _F0 else -_HALF_BELOW
                out[b, 2 + j] = np.uint8(np.int32(v + s) & 0xFF)
        else:  # (int8)((x - min) * id + offset), capped; min = 0 for q4_0 / q5_0, where x - 0 is x exactly
            off = np.float32(8.5) if kind == Q4_0 else np.float32(16.5) if kind == Q5_0 else np.float32(0.5)
            cap = 31 if kind == Q5_0 else 255 if kind == Q5_1 else 15  # q5_1: (uint8_t), no MIN in the C code
            qs = 2 if kind == Q4_0 else 4 if kind == Q4_1 else 6 if kind == Q5_0 else 8  # where qs[] starts
            qh = np.uint32(0)
            for j in range(16):
                q0 = min(cap, np.int32((x[b, j] - mn) * idv + off))
                q1 = min(cap, np.int32((x[b, j + 16] - mn) * idv + off))
                out[b, qs + j] = np.uint8((q0 & 15) | ((q1 & 15) << 4))
                qh |= np.uint32(((q0 >> 4) & 1) << j) | np.uint32(((q1 >> 4) & 1) << (j + 16))
            if kind == Q5_0 or kind == Q5_1:  # qh: bit j is bit 4 of code j, little-endian, before qs
                for t in range(4):
                    out[b, qs - 4 + t] = np.uint8((qh >> np.uint32(8 * t)) & np.uint32(0xFF))


@_compiled
def _run_row_weights(x, qw, lo, hi, W):  # noqa: ANN001
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


# --------------------------------------------------------------------------- k-quant codes from the final scales


@_inline
def _clamp_int(l, lo, hi):  # noqa: ANN001
    """``MAX(lo, MIN(hi, l))`` on an int."""
    return lo if l < lo else (hi if l > hi else l)


@_compiled
def _run_q4_k_codes(x, L, dd, dm, lo, hi, out):  # noqa: ANN001
    """``quantize_row_q4_K_ref``'s last loop for super-blocks ``lo..hi``: ``l = nearest_int((x + dm) / dd)``
    clamped to 0..15 (the search's codes ``L`` where ``dd == 0``), packed two per byte into
    ``out[:, 16:144]`` (``qs[32*p + l] = q[64p + l] | q[64p + 32 + l] << 4``)."""
    for b in range(lo, hi):
        for p in range(4):
            j0, j1 = 2 * p, 2 * p + 1
            d0, d1, m0, m1 = dd[b, j0], dd[b, j1], dm[b, j0], dm[b, j1]
            for t in range(32):
                e0, e1 = 64 * p + t, 64 * p + 32 + t
                if d0 == _F0:
                    q0 = np.int32(L[b, e0])
                else:
                    q0 = _clamp_int(nearest_int((x[b, e0] + m0) / d0), 0, 15)
                if d1 == _F0:
                    q1 = np.int32(L[b, e1])
                else:
                    q1 = _clamp_int(nearest_int((x[b, e1] + m1) / d1), 0, 15)
                out[b, 16 + 32 * p + t] = np.uint8(q0 | (q1 << 4))


@_compiled
def _run_q6_k_codes(x, L, dd, zero, lo, hi, out):  # noqa: ANN001
    """``quantize_row_q6_K_ref``'s last loops for super-blocks ``lo..hi``: ``l = nearest_int(x / dd)``
    clamped to -32..31, plus 32 (the search's stored codes ``L`` where ``dd == 0``, 0 in a ``zero``
    super-block), packed into ``ql`` (``out[:, 0:128]``) and ``qh`` (``out[:, 128:192]``) as the C code
    does: element ``128h + 32j + l`` -> low nibble in ``ql[64h + 32(j%2) + l]`` (high half if ``j >= 2``),
    bits 4-5 in ``qh[32h + l]`` at bit ``2j``."""
    q = np.empty(256, np.int32)
    for b in range(lo, hi):
        if zero[b]:
            for t in range(192):
                out[b, t] = 0
            continue
        for s in range(16):
            d = dd[b, s]
            for t in range(16):
                e = 16 * s + t
                if d == _F0:
                    q[e] = np.int32(L[b, e])
                else:
                    q[e] = _clamp_int(nearest_int(x[b, e] / d), -32, 31) + 32
        for h in range(2):
            for t in range(32):
                a0, a1, a2, a3 = q[128 * h + t], q[128 * h + 32 + t], q[128 * h + 64 + t], q[128 * h + 96 + t]
                out[b, 64 * h + t] = np.uint8((a0 & 15) | ((a2 & 15) << 4))
                out[b, 64 * h + 32 + t] = np.uint8((a1 & 15) | ((a3 & 15) << 4))
                out[b, 128 + 32 * h + t] = np.uint8((a0 >> 4) | ((a1 >> 4) << 2) | ((a2 >> 4) << 4) | ((a3 >> 4) << 6))


# --------------------------------------------------------------------------- FP4 (E2M1) blocks


@_compiled
def _run_block_absmax(xi, lo, hi, block, out):  # noqa: ANN001
    """``out[r, b] = max |x|`` over block ``b`` of row ``r``, as int32 bits (rows ``lo..hi`` of the int32
    view ``xi``): for non-negative floats the bit order is the value order, and NaN's bits exceed inf's."""
    nb = xi.shape[1] // block
    for r in range(lo, hi):
        for b in range(nb):
            m = np.int32(0)
            for j in range(block):
                a = xi[r, b * block + j] & _ABS
                m = a if a > m else m
            out[r, b] = m


_ONE = np.int32(0x3F800000)  # fp32 bits of 1.0
_SIX = np.int32(0x40C00000)  # 6.0
_QUARTER_UP = np.int32(0x3E800001)  # just above 0.25
_THREE_QUARTERS = np.int32(0x3F400000)  # 0.75
_ROUND = np.int32((1 << 21) - 1 - 0x3F000000 - (1 << 22))  # e2m1_pack_arith's mantissa rounding and code offset


@_compiled
def _run_e2m1(x, scale, divide, ties_to_even, minus_zero, lo, hi, block, out):  # noqa: ANN001
    """Rows ``lo..hi``: ``y = x / scale[r, b]`` (``divide``) or ``x * scale[r, b]`` per block, rounded to E2M1
    by :func:`qkit.schemes.e2m1.e2m1_pack_arith`'s integer formula on the fp32 bits (branch-free, so every
    step vectorises), an exact ``-0.0`` coded ``minus_zero``, packed two per byte (column ``2j`` low)."""
    rows, cols = x.shape
    nb = cols // block
    y = np.empty(cols, np.float32)
    bits = y.view(np.int32)
    codes = np.empty(cols, np.int32)
    tie_lo = _THREE_QUARTERS if ties_to_even else _THREE_QUARTERS + np.int32(1)
    for r in range(lo, hi):
        for b in range(nb):
            s = scale[r, b]
            base = b * block
            if divide:
                for j in range(block):
                    y[base + j] = x[r, base + j] / s
            else:
                for j in range(block):
                    y[base + j] = x[r, base + j] * s
        for j in range(cols):
            v = bits[j]
            m = v & _ABS
            sign = (v >> np.int32(28)) & np.int32(8)
            a = (m - tie_lo) >> np.int32(31)  # -1 below the 0.75 midpoint
            nz = ~((m - _QUARTER_UP) >> np.int32(31))  # -1 above 0.25 (a nonzero code)
            if not ties_to_even:
                sign = sign & nz  # gguf: a value that rounds to 0 is +0
            a = a - nz
            m = _ONE if m < _ONE else m
            m = _SIX if m > _SIX else m
            if ties_to_even:
                m = m + ((m >> np.int32(22)) & np.int32(1))
            c = (((m + _ROUND) >> np.int32(22)) + a) | sign
            codes[j] = c if v != np.int32(-(2**31)) else minus_zero
        for k in range(cols // 2):
            out[r, k] = np.uint8(codes[2 * k] | (codes[2 * k + 1] << np.int32(4)))
