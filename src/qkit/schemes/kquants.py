"""llama.cpp's k-quants ``q4_k`` and ``q6_k`` (super-blocks of 256): their block layouts, encoders and decoders.

Reference: ``ggml/src/ggml-quants.c`` and ``src/llama-quant.cpp`` of llama.cpp at commit
``0c1e57098bba43ac29e6e3b677cdceebdd22334f`` (ggml 0.25.3, vendored by llama-cpp-python 0.3.36); the
functions named below are that file's. Storage follows the contract of ``qkit.schemes.ggml``:
``qweight`` uint8 ``[rows, bytes_per_row]`` holding row ``r``'s blocks, ``scales`` empty.

**q4_k** (``block_q4_K``, 144 bytes per 256 weights, 4.5 bits per weight): ``d: fp16, dmin: fp16,
scales: u8[12], qs: u8[128]``; eight sub-blocks of 32, each with a 6-bit scale ``sc`` and a 6-bit
minimum ``m`` packed into ``scales`` (``get_scale_min_k4``), and 4-bit codes; ``w = d*sc * q - dmin*m``.
``quantize_row_q4_K_ref`` per sub-block ``x[0..31]``::

    av_x    = sqrtf(sum(x*x) / 32);  w_i = av_x + |x_i|                 (importance weights)
    scale_j, min_j = make_qkx2_quants(x, w, nmax=15, rmin=-1, rdelta=0.1, nstep=20)
    d  = fp16(max_j scale_j / 63);  sc_j = min(63, nearest_int(63/max_scale * scale_j))
    dmin = fp16(max_j min_j / 63);  m_j  = min(63, nearest_int(63/max_min * min_j))
    q_i = clamp(nearest_int((x_i + dmin*m_j) / (d*sc_j)), 0, 15)   (kept from make_qkx2_quants if d*sc_j == 0)

The scale searches (``make_qkx2_quants``, ``make_qx_quants``) and the exact fp32 arithmetic they need
are in ``qkit.schemes.kquant_search``.

**q6_k** (``block_q6_K``, 210 bytes per 256 weights, 6.5625 bits per weight): ``ql: u8[128], qh: u8[64],
scales: i8[16], d: fp16``; sixteen sub-blocks of 16 with an 8-bit signed scale and 6-bit codes;
``w = d*sc * (q - 32)``. ``quantize_row_q6_K_ref``: ``scale_j = make_qx_quants(x, nmax=32, rmse_type=1)``
(a symmetric fit weighted by ``x*x`` over the inverse scales ``-(32 + 0.1*is) / max``, ``is = -9..9``),
``d = fp16(1 / (-128/max_scale))`` (``max_scale`` the first scale of largest magnitude), ``sc_j =
min(127, nearest_int(-128/max_scale * scale_j))``, ``q_i = clamp(nearest_int(x_i / (d*sc_j)), -32, 31) + 32``;
a super-block whose scales are all below ``GROUP_MAX_EPS = 1e-15`` is all zero bytes.

**Widths.** llama.cpp's ``tensor_type_fallback`` (``llama-quant.cpp``): a tensor whose row width
``ncols`` (ggml ``ne[0]``, the last dimension) is not a multiple of 256 is written as **q5_0** instead
of q4_k and as **q8_0** instead of q6_k; if the width is not even a multiple of 32, llama.cpp writes
F16, qkit refuses it (``SchemeError``). ``resolve(shape, name)`` applies this rule, so the
``QuantizedTensor``'s scheme is the type actually written: the default model's 576-wide matrices get
q5_0 under q4_k, its 1536-wide ``down_proj`` q4_k.

The ``q4_k_m`` recipe, which picks q4_k or q6_k per tensor, is ``qkit.schemes.recipes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.ggml import (
    Q5_0,
    Q8_0,
    GGMLScheme,
    T,
    check_finite,
    fp16_bytes,
    fp16_scale,
    read_fp16,
    register_codec,
)
from qkit.schemes.kquant_search import GROUP_MAX_EPS, fdiv, first_max_abs, make_qkx2_quants, make_qx_quants, seq_sum, sqrtf
from qkit.schemes.registry import register

QK_K = 256  # weights per super-block (ggml-common.h)
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the llama.cpp these rules are read from


# --------------------------------------------------------------------------- Q4_K


CHUNK = 1024  # super-blocks per pass of the torch code: keeps the [32, sub-blocks] intermediates near the cache
KERNEL_CHUNK = 16384  # with the compiled kernels (few intermediates; each pass costs ~40 small torch operations)


def in_chunks(encode: Any, x: torch.Tensor, size: int) -> torch.Tensor:
    """``encode`` over ``CHUNK`` (with the kernels ``KERNEL_CHUNK``) super-blocks at a time (every block is
    independent of the others). With the compiled kernels, torch runs at one thread inside and the
    kernels take the cores (:func:`qkit.schemes.kernels.owning_the_cores`). (The torch path alone was
    measured no faster with 2 threads, under a one-thread pool or with Python threads over the chunks:
    its operations are too small to leave the GIL for long.)"""
    with kernels.owning_the_cores() if kernels.available(x) else contextlib.nullcontext():
        check_finite(*torch.aminmax(x))
        out = torch.empty(x.shape[0], size, dtype=torch.uint8, device=x.device)
        chunk = KERNEL_CHUNK if kernels.available(x) else CHUNK
        for i in range(0, x.shape[0], chunk):
            out[i : i + chunk] = encode(x[i : i + chunk])
    return out


def encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q4_K`` bytes ``[nb, 144]`` (``quantize_row_q4_K_ref``)."""
    return in_chunks(_encode_q4_k, x, 144)


