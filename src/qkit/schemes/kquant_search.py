"""The exact fp32 arithmetic of llama.cpp's scale searches, vectorised across sub-blocks, bit for bit with
``ggml-quants.c`` at ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``: ``make_qkx2_quants`` / ``make_qkx3_quants``
(q4_k, q5_k, q2_k; q4_1 / q5_1 / the k-quants with an importance matrix), ``make_qx_quants`` (q6_k, q3_k;
q4_0 / q5_0 with an importance matrix), ``make_q3_quants`` (q3_k) and ``make_qp_quants`` (q2_k / q3_k's
scales with an importance matrix). Layout: element ``i`` of sub-block ``k`` at ``[i, k]`` (fp32 ``[n, S]``).

``make_qkx2_quants`` fits ``x ~ scale * L + min`` (``min <= 0``, ``L`` in ``0..nmax``) by weighted least
squares: it starts from ``iscale = nmax / (max - min)`` and tries the inverse scales
``(rmin + rdelta*is + nmax) / (max - min)``, ``is = 0..nstep``, keeping the one with the lowest weighted
squared (``use_mad``: absolute) error (strictly lower: the first wins a tie). When a step wins, the C code
overwrites ``min`` with the fitted minimum, and the later steps shift ``x`` by, and divide by ``max -``,
that new ``min``. ``make_qkx3_quants`` is the same with ``x*x`` weights for ``NULL``.
``make_qx_quants`` fits ``x ~ scale * l`` (``l`` in ``-nmax..nmax-1``) over ``-(nmax + 0.1*is) / max``,
``is = -9..9``, maximising ``sumlx**2 / suml2``; ``make_q3_quants`` and ``make_qp_quants`` add up to five
passes of coordinate descent on single codes (sequential over the elements, vectorised across columns).

**Exactness.** Every operation is fp32, in the C code's order and association, so the bytes equal
``ggml_quantize_chunk`` as built for x86-64 (ggml-base is compiled without ``-march``, so no FMA
contraction; a build that contracts ``a*b + c`` into FMA, as compilers may on ARM, can differ in the
last bit of a sum and so, rarely, in a code). The sums are sequential, as the C loops are: ``seq_sum``
adds the terms one at a time, vectorised over all sub-blocks, since ``torch.sum`` sums pairwise. Two
torch operations are not the IEEE ones and are avoided: ``c / tensor`` (multiplies by a reciprocal:
:func:`fdiv` divides) and fp32 ``torch.sqrt`` (can be an ulp off: :func:`sqrtf` rounds the fp64 root).
``nearest_int`` (the ``+ 12582912.f`` trick) is round-half-to-even, i.e. ``torch.round``, for
``|v| <= 4194303``; an inverse scale that overflows to inf (a sub-block narrower than about 4e-38) gives
code 0, as the trick does for inf and NaN. Where an argument can leave that range (the coordinate
descents' ``x * sl2 / slx``; a ``make_qkx`` step after a fitted min landed next to the max) the trick
itself runs (:func:`nearest_int`). On CPU the searches run in compiled kernels
(:mod:`qkit.schemes.kernels`, :mod:`qkit.schemes._kernels_search`: the same fp32 operations in the same
order per sub-block, vectorised across sub-blocks; 3-10x faster than llama.cpp's own C on one thread);
the torch code here is their oracle in the tests and the path on other devices.
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


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """C ``nearest_int`` for any fp32 ``v``: the bits of ``v + 12582912.f``, ``(bits & 0x7fffff) - 0x400000``
    (int32). Round half to even for ``|v| <= 4194303``; beyond it the C ``assert`` is compiled out and the
    trick wraps (``inf`` gives -4194304, the default NaN 0). For the unbounded arguments of the
    coordinate descents (``x * sl2 / slx``); bounded ones use :func:`codes_into`."""
    return ((v + 12582912.0).view(torch.int32) & 0x7FFFFF) - 0x400000


def first_min(x: torch.Tensor) -> torch.Tensor:
    """``min`` along dim 0 as the C loop ``min = x[0]; if (x[i] < min) min = x[i];`` finds it: ``amin``,
    and where that is zero, the first zero with its sign (``the_min = -min`` keeps it: q4_1 / q5_1 store
    ``fp16(-the_min)``, so ``-0`` and ``+0`` are different bytes)."""
    mn = x.amin(dim=0)
    zero = mn == 0
    if bool(zero.any()):
        cols = zero.nonzero().squeeze(1)
        sub = x.index_select(1, cols)
        first = (sub == 0).to(torch.uint8).argmax(dim=0, keepdim=True)
        mn = mn.index_put((cols,), sub.gather(0, first).squeeze(0))
    return mn


# --------------------------------------------------------------------------- make_qkx2_quants / make_qkx3_quants


def qkx_steps(nmax: int, rmin: float, rdelta: float, nstep: int) -> list[float]:
    """The numerators ``rmin + rdelta*is + nmax``, ``is = 0..nstep``, each operation rounded to fp32 as in C
    (none for ``nstep < 1``: the C code returns before the loop)."""
    r, d, m = np.float32(rmin), np.float32(rdelta), np.float32(nmax)
    return [float(np.float32(r + d * np.float32(i)) + m) for i in range(nstep + 1)] if nstep >= 1 else []


def make_qkx2_quants(
    x: torch.Tensor, w: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20, use_mad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)`` for every
    column (q4_k: the defaults; q2_k: ``(3, -0.5, 0.1, 15, True)``; q5_k: ``(31, -0.5, 0.1, 15, False)``).

    ``x``, ``w``: fp32 ``[n, S]`` (element ``i`` of sub-block ``k`` at ``[i, k]``). Returns ``(scale [S],
    the_min [S], L [n, S])``: ``x ~ scale * L - the_min`` with ``the_min`` the C ``*the_min = -min``
    (``>= 0``, a signed zero as C leaves it), ``L`` fp32 codes in ``0..nmax``; a column with
    ``max == min`` gets scale 0, codes 0 and ``the_min = -min``. ``use_mad``: absolute instead of
    squared errors. The large intermediates live in preallocated buffers (fresh multi-megabyte tensors
    per step cost more than the arithmetic).
    """
    return _qkx(x, w, nmax, qkx_steps(nmax, rmin, rdelta, nstep), use_mad)[:3]


