"""GPTQ's maths for one linear (Frantar et al. 2022, arXiv:2210.17323): tensors in, tensors out.

Layer 5 (``qkit.methods``), but pure: no I/O, no model, no printing. The Hessian ``X Xᵀ``
(``accumulate_gram``, ``symmetrize``), dead columns, dampening with retries and the upper Cholesky factor
``U`` of ``(H + λI)⁻¹`` (``prepare_hessian``, ``inverse_hessian_factor``), and the lazy-block column loop
(``gptq_solve``) that rounds each column onto the scheme's grid (an observer of
``qkit.schemes.observers``) and spreads its error over the columns not yet quantized::

    e_j = (w_j - Q(w_j)) / U[j, j];   w_k -= e_j * U[j, k]  for k > j

The derivation and every numerical choice: docs/gptq.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkit.errors import InputError, SchemeError
from qkit.schemes import Scheme
from qkit.schemes.observers import Observer, observer_for, observer_type, round_to_nearest

DEFAULT_DAMPENING = 0.01  # fraction of mean(diag H) added to the diagonal (the reference's percdamp)
DEFAULT_BLOCK_SIZE = 128  # columns per lazy batch update (the reference's blocksize)
MAX_DAMP_RETRIES = 5  # dampening x10 each time H (or H^-1) is not positive definite
# Columns per inner sub-block: the per-column update touches rows x SUB_BLOCK weights, small enough for
# torch to run it on one thread (a thread-pool barrier per column costs milliseconds on a busy machine);
# each sub-block's error then reaches the rest of the lazy block in one matmul. Same arithmetic, regrouped.
SUB_BLOCK = 16


# --------------------------------------------------------------------------- the Hessian


def accumulate_gram(H: torch.Tensor, x: torch.Tensor, chunk: int = 256) -> None:
    """``H += xᵀ x`` on and above the diagonal only (``x [n, d]``, ``H [d, d]`` fp32); ``symmetrize(H)``
    completes it. Block rows of ``chunk`` columns: about 60-70 % of a full product's multiply-adds for
    d = 576-1536 (the Hessians cost about as much as the block's forward pass)."""
    d = x.shape[1]
    for a in range(0, d, chunk):
        b = min(a + chunk, d)
        H[a:b, a:].addmm_(x[:, a:b].T, x[:, a:])


def symmetrize(H: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The full symmetric matrix from its upper triangle (as ``accumulate_gram`` leaves it), in place:
    below the diagonal every entry becomes its mirror above it (``H.triu() + H.triu(1).T``, the same
    values), one block of ``chunk`` columns at a time, so no second ``[d, d]`` matrix is held (a 7B
    ``down_proj``'s Gram is 0.48 GB)."""
    d = H.shape[0]
    for a in range(0, d, chunk):
        b = min(a + chunk, d)
        diag = H[a:b, a:b]
        diag.copy_(diag.triu().add_(diag.triu(1).T))
        if b < d:
            H[a:b, b:].add_(0.0)  # as triu() + 0 did: a -0.0 above the diagonal reads +0.0
            H[b:, a:b].copy_(H[a:b, b:].T)
    return H


def inverse_hessian_factor(H: torch.Tensor, dampening: float, retries: int = MAX_DAMP_RETRIES, *,
                           perm: torch.Tensor | None = None, dead: torch.Tensor | None = None,
                           shrink: float = 0.0) -> tuple[torch.Tensor | None, float, int]:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``Uᵀ U = (H + λI)⁻¹``), ``λ = dampening * mean(diag H)``.

    fp32, as the reference. Computed without forming the inverse: with ``J`` the reversal permutation and
    ``J (H + λI) J = L Lᵀ``, ``U = J L⁻¹ J`` (upper triangular, and ``Uᵀ U = J L⁻ᵀ L⁻¹ J = (H + λI)⁻¹``):
    one Cholesky and one triangular solve. Retries with ``dampening * 10`` while the factorisation fails;
    returns ``(U or None, dampening used, retries)``. ``H``: symmetric ``[cols, cols]``; not modified.
    ``perm``: factor ``H[perm][:, perm]`` (act order); ``dead``: columns whose diagonal counts as 1
    (``prepare_hessian``'s dead columns). Neither is materialised: ``J P H Pᵀ J`` is gathered straight
    into the one working copy, so the peak is ``H`` and three more ``[cols, cols]`` fp32 matrices.
    ``shrink``: ``H``'s diagonal is taken ``1 + shrink`` times (before the dampening, whose mean diagonal is
    of the shrunk one): ``H + shrink * diag(H)``, which, since GPTQ's solution does not change when ``H`` is
    scaled, is ``H`` pulled toward its diagonal by ``shrink / (1 + shrink)`` (0: the reference's ``H``).
    """
    n = H.shape[0]
    order = (torch.arange(n - 1, -1, -1) if perm is None else perm.flip(0)).to(H.device)  # J P
    diag = H.diagonal().to(torch.float32)
    if shrink:
        diag = diag * (1.0 + shrink)
    if dead is not None and bool(dead.any()):
        diag = diag.masked_fill(dead, 1.0)
    mean_diag = diag.index_select(0, order.flip(0)).mean()  # in processing order, as P H Pᵀ's diagonal
    diag = diag.index_select(0, order)
    damp = dampening
    for attempt in range(retries + 1):
        Hd = _gathered(H, order)
        Hd.diagonal().copy_(diag).add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        del Hd
        if int(info) == 0:
            U = torch.linalg.solve_triangular(L, torch.eye(n, dtype=torch.float32, device=H.device), upper=False)
            del L
            U = U.flip(0, 1)
            if bool(torch.isfinite(U).all()):
                return U, damp, attempt
        damp *= 10
    return None, damp / 10, retries


def _gathered(H: torch.Tensor, order: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``H[order][:, order]`` in fp32, a block of rows at a time (no intermediate ``[cols, cols]`` copy)."""
    out = torch.empty(H.shape, dtype=torch.float32, device=H.device)
    for a in range(0, H.shape[0], chunk):
        rows = H.index_select(0, order[a : a + chunk])
        out[a : a + chunk] = rows.index_select(1, order)
    return out


@dataclass
class PreparedHessian:
    """What every linear fed the same inputs shares: dead columns, the act-order permutation and ``U``."""

    U: torch.Tensor | None  # fp32 [cols, cols], upper Cholesky factor of (H + λI)^-1, permuted order; None: failed
    perm: torch.Tensor | None  # act order: processing order of the original columns
    dead: torch.Tensor  # bool [cols]: H[i, i] == 0
    dampening: float  # the fraction finally used
    retries: int


def prepare_hessian(H: torch.Tensor, dampening: float = DEFAULT_DAMPENING, act_order: bool = False,
                    shrink: float = 0.0) -> PreparedHessian:
    """Dead columns (``H[i, i] = 1``), act-order permutation (descending ``diag H``) and the factor ``U``.
    ``H`` is not modified or copied whole (``inverse_hessian_factor`` gathers the one copy it factors)."""
    diag = H.diagonal().to(torch.float32)
    dead = diag == 0
    perm = torch.argsort(diag.masked_fill(dead, 1.0), descending=True, stable=True) if act_order else None
    U, damp, retries = inverse_hessian_factor(H, dampening, perm=perm, dead=dead, shrink=shrink)
    return PreparedHessian(U, perm, dead, damp, retries)


# --------------------------------------------------------------------------- which schemes


def unsupported(scheme: Scheme) -> str:
    """The one-line refusal of a scheme no observer serves."""
    return (f"GPTQ cannot choose the codes of scheme {scheme.name!r} (kind {scheme.kind}); "
            "it serves absmax schemes (int8-tensor, int8-row, int4-tensor, int4-row, int4-gN, int8-gN), nf4, "
            "mxfp4, nvfp4 and llama.cpp's block types and recipes (q8_0 ... q6_k, iq4_nl, iq4_xs, q4_k_m, ...): "
            "pick one of those or use --method rtn")


def check_scheme(scheme: Scheme) -> None:
    """``SchemeError`` unless an observer serves ``scheme`` (nf4 / fp4 widths are checked per matrix)."""
    if observer_type(scheme) is None:
        raise SchemeError(unsupported(scheme))


def whole_blocks(scheme: Scheme, cols: int, tensor: str | None = None) -> None:
    """One-line refusal of a width that is not whole blocks of a block scheme (nf4, mxfp4, nvfp4)."""
    kind = observer_type(scheme)
    block = None if kind is None else kind.block_width(scheme)
    if block is None or (cols > 0 and cols % block == 0):
        return
    what = f"{tensor} has {cols} columns" if tensor else f"this matrix has {cols} columns"
    raise SchemeError(
        f"GPTQ with {scheme.name} needs rows that are whole blocks of {block} ({what}): "
        f"{scheme.name} blocks would cross rows; use an absmax scheme (int4-gN, int4-row), "
        + (f"leave it out with --exclude '{tensor}', " if tensor else "")
        + "or --method rtn"
    )


# --------------------------------------------------------------------------- the solve


@dataclass
class SolveResult:
    """What one GPTQ solve of a ``[rows, cols]`` matrix produced."""

    codes: torch.Tensor  # [rows, cols] in the original column order (float holding integers / int codes)
    dequantized: torch.Tensor  # [rows, cols] fp32, what the stored parts decode to
    grid: Observer  # holds the scales; ``grid.parts(codes, rows)`` gives the stored parts
    dampening: float  # the fraction finally used
    retries: int  # how many times the dampening was raised
    dead: int  # dead input columns
    fallback: bool = False  # H never became positive definite: RTN was used


def gptq_solve(
    W: torch.Tensor,
    H: torch.Tensor | None,
    scheme: Scheme,
    *,
    dampening: float = DEFAULT_DAMPENING,
    block_size: int = DEFAULT_BLOCK_SIZE,
    act_order: bool = False,
    prepared: PreparedHessian | None = None,
    scale_rule: str = "absmax",
    quant_weights: torch.Tensor | None = None,
    static_groups: bool = False,
    tensor_amax: torch.Tensor | None = None,
) -> SolveResult:
    """GPTQ of one weight ``W [rows, cols]`` against ``H [cols, cols]`` (``Xᵀ X`` of its inputs, any scale),
    or against ``prepared`` (``prepare_hessian(H, dampening, act_order)``, shared by layers with one input).
    ``quant_weights``: an importance matrix's entry for ``W`` (fp32 ``[cols]``; llama.cpp's types only),
    which weights their scale searches as ``--method rtn --imatrix`` does. ``static_groups``: every
    unit's scales from the original weights even without act order (with it they always are).
    ``tensor_amax``: nvfp4's fused group's largest ``max |w|`` (``GroupScaled``), whose global scale the
    solve uses instead of ``W``'s own, as ``--method rtn`` does.

    Runs on ``W``'s device, fp32. Returns codes in the original column order, the dequantized weights and
    the observer holding the scales (docs/gptq.md gives every choice). A scheme that picks a type per
    width or name (a llama.cpp recipe, a k-quant's fallback) is solved as ``scheme.resolve(W.shape)``.
    """
    rows, cols = W.shape
    if prepared is None:
        if H is None or tuple(H.shape) != (cols, cols):
            raise InputError(f"H has shape {None if H is None else list(H.shape)}, expected [{cols}, {cols}]")
        prepared = prepare_hessian(H.to(W.device), dampening, act_order)
    check_scheme(scheme)
    whole_blocks(scheme, cols)
    scheme = scheme.resolve((rows, cols))
    W = W.to(torch.float32).clone()
    # nvfp4's global scale and the llama.cpp types' row statistics: from the whole W as given (as RTN
    # computes them), before dead columns are zeroed
    grid = observer_for(scheme, rows, cols, W.device, scale_rule=scale_rule, weights=W, quant_weights=quant_weights,
                        tensor_amax=tensor_amax)
    n_dead = int(prepared.dead.sum())
    if n_dead:
        W[:, prepared.dead] = 0.0
    if prepared.U is None:  # H never became positive definite: round to nearest on the same grid
        codes, Q = round_to_nearest(W, grid)
        return SolveResult(codes, Q, grid, prepared.dampening, prepared.retries, n_dead, fallback=True)
    held = [W]  # handed over: the loop frees it once its transposed working copy is made
    del W
    codes, Q = _column_loop(held, prepared.U, prepared.perm, grid, block_size, static_groups)
    return SolveResult(codes, Q, grid, prepared.dampening, prepared.retries, n_dead)


def _column_loop(held: list[torch.Tensor], U: torch.Tensor, perm: torch.Tensor | None, grid: Observer,
                 block_size: int, static_groups: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The lazy-block loop over ``W [rows, cols]`` (``held``'s one tensor, which the loop takes and frees:
    fp32, dead columns zeroed, original order) with the factor ``U`` (in processing order); returns
    ``(codes, Ŵ)`` in the original column order. Four ``[rows, cols]`` fp32 matrices at most: the caller's
    source, the transposed working copy and the two outputs."""
    W = held.pop()
    rows, cols = W.shape
    device = W.device
    static = static_groups or perm is not None or grid.unit >= cols or grid.per_tensor
    if static:  # scales from the original weights, original column order
        for u in range(grid.n_units):
            grid.set_unit(u, W[:, u * grid.unit : (u + 1) * grid.unit])
    # Lazy blocks are whole groups, and every group start begins a sub-block, so a group's scale is
    # computed from fully updated weights. The loop works on transposed copies (``[cols, rows]``), so each
    # column is a contiguous vector.
    unit = grid.unit
    bs = block_size if static else unit * max(1, block_size // unit)
    order = torch.arange(cols) if perm is None else perm.cpu()
    unit_of, col_of = (order // unit).tolist(), order.tolist()
    Wt = (W.T if perm is None else W.T[perm]).contiguous()  # W[:, perm].T in one copy
    del W
    codes_t = torch.zeros(cols, rows, device=device)
    Q_t = torch.zeros(cols, rows, device=device)
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        n = i2 - i1
        W1 = Wt[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        diag = U1.diagonal().tolist()
        s1 = 0
        while s1 < n:
            s2 = min(s1 + SUB_BLOCK, n)
            if not static:
                s2 = min(s2, ((i1 + s1) // unit + 1) * unit - i1)
            for i in range(s1, s2):
                j = i1 + i
                if not static and j % unit == 0:
                    grid.set_unit(unit_of[j], W1[i : i + unit].T)
                w = W1[i]
                q = Q_t[j]
                grid.quantize_into(w, unit_of[j], codes_t[j], q, col_of[j])
                err = torch.sub(w, q, out=Err1[i]).div_(diag[i])
                if i + 1 < s2:
                    W1[i + 1 : s2].addr_(U1[i, i + 1 : s2], err, alpha=-1.0)
            if s2 < n:
                W1[s2:].addmm_(U1[s1:s2, s2:].T, Err1[s1:s2], alpha=-1.0)
            s1 = s2
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1.0)
    del Wt, W1, Err1
    inv = None if perm is None else torch.argsort(perm)
    # one [rows, cols] output at a time, each transposed copy freed as soon as it is read
    codes = (codes_t.T if inv is None else codes_t.T[:, inv]).contiguous()
    del codes_t
    Q = (Q_t.T if inv is None else Q_t.T[:, inv]).contiguous()
    del Q_t
    grid.finish(codes, torch.arange(cols, device=device) // unit)
    return codes, Q


__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_DAMPENING", "MAX_DAMP_RETRIES", "PreparedHessian", "SolveResult",
           "accumulate_gram", "check_scheme", "gptq_solve", "inverse_hessian_factor", "prepare_hessian", "symmetrize",
           "unsupported", "whole_blocks"]
