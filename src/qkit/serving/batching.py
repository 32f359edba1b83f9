"""Static against continuous batching, simulated over a queue of requests with known output lengths.

All requests are queued at time 0, in order; request ``i`` needs ``lengths[i]`` decode steps (one output
token per step). A server has ``slots`` sequences per batch, and one decode step over ``b`` sequences
costs ``cost(b)`` (measured by ``qkit bench``, given as a constant, or 1 "step" by default). Prefill is
not modelled.

* **Static**: requests are taken ``slots`` at a time; a batch runs ``max(lengths in batch)`` steps (the
  finished members are padding, still computed) and is returned as a whole when it ends, as a padded
  ``generate`` call returns; the next batch then starts.
* **Continuous**: every slot runs independently; when a request finishes, its slot takes the next
  queued request at the next step, and each step costs ``cost(number of busy slots)``.

Reported per policy: makespan, throughput ``sum(lengths) / makespan``, mean and p95 latency (time from
0 to the request's end; p95 by linear interpolation, ``numpy.percentile``'s default), and slot
utilisation (useful token-steps / slot-steps paid for).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qkit.errors import InputError

DEFAULT_REQUESTS = 64
DEFAULT_SLOTS = 8
DEFAULT_SEED = 0
# Output lengths: lognormal (skewed: many short answers, a long tail), median 128 tokens, clipped.
LENGTH_MEDIAN = 128
LENGTH_SIGMA = 1.0
LENGTH_MAX = 2048


@dataclass(frozen=True)
class StepCost:
    """Cost of one decode step over ``b`` sequences: linear interpolation between measured batch sizes.

    Below the smallest measured size the smallest's cost is used; above the largest the cost grows in
    proportion to ``b`` (no further batching gain is assumed). ``unit`` is ``"s"`` or ``"step"``.
    """

    batch_sizes: tuple[int, ...] = (1,)
    costs: tuple[float, ...] = (1.0,)
    unit: str = "step"
    source: str = "unit cost (1 step)"

    def __post_init__(self) -> None:
        if len(self.batch_sizes) != len(self.costs) or not self.costs or any(c <= 0 for c in self.costs):
            raise InputError("a step cost needs one positive cost per batch size")

    def __call__(self, b: int) -> float:
        top = self.batch_sizes[-1]
        if b > top and len(self.batch_sizes) > 1:
            return self.costs[-1] * b / top
        return float(np.interp(b, self.batch_sizes, self.costs))


def constant_cost(seconds: float) -> StepCost:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InputError(f"--step-ms must be a positive number of milliseconds (got {seconds * 1e3:g})")
    return StepCost((1,), (seconds,), "s", f"{seconds * 1e3:g} ms per step (given)")


def cost_from_bench(path: str | Path) -> StepCost:
    """The batching table of a ``qkit bench --json`` file: median step seconds per batch size."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["batching"]["rows"]
        pairs = sorted((int(r["batch"]), float(r["step_seconds"]["median"])) for r in rows)
    except FileNotFoundError:
        raise InputError(f"no such bench file: {path}; write one with qkit bench --json PATH") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} has no batching table ({exc}); pass the file written by qkit bench --json") from exc
    if not pairs:
        raise InputError(f"{path} has an empty batching table; re-run qkit bench")
    return StepCost(tuple(b for b, _ in pairs), tuple(c for _, c in pairs), "s", f"measured by qkit bench ({path})")


def draw_lengths(requests: int = DEFAULT_REQUESTS, seed: int = DEFAULT_SEED) -> list[int]:
    """``requests`` output lengths, lognormal with median ``LENGTH_MEDIAN`` and sigma ``LENGTH_SIGMA``,
    rounded up and clipped to ``[1, LENGTH_MAX]``; the same seed gives the same lengths."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mean=math.log(LENGTH_MEDIAN), sigma=LENGTH_SIGMA, size=requests)
    return np.clip(np.ceil(x), 1, LENGTH_MAX).astype(int).tolist()


def read_lengths(path: str | Path) -> list[int]:
    """Output lengths from a file: integers separated by whitespace or commas, or a JSON list."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(f"no such lengths file: {path}; pass a file of integers, one per line") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        lengths = [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path} must hold integer output lengths, one per line ({exc})") from exc
    return lengths


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    makespan: float
    throughput: float  # tokens per unit of time
    mean_latency: float
    p95_latency: float
    utilisation: float
    latencies: list[float]


