"""The planner's exact solver: one candidate type per tensor, total bytes within a budget, least damage.

This is the multiple-choice knapsack (MCKP): items ``i = 0..n-1`` (tensors) with options ``j`` of cost
``c[i][j]`` (float64 >= 0, predicted KL in nats) and size ``s[i][j]`` (int bytes > 0); choose one ``j_i``
per item minimising ``sum_i c[i][j_i]`` subject to ``sum_i s[i][j_i] <= B``.

Derivation. Every mix spends at least ``base = sum_i min_j s[i][j]``, so write ``s = m_i + d_ij`` and the
constraint becomes ``sum_i d_ij <= slack = B - base``. An option whose size and cost are both >= another's
never helps, so it is dropped (the lowest index survives among exact duplicates); what remains, sorted by
size, has strictly falling cost. All increments are multiples of ``g = gcd(d_ij > 0)``, so with
``dp_i[k]`` = least cost of items ``0..i`` whose increments sum to ``<= k g``,

    dp_{-1}[k] = 0,    dp_i[k] = min_j dp_{i-1}[k - d_ij / g] + c_ij    (terms with k < d_ij / g absent)

over ``k = 0..K``, ``K = min(slack // g, sum_i max_j d_ij / g)``, is exact: ``dp_{n-1}[K]`` is the optimum.
When ``K + 1`` exceeds ``max_states`` the unit becomes ``u = g * ceil((slack // g) / (max_states - 1))``
(a multiple of ``g``, so that no increment is rounded needlessly) and every increment is rounded UP to a
multiple of ``u``: the answer still fits the budget but is no longer proven optimal (``exact=False``).
The bytes the rounding leaves unused are then spent in exact bytes (``_repair``: single moves to a
larger option, the largest saving first), which can only lower the cost.
Float addition is monotone, so the DP minimum is bit-identical to the least item-order float64 sum over
all feasible mixes.

Lower bound (Sinha & Zoltners 1979): the LP relaxation of MCKP puts each item on the lower convex hull of
its (size, cost) points; starting from every item's smallest option, buying hull segments greedily by
efficiency ``-dc/ds`` (largest first), the last one fractionally, solves that LP. Its value is <= the
optimum and is reported as ``lower_bound`` (clamped to ``<= cost`` against float noise).

Ties: exact duplicates keep the lowest index; at a DP state the smaller of two equally cheap options
wins (options are tried by size ascending and ``<`` never replaces); the backtrack starts from the
fewest-byte state that reaches the optimal cost. So among equally cheap mixes the one with the fewest
(unit-rounded) bytes wins, then the one whose last item is smallest, then the item before, and so on.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from qkit.errors import InputError
from qkit.plan.candidates import Candidate, fused_groups


@dataclass(frozen=True)
class Solution:
    """One option per item. ``cost`` is the float64 sum of the chosen costs in item order; ``nbytes`` exact."""

    choice: tuple[int, ...]  # chosen option index per item (an index into the caller's lists)
    cost: float
    nbytes: int
    exact: bool  # True: provably optimal for the given sizes
    unit: int  # bytes per DP state: the gcd of the size increments, or the rounding unit
    states: int  # DP states used (0: no DP was needed)
    lower_bound: float  # LP bound, <= the optimum; == cost when nothing better can exist
    seconds: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["choice"] = list(self.choice)
        return d


def _validate(costs, sizes, budget) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise InputError(f"the budget must be an integer number of bytes, got {budget!r}")
    try:
        lens = [(len(c), len(s)) for c, s in zip(costs, sizes)]
        if len(costs) != len(sizes):
            raise InputError(f"costs has {len(costs)} items but sizes has {len(sizes)}; give one list of each per tensor")
    except TypeError:
        raise InputError("costs and sizes must be lists (one per tensor) of per-candidate lists") from None
    cs, ss = [], []
    for i, (c, s) in enumerate(zip(costs, sizes)):
        if lens[i][0] != lens[i][1]:
            raise InputError(f"item {i} has {len(c)} costs but {len(s)} sizes; give one of each per candidate")
        if len(c) == 0:
            raise InputError(f"item {i} has no candidate options; give every tensor at least one")
        try:
            c = np.asarray(c, dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(f"item {i}: the costs must be numbers, got {list(c)!r}") from None
        if c.ndim != 1 or not np.isfinite(c).all() or (c < 0).any():
            raise InputError(f"item {i}: the costs must be finite and >= 0, got {c.tolist()!r}")
        s_arr = np.asarray(s)
        if s_arr.ndim != 1 or s_arr.dtype.kind not in "iu" or (s_arr <= 0).any():
            raise InputError(f"item {i}: the sizes must be positive integer byte counts, got {list(s)!r}")
        cs.append(c)
        ss.append(s_arr.astype(np.int64))
    return cs, ss, int(budget)


def smallest(sizes) -> int:
    """Bytes of the smallest mix: ``sum_i min_j sizes[i][j]`` (exact Python int)."""
    return sum(int(min(s)) for s in sizes)


def largest(sizes) -> int:
    """Bytes of the largest mix: ``sum_i max_j sizes[i][j]`` (exact Python int)."""
    return sum(int(max(s)) for s in sizes)


def _below(budget: int, base: int) -> InputError:
    return InputError(
        f"the budget of {budget} bytes is below the smallest mix, {base} bytes (every tensor at its smallest candidate)"
    )


def _fold(values) -> float:
    total = 0.0  # a left fold in item order, the order the DP adds in
    for v in values:
        total += float(v)
    return total


def brute_force(costs, sizes, budget) -> tuple[tuple[int, ...], float]:
    """The naive oracle: try every mix with ``itertools.product``; return the first cheapest that fits."""
    cs, ss, budget = _validate(costs, sizes, budget)
    if math.prod(len(c) for c in cs) > 1_000_000:
        raise InputError("brute_force tries every mix and refuses more than 1e6 of them; use solve() instead")
    best: tuple[tuple[int, ...], float] | None = None
    for choice in itertools.product(*(range(len(c)) for c in cs)):
        nbytes = sum(int(ss[i][j]) for i, j in enumerate(choice))
        cost = _fold(cs[i][j] for i, j in enumerate(choice))
        if nbytes <= budget and (best is None or cost < best[1]):
            best = (tuple(choice), cost)
    if best is None:
        raise _below(budget, smallest(ss))
    return best


def _prune(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Original indices of the undominated options, by size ascending (their costs strictly fall)."""
    order = np.lexsort((np.arange(len(c)), c, s))  # size, then cost, then index
    keep, low = [], math.inf
    for j in order.tolist():
        if c[j] < low:
            keep.append(j)
            low = c[j]
    return np.array(keep, dtype=np.int64)


