"""``QuantizedTensor``: what a scheme makes of one weight, and the one way back to floats.

Storage, per scheme kind (this is also the on-disk layout, see ``qkit.checkpoint``):

* absmax, 8 bits: ``qweight`` int8 ``[rows, cols]``; ``scales`` ``granularity.scale_shape``.
* absmax, 4 bits: ``qweight`` uint8 ``[ceil(rows*cols/2)]``: codes ``q + 8`` (0..15) of the row-major
  flattened matrix, packed two per byte, even element in the high nibble (``qkit.schemes.packing``).
* nf4: ``qweight`` uint8 ``[ceil(n/2)]`` with the same nibble order (identical to bitsandbytes' bytes);
  ``scales`` the per-block absmax ``[ceil(n/64)]``.
* ggml (llama.cpp block types q8_0 ... q6_k, ``qkit.schemes.ggml`` / ``kquants``): ``qweight`` uint8
  ``[rows, bytes_per_row]``, row ``r`` exactly llama.cpp's blocks of row ``r``; the scales live inside the
  blocks, so ``scales`` is an empty fp16 tensor (and ``encode`` itself refuses NaN/inf weights).

Tensors with more than two dimensions are quantized as ``[shape[0], prod(shape[1:])]``; 1-D as ``[1, n]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes.base import GroupScaled, ImportanceWeighted, Scheme, as_2d

__all__ = ["QuantizedTensor", "as_2d", "check_parts", "dequantize", "quantize_tensor"]


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """One quantized weight: ``qweight`` and ``scales`` (every scheme has both) plus any ``extra`` parts
    the scheme stores (``scheme.parts`` names them all, in order)."""

    scheme: Scheme
    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype  # the original weight's dtype, restored by ``dequantize`` by default
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_parts(
        cls, scheme: Scheme, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
        *, name: str = "<tensor>",
    ) -> QuantizedTensor:
        """Assemble stored parts, refusing (``SchemeError`` naming ``name``) parts whose names, shapes or
        dtypes are not exactly what ``scheme`` stores for a weight of ``shape`` (``scheme.part_layout``):
        a decoder would otherwise read past, cut or reinterpret them into silently wrong weights."""
        check_parts(scheme, parts, tuple(shape), name)
        extra = {k: v for k, v in parts.items() if k not in ("qweight", "scales")}
        return cls(scheme, parts["qweight"], parts["scales"], tuple(shape), dtype, extra)

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, **self.extra}

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of storage: codes, scales and any extra parts."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors stored for weight ``name`` in a checkpoint: ``name.qweight``, ``name.scales``, ..."""
        return {f"{name}.{k}": v for k, v in self.parts.items()}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)


def check_parts(scheme: Scheme, parts: dict[str, Any], shape: tuple[int, ...], name: str = "<tensor>") -> None:
    """Refuse parts that are not what ``scheme`` stores for a ``shape`` weight. ``parts`` maps each part
    name to a tensor, or to anything with ``shape`` and ``dtype`` (a header's description of one)."""
    try:
        layout = scheme.part_layout(tuple(shape))
    except SchemeError as exc:
        raise SchemeError(f"tensor {name}: a {list(shape)} weight cannot be stored in {scheme.name} ({exc})") from None
    if set(parts) != set(layout):
        raise SchemeError(
            f"tensor {name}: stored parts {', '.join(sorted(parts)) or 'none'}, but {scheme.name} stores "
            f"{', '.join(sorted(layout))}"
        )
    for part, (want_shape, want_dtype) in layout.items():
        got = parts[part]
        if tuple(got.shape) != tuple(want_shape) or got.dtype != want_dtype:
            raise SchemeError(
                f"tensor {name}: {part} is {str(got.dtype).removeprefix('torch.')} {list(got.shape)}, but a "
                f"{list(shape)} weight in {scheme.name} stores {str(want_dtype).removeprefix('torch.')} {list(want_shape)}"
            )


def quantize_tensor(
    w: torch.Tensor, scheme: Scheme, *, name: str = "<tensor>", quant_weights: torch.Tensor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize one floating-point tensor with ``scheme``; runs on ``w``'s device.

    ``quant_weights`` (fp32 ``[cols]``, an importance matrix's entry for this tensor) goes to a scheme that
    takes one (``ImportanceWeighted``: llama.cpp's block types); any other scheme refuses it.
    ``tensor_amax`` (fp32 scalar, the largest ``max |w|`` of the fused group ``w`` belongs to) goes to a scheme
    with a per-tensor scale a fused layer shares (``GroupScaled``: nvfp4); any other scheme refuses it.

    Raises ``NonFiniteWeightError`` (naming ``name``) for NaN/inf weights, and ``SchemeError`` when a
    scale overflows the scale dtype. ``scheme.resolve(shape, name)`` first picks the scheme actually used
    (a mixture recipe such as ``q4_k_m`` by name, a block format that falls back to another type for a
    width it cannot take; every other scheme is itself); the result's ``scheme`` is that one.
    """
    if not w.is_floating_point():
        raise SchemeError(f"tensor {name} has dtype {w.dtype}; only floating-point weights can be quantized")
    shape = tuple(w.shape)
    if w.numel() == 0:
        raise SchemeError(f"tensor {name} is empty (shape {list(shape)}); exclude it from quantization")
    w = w.detach()  # a parameter that requires grad (quantization is not differentiated through)
    scheme = scheme.resolve(shape, name)  # a recipe or a format with a fallback picks the scheme per tensor
    if tensor_amax is not None and not isinstance(scheme, GroupScaled):
        raise SchemeError(f"tensor {name}: {scheme.name} has no per-tensor scale a fused layer shares (nvfp4 has)")
    try:
        if tensor_amax is not None:
            parts = scheme.encode_grouped(w, tensor_amax)
        elif quant_weights is None:
            parts = scheme.encode(w)
        elif isinstance(scheme, ImportanceWeighted):
            parts = scheme.encode(w, quant_weights=quant_weights)
        else:
            raise SchemeError(
                f"tensor {name}: {scheme.name} does not take an importance matrix (--imatrix applies to llama.cpp's block types)"
            )
    except NonFiniteWeightError:  # block formats find non-finite weights themselves (their scales are inside)
        raise NonFiniteWeightError(
            f"tensor {name} contains NaN or infinite values; fix the source weights or exclude it from quantization (qkit quantize --exclude)"
        ) from None
    scales = parts["scales"]
    if scales.is_floating_point() and not torch.isfinite(scales).all():
        # An absmax propagates NaN and inf, so checking the (small) scales finds any non-finite weight.
        if not torch.isfinite(w).all():
            raise NonFiniteWeightError(
                f"tensor {name} contains NaN or infinite values; fix the source weights or exclude it from quantization (qkit quantize --exclude)"
            )
        raise SchemeError(
            f"tensor {name}: a scale overflows {scheme.scale_dtype} (max |w| = {w.abs().max().item():.4g}); "
            "use --scale-dtype fp32"
        )
    return QuantizedTensor.from_parts(scheme, parts, shape, w.dtype, name=name)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``QuantizedTensor`` -> float tensor of the original shape, in ``dtype`` (default: the original)."""
    return qt.scheme.decode(qt.parts, qt.shape, dtype or qt.dtype)
