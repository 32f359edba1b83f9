"""Small statistics the quality table reports: Wilson intervals, exact McNemar, mean with standard error."""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion ``k/n`` (Wilson, 1927); ``(0, 1)`` for ``n = 0``."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> tuple[int, int, float]:
    """Exact McNemar test on paired binary outcomes.

    Returns ``(only_a, only_b, p)``: the discordant counts and the two-sided exact p-value, i.e. the
    binomial test of ``only_a`` out of ``only_a + only_b`` at 1/2 (``p = 1`` with no discordant pair).
    """
    if len(a) != len(b):
        raise ValueError("paired outcomes must have equal length")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    n = only_a + only_b
    if n == 0:
        return only_a, only_b, 1.0
    from scipy.stats import binomtest

    return only_a, only_b, float(binomtest(only_a, n, 0.5).pvalue)