def _lp_bound(kc: list[np.ndarray], ks: list[np.ndarray], slack: int) -> float:
    """Sinha-Zoltners LP bound on the pruned items (``ks`` ascending, ``kc`` falling)."""
    hulls, seg_item, seg_ds, seg_gain = [], [], [], []
    for i, (c, s) in enumerate(zip(kc, ks)):
        h: list[int] = []
        for p in range(len(c)):  # lower hull, monotone chain; drop points on or above a chord
            while len(h) >= 2:
                o, a = h[-2], h[-1]
                if (s[a] - s[o]) * (c[p] - c[o]) - (c[a] - c[o]) * (s[p] - s[o]) > 0:
                    break
                h.pop()
            h.append(p)
        hulls.append(c[h])
        for a, b in zip(h, h[1:]):
            seg_item.append(i)
            seg_ds.append(int(s[b] - s[a]))
            seg_gain.append(float(c[a] - c[b]))
    if not seg_ds:
        return _fold(h[0] for h in hulls)
    ds, gain, item = np.array(seg_ds, dtype=np.int64), np.array(seg_gain), np.array(seg_item)
    order = np.argsort(-(gain / ds), kind="stable")  # stable: an item's segments stay in hull order
    cum = np.cumsum(ds[order])
    k = int(np.searchsorted(cum, slack, side="right"))  # segments bought whole
    vertex = np.bincount(item[order[:k]], minlength=len(kc))
    lp = _fold(h[v] for h, v in zip(hulls, vertex.tolist()))
    if k < len(order):
        rest = slack - (int(cum[k - 1]) if k else 0)
        lp -= float(gain[order[k]]) * rest / float(ds[order[k]])
    return lp