def make_qkx3_quants(
    x: torch.Tensor, w: torch.Tensor | None = None, nmax: int = 15, rmin: float = -0.9, rdelta: float = 0.05, nstep: int = 36, use_mad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx3_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)``: as
    :func:`make_qkx2_quants` (same returns), with weights ``x*x`` when ``w`` is ``None`` (C ``NULL``);
    its early return tests ``max <= min``, which after ``if (min > 0) min = 0`` is ``max == min``.
    q4_1 / q5_1 with an importance matrix: ``nmax`` 15 / 31 and the defaults."""
    return _qkx(x, x * x if w is None else w, nmax, qkx_steps(nmax, rmin, rdelta, nstep), use_mad)[:3]


def make_qkx3_rule(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float = -0.9, rdelta: float = 0.05, nstep: int = 36
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`make_qkx3_quants` (squared errors) and the rule its kept codes came from: ``(scale, the_min, L,
    iscale [S], shift [S])`` with ``L = clamp(nearest_int(iscale * (x - shift)), 0, nmax)`` (0 where
    ``max == min``). GPTQ rounds error-updated weights by the same rule (``qkit.schemes.ggml_observer``)."""
    return _qkx(x, w, nmax, qkx_steps(nmax, rmin, rdelta, nstep), False)


def _qkx(x: torch.Tensor, w: torch.Tensor, nmax: int, steps: list[float], use_mad: bool) -> tuple[torch.Tensor, ...]:
    n, S = x.shape
    mn = first_min(x)
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)  # if (min > 0) min = 0;  (a zero min keeps its sign)
    mx = x.amax(dim=0)
    same = mx == mn
    sum_w = seq_sum(w, from_zero=False)
    sum_x = seq_sum(w * x, from_zero=False)
    La = torch.empty_like(x)
    err = torch.empty_like(x)
    prods = torch.empty(n, 3, S, dtype=x.dtype, device=x.device)  # w*l, w*l*l, w*l*x per element
    sums = torch.empty(3, S, dtype=x.dtype, device=x.device)

    def weighted_error(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """sum_i w_i * d_i^2 (or w_i * |d_i|), d_i = (scale * L_i + shift) - x_i, with ``L`` in ``La``."""
        torch.mul(La, scale, out=err).add_(shift).sub_(x)
        err.abs_() if use_mad else err.mul_(err)
        return seq_sum(err.mul_(w))

    iscale0 = fdiv(float(nmax), mx - mn)
    codes_into(La, x, mn, iscale0, 0, nmax)
    best_err = weighted_error(fdiv(1.0, iscale0), mn)
    best_scale = fdiv(1.0, iscale0)
    # The C loop updates ``min`` itself when a step wins, so the later steps shift x by the new min and
    # divide by the new (max - min): the search is sequential per sub-block, vectorised across them.
    cur_min = mn
    best_iscale, best_shift = iscale0, mn  # what the kept codes were computed from
    lo = x.amin(dim=0)  # the true extremes bound |iscale * (x - min)| (see _qkx_codes)
    for c in steps:
        iscale = fdiv(c, mx - cur_min)
        _qkx_codes(La, x, cur_min, iscale, nmax, lo, mx)
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
    L = _qkx_codes(La, x, best_shift, best_iscale, nmax, lo, mx)
    best_min = cur_min
    if bool(same.any()):  # max == min: L = 0, the_min = -min, scale 0
        L.mul_((~same).to(L.dtype))
        best_scale = torch.where(same, torch.zeros_like(best_scale), best_scale)
        best_min = torch.where(same, mn, best_min)
    return best_scale, best_min.neg(), L, best_iscale, best_shift


_ROUND_BOUND = 4.0e6  # under nearest_int's exact range (|v| <= 4194303), with room for the bound's own rounding


def _qkx_codes(out: torch.Tensor, x: torch.Tensor, shift: torch.Tensor, iscale: torch.Tensor, nmax: int, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``out = MAX(0, MIN(nmax, nearest_int(iscale * (x - shift))))`` exactly. Once a step has replaced
    ``min`` by a fitted one, ``(max - min)`` can be tiny next to ``x - min`` (weights on a few elements
    near the maximum), and ``|iscale * (x - min)|`` can pass 4194303, where the C trick wraps instead of
    rounding: then (checked per column from the extremes ``lo``, ``hi``, cheaply) the bit trick itself
    runs; else rounding (:func:`codes_into`). An infinite ``iscale`` gives code 0 either way."""
    finite = torch.nan_to_num(iscale, nan=0.0, posinf=0.0, neginf=0.0)
    reach = torch.maximum((hi - shift).abs(), (lo - shift).abs()).mul_(finite.abs())
    if not bool((reach > _ROUND_BOUND).any()):
        return codes_into(out, x, shift, iscale, 0, nmax)
    torch.sub(x, shift, out=out).mul_(finite)
    return out.copy_(nearest_int(out).clamp_(0, nmax))


# --------------------------------------------------------------------------- make_qx_quants / make_q3_quants


def _qx_weights(x: torch.Tensor, rmse_type: int) -> torch.Tensor:
    """``rmse_type == 1 ? x*x : rmse_type == 2 ? 1 : rmse_type == 3 ? fabsf(x) : sqrtf(fabsf(x))``."""
    if rmse_type == 1:
        return x * x
    if rmse_type == 2:
        return torch.ones_like(x)
    return x.abs() if rmse_type == 3 else sqrtf(x.abs())


def make_qx_quants(x: torch.Tensor, nmax: int = 32, rmse_type: int = 1, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, rmse_type, qw)`` for every column of ``x`` ``[n, S]`` (fp32); ``qw``
    ``[n, S]`` the per-element weights (C: used instead of the ``rmse_type`` weights when not ``NULL``;
    q4_0 / q5_0 with an importance matrix: ``nmax`` 8 / 16, ``rmse_type`` 1). ``rmse_type`` 0 keeps the
    codes of ``-nmax / max``; a negative one returns after the first fit (``0.5 * (scale + 1/iscale)``).

    Returns ``(scale [S], L [n, S])`` with ``L`` the stored codes ``l + nmax`` in ``0..2*nmax-1`` (fp32);
    a column with ``max|x| < GROUP_MAX_EPS`` gets scale 0 and codes 0.
    """
    return _qx(x, nmax, rmse_type, qw)[:2]


def make_qx_rule(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`make_qx_quants` with ``rmse_type`` 1 and weights ``qw``, and the inverse scale its codes came
    from: ``(scale, L, iscale [S])``, ``L = clamp(nearest_int(iscale * x), -nmax, nmax - 1) + nmax`` (0 in an
    all-zero column). GPTQ rounds error-updated weights by the same rule (``qkit.schemes.ggml_observer``)."""
    return _qx(x, nmax, 1, qw)


def _qx(x: torch.Tensor, nmax: int, rmse_type: int, qw: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """:func:`make_qx_quants`; with ``rmse_type`` 1 also the inverse scale of the kept codes (``make_qx_rule``)."""
    n, S = x.shape
    amax, mx = first_max_abs(x, 0)
    zero = amax < GROUP_MAX_EPS
    L = torch.empty_like(x)
    iscale0 = fdiv(float(-nmax), mx)
    if rmse_type == 0:
        scale = fdiv(1.0, iscale0)
        codes_into(L, x, None, iscale0, -nmax, nmax - 1).add_(nmax)
        return _zeroed(zero, scale, L)
    w = qw if qw is not None else _qx_weights(x, abs(rmse_type))
    wx = w * x
    prods = torch.empty(n, 2, S, dtype=x.dtype, device=x.device)  # w*x*l, w*l*l per element
    sums = torch.empty(2, S, dtype=x.dtype, device=x.device)

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes_into(L, x, None, iscale, -nmax, nmax - 1)
        torch.mul(wx, L, out=prods[:, 0])
        torch.mul(w, L, out=prods[:, 1]).mul_(L)
        sumlx, suml2 = seq_sum(prods, out=sums)
        return sumlx.clone(), suml2.clone()

    sumlx, suml2 = fit(iscale0)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    if rmse_type < 0:  # return_early
        inv = fdiv(1.0, iscale0)
        scale = torch.where(suml2 > 0, (scale + inv) * 0.5, inv)
        L.add_(nmax)
        return _zeroed(zero, scale, L)
    best = scale * sumlx
    best_iscale = iscale0
    for c in (float(-(np.float32(nmax) + np.float32(0.1) * np.float32(i))) for i in range(-9, 10) if i != 0):
        iscale = fdiv(c, mx)
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    codes_into(L, x, None, best_iscale, -nmax, nmax - 1).add_(nmax)
    return (*_zeroed(zero, scale, L), best_iscale)


def _zeroed(zero: torch.Tensor, scale: torch.Tensor, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale 0 and codes 0 in the all-zero columns (``amax < GROUP_MAX_EPS``: the C early return)."""
    if bool(zero.any()):
        L.mul_((~zero).to(L.dtype))
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, L


def make_q3_quants(x: torch.Tensor, nmax: int, do_rmse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse)`` for every column of ``x`` ``[n, S]`` (fp32; q3_k: ``nmax``
    4). Returns ``(scale [S], L [n, S])``, ``L`` the stored codes ``l + nmax`` (fp32; 0 in an all-zero
    column). With ``do_rmse``: the ``x*x``-weighted fit of the codes of ``-nmax / max``, then up to five
    passes of coordinate descent (element ``i`` moves to ``nearest_int(x_i * sl2 / slx)`` when that
    raises ``sumlx**2 / suml2``), sequential over the elements, vectorised across columns. A pass that
    changes nothing leaves the state as it found it, so running all five where C breaks early is exact."""
    amax, mx = first_max_abs(x, 0)
    zero = amax < GROUP_MAX_EPS
    iscale = fdiv(float(-nmax), mx)
    L = codes_into(torch.empty_like(x), x, None, iscale, -nmax, nmax - 1)
    if not do_rmse:
        return _zeroed(zero, fdiv(1.0, iscale), L.add_(nmax))
    w = x * x
    wx = w * x
    sumlx = seq_sum(wx * L)
    suml2 = seq_sum(w * L * L)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(x.shape[0]):
            Li = L[i]
            slx = sumlx - wx[i] * Li
            sl2 = suml2 - w[i] * Li * Li
            new_l = nearest_int(x[i] * sl2 / slx).clamp_(-nmax, nmax - 1).float()
            slx_n = slx + wx[i] * new_l
            sl2_n = sl2 + w[i] * new_l * new_l
            take = (slx > 0) & (new_l != Li) & (sl2_n > 0) & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n)
            L[i] = torch.where(take, new_l, Li)
            sumlx = torch.where(take, slx_n, sumlx)
            suml2 = torch.where(take, sl2_n, suml2)
            changed |= take
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return _zeroed(zero, scale, L.add_(nmax))


# --------------------------------------------------------------------------- make_qp_quants


def make_qp_quants(x: torch.Tensor, qw: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, x, L, quant_weights)`` for every column of ``x`` ``[n, S]`` (fp32, meant
    for non-negative values: q2_k / q3_k quantize their sub-block scales and mins with it), weights ``qw``
    ``[n, S]``. Returns ``(scale [S], L [n, S])``: ``x ~ scale * L``, ``L`` fp32 codes ``<= nmax`` as the
    C ``uint8_t`` array holds them (a negative code wraps); 0 where ``max(0, x) < GROUP_MAX_EPS``.
    The codes of ``nmax / max`` and of 8 more inverse scales ``(0.1*is + nmax) / max`` are compared by
    weighted squared error (strictly lower wins), then up to five passes of coordinate descent."""
    mx = x.amax(dim=0).clamp_(min=0)  # max = MAX(max, x[i]) from 0
    zero = mx < GROUP_MAX_EPS
    iscale = fdiv(float(nmax), mx)

    def mse(scale: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        diff = x - scale * l
        return seq_sum(qw * diff * diff)

    best_mse = mse(fdiv(1.0, iscale), (nearest_int(iscale * x) & 0xFF).float())  # L[i] = nearest_int(..): a byte
    for c in (float(np.float32(0.1) * np.float32(i) + np.float32(nmax)) for i in range(-4, 5) if i != 0):
        iscale_is = fdiv(c, mx)
        cur = mse(fdiv(1.0, iscale_is), nearest_int(iscale_is * x).clamp_(max=nmax).float())
        better = cur < best_mse
        best_mse = torch.where(better, cur, best_mse)
        iscale = torch.where(better, iscale_is, iscale)
    l = nearest_int(iscale * x).clamp_(max=nmax).float()
    L = (l.to(torch.int32) & 0xFF).float()  # what the uint8_t array holds; the sums take the int
    wx = qw * x
    sumlx = seq_sum(wx * l)
    suml2 = seq_sum(qw * l * l)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(x.shape[0]):
            Li = L[i]
            slx = sumlx - wx[i] * Li
            sl2 = suml2 - qw[i] * Li * Li
            new_l = nearest_int(x[i] * sl2 / slx).clamp_(max=nmax).float()
            slx_n = slx + wx[i] * new_l
            sl2_n = sl2 + qw[i] * new_l * new_l
            take = (slx > 0) & (sl2 > 0) & (new_l != Li) & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n)
            L[i] = torch.where(take, (new_l.to(torch.int32) & 0xFF).float(), Li)
            sumlx = torch.where(take, slx_n, sumlx)
            suml2 = torch.where(take, sl2_n, suml2)
            changed |= take
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return _zeroed(zero, scale, L)
