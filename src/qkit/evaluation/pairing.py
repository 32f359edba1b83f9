"""Rows paired on the same positions, once every row is measured: what a method bought, and what an engine
changed.

Layer 6 (``evaluation``), below the row loop (``engine_rows``). Every row scores the same positions
against the same reference, so two rows' per-position differences give a paired change with a standard
error far tighter than two independent ones:

- ``Row.versus``: a row whose method is not rtn against the row of the same scheme and simulations with
  rtn, and a planned mix (``plan:FORMAT@SCHEME``) against that scheme's row with the same method: the KL
  and perplexity differences (what gptq, awq, the importance matrix or the planner bought);
- ``Row.versus_torch``: an engine's row against the torch row of the same spec (or the torch reference):
  engine minus torch, the perplexity change and, with the full distribution, the KL difference.

Over an eval suite each also holds ``domains``: the same differences on each domain's positions.
"""

from __future__ import annotations

from qkit.evaluation.domains import paired_domains
from qkit.evaluation.engines import TORCH
from qkit.evaluation.measuring import REFERENCE
from qkit.evaluation.token_scores import TokenScores
from qkit.evaluation.report import Row
from qkit.evaluation.specs import RowSpec, parse_plan_word
from qkit.methods import RTN


def method_base(spec: RowSpec) -> str | None:
    """The name of the row ``spec`` is paired with: rtn's of its scheme and simulations, or the scheme a
    plan's bytes were matched to (same method); None for rtn rows and plans of a file or a bit target."""
    if spec.plan is not None:
        target = None if spec.plan.endswith(".json") else parse_plan_word(spec.plan)[2]
        return None if target is None else RowSpec(target, spec.method, spec.simulation).name
    if spec.method == RTN:
        return None
    return RowSpec(spec.scheme, RTN, spec.simulation).name


def pair_rows(rows: list[Row], specs: list[RowSpec], scores: dict[str, TokenScores]) -> None:
    """Fill ``Row.versus`` and ``Row.versus_torch`` (see the module docstring). ``scores``: every measured
    row's scores by its table name (torch rows by their spec's name, the reference as ``reference``)."""
    compare_methods(rows, specs, scores)
    for row in rows:  # an engine's row against the torch row of its spec (or the torch reference)
        against = row.spec.get("name") or REFERENCE
        if row.runtime != TORCH and row.refused is None and row.scheme in scores and against in scores:
            full = bool(row.engine.get("full_distribution", True))
            row.versus_torch = _paired(scores[row.scheme], scores[against], against, full)


def compare_methods(rows: list[Row], specs: list[RowSpec], scores: dict[str, TokenScores]) -> None:
    """``Row.versus``: each method's (or plan's) torch row against the row ``method_base`` names."""
    bases = {spec.name: method_base(spec) for spec in specs}
    for row in rows:
        base = bases.get(row.scheme)
        if row.runtime == TORCH and base in scores and row.scheme in scores:
            row.versus = _paired(scores[row.scheme], scores[base], base)


def _paired(scores: TokenScores, other: TokenScores, against: str, kl: bool = True) -> dict:
    """``scores`` minus ``other``: over every position, and per domain of an eval suite (``domains``)."""
    out = {"against": against, **scores.paired(other, kl=kl)}
    by_domain = paired_domains(scores, other, kl)
    return {**out, "domains": by_domain} if by_domain else out


__all__ = ["compare_methods", "method_base", "pair_rows"]