def _encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    if kernels.available(x):
        scales, mins, L = kernels.qkx2(x.reshape(nb * 8, 32), 15)
        L = L.view(nb, 8, 32)
    else:
        xs = x.view(nb * 8, 32).t().contiguous()  # [32, sub-blocks]
        av_x = sqrtf(seq_sum(xs * xs).div_(32))
        w = xs.abs().add_(av_x)
        scales, mins, L = make_qkx2_quants(xs, w, 15)
        L = L.t().reshape(nb, 8, 32)
    scales, mins = scales.view(nb, 8), mins.view(nb, 8)
    max_scale, max_min = scales.amax(dim=1), mins.amax(dim=1)
    max_scale = torch.where(max_scale > 0, max_scale, torch.zeros_like(max_scale))
    max_min = torch.where(max_min > 0, max_min, torch.zeros_like(max_min))
    inv_scale = torch.where(max_scale > 0, fdiv(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, fdiv(63.0, max_min), torch.zeros_like(max_min))
    # uint8_t ls = nearest_int(...); ls = MIN(63, ls): the int is truncated to a byte first
    ls = ((scales * inv_scale.unsqueeze(1)).round_().to(torch.int32) & 0xFF).clamp_(max=63)
    lm = ((mins * inv_min.unsqueeze(1)).round_().to(torch.int32) & 0xFF).clamp_(max=63)
    d = fp16_scale(max_scale / 63, "scale", x)
    dmin = fp16_scale(max_min / 63, "minimum", x)
    dd = d.float().unsqueeze(1) * ls.float()  # [nb, 8]
    dm = dmin.float().unsqueeze(1) * lm.float()
    out = torch.empty(nb, 144, dtype=torch.uint8, device=x.device)
    if kernels.available(x):
        kernels.q4_k_codes(x, L.view(nb, QK_K), dd, dm, out)
    else:
        xb = x.view(nb, 8, 32)
        keep = dd == 0  # if (!d) continue;  the codes of make_qkx2_quants stay
        safe = torch.where(keep, torch.ones_like(dd), dd)
        q = (xb + dm.unsqueeze(2)).div_(safe.unsqueeze(2)).round_().clamp_(0, 15)
        q = torch.where(keep.unsqueeze(2), L, q).to(torch.uint8)
        out[:, 16:].view(nb, 4, 32).copy_(q[:, 0::2] | (q[:, 1::2] << 4))
    out[:, 0:2] = fp16_bytes(d)
    out[:, 2:4] = fp16_bytes(dmin)
    ls8, lm8 = ls.to(torch.uint8), lm.to(torch.uint8)
    out[:, 4:8] = ls8[:, :4] | ((ls8[:, 4:] >> 4) << 6)
    out[:, 8:12] = lm8[:, :4] | ((lm8[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls8[:, 4:] & 0x0F) | ((lm8[:, 4:] & 0x0F) << 4)
    return out


def decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q4_K`` bytes ``[nb, 144]`` -> fp32 ``[nb, 256]``: ``d*sc * q - dmin*m`` per sub-block."""
    nb = b.shape[0]
    d, dmin = read_fp16(b, 0), read_fp16(b, 2)
    s = b[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)  # get_scale_min_k4
    m = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32).float()
    return ((d * sc.float()).unsqueeze(2) * q - (dmin * m.float()).unsqueeze(2)).reshape(nb, QK_K)


# --------------------------------------------------------------------------- Q6_K


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q6_K`` bytes ``[nb, 210]`` (``quantize_row_q6_K_ref``)."""
    return in_chunks(_encode_q6_k, x, 210)


def _encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    if kernels.available(x):
        scales, L = kernels.qx(x.reshape(nb * 16, 16), 32)
        L = L.view(nb, 16, 16)
    else:
        scales, L = make_qx_quants(x.view(nb * 16, 16).t().contiguous(), 32)  # [16, sub-blocks]
        L = L.t().reshape(nb, 16, 16)
    scales = scales.view(nb, 16)
    max_abs, max_scale = first_max_abs(scales, 1)
    zero = max_abs < GROUP_MAX_EPS  # the whole super-block is written as zero bytes
    iscale = fdiv(-128.0, max_scale)
    d = fp16_scale(torch.where(zero, torch.zeros_like(iscale), fdiv(1.0, iscale)), "scale", x)
    sc = (scales * iscale.unsqueeze(1)).round_().clamp_(max=127)
    sc = torch.where(zero.unsqueeze(1), torch.zeros_like(sc), sc).to(torch.int8)
    dd = d.float().unsqueeze(1) * sc.float()
    out = torch.empty(nb, 210, dtype=torch.uint8, device=x.device)
    if kernels.available(x):
        kernels.q6_k_codes(x, L.view(nb, QK_K), dd, zero, out)
    else:
        keep = dd == 0
        safe = torch.where(keep, torch.ones_like(dd), dd)
        q = x.view(nb, 16, 16).div(safe.unsqueeze(2)).round_().clamp_(-32, 31).add_(32)
        q = torch.where(keep.unsqueeze(2), L, q).to(torch.uint8)
        q = torch.where(zero.view(nb, 1, 1), torch.zeros_like(q), q).reshape(nb, 2, 4, 32)  # [half, quarter, l]
        ql = out[:, :128].view(nb, 2, 2, 32)
        ql.copy_((q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4))
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        out[:, 128:192].view(nb, 2, 32).copy_(qh)
    out[:, 192:208] = sc.view(torch.uint8)
    out[:, 208:210] = fp16_bytes(d)
    return out


def decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q6_K`` bytes ``[nb, 210]`` -> fp32 ``[nb, 256]``: ``(d * sc) * (q - 32)`` per sub-block of 16."""
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 2, 4, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = (qh >> shifts) & 0x03
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(nb, 16, 16).float()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = read_fp16(b, 208)
    return ((d * sc).unsqueeze(2) * q).reshape(nb, QK_K)


register_codec(T.Q4_K, encode_q4_k, decode_q4_k)
register_codec(T.Q6_K, encode_q6_k, decode_q6_k)


# --------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class KQuantScheme(GGMLScheme):
    """A k-quant type with llama.cpp's fallback for widths that are not a multiple of 256."""

    fallback: Any = None  # the 32-block scheme llama.cpp writes instead (tensor_type_fallback)

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> GGMLScheme:
        cols = shape[-1] if shape else 1
        if cols % QK_K == 0:
            return self
        if cols % 32:
            raise SchemeError(
                f"tensor {name}: width {cols} is not a multiple of 32, which every llama.cpp block type needs "
                f"({self.name} falls back to {self.fallback.name} for widths that are multiples of 32 but not "
                f"{QK_K}; llama.cpp would keep this one as F16); exclude it from quantization (qkit quantize --exclude)"
            )
        return self.fallback


Q4_K = register(KQuantScheme(
    "q4_k", T.Q4_K, 4, fallback=Q5_0,
    description="llama.cpp Q4_K: eight sub-blocks of 32 with 6-bit scales and minimums, chosen by llama.cpp's search",
))
Q6_K = register(KQuantScheme(
    "q6_k", T.Q6_K, 6, fallback=Q8_0, description="llama.cpp Q6_K: sixteen sub-blocks of 16 with 8-bit scales",
))
