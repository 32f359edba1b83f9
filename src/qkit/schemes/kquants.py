"""llama.cpp's k-quants ``q4_k``, ``q5_k`` and ``q6_k`` (super-blocks of 256): their block layouts, encoders
(without and with an importance matrix) and decoders.

Reference: ``ggml/src/ggml-quants.c`` and ``src/llama-quant.cpp`` of llama.cpp at commit
``0c1e57098bba43ac29e6e3b677cdceebdd22334f`` (ggml 0.25.3, vendored by llama-cpp-python 0.3.36); the
functions named below are that file's. Storage follows the contract of ``qkit.schemes.ggml``:
``qweight`` uint8 ``[rows, bytes_per_row]`` holding row ``r``'s blocks, ``scales`` empty.

**q4_k** (``block_q4_K``, 144 bytes per 256 weights, 4.5 bits per weight): ``d: fp16, dmin: fp16,
scales: u8[12], qs: u8[128]``; eight sub-blocks of 32, each with a 6-bit scale ``sc`` and a 6-bit
minimum ``m`` packed into ``scales`` (``get_scale_min_k4``), and 4-bit codes; ``w = d*sc * q - dmin*m``.
**q5_k** (``block_q5_K``, 176 bytes, 5.5 bits per weight): ``d, dmin, scales[12]`` as q4_k, then
``qh: u8[32], qs: u8[128]``: 5-bit codes, the low nibbles in ``qs`` as q4_k's, bit 4 of element ``l`` of
sub-block ``s`` in bit ``s`` of ``qh[l]``. ``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref`` per
sub-block ``x[0..31]`` (``nmax`` 15 / 31)::

    av_x    = sqrtf(sum(x*x) / 32);  w_i = av_x + |x_i|                 (importance weights)
    scale_j, min_j = make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep)   (q4_k: -1, 0.1, 20; q5_k: -0.5, 0.1, 15)
    d  = fp16(max_j scale_j / 63);  sc_j = min(63, nearest_int(63/max_scale * scale_j))
    dmin = fp16(max_j min_j / 63);  m_j  = min(63, nearest_int(63/max_min * min_j))
    q_i = clamp(nearest_int((x_i + dmin*m_j) / (d*sc_j)), 0, nmax)   (kept from the search if d*sc_j == 0)

With an importance matrix (``quantize_row_q{4,5}_K_impl``, ``qw`` the importance of the row's columns)::

    sigma2 = 2 * sum(x*x over the super-block) / 256;  w_i = qw_i * sqrtf(sigma2 + x_i*x_i)
    scale_j, min_j = make_qkx3_quants(x, w, nmax, -0.9, 0.05, 36);  sw_j = sum_i w_i
    d = fp16(make_qp_quants(8, 63, scales, Ls, sw));  dmin = fp16(make_qp_quants(8, 63, mins, Lm, sw))

(``make_qp_quants``: the 6-bit codes of the eight scales, fitted by ``sw``-weighted least squares with a
coordinate descent; q5_k then clips them to 63, q4_k stores the bytes as they are), and the codes as
above from the stored bytes.

**q6_k** (``block_q6_K``, 210 bytes per 256 weights, 6.5625 bits per weight): ``ql: u8[128], qh: u8[64],
scales: i8[16], d: fp16``; sixteen sub-blocks of 16 with an 8-bit signed scale and 6-bit codes;
``w = d*sc * (q - 32)``. ``quantize_row_q6_K_ref``: ``scale_j = make_qx_quants(x, nmax=32, rmse_type=1)``
(a symmetric fit weighted by ``x*x`` over the inverse scales ``-(32 + 0.1*is) / max``, ``is = -9..9``),
``d = fp16(1 / (-128/max_scale))`` (``max_scale`` the first scale of largest magnitude), ``sc_j =
min(127, nearest_int(-128/max_scale * scale_j))``, ``q_i = clamp(nearest_int(x_i / (d*sc_j)), -32, 31) + 32``;
a super-block whose scales are all below ``GROUP_MAX_EPS = 1e-15`` is all zero bytes.
``quantize_row_q6_K_impl`` is the same with the fit weighted by the importance: ``make_qx_quants(16, 32,
x, L, 1, qw)`` (no ``sigma2``: llama.cpp has it commented out).

The scale searches and the exact fp32 arithmetic they need are in ``qkit.schemes.kquant_search`` (torch)
and, for the compiled CPU path, :mod:`qkit.schemes.kernels`. **Exactness**: both paths give llama.cpp's
bytes (``ggml_quantize_chunk`` with and without an importance matrix) bit for bit; the final codes use
the C ``nearest_int`` trick itself, so they match even where its argument is out of range. An importance
vector with NaN, inf or a negative value is refused (``SchemeError``); with zeros it is used as llama.cpp
uses it (a super-block whose importances are all 0 gets ``d = dmin = 0`` in q4_k / q5_k, zero bytes in q6_k).

**Widths.** llama.cpp's ``tensor_type_fallback`` (``llama-quant.cpp``): a tensor whose row width
``ncols`` (ggml ``ne[0]``, the last dimension) is not a multiple of 256 is written as **q5_0** instead
of q4_k, as **q5_1** instead of q5_k and as **q8_0** instead of q6_k; if the width is not even a
multiple of 32, llama.cpp writes F16, qkit refuses it (``SchemeError``). ``resolve(shape, name)``
applies this rule, so the ``QuantizedTensor``'s scheme is the type actually written: the default
model's 576-wide matrices get q5_0 under q4_k, its 1536-wide ``down_proj`` q4_k.

The ``q4_k_m`` recipe, which picks q4_k or q6_k per tensor, is ``qkit.schemes.recipes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.ggml import Q5_0, Q5_1, Q8_0, GGMLScheme, T, check_importance, register_codec
from qkit.schemes.ggml_blocks import check_finite, fp16_bytes, fp16_scale, read_fp16
from qkit.schemes.kquant_search import (
    GROUP_MAX_EPS,
    fdiv,
    first_max_abs,
    make_qkx2_quants,
    make_qkx3_quants,
    make_qp_quants,
    make_qx_quants,
    nearest_int,
    seq_sum,
    sqrtf,
)
from qkit.schemes.registry import register
from qkit.threads import one_torch_thread

QK_K = 256  # weights per super-block (ggml-common.h)
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the llama.cpp these rules are read from


# --------------------------------------------------------------------------- chunks, importance vectors


CHUNK = 1024  # super-blocks per pass of the torch code: keeps the [32, sub-blocks] intermediates near the cache
KERNEL_CHUNK = 16384  # with the compiled kernels (few intermediates; each pass costs ~40 small torch operations)


def in_chunks(encode: Any, x: torch.Tensor, size: int, qw: torch.Tensor | None = None) -> torch.Tensor:
    """``encode`` over ``CHUNK`` (with the kernels ``KERNEL_CHUNK``) super-blocks at a time (every block is
    independent of the others): ``encode(chunk)``, or with an importance ``qw`` ``[P, 256]`` (one matrix
    row's, ``P`` super-blocks per row) ``encode(chunk, qw, first)``, ``first`` the chunk's first super-block.
    With the compiled kernels, torch runs at one thread inside and the kernels take the cores
    (:func:`qkit.schemes.kernels.owning_the_cores`). The torch code on the CPU runs at one thread too: its
    many small operations each pay the pool's barrier (measured on a busy 2-core machine: q4_k with an
    importance matrix on 576x1536, 0.1 s on one thread, 2.5-10 s on two; it was never faster with 2
    threads, under a one-thread pool or with Python threads over the chunks)."""
    if kernels.available(x):
        cores = kernels.owning_the_cores()
    else:
        cores = one_torch_thread() if x.device.type == "cpu" else contextlib.nullcontext()
    with cores:
        check_finite(*torch.aminmax(x))
        out = torch.empty(x.shape[0], size, dtype=torch.uint8, device=x.device)
        chunk = KERNEL_CHUNK if kernels.available(x) else CHUNK
        for i in range(0, x.shape[0], chunk):
            out[i : i + chunk] = encode(x[i : i + chunk]) if qw is None else encode(x[i : i + chunk], qw, i)
    return out


def weighted(encode: Any, size: int, name: str) -> Any:
    """The importance-weighted row encoder (``ggml.register_weighted``) of a k-quant whose super-block
    encoder is ``encode(x [n, 256], qw [P, 256], first) -> uint8 [n, size]``: ``x`` fp32 ``[rows, cols]``,
    ``qw`` fp32 ``[cols]`` -> uint8 ``[rows, cols / 256 * size]`` (``quantize_q*_K`` with ``quant_weights``:
    the ``_impl`` function row by row; super-block ``i`` of a row takes ``qw[256*i : 256*i + 256]``)."""

    def run(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
        check_importance(qw, name)
        rows, cols = x.shape
        blocks = in_chunks(encode, x.reshape(-1, QK_K), size, qw.reshape(cols // QK_K, QK_K).contiguous())
        return blocks.view(rows, -1)

    run.__name__ = run.__qualname__ = f"encode_{name}_weighted"
    run.__doc__ = f"fp32 ``[rows, cols]`` and fp32 importances ``[cols]`` -> ``block_{name[:2].upper()}_K`` bytes ``[rows, cols / 256 * {size}]``."
    return run


def _rows_of(qw: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """The importance row of each of ``n`` super-blocks from super-block ``first`` on: ``[n, 256]``."""
    idx = torch.arange(first, first + n, device=qw.device).remainder_(qw.shape[0])
    return qw.index_select(0, idx)


# --------------------------------------------------------------------------- Q4_K and Q5_K


def encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q4_K`` bytes ``[nb, 144]`` (``quantize_row_q4_K_ref``)."""
    return in_chunks(_encode_q4_k, x, 144)


def encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q5_K`` bytes ``[nb, 176]`` (``quantize_row_q5_K_ref``)."""
    return in_chunks(_encode_q5_k, x, 176)


def _encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    return _encode_k45(x, 15, (-1.0, 0.1, 20))


def _encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    return _encode_k45(x, 31, (-0.5, 0.1, 15))


def _encode_k45(x: torch.Tensor, nmax: int, search: tuple[float, float, int]) -> torch.Tensor:
    """``quantize_row_q4_K_ref`` (``nmax`` 15) / ``quantize_row_q5_K_ref`` (31): ``make_qkx2_quants(32, nmax,
    ..., *search, false)`` per sub-block, the scales and minimums over 63 levels of their maximum."""
    nb = x.shape[0]
    if kernels.available(x):
        scales, mins, L = kernels.qkx2(x.reshape(nb * 8, 32), nmax, *search)
        L = L.view(nb, 8, 32)
    else:
        xs = x.view(nb * 8, 32).t().contiguous()  # [32, sub-blocks]
        av_x = sqrtf(seq_sum(xs * xs).div_(32))
        w = xs.abs().add_(av_x)
        scales, mins, L = make_qkx2_quants(xs, w, nmax, *search)
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
    out = torch.empty(nb, 144 if nmax == 15 else 176, dtype=torch.uint8, device=x.device)
    if kernels.available(x):
        (kernels.q4_k_codes if nmax == 15 else kernels.q5_k_codes)(x, L.view(nb, QK_K), dd, dm, out)
    else:
        _pack_codes(_final_codes(x, L, dd, dm, nmax), nmax, out)
    out[:, 0:2] = fp16_bytes(d)
    out[:, 2:4] = fp16_bytes(dmin)
    _pack_scales(ls.to(torch.uint8), lm.to(torch.uint8), out)
    return out


def _impl_k45(x: torch.Tensor, qw: torch.Tensor, first: int, nmax: int) -> torch.Tensor:
    """``quantize_row_q4_K_impl`` (``nmax`` 15) / ``quantize_row_q5_K_impl`` (31) with ``quant_weights`` on
    super-blocks ``[nb, 256]`` from number ``first`` of the matrix on (``qw`` ``[P, 256]``, see ``in_chunks``)."""
    nb = x.shape[0]
    if kernels.available(x):
        out, dmf = kernels.k45_impl(x, qw, first, nmax)
        if not bool(torch.isfinite(dmf.to(torch.float16)).all()):  # the torch code's message (it raises)
            fp16_scale(dmf[:, 0], "scale", x), fp16_scale(dmf[:, 1], "minimum", x)
        return out
    qwe = _rows_of(qw, first, nb)
    xt = x.t().contiguous()
    sigma2 = seq_sum(xt * xt).mul_(2).div_(QK_K)  # 2*sum_x2/QK_K over the super-block
    w = qwe * sqrtf(x * x + sigma2.unsqueeze(1))  # qw[l] * sqrtf(sigma2 + x*x)
    xs = x.reshape(nb * 8, 32).t().contiguous()  # [32, sub-blocks]
    ws = w.reshape(nb * 8, 32).t().contiguous()
    sw = seq_sum(ws).view(nb, 8).t()  # [8, nb]
    scales, mins, L = make_qkx3_quants(xs, ws, nmax, -0.9, 0.05, 36)
    d_block, Ls = make_qp_quants(scales.view(nb, 8).t(), sw, 63)
    m_block, Lm = make_qp_quants(mins.view(nb, 8).t(), sw, 63)
    ls, lm = Ls.t().to(torch.uint8), Lm.t().to(torch.uint8)
    if nmax == 31:  # q5_k: ls = MIN(63, ls)
        ls, lm = ls.clamp(max=63), lm.clamp(max=63)
    d = fp16_scale(d_block, "scale", x)
    dmin = fp16_scale(m_block, "minimum", x)
    out = torch.empty(nb, 144 if nmax == 15 else 176, dtype=torch.uint8, device=x.device)
    out[:, 0:2] = fp16_bytes(d)
    out[:, 2:4] = fp16_bytes(dmin)
    _pack_scales(ls, lm, out)
    sc, m = _scale_min_k4(out[:, 4:16])  # the codes are recomputed from the stored bytes
    dd = d.float().unsqueeze(1) * sc.float()
    dm = dmin.float().unsqueeze(1) * m.float()
    _pack_codes(_final_codes(x, L.t().reshape(nb, 8, 32), dd, dm, nmax), nmax, out)
    return out


def _final_codes(x: torch.Tensor, L: torch.Tensor, dd: torch.Tensor, dm: torch.Tensor, nmax: int) -> torch.Tensor:
    """``l = clamp(nearest_int((x + dm) / dd), 0, nmax)`` per sub-block (``dd`` = ``d*sc``, ``dm`` =
    ``dmin*m``, fp32 ``[nb, 8]``), the search's codes ``L`` ``[nb, 8, 32]`` where ``dd == 0``: uint8 ``[nb, 8, 32]``."""
    nb = x.shape[0]
    keep = dd == 0  # if (!d) continue;  the codes of the search stay
    safe = torch.where(keep, torch.ones_like(dd), dd)
    q = nearest_int((x.view(nb, 8, 32) + dm.unsqueeze(2)).div_(safe.unsqueeze(2))).clamp_(0, nmax)
    return torch.where(keep.unsqueeze(2), L.to(torch.int32), q).to(torch.uint8)


