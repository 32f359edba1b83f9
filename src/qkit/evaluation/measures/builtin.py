"""qkit eval's metrics, each one class and one ``MEASURES.register`` line, in the order the tables show them.

Layer 6 (``evaluation.measures``). The formulas (``token_scores.TokenScores``, ``klstats``, ``stats``):

- ``perplexity``: ``exp(mean nll)`` ± ``ppl * SE(nll)`` (delta method);
- ``perplexity-change``: ``100 (exp(mean d) - 1)`` with ``d = nll - nll_ref`` per position, paired SE
  ``100 exp(mean d) SE(d)`` (0 for the reference itself);
- ``kl``: mean KL(reference || row) per position, nats, ± its SE;
- ``kl-p99``: the 99th percentile of the per-position KL as ``llama-perplexity --kl-divergence`` prints
  its "99.0%   KLD" line (``klstats.llama_percentile``: ``p = 0.99f * (n - 1)`` in float32, linear
  interpolation between the sorted values at ``floor(p)`` and the next); an order statistic, so no SE
  (llama.cpp prints none): the mean says how far a row is on average, this how bad its worst positions get;
- ``top-1``: the share of positions whose argmax is the reference's (a binomial rate);
- ``battery``: right answers of the factual battery with a Wilson 95% interval, and exact McNemar against
  the reference's answers;
- ``agreement``: teacher-forced argmax against the reference's greedy continuation, a Wilson 95% interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from qkit.evaluation.battery import is_correct
from qkit.evaluation.klstats import llama_percentile
from qkit.evaluation.measures.base import (
    MEASURES,
    Evidence,
    FrontierPanel,
    TokenMeasure,
    estimate,
    fixed,
    fmt_change,
    fmt_estimate,
    fmt_number,
    num,
)
from qkit.evaluation.stats import mcnemar_exact, wilson_interval
from qkit.jsonfields import CHANGE_PCT, COUNT, MEASURE, NULL, PERPLEXITY, PROBABILITY, list_of

nan = math.nan


class Perplexity(TokenMeasure):
    keys = ("perplexity", "perplexity_se")
    fields = {"perplexity": PERPLEXITY, "perplexity_se": MEASURE}
    header = page_header = "perplexity"  # over an eval suite the pooled perplexity is not a column: the domains' are
    domain_caption = "the reference's row: its perplexity ± SE"  # the rows' own cells are their changes

    def compute(self, e: Evidence) -> dict[str, Any]:
        return {"perplexity": e.scores.perplexity, "perplexity_se": e.scores.perplexity_se}

    def cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        return fmt_estimate(num(v.get("perplexity")), num(v.get("perplexity_se")), scored)

    def page_cell(self, v: Mapping[str, Any], reference: bool) -> str:
        return estimate(v.get("perplexity"), v.get("perplexity_se"), 3)

    def domain_cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        return f"ppl {self.cell(v, scored, reference)}" if reference else ""


class PerplexityChange(TokenMeasure):
    keys = ("perplexity_change_pct", "perplexity_change_se_pct")
    fields = {"perplexity_change_pct": CHANGE_PCT, "perplexity_change_se_pct": MEASURE}
    header, suite_header, page_header, domain_header = "Δ ppl", "worst Δ ppl", "Δ ppl (%)", "Δ ppl ± paired SE"
    worst, worst_key = max, "perplexity_change_pct"
    frontier = FrontierPanel("Δ perplexity", "Δ perplexity, %", "size against perplexity change (± 2 paired SE)",
                             "symlog", "Δ ppl % ± 2 SE", 2, sign=True)
    place = 1  # after KL, the headline, in the per-domain table and on the frontier

    def compute(self, e: Evidence) -> dict[str, Any]:
        change, se = (0.0, 0.0) if e.reference is None else e.scores.change_against(e.reference)
        return {"perplexity_change_pct": change, "perplexity_change_se_pct": se}

    def cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        return "" if reference else fmt_change(num(v.get(self.keys[0])), num(v.get(self.keys[1])))

    def page_cell(self, v: Mapping[str, Any], reference: bool) -> str:
        return "" if reference else estimate(v.get(self.keys[0]), v.get(self.keys[1]), 2)


class KL(TokenMeasure):
    keys = ("kld", "kld_se")
    fields = {"kld": MEASURE, "kld_se": MEASURE}
    header, suite_header, page_header, domain_header = "KL (nats)", "worst KL", "KL (nats)", "KL (nats)"
    worst, worst_key = max, "kld"
    frontier = FrontierPanel("KL", "KL(reference ‖ row), nats/token", "size against KL divergence (± 2 SE)", "log",
                             "KL ± 2 SE", 4)
    place = 0

    def domain_cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        return "" if reference else self.cell(v, scored, reference)

    def compute(self, e: Evidence) -> dict[str, Any]:
        return {"kld": e.scores.kld, "kld_se": e.scores.kld_se}

    def page_cell(self, v: Mapping[str, Any], reference: bool) -> str:
        return "" if reference else estimate(v.get("kld"), v.get("kld_se"), 4)


class KLP99(TokenMeasure):
    """In the JSON (each row and each domain) and on the report's page; not in the terminal table, whose
    columns README and the docs show (``qkit eval --kl-stats`` prints it as llama-perplexity's "99.0% KLD")."""

    keys = ("kld_p99",)
    fields = {"kld_p99": MEASURE}
    page_header = "KL p99 (nats)"
    worst, worst_key = max, "kld_p99"

    def compute(self, e: Evidence) -> dict[str, Any]:
        kl = e.scores.kl.detach().cpu().double().numpy()
        if kl.size == 0 or np.isnan(kl).any():  # no full distribution: no KL at any position
            return {"kld_p99": nan}
        return {"kld_p99": llama_percentile(np.sort(kl), 0.99)}

    def page_cell(self, v: Mapping[str, Any], reference: bool) -> str:
        x = num(v.get("kld_p99"))
        return "" if reference else (fixed(x, 4) if math.isfinite(x) else "-")


class Top1(TokenMeasure):
    keys = ("top1_match",)
    fields = {"top1_match": PROBABILITY}
    header, suite_header, page_header = "top-1", "worst top-1", "top-1"
    worst, worst_key = min, "top1_match"

    def compute(self, e: Evidence) -> dict[str, Any]:
        return {"top1_match": e.scores.top1_match}

    def cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        x = num(v.get("top1_match"))
        return fmt_number(100 * x, ".1f") + ("%" if math.isfinite(x) else "")


class Battery(TokenMeasure):
    keys = ("battery_correct", "battery_total", "battery_ci95", "battery_answers", "battery_outputs",
            "mcnemar_only_reference", "mcnemar_only_row", "mcnemar_p")
    fields = {"battery_ci95": list_of(PROBABILITY) | NULL, "battery_correct": COUNT | NULL, "battery_total": COUNT | NULL}
    per_domain, worst = False, None
    header = suite_header = "battery (95% CI)"
    page_header = "battery"

    def compute(self, e: Evidence) -> dict[str, Any]:
        answers = [is_correct(o, q.answers) for o, q in zip(e.outputs, e.questions)]
        only_ref, only_row, p = ((0, 0, 1.0) if e.reference_answers is None
                                 else mcnemar_exact(list(e.reference_answers), answers))
        k, n = sum(answers), len(answers)
        return {"battery_correct": k, "battery_total": n, "battery_ci95": wilson_interval(k, n),
                "battery_answers": answers, "battery_outputs": list(e.outputs),
                "mcnemar_only_reference": only_ref, "mcnemar_only_row": only_row, "mcnemar_p": p}

    def blank(self) -> dict[str, Any]:
        return {"battery_correct": 0, "battery_total": 0, "battery_ci95": (nan, nan), "battery_answers": [],
                "battery_outputs": [], "mcnemar_only_reference": 0, "mcnemar_only_row": 0, "mcnemar_p": nan}

    def cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        if not v.get("battery_total"):
            return "-"
        lo, hi = v["battery_ci95"]
        return f"{v['battery_correct']}/{v['battery_total']} ({100 * lo:.0f}-{100 * hi:.0f}%)"

    def page_cell(self, v: Mapping[str, Any], reference: bool) -> str:
        return f"{v.get('battery_correct')}/{v.get('battery_total')}" if v.get("battery_total") else "-"


class Agreement(TokenMeasure):
    keys = ("agreement", "agreement_total", "agreement_ci95")
    fields = {"agreement": COUNT | NULL, "agreement_total": COUNT | NULL}
    per_domain, worst = False, None
    header = suite_header = page_header = "agreement"

    def compute(self, e: Evidence) -> dict[str, Any]:
        agree = e.agree if e.agree is not None else torch.zeros(0, 0, dtype=torch.bool)
        k, n = int(agree.sum()), int(agree.numel())
        return {"agreement": k, "agreement_total": n, "agreement_ci95": wilson_interval(k, n)}

    def blank(self) -> dict[str, Any]:
        return {"agreement": 0, "agreement_total": 0, "agreement_ci95": (nan, nan)}

    def cell(self, v: Mapping[str, Any], scored: int, reference: bool) -> str:
        return f"{v.get('agreement')}/{v.get('agreement_total')}"


MEASURES.register("perplexity", Perplexity())
MEASURES.register("perplexity-change", PerplexityChange())
MEASURES.register("kl", KL())
MEASURES.register("kl-p99", KLP99())
MEASURES.register("top-1", Top1())
MEASURES.register("battery", Battery())
MEASURES.register("agreement", Agreement())

__all__ = ["KL", "KLP99", "Agreement", "Battery", "Perplexity", "PerplexityChange", "Top1"]
