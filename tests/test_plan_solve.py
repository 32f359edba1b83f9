"""The planner's MCKP solver against a brute-force oracle, hand-computed goldens, refusals and a speed bound."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.errors import InputError
from qkit.plan.solve import Solution, brute_force, largest, smallest, solve

COSTS = st.one_of(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.0, 2.0]), st.floats(0.0, 10.0, allow_nan=False))


@st.composite
def instances(draw, max_items=6, max_options=4):
    """(costs, sizes, budget): ragged option counts, sizes 1..50 times a unit, ties and zeros in the costs."""
    n = draw(st.integers(1, max_items))
    unit = draw(st.sampled_from([1, 1, 2, 3, 7, 64]))
    anti = draw(st.booleans())  # bigger is better, as for real types: the DP rather than the shortcut decides
    costs, sizes = [], []
    for _ in range(n):
        k = draw(st.integers(1, max_options))
        c = [draw(COSTS) for _ in range(k)]
        s = [unit * draw(st.integers(1, 50)) for _ in range(k)]
        costs.append(sorted(c, reverse=True) if anti else c)
        sizes.append(sorted(s) if anti else s)
    budget = draw(st.integers(smallest(sizes) - 5, largest(sizes) + 5))
    return costs, sizes, budget


def check_solution(sol: Solution, costs, sizes, budget) -> None:
    """The reported numbers are those of the reported choice, and the choice fits."""
    assert len(sol.choice) == len(costs)
    nbytes = sum(sizes[i][j] for i, j in enumerate(sol.choice))
    cost = 0.0
    for i, j in enumerate(sol.choice):
        cost += costs[i][j]
    assert sol.nbytes == nbytes <= budget
    assert sol.cost == cost
    assert sol.lower_bound <= sol.cost
    json.dumps(sol.to_dict(), allow_nan=False)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(instances())
def test_matches_brute_force(inst):
    costs, sizes, budget = inst
    if budget < smallest(sizes):
        with pytest.raises(InputError, match="below the smallest mix"):
            solve(costs, sizes, budget)
        return
    sol = solve(costs, sizes, budget)
    _, best = brute_force(costs, sizes, budget)
    check_solution(sol, costs, sizes, budget)
    assert sol.exact
    assert math.isclose(sol.cost, best, rel_tol=1e-12, abs_tol=0.0)
    assert sol.lower_bound <= best * (1 + 1e-12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(instances(), st.integers(2, 4))
def test_forced_rounding_fits_and_bounds(inst, max_states):
    costs, sizes, budget = inst
    if budget < smallest(sizes):
        return
    sol = solve(costs, sizes, budget, max_states=max_states)
    _, best = brute_force(costs, sizes, budget)
    check_solution(sol, costs, sizes, budget)
    assert sol.states <= max_states or sol.states == 0
    assert sol.cost >= best * (1 - 1e-12)
    assert sol.lower_bound <= best * (1 + 1e-12)
    if not sol.exact:
        assert sol.unit > 0 and sol.states <= max_states
    left = budget - sol.nbytes  # the repair spent what rounding left: no single move that fits still saves
    for i, j in enumerate(sol.choice):
        assert all(costs[i][m] >= costs[i][j] for m in range(len(sizes[i])) if sizes[i][m] - sizes[i][j] <= left), i


def test_rounding_leaves_no_bytes_a_cheaper_option_fits_in():
    """A budget that is exactly every item at its largest option (a uniform row's own bytes): rounding each
    increment up makes that mix look too big to the DP, and the exact-bytes repair takes it back."""
    costs = [[2.0, 1.0, 0.0]] * 6  # a small, a middle (the uniform row's type) and a kept option
    sizes = [[10, 17, 40]] * 6  # slack 42 over the base: 43 exact states; with 4 the unit is 14 bytes
    sol = solve(costs, sizes, 6 * 17, max_states=4)
    _, best = brute_force(costs, sizes, 6 * 17)
    assert best == 6.0 and not sol.exact and sol.unit == 14
    # rounded, 7-byte increments cost 14 and only three of them fit; the repair spends the 21 bytes left
    assert sol.choice == (1,) * 6 and sol.cost == 6.0 and sol.nbytes == 102


def test_rounding_is_reported():
    # increments 1..40 bytes (gcd 1) over a slack of 55 bytes: 56 exact states, so 4 forces rounding
    costs = [[4.0, 2.0, 1.0, 0.0]] * 3
    sizes = [[10, 11, 30, 50]] * 3
    sol = solve(costs, sizes, 85, max_states=4)
    assert not sol.exact and sol.states <= 4 and sol.unit == 19  # 1 * ceil(55 / 3)
    check_solution(sol, costs, sizes, 85)
    full = solve(costs, sizes, 85)
    assert full.exact and full.unit == 1 and full.states == 56
    assert sol.cost >= full.cost and sol.lower_bound == full.lower_bound


GOLDEN_COSTS = [[5.0, 2.0, 0.0], [4.0, 0.0], [3.0, 2.5, 0.5]]
GOLDEN_SIZES = [[10, 20, 40], [10, 30], [10, 15, 20]]


def test_golden_three_items():
    # base 30 bytes, slack 35, increments {0,10,30}, {0,20}, {0,5,10}: gcd 5, 35 / 5 + 1 = 8 states.
    # Mixes within 35 bytes of increments: (1,1,1) 2 + 0 + 2.5 = 4.5 at 35; (1,1,0) 5.0; (0,1,2) 5.5;
    # (2,0,1) 6.5; (1,0,2) 6.5: the optimum is (1,1,1).
    # LP: hull segments A 10 B for 3 (0.3/B), C 0 -> 2 (10 B for 2.5, 0.25/B; C's 15-B point lies above the
    # chord), A 10 -> 40 B (0.1/B), B 20 B for 4 (0.2/B). Buy A (10), C (10), then 15/20 of B: 12 - 3 - 2.5 - 3.
    sol = solve(GOLDEN_COSTS, GOLDEN_SIZES, 65)
    assert sol.choice == (1, 1, 1)
    assert (sol.cost, sol.nbytes, sol.exact, sol.unit, sol.states, sol.lower_bound) == (4.5, 65, True, 5, 8, 3.5)
    # 5 more bytes: (1,1,2) = 2.5, and the LP is tight there (A, C and all of B fit in 40)
    sol = solve(GOLDEN_COSTS, GOLDEN_SIZES, 70)
    assert (sol.choice, sol.cost, sol.lower_bound, sol.states) == ((1, 1, 2), 2.5, 2.5, 9)
    assert brute_force(GOLDEN_COSTS, GOLDEN_SIZES, 65) == ((1, 1, 1), 4.5)


def test_trivial_and_smallest_budgets():
    # everything at its cheapest option fits: no DP, and the bound equals the cost
    sol = solve(GOLDEN_COSTS, GOLDEN_SIZES, 90)
    assert (sol.choice, sol.cost, sol.nbytes, sol.states, sol.lower_bound) == ((2, 1, 2), 0.5, 90, 0, 0.5)
    sol = solve(GOLDEN_COSTS, GOLDEN_SIZES, 30)
    assert (sol.choice, sol.cost, sol.nbytes) == ((0, 0, 0), 12.0, 30)
    assert smallest(GOLDEN_SIZES) == 30 and largest(GOLDEN_SIZES) == 90


def test_ties():
    # exact duplicates: the lowest index; equal cost at a larger size: the smaller one
    sol = solve([[1.0, 0.0, 0.0, 0.0]], [[5, 9, 9, 12]], 100)
    assert sol.choice == (1,)
    # equally cheap mixes (1,1) at 45 B and (2,0) at 50 B: the fewer bytes win
    sol = solve([[2.0, 1.0, 0.0], [1.0, 0.0]], [[10, 20, 40], [10, 25]], 50)
    assert (sol.choice, sol.cost, sol.nbytes) == ((1, 1), 1.0, 45)
    # equal cost and bytes, (1,0) or (0,1): the last item takes its lowest index
    sol = solve([[1.0, 0.0], [1.0, 0.0]], [[10, 20], [10, 20]], 30)
    assert (sol.choice, sol.cost, sol.nbytes) == ((1, 0), 1.0, 30)


def without_time(sol: Solution) -> Solution:
    return dataclasses.replace(sol, seconds=0.0)


def test_deterministic_and_permutation():
    rng = np.random.default_rng(3)
    costs = rng.random((8, 5)).tolist()
    sizes = rng.integers(1, 40, (8, 5)).tolist()
    budget = (smallest(sizes) + largest(sizes)) // 2
    a, b = solve(costs, sizes, budget), solve(costs, sizes, budget)
    assert without_time(a) == without_time(b)
    assert a.to_dict().keys() == {f.name for f in dataclasses.fields(Solution)}
    # reversing the items reverses the choice (continuous random costs: the optimum is unique)
    r = solve(costs[::-1], sizes[::-1], budget)
    assert r.choice == a.choice[::-1] and r.nbytes == a.nbytes
    assert math.isclose(r.cost, a.cost, rel_tol=1e-12)
    # numpy arrays are accepted and give the same answer
    assert without_time(solve(np.array(costs), np.array(sizes), np.int64(budget))) == without_time(a)


@pytest.mark.parametrize(
    ("costs", "sizes", "budget", "message"),
    [
        ([[1.0]], [[10]], 9, "the budget of 9 bytes is below the smallest mix, 10 bytes (every tensor at its smallest"),
        ([[1.0], [2.0]], [[10]], 100, "costs has 2 items but sizes has 1"),
        ([[1.0, 2.0]], [[10]], 100, "item 0 has 2 costs but 1 sizes"),
        ([[1.0], []], [[10], []], 100, "item 1 has no candidate options"),
        ([[float("nan")]], [[10]], 100, "finite and >= 0"),
        ([[float("inf")]], [[10]], 100, "finite and >= 0"),
        ([[-0.5]], [[10]], 100, "finite and >= 0"),
        ([["x"]], [[10]], 100, "costs must be numbers"),
        ([[1.0]], [[0]], 100, "positive integer byte counts"),
        ([[1.0]], [[-3]], 100, "positive integer byte counts"),
        ([[1.0]], [[10.5]], 100, "positive integer byte counts"),
        ([[1.0]], [[10.0]], 100, "positive integer byte counts"),
        ([[1.0]], [[10]], 100.0, "budget must be an integer"),
        ([[1.0]], [[10]], True, "budget must be an integer"),
        ([1.0], [10], 100, "must be lists"),
    ],
)
def test_refusals(costs, sizes, budget, message):
    with pytest.raises(InputError) as err:
        solve(costs, sizes, budget)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_refusals_of_options_and_brute_force():
    with pytest.raises(InputError, match="max_states must be an integer >= 2"):
        solve([[1.0]], [[10]], 10, max_states=1)
    with pytest.raises(InputError, match="refuses more than 1e6") as err:
        brute_force([[0.0] * 11] * 6, [[1] * 11] * 6, 100)  # 11**6 = 1.77e6 mixes
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="below the smallest mix"):
        brute_force([[1.0]], [[10]], 9)


# ggml bytes per block: q4_0 q4_1 q5_0 q5_1 q8_0 per 32 weights; q2_K q3_K iq4_xs q4_K q5_K q6_K per 256
BLOCK32 = (18, 20, 22, 24, 34)
SUPER256 = (84, 110, 136, 144, 176, 210)
SHAPES = [(1536, 576)] * 60 + [(192, 576)] * 60 + [(576, 576)] * 60 + [(576, 1536)] * 30  # (out, in)


def realistic(seed: int = 0):
    """210 tensors x 12 candidates sized like the default model's projections; costs ~ a_i 2^(-2 bpw).

    A row of ``in`` weights takes ``in/32`` blocks of a 32-block type, ``ceil(in/256)`` super-blocks of a
    K-type (576-wide rows padded to 3), or ``2 in`` bytes in f16 (cost 0).
    """
    rng = np.random.default_rng(seed)
    costs, sizes = [], []
    for rows, cols in SHAPES:
        per_row = [cols // 32 * b for b in BLOCK32] + [-(-cols // 256) * b for b in SUPER256] + [2 * cols]
        s = np.array([rows * b for b in per_row])
        c = rng.lognormal(0.0, 1.0) * 2.0 ** (-16 * s / (rows * cols)) * (1 + 0.1 * rng.random(len(s)))
        c[-1] = 0.0
        costs.append(c.tolist())
        sizes.append(s.tolist())
    return costs, sizes


def test_speed_realistic():
    costs, sizes = realistic()
    weights = sum(r * c for r, c in SHAPES)
    assert weights == 106_168_320
    budget = int(5.5 * weights / 8)  # 5.5 bits per weight
    times, sols = [], []
    for _ in range(5):
        sol = solve(costs, sizes, budget)
        times.append(sol.seconds)
        sols.append(without_time(sol))
    assert all(s == sols[0] for s in sols)
    sol = sols[0]
    check_solution(sol, costs, sizes, budget)
    assert sol.exact and sol.unit == 1152 and sol.states == 25561  # (budget - base) / 1152 + 1
    assert sol.lower_bound <= sol.cost <= sol.lower_bound * 1.001
    assert statistics.median(times) < 1.0, f"median {statistics.median(times):.3f} s over 5 solves"
