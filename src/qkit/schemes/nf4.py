"""NF4: the 16 QLoRA levels (normal-distribution quantiles) with an absmax per block of 64.

Blocks are taken over the *flattened* tensor, exactly as bitsandbytes does (a block may cross a row
boundary; a last, shorter block gets its own absmax). Codes are chosen as bitsandbytes'
``quantize_4bit(..., quant_type="nf4")`` chooses them, bit for bit:

    scaled = w * (1 / absmax)        for full blocks (bitsandbytes multiplies by the reciprocal)
    scaled = w / absmax              for the short tail block (bitsandbytes divides there)
    code   = bucketize(scaled, midpoints)   midpoints of adjacent levels in fp32; a value exactly on
                                            a midpoint takes the lower level (``right=False``)

(The codes are computed by :func:`nf4_codes`, a lookup on each value's top 12 bits plus one compare,
which equals ``bucketize`` exactly and is several times faster on CPU.) Codes are always computed from
the fp32 absmax; the absmax is then stored in ``scale_dtype``
(fp16 by default: 4 + 16/64 = 4.25 bits per weight) and dequantization is ``NF4[code] * stored_absmax``
in fp32, which with ``scale_dtype=float32`` equals bitsandbytes' ``dequantize_4bit`` exactly.

Storage (:class:`NF4Scheme`, registered as ``nf4``): ``qweight`` uint8 ``[ceil(n/2)]``, the codes of the
flattened tensor packed two per byte as ``qkit.schemes.packing`` does (bitsandbytes' bytes); ``scales``
the per-block absmax ``[ceil(n/block_size)]`` in ``scale_dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes.base import DTYPE_NAMES, Layout, SchemeDefaults
from qkit.schemes.packing import pack_nibbles, unpack_nibbles
from qkit.schemes.registry import register

# The NF4 levels, as float32, from Dettmers et al., "QLoRA" (2023), Appendix E, and bitsandbytes'
# ``get_4bit_type("nf4")``; they are the quantiles of N(0, 1) normalised to [-1, 1] with an exact 0.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_LUTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

# Code lookup by the top 12 bits of an fp32 value (sign, 8 exponent bits, 3 mantissa bits): each such
# bucket is an interval of floats of one sign, 1/8 of a binade wide. Adjacent NF4 midpoints of one
# sign are at least 1.28x apart, so a bucket holds at most one midpoint (checked when the table is
# built), and the code of any x in the bucket is ``CODE_LO[key] + (x > THRESHOLD[key])``, with
# ``THRESHOLD`` the midpoint inside the bucket (+inf if none). This equals ``bucketize`` exactly.
_KEY_SHIFT = 20
_KEY_MASK = (1 << (32 - _KEY_SHIFT)) - 1


def nf4_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, midpoints)`` as fp32 tensors on ``device`` (cached; read-only by convention)."""
    device = torch.device(device)
    if device not in _TABLES:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
        _TABLES[device] = (levels, (levels[:-1] + levels[1:]) / 2)
    return _TABLES[device]


def _code_luts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CODE_LO int32[4096], THRESHOLD fp32[4096])`` for :func:`nf4_codes` (cached per device)."""
    if device not in _LUTS:
        _, midpoints = nf4_tables("cpu")
        keys = torch.arange(_KEY_MASK + 1, dtype=torch.int64)
        first = keys << _KEY_SHIFT  # the bucket's bit patterns run from ``first`` to ``last``
        last = first | ((1 << _KEY_SHIFT) - 1)

        def as_float(bits: torch.Tensor) -> torch.Tensor:  # uint32 bit pattern (held in int64) -> fp32
            return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)

        a, b = as_float(first), as_float(last)
        low, high = torch.minimum(a, b), torch.maximum(a, b)  # negative buckets run backwards
        code_low = torch.bucketize(low, midpoints)
        code_high = torch.bucketize(high, midpoints)
        finite = torch.isfinite(low) & torch.isfinite(high)
        if bool(((code_high - code_low)[finite] > 1).any()):  # pragma: no cover - a property of the levels
            raise RuntimeError("NF4 lookup table: a bucket holds two midpoints; lower _KEY_SHIFT")
        inner = midpoints[code_low.clamp(max=len(midpoints) - 1)]
        threshold = torch.where(code_high > code_low, inner, torch.full_like(low, float("inf")))
        _LUTS[device] = (code_low.to(torch.int32).to(device), threshold.to(device))
    return _LUTS[device]


def nf4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 ``scaled`` ``[m]`` (contiguous) -> int32 codes ``[m]``, equal to
    ``torch.bucketize(scaled, midpoints)`` (``right=False``: a value exactly on a midpoint takes the
    lower level) for every finite value, in a few vectorised passes instead of a binary search each.
    """
    code_lo, threshold = _code_luts(scaled.device)
    key = (scaled.view(torch.int32) >> _KEY_SHIFT).bitwise_and_(_KEY_MASK)  # int32 indices: no int64 copy
    # x > t  <=>  t - x < 0: the sign of an IEEE difference is exact (it is 0 only when x == t), and
    # t = +inf gives +inf. The sign bit, shifted down arithmetically, is -1 where x > t, else 0.
    up = threshold.index_select(0, key).sub_(scaled).view(torch.int32).bitwise_right_shift_(31)
    return code_lo.index_select(0, key).sub_(up)


