"""llama.cpp's non-linear 4-bit types ``iq4_nl`` and ``iq4_xs``: block layouts, encoders (with and
without an importance matrix) and decoders.

Reference: ``ggml/src/ggml-quants.c`` of llama.cpp at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``:
``quantize_row_iq4_nl_impl``, ``quantize_iq4_nl``, ``quantize_iq4_xs``, ``best_index_int8``,
``dequantize_row_iq4_nl``, ``dequantize_row_iq4_xs``; the grid ``kvalues_iq4nl`` is ``ggml-common.h``'s.
Storage follows the contract of ``qkit.schemes.ggml``: ``qweight`` uint8 ``[rows, bytes_per_row]``
holding row ``r``'s blocks, ``scales`` empty.

**Grid.** A code ``q`` in 0..15 stands for ``v[q]``, ``v = kvalues_iq4nl = (-127, -104, -83, -65, -49,
-35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)``. ``best_index_int8(x)`` is the nearest grid value's
index (0 at or below -127, 15 at or above 113; between ``v[m] <= x < v[m+1]``, ``m`` if ``x - v[m] <
v[m+1] - x`` in fp32, else ``m + 1``: a tie goes up).

**iq4_nl** (``block_iq4_nl``, 18 bytes per 32 weights, 4.5 bits per weight): ``d: fp16, qs: u8[16]``,
``w_j = d * v[q_j]``; ``qs[j] = q[j] | q[j + 16] << 4``. **iq4_xs** (``block_iq4_xs``, 136 bytes per
256 weights, 4.25 bits per weight): ``d: fp16, scales_h: u16, scales_l: u8[4], qs: u8[128]``; eight
sub-blocks of 32, sub-block ``i`` with the 6-bit scale ``ls_i`` (low nibble in ``scales_l[i/2]``,
nibble ``i%2``; high two bits at bit ``2i`` of ``scales_h``) and ``w = d * (ls_i - 32) * v[q]``; the
codes of sub-block ``i`` are packed like an iq4_nl block at ``qs[16i]``.

**Search** (``quantize_row_iq4_nl_impl`` with ``ntry = 7``; ``ggml_quantize_chunk`` calls
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with or without an importance matrix, so the plain encoders
are these, not ``quantize_row_iq4_nl_ref``'s ``ntry = -1``). Per sub-block ``x[0..31]``, weights
``w_j = x_j**2`` without an importance matrix, ``w_j = qw_j * sqrtf(sigma2 + x_j**2)`` with one
(``sigma2 = 2/S * sum x**2`` over the super-block of ``S`` = 32 (iq4_nl) or 256 (iq4_xs) elements)::

    max = first x of largest |x|;  if max|x| < 1e-15: scale = 0, next sub-block
    d = -max / -127;  q = best_index(x / d);  d = sumqx / sumq2  (0 if sumq2 == 0);  best = d * sumqx
    for t in -7..7:  q = best_index((t - 127) / max * x)
                     if sumq2 > 0 and sumqx**2 > best * sumq2: d = sumqx / sumq2; best = d * sumqx
    (sumqx = sum (w*v[q])*x, sumq2 = sum (w*v[q])*v[q], in order)

iq4_nl stores ``fp16(d)`` and ``q = best_index(x * (1/d))`` (the fp32 ``d``; 0 for ``d == 0``).
iq4_xs takes ``max_scale``, the first sub-block scale of largest magnitude, ``D = -max_scale / 32``
(stored as ``fp16(D)``; ``-0.0`` for an all-zero super-block), ``l_i = clamp(nearest_int(scale_i / D),
-32, 31)``, ``ls_i = l_i + 32``, and the codes again with the rounded scale, ``best_index(x / (D*l_i))``
(0 for ``D*l_i == 0``, i.e. code 8): the fp32 ``D``, not its fp16, as the C code does.

**Exactness.** Every operation is fp32 in the C order (no FMA: ggml-base is built without ``-march``),
so the bytes equal ``ggml_quantize_chunk`` bit for bit, with and without an importance matrix; the
tests compare fresh random, tie, sparse, outlier and real-model matrices with the built library. The
torch code here is the oracle and the path off the CPU: sums are sequential (``seq_sum``), divisions
and square roots the IEEE ones (``fdiv``, ``sqrtf``), ``best_index_int8`` the C comparisons
vectorised. On CPU a compiled kernel (:mod:`qkit.schemes._kernels_iquants`, one super-block at a time,
split over the threads) runs the same statements, about 15x faster than llama.cpp's C on one thread.
Decoding equals ``dequantize_row_iq4_*`` and ``gguf.quants.dequantize`` bit for bit.

**Refusals.** NaN / inf weights: ``NonFiniteWeightError``; a scale beyond fp16 (weights above about
8e6 for iq4_nl, 2.6e8 for iq4_xs, or a sub-block scale that is not finite in fp32): ``SchemeError``,
where llama.cpp would write inf or drop the sub-block; an importance vector with NaN, inf or negative
values: ``SchemeError``.

**Widths.** iq4_nl needs a multiple of 32 (else ``SchemeError``; llama.cpp writes F16). iq4_xs falls
back to **iq4_nl** where the width is not a multiple of 256 (``tensor_type_fallback`` in
``llama-quant.cpp``): the default model's 576-wide matrices get iq4_nl under iq4_xs.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import numpy as np
import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.ggml import GGMLScheme, T, check_importance, register_codec
from qkit.schemes.ggml_blocks import check_finite, fp16_bytes, fp16_scale, read_fp16
from qkit.schemes.kquant_search import GROUP_MAX_EPS, fdiv, first_max_abs, seq_sum, sqrtf
from qkit.schemes.kquants import QK_K, KQuantScheme
from qkit.schemes.registry import register
from qkit.threads import one_torch_thread

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h
NTRY = 7  # what quantize_iq4_nl / quantize_iq4_xs pass to quantize_row_iq4_nl_impl
SIZES = {32: 18, QK_K: 136}  # bytes per super-block: block_iq4_nl, block_iq4_xs
CHUNK = 4096  # sub-blocks of 32 per pass of the torch code (keeps the [32, sub-blocks] intermediates small)
_GRID: dict[torch.device, torch.Tensor] = {}


def _grid(device: torch.device) -> torch.Tensor:
    if device not in _GRID:
        _GRID[device] = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=device)
    return _GRID[device]


def _jit() -> ModuleType:
    from qkit.schemes import _kernels_iquants  # local: imports numba (heavy), only when a tensor needs the kernel

    return _kernels_iquants


# --------------------------------------------------------------------------- the torch oracle


def best_index_int8(x: torch.Tensor) -> torch.Tensor:
    """``best_index_int8(16, kvalues_iq4nl, x)`` elementwise for fp32 ``x`` (any shape) -> int64 indices.

    The C: ``x <= v[0]``: 0; ``x >= v[15]``: 15; else the binary search's ``v[m] <= x < v[m+1]`` and
    ``x - v[m] < v[m+1] - x ? m : m + 1`` (fp32 subtractions). ``m`` is the number of ``v[1..14]`` at or
    below ``x``; a NaN, for which every comparison is false, ends the C search at 15."""
    v = _grid(x.device)
    nan = torch.isnan(x)
    xs = torch.where(nan, torch.zeros_like(x), x)
    m = torch.searchsorted(v[1:15].contiguous(), xs, right=True)
    lower = (xs - v[m]) < (v[m + 1] - xs)
    idx = torch.where(lower, m, m + 1)
    idx = torch.where(xs <= v[0], torch.zeros_like(idx), idx)
    return torch.where((xs >= v[15]) | nan, torch.full_like(idx, 15), idx)


def _sub_block_scales(xe: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scale search of ``quantize_row_iq4_nl_impl`` for every sub-block: ``xe``, ``w`` fp32 ``[32, B]``
    (element ``j`` of sub-block ``k`` at ``[j, k]``) -> the scales, fp32 ``[B]`` (0 where ``max|x| < 1e-15``)."""
    v = _grid(xe.device)
    amax, mx = first_max_abs(xe, 0)
    prods = torch.empty(32, 2, xe.shape[1], dtype=xe.dtype, device=xe.device)
    sums = torch.empty(2, xe.shape[1], dtype=xe.dtype, device=xe.device)

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = v[best_index_int8(xe * iscale)]
        wq = w * q
        torch.mul(wq, xe, out=prods[:, 0])
        torch.mul(wq, q, out=prods[:, 1])
        sumqx, sumq2 = seq_sum(prods, out=sums)
        return sumqx.clone(), sumq2.clone()

    d = (-mx) / float(KVALUES_IQ4NL[0])  # ntry > 0: -max/values[0]
    sumqx, sumq2 = fit(fdiv(1.0, d))
    pos = sumq2 > 0
    d = torch.where(pos, sumqx / torch.where(pos, sumq2, 1.0), torch.zeros_like(sumqx))
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = fit(fdiv(float(itry + KVALUES_IQ4NL[0]), mx))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, sumqx / torch.where(better, sumq2, 1.0), d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(amax < GROUP_MAX_EPS, torch.zeros_like(d), d)


