"""The lazy-block GPTQ solver against a naive, line-by-line implementation of the paper's Algorithm 1.

Frantar et al. 2022 (arXiv:2210.17323), Algorithm 1, one column at a time and every update applied at
once to all later columns (no lazy blocks, no sub-blocks, no matmuls)::

    for i in columns (in act order when asked):
        q_i   = quant(w_i)                               the scheme's grid (an observer), scales of w_i's group
        err_i = (w_i - q_i) / [H^-1]_ii                  [H^-1] the upper Cholesky factor U of the dampened inverse
        w_{i+1:} -= err_i [H^-1]_{i, i+1:}

with dead inputs zeroed, the scales of a group set when its first column is reached (static groups from
the original weights under act order, and for per-row / per-tensor scales), as docs/gptq.md states.

Tolerance. The factor ``U`` is the solver's (``prepare_hessian``) in both; separately, it is checked
against the paper's recipe (fp64 ``cholesky(inverse(H + λI))``, upper) to 1e-4 of its largest entry
(fp32 against fp64 on a Hessian with condition number ~1e3). With one ``U``, the two loops do the same
fp32 operations per column (the same rank-1 updates inside a sub-block) but sum the errors of up to 16
columns in a different order (the lazy solver in one matmul): the weights they round differ by a few
ulps. A code could differ only where a weight lies within those ulps of a rounding boundary; the seeded
cases below hold none, so codes, stored scales and dequantized weights are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from qkit.methods.gptq import gptq_solve, prepare_hessian
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.observers import observer_for, round_to_nearest


def correlated_hessian(cols: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.eye(cols) + 0.5 * torch.randn(cols, cols, generator=g) / cols**0.5
    X = A @ torch.randn(cols, 4 * cols, generator=g)
    X[list(dead)] = 0.0
    return X @ X.T


def naive_gptq(W: torch.Tensor, H: torch.Tensor, scheme, *, dampening: float = 0.01, act_order: bool = False,
               skip_after: int | None = None, scales_from_original: bool = False):
    """Algorithm 1, column by column. ``skip_after`` and ``scales_from_original`` plant bugs (the error of
    the columns before each multiple of ``skip_after`` never reaches that column; group scales from the
    original weights): the comparison must catch both."""
    rows, cols = W.shape
    W = W.to(torch.float32).clone()
    obs = observer_for(scheme, rows, cols, W.device, weights=W)  # nvfp4's global scale: before dead columns
    Hd = H.to(torch.float32).clone()
    dead = Hd.diagonal() == 0
    Hd[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(Hd.diagonal(), descending=True, stable=True) if act_order else torch.arange(cols)
    U = prepare_hessian(H, dampening, act_order).U  # the solver's factor, in processing order (see the docstring)
    unit = obs.unit
    static = act_order or unit >= cols or obs.per_tensor or scales_from_original
    if static:
        for u in range(obs.n_units):
            obs.set_unit(u, W[:, u * unit : (u + 1) * unit])
    Wp = W[:, perm].clone()
    codes = torch.zeros(rows, cols)
    Q = torch.zeros(rows, cols)
    c, q = torch.zeros(rows), torch.zeros(rows)
    for i in range(cols):
        j = int(perm[i])
        if not static and j % unit == 0:  # without act order i == j: the group's columns are Wp[:, i : i + unit]
            obs.set_unit(j // unit, Wp[:, i : i + unit])
        w = Wp[:, i].contiguous()
        obs.quantize_into(w, j // unit, c, q)
        codes[:, j], Q[:, j] = c, q
        err = (w - q) / U[i, i]
        later = Wp[:, i + 1 :]
        update = torch.outer(err, U[i, i + 1 :])
        if skip_after is not None and i + 1 < cols and (i + 1) % skip_after == 0:
            update[:, 0] = 0.0  # planted: a block boundary that drops the error reaching its first column
        later -= update
    obs.finish(codes, torch.arange(cols) // unit)
    return codes, Q, obs


def paper_factor(H: torch.Tensor, dampening: float, act_order: bool) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)^-1`` in fp64, as the paper writes it (dead columns set to 1 first)."""
    H = H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        H = H[perm][:, perm]
    H.diagonal().add_(dampening * H.diagonal().mean())
    return torch.linalg.cholesky(torch.linalg.inv(H), upper=True)


def assert_same(W, H, scheme, *, block_size: int, act_order: bool, **planted) -> None:
    rows, cols = W.shape
    lazy = gptq_solve(W, H, scheme, block_size=block_size, act_order=act_order)
    codes, Q, obs = naive_gptq(W, H, scheme, act_order=act_order, **planted)
    assert torch.equal(lazy.codes.float(), codes)
    ours, theirs = lazy.grid.parts(lazy.codes, slice(0, rows)), obs.parts(codes, slice(0, rows))
    assert list(ours) == list(theirs)
    for k in ours:
        assert torch.equal(ours[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8)), k
    assert torch.equal(lazy.dequantized, Q)


