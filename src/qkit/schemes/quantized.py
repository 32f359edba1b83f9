"""``QuantizedTensor``: what a scheme makes of one weight, and the one way back to floats.

Storage, per scheme kind (this is also the on-disk layout, see ``qkit.checkpoint``):

* absmax, 8 bits: ``qweight`` int8 ``[rows, cols]``; ``scales`` ``granularity.scale_shape``.
* absmax, 4 bits: ``qweight`` uint8 ``[ceil(rows*cols/2)]``: codes ``q + 8`` (0..15) of the row-major
  flattened matrix, packed two per byte, even element in the high nibble (``qkit.schemes.packing``).
* nf4: ``qweight`` uint8 ``[ceil(n/2)]`` with the same nibble order (identical to bitsandbytes' bytes);
  ``scales`` the per-block absmax ``[ceil(n/64)]``.

Tensors with more than two dimensions are quantized as ``[shape[0], prod(shape[1:])]``; 1-D as ``[1, n]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes.absmax import dequantize_absmax, quantize_absmax
from qkit.schemes.nf4 import dequantize_nf4, quantize_nf4
from qkit.schemes.packing import pack_nibbles, unpack_nibbles
from qkit.schemes.registry import AbsmaxScheme, NF4Scheme, Scheme


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    scheme: Scheme
    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype  # the original weight's dtype, restored by ``dequantize`` by default

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of storage: packed codes plus scales."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors stored for weight ``name`` in a checkpoint."""
        return {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view a scheme quantizes: ``[shape[0], prod(shape[1:])]``; 1-D as ``[1, n]``."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


def quantize_tensor(w: torch.Tensor, scheme: Scheme, *, name: str = "<tensor>") -> QuantizedTensor:
    """Quantize one floating-point tensor with ``scheme``; runs on ``w``'s device.

    Raises ``NonFiniteWeightError`` (naming ``name``) for NaN/inf weights, and ``SchemeError`` when a
    scale overflows the scale dtype.
    """
    if not w.is_floating_point():
        raise SchemeError(f"tensor {name} has dtype {w.dtype}; only floating-point weights can be quantized")
    shape = tuple(w.shape)
    if w.numel() == 0:
        raise SchemeError(f"tensor {name} is empty (shape {list(shape)}); exclude it from quantization")
    if isinstance(scheme, NF4Scheme):
        qweight, scales = quantize_nf4(w, scheme.block_size, scheme.scale_dtype)
    elif isinstance(scheme, AbsmaxScheme):
        q, scales = quantize_absmax(w.reshape(as_2d(shape)), scheme.bits, scheme.granularity, scheme.scale_dtype)
        # 4-bit codes are stored offset-binary: q + 8 maps -8..7 to 0..15.
        qweight = pack_nibbles((q + 8).to(torch.uint8)) if scheme.packed else q
    else:  # pragma: no cover - the registry only makes the two kinds
        raise SchemeError(f"unsupported scheme {scheme!r}")
    if not torch.isfinite(scales).all():
        # An absmax propagates NaN and inf, so checking the (small) scales finds any non-finite weight.
        if not torch.isfinite(w).all():
            raise NonFiniteWeightError(
                f"tensor {name} contains NaN or infinite values; fix the source weights or exclude it with --exclude"
            )
        raise SchemeError(
            f"tensor {name}: a scale overflows {scheme.scale_dtype} (max |w| = {w.abs().max().item():.4g}); "
            "use --scale-dtype fp32"
        )
    return QuantizedTensor(scheme, qweight, scales, shape, w.dtype)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``QuantizedTensor`` -> float tensor of the original shape, in ``dtype`` (default: the original)."""
    dtype = dtype or qt.dtype
    scheme = qt.scheme
    if isinstance(scheme, NF4Scheme):
        return dequantize_nf4(qt.qweight, qt.scales, qt.shape, scheme.block_size, dtype)
    rows, cols = as_2d(qt.shape)
    if scheme.packed:
        q = (unpack_nibbles(qt.qweight, rows * cols).to(torch.int8) - 8).view(rows, cols)
    else:
        q = qt.qweight.view(rows, cols)
    return dequantize_absmax(q, qt.scales, scheme.granularity, dtype).reshape(qt.shape)
