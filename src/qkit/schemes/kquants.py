"""llama.cpp's k-quants ``q4_k`` and ``q6_k`` (super-blocks of 256) and the ``q4_k_m`` recipe.

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

``make_qkx2_quants`` fits ``x ~ scale * L + min`` (``min <= 0``, ``L`` in ``0..15``) by weighted least
squares: it starts from ``iscale = 15 / (max - min)`` and tries the 21 inverse scales
``(rmin + rdelta*is + 15) / (max - min)``, ``is = 0..20``, keeping the one with the lowest weighted
squared error (strictly lower: the first wins a tie). When a step wins, the C code overwrites ``min``
with the fitted minimum, and the later steps shift ``x`` by, and divide by ``max -``, that new ``min``.

**q6_k** (``block_q6_K``, 210 bytes per 256 weights, 6.5625 bits per weight): ``ql: u8[128], qh: u8[64],
scales: i8[16], d: fp16``; sixteen sub-blocks of 16 with an 8-bit signed scale and 6-bit codes;
``w = d*sc * (q - 32)``. ``quantize_row_q6_K_ref``: ``scale_j = make_qx_quants(x, nmax=32, rmse_type=1)``
(a symmetric fit weighted by ``x*x`` over the inverse scales ``-(32 + 0.1*is) / max``, ``is = -9..9``),
``d = fp16(1 / (-128/max_scale))`` (``max_scale`` the first scale of largest magnitude), ``sc_j =
min(127, nearest_int(-128/max_scale * scale_j))``, ``q_i = clamp(nearest_int(x_i / (d*sc_j)), -32, 31) + 32``;
a super-block whose scales are all below ``GROUP_MAX_EPS = 1e-15`` is all zero bytes.

**Exactness.** Every operation is fp32, in the C code's order and association, so the bytes equal
``ggml_quantize_chunk`` (no importance matrix) as built for x86-64 (ggml-base is compiled without
``-march``, so no FMA contraction; a build that contracts ``a*b + c`` into FMA, as compilers may on
ARM, can differ in the last bit of a sum and so, rarely, in a code). The sums are sequential, as the
C loops are: ``seq_sum`` adds the 32 (or 16) terms one at a time, vectorised over all sub-blocks, since
``torch.sum`` sums pairwise. Two torch operations are not the IEEE ones and are avoided: ``c / tensor``
(multiplies by a reciprocal: :func:`fdiv` divides) and fp32 ``torch.sqrt`` (can be an ulp off:
:func:`sqrtf` rounds the fp64 root). ``nearest_int`` (the ``+ 12582912.f`` trick) is round-half-to-even, i.e.
``torch.round``, for the bounded values it sees here; an inverse scale that overflows to inf (a
sub-block narrower than about 4e-38) gives code 0, as the trick does for inf and NaN. On CPU the two
scale searches run in compiled kernels (:mod:`qkit.schemes.kernels`: the same fp32 operations in the same
order per sub-block, vectorised across sub-blocks; 4-5x faster than llama.cpp's own C on one thread);
the torch code here is their oracle in the tests and the path on other devices. Decoding equals
``dequantize_row_q4_K`` / ``dequantize_row_q6_K`` and ``gguf.quants.dequantize`` bit for bit.

**Widths.** llama.cpp's ``tensor_type_fallback`` (``llama-quant.cpp``): a tensor whose row width
``ncols`` (ggml ``ne[0]``, the last dimension) is not a multiple of 256 is written as **q5_0** instead
of q4_k and as **q8_0** instead of q6_k; if the width is not even a multiple of 32, llama.cpp writes
F16, qkit refuses it (``SchemeError``). ``resolve(shape, name)`` applies this rule, so the
``QuantizedTensor``'s scheme is the type actually written: the default model's 576-wide matrices get
q5_0 under q4_k, its 1536-wide ``down_proj`` q4_k.

**q4_k_m** is llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` (``llama_tensor_get_type_impl``, then the width
fallback above), for a dense (not mixture-of-experts) llama/qwen2-family model; see :class:`Q4KMRecipe`.
"""

from __future__ import annotations


import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
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
from qkit.schemes.registry import Scheme, as_2d, register

QK_K = 256  # weights per super-block (ggml-common.h)
GROUP_MAX_EPS = float(np.float32(1e-15))  # ggml-quants.c: a (sub-)block below this is all zero
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the llama.cpp these rules are read from


# --------------------------------------------------------------------------- exact fp32 helpers


