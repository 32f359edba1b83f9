"""llama.cpp's ternary types ``tq1_0`` and ``tq2_0`` (super-blocks of 256 weights, codes -1, 0, +1).

Both scale a super-block by its largest magnitude and round every weight to a trit
(``quantize_row_tq1_0_ref`` / ``quantize_row_tq2_0_ref`` of ``ggml-quants.c``, commit ``LLAMA_CPP_COMMIT``),
every step in fp32::

    d    = max |x| over the 256 weights             stored as fp16 (GGML_FP32_TO_FP16: nearest even)
    id   = d ? 1/d : 0
    t    = lroundf(x * id) + 1                      0, 1, 2 for -1, 0, +1 (roundf: half away from zero)
    x^   = d_fp16 * (t - 1)                         (dequantize_row_tq*_0, gguf.quants)

They differ in how the trits are packed:

* **tq2_0** (``block_tq2_0``, 66 bytes, 2.0625 bits per weight): ``qs: u8[64]``, then ``d``. Byte ``m`` of
  the 32-byte group ``g`` holds the trits of weights ``128 g + m + 32 n`` in bits ``2n, 2n + 1``, ``n = 0..3``.
* **tq1_0** (``block_tq1_0``, 54 bytes, 1.6875 bits per weight): ``qs: u8[48]``, ``qh: u8[4]``, then ``d``.
  Five trits per byte, the first the most significant, as ``ceil(256 q / 243)`` of their base-3 number ``q``
  (so that ``(byte * 3**n mod 256) * 3 >> 8`` reads trit ``n`` back): bytes 0..31 hold weights ``m + 32 n``
  (``n = 0..4``, weights 0..159), bytes 32..47 weights ``160 + m + 16 n`` (160..239); ``qh[j]`` holds the four
  weights ``240 + j + 4 n`` (``n = 0..3``) and a zero trit last.

Neither reads an importance matrix (``quantize_tq1_0`` / ``quantize_tq2_0`` ignore ``quant_weights``), so
``encode(w, quant_weights=...)`` quantizes as without one, as llama.cpp does. A width that is not whole
super-blocks falls back to ``q4_0`` (``tensor_type_fallback``), as llama-quantize writes it; a width that is
not a multiple of 32 is refused (llama.cpp would keep F16). NaN / inf weights are refused
(``NonFiniteWeightError``) and a ``d`` beyond fp16 (``max |x| > 65504``) is a ``SchemeError``, where llama.cpp
would store inf. A super-block whose ``max |x|`` is below about ``2**-128`` has ``1/d = inf``: C's
``lroundf`` of the resulting inf / NaN is ``LONG_MIN`` on x86-64, and ``+ 1`` truncated to ``int`` is 1, so
every trit there is 0, which is what qkit writes (tested against llama-quantize); its fp16 ``d`` is 0 anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qkit.schemes.ggml import Q4_0, T, register_codec
from qkit.schemes.ggml_blocks import fp16_bytes, fp16_scale, inverse, read_fp16, round_half_away
from qkit.schemes.kquants import QK_K, KQuantScheme
from qkit.schemes.registry import register

TQ1_SIZE, TQ2_SIZE = 54, 66  # sizeof(block_tq1_0), sizeof(block_tq2_0)
_POW5 = (81, 27, 9, 3, 1)  # the first trit of a byte is its most significant


def ternary(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 super-blocks ``[nb, 256]`` -> ``(trits uint8 [nb, 256] in 0..2, d fp16 [nb])`` (module docstring)."""
    amax = x.abs().amax(dim=1)  # NaN and inf reach it: fp16_scale refuses them
    h = fp16_scale(amax, "scale", amax)
    idv = inverse(amax)
    v = x * idv.unsqueeze(1)
    huge = torch.isinf(idv)
    if bool(huge.any()):  # 1/d overflowed: lroundf(inf or NaN) + 1 is 1 on x86-64 (module docstring)
        v = torch.where(huge.unsqueeze(1), torch.zeros_like(v), v)
    return round_half_away(v).to(torch.int8).add_(1).view(torch.uint8), h


