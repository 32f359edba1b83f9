"""fp32 <-> fp16 inside the numba kernels, bit for bit (imported on first use: numba is heavy).

The k-quant kernels round ``d`` / ``dmin`` to fp16 themselves, because the C recomputes the codes from
the rounded values (``GGML_FP16_TO_FP32(y.d)``). :func:`fp16_bits` is ``GGML_FP32_TO_FP16``: round to
nearest even, subnormals included, inf from 65520 on (65504 is the largest fp16), ``0x7e00`` (with the
sign) for NaN. :func:`fp16_value` is ``GGML_FP16_TO_FP32`` for finite bits, exactly. Both take ``one``, a
one-element int32 buffer, to reinterpret between fp32 and its bits. The tests compare them with torch's
``.to(torch.float16)`` on every fp16 value, the midpoints between neighbours and their neighbours.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_compiled = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")


@_inline
def fp16_bits(f, one):
    """fp32 ``f`` -> its fp16 bits (an int), round to nearest even; inf beyond fp16's range, 0x7e00 for NaN."""
    one.view(np.float32)[0] = f
    b = one[0]
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:  # >= 65520: rounds to inf (65504 is the largest fp16)
        return sign | 0x7C00
    if a >= 0x38800000:  # a normal fp16: rebias the exponent, round off 13 mantissa bits (a carry is right)
        m = a - 0x38000000
        return sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13)
    # subnormal (or zero): |f| * 2**24 is exact and below 2**10; (v + 2**23) - 2**23 rounds it to even
    v = abs(f) * np.float32(16777216.0)
    return sign | np.int32((v + np.float32(8388608.0)) - np.float32(8388608.0))


@_inline
def fp16_value(h, one):
    """Finite fp16 bits ``h`` -> their fp32 value (``GGML_FP16_TO_FP32``), exactly."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float32(m) * np.float32(2.0**-24)  # subnormal or zero: m units of 2**-24, exact
    else:
        one[0] = np.int32(((e + 112) << 23) | (m << 13))
        v = one.view(np.float32)[0]
    return -v if h & 0x8000 else v


@_compiled
def fp16_round_trip(f, bits_out, value_out):
    """For the tests: ``bits_out[i] = GGML_FP32_TO_FP16(f[i])`` and ``value_out[i]`` its fp32 value (inf
    where not finite)."""
    one = np.empty(1, np.int32)
    for i in range(f.shape[0]):
        h = fp16_bits(f[i], one)
        bits_out[i] = h
        value_out[i] = fp16_value(h, one) if (h & 0x7C00) != 0x7C00 else np.float32(np.inf)
