"""FP4 block formats: ``mxfp4`` (OCP Microscaling v1.0) and ``nvfp4`` (NVIDIA), both with E2M1 elements.

E2M1 (1 sign, 2 exponent, 1 mantissa bit; OCP MX v1.0 section 5.3.3): magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with codes 0..7 (the code *is* the bit pattern), bit 3 the sign
(code 8 is -0). Weights are quantized as ``[shape[0], prod(shape[1:])]`` (1-D as ``[1, n]``) in blocks
of ``B`` consecutive weights of one row; the row width must be a multiple of ``B``.

**mxfp4** (``B = 32``; 4 + 8/32 = 4.25 bits per weight exactly). The scale selection and rounding of the
``gguf`` package's reference quantizer (``gguf.quants.MXFP4.quantize``, llama.cpp's GGML type MXFP4),
bit for bit::

    a     = max |w| over the block                                    (fp32)
    E     = floor(fl32(log2 a)) - 2       2 = emax of E2M1; e = E + 127, the stored E8M0 byte (a = 0: e = 0)
    scale = 2**E                                                      (OCP: X = 2**(floor(log2 a) - emax))
    code  = nearest E2M1 to w / scale, saturating at 6; a tie goes to the smaller magnitude and a value that
            rounds to 0 is +0 (gguf takes the first of equal errors in the order 0, 0.5, ..., 6, -0, -0.5, ...)
    w_hat = E2M1[code] * 2**(e - 127)                                 (exact in fp32)

``fl32(log2 a)`` is log2 rounded to fp32 *before* the floor, as gguf (numpy) and llama.cpp (``log2f``)
compute it: for an ``a`` within about 2**-20 relative below a power of two it is that power, so ``E`` is one
more than the exact exponent of ``a`` (the block then uses half its range; measured: numpy's and torch's
fp32 log2 equal fp64 log2 rounded to fp32 there, which is what qkit computes). One divergence, by design:
a block with ``0 < a < 2**-125`` would need ``e < 0``; gguf's uint8 cast wraps it (undefined behaviour in
C), qkit clamps to ``e = 0`` (scale ``2**-127``, the smallest E8M0 value).

**nvfp4** (``B = 16``; 4 + 8/16 = 4.5 bits per weight, plus one fp32 per tensor: ``4.5 + 32/n`` for a
tensor of ``n`` weights). The scale selection and rounding of compressed-tensors 0.20.1 / llm-compressor
(``generate_gparam``, ``calculate_qparams``, ``_quantize``, ``cast_to_fp4``, ``pack_fp4_to_uint8``), bit
for bit, all in fp32::

    gs    = 2688 / max(max |w| over the tensor, tiny)     2688 = 448 * 6; inf or NaN -> 1.0 (all-zero tensor);
                                                          computed as torch computes a number over a tensor,
                                                          fl(fl(1 / amax) * 2688), as generate_gparam does
    s     = e4m3(clamp(gs * (a / 6), -448, 448))          a = the block's max |w|; torch's round-to-nearest-even
    s     = 0.125 where s == 0                            (compressed-tensors' "eps" of E4M3 for empty blocks)
    y     = w / (s / gs)                                  two roundings, in this order
    code  = nearest E2M1 to clamp(y, -6, 6), ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
            2.5 -> 2, 3.5 -> 4, 5 -> 4); sign bit set for y < 0, so a small negative weight is -0 (code 8)
    w_hat = E2M1[code] * (s / gs)                         compressed-tensors' ``_dequantize``, in fp32

``gs`` is compressed-tensors' ``weight_global_scale`` (the reciprocal of NVIDIA ModelOpt's
``weight_scale_2``). The reference computes ``a / 6`` in the weights' dtype; qkit computes it in fp32
from the weights read as fp32, which equals the reference on fp32 weights (tested).

Storage (this is also the on-disk layout, ``NAME.<part>``):

* ``qweight`` uint8 ``[rows, cols / 2]``: byte ``j`` of a row holds column ``2j`` in its low nibble and
  ``2j + 1`` in its high nibble: compressed-tensors' ``pack_fp4_to_uint8`` layout, so the export to
  ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` is a copy. (gguf's MXFP4 block puts element ``j`` and
  ``j + 16`` in one byte; ``to_gguf_mxfp4_blocks`` converts.)
* ``scales`` uint8 ``[rows, cols / B]``: mxfp4, the E8M0 bytes ``e`` (scale ``2**(e - 127)``); nvfp4, the
  FP8 E4M3 (``torch.float8_e4m3fn``) bit patterns of ``s`` (``scales.view(torch.float8_e4m3fn)``). Stored as
  uint8 because torch cannot test fp8 for finiteness (``quantize_tensor`` checks float scales).
* nvfp4 only: ``global_scale`` fp32 ``[1]``, ``gs``.

Non-finite input: ``encode`` returns a float NaN ``scales`` (the registry's convention: a non-finite
weight gives a non-finite scale, and ``quantize_tensor`` turns it into ``NonFiniteWeightError`` naming
the tensor); nothing of it is ever stored.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.registry import as_2d, register

# E2M1 magnitudes by code 0..7 (OCP MX v1.0, table 5); codes 8..15 are their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127
E2M1_EMAX = 2  # floor(log2(6)): the offset of the MX shared exponent (OCP MX v1.0, section 6.3)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * 6.0  # compressed-tensors generate_gparam: FP8 max * FP4 max
E4M3_EPS = 0.125  # compressed-tensors _get_dtype_eps(float8_e4m3fn): replaces a zero block scale

# fp32 bit patterns used by the integer rounding in :func:`e2m1_pack`.
_ONE = 0x3F800000  # 1.0
_SIX = 0x40C00000  # 6.0
_QUARTER = 0x3E800000  # 0.25
_THREE_QUARTERS = 0x3F400000  # 0.75
_HALF_MANTISSA = (1 << 21) - 1  # below half of the 1-bit mantissa's step
_CODE_OFFSET = 0x3F000000  # bits(1.0) - (2 << 22): so that 1.0 gives code 2
_INF = 0x7F800000  # bits(inf); NaN's |bits| are larger
# Elements per chunk of rows: large enough that the ~10-20 torch calls per chunk cost little next to the
# arithmetic, small enough that a chunk's temporaries stay in cache. Measured on the default model's
# shapes, one thread, with the lookup rounding and the per-thread buffers (``_work``): 2**19 best (mxfp4
# 8.5x an int8 copy; 2**17 11.8x, 2**21 8.8x).
_CHUNK_ELEMENTS = 1 << 19


class _Work:
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


def _work(n: int, device: torch.device) -> _Work:
    """Scratch buffers of at least ``n`` elements, kept per thread and device between calls: a fresh
    multi-megabyte buffer per matrix costs its first-touch page faults every time (measured: about a
    third of mxfp4's time over the default model's 210 matrices)."""
    cache = getattr(_WORK, "by_device", None)
    if cache is None:
        cache = _WORK.by_device = {}
    w = cache.get(device)
    if w is None or w.n < n:
        w = cache[device] = _Work(n, device)
    return w


def e2m1_pack_arith(y: torch.Tensor, out: torch.Tensor, *, ties_to_even: bool, work: _Work | None = None) -> torch.Tensor:
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
    w = work if work is not None and work.m.numel() >= n else _Work(n, y.device)
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
    y: torch.Tensor, out: torch.Tensor, *, ties_to_even: bool, work: _Work | None = None, minus_zero: int | None = None
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
    w = work if work is not None and work.c.numel() >= n else _Work(n, y.device)
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


def _check_width(name: str, block: int, shape: tuple[int, ...], tensor: str) -> None:
    rows, cols = as_2d(shape)
    if cols % block == 0 and cols > 0:
        return
    others = "nvfp4 (blocks of 16) can, " if block == MXFP4_BLOCK and cols % NVFP4_BLOCK == 0 else ""
    raise SchemeError(
        f"tensor {tensor} is {cols} wide ({cols} = {cols / block:g} x {block}): {name} stores blocks of {block} "
        f"along each row, so the width must be a multiple of {block}; {others}or leave it out with "
        f"--exclude '{tensor}', or give it another scheme with --keep int8-row:'{tensor}'"
    )


def _fp4_layout(name: str, block: int, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """qweight uint8 ``[rows, cols/2]`` and one scale byte per block, uint8 ``[rows, cols/block]``."""
    rows, cols = as_2d(tuple(shape))
    if cols % block or cols == 0:
        raise SchemeError(f"{name} stores whole blocks of {block} per row; a width of {cols} is not")
    return {"qweight": ((rows, cols // 2), torch.uint8), "scales": ((rows, cols // block), torch.uint8)}


def _non_finite(device: torch.device) -> dict[str, torch.Tensor]:
    """What ``encode`` returns for NaN / inf input: ``quantize_tensor`` raises on the NaN scale."""
    return {"qweight": torch.zeros(0, dtype=torch.uint8, device=device),
            "scales": torch.full((1,), math.nan, device=device)}


def _block_absmax(x: torch.Tensor, block: int, work: _Work, out: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` ``[rows, cols]`` -> ``max |x|`` per block of ``block`` columns, as fp32 ``[rows, cols / block]``
    (a view of the int32 ``out``). The max is taken over the int32 bits of ``|x|``: for non-negative floats
    the bit order is the value order (several times faster than a float ``aminmax`` over a short last
    dimension), and NaN's bits exceed inf's, so ``out >= 0x7F800000`` flags a non-finite block.
    """
    rows, cols = x.shape
    m = torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=work.m[: rows * cols].view(rows, cols))
    torch.amax(m.view(rows, -1, block), dim=2, out=out)
    return out.view(torch.float32)


