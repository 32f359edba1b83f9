"""Symmetric absmax quantization for any bit width and granularity.

For each unit ``u`` (a tensor, a row or a group, see ``qkit.granularity``)::

    qmax  = 2**(bits-1) - 1
    scale = absmax(u) / qmax              computed in fp32, then stored in ``scale_dtype``
    q     = clamp(round(u / scale), -qmax - 1, qmax)     round half to even (torch.round)
    u_hat = q * scale

The *stored* scale (after the cast to ``scale_dtype``) is the one used both to quantize and to
dequantize, so an in-memory result and a saved-and-reloaded one are bit-identical, and the error of
every weight is at most half a step of that stored scale: the round-to-nearest cast of a scale that is
a normal number of ``scale_dtype`` moves ``absmax/scale`` by at most ``qmax * 2**-11`` (fp16) or
``qmax * 2**-9`` (bf16), less than the half step that ``clamp`` could cost. A scale that is subnormal
in ``scale_dtype`` (fp16: ``absmax < qmax * 2**-14``, far below any real weight) has a coarse absolute
grid, so where its rounding would put ``absmax/scale`` above ``qmax + 1/2`` (or flush it to 0 for a
nonzero unit) it is moved up one step of ``scale_dtype``: then ``scale >= absmax/qmax`` and the bound
holds. A unit of zeros has scale 0 and gives zeros, never NaN.

Storage (:class:`AbsmaxScheme`): 8 bits, ``qweight`` int8 ``[rows, cols]``; 4 bits, ``qweight`` uint8
``[ceil(rows*cols/2)]``, codes ``q + 8`` (0..15) of the row-major flattened matrix packed two per byte
(``qkit.schemes.packing``); ``scales`` ``granularity.scale_shape((rows, cols))`` in ``scale_dtype``.
Registered here: the quality table's ``int8-tensor`` ... ``int4-g128``, and the ``int{4,8}-g{N}`` family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.granularity import Granularity, PerGroup, PerRow, PerTensor
from qkit.schemes.base import DTYPE_NAMES, Layout, SchemeDefaults, as_2d
from qkit.schemes.packing import pack_nibbles, unpack_nibbles
from qkit.schemes.registry import register, register_family

SUPPORTED_BITS = (4, 8)


def absmax_scales(units: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """``units``: float ``[n_units, unit_len]`` -> stored scales ``[n_units, 1]`` in ``scale_dtype``."""
    qmax = 2 ** (bits - 1) - 1
    absmax = units.abs().amax(dim=1, keepdim=True)
    scales = (absmax / qmax).to(scale_dtype)
    # Only subnormal scales can be rounded down this far (see the module docstring); the test is on
    # the small scales tensor, and a non-finite scale compares False and is left for the caller.
    rounded_too_low = absmax > scales.float() * (qmax + 0.5)
    return torch.where(rounded_too_low, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)


def quantize_absmax(
    w: torch.Tensor, bits: int, granularity: Granularity, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight ``w`` ``[rows, cols]``.

    Returns ``(q, scales)``: ``q`` int8 ``[rows, cols]`` with values in ``[-qmax-1, qmax]``, and the
    stored ``scales`` in ``scale_dtype`` with shape ``granularity.scale_shape(w.shape)``.
    Non-finite input gives a non-finite scale; callers check the scales (see ``qkit.transform``).
    """
    qmax = 2 ** (bits - 1) - 1
    shape = tuple(w.shape)
    units = granularity.to_units(w if w.dtype == torch.float32 else w.float())
    scales = absmax_scales(units, bits, scale_dtype)
    divisor = scales.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))  # zero unit -> q = 0
    q = torch.div(units, divisor).round_().clamp_(-qmax - 1, qmax).to(torch.int8)
    return granularity.from_units(q, shape), scales.reshape(granularity.scale_shape(shape))


