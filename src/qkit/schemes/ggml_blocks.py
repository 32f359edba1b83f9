"""What every llama.cpp block encoder shares: the C loops' extremes, fp16 scales, the C casts and roundings,
and the nibble and high-bit packing, each exactly as ``ggml-quants.c`` computes it.

Layer 2 (``schemes/``): tensors in, tensors out. Used by the 32-block types (:mod:`qkit.schemes.ggml`), the
k-quants, the i-quants and the weighted encoders; the exactness notes are :mod:`qkit.schemes.ggml`'s.
"""

from __future__ import annotations

import numpy as np
import torch

from qkit.errors import NonFiniteWeightError, SchemeError

FLT_MIN = 2.0**-126  # smallest normal fp32: a ``d`` below it may make ``1/d`` overflow


def check_finite(*stats: torch.Tensor) -> None:
    """``NonFiniteWeightError`` when any of ``stats`` (per-block extremes, which NaN and inf reach: amax and
    amin propagate NaN, and an inf is its own extreme) is not finite. The scales are inside the blocks, so
    the caller's scale check cannot see them."""
    finite = torch.isfinite(stats[0])
    for s in stats[1:]:
        finite &= torch.isfinite(s)
    if not bool(finite.all()):
        raise NonFiniteWeightError(
            "a weight tensor contains NaN or infinite values (llama.cpp block formats keep their scales "
            "inside the blocks); fix the source weights or exclude the tensor from quantization (qkit quantize --exclude)"
        )


def fp16_scale(d: torch.Tensor, what: str, peak: torch.Tensor) -> torch.Tensor:
    """fp32 ``d`` -> fp16 (round to nearest even, as ``GGML_FP32_TO_FP16``). A non-finite result is either a
    NaN / inf weight, which reaches ``peak`` (per-block extremes: ``amax`` / ``amin`` propagate NaN, and
    an inf is its own extreme), ``NonFiniteWeightError``, or a scale beyond fp16's range, ``SchemeError``.
    So the encoders need no separate pass over the weights to refuse NaN and inf."""
    h = d.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        check_finite(peak)
        raise SchemeError(
            f"a block {what} overflows fp16 (max |w| = {peak.abs().max().item():.4g}); llama.cpp block formats "
            "store fp16 scales: scale the weights down or exclude the tensor from quantization (qkit quantize --exclude)"
        )
    return h


def fp16_bytes(h: torch.Tensor) -> torch.Tensor:
    """fp16 ``[n]`` -> its little-endian bytes, uint8 ``[n, 2]``."""
    return h.contiguous().view(torch.uint8).view(-1, 2)