def seq_sum(terms: torch.Tensor, *, from_zero: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``i`` of ``terms`` ``[R, ...]`` added in order, in fp32: ``((0 + t0) + t1) + ...`` (the C loop
    ``s = 0; for (i...) s += t[i];``), or ``(t0 + t1) + ...`` with ``from_zero=False`` (``s = t[0]; ...``).
    Vectorised over the other dimensions; ``torch.sum`` adds in another order and rounds differently.

    On CPU one ``index_add_`` onto a single row does the ``R`` row additions in order inside torch (its
    CPU kernel adds ``source[i]`` for ``i = 0, 1, ...``; checked once per process by
    :func:`_index_add_is_sequential`, else, and on other devices, a Python loop of ``add_``)."""
    first = 0 if from_zero else 1
    acc = out if out is not None else torch.empty(terms.shape[1:], dtype=terms.dtype, device=terms.device)
    if from_zero:
        acc.zero_()
    else:
        acc.copy_(terms[0])
    if terms.device.type == "cpu" and _index_add_is_sequential():
        acc.unsqueeze(0).index_add_(0, _zeros_index(terms.shape[0] - first), terms[first:])
    else:
        for row in terms[first:].unbind(0):
            acc.add_(row)
    return acc


_ZEROS: dict[int, torch.Tensor] = {}
_SEQUENTIAL: list[bool] = []


def _zeros_index(n: int) -> torch.Tensor:
    if n not in _ZEROS:
        _ZEROS[n] = torch.zeros(n, dtype=torch.long)
    return _ZEROS[n]


def _index_add_is_sequential() -> bool:
    """Whether this torch's CPU ``index_add_`` with a repeated index adds the rows in order (probed once on
    values whose fp32 sum depends on the order)."""
    if not _SEQUENTIAL:
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(32, 4099, generator=gen) * torch.exp(torch.randn(32, 4099, generator=gen) * 8)
        loop = torch.zeros(4099)
        for row in probe.unbind(0):
            loop.add_(row)
        fast = torch.zeros(1, 4099).index_add_(0, torch.zeros(32, dtype=torch.long), probe)[0]
        _SEQUENTIAL.append(bool(torch.equal(fast, loop)))
    return _SEQUENTIAL[0]


def fdiv(a: float, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` for an fp32 constant ``a``, correctly rounded (``a / tensor`` in torch multiplies by the
    reciprocal: two roundings)."""
    return torch.full_like(b, a).div_(b)


