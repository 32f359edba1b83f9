"""AWQ's arithmetic on one weight (Lin et al., arXiv:2306.00978; AutoAWQ's ``auto_scale`` and ``auto_clip``):
the fake quantization a search scores (``fake_quant``: what qkit writes), the scale formula
(``awq_scales``), and the clipping search per output row and group (``clip_thresholds``, ``apply_clip``).
The block walk and the fold that use them: ``qkit.methods.awq``.

Layer 5 (``methods``).
"""

from __future__ import annotations

import torch

from qkit.granularity import PerGroup, PerRow
from qkit.schemes import AbsmaxScheme, NF4Scheme, Scheme, quantize_tensor
from qkit.schemes.absmax import absmax_scales

# Defaults of the reference implementations (AutoAWQ ``_compute_best_scale`` / ``_compute_best_clip``).
N_GRID = 20
CLIP_GRID = 20
MAX_SHRINK = 0.5
SCALE_FLOOR = 1e-4


def fake_quant(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``deq(Q(w))`` in fp32 with qkit's own writer path, so a search optimises exactly what gets written.

    Absmax schemes skip only the (lossless) nibble packing: ``quantize_absmax`` then ``dequantize_absmax``
    is what ``quantize_tensor`` + ``dequantize`` compute (tested bit for bit); every other scheme goes
    through ``quantize_tensor`` itself."""
    if type(scheme) is AbsmaxScheme and w.dim() == 2:
        # quantize_absmax + dequantize_absmax without the int8 round trip (exact: the codes are integers
        # in [-128, 127]) and with the ops in place: a search calls this n_grid times per linear.
        g, qmax = scheme.granularity, 2 ** (scheme.bits - 1) - 1
        units = g.to_units(w.float())
        scales = absmax_scales(units, scheme.bits, scheme.scale_dtype).float()
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.div(units, divisor).round_().clamp_(-qmax - 1, qmax).mul_(scales)
        return g.from_units(q, tuple(w.shape))
    return quantize_tensor(w, scheme).dequantize(torch.float32)


def awq_scales(x_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """``s = clamp(x̄^ratio, 1e-4)``, normalised by ``sqrt(max(s)·min(s))`` (llm-awq ``auto_scale``); fp32 ``[c]``.
    ``ratio = 0`` gives exactly ones."""
    s = x_mean.float().pow(ratio).clamp(min=SCALE_FLOOR)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def scaled_fake_quant(w: torch.Tensor, cols: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``deq(Q(W · s)) / s`` for a weight ``[out, in]`` and column scales ``[in]``: the folded quantized
    weight seen from the original (unscaled) input."""
    return fake_quant(w.float() * cols, scheme) / cols


def clip_width(scheme: Scheme, cols: int) -> int | None:
    """Columns per clipping group: the scheme's scale unit when it is a group of one row (None: no clipping)."""
    g = scheme.granularity if isinstance(scheme, AbsmaxScheme) else None  # block formats have none
    if isinstance(g, PerGroup):
        return g.size
    if isinstance(g, PerRow):
        return cols
    if isinstance(scheme, NF4Scheme) and cols % scheme.block_size == 0:
        return scheme.block_size
    return None


def group_units(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., cols]`` -> ``[..., ceil(cols/width), width]`` (zero padding: changes no absmax, no product)."""
    pad = (-t.shape[-1]) % width
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(*t.shape[:-1], -1, width)


@torch.no_grad()
def clip_thresholds(
    w: torch.Tensor, x: torch.Tensor, scheme: Scheme, width: int, *, n_grid: int = CLIP_GRID, max_shrink: float = MAX_SHRINK
) -> torch.Tensor:
    """AutoAWQ's clipping search: per output row and group of ``width`` columns, the clamp threshold
    ``max|W_g| · (1 - i/n_grid)``, ``0 <= i < max_shrink · n_grid``, minimising the mean over tokens of
    ``(X_g · (deq(Q(clamp(W))) - W)_g)²`` (every group quantized with ``scheme`` at once per level).

    ``w``: ``[out, in]``; ``x``: ``[tokens, in]``. Returns fp32 ``[out, ceil(in/width)]``; ``i = 0`` (no
    clipping) is always a candidate.
    """
    w = w.float()
    rows, cols = w.shape
    xu = group_units(x.float(), width)  # [T, ng, G]
    org = group_units(w, width).abs().amax(dim=-1)  # [out, ng]
    best = org.clone()
    best_err = torch.full_like(org, float("inf"))
    for i in range(max(1, int(max_shrink * n_grid))):
        t = org * (1 - i / n_grid)
        bound = t.repeat_interleave(width, dim=1)[:, :cols]
        dw = fake_quant(torch.maximum(torch.minimum(w, bound), -bound), scheme) - w
        err = _group_output_error(xu, group_units(dw, width))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, t, best)
    return best


def _group_output_error(xu: torch.Tensor, du: torch.Tensor, max_elems: int = 1 << 24) -> torch.Tensor:
    """``mean_t (sum_k xu[t,g,k] · du[r,g,k])²`` -> ``[out, ng]``, in row chunks to bound memory."""
    rows = du.shape[0]
    chunk = max(1, max_elems // max(1, xu.shape[0] * xu.shape[1]))
    out = []
    for r in range(0, rows, chunk):
        y = torch.einsum("tgk,rgk->rgt", xu, du[r : r + chunk])
        out.append(y.pow(2).mean(dim=-1))
    return torch.cat(out)


def apply_clip(w: torch.Tensor, thresholds: torch.Tensor, width: int) -> torch.Tensor:
    """Clamp ``w`` ``[out, in]`` to ``±thresholds`` ``[out, ng]`` per group of ``width`` columns."""
    bound = thresholds.repeat_interleave(width, dim=1)[:, : w.shape[1]].to(w.dtype)
    return torch.maximum(torch.minimum(w, bound), -bound)


__all__ = ["CLIP_GRID", "MAX_SHRINK", "N_GRID", "SCALE_FLOOR", "apply_clip", "awq_scales", "clip_thresholds", "clip_width",
           "fake_quant", "group_units", "scaled_fake_quant"]
