"""The exact fp32 arithmetic of llama.cpp's k-quant scale searches: ``make_qkx2_quants`` (q4_k) and
``make_qx_quants`` (q6_k), vectorised across sub-blocks, bit for bit with ``ggml-quants.c`` at
``qkit.schemes.kquants.LLAMA_CPP_COMMIT``.

``make_qkx2_quants`` fits ``x ~ scale * L + min`` (``min <= 0``, ``L`` in ``0..15``) by weighted least
squares: it starts from ``iscale = 15 / (max - min)`` and tries the 21 inverse scales
``(rmin + rdelta*is + 15) / (max - min)``, ``is = 0..20``, keeping the one with the lowest weighted
squared error (strictly lower: the first wins a tie). When a step wins, the C code overwrites ``min``
with the fitted minimum, and the later steps shift ``x`` by, and divide by ``max -``, that new ``min``.

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
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = float(np.float32(1e-15))  # ggml-quants.c: a (sub-)block below this is all zero


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
