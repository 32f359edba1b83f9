"""llama.cpp's low-bit k-quants ``q2_k`` and ``q3_k`` (super-blocks of 256, sixteen sub-blocks of 16):
block layouts, encoders with and without an importance matrix, decoders.

Reference: ``ggml/src/ggml-quants.c`` at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``; the functions named
below are that file's. Storage follows the contract of ``qkit.schemes.ggml`` (``qweight`` uint8
``[rows, bytes_per_row]`` holding row ``r``'s blocks, ``scales`` empty).

**q2_k** (``block_q2_K``, 84 bytes per 256 weights, 2.625 bits per weight): ``scales: u8[16]`` (low
nibble the 4-bit scale ``sc_j``, high nibble the 4-bit minimum ``m_j`` of sub-block ``j``), ``qs: u8[64]``,
``d: fp16``, ``dmin: fp16``; ``w = d*sc_j * q - dmin*m_j``, ``q`` in ``0..3``. ``quantize_row_q2_K_ref``::

    scale_j, min_j = make_qkx2_quants(16, 3, x_j, |x_j|, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=true)
    sc_j = nearest_int(15/max_scale * scale_j);   d    = fp16(max_scale / 15)
    m_j  = nearest_int(15/max_min * min_j);       dmin = fp16(max_min / 15)
    q_i  = clamp(nearest_int((x_i + dmin*m_j) / (d*sc_j)), 0, 3)   (the search's codes where d*sc_j == 0)

``quantize_row_q2_K_impl`` (an importance matrix ``qw``): per super-block ``sigma2 = sum(x*x) / 256``,
weights ``w_i = qw_i * sqrtf(sigma2 + x_i**2)``, ``scale_j, min_j = make_qkx3_quants(16, 3, x_j, w_j,
-0.9, 0.05, 36, false)``, and the 4-bit scales and minimums with their ``d`` / ``dmin`` by
``make_qp_quants(16, 15, scales, sw)`` / ``make_qp_quants(16, 15, mins, sw)`` (``sw_j = sum w_j``); then
the same code recomputation.

**q3_k** (``block_q3_K``, 110 bytes per 256 weights, 3.4375 bits per weight): ``hmask: u8[32]`` (bit
``k`` of byte ``m`` is the high bit of code ``32k + m``), ``qs: u8[64]`` (the low two bits),
``scales: u8[12]`` (6-bit ``sc_j + 32``: the low nibble in byte ``j`` for ``j < 8``, else in the high
nibble of byte ``j - 8``; the top two bits in byte ``8 + j % 4`` at bit ``2 * (j / 4)``), ``d: fp16``;
``w = d*sc_j * (q - 4)``, ``q`` in ``0..7``. ``quantize_row_q3_K_ref``: ``scale_j = make_q3_quants(16, 4,
x_j, do_rmse=true)``; ``max_scale`` the first scale of largest magnitude, ``sc_j = clamp(nearest_int(-32 /
max_scale * scale_j), -32, 31)``, ``d = fp16(1 / (-32/max_scale))``; ``q_i = clamp(nearest_int(x_i /
(d*sc_j)), -4, 3) + 4`` (the search's codes where ``d*sc_j == 0``). ``quantize_row_q3_K_impl``:
``sigma2 = 2 * sum(x*x) / 256``, ``w_i = qw_i * sqrtf(sigma2 + x_i**2)``, ``scale_j = make_qx_quants(16,
4, x_j, rmse_type=1, w_j)``, and ``sc_j``, ``d`` from ``make_qx_quants(16, 32, scales, rmse_type=1, sw)``.

In both, ``qs[32h + l]`` packs the codes of elements ``128h + l + 32k`` (``k = 0..3``) at bit ``2k``.

**Exactness.** The bytes equal ``ggml_quantize_chunk`` (``quantize_q2_K`` / ``quantize_q3_K``, with and
without ``quant_weights``) bit for bit: fp32 in the C's order, ``nearest_int`` as its ``+ 12582912.f`` bit
trick (exact for every input), the C's integer wraps (``(uint8_t)`` / ``(int8_t)`` stores), and the codes
recomputed from the fp16-rounded ``d`` / ``dmin``. On CPU a compiled kernel does it
(:mod:`qkit.schemes._kernels_low`: the C statements across 64 sub-blocks at once, split over threads);
on one thread it takes 0.2x (q2_k) and 0.3x (q3_k) of llama.cpp's own time for the default model's
1536-wide matrices, with or without an importance matrix. The torch code here, vectorised across
sub-blocks with the searches of :mod:`qkit.schemes.kquant_search`, is its oracle in the tests and the
path on other devices. Decoding equals ``dequantize_row_q2_K`` / ``dequantize_row_q3_K`` and
``gguf.quants.dequantize`` bit for bit.

**Refusals.** NaN / inf weights: ``NonFiniteWeightError``; a ``d`` or ``dmin`` beyond fp16: ``SchemeError``
(llama.cpp would write inf); an importance vector with NaN, inf or a negative value: ``SchemeError``.
(Where the fp32 sums of the searches overflow, i.e. importance times weight beyond about 1e34, the C
and the kernel write what the overflowed arithmetic gives; the torch path may refuse with
``SchemeError`` instead.)

**Widths** (``tensor_type_fallback`` in ``llama-quant.cpp``): a row width that is a multiple of 32 but
not of 256 is written as **q4_0** under both types (the default model's 576-wide matrices); other
widths are refused, where llama.cpp writes F16.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes import kquant_search as ks
from qkit.schemes.ggml import Q4_0, T, check_importance, register_codec
from qkit.schemes.ggml_blocks import check_finite, fp16_bytes, fp16_scale, read_fp16
from qkit.schemes.kquant_search import fdiv, first_max_abs, nearest_int, seq_sum, sqrtf
from qkit.schemes.kquants import QK_K, KQuantScheme
from qkit.schemes.registry import register

Q2_SIZE, Q3_SIZE = 84, 110  # bytes per super-block (ggml-common.h)
CHUNK = 1024  # super-blocks per pass of the torch code (keeps its [16, sub-blocks] intermediates small)
_SHIFTS = (0, 2, 4, 6)


def _jit() -> Any:
    # a local import: it imports numba (heavy), and only when a tensor takes the kernels
    from qkit.schemes import _kernels_low

    return _kernels_low


# --------------------------------------------------------------------------- shared pieces (torch)


def pack_2bit(q: torch.Tensor, out: torch.Tensor) -> None:
    """Codes ``q`` (int, ``0..3``) ``[nb, 256]`` into ``qs`` ``out`` uint8 ``[nb, 64]``: ``qs[32h + l] =
    q[128h + l] | q[128h + 32 + l] << 2 | q[128h + 64 + l] << 4 | q[128h + 96 + l] << 6``."""
    q = q.reshape(-1, 2, 4, 32)
    packed = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    out.view(-1, 2, 32).copy_(packed)


def unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """``qs`` uint8 ``[nb, 64]`` -> codes uint8 ``[nb, 256]`` (the inverse of :func:`pack_2bit`)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def _sub_blocks(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[nb, 256]`` -> ``[16, nb * 16]``: element ``i`` of sub-block ``k`` at ``[i, k]``."""
    return x.reshape(-1, 16).t().contiguous()


def _row_max(v: torch.Tensor) -> torch.Tensor:
    """The C loop ``m = 0; if (v > m) m = v;`` over each row of ``v`` ``[nb, 16]`` (NaN never wins)."""
    m = torch.nan_to_num(v, nan=0.0).amax(dim=1)
    return torch.where(m > 0, m, torch.zeros_like(m))


def _sigma2_weights(x: torch.Tensor, qwb: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``_impl`` weights ``qw_i * sqrtf(sigma2 + x_i**2)``, ``sigma2 = factor * sum(x*x) / 256`` per
    super-block (``x``, ``qwb`` ``[nb, 256]``), as ``[16, sub-blocks]``, and their sums ``sw`` ``[nb, 16]``."""
    sumx2 = seq_sum((x * x).t().contiguous())
    sigma2 = sumx2 * factor / QK_K  # exact scalings by powers of two, as the C's 2*sumx2/QK_K
    xs = _sub_blocks(x)
    w = _sub_blocks(qwb).mul_(sqrtf(xs * xs + sigma2.repeat_interleave(16).unsqueeze(0)))
    return w, seq_sum(w).view(-1, 16)


# --------------------------------------------------------------------------- Q2_K


def _q2_finish(x: torch.Tensor, L: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """The common end of the q2 functions: ``block_q2_K`` bytes ``[nb, 84]`` from ``x`` ``[nb, 256]``, the
    search's codes ``L`` ``[nb, 256]``, fp16 ``d`` / ``dmin`` ``[nb]`` and the scale bytes ``sc`` ``[nb, 16]``
    (int32), the codes recomputed from the stored scales."""
    nb = x.shape[0]
    dd = d.float().unsqueeze(1) * (sc & 0xF).float()
    dm = dmin.float().unsqueeze(1) * (sc >> 4).float()
    keep = dd == 0  # if (!d) continue;  the search's codes stay
    q = nearest_int((x.view(nb, 16, 16) + dm.unsqueeze(2)) / torch.where(keep, torch.ones_like(dd), dd).unsqueeze(2))
    q = torch.where(keep.unsqueeze(2), L.view(nb, 16, 16).to(torch.int32), q.clamp_(0, 3))
    out = torch.empty(nb, Q2_SIZE, dtype=torch.uint8, device=x.device)
    out[:, :16] = sc.to(torch.uint8)
    pack_2bit(q.reshape(nb, QK_K), out[:, 16:80])
    out[:, 80:82] = fp16_bytes(d)
    out[:, 82:84] = fp16_bytes(dmin)
    return out


def _q2_ref_torch(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = _sub_blocks(x)
    scales, mins, L = ks.make_qkx2_quants(xs, xs.abs(), nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=True)
    scales, mins = scales.view(nb, 16), mins.view(nb, 16)
    max_scale, max_min = _row_max(scales), _row_max(mins)
    q4 = torch.full_like(max_scale, 15.0)
    ls = nearest_int(fdiv(15.0, max_scale).unsqueeze(1) * scales)
    lm = nearest_int(fdiv(15.0, max_min).unsqueeze(1) * mins)
    ls = torch.where((max_scale > 0).unsqueeze(1), ls, torch.zeros_like(ls))
    lm = torch.where((max_min > 0).unsqueeze(1), lm, torch.zeros_like(lm))
    sc = (ls | (lm << 4)) & 0xFF  # y.scales[j] = l; y.scales[j] |= (l << 4): stored as uint8
    d = fp16_scale(max_scale / q4, "scale", x)  # 0 where max_scale is 0
    dmin = fp16_scale(max_min / q4, "minimum", x)
    return _q2_finish(x, L.t().reshape(nb, QK_K), d, dmin, sc)


def _q2_impl_torch(x: torch.Tensor, qwb: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    w, sw = _sigma2_weights(x, qwb, 1.0)
    scales, mins, L = ks.make_qkx3_quants(_sub_blocks(x), w, nmax=3, rmin=-0.9, rdelta=0.05, nstep=36, use_mad=False)
    sw_t = sw.t().contiguous()
    dm, Ls = ks.make_qp_quants(scales.view(nb, 16).t().contiguous(), sw_t, 15)
    mm, Lm = ks.make_qp_quants(mins.view(nb, 16).t().contiguous(), sw_t, 15)
    d = fp16_scale(dm, "scale", x)
    dmin = fp16_scale(mm, "minimum", x)
    Ls, Lm = Ls.t().to(torch.int32) & 0xFF, Lm.t().to(torch.int32) & 0xFF  # uint8 codes (the C's wrap)
    return _q2_finish(x, L.t().reshape(nb, QK_K), d, dmin, (Ls | (Lm << 4)) & 0xFF)


def decode_q2_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q2_K`` bytes ``[nb, 84]`` -> fp32 ``[nb, 256]``: ``d*(sc & 0xF) * q - dmin*(sc >> 4)``."""
    nb = b.shape[0]
    sc = b[:, :16].to(torch.int32)
    dl = read_fp16(b, 80) * (sc & 0xF).float()
    ml = read_fp16(b, 82) * (sc >> 4).float()
    q = unpack_2bit(b[:, 16:80]).view(nb, 16, 16).float()
    return (dl.unsqueeze(2) * q - ml.unsqueeze(2)).reshape(nb, QK_K)


# --------------------------------------------------------------------------- Q3_K


def _q3_unpack_scales(s: torch.Tensor) -> torch.Tensor:
    """The 12 scale bytes ``[nb, 12]`` -> the signed 6-bit scales ``sc_j`` int32 ``[nb, 16]`` (``- 32``)."""
    lo = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=1)
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=s.device).view(1, 4, 1)
    hi = ((s[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(-1, 16)  # j = 4 * (j / 4) + j % 4
    return (lo | (hi << 4)).to(torch.int32) - 32


def _q3_pack_scales(l: torch.Tensor, out: torch.Tensor) -> None:
    """6-bit scales ``l`` (int, ``0..63``) ``[nb, 16]`` into the 12 bytes ``out`` ``[nb, 12]``."""
    out[:, :8] = ((l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)).to(torch.uint8)
    top = (l >> 4).view(-1, 4, 4)  # [nb, j / 4, j % 4]
    out[:, 8:12] = (top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)).to(torch.uint8)


def _q3_finish(x: torch.Tensor, L: torch.Tensor, d: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """The common end of the q3 functions: ``block_q3_K`` bytes ``[nb, 110]`` from ``x`` ``[nb, 256]``, the
    search's stored codes ``L`` ``[nb, 256]`` (``0..7``), fp16 ``d`` ``[nb]`` and the 6-bit scales ``l``
    ``[nb, 16]``, the codes recomputed from the stored scales."""
    nb = x.shape[0]
    out = torch.empty(nb, Q3_SIZE, dtype=torch.uint8, device=x.device)
    _q3_pack_scales(l, out[:, 96:108])
    dd = d.float().unsqueeze(1) * _q3_unpack_scales(out[:, 96:108]).float()
    keep = dd == 0
    q = nearest_int(x.view(nb, 16, 16) / torch.where(keep, torch.ones_like(dd), dd).unsqueeze(2)).clamp_(-4, 3).add_(4)
    pack_q3_codes(torch.where(keep.unsqueeze(2), L.view(nb, 16, 16).to(torch.int32), q), out)
    out[:, 108:110] = fp16_bytes(d)
    return out


def pack_q3_codes(q: torch.Tensor, out: torch.Tensor) -> None:
    """Codes ``0..7`` (int, any shape of ``nb * 256``) into ``hmask`` and ``qs`` of ``block_q3_K`` bytes ``out``
    ``[nb, 110]`` (``out[:, :96]``): bit ``k`` of ``hmask[m]`` is bit 2 of code ``32k + m``, the low two bits
    packed by :func:`pack_2bit`."""
    nb = out.shape[0]
    q = q.reshape(nb, 8, 32).to(torch.int32)  # [nb, j / 32, j % 32]
    high = q > 3
    bits = high.to(torch.int32) << torch.arange(8, dtype=torch.int32, device=q.device).view(1, 8, 1)
    out[:, :32] = bits.sum(dim=1).to(torch.uint8)
    pack_2bit((q - 4 * high.to(torch.int32)).reshape(nb, QK_K), out[:, 32:96])


def q3_codes(b: torch.Tensor) -> torch.Tensor:
    """``block_q3_K`` bytes ``[nb, 110]`` -> the codes ``0..7`` int32 ``[nb, 256]`` (``q - 4`` is the level)."""
    nb = b.shape[0]
    hbit = (b[:, :32].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    return unpack_2bit(b[:, 32:96]).to(torch.int32) + 4 * hbit.reshape(nb, QK_K).to(torch.int32)


def _q3_ref_torch(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    scales, L = ks.make_q3_quants(_sub_blocks(x), 4, True)
    scales = scales.view(nb, 16)
    _, max_scale = first_max_abs(scales, 1)  # the first scale of largest magnitude, signed (0 if none)
    nz = max_scale != 0
    iscale = fdiv(-32.0, torch.where(nz, max_scale, torch.ones_like(max_scale)))
    l = nearest_int(iscale.unsqueeze(1) * scales)
    l = ((l + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
    l = torch.where(nz.unsqueeze(1), l.clamp_(-32, 31) + 32, torch.zeros_like(l))
    d = fp16_scale(torch.where(nz, fdiv(1.0, iscale), torch.zeros_like(iscale)), "scale", x)
    return _q3_finish(x, L.t().reshape(nb, QK_K), d, l)


def _q3_impl_torch(x: torch.Tensor, qwb: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    w, sw = _sigma2_weights(x, qwb, 2.0)
    scales, L = ks.make_qx_quants(_sub_blocks(x), 4, rmse_type=1, qw=w)
    d_block, Ls = ks.make_qx_quants(scales.view(nb, 16).t().contiguous(), 32, rmse_type=1, qw=sw.t().contiguous())
    d = fp16_scale(d_block, "scale", x)
    return _q3_finish(x, L.t().reshape(nb, QK_K), d, Ls.t().to(torch.int32))


def decode_q3_k(b: torch.Tensor) -> torch.Tensor:
    """``block_q3_K`` bytes ``[nb, 110]`` -> fp32 ``[nb, 256]``: ``(d * sc_j) * (q - 4)``, ``q``'s high bit
    from ``hmask``."""
    nb = b.shape[0]
    dl = read_fp16(b, 108) * _q3_unpack_scales(b[:, 96:108]).float()
    q = q3_codes(b) - 4
    return (dl.unsqueeze(2) * q.view(nb, 16, 16).float()).reshape(nb, QK_K)


# --------------------------------------------------------------------------- drivers: kernel or torch


# kind -> (bytes per block, unit of work for kernels._split): about half a millisecond of one thread
# (measured ~4, 9, 1.4 and 2.5 us per super-block), in whole tiles of the kernels' 64 super-blocks
_KERNELS = {"q2_k": (Q2_SIZE, 128), "q2_k_impl": (Q2_SIZE, 64), "q3_k": (Q3_SIZE, 384), "q3_k_impl": (Q3_SIZE, 192)}
_TORCH = {"q2_k": _q2_ref_torch, "q2_k_impl": _q2_impl_torch, "q3_k": _q3_ref_torch, "q3_k_impl": _q3_impl_torch}


def _run_kernel(kind: str, x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """The compiled encoder over all super-blocks of ``x`` ``[nb, 256]`` (``qw`` ``[blocks per row, 256]``
    for the ``_impl`` kinds), split over the threads; a ``d`` / ``dmin`` beyond fp16 is refused here."""
    jit = _jit()
    nb = x.shape[0]
    size, unit = _KERNELS[kind]
    xn = x.detach().contiguous().numpy()
    impl = qw is not None
    qn = qw.detach().contiguous().numpy() if impl else np.zeros((1, QK_K), np.float32)
    out = np.empty((nb, size), np.uint8)
    d, m = np.zeros(nb, np.float32), np.zeros(nb, np.float32)
    if kind.startswith("q2_k"):
        run = lambda lo, hi: jit.run_q2_k(xn, qn, impl, lo, hi, out, d, m)
    else:
        run = lambda lo, hi: jit.run_q3_k(xn, qn, impl, lo, hi, out, d)
    kernels._split(run, nb, unit=unit)
    for v, what in ((d, "scale"), (m, "minimum")):
        t = torch.from_numpy(v)
        if not bool(torch.isfinite(t.to(torch.float16)).all()):
            fp16_scale(t, what, x)  # raises, with the torch encoders' message
    return torch.from_numpy(out)


def _encode(kind: str, x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """``kind``'s encoder on fp32 super-blocks ``x`` ``[nb, 256]``: the kernel on CPU, else the torch code in
    chunks (``qw`` ``[blocks per row, 256]``: block ``b`` of the rows in order takes row ``b % len(qw)``)."""
    nb = x.shape[0]
    size = _KERNELS[kind][0]
    if nb == 0:
        return torch.empty(0, size, dtype=torch.uint8, device=x.device)
    check_finite(*torch.aminmax(x))
    if kernels.available(x):
        with kernels.owning_the_cores():
            return _run_kernel(kind, x, qw)
    out = torch.empty(nb, size, dtype=torch.uint8, device=x.device)
    for i in range(0, nb, CHUNK):
        xc = x[i : i + CHUNK]
        if qw is None:
            out[i : i + CHUNK] = _TORCH[kind](xc)
        else:
            rows = torch.arange(i, i + xc.shape[0], device=x.device) % qw.shape[0]
            out[i : i + CHUNK] = _TORCH[kind](xc, qw.index_select(0, rows))
    return out


def _weighted(kind: str, name: str) -> Any:
    def weighted(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        check_importance(qw, name)
        if cols % QK_K:
            raise SchemeError(f"{name}: rows of {cols} are not whole super-blocks of {QK_K}")
        blocks = _encode(kind, x.reshape(-1, QK_K), qw.reshape(-1, QK_K).to(torch.float32).contiguous())
        return blocks.view(rows, cols // QK_K * _KERNELS[kind][0])

    weighted.__name__ = weighted.__qualname__ = f"weighted_{name}"
    weighted.__doc__ = (
        f"fp32 rows ``[rows, cols]`` and the importance of each column ``[cols]`` -> {name} blocks "
        f"``[rows, cols / 256 * {_KERNELS[kind][0]}]`` (``quantize_row_{name[:2]}_K_impl`` row by row)."
    )
    return weighted


def encode_q2_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q2_K`` bytes ``[nb, 84]`` (``quantize_row_q2_K_ref``)."""
    return _encode("q2_k", x, None)


def encode_q3_k(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_q3_K`` bytes ``[nb, 110]`` (``quantize_row_q3_K_ref``)."""
    return _encode("q3_k", x, None)


weighted_q2_k = _weighted("q2_k_impl", "q2_k")
weighted_q3_k = _weighted("q3_k_impl", "q3_k")

register_codec(T.Q2_K, encode_q2_k, decode_q2_k, weighted=weighted_q2_k)
register_codec(T.Q3_K, encode_q3_k, decode_q3_k, weighted=weighted_q3_k)


Q2_K = register(KQuantScheme(
    "q2_k", T.Q2_K, 2, fallback=Q4_0,
    description="llama.cpp Q2_K: sixteen sub-blocks of 16 with 4-bit scales and minimums, 2-bit codes",
))
Q3_K = register(KQuantScheme(
    "q3_k", T.Q3_K, 3, fallback=Q4_0,
    description="llama.cpp Q3_K: sixteen sub-blocks of 16 with 6-bit scales, 3-bit codes",
))

__all__ = ["Q2_K", "Q3_K", "decode_q2_k", "decode_q3_k", "encode_q2_k", "encode_q3_k",
           "weighted_q2_k", "weighted_q3_k"]
