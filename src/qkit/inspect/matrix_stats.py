"""Statistics of one weight matrix and the relative error a scheme leaves in it (tensors in, numbers out).

Layer 7 (``inspect``), reading only ``schemes`` and ``granularity`` (layer 2): the formulas are in
``qkit.inspect.errors``' module docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from qkit.granularity import PerTensor
from qkit.schemes import Scheme, quantize_tensor
from qkit.schemes.absmax import quantize_absmax

SIGMA_OUTLIER = 6.0  # "beyond 6 sigma": |w - mean| > 6 std
SIGMA_TYPICAL = 3.0  # "typical weights": |w - mean| <= 3 std (99.7% of a normal distribution)


@dataclass(frozen=True)
class MatrixStats:
    name: str
    shape: tuple[int, ...]
    mean_abs: float
    std: float
    max_abs: float
    beyond_6sigma: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def max_over_std(self) -> float:
        return self.max_abs / self.std if self.std > 0 else math.inf if self.max_abs > 0 else 0.0

    @property
    def share_beyond_6sigma(self) -> float:
        return self.beyond_6sigma / self.numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "mean_abs": self.mean_abs,
            "std": self.std,
            "max_abs": self.max_abs,
            "max_over_std": self.max_over_std,
            "beyond_6sigma": self.beyond_6sigma,
            "share_beyond_6sigma": self.share_beyond_6sigma,
        }


_BLOCK = 1024


def sum64(x: torch.Tensor) -> float:
    """Sum of a float tensor: fp32 partial sums over blocks of 1024 terms, block totals in float64."""
    flat = x.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    k = flat.numel() - flat.numel() % _BLOCK
    total = flat[:k].view(-1, _BLOCK).sum(dim=1).double().sum() if k else torch.zeros((), dtype=torch.float64)
    return float(total + flat[k:].double().sum())


def sumsq64(x: torch.Tensor) -> float:
    """``sum x^2`` (one fp32 temporary), accumulated as in :func:`sum64`."""
    return sum64(x.float().square())


def matrix_stats(w: torch.Tensor, name: str = "<tensor>") -> MatrixStats:
    """Statistics of one weight tensor (any shape, any float dtype), in float64 (formulas: module doc)."""
    n = w.numel()
    a = w.detach().float().abs()
    centred = w.detach().reshape(-1).double()  # float64 throughout: the mean is subtracted exactly
    centred -= centred.mean()
    std = math.sqrt(float(torch.dot(centred, centred)) / n)
    beyond = int((centred.abs_() > SIGMA_OUTLIER * std).sum()) if std > 0 else 0
    return MatrixStats(name, tuple(w.shape), sum64(a) / n, std, float(a.max()), beyond)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor, norm_w: float | None = None) -> float:
    """``||w - w_hat||_F / ||w||_F``, sums of squares accumulated in float64 (0 for an all-zero ``w``).

    ``norm_w``: ``||w||_F`` when the caller already has it (one matrix, several schemes).
    """
    w = w.detach().float()
    denom = math.sqrt(sumsq64(w)) if norm_w is None else norm_w
    num = math.sqrt(sumsq64(w - w_hat.detach().float()))
    return num / denom if denom > 0 else (0.0 if num == 0 else math.inf)


def reconstruct(w: torch.Tensor, scheme: Scheme, name: str = "<tensor>") -> tuple[torch.Tensor, int]:
    """``(W_hat fp32, stored bytes)``: exactly what ``qkit quantize`` writes for ``w``, dequantized."""
    qt = quantize_tensor(w, scheme, name=name)
    return qt.dequantize(torch.float32), qt.nbytes


def int4_tensor_levels(w: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """How many of the 16 per-tensor int4 levels the weights use: all of them, and the typical ones.

    ``q = clamp(round(w / s), -8, 7)`` with ``s = max|w| / 7`` (stored in ``scale_dtype``), the same call
    ``int4-tensor`` makes. Typical weights: ``|w - mean| <= 3 std``. ``zero_share``: share of all
    weights that round to level 0 (they are lost entirely).
    """
    wf = w.detach().float().reshape(1, -1)
    q, scale = quantize_absmax(wf, 4, PerTensor(), scale_dtype)
    wd = wf.double()
    mean = wd.mean()
    std = (wd - mean).square().mean().sqrt()
    typical = (wd - mean).abs() <= SIGMA_TYPICAL * std
    return {
        "scale": float(scale.float().reshape(())),
        "levels_total": 16,
        "levels_used": int(torch.unique(q).numel()),
        "typical_levels_used": int(torch.unique(q[typical]).numel()) if bool(typical.any()) else 0,
        "typical_share": float(typical.double().mean()),
        "zero_share": float((q == 0).double().mean()),
    }


__all__ = ["MatrixStats", "int4_tensor_levels", "matrix_stats", "reconstruct", "relative_error", "sum64", "sumsq64"]