def codes_into(out: torch.Tensor, x: torch.Tensor, shift: torch.Tensor | None, iscale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``out = clamp(nearest_int(iscale * (x - shift)), lo, hi)`` (fp32 ``[R, n]``; ``shift``, ``iscale``
    ``[n]``). ``nearest_int`` rounds half to even (the ``+ 12582912.f`` trick) for the bounded values it
    gets here; a non-finite ``iscale`` (a sub-block narrower than about 4e-38) gives 0, as the trick does
    for inf and NaN."""
    iscale = torch.nan_to_num(iscale, nan=0.0, posinf=0.0, neginf=0.0)
    if shift is None:
        torch.mul(x, iscale, out=out)
    else:
        torch.sub(x, shift, out=out).mul_(iscale)
    return out.round_().clamp_(lo, hi)


def sqrtf(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (C ``sqrtf``): ``torch.sqrt`` on fp32 CPU tensors can be one
    ulp off (it is not the IEEE operation); the fp64 root rounded to fp32 is exact (double rounding is
    innocuous for a square root when the wide format has more than ``2p + 2`` bits)."""
    return v.double().sqrt_().float()


def first_max_abs(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, max)`` along ``dim``: the largest ``|x|`` and the first element reaching it, signed
    (``+0`` where all are zero): the C loop ``if (ax > amax) { amax = ax; max = x[i]; }``. From ``amax``
    and ``amin`` (an ``argmax`` over the whole tensor is several times slower); only where both ``+a`` and
    ``-a`` occur does the first one have to be looked up."""
    hi, lo = x.amax(dim=dim), x.amin(dim=dim)
    amax = torch.maximum(hi, -lo).abs()
    mx = torch.where(hi >= -lo, hi, lo)
    tie = (hi == -lo) & (hi != 0)
    if bool(tie.any()):
        cols = tie.nonzero().squeeze(1)
        sub = x.index_select(1 - dim, cols)  # the tied rows / columns
        hit = (sub.abs() == amax.index_select(0, cols).unsqueeze(dim)).to(torch.uint8)
        first = hit.argmax(dim=dim, keepdim=True)
        mx = mx.index_put((cols,), sub.gather(dim, first).squeeze(dim))
    return amax, torch.where(amax > 0, mx, torch.zeros_like(mx))


# --------------------------------------------------------------------------- make_qkx2_quants / make_qx_quants


# (rmin + rdelta*is + nmax) for Q4_K's make_qkx2_quants(32, 15, ..., -1.f, 0.1f, 20): each step rounded to fp32
_QKX2_STEPS = [
    float(np.float32(np.float32(-1.0) + np.float32(0.1) * np.float32(i)) + np.float32(15)) for i in range(21)
]
# -(nmax + 0.1f*is) for make_qx_quants(16, 32, ...), is = -9..9 without 0
_QX_STEPS = [
    float(-(np.float32(32) + np.float32(0.1) * np.float32(i))) for i in range(-9, 10) if i != 0
]


def make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int = 15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, -1.f, 0.1f, 20, false)`` for every column.

    ``x``, ``w``: fp32 ``[n, S]`` (element ``i`` of sub-block ``k`` at ``[i, k]``). Returns ``(scale [S],
    the_min [S], L [n, S])``: ``x ~ scale * L - the_min``, ``L`` fp32 codes in ``0..nmax``. The large
    intermediates live in three preallocated buffers (fresh multi-megabyte tensors per step cost more
    than the arithmetic).
    """
    n, S = x.shape
    mn = x.amin(dim=0).clamp_(max=0)  # if (min > 0) min = 0;
    mx = x.amax(dim=0)
    same = mx == mn
    sum_w = seq_sum(w, from_zero=False)
    sum_x = seq_sum(w * x, from_zero=False)
    La = torch.empty_like(x)
    err = torch.empty_like(x)
    prods = torch.empty(n, 3, S, dtype=x.dtype, device=x.device)  # w*l, w*l*l, w*l*x per element
    sums = torch.empty(3, S, dtype=x.dtype, device=x.device)

    def weighted_error(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """sum_i w_i * ((scale * L_i + shift) - x_i)^2, with ``L`` in ``La``."""
        torch.mul(La, scale, out=err).add_(shift).sub_(x)
        return seq_sum(err.mul_(err).mul_(w))

    iscale0 = fdiv(float(nmax), mx - mn)
    codes_into(La, x, mn, iscale0, 0, nmax)
    best_err = weighted_error(fdiv(1.0, iscale0), mn)
    best_scale = fdiv(1.0, iscale0)
    # The C loop updates ``min`` itself when a step wins, so the later steps shift x by the new min and
    # divide by the new (max - min): the search is sequential per sub-block, vectorised across them.
    cur_min = mn
    best_iscale, best_shift = iscale0, mn  # what the kept codes were computed from
    for c in _QKX2_STEPS:
        iscale = fdiv(c, mx - cur_min)
        codes_into(La, x, cur_min, iscale, 0, nmax)
        wl = prods[:, 0]
        torch.mul(w, La, out=wl)
        torch.mul(wl, La, out=prods[:, 1])
        torch.mul(wl, x, out=prods[:, 2])
        sum_l, sum_l2, sum_xl = seq_sum(prods, out=sums)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        cur_err = weighted_error(this_scale, this_min)
        better = (D > 0) & (cur_err < best_err)
        best_err = torch.where(better, cur_err, best_err)
        best_scale = torch.where(better, this_scale, best_scale)
        best_iscale = torch.where(better, iscale, best_iscale)
        best_shift = torch.where(better, cur_min, best_shift)
        cur_min = torch.where(better, this_min, cur_min)
    # The kept codes, recomputed from what they were computed from (the same fp32 operations give the same L).
    L = codes_into(La, x, best_shift, best_iscale, 0, nmax)
    best_min = cur_min
    if bool(same.any()):  # max == min: L = 0, the_min = -min, scale 0
        L.mul_((~same).to(L.dtype))
        best_scale = torch.where(same, torch.zeros_like(best_scale), best_scale)
        best_min = torch.where(same, mn, best_min)
    return best_scale, best_min.neg(), L


def make_qx_quants(x: torch.Tensor, nmax: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` for every column of ``x`` ``[n, S]`` (fp32).

    Returns ``(scale [S], L [n, S])`` with ``L`` the stored codes ``l + nmax`` in ``0..2*nmax-1`` (fp32);
    a column with ``max|x| < GROUP_MAX_EPS`` gets scale 0 and codes 0.
    """
    n, S = x.shape
    amax, mx = first_max_abs(x, 0)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    L = torch.empty_like(x)
    prods = torch.empty(n, 2, S, dtype=x.dtype, device=x.device)  # w*x*l, w*l*l per element
    sums = torch.empty(2, S, dtype=x.dtype, device=x.device)

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes_into(L, x, None, iscale, -nmax, nmax - 1)
        torch.mul(wx, L, out=prods[:, 0])
        torch.mul(w, L, out=prods[:, 1]).mul_(L)
        sumlx, suml2 = seq_sum(prods, out=sums)
        return sumlx.clone(), suml2.clone()

    iscale0 = fdiv(float(-nmax), mx)
    sumlx, suml2 = fit(iscale0)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    best_iscale = iscale0
    for c in _QX_STEPS:
        iscale = fdiv(c, mx)
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    codes_into(L, x, None, best_iscale, -nmax, nmax - 1).add_(nmax)
    if bool(zero.any()):
        L.mul_((~zero).to(L.dtype))
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, L


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
                f"{QK_K}; llama.cpp would keep this one as F16); exclude it with --exclude"
            )
        return self.fallback


Q4_K = register(KQuantScheme("q4_k", T.Q4_K, 4, Q5_0))
Q6_K = register(KQuantScheme("q6_k", T.Q6_K, 6, Q8_0))


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's ``use_more_bits`` (C integer division): the first and last eighth of the layers
    and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# Tensor categories of llama-quant.cpp's ``tensor_get_category``, for Hugging Face and GGUF names.
_ATTN_V = re.compile(r"(^|\.)(self_attn\.(v_proj|qkv_proj|kv_b_proj)|attn_(v|qkv|kv_b))\.weight$")
_FFN_DOWN = re.compile(r"(^|\.)(mlp\.down_proj|ffn_down)\.weight$")
_OUTPUT = re.compile(r"^(lm_head|output)\.weight$")
_TOKEN_EMBD = re.compile(r"^(model\.)?(embed_tokens|token_embd)\.weight$")
_LAYER = re.compile(r"(^|\.)(layers|blk)\.(\d+)\.")


@dataclass(frozen=True)
class Q4KMRecipe:
    """llama.cpp's Q4_K_M mixture (``LLAMA_FTYPE_MOSTLY_Q4_K_M``), per tensor, in ``resolve(shape, name)``.

    From ``llama_tensor_get_type_impl`` (llama-quant.cpp, commit in ``LLAMA_CPP_COMMIT``), for a dense
    model (``n_expert <= 1``) that is not llama.cpp's 70B type, default type Q4_K:

    * ``attn_v`` (``self_attn.v_proj``; also a fused ``qkv_proj``) and ``ffn_down`` (``mlp.down_proj``) of
      layer ``i`` get **Q6_K** where ``use_more_bits(i, n_layers)``: ``i < n/8 or i >= 7n/8 or
      (i - n/8) % 3 == 2`` (integer division; for 30 layers: 0-2, 5, 8, 11, 14, 17, 20, 23, 26-29);
      llama.cpp counts these tensors in its load order, which is by layer, so ``i`` is the layer index;
    * ``output`` (``lm_head``), and the token embedding when it is tied to the output, gets **Q6_K**, or
      **Q8_0** when its width is not a multiple of 256;
    * every other tensor (q, k, o, gate, up; an untied token embedding) gets **Q4_K**;
    * then the width fallback: Q4_K -> Q5_0 and Q6_K -> Q8_0 where the width is not a multiple of 256.

    qkit quantizes only the block projections by default (``qkit.transform``): llama.cpp's Q4_K_M file
    also quantizes ``token_embd`` (Q4_K, or like ``output`` when tied) and ``output`` (Q6_K), which qkit's
    row keeps in the original dtype unless the user includes them (``--include``).

    ``n_layers`` (the model's ``num_hidden_layers``) is needed for attn_v / ffn_down; a recipe without it
    refuses those tensors. ``bind_model(scheme, config)`` fills it (and ``tied_embeddings``) from a
    model's config. ``to_dict`` records them when bound; ``scheme_from_dict`` gives back the unbound
    recipe (each tensor's manifest entry holds the type it actually got, which is what decoding needs).
    """

    name: str = "q4_k_m"
    n_layers: int | None = None
    tied_embeddings: bool = False
    kind = "ggml"
    ggml_type = T.Q4_K  # the file type's default tensor type
    bits = 4
    scale_dtype = torch.float16
    fixed_scale_dtype = True
    parts = ("qweight", "scales")

    def ggml_type_for(self, shape: tuple[int, ...], name: str) -> Any:
        """The llama.cpp type this recipe gives ``name`` before the width fallback."""
        cols = shape[-1] if shape else 1
        if _OUTPUT.search(name) or (self.tied_embeddings and _TOKEN_EMBD.search(name)):
            return T.Q8_0 if cols % QK_K else T.Q6_K
        if _ATTN_V.search(name) or _FFN_DOWN.search(name):
            m = _LAYER.search(name)
            if self.n_layers is None:
                raise SchemeError(
                    f"tensor {name}: {self.name} needs the model's layer count to choose this tensor's type "
                    "(llama.cpp's use_more_bits); bind it with qkit.schemes.kquants.bind_model(scheme, config)"
                )
            if m is None or not 0 <= int(m.group(3)) < self.n_layers:
                raise SchemeError(f"tensor {name}: no layer index below {self.n_layers} in its name; {self.name} cannot place it")
            return T.Q6_K if use_more_bits(int(m.group(3)), self.n_layers) else T.Q4_K
        return T.Q4_K

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> GGMLScheme:
        t = self.ggml_type_for(tuple(shape), name)
        return {T.Q4_K: Q4_K, T.Q6_K: Q6_K, T.Q8_0: Q8_0}[t].resolve(tuple(shape), name)

    def nbytes_for(self, shape: tuple[int, ...], name: str | None = None) -> int:
        """Bytes stored for ``name`` (its resolved type); without a name, those of a plain Q4_K tensor."""
        return self.resolve(tuple(shape), name or "<tensor>").nbytes_for(tuple(shape))

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A tensor without a name gets the default type (``quantize_tensor`` resolves by name first)."""
        return self.resolve(tuple(w.shape)).encode(w)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode by the bytes per row, which tell the four types this recipe writes apart."""
        rows, cols = as_2d(tuple(shape))
        per_row = parts["qweight"].reshape(rows, -1).shape[1]
        for s in (Q4_K, Q6_K, Q5_0, Q8_0):
            if cols % s.block_size == 0 and per_row == cols // s.block_size * s.type_size:
                return s.decode(parts, shape, dtype)
        raise SchemeError(f"{self.name}: {per_row} bytes per row of width {cols} match none of its types")

    def part_layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """A recipe stores no parts of its own: each tensor's manifest entry names the type it got."""
        raise SchemeError(f"{self.name} is a recipe, not a stored type; a tensor's entry names the type it got (q4_k, q6_k, q5_0, q8_0)")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ggml_type": self.ggml_type.name,
            "recipe": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
        }
        if self.n_layers is not None:
            d["n_layers"] = self.n_layers
            d["tied_embeddings"] = self.tied_embeddings
        return d


Q4_K_M = register(Q4KMRecipe())


def bind_model(scheme: Scheme, config: dict[str, Any]) -> Scheme:
    """``scheme`` with what a recipe needs from the model's ``config.json`` filled in (``n_layers``,
    ``tied_embeddings``); any other scheme unchanged. Refuses models the recipe does not cover here:
    mixture-of-experts (llama.cpp's rules differ) and llama.cpp's 70B type (llama with 80 layers and
    grouped-query attention, qwen2 with 80 layers), whose attn_v would need Q5_K."""
    if not isinstance(scheme, Q4KMRecipe):
        return scheme
    try:
        n_layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SchemeError(f"{scheme.name} needs num_hidden_layers in the model config ({exc})") from exc
    experts = max(int(config.get(k) or 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    if experts > 1:
        raise SchemeError(f"{scheme.name}: mixture-of-experts models ({experts} experts) follow other llama.cpp rules; use q4_k")
    arch = str(config.get("model_type", ""))
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads", config.get("num_attention_heads"))
    if n_layers == 80 and (arch == "qwen2" or (arch == "llama" and heads != kv)):
        raise SchemeError(f"{scheme.name}: llama.cpp gives this 70B-type model's attn_v Q5_K, which qkit does not implement; use q4_k")
    return dataclasses.replace(scheme, n_layers=n_layers, tied_embeddings=bool(config.get("tie_word_embeddings", False)))
