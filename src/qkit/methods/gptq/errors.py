"""GPTQ's errors for the record: a weight's output error on its calibration inputs, and what ``--method rtn``
would store in its place (the reference every GPTQ solve is compared with, and the fallback).

Layer 5 (``qkit.methods.gptq``): tensors in, numbers and tensors out.
"""

from __future__ import annotations

import torch

from qkit.schemes import AbsmaxScheme, QuantizedTensor, Scheme, quantize_tensor
from qkit.schemes.absmax import dequantize_absmax, quantize_absmax


def output_errors(W: torch.Tensor, W_hats: list[torch.Tensor], XtX: torch.Tensor) -> list[float]:
    """``||W X - Ŵ X||² / ||W X||²`` for each ``Ŵ`` of ``W_hats``, from ``XtX = X Xᵀ`` (any positive scale):
    ``tr(Δ G Δᵀ) / tr(W G Wᵀ)`` with ``Δ = W - Ŵ``; fp32 matmuls, row sums accumulated in fp64."""
    G = XtX.to(torch.float32)
    W = W.to(device=G.device, dtype=torch.float32)
    den = _quadratic(W, G)
    return [_quadratic(W - h.to(device=G.device, dtype=torch.float32), G) / den if den > 0 else 0.0 for h in W_hats]


def _quadratic(M: torch.Tensor, G: torch.Tensor) -> float:
    """``tr(M G Mᵀ)``: rows of ``M @ G`` dotted with rows of ``M``, summed in fp64."""
    return float(torch.linalg.vecdot(M @ G, M).sum(dtype=torch.float64))


def output_error(W: torch.Tensor, W_hat: torch.Tensor, XtX: torch.Tensor) -> float:
    """``||W X - Ŵ X||² / ||W X||²`` (see ``output_errors``)."""
    return output_errors(W, [W_hat], XtX)[0]


def rtn_dequantized(W: torch.Tensor, scheme: Scheme, quant_weights: torch.Tensor | None = None,
                    tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """What ``--method rtn`` (with ``--imatrix``: ``quant_weights``, llama.cpp's types) would store for ``W``
    (fp32 ``[rows, cols]``), dequantized to fp32: absmax schemes through qkit's own quantizer without
    packing the codes; others through ``quantize_tensor`` (``tensor_amax``: nvfp4's fused group's, ``GroupScaled``)."""
    if isinstance(scheme, AbsmaxScheme):
        q, scales = quantize_absmax(W, scheme.bits, scheme.granularity, scheme.scale_dtype)
        return dequantize_absmax(q, scales, scheme.granularity, torch.float32)
    return quantize_tensor(W, scheme, quant_weights=quant_weights, tensor_amax=tensor_amax).dequantize(torch.float32)


def rtn_parts(full: str, W: torch.Tensor, scheme: Scheme, qw: torch.Tensor | None, shape: tuple[int, ...],
              dtype: torch.dtype, tensor_amax: torch.Tensor | None = None) -> tuple[QuantizedTensor, torch.Tensor]:
    """What ``--method rtn`` (with ``qw``, ``tensor_amax``) writes for ``W``, as stored at ``shape``/``dtype``, and its decoding."""
    qt = quantize_tensor(W, scheme, name=full, quant_weights=qw, tensor_amax=tensor_amax)
    return QuantizedTensor.from_parts(qt.scheme, qt.parts, shape, dtype), qt.dequantize(torch.float32)


__all__ = ["output_error", "output_errors", "rtn_dequantized", "rtn_parts"]
