"""Does a (quantized) draft model pay off in speculative decoding?

With a draft that proposes ``gamma`` tokens, each accepted independently with probability ``alpha``
(the draft's greedy agreement with the target), one target verification pass yields on average
(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, eq. 1)::

    E[tokens per pass] = (1 - alpha**(gamma + 1)) / (1 - alpha)          (= gamma + 1 when alpha = 1)

and costs ``gamma`` draft forwards plus one target forward, so with a draft forward costing ``c`` of a
target forward::

    speedup = E[tokens per pass] / (gamma * c + 1)

A speedup below 1 means speculation *slows generation down*.

With an eval JSON, ``alpha`` is each scheme's greedy agreement and, unless given, ``c`` is the scheme's
bits per weight over the reference's: decode is memory-bandwidth bound, so a forward costs about the
bytes of weights it reads (an assumption, stated with the output; it ignores dequantization work and
the draft being the same size as the target in parameters).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qkit.bounds import real, whole
from qkit.errors import InputError
from qkit.serving.batching import _read_text

DEFAULT_GAMMAS: tuple[int, ...] = (1, 2, 4, 8)
DEFAULT_COST = 0.1  # draft forward / target forward, when neither --cost nor --from gives one
MAX_GAMMA = 1024  # draft tokens per pass: far beyond any acceptance rate's use (alpha**1024 is nothing)
MAX_COST = 1000.0  # a draft 1000x the target's cost: already a slowdown; the bound keeps the table finite
BANDWIDTH_ASSUMPTION = (
    "draft cost c = scheme bits per weight / reference bits per weight: decode is memory-bandwidth bound, "
    "so a forward costs about the bytes of weights it reads (dequantization work not counted)"
)
Z95 = 1.959963984540054  # two-sided 95% normal quantile


def expected_tokens(alpha: float, gamma: int) -> float:
    """``(1 - alpha**(gamma+1)) / (1 - alpha)``; its limit ``gamma + 1`` at ``alpha = 1``."""
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, cost: float) -> float:
    """``expected_tokens(alpha, gamma) / (gamma * cost + 1)``."""
    return expected_tokens(alpha, gamma) / (gamma * cost + 1.0)


@dataclass(frozen=True)
class DraftRow:
    draft: str
    alpha: float
    cost: float
    cost_source: str  # "--cost", "default", "bits per weight ratio"
    gamma: int
    expected_tokens: float
    speedup: float
    slower: bool
    alpha_se: float | None = None  # standard error of alpha when it was measured on n tokens
    speedup_low: float | None = None  # speedup at the low end of alpha's 95% interval
    speedup_high: float | None = None


@dataclass(frozen=True)
class SpeculateReport:
    rows: list[DraftRow]
    gammas: list[int]
    best: dict[str, dict[str, Any]]  # draft -> the row with the highest speedup
    assumption: str | None
    source: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_alpha(alpha: float, where: str) -> float:
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0) or math.isnan(alpha):
        raise InputError(f"acceptance rate {alpha!r} ({where}) must be a fraction in [0, 1], e.g. 0.8")
    return float(alpha) + 0.0  # -0.0 would print as "-0"


def drafts_from_eval(path: str | Path) -> list[dict[str, Any]]:
    """``[{"draft", "alpha", "n", "ci95", "cost"}]`` from a ``qkit eval --json`` file.

    Rows have scheme, bits_per_weight, agreement (a count of agreeing tokens, or a fraction when a float),
    agreement_total and optionally agreement_ci95; the ``reference`` row gives the target's bits per weight.
    """

    text = _read_text(path, "eval file", "write one with qkit eval --json PATH")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); pass the file written by qkit eval --json") from exc
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InputError(f"{path} has no 'rows' list of objects; pass the file written by qkit eval --json")
    try:
        ref = next(r for r in rows if r.get("scheme") == "reference")
    except StopIteration:
        raise InputError(f"{path} has no 'reference' row; re-run qkit eval with its reference row") from None
    out = []
    for r in rows:
        if r is ref:
            continue
        try:
            n = int(r.get("agreement_total") or 0)
            a = r["agreement"]
            # qkit eval writes a count of agreeing tokens (an int) out of agreement_total; a float is a fraction.
            is_count = isinstance(a, int) and not isinstance(a, bool)
            if is_count and n < 1:
                raise ValueError("an agreement count needs agreement_total")
            alpha = _check_alpha(a / n if is_count else a, f"{r['scheme']} in {path}")
            ci = r.get("agreement_ci95")
            ci = (float(ci[0]), float(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None
            if ci is not None and not 0.0 <= ci[0] <= ci[1] <= 1.0:  # NaN fails too
                raise ValueError(f"agreement_ci95 {list(ci)} is not a range within [0, 1]")
            cost = float(r["bits_per_weight"]) / float(ref["bits_per_weight"])
            if not (cost >= 0 and math.isfinite(cost)):
                raise ValueError(f"bits_per_weight ratio {cost} is not a non-negative number")
            out.append({"draft": str(r["scheme"]), "alpha": alpha, "n": n, "ci95": ci, "cost": cost})
        except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
            raise InputError(
                f"row {r.get('scheme', '?')!r} of {path} lacks scheme/bits_per_weight/agreement ({exc}); "
                "pass the file written by qkit eval --json"
            ) from exc
    if not out:
        raise InputError(f"{path} has only the reference row; evaluate at least one scheme")
    return out


def speculate(
    *,
    alphas: Sequence[float] = (),
    from_eval: str | Path | None = None,
    gammas: Sequence[int] = DEFAULT_GAMMAS,
    cost: float | None = None,
) -> SpeculateReport:
    """Expected tokens per pass and speedup for every draft (an alpha, or an eval row) and every gamma."""
    if bool(alphas) == (from_eval is not None):
        raise InputError("give acceptance rates with --alpha A (repeatable) or an eval JSON with --from, not both")
    if not gammas or any(int(g) != g or g < 1 for g in gammas):
        raise InputError(f"--gamma needs positive integers, e.g. 1,2,4,8 (got {list(gammas)})")
    for g in gammas:
        whole(int(g), "--gamma", 1, MAX_GAMMA)
    if cost is not None and not (cost >= 0 and math.isfinite(cost)):
        raise InputError(f"--cost must be a non-negative fraction of a target forward (got {cost})")
    if cost is not None:
        cost = real(cost, "--cost", 0, MAX_COST)
    if from_eval is not None:
        drafts = drafts_from_eval(from_eval)
        if cost is not None:
            drafts = [{**d, "cost": cost} for d in drafts]
        cost_source = "--cost" if cost is not None else "bits per weight ratio"
    else:
        drafts = [{"draft": f"alpha={_check_alpha(a, '--alpha'):g}", "alpha": _check_alpha(a, "--alpha"), "n": 0,
                   "cost": DEFAULT_COST if cost is None else cost} for a in alphas]
        cost_source = "default" if cost is None else "--cost"
    rows = []
    for d in drafts:
        se = math.sqrt(d["alpha"] * (1 - d["alpha"]) / d["n"]) if d["n"] else None
        # The 95% range of alpha: the eval's Wilson interval when it wrote one, else alpha +- 1.96 SE.
        ci = d.get("ci95") or ((max(0.0, d["alpha"] - Z95 * se), min(1.0, d["alpha"] + Z95 * se)) if se is not None else None)
        for g in sorted({int(x) for x in gammas}):
            s = speedup(d["alpha"], g, d["cost"])
            lo = hi = None
            if ci is not None:  # speedup increases with alpha, so the interval maps end to end
                lo, hi = speedup(ci[0], g, d["cost"]), speedup(ci[1], g, d["cost"])
            rows.append(DraftRow(d["draft"], d["alpha"], d["cost"], cost_source, g, expected_tokens(d["alpha"], g),
                                 s, s < 1.0, se, lo, hi))
    best = {}
    for r in rows:
        if r.draft not in best or r.speedup > best[r.draft]["speedup"]:
            best[r.draft] = {"gamma": r.gamma, "speedup": r.speedup}
    assumption = BANDWIDTH_ASSUMPTION if cost_source == "bits per weight ratio" else None
    return SpeculateReport(rows, sorted({int(x) for x in gammas}), best, assumption, str(from_eval) if from_eval else None)