def _rows_per_chunk(cols: int) -> int:
    return max(1, _CHUNK_ELEMENTS // cols)


def _as_fp32_2d(w: torch.Tensor) -> torch.Tensor:
    w2 = w.reshape(as_2d(tuple(w.shape)))
    return w2 if w2.dtype == torch.float32 and w2.is_contiguous() else w2.float().contiguous()


# --------------------------------------------------------------------------- MXFP4


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block absmax (finite, >= 0) -> int32 biased E8M0 exponents ``e`` (module docstring formula).

    ``log2`` in fp64, rounded to fp32, then floored: numpy's fp32 ``log2`` as gguf calls it (see the module
    docstring), independent of the device's fp32 ``log2``. A zero block gets ``e = 0``.
    """
    log2 = torch.log2(amax.double()).float().floor_()
    e = torch.where(amax > 0, log2 - E2M1_EMAX + E8M0_BIAS, torch.zeros_like(log2))
    return e.clamp_(0, 254).to(torch.int32)


def _e8m0_to_fp32(e: torch.Tensor) -> torch.Tensor:
    """int biased exponents 0..254 -> ``2**(e - 127)`` in fp32, exactly (``e = 0`` is the subnormal 2**-127)."""
    e = e.to(torch.int32)
    normal = (e << 23).view(torch.float32)
    return torch.where(e > 0, normal, torch.full_like(normal, 2.0**-127))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float ``w`` ``[rows, cols]`` (``cols % 32 == 0``) -> ``(qweight uint8 [rows, cols/2], e uint8 [rows, cols/32])``.

    None when ``w`` holds NaN or inf. One chunk of rows at a time (temporaries stay in cache).
    """
    x = _as_fp32_2d(w)
    rows, cols = x.shape
    nb = cols // MXFP4_BLOCK
    qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
    if kernels.available(x):  # two compiled passes: block absmax, then scale + round + pack
        with kernels.owning_the_cores():
            amax_bits = kernels.block_absmax_bits(x, MXFP4_BLOCK)
            if bool((amax_bits >= _INF).any()):
                return None
            e = mxfp4_exponents(amax_bits.view(torch.float32))
            kernels.e2m1_blocks(x, e8m0_reciprocals(e), divide=False, ties_to_even=False, minus_zero=0, out=qweight)
            return qweight, e.to(torch.uint8)
    amax_bits = torch.empty(rows, nb, dtype=torch.int32, device=x.device)
    exps = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    step = min(rows, _rows_per_chunk(cols))  # buffers no larger than the matrix
    work = _work(step * cols, x.device)
    y = work.y[: step * cols].view(step, nb, MXFP4_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        amax = _block_absmax(x[r0:r1], MXFP4_BLOCK, work, out=amax_bits[r0:r1])
        e = mxfp4_exponents(amax)  # garbage for a non-finite block: refused after the loop
        exps[r0:r1] = e
        # 1 / 2**(e - 127) = 2**(127 - e): fp32 exponent field 254 - e, normal since e <= 252 (a < 2**128).
        inverse = e8m0_reciprocals(e).unsqueeze(2)
        yc = torch.mul(x[r0:r1].view(r1 - r0, nb, MXFP4_BLOCK), inverse, out=y[: r1 - r0])  # exact: a power-of-two rescale
        e2m1_pack(yc.view(r1 - r0, cols), qweight[r0:r1], ties_to_even=False, work=work)
    if bool((amax_bits >= _INF).any()):
        return None
    return qweight, exps


def dequantize_mxfp4(qweight: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1[code] * 2**(e - 127)`` in fp32 (exact), ``[rows, cols]``, cast to ``dtype``."""
    values = e2m1_values(qweight)
    rows, cols = values.shape
    scale = _e8m0_to_fp32(exps).reshape(rows, -1, 1)
    return values.view(rows, -1, MXFP4_BLOCK).mul_(scale).view(rows, cols).to(dtype)


# --------------------------------------------------------------------------- NVFP4


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Tensor absmax (fp32 scalar) -> fp32 ``[1]`` global scale, as compressed-tensors' ``generate_gparam``."""
    # A Python number over a tensor, exactly as generate_gparam writes it: torch evaluates it as
    # reciprocal(amax) * 2688 (two roundings), which can differ by an ulp from a true division.
    gs = NVFP4_GLOBAL_NUMERATOR / amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 block absmax + global scale -> E4M3 block scales as fp32 values (``calculate_qparams``)."""
    s = global_scale * (amax / 6.0)
    s = s.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, torch.full_like(s, E4M3_EPS), s)


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Float ``w`` ``[rows, cols]`` (``cols % 16 == 0``) -> ``(qweight uint8 [rows, cols/2], scale bits uint8
    [rows, cols/16], global_scale fp32 [1])``; None when ``w`` holds NaN or inf.

    ``global_scale``: use this tensor scale instead of ``2688 / max|w|`` (as compressed-tensors accepts a
    calibrated one); a block whose ``gs * a / 6`` exceeds 448 then saturates at 448.
    """
    x = _as_fp32_2d(w)
    rows, cols = x.shape
    nb = cols // NVFP4_BLOCK
    if kernels.available(x):  # two compiled passes: block absmax (the tensor's is their max), then the codes
        with kernels.owning_the_cores():
            amax_bits = kernels.block_absmax_bits(x, NVFP4_BLOCK)
            peak = amax_bits.max()
            if int(peak) >= _INF:
                return None
            amax = amax_bits.view(torch.float32)
            gs = nvfp4_global_scale(peak.view(torch.float32)) if global_scale is None else global_scale.float().reshape(1)
            s = nvfp4_block_scales(amax, gs)
            qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
            # a -0.0 (a -0.0 weight, or a negative one the division underflows) is +0, as in e2m1_pack below
            kernels.e2m1_blocks(x, s / gs, divide=True, ties_to_even=True, minus_zero=0, out=qweight)
            return qweight, s.to(torch.float8_e4m3fn).view(torch.uint8), gs
    lo, hi = torch.aminmax(x)  # one read pass: the tensor scale needs max |w| before any block
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return None
    gs = nvfp4_global_scale(torch.maximum(-lo, hi)) if global_scale is None else global_scale.float().reshape(1)
    step = min(rows, _rows_per_chunk(cols))  # buffers no larger than the matrix
    work = _work(step * cols, x.device)
    amax_bits = torch.empty(rows, nb, dtype=torch.int32, device=x.device)
    s = torch.empty(rows, nb, device=x.device)
    blocks_all = x.view(rows, nb, NVFP4_BLOCK)
    qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
    y = work.y[: step * cols].view(step, nb, NVFP4_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        amax = _block_absmax(x[r0:r1], NVFP4_BLOCK, work, out=amax_bits[r0:r1])
        sc = s[r0:r1]
        sc.copy_(nvfp4_block_scales(amax, gs))
        divisor = (sc / gs).unsqueeze(2)  # compressed-tensors: scale = scale / global_scale; x / scale
        yc = torch.div(blocks_all[r0:r1], divisor, out=y[: r1 - r0])
        # saturation at 6 is _quantize's clamp(y, -6, 6); a -0.0 (a -0.0 weight, or a negative one that the
        # division underflows) is +0, as compressed-tensors codes it (torch.sign(-0.0) is 0)
        e2m1_pack(yc.view(r1 - r0, cols), qweight[r0:r1], ties_to_even=True, work=work, minus_zero=0)
    scale_bits = s.to(torch.float8_e4m3fn).view(torch.uint8)
    return qweight, scale_bits, gs


def dequantize_nvfp4(
    qweight: torch.Tensor, scale_bits: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``E2M1[code] * (s / gs)`` in fp32 (compressed-tensors' ``_dequantize``), ``[rows, cols]``, cast to ``dtype``."""
    values = e2m1_values(qweight)
    rows, cols = values.shape
    step = scale_bits.view(torch.float8_e4m3fn).float() / global_scale.float().reshape(1)
    return values.view(rows, -1, NVFP4_BLOCK).mul_(step.reshape(rows, -1, 1)).view(rows, cols).to(dtype)


# --------------------------------------------------------------------------- the schemes


@dataclass(frozen=True)
class MXFP4Scheme:
    """OCP MXFP4: E2M1 in blocks of 32 along each row, one E8M0 (power-of-two) scale per block."""

    name: str = "mxfp4"
    kind = "fp4"
    bits = 4
    packed = True
    block_size = MXFP4_BLOCK
    scale_dtype = torch.uint8  # E8M0 bytes
    fixed_scale_dtype = True  # the scale format is part of the format: --scale-dtype does not apply
    parts = ("qweight", "scales")

    def resolve(self, shape: tuple[int, ...], name: str) -> MXFP4Scheme:
        """Called by ``quantize_tensor`` with the tensor's name: refuse a width that is not whole blocks."""
        _check_width(self.name, self.block_size, shape, name)
        return self

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_width(self.name, self.block_size, tuple(w.shape), "<tensor>")
        out = quantize_mxfp4(w)
        if out is None:
            return _non_finite(w.device)
        return {"qweight": out[0], "scales": out[1]}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = as_2d(shape)
        qweight = parts["qweight"].reshape(rows, cols // 2)
        return dequantize_mxfp4(qweight, parts["scales"].reshape(rows, -1), dtype).reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{part: (shape, dtype)}`` that ``encode`` stores: packed codes, one E8M0 byte per block of each row."""
        return _fp4_layout(self.name, self.block_size, shape)

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Stored bytes: ``n/2`` codes + ``n/32`` E8M0 scales = 4.25 bits per weight."""
        n = math.prod(shape)
        return n // 2 + n // self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bits": 4, "element": "e2m1", "granularity": "block",
                "block_size": self.block_size, "scale_dtype": "e8m0", "global_scale": None}

    # GGUF (``qkit.export.gguf``): llama.cpp's GGML type MXFP4 holds exactly these codes and exponents, in
    # another byte order; the writer stores ``to_ggml_blocks`` and a reader rebuilds the parts with
    # ``from_ggml_blocks`` (bit for bit: tested against ``gguf.quants``).
    @property
    def ggml_type(self) -> Any:
        """``gguf.GGMLQuantizationType.MXFP4`` (39); ``gguf`` is imported only when asked."""
        import gguf

        return gguf.GGMLQuantizationType.MXFP4

    def to_ggml_blocks(self, qt: Any) -> torch.Tensor:
        """A ``QuantizedTensor`` of this scheme -> GGML MXFP4 block bytes, uint8 ``[rows, cols/32 * 17]``."""
        rows, cols = as_2d(qt.shape)
        return to_gguf_mxfp4_blocks(qt.qweight.reshape(rows, cols // 2), qt.scales.reshape(rows, -1))

    def from_ggml_blocks(self, blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """GGML MXFP4 block bytes ``[rows, cols/32 * 17]`` -> the ``QuantizedTensor`` qkit quantized."""
        from qkit.schemes.quantized import QuantizedTensor

        rows, cols = as_2d(tuple(shape))
        qweight, exps = from_gguf_mxfp4_blocks(blocks.reshape(rows, -1))
        if tuple(qweight.shape) != (rows, cols // 2):
            raise SchemeError(f"MXFP4 blocks of {list(blocks.shape)} bytes do not hold a {list(shape)} tensor")
        return QuantizedTensor.from_parts(self, {"qweight": qweight, "scales": exps}, tuple(shape), dtype)


@dataclass(frozen=True)
class NVFP4Scheme:
    """NVIDIA NVFP4: E2M1 in blocks of 16 along each row, an FP8 E4M3 scale per block, an fp32 scale per tensor."""

    name: str = "nvfp4"
    kind = "fp4"
    bits = 4
    packed = True
    block_size = NVFP4_BLOCK
    scale_dtype = torch.float8_e4m3fn  # stored as its uint8 bit patterns (module docstring)
    fixed_scale_dtype = True
    parts = ("qweight", "scales", "global_scale")

    def resolve(self, shape: tuple[int, ...], name: str) -> NVFP4Scheme:
        _check_width(self.name, self.block_size, shape, name)
        return self

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_width(self.name, self.block_size, tuple(w.shape), "<tensor>")
        out = quantize_nvfp4(w)
        if out is None:
            return _non_finite(w.device)
        return {"qweight": out[0], "scales": out[1], "global_scale": out[2]}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = as_2d(shape)
        qweight = parts["qweight"].reshape(rows, cols // 2)
        out = dequantize_nvfp4(qweight, parts["scales"].reshape(rows, -1), parts["global_scale"], dtype)
        return out.reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{part: (shape, dtype)}`` that ``encode`` stores: as mxfp4's (E4M3 scale bytes) plus the fp32 global scale."""
        return {**_fp4_layout(self.name, self.block_size, shape), "global_scale": ((1,), torch.float32)}

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Stored bytes: ``n/2`` codes + ``n/16`` E4M3 scales + 4 (the fp32 global scale) = 4.5 + 32/n bits per weight."""
        n = math.prod(shape)
        return n // 2 + n // self.block_size + 4

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bits": 4, "element": "e2m1", "granularity": "block",
                "block_size": self.block_size, "scale_dtype": "e4m3", "global_scale": "fp32"}


MXFP4 = register(MXFP4Scheme())
NVFP4 = register(NVFP4Scheme())


def to_gguf_mxfp4_blocks(qweight: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """qkit mxfp4 parts -> GGML MXFP4 block bytes ``[rows, cols/32 * 17]``: per block the E8M0 byte, then 16
    bytes whose low nibble is element ``j`` and high nibble element ``j + 16`` (``gguf.quants.MXFP4``)."""
    codes = unpack_fp4(qweight)
    rows = codes.shape[0]
    blocks = codes.view(rows, -1, 2, MXFP4_BLOCK // 2)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).to(torch.uint8)
    return torch.cat((exps.reshape(rows, -1, 1), qs), dim=2).reshape(rows, -1)


def from_gguf_mxfp4_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_gguf_mxfp4_blocks`: GGML MXFP4 block bytes uint8 ``[rows, nb * 17]`` ->
    ``(qweight uint8 [rows, nb * 16], exps uint8 [rows, nb])`` in qkit's layout (:func:`pack_fp4`)."""
    rows = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.shape[1] % (MXFP4_BLOCK // 2 + 1):
        raise SchemeError(f"GGML MXFP4 rows are whole 17-byte blocks of uint8; got {blocks.dtype} {list(blocks.shape)}")
    b = blocks.reshape(rows, -1, MXFP4_BLOCK // 2 + 1)
    exps = b[:, :, 0].contiguous()
    qs = b[:, :, 1:]
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2)  # [rows, nb, 2, 16]: elements j and j + 16
    return pack_fp4(codes.reshape(rows, -1)), exps


# --------------------------------------------------------------------------- helpers for calibrated methods


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[16]``: the E2M1 value of every code 0..15 (code 8 is -0.0), as :func:`e2m1_values` decodes them."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)


def e8m0_values(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents 0..254 -> fp32 scales ``2**(e - 127)``, exactly as :func:`dequantize_mxfp4` decodes them."""
    return _e8m0_to_fp32(e)


def e8m0_reciprocals(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents 0..252 (from :func:`mxfp4_exponents`) -> fp32 ``2**(127 - e)``, the factor
    :func:`quantize_mxfp4` multiplies a block by (exact: a power of two, normal for ``e <= 252``)."""
    return ((2 * E8M0_BIAS - e.to(torch.int32)) << 23).view(torch.float32)
