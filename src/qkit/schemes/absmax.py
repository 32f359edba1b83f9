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
"""

from __future__ import annotations

import torch

from qkit.granularity import Granularity


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
