"""E2M1 and E8M0: the FP4 element grid, its rounding and packing, and the power-of-two scales.

The numbers both FP4 schemes (``qkit.schemes.fp4``) and the calibrated methods' FP4 observers build on.
E2M1 (1 sign, 2 exponent, 1 mantissa bit; OCP MX v1.0 section 5.3.3): magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with codes 0..7 (the code *is* the bit pattern), bit 3 the sign (code 8
is -0). Two rounding rules (:func:`e2m1_pack`): ties to the smaller magnitude with a zero always +0 (gguf's
MXFP4), and ties to even with the sign bit set for every negative value (compressed-tensors' NVFP4).
Packing (:func:`pack_fp4`): column ``2j`` of a row in the low nibble of byte ``j``, ``2j + 1`` in the high
one. E8M0 (OCP MX v1.0 section 5.4.1): a biased exponent byte ``e``, the scale ``2**(e - 127)``.
"""

from __future__ import annotations

import threading

import torch

# E2M1 magnitudes by code 0..7 (OCP MX v1.0, table 5); codes 8..15 are their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E2M1_EMAX = 2  # floor(log2(6)): the offset of the MX shared exponent (OCP MX v1.0, section 6.3)

# fp32 bit patterns used by the integer rounding in :func:`e2m1_pack_arith`.
_ONE = 0x3F800000  # 1.0
_SIX = 0x40C00000  # 6.0
_QUARTER = 0x3E800000  # 0.25
_THREE_QUARTERS = 0x3F400000  # 0.75
_HALF_MANTISSA = (1 << 21) - 1  # below half of the 1-bit mantissa's step
_CODE_OFFSET = 0x3F000000  # bits(1.0) - (2 << 22): so that 1.0 gives code 2
INF_BITS = 0x7F800000  # bits(inf); NaN's |bits| are larger: ``block_absmax`` bits >= this flag a non-finite block


class Work:
    """Scratch buffers for :func:`e2m1_pack`, reused across the chunks of one matrix (no allocation per chunk)."""

    def __init__(self, n: int, device: torch.device):
        self.n, self.device = n, device
        self.m = torch.empty(n, dtype=torch.int32, device=device)
        self.a = torch.empty(n, dtype=torch.int32, device=device)
        self.s = torch.empty(n, dtype=torch.int32, device=device)
        self.c = torch.empty(n, dtype=torch.uint8, device=device)  # codes (lookup path)
        self.y = torch.empty(n, dtype=torch.float32, device=device)  # the scaled block values
        self._d: torch.Tensor | None = None
        self._b: torch.Tensor | None = None

    @property
    def b(self) -> torch.Tensor:  # only the integer rounding (e2m1_pack_arith) needs it
        if self._b is None:
            self._b = torch.empty(self.n, dtype=torch.int32, device=self.device)
        return self._b

    @property
    def d(self) -> torch.Tensor:  # only ties to even needs the second lookup
        if self._d is None:
            self._d = torch.empty(self.n, dtype=torch.uint8, device=self.device)
        return self._d


_WORK = threading.local()


def work_buffers(n: int, device: torch.device) -> Work:
    """Scratch buffers of at least ``n`` elements, kept per thread and device between calls: a fresh
    multi-megabyte buffer per matrix costs its first-touch page faults every time (measured: about a
    third of mxfp4's time over the default model's 210 matrices)."""
    cache = getattr(_WORK, "by_device", None)
    if cache is None:
        cache = _WORK.by_device = {}
    w = cache.get(device)
    if w is None or w.n < n:
        w = cache[device] = Work(n, device)
    return w