def _base3(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``ceil(256 q / 243)`` of ``q = sum_n t[..., n, :] * weights[n]`` (trits ``[..., k, m]``), as uint8 ``[..., m]``:
    C computes it in ``uint16_t`` and stores the low byte."""
    q = (t.to(torch.int32) * weights.view(-1, 1)).sum(dim=-2)
    return ((q * 256 + 242) // 243).to(torch.uint8)


def pack_tq1(t: torch.Tensor, out: torch.Tensor) -> None:
    """Trits uint8 ``[nb, 256]`` -> ``qs`` and ``qh`` of ``block_tq1_0``, written into ``out[:, :52]``."""
    nb = t.shape[0]
    w = torch.tensor(_POW5, dtype=torch.int32, device=t.device)
    out[:, :32] = _base3(t[:, :160].reshape(nb, 5, 32), w)
    out[:, 32:48] = _base3(t[:, 160:240].reshape(nb, 5, 16), w)
    out[:, 48:52] = _base3(t[:, 240:].reshape(nb, 4, 4), w[:4])  # 81, 27, 9, 3: "q *= 3" after the fourth trit


def pack_tq2(t: torch.Tensor, out: torch.Tensor) -> None:
    """Trits uint8 ``[nb, 256]`` -> ``qs`` of ``block_tq2_0``, written into ``out[:, :64]``."""
    g = t.reshape(t.shape[0], 2, 4, 32)
    out[:, :64] = (g[:, :, 0] | (g[:, :, 1] << 2) | (g[:, :, 2] << 4) | (g[:, :, 3] << 6)).reshape(-1, 64)


# trit n of a byte, n = 0..4 (dequantize_row_tq1_0: ((uint8_t)(q * 3**n) * 3) >> 8), by byte value: [256, 5]
_TQ1_TRITS = ((torch.arange(256, dtype=torch.int32).view(-1, 1) * torch.tensor((1, 3, 9, 27, 81)) & 0xFF) * 3) >> 8


def tq1_trits(b: torch.Tensor) -> torch.Tensor:
    """The trits of ``block_tq1_0`` bytes ``[nb, 54]``: int32 ``[nb, 256]`` in 0..2."""
    nb = b.shape[0]
    table = _TQ1_TRITS.to(b.device)

    def digits(qs: torch.Tensor, n: int) -> torch.Tensor:  # [nb, k] -> [nb, n * k]: trit i of byte m at i * k + m
        return table[qs.long(), :n].transpose(1, 2).reshape(nb, -1)

    return torch.cat([digits(b[:, :32], 5), digits(b[:, 32:48], 5), digits(b[:, 48:52], 4)], dim=1)


def tq2_trits(b: torch.Tensor) -> torch.Tensor:
    """The trits of ``block_tq2_0`` bytes ``[nb, 66]``: int32 ``[nb, 256]`` in 0..3 (3 is never written)."""
    shifts = torch.tensor((0, 2, 4, 6), dtype=torch.int32, device=b.device).view(1, 1, 4, 1)
    qs = b[:, :64].to(torch.int32).reshape(-1, 2, 1, 32)
    return ((qs >> shifts) & 3).reshape(-1, QK_K)


def _encoder(size: int, pack: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The encoder fp32 ``[nb, 256]`` -> block bytes uint8 ``[nb, size]``: the trits packed by ``pack``, then ``d``."""

    def encode(x: torch.Tensor) -> torch.Tensor:
        t, h = ternary(x)
        out = torch.empty(x.shape[0], size, dtype=torch.uint8, device=x.device)
        pack(t, out)
        out[:, size - 2:] = fp16_bytes(h)
        return out

    return encode


encode_tq1_0 = _encoder(TQ1_SIZE, pack_tq1)
encode_tq2_0 = _encoder(TQ2_SIZE, pack_tq2)


def decode_tq1_0(b: torch.Tensor) -> torch.Tensor:
    return read_fp16(b, TQ1_SIZE - 2) * (tq1_trits(b) - 1).float()


def decode_tq2_0(b: torch.Tensor) -> torch.Tensor:
    return read_fp16(b, TQ2_SIZE - 2) * (tq2_trits(b) - 1).float()


register_codec(T.TQ1_0, encode_tq1_0, decode_tq1_0)
register_codec(T.TQ2_0, encode_tq2_0, decode_tq2_0)

class TernaryScheme(KQuantScheme):
    """A ternary type (tq1_0, tq2_0): llama.cpp's storage for models trained ternary (BitNet b1.58, TriLM).
    Rounding a float model to three levels per weight is no rung of a budget ladder, so a plan does not mix
    it in (``qkit_format.plan_types``); it is written where a user names it."""


TQ1_0 = register(TernaryScheme(
    "tq1_0", T.TQ1_0, 2, fallback=Q4_0,
    description="llama.cpp TQ1_0: ternary codes (-1, 0, +1) five to a byte, one fp16 scale per 256 weights",
))
TQ2_0 = register(TernaryScheme(
    "tq2_0", T.TQ2_0, 2, fallback=Q4_0,
    description="llama.cpp TQ2_0: ternary codes (-1, 0, +1) in 2 bits each, one fp16 scale per 256 weights",
))

__all__ = ["TernaryScheme", "TQ1_0", "TQ1_SIZE", "TQ2_0", "TQ2_SIZE", "decode_tq1_0", "decode_tq2_0", "encode_tq1_0", "encode_tq2_0",
           "pack_tq1", "pack_tq2", "ternary", "tq1_trits", "tq2_trits"]