def read_fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block (uint8 ``[nb, size]``), as fp32 ``[nb, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def signed_extreme(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, max)`` of every row of ``x`` ``[nb, n]``: ``amax = max|x|`` and ``max`` the *first* element
    with ``|x| = amax`` (with its sign), ``+0`` for a row of zeros, as the C loop
    ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` finds them. A NaN or inf reaches both."""
    hi, lo = x.amax(dim=1), x.amin(dim=1)
    amax = torch.maximum(hi, -lo)
    mx = torch.where(hi >= -lo, hi, lo)
    tie = (hi == -lo) & (hi != 0)  # both +a and -a occur: the first one wins (rare: look it up)
    if bool(tie.any()):
        rows = tie.nonzero().squeeze(1)
        sub = x.index_select(0, rows)
        first = (sub.abs() == amax.index_select(0, rows).unsqueeze(1)).to(torch.uint8).argmax(dim=1)
        mx = mx.index_put((rows,), sub.gather(1, first.unsqueeze(1)).squeeze(1))
    zero = amax == 0
    return amax.abs(), torch.where(zero, torch.zeros_like(mx), mx)


def first_extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of every row as the C loops ``if (v < min) min = v; if (v > max) max = v;`` find them:
    the values of ``amin``/``amax``, and where an extreme is zero, the sign of the row's first zero."""
    mn, mx = x.amin(dim=1), x.amax(dim=1)
    for ext in (mn, mx):
        zero = ext == 0
        if bool(zero.any()):
            rows = zero.nonzero().squeeze(1)
            sub = x.index_select(0, rows)
            first = (sub == 0).to(torch.uint8).argmax(dim=1)
            ext.index_put_((rows,), sub.gather(1, first.unsqueeze(1)).squeeze(1))
    return mn, mx


def inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1.0f/d : 0.0f`` (fp32)."""
    return torch.where(d != 0, torch.ones_like(d).div_(d), torch.zeros_like(d))


def subnormal(d: torch.Tensor) -> torch.Tensor:
    """Blocks whose fp32 ``d`` is nonzero and below the normal range: there ``x/d`` is not bounded by the
    code range (``d`` has lost precision, ``1/d`` may overflow), so the C casts can wrap or see inf/NaN."""
    return (d != 0) & (d.abs() < FLT_MIN)


def c_bytes(v: torch.Tensor, idv: torch.Tensor, cap: int | None) -> torch.Tensor:
    """The byte the C code stores for ``(int8_t)v`` (then ``MIN(cap, .)``), exactly, for any fp32 ``v``
    ``[nb, n]``: rows whose ``1/d`` (``idv``) overflowed hold inf/NaN, which x86-64 converts to
    ``0x80000000``, low byte 0; other values are truncated and wrapped to a byte."""
    bad = ~torch.isfinite(idv)
    q = torch.where(bad.unsqueeze(1), 0.0, v).to(torch.int32)
    if cap is not None:
        q = q.to(torch.int8).clamp_(max=cap).to(torch.int32)
    return (q & 0xFF).to(torch.uint8)


def pack_nibbles_or(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``qs[j] = q[j] | (q[j + 16] << 4)`` for uint8 codes ``[nb, 32]`` into ``out`` ``[nb, 16]`` (in 8 bits,
    as the C ``uint8_t`` assignment truncates; for 4-bit codes the high nibble is exactly ``q[j + 16]``)."""
    return torch.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out)


def pack_low_high(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)`` for uint8 codes ``[nb, 32]`` into ``out``."""
    return torch.bitwise_or(q[:, :16] & 0x0F, q[:, 16:] << 4, out=out)


_GATHER_BITS = 0x0102040810204080  # sum_k 2**(56 - 7k): moves bit 8k of a word to bit 56 + k


def high_bits(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``qh`` (uint32, little-endian, as 4 bytes) of uint8 codes ``[nb, 32]``: bit ``j`` is bit 4 of code ``j``.

    Eight 0/1 bytes read as one little-endian int64 ``sum_k b_k 2**(8k)``, times ``_GATHER_BITS``, hold
    ``sum_k b_k 2**k`` in their top byte: every other product term lands below bit 56 or above bit 63, at
    distinct positions (so no carries). The product wraps modulo 2**64, as torch's int64 multiply does;
    the tests compare the bytes with the gguf package and llama.cpp."""
    words = ((q >> 4) & 1).view(torch.int64)  # [nb, 4]
    return out.copy_(((words * _GATHER_BITS) >> 56) & 0xFF)


HALF_BELOW = float(np.nextafter(np.float32(0.5), np.float32(0)))  # 0.49999997f, the float just below 1/2


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (half away from zero) for fp32 ``|v| < 2**23``, as the truncation toward zero of
    ``v + copysign(0.49999997f, v)`` (still fp32; the caller converts). Exact: below 1/2 the sum stays
    below 1 (``0.5 - 2**-25 + 0.49999997 = 1 - 2**-24`` is a float), at ``k + 1/2`` it rounds up to
    ``k + 1``, and where it crosses a power of two it cannot reach the next integer
    (``test_round_half_away`` checks the neighbourhood of every half-integer up to 256 and random values)."""
    return torch.copysign(torch.tensor(HALF_BELOW, device=v.device), v).add_(v)


__all__ = ["FLT_MIN", "HALF_BELOW", "c_bytes", "check_finite", "first_extremes", "fp16_bytes", "fp16_scale", "high_bits", "inverse", "pack_low_high", "pack_nibbles_or", "read_fp16", "round_half_away", "signed_extreme", "subnormal"]