CASES = [  # (scheme, rows, cols, block size): block sizes that divide the width and that do not
    ("int4-g32", 8, 64, 32),
    ("int4-g32", 8, 96, 64),  # 96 = 64 + 32: a short last lazy block
    ("int4-g24", 6, 120, 48),  # 120 = 2 x 48 + 24
    ("int4-g16", 5, 200, 40),  # 200 = 5 x 40; groups of 16 in blocks of 32 (rounded to whole groups)
    ("int8-g32", 12, 160, 128),  # 160 = 128 + 32
    ("int4-row", 7, 100, 24),  # per-row scales: static, blocks of 24 cut anywhere
    ("int4-tensor", 4, 72, 16),
    ("int4-g128", 6, 192, 128),  # a short last group of 64 per row
    ("nf4", 6, 128, 64),
    ("mxfp4", 5, 96, 32),
    ("nvfp4", 8, 80, 48),  # 80 = 48 + 32, blocks of 16
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name,rows,cols,block_size", CASES)
def test_lazy_blocks_equal_the_naive_algorithm_bit_for_bit(name, rows, cols, block_size, act_order):
    seed = rows * 1000 + cols
    W = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    H = correlated_hessian(cols, seed)
    assert_same(W, H, get_scheme(name), block_size=block_size, act_order=act_order)


@pytest.mark.parametrize("act_order", [False, True])
def test_dead_input_columns_equal_the_naive_algorithm(act_order):
    W = torch.randn(8, 96, generator=torch.Generator().manual_seed(3))
    H = correlated_hessian(96, 3, dead=(0, 31, 32, 95))  # at block and group boundaries
    assert_same(W, H, get_scheme("int4-g32"), block_size=32, act_order=act_order)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("cols", [64, 100])
def test_the_solvers_factor_is_the_cholesky_of_the_dampened_inverse(cols, act_order):
    H = correlated_hessian(cols, cols, dead=(5,))
    U = prepare_hessian(H, 0.01, act_order).U
    ref = paper_factor(H, 0.01, act_order)
    assert torch.allclose(U.double(), ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    assert torch.equal(U, U.triu())


@pytest.mark.parametrize("planted", [{"skip_after": 32}, {"scales_from_original": True}])
def test_the_comparison_catches_a_planted_bug(planted):
    """A block boundary that loses one column's error feedback, or group scales taken from the original
    weights instead of the error-updated ones: either makes the naive codes differ from the solver's."""
    W = torch.randn(8, 96, generator=torch.Generator().manual_seed(4))
    H = correlated_hessian(96, 4)
    assert_same(W, H, get_scheme("int4-g32"), block_size=32, act_order=False)  # without the bug: equal
    with pytest.raises(AssertionError):
        assert_same(W, H, get_scheme("int4-g32"), block_size=32, act_order=False, **planted)


# --------------------------------------------------------------------------- RTN through the same observers

RTN_SCHEMES = ["int4-g64", "int4-g24", "int4-row", "int4-tensor", "int8-row", "int8-g32", "nf4", "mxfp4", "nvfp4"]


def observed_parts(W: torch.Tensor, name: str, scale_rule: str = "absmax") -> dict[str, torch.Tensor]:
    obs = observer_for(get_scheme(name), *W.shape, W.device, scale_rule=scale_rule, weights=W)
    codes, _ = round_to_nearest(W, obs)
    return obs.parts(codes, slice(0, W.shape[0]))


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.mark.parametrize("name", RTN_SCHEMES)
def test_rtn_through_the_observer_is_the_schemes_encode(name):
    """``round_to_nearest`` over a scheme's observer with the default rule writes ``quantize_tensor``'s bytes."""
    W = torch.randn(12, 192, generator=torch.Generator().manual_seed(21))
    W[3, :64] = 0.0  # a zero group / block
    assert same_bytes(observed_parts(W, name), quantize_tensor(W, get_scheme(name)).parts)


@pytest.mark.parametrize("rule", ["full-range", "mse"])
@pytest.mark.parametrize("name", ["int4-g32", "int4-row", "int8-g16", "int4-tensor"])
@pytest.mark.parametrize("act_order", [False, True])
def test_rtn_with_a_scale_rule_equals_gptq_with_a_diagonal_hessian_and_that_rule(rule, name, act_order):
    """The scale rules are the schemes layer's: RTN applies one through the observer, and GPTQ with a
    diagonal H (no error feedback) and the same rule gives the same bytes. The rule matters: the parts
    differ from the default rule's."""
    g = torch.Generator().manual_seed(22)
    W = torch.randn(16, 128, generator=g)
    H = torch.diag(torch.rand(128, generator=g) + 0.1)
    r = gptq_solve(W, H, get_scheme(name), act_order=act_order, scale_rule=rule)
    rtn = observed_parts(W, name, rule)
    assert same_bytes(r.grid.parts(r.codes, slice(0, 16)), rtn)
    assert not same_bytes(rtn, quantize_tensor(W, get_scheme(name)).parts)