def dequantize_absmax(
    q: torch.Tensor, scales: torch.Tensor, granularity: Granularity, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q`` int8 ``[rows, cols]`` and stored ``scales`` -> ``q * scale`` in fp32, cast to ``dtype``."""
    shape = tuple(q.shape)
    units = granularity.to_units(q.to(torch.float32))
    w = units.mul_(scales.reshape(-1, 1).to(torch.float32))
    return granularity.from_units(w, shape).to(dtype)


@dataclass(frozen=True)
class AbsmaxScheme(SchemeDefaults):
    """Symmetric absmax integer quantization (module docstring) of ``bits`` per code, one scale per
    ``granularity`` unit."""

    name: str
    bits: int
    granularity: Granularity
    scale_dtype: torch.dtype = torch.float16
    kind = "absmax"

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise SchemeError(f"scheme {self.name!r}: bits must be one of {SUPPORTED_BITS}, got {self.bits}")

    parts = ("qweight", "scales")

    @property
    def packed(self) -> bool:
        return self.bits == 4

    @property
    def row_block(self) -> int:  # type: ignore[override]  # a group's width; per-row and per-tensor scales: 1
        return self.granularity.size if isinstance(self.granularity, PerGroup) else 1

    @property
    def description(self) -> str:
        g = self.granularity
        if isinstance(g, PerGroup):
            unit = f"{g.size} consecutive weights of a row"
        else:
            unit = "output row" if isinstance(g, PerRow) else "matrix"
        return f"symmetric absmax int{self.bits}, one scale per {unit}"

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_absmax(w.reshape(as_2d(tuple(w.shape))), self.bits, self.granularity, self.scale_dtype)
        return {"qweight": self.pack_codes(q), "scales": scales}

    def pack_codes(self, q: torch.Tensor) -> torch.Tensor:
        """int8 codes ``[rows, cols]`` -> stored ``qweight``: 4-bit codes offset-binary (``q + 8``) and packed."""
        return pack_nibbles((q + 8).to(torch.uint8)) if self.packed else q.to(torch.int8)

    def codes(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Stored ``qweight`` -> int8 codes ``[rows, cols]`` in ``[-qmax-1, qmax]``."""
        rows, cols = as_2d(shape)
        if self.packed:
            return (unpack_nibbles(parts["qweight"], rows * cols).to(torch.int8) - 8).view(rows, cols)
        return parts["qweight"].view(rows, cols)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        q = self.codes(parts, shape)
        return dequantize_absmax(q, parts["scales"], self.granularity, dtype).reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """``{part: (shape, dtype)}`` that ``encode`` stores for a weight of ``shape`` (checked on reading)."""
        rows, cols = as_2d(tuple(shape))
        q = ((-(-rows * cols // 2),), torch.uint8) if self.packed else ((rows, cols), torch.int8)
        return {"qweight": q, "scales": (self.granularity.scale_shape((rows, cols)), self.scale_dtype)}

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """``ceil(n/2)`` packed codes (4 bits) or ``n`` int8 codes, plus ``prod(scale_shape)`` scales."""
        return super().nbytes_for(shape)

    def to_dict(self) -> dict[str, Any]:
        g = self.granularity
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": self.bits,
            "granularity": "group" if isinstance(g, PerGroup) else g.label,
            "group_size": g.size if isinstance(g, PerGroup) else None,
            "scale_dtype": DTYPE_NAMES[self.scale_dtype],
            "symmetric": True,
        }


# The quality table's integer schemes, in its row order (nf4, its last row, registers in qkit.schemes.nf4).
for _s in (
    AbsmaxScheme("int8-tensor", 8, PerTensor()),
    AbsmaxScheme("int8-row", 8, PerRow()),
    AbsmaxScheme("int4-tensor", 4, PerTensor()),
    AbsmaxScheme("int4-row", 4, PerRow()),
    AbsmaxScheme("int4-g128", 4, PerGroup(128)),
):
    register(_s)


def _group_member(m: Any) -> AbsmaxScheme | None:
    bits, size = int(m.group(1)), int(m.group(2))
    return AbsmaxScheme(m.group(0), bits, PerGroup(size)) if bits in SUPPORTED_BITS and size > 0 else None


register_family(
    r"int(\d+)-g(\d+)",
    _group_member,
    "int4-gN / int8-gN for another group size N",
    names=("int4-gN", "int8-gN"),
    example="int4-g64",
    description="symmetric absmax, one scale per N consecutive weights of a row",
)