def _summary(policy: str, lengths: np.ndarray, finish: np.ndarray, paid_slot_steps: float) -> PolicyResult:
    makespan = float(finish.max())
    return PolicyResult(
        policy, makespan, float(lengths.sum()) / makespan, float(finish.mean()),
        float(np.percentile(finish, 95)), float(lengths.sum()) / paid_slot_steps, finish.tolist(),
    )


def simulate_static(lengths: Sequence[int], slots: int, cost: StepCost) -> PolicyResult:
    L = np.asarray(lengths, dtype=np.int64)
    finish = np.zeros(len(L))
    t = 0.0
    paid = 0
    for start in range(0, len(L), slots):  # one iteration per batch
        batch = L[start : start + slots]
        t += int(batch.max()) * cost(len(batch))
        finish[start : start + slots] = t
        paid += int(batch.max()) * slots
    return _summary("static", L, finish, paid)


def simulate_continuous(lengths: Sequence[int], slots: int, cost: StepCost) -> PolicyResult:
    """Event-driven: between two request ends the busy count is constant, so whole runs of steps are
    taken at once (one loop iteration per finishing event, never one per step)."""
    L = np.asarray(lengths, dtype=np.int64)
    finish = np.zeros(len(L))
    remaining = np.zeros(slots, dtype=np.int64)
    owner = np.full(slots, -1)
    queue = 0
    t = 0.0
    paid = 0
    while True:
        free = np.flatnonzero(owner < 0)[: len(L) - queue]
        owner[free] = np.arange(queue, queue + len(free))
        remaining[free] = L[queue : queue + len(free)]
        queue += len(free)
        busy = owner >= 0
        if not busy.any():
            break
        k = int(remaining[busy].min())  # steps until the next request ends
        t += k * cost(int(busy.sum()))
        paid += k * slots
        remaining[busy] -= k
        done = busy & (remaining == 0)
        finish[owner[done]] = t
        owner[done] = -1
    return _summary("continuous", L, finish, paid)


@dataclass(frozen=True)
class BatchingReport:
    requests: int
    slots: int
    seed: int | None
    lengths_source: str
    lengths: list[int]
    cost: dict[str, Any]
    static: PolicyResult
    continuous: PolicyResult
    throughput_ratio: float  # continuous / static
    mean_latency_ratio: float  # static / continuous
    p95_latency_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulate_batching(
    *,
    requests: int = DEFAULT_REQUESTS,
    slots: int = DEFAULT_SLOTS,
    seed: int = DEFAULT_SEED,
    lengths: Sequence[int] | None = None,
    lengths_file: str | Path | None = None,
    cost: StepCost | None = None,
) -> BatchingReport:
    """Run both policies over the same requests and compare them (ratios > 1 favour continuous)."""
    if slots < 1:
        raise InputError(f"--slots must be at least 1 (got {slots})")
    if lengths_file is not None:
        lengths = read_lengths(lengths_file)
        source = str(lengths_file)
    elif lengths is not None:
        source = "given"
    else:
        if requests < 1:
            raise InputError(f"--requests must be at least 1 (got {requests})")
        lengths = draw_lengths(requests, seed)
        source = f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}, max {LENGTH_MAX}), seed {seed}"
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise InputError("output lengths must be positive integers, at least one request")
    cost = cost or StepCost()
    static = simulate_static(lengths, slots, cost)
    cont = simulate_continuous(lengths, slots, cost)
    return BatchingReport(
        len(lengths), slots, seed if lengths_file is None and source.startswith("lognormal") else None, source,
        lengths, asdict(cost), static, cont, cont.throughput / static.throughput,
        static.mean_latency / cont.mean_latency, static.p95_latency / cont.p95_latency,
    )
