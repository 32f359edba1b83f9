"""Per-domain statistics of an eval suite: each domain's positions scored as if it were the only text.

Layer 6 (``evaluation``), beside ``token_scores``. The default eval scores several held-out texts
(``qkit.catalog.DEFAULT_SUITE``: the Book of Ruth, the GPL-3 text, argparse.py, a play's dialogue), each in
windows of its own (``CorpusReference(segments=...)``), so a row's per-position values are the domains'
one after another; ``TokenScores.domains`` names them and counts their positions. ``slices`` cuts a row's
scores back into one ``TokenScores`` per domain, and every statistic of a domain (perplexity and its SE,
the paired change against the reference and its paired SE, KL, top-1) is then exactly what the
single-text code gives on that domain alone (tests/test_corpora.py checks it against an independent
computation).

A row's headline over a suite is its worst domain (``worst``): the largest KL, the largest perplexity
change, the smallest top-1; never the calibration's own text, which the suite never holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qkit.evaluation.measures import Evidence, measure_values
from qkit.evaluation.token_scores import TokenScores


def slices(scores: TokenScores) -> dict[str, TokenScores]:
    """One ``TokenScores`` per domain, in order (views of ``scores``' tensors); {} for a single text."""
    out: dict[str, TokenScores] = {}
    start = 0
    for name, n in scores.domains:
        stop = start + n
        out[name] = TokenScores(scores.nll[start:stop], scores.kl[start:stop], scores.top1[start:stop],
                                scores.measurable)
        start = stop
    return out


def domain_rows(scores: TokenScores, reference: TokenScores | None) -> list[dict[str, Any]]:
    """Per domain: ``name``, ``scored_tokens`` and every per-domain measure's values on its positions
    (``evaluation.measures``: ``perplexity`` and ``perplexity_se``, the change against the reference's same
    positions with its paired SE, ``perplexity_change_pct`` and ``perplexity_change_se_pct``, 0 for the
    reference itself, ``reference`` None; ``kld``, ``kld_se``, ``kld_p99`` and ``top1_match``). [] for one text."""
    if len(scores.domains) < 2:
        return []
    ref = slices(reference) if reference is not None else {}
    return [{"name": name, "scored_tokens": s.n, **measure_values(Evidence(s, ref.get(name)), per_domain=True)}
            for name, s in slices(scores).items()]


def paired_domains(scores: TokenScores, other: TokenScores, kl: bool = True) -> dict[str, dict[str, float]]:
    """``TokenScores.paired`` per domain (this row minus ``other`` on each domain's positions); {} for one text."""
    if len(scores.domains) < 2:
        return {}
    theirs = slices(other)
    return {name: s.paired(theirs[name], kl=kl) for name, s in slices(scores).items()}


_WORST = {"kld": max, "perplexity_change_pct": max, "top1_match": min}


def worst(domains: list[dict[str, Any]], key: str, pick: Callable[..., Any] | None = None) -> dict[str, Any] | None:
    """The domain whose ``key`` is worst by ``pick`` (``max`` or ``min``; by default the largest KL or perplexity
    change, the smallest top-1), or None; a domain whose value is not finite is the worst of all (it could not
    be measured, or it collapsed)."""
    if not domains:
        return None
    broken = [d for d in domains if not math.isfinite(d[key])]
    return broken[0] if broken else (pick or _WORST[key])(domains, key=lambda d: d[key])


__all__ = ["domain_rows", "paired_domains", "slices", "worst"]
