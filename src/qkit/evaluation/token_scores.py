"""A row's per-position values on the scored tokens, and the statistics over them (``TokenScores``).

Layer 6 (``evaluation``), below every reader of a row's values: the measures (``measures``), the domains of
an eval suite (``domains``), the pairing of rows (``pairing``) and the engines that produce them
(``perplexity.CorpusReference.score``, the worker engines' ``scoring``). The formulas::

    ppl    = exp(mean nll),   SE(ppl) = ppl * SE(mean nll)          (delta method, as mlx-lm reports it)
    change = exp(mean d) - 1, SE = exp(mean d) * SE(mean d),  d = nll - nll_ref per position (paired)
    KL     = mean KL_t,       top-1 = mean [argmax p == argmax q]

A standard error needs ``MIN_SCORED`` values; with fewer it is NaN, and every reader says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_SCORED = 2  # scored positions a standard error needs (the unbiased std divides by n - 1)


@dataclass
class TokenScores:
    """Per scored position: ``nll`` float64 [n], ``kl`` float64 [n], ``top1`` bool [n]."""

    nll: torch.Tensor
    kl: torch.Tensor
    top1: torch.Tensor
    # False when some log-probability was NaN (an overflowed row): its argmax, hence its top-1, means nothing
    measurable: bool = True
    # (name, positions) of each domain of an eval suite, in order (qkit.evaluation.domains); () for one text
    domains: tuple[tuple[str, int], ...] = ()

    @property
    def n(self) -> int:
        return int(self.nll.numel())

    @property
    def perplexity(self) -> float:
        return _exp(self.nll.mean().item())

    @property
    def perplexity_se(self) -> float:
        return self.perplexity * _se(self.nll)

    @property
    def kld(self) -> float:
        return self.kl.mean().item()

    @property
    def kld_se(self) -> float:
        return _se(self.kl)

    @property
    def top1_match(self) -> float:
        """The share of positions whose argmax is the reference's; NaN ("not measured") for a row whose
        log-probabilities were not all numbers."""
        return self.top1.double().mean().item() if self.measurable else math.nan

    def change_against(self, reference: TokenScores) -> tuple[float, float]:
        """Perplexity change vs ``reference`` in percent, with its paired standard error.

        Both score the same tokens, so the per-token difference ``d = nll - nll_ref`` gives the change
        ``exp(mean d) - 1`` and, by the delta method, SE ``exp(mean d) * SE(mean d)``; far tighter than
        comparing two independent perplexity SEs.
        """
        d = self.nll - reference.nll
        ratio = _exp(d.mean().item())
        return 100 * (ratio - 1), 100 * ratio * _se(d)

    def kl_change_against(self, other: TokenScores) -> tuple[float, float]:
        """Mean KL to the reference minus ``other``'s, with its paired standard error: both rows score the
        same positions against the same reference, so ``d = kl - kl_other`` per position."""
        d = self.kl - other.kl
        return d.mean().item(), _se(d)

    def paired(self, other: TokenScores, kl: bool = True) -> dict[str, float]:
        """This row minus ``other`` on the same positions, as ``Row.versus`` holds it: the perplexity change
        (``change_against``) and, with ``kl`` (both have the full distribution), the KL difference."""
        pct, pct_se = self.change_against(other)
        out = {"perplexity_change_pct": pct, "perplexity_change_se_pct": pct_se}
        if kl:
            out["kld_change"], out["kld_change_se"] = self.kl_change_against(other)
        return out


def _exp(x: float) -> float:
    # math.exp raises OverflowError past ~709; a collapsed row's mean NLL can get there: its perplexity is inf
    return math.exp(x) if x < 709.0 else math.inf


def _se(x: torch.Tensor) -> float:
    """Standard error of the mean; NaN when it does not exist (fewer than ``MIN_SCORED`` values): every
    reader (``qkit.evaluation.notes.interpret``, the table) says so instead of calling a NaN significant."""
    n = x.numel()
    return x.std(unbiased=True).item() / math.sqrt(n) if n >= MIN_SCORED else float("nan")


__all__ = ["MIN_SCORED", "TokenScores"]