def e2m1_pack_arith(y: torch.Tensor, out: torch.Tensor, *, ties_to_even: bool, work: Work | None = None) -> torch.Tensor:
    """fp32 ``y`` ``[rows, cols]`` (contiguous, finite) rounded to E2M1 and packed into uint8 ``out``
    ``[rows, cols / 2]`` (:func:`pack_fp4` layout); returns ``out``.

    Magnitudes above 6 saturate to 6. ``ties_to_even=True`` (compressed-tensors' ``cast_to_fp4``): a tie
    goes to the even code and the sign bit is set for every ``y < 0`` (a negative value that rounds to 0
    is -0, code 8; the caller turns ``-0.0`` into +0.0, as ``torch.sign(-0.0) == 0`` there). ``ties_to_even=False``
    (gguf's MXFP4): a tie goes to the smaller magnitude and a value that rounds to 0 is +0.

    Integer arithmetic on the fp32 bits ``m`` of ``|y|``, no lookup and no per-element branch: for
    ``|y| >= 1`` rounding to E2M1 is rounding the fp32 mantissa to one bit (``m + 0x1FFFFF``, plus 1 when the
    kept bit is odd for ties to even, then ``>> 22``; offset so that 1.0 gives code 2 and 6.0 code 7);
    below 1 the grid is ``{0, 0.5, 1}`` and the two midpoints 0.25 and 0.75 step down from code 2
    (``(m - t) >> 31`` is -1 below ``t``, else 0). The sign bit is bit 31 of ``y`` moved to bit 3. Exact:
    every midpoint is a dyadic fp32 number and every step is exact int32 arithmetic. Everything runs in
    int32 (no bool or uint8 temporaries, whose conversions cost more than the arithmetic).
    """
    n = y.numel()
    w = work if work is not None and work.m.numel() >= n else Work(n, y.device)
    bits = y.reshape(-1).view(torch.int32)
    m, a, b, s = w.m[:n], w.a[:n], w.b[:n], w.s[:n]
    torch.bitwise_and(bits, 0x7FFFFFFF, out=m)  # |y|'s bits, ordered as |y| is
    torch.bitwise_right_shift(bits, 28, out=s).bitwise_and_(8)  # the sign, as code bit 3
    torch.sub(m, _THREE_QUARTERS if ties_to_even else _THREE_QUARTERS + 1, out=a).bitwise_right_shift_(31)
    # b = -1 where |y| > 0.25 (a nonzero code; 0.25 is a tie both rules send to 0), else 0
    torch.sub(m, _QUARTER + 1, out=b).bitwise_right_shift_(31).bitwise_not_()
    if not ties_to_even:  # gguf: a value that rounds to 0 is +0
        s.bitwise_and_(b)
    a.sub_(b)  # -1, 0 or +1: with a -1 folded into the offset below, the steps down from code 2 below 1.0
    m.clamp_(_ONE, _SIX)
    if ties_to_even:
        torch.bitwise_right_shift(m, 22, out=b).bitwise_and_(1)  # an odd kept bit rounds a tie up
        m.add_(b)
    m.add_(_HALF_MANTISSA - _CODE_OFFSET - (1 << 22)).bitwise_right_shift_(22).add_(a).bitwise_or_(s)
    # Pack: viewed as int64 (little-endian), element 2j is the low word and 2j+1 the high one, so
    # (v >> 28) | v has code 2j | code 2j+1 << 4 in its low byte; the conversion keeps that byte.
    v = m.view(torch.int64)
    p = a.view(torch.int64)[: n // 2]
    torch.bitwise_right_shift(v, 28, out=p).bitwise_or_(v)
    out.view(-1).copy_(p)
    return out


_LUT_BITS = 21  # the low mantissa bits a bucket spans: the top 11 bits (sign, exponent, 2 mantissa bits) index it
_LUTS: dict[tuple[torch.device, bool, int], torch.Tensor] = {}


def e2m1_code_table(ties_to_even: bool, device: torch.device | str = "cpu", minus_zero: int | None = None) -> torch.Tensor:
    """uint8 ``[2048]``: the E2M1 code (sign included) of every value strictly inside each bucket of the top
    11 bits of an fp32 (``bits >> 21``), by :func:`e2m1_pack_arith`'s rounding; the buckets of inf and NaN
    hold what the lookup in :func:`e2m1_pack` needs for signed zeros (see there). Cached per device."""
    device = torch.device(device)
    minus_zero = (8 if ties_to_even else 0) if minus_zero is None else minus_zero
    key = (device, ties_to_even, minus_zero)
    if key not in _LUTS:
        b = torch.arange(2048, dtype=torch.int64)
        mid = (b << _LUT_BITS) | (1 << (_LUT_BITS - 1))
        mid = torch.where(mid >= 2**31, mid - 2**32, mid).to(torch.int32).view(torch.float32)
        special = ~torch.isfinite(mid)
        mid = torch.where(special, torch.zeros_like(mid), mid).reshape(1, -1).contiguous()
        packed = torch.empty(1, 1024, dtype=torch.uint8)
        table = unpack_fp4(e2m1_pack_arith(mid, packed, ties_to_even=ties_to_even))[0]
        # Bucket 0x3FF (+NaN) is where -0.0 lands after the one-ulp step below (bits - 1 = 0x7FFFFFFF) and
        # bucket 0x7FF (-NaN) is where +0.0 lands (bits - 1 = -1): +0 for both, except that with ties to even
        # -0.0 keeps its sign (code 8), as compressed-tensors' sign rule gives it.
        table[special.reshape(-1)] = 0
        table[0x3FF] = minus_zero  # -0.0 - 1 ulp = 0x7FFFFFFF: bucket 0x3FF (ties to even: 8 by the sign rule)
        _LUTS[key] = table.to(device)
    return _LUTS[key]


def e2m1_pack(
    y: torch.Tensor, out: torch.Tensor, *, ties_to_even: bool, work: Work | None = None, minus_zero: int | None = None
) -> torch.Tensor:
    """fp32 ``y`` ``[rows, cols]`` (contiguous, finite) rounded to E2M1 and packed into uint8 ``out``
    ``[rows, cols / 2]`` (:func:`pack_fp4` layout); returns ``out``. Exactly :func:`e2m1_pack_arith`
    (rules there; tested over fp32 bit patterns), by table lookup, in about half the passes over the data.
    ``minus_zero``: the code of an exact -0.0 (default: the rule's, 8 with ties to even, else 0); nvfp4
    passes 0, compressed-tensors' code for a -0.0 (``torch.sign(-0.0)`` is 0), instead of adding 0.0 first.

    Every rounding threshold of E2M1 (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has at most 2 mantissa bits, so
    it is the start of a bucket of the top 11 bits of an fp32 (``bits >> 21``: sign, exponent, 2 mantissa
    bits), and every value strictly inside a bucket rounds to one code (:func:`e2m1_code_table`). Only a value
    *at* a threshold (a tie) needs more, and the integer ``bits - 1`` (one ulp towards zero, for either
    sign) moves exactly the ties into the bucket below:

    * ties to the smaller magnitude (gguf's MXFP4): ``code = T[((bits - 1) >> 21) & 0x7FF]``;
    * ties to even (compressed-tensors' NVFP4): the ties that round down (0.25 = 1.00b x 2**-2, 1.25, 2.5,
      5 = 1.01b x 2**e) have their first mantissa bit (bit 22) 0, those that round up (0.75 = 1.10b x 2**-1,
      1.75, 3.5 = 1.11b x 2**e) have it 1: ``code = T[((bits - 1 + bit22) >> 21) & 0x7FF]``. The other
      bucket starts with bit 22 clear (0.5, 1, 2, 4, 8, ...) move to the bucket below, whose interior
      rounds to the same code. -0.0 lands in bucket 0x3FF, which holds code 8 for this rule.
    """
    n = y.numel()
    w = work if work is not None and work.c.numel() >= n else Work(n, y.device)
    bits = y.reshape(-1).view(torch.int32)
    idx, codes = w.a[:n], w.c[:n]
    table = e2m1_code_table(ties_to_even, y.device, minus_zero)
    if not ties_to_even:
        torch.sub(bits, 1, out=idx).bitwise_right_shift_(_LUT_BITS).bitwise_and_(0x7FF)
        torch.index_select(table, 0, idx, out=codes)  # ties down
    else:
        # the one-ulp step only where the bucket's first mantissa bit (bit 22) is 0: see the docstring
        step = torch.bitwise_right_shift(bits, 22, out=w.m[:n]).bitwise_and_(1)
        torch.add(bits, step, out=idx).sub_(1).bitwise_right_shift_(_LUT_BITS).bitwise_and_(0x7FF)
        torch.index_select(table, 0, idx, out=codes)
    # Pack: two uint8 codes c0, c1 read as one little-endian int16 v = c0 + 256 c1; v | (v >> 4) has
    # c0 | c1 << 4 in its low byte (c0 < 16), which the conversion to uint8 keeps.
    v = codes.view(torch.int16)
    p = w.s.view(torch.int16)[: n // 2]
    torch.bitwise_right_shift(v, 4, out=p).bitwise_or_(v)
    out.view(-1).copy_(p)
    return out


def e2m1_codes(y: torch.Tensor, *, ties_to_even: bool) -> torch.Tensor:
    """fp32 ``y`` ``[rows, cols]`` (``cols`` even) -> uint8 E2M1 codes 0..15 ``[rows, cols]`` (rules: :func:`e2m1_pack`)."""
    y = y.float().contiguous()
    packed = torch.empty(y.shape[0], y.shape[1] // 2, dtype=torch.uint8, device=y.device)
    return unpack_fp4(e2m1_pack(y, packed, ties_to_even=ties_to_even))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes ``[rows, cols]`` (0..15, ``cols`` even) -> uint8 ``[rows, cols / 2]``: column ``2j`` in
    the low nibble of byte ``j``, ``2j + 1`` in the high nibble (compressed-tensors' ``pack_fp4_to_uint8``)."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 ``[rows, cols / 2]`` -> uint8 codes ``[rows, cols]``."""
    out = torch.empty(*packed.shape, 2, dtype=torch.uint8, device=packed.device)
    out[..., 0] = packed & 0x0F
    out[..., 1] = packed >> 4
    return out.reshape(packed.shape[0], -1)


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """fp32 ``[256, 2]``: the two E2M1 values (low nibble, high nibble) of every byte (cached per device)."""
    if device not in _PAIR_TABLES:
        values = e2m1_table()
        byte = torch.arange(256)
        _PAIR_TABLES[device] = torch.stack((values[byte & 15], values[byte >> 4]), dim=1).to(device)
    return _PAIR_TABLES[device]


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, cols / 2]`` (:func:`pack_fp4` layout) -> fp32 E2M1 values ``[rows, cols]``."""
    return _pair_table(packed.device)[packed.long()].reshape(packed.shape[0], -1)


def block_absmax(x: torch.Tensor, block: int, work: Work, out: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` ``[rows, cols]`` -> ``max |x|`` per block of ``block`` columns, as fp32 ``[rows, cols / block]``
    (a view of the int32 ``out``). The max is taken over the int32 bits of ``|x|``: for non-negative floats
    the bit order is the value order (several times faster than a float ``aminmax`` over a short last
    dimension), and NaN's bits exceed inf's, so ``out >= 0x7F800000`` flags a non-finite block.
    """
    rows, cols = x.shape
    m = torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=work.m[: rows * cols].view(rows, cols))
    torch.amax(m.view(rows, -1, block), dim=2, out=out)
    return out.view(torch.float32)


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block absmax (finite, >= 0) -> int32 biased E8M0 exponents ``e`` (the formula of ``qkit.schemes.fp4``'s docstring).

    ``log2`` in fp64, rounded to fp32, then floored: numpy's fp32 ``log2`` as gguf calls it (see ``qkit.schemes.fp4``'s
    docstring), independent of the device's fp32 ``log2``. A zero block gets ``e = 0``.
    """
    log2 = torch.log2(amax.double()).float().floor_()
    e = torch.where(amax > 0, log2 - E2M1_EMAX + E8M0_BIAS, torch.zeros_like(log2))
    return e.clamp_(0, 254).to(torch.int32)


def e8m0_values(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents 0..254 -> fp32 scales ``2**(e - 127)``, exactly (``e = 0`` is the subnormal 2**-127),
    as :func:`qkit.schemes.fp4.dequantize_mxfp4` decodes them."""
    e = e.to(torch.int32)
    normal = (e << 23).view(torch.float32)
    return torch.where(e > 0, normal, torch.full_like(normal, 2.0**-127))




def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[16]``: the E2M1 value of every code 0..15 (code 8 is -0.0), as :func:`e2m1_values` decodes them."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)




def e8m0_reciprocals(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents 0..252 (from :func:`mxfp4_exponents`) -> fp32 ``2**(127 - e)``, the factor
    :func:`qkit.schemes.fp4.quantize_mxfp4` multiplies a block by (exact: a power of two, normal for ``e <= 252``)."""
    return ((2 * E8M0_BIAS - e.to(torch.int32)) << 23).view(torch.float32)