def _pack_codes(q: torch.Tensor, nmax: int, out: torch.Tensor) -> None:
    """uint8 codes ``[nb, 8, 32]`` into ``qs`` (q4_k: ``out[:, 16:144]``) or ``qh`` and ``qs`` (q5_k:
    ``out[:, 16:48]``, ``out[:, 48:176]``): sub-blocks ``2p`` and ``2p + 1`` share 32 bytes (low, high
    nibble); bit 4 of element ``l`` of sub-block ``s`` is bit ``s`` of ``qh[l]``."""
    nb = q.shape[0]
    if nmax == 15:
        out[:, 16:].view(nb, 4, 32).copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        return
    lo = q & 0x0F
    out[:, 48:].view(nb, 4, 32).copy_(lo[:, 0::2] | (lo[:, 1::2] << 4))
    shifts = torch.arange(8, dtype=torch.uint8, device=q.device).view(1, 8, 1)
    out[:, 16:48] = ((q >> 4) << shifts).sum(dim=1, dtype=torch.uint8)  # disjoint bits: the sum is the OR


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor, out: torch.Tensor) -> None:
    """The 12 bytes of ``scales`` (``out[:, 4:16]``) from the 6-bit codes uint8 ``[nb, 8]``, as the C
    packs them: ``uint8_t`` arithmetic (a shifted value keeps its low 8 bits)."""
    out[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_scale_min_k4(j, scales, &sc, &m)`` for ``j = 0..7`` from the 12 bytes ``s`` ``[nb, 12]``."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    m = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc, m


def decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q4_K`` bytes ``[nb, 144]`` -> fp32 ``[nb, 256]``: ``d*sc * q - dmin*m`` per sub-block."""
    nb = b.shape[0]
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
    return _decode_k45(b, q)


def decode_q5_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q5_K`` bytes ``[nb, 176]`` -> fp32 ``[nb, 256]``: ``d*sc * q - dmin*m`` per sub-block."""
    nb = b.shape[0]
    qs = b[:, 48:].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # bit s of qh[l]: bit 4 of element l of sub-block s
    return _decode_k45(b, q | (high << 4))


def _decode_k45(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    d, dmin = read_fp16(b, 0), read_fp16(b, 2)
    sc, m = _scale_min_k4(b[:, 4:16])
    return ((d * sc.float()).unsqueeze(2) * q.float() - (dmin * m.float()).unsqueeze(2)).reshape(b.shape[0], QK_K)


# --------------------------------------------------------------------------- Q6_K


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q6_K`` bytes ``[nb, 210]`` (``quantize_row_q6_K_ref``)."""
    return in_chunks(_encode_q6_k, x, 210)


def _encode_q6_k(x: torch.Tensor, qw: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """``quantize_row_q6_K_ref``, or with ``qw`` (``[P, 256]``, see ``in_chunks``) ``quantize_row_q6_K_impl``:
    the same but for the search, ``make_qx_quants(16, 32, x, L, 1, qw)``."""
    nb = x.shape[0]
    if kernels.available(x):
        if qw is None:
            scales, L = kernels.qx(x.reshape(nb * 16, 16), 32)
        else:
            scales, L = kernels.qx_weighted(x.reshape(nb * 16, 16), qw.reshape(-1, 16), 16 * first, 32)
        L = L.view(nb, 16, 16)
    else:
        qws = None if qw is None else _rows_of(qw, first, nb).reshape(nb * 16, 16).t().contiguous()
        scales, L = make_qx_quants(x.view(nb * 16, 16).t().contiguous(), 32, 1, qws)  # [16, sub-blocks]
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
        q = nearest_int(x.view(nb, 16, 16).div(safe.unsqueeze(2))).clamp_(-32, 31).add_(32)
        q = torch.where(keep.unsqueeze(2), L.to(torch.int32), q).to(torch.uint8)
        pack_q6_codes(torch.where(zero.view(nb, 1, 1), torch.zeros_like(q), q), out)
    out[:, 192:208] = sc.view(torch.uint8)
    out[:, 208:210] = fp16_bytes(d)
    return out


def pack_q6_codes(q: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 codes ``0..63`` (any shape of ``nb * 256``) into ``ql`` / ``qh`` of ``block_q6_K`` bytes ``out``
    ``[nb, 210]`` (``out[:, :192]``): element ``128h + 32k + l`` has its low nibble in ``ql[64h + 32(k % 2) +
    l]`` (high nibble for ``k >= 2``) and its top two bits at bit ``2k`` of ``qh[32h + l]``."""
    nb = out.shape[0]
    q = q.reshape(nb, 2, 4, 32)  # [half, quarter, l]
    out[:, :128].view(nb, 2, 2, 32).copy_((q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4))
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out[:, 128:192].view(nb, 2, 32).copy_(qh)


def q6_codes(b: torch.Tensor) -> torch.Tensor:
    """``block_q6_K`` bytes ``[nb, 210]`` -> the stored codes ``0..63`` uint8 ``[nb, 256]`` (the inverse of
    :func:`pack_q6_codes`)."""
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 2, 4, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    return (ql | (((qh >> shifts) & 0x03) << 4)).reshape(nb, QK_K)


def decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q6_K`` bytes ``[nb, 210]`` -> fp32 ``[nb, 256]``: ``(d * sc) * (q - 32)`` per sub-block of 16."""
    nb = b.shape[0]
    q = (q6_codes(b).to(torch.int8) - 32).reshape(nb, 16, 16).float()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = read_fp16(b, 208)
    return ((d * sc).unsqueeze(2) * q).reshape(nb, QK_K)


register_codec(T.Q4_K, encode_q4_k, decode_q4_k, weighted(lambda x, qw, first: _impl_k45(x, qw, first, 15), 144, "q4_k"))
register_codec(T.Q5_K, encode_q5_k, decode_q5_k, weighted(lambda x, qw, first: _impl_k45(x, qw, first, 31), 176, "q5_k"))
register_codec(T.Q6_K, encode_q6_k, decode_q6_k, weighted(_encode_q6_k, 210, "q6_k"))


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
Q5_K = register(KQuantScheme(
    "q5_k", T.Q5_K, 5, fallback=Q5_1,
    description="llama.cpp Q5_K: eight sub-blocks of 32 with 6-bit scales and minimums, 5-bit codes",
))
Q6_K = register(KQuantScheme(
    "q6_k", T.Q6_K, 6, fallback=Q8_0, description="llama.cpp Q6_K: sixteen sub-blocks of 16 with 8-bit scales",
))