def quantize_nf4(
    w: torch.Tensor, block_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any-shape float ``w`` -> ``(packed uint8[ceil(n/2)], absmax[ceil(n/block_size)] in scale_dtype)``.

    Byte for byte bitsandbytes' ``quantize_4bit`` output, the padding nibble of an odd ``n`` included
    (bitsandbytes pads the scaled values with 0.0, so the pad is code 7). One matrix at a time: the
    scaled values of the full blocks and of the tail are written into one buffer (no ``torch.cat``).
    Non-finite input gives a non-finite absmax; callers check it (see ``qkit.transform``).
    """
    flat = w.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    n = flat.numel()
    full = n - n % block_size
    n_full = full // block_size
    absmax = torch.empty(-(-n // block_size), dtype=torch.float32, device=flat.device)
    scaled = torch.empty(n + n % 2, dtype=torch.float32, device=flat.device)
    if n_full:
        blocks = flat[:full].view(n_full, block_size)
        torch.amax(blocks.abs(), dim=1, out=absmax[:n_full])
        # bitsandbytes: A * (1.0 / absmax.clamp(min=1e-38)); the same two roundings, bit for bit.
        # No clamp of the result to [-1, 1] as bitsandbytes does: values beyond the outer midpoints
        # get code 0 or 15 either way, so the codes are identical and a pass is saved.
        inverse = (1.0 / absmax[:n_full].clamp(min=1e-38)).unsqueeze(1)
        torch.mul(blocks, inverse, out=scaled[:full].view(n_full, block_size))
    if full < n:
        tail = flat[full:]
        tail_max = tail.abs().amax()
        absmax[n_full] = tail_max
        torch.div(tail, tail_max.clamp(min=1e-38), out=scaled[full:n])  # bitsandbytes divides here
    if n % 2:
        scaled[n] = 0.0
    return pack_nibbles(nf4_codes(scaled)), absmax.to(scale_dtype)


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``NF4[code] * absmax`` in fp32, reshaped to ``shape``."""
    levels, _ = nf4_tables(packed.device)
    n = 1
    for d in shape:
        n *= d
    values = levels[unpack_nibbles(packed, n).long()]
    absmax = absmax.to(torch.float32)
    full = n - n % block_size
    values[:full].view(-1, block_size).mul_(absmax[: full // block_size].unsqueeze(1))
    if full < n:
        values[full:].mul_(absmax[-1])
    return values.reshape(shape).to(dtype)


@dataclass(frozen=True)
class NF4Scheme(SchemeDefaults):
    """NF4 codebook with a flattened absmax per block (module docstring)."""

    name: str = "nf4"
    block_size: int = 64
    scale_dtype: torch.dtype = torch.float16
    kind = "nf4"
    bits = 4
    packed = True

    parts = ("qweight", "scales")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError(f"NF4 block size must be positive, got {self.block_size}")

    @property
    def description(self) -> str:
        return (f"NF4 codebook (normal quantiles), absmax per block of {self.block_size} of the flattened "
                "matrix, as bitsandbytes")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales = quantize_nf4(w, self.block_size, self.scale_dtype)
        return {"qweight": qweight, "scales": scales}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4(parts["qweight"], parts["scales"], shape, self.block_size, dtype)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """``{part: (shape, dtype)}`` that ``encode`` stores: codes of the flattened tensor, one absmax per block."""
        n = math.prod(shape)
        return {"qweight": ((-(-n // 2),), torch.uint8), "scales": ((-(-n // self.block_size),), self.scale_dtype)}

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """``ceil(n/2)`` packed codes plus ``ceil(n/block_size)`` absmax values in ``scale_dtype``."""
        return super().nbytes_for(shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": 4,
            "granularity": "block",
            "block_size": self.block_size,
            "scale_dtype": DTYPE_NAMES[self.scale_dtype],
        }


NF4 = register(NF4Scheme())
