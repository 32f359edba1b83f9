"""Timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def round_robin(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Time every ``fn`` once per round, ``repeats`` rounds (after one warm-up round), so that all rows
    see the same machine load; on a shared machine this matters more than anything else."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    return times