def solve(
    costs: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: int, *, max_states: int = 1 << 20
) -> Solution:
    """Solve the MCKP exactly by a DP over byte units (see the module docstring).

    ``costs[i][j]`` float >= 0 and ``sizes[i][j]`` int > 0 are option ``j`` of item ``i`` (items may have
    different numbers of options). Memory: one uint8/uint16 argmin per item and state, ``n * states``.
    """
    t0 = time.perf_counter()
    cs, ss, budget = _validate(costs, sizes, budget)
    if isinstance(max_states, bool) or not isinstance(max_states, numbers.Integral) or max_states < 2:
        raise InputError(f"max_states must be an integer >= 2, got {max_states!r}")
    n = len(cs)
    base = smallest(ss)
    if budget < base:
        raise _below(budget, base)
    keep = [_prune(c, s) for c, s in zip(cs, ss)]
    kc = [c[k] for c, k in zip(cs, keep)]
    ks = [s[k] for s, k in zip(ss, keep)]
    inc = [s - s[0] for s in ks]  # s[0] is the item's minimum size
    positive = np.concatenate([d[1:] for d in inc] + [np.zeros(0, np.int64)])
    g = int(np.gcd.reduce(positive)) if positive.size else 1
    slack = budget - base

    def done(choice, exact, unit, states, lower=None) -> Solution:
        choice = tuple(int(keep[i][j]) for i, j in enumerate(choice))
        cost = _fold(cs[i][j] for i, j in enumerate(choice))
        nbytes = sum(int(ss[i][j]) for i, j in enumerate(choice))
        lower = cost if lower is None else min(lower, cost)
        return Solution(choice, cost, nbytes, exact, unit, states, lower, time.perf_counter() - t0)

    # every item at its cheapest option (the largest kept one) fits: trivially optimal
    if sum(int(s[-1]) for s in ks) <= budget:
        return done([len(k) - 1 for k in keep], True, g, 0)

    q = slack // g
    K = min(q, sum(int(d[-1]) for d in inc) // g)
    exact, unit = K + 1 <= max_states, g
    if exact:
        du = [d // g for d in inc]
    else:
        unit = g * -(-q // (max_states - 1))
        du = [-(-d // unit) for d in inc]  # round UP: the mix still fits the budget
        K = min(slack // unit, sum(int(d[-1]) for d in du))
    width = K + 1
    arg_dtype = np.min_scalar_type(max(len(k) for k in keep) - 1)
    dp = np.zeros(width)
    cand, better = np.empty(width), np.empty(width, dtype=bool)  # reused scratch: no allocation per option
    args = []
    for i in range(n):
        new = dp + kc[i][0]  # option 0 has increment 0 and so is defined at every state
        arg = np.zeros(width, dtype=arg_dtype)
        for j in range(1, len(keep[i])):
            shift = int(du[i][j])
            if shift >= width:
                break  # sizes ascend: the rest do not fit either
            m = width - shift
            np.add(dp[:m], kc[i][j], out=cand[:m])
            np.less(cand[:m], new[shift:], out=better[:m])  # strict: the lowest index keeps a tie
            np.copyto(new[shift:], cand[:m], where=better[:m])  # copyto: ~2x faster than boolean indexing
            np.copyto(arg[shift:], j, where=better[:m])
        args.append(arg)
        dp = new
    k = int(np.flatnonzero(dp == dp[-1])[0])  # fewest-byte state with the optimal cost
    choice = [0] * n
    for i in range(n - 1, -1, -1):
        j = int(args[i][k])
        choice[i] = j
        k -= int(du[i][j])
    if not exact:
        _repair(choice, kc, ks, budget)
    return done(choice, exact, unit, width, _lp_bound(kc, ks, slack))


def _repair(choice: list[int], kc: list[np.ndarray], ks: list[np.ndarray], budget: int) -> None:
    """After a rounded DP: spend the bytes the rounding left unused, in exact bytes. Rounding every
    increment up can make a mix that fits exactly look too big (every tensor at the option whose bytes are
    the budget, say), so the DP's answer may leave slack. Repeatedly move the one item whose move to a
    larger kept option (lower cost) fits in that slack and saves the most cost; ties go to the lowest item,
    then option. Each move lowers the cost and keeps the mix within the budget, so the answer can only
    improve; it is still not proven optimal."""
    left = budget - sum(int(ks[i][j]) for i, j in enumerate(choice))
    while True:
        best = None  # (saving, item, option)
        for i, j in enumerate(choice):
            s, c = ks[i], kc[i]
            for m in range(j + 1, len(s)):
                if int(s[m] - s[j]) > left:
                    break  # kept options ascend in size
                saving = float(c[j] - c[m])
                if best is None or saving > best[0]:
                    best = (saving, i, m)
        if best is None or best[0] <= 0:
            return
        _, i, m = best
        left -= int(ks[i][m] - ks[i][choice[i]])
        choice[i] = m


def tied_items(names: Sequence[str], options: Sequence[Sequence[Candidate]], format: str,
               costs: Sequence[Sequence[float]] | None = None) -> tuple[list[list[int]], list[list[Candidate]], list[list[float]]]:
    """The solver's items: each group of ``candidates.fused_groups`` (tensors that must share one type)
    is one item whose options are the types every member offers, with the members' bytes and predicted
    ``costs`` summed (so the knapsack over items is exact for the tied problem). Returns the groups
    (indices into ``names``), each item's merged candidates (``scheme`` None) and their costs."""
    groups = fused_groups(format, names)
    items, merged = [], []
    for g in groups:
        by_name = [{c.name: k for k, c in enumerate(options[i])} for i in g]
        common = [c.name for c in options[g[0]] if all(c.name in m for m in by_name)]
        if not common:
            raise InputError(f"{', '.join(names[i] for i in g)} must share one type (vLLM fuses them) but "
                             "have no candidate in common; widen --candidates")
        items.append([Candidate(n, None, sum(options[i][m[n]].nbytes for i, m in zip(g, by_name))) for n in common])
        if costs is not None:
            merged.append([sum(costs[i][m[n]] for i, m in zip(g, by_name)) for n in common])
    return groups, items, merged