def quantize_iq4_torch(
    x: torch.Tensor, qw: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``quantize_row_iq4_nl_impl(S, 32, ..., ntry=7)`` on every super-block (row) of ``x`` fp32 ``[n, S]``,
    ``S`` = 32 (iq4_nl) or 256 (iq4_xs); ``qw`` fp32 ``[n, S]`` the importance of each element, or
    ``None`` (weights ``x*x``).

    Returns ``(d fp32 [n] (what is stored as fp16), codes uint8 [n, S], ls int64 [n, 8] the 6-bit scales
    (iq4_xs) or None, bad bool [n] where a sub-block scale is not finite)``."""
    n, S = x.shape
    nsub = S // 32
    xe = x.reshape(n * nsub, 32).t()
    if qw is None:
        w = xe * xe
    else:
        xt = x.t()
        sigma2 = seq_sum(xt * xt).mul_(2.0 / S)  # sigma2 *= 2.f/super_block_size: a power of two, exact
        w = qw.reshape(n * nsub, 32).t() * sqrtf(sigma2.repeat_interleave(nsub) + xe * xe)
    scales = _sub_block_scales(xe.contiguous(), w.contiguous()).view(n, nsub)
    bad = ~torch.isfinite(scales).all(dim=1)
    if nsub == 1:
        s = scales[:, 0]
        iscale = torch.where(s != 0, fdiv(1.0, s), torch.zeros_like(s))
        return s, best_index_int8(x * iscale.unsqueeze(1)).to(torch.uint8), None, bad
    _, max_scale = first_max_abs(torch.where(torch.isfinite(scales), scales, 0.0), 1)
    d = (-max_scale) / 32.0
    iscale = torch.where(d != 0, fdiv(1.0, d), torch.zeros_like(d))
    l = (iscale.unsqueeze(1) * scales).nan_to_num_(0.0).round_().clamp_(-32, 31)  # nearest_int; MAX(-32, MIN(31, l))
    dl = d.unsqueeze(1) * l
    idl = torch.where(dl != 0, fdiv(1.0, dl), torch.zeros_like(dl))
    codes = best_index_int8(x.reshape(n, nsub, 32) * idl.unsqueeze(2)).to(torch.uint8).view(n, S)
    return d, codes, l.to(torch.int64) + 32, bad


def _pack(codes: torch.Tensor, ls: torch.Tensor | None, out: torch.Tensor) -> None:
    """Everything but the fp16 ``d`` into ``out`` (uint8 ``[n, size]``): ``qs`` (per 32 codes ``q[j] |
    q[j + 16] << 4``) and, for iq4_xs, ``scales_h`` / ``scales_l``."""
    n, S = codes.shape
    c = codes.view(n, S // 32, 32)
    qs = (c[:, :, :16] | (c[:, :, 16:] << 4)).reshape(n, S // 2)
    if ls is None:
        out[:, 2:] = qs
        return
    out[:, 8:] = qs
    out[:, 4:8] = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).to(torch.uint8)
    shifts = torch.arange(0, 16, 2, device=ls.device)
    sh = ((ls >> 4) << shifts).sum(dim=1)  # disjoint bits: the sum is the C's |=
    out[:, 2] = (sh & 0xFF).to(torch.uint8)
    out[:, 3] = (sh >> 8).to(torch.uint8)


# --------------------------------------------------------------------------- encoders


def _encode(x: torch.Tensor, qw: torch.Tensor | None, S: int) -> torch.Tensor:
    """fp32 ``x`` ``[rows, cols]`` (``cols`` a multiple of ``S``), ``qw`` fp32 ``[cols]`` or ``None`` ->
    the blocks of every row, uint8 ``[rows, cols / S * size]``."""
    return encode_with_scales(x, qw, S)[0]


def encode_with_scales(x: torch.Tensor, qw: torch.Tensor | None, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``_encode``, and the fp32 ``d`` of every super-block ``[rows * cols / S]`` that the codes were
    rounded with (iq4_nl: the sub-block's scale; iq4_xs: ``D``; stored as fp16): GPTQ rounds by it
    (``qkit.schemes.ggml_observer``). ``qw`` is checked by the callers (``weighted_iq4_*``)."""
    rows, cols = x.shape
    size, per_row = SIZES[S], cols // S
    n = rows * per_row
    out = torch.empty(n, size, dtype=torch.uint8, device=x.device)
    if qw is not None and qw.numel() != cols:  # the kernel reads qw[(s % per_row) * S + j] unchecked
        raise SchemeError(f"an importance vector of {qw.numel()} values for rows of {cols}")
    if n == 0:
        return out.view(rows, -1), torch.zeros(0, device=x.device)
    use_kernel = kernels.available(x)
    # The torch path is many small operations: on the CPU one thread is faster than a pool that pays a
    # barrier per operation (a 48x1536 matrix 0.25 s on one thread, 3.6 s on two busy cores).
    cpu = x.device.type == "cpu"
    with kernels.owning_the_cores() if use_kernel else one_torch_thread() if cpu else contextlib.nullcontext():
        check_finite(*torch.aminmax(x))
        if use_kernel:
            jit = _jit()
            xn = x.detach().contiguous().numpy().reshape(-1)
            qn = qw.detach().contiguous().numpy() if qw is not None else np.empty(0, np.float32)
            on = out.numpy()
            dn, badn = np.empty(n, np.float32), np.zeros(n, np.uint8)
            run = lambda lo, hi: jit._run_iq4(xn, qn, per_row, S, lo, hi, on, dn, badn)  # noqa: E731
            kernels._split(run, n, unit=1024 * 32 // S)  # 1024 blocks of 32: ~0.6 ms of work
            d, bad = torch.from_numpy(dn), torch.from_numpy(badn).bool()
        else:
            xs = x.reshape(n, S)
            qsb = qw.view(per_row, S) if qw is not None else None
            d = torch.empty(n, dtype=torch.float32, device=x.device)
            bad = torch.empty(n, dtype=torch.bool, device=x.device)
            step = max(1, CHUNK * 32 // S)
            for i in range(0, n, step):
                j = min(n, i + step)
                q = None if qsb is None else qsb.index_select(0, torch.arange(i, j, device=x.device) % per_row)
                d[i:j], codes, ls, bad[i:j] = quantize_iq4_torch(xs[i:j], q)
                _pack(codes, ls, out[i:j])
        if bool(bad.any()):  # a sub-block scale overflowed fp32: refuse as a scale beyond fp16
            d = torch.where(bad, torch.full_like(d, float("inf")), d)
        out[:, :2] = fp16_bytes(fp16_scale(d, "scale", x))
    return out.view(rows, -1), d


def encode_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """fp32 blocks ``[nb, 32]`` -> ``block_iq4_nl`` bytes ``[nb, 18]`` (``quantize_iq4_nl`` without an
    importance matrix: weights ``x*x``)."""
    return _encode(x, None, 32)


def encode_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """fp32 super-blocks ``[nb, 256]`` -> ``block_iq4_xs`` bytes ``[nb, 136]`` (``quantize_iq4_xs`` without
    an importance matrix)."""
    return _encode(x, None, QK_K)


def weighted_iq4_nl(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``[rows, cols]`` and the importance of each column ``qw`` fp32 ``[cols]`` -> uint8
    ``[rows, cols / 32 * 18]``: ``quantize_iq4_nl(x, ..., quant_weights=qw)``."""
    check_importance(qw, "iq4_nl")
    return _encode(x, qw.reshape(-1).float().contiguous(), 32)


def weighted_iq4_xs(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """As :func:`weighted_iq4_nl` for ``block_iq4_xs``: uint8 ``[rows, cols / 256 * 136]``."""
    check_importance(qw, "iq4_xs")
    return _encode(x, qw.reshape(-1).float().contiguous(), QK_K)


# --------------------------------------------------------------------------- decoders


def _values(qs: torch.Tensor) -> torch.Tensor:
    """``qs`` uint8 ``[..., 16]`` -> the grid values ``[..., 32]`` (low nibbles, then high), fp32."""
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()
    return _grid(qs.device)[q]


def decode_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """``block_iq4_nl`` bytes ``[nb, 18]`` -> fp32 ``[nb, 32]``: ``d * v[q]``."""
    return read_fp16(b, 0) * _values(b[:, 2:])


def decode_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """``block_iq4_xs`` bytes ``[nb, 136]`` -> fp32 ``[nb, 256]``: ``(d * (ls - 32)) * v[q]`` per sub-block."""
    nb = b.shape[0]
    d = read_fp16(b, 0)  # [nb, 1]
    sh = b[:, 2].long() | (b[:, 3].long() << 8)
    sl = b[:, 4:8].long()
    lo = torch.stack([sl & 0xF, sl >> 4], dim=2).reshape(nb, 8)
    hi = (sh.unsqueeze(1) >> torch.arange(0, 16, 2, device=b.device)) & 3
    dl = d * ((lo | (hi << 4)) - 32).float()  # [nb, 8]
    return (dl.unsqueeze(2) * _values(b[:, 8:].reshape(nb, 8, 16))).reshape(nb, QK_K)


register_codec(T.IQ4_NL, encode_iq4_nl, decode_iq4_nl, weighted=weighted_iq4_nl)
register_codec(T.IQ4_XS, encode_iq4_xs, decode_iq4_xs, weighted=weighted_iq4_xs)


IQ4_NL = register(GGMLScheme(
    "iq4_nl", T.IQ4_NL, 4,
    description="llama.cpp IQ4_NL: blocks of 32, 4-bit indices into a non-linear 16-value grid, an fp16 scale",
))
IQ4_XS = register(KQuantScheme(
    "iq4_xs", T.IQ4_XS, 4, fallback=IQ4_NL,
    description="llama.cpp IQ4_XS: eight sub-blocks of 32 with 6-bit scales, 4-bit indices into IQ4_NL's non-linear grid",
))

__all__ = [
    "IQ4_NL", "IQ4_XS", "KVALUES_IQ4NL", "best_index_int8", "decode_iq4_nl", "decode_iq4_xs",
    "encode_iq4_nl", "encode_iq4_xs", "encode_with_scales", "quantize_iq4_torch", "weighted_iq4_nl", "weighted_iq4_xs",
]
