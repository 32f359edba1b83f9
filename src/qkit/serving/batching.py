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

from qkit import reading
from qkit.bounds import real, show_number, whole
from qkit.errors import InputError
from qkit.threads import available_memory

DEFAULT_REQUESTS = 64
DEFAULT_SLOTS = 8
DEFAULT_SEED = 0
# Output lengths: lognormal (skewed: many short answers, a long tail), median 128 tokens, clipped.
LENGTH_MEDIAN = 128
LENGTH_SIGMA = 1.0
LENGTH_MAX = 2048
# Upper bounds, checked before anything is drawn, read or simulated. The simulation takes one event step
# per request (~10 us) and holds about 400 bytes per request at its peak (the lengths, two finish times,
# their Python lists in the report and its JSON; measured: 100,000 requests add 38 MB of RSS and 1.7 s):
# 10 million requests are minutes of work and about 4 GB. A length is at most 2**53 steps (an exact float).
MAX_REQUESTS = 10_000_000
MAX_SEED = 2**64 - 1  # numpy's generators take any 64-bit seed
MIN_STEP_MS, MAX_STEP_MS = 1e-6, 1e9  # a nanosecond to 11 days per decode step: the times stay finite and printable
BYTES_PER_REQUEST = 512
MAX_LENGTH = 2**53


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
        if (len(self.batch_sizes) != len(self.costs) or not self.costs
                or not all(c > 0 and math.isfinite(c) for c in self.costs)
                or any(b < 1 for b in self.batch_sizes) or len(set(self.batch_sizes)) != len(self.batch_sizes)):
            raise InputError("a step cost needs one positive, finite cost per distinct batch size of at least 1")

    def __call__(self, b: int) -> float:
        top = self.batch_sizes[-1]
        if b > top and len(self.batch_sizes) > 1:
            return self.costs[-1] * b / top
        return float(np.interp(b, self.batch_sizes, self.costs))


def constant_cost(seconds: float) -> StepCost:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InputError(f"--step-ms must be a positive number of milliseconds (got {seconds * 1e3:g})")
    real(seconds * 1e3, "--step-ms", MIN_STEP_MS, MAX_STEP_MS)
    return StepCost((1,), (seconds,), "s", f"{seconds * 1e3:g} ms per step (given)")


def cost_from_bench(path: str | Path) -> StepCost:
    """The batching table of a ``qkit bench --json`` file: median step seconds per batch size."""
    text = _read_text(path, "bench file", "write one with qkit bench --json PATH")
    try:
        data = json.loads(text)
        rows = data["batching"]["rows"]
        pairs = sorted((r["batch"], float(r["step_seconds"]["median"])) for r in rows)
        if any(isinstance(b, bool) or not isinstance(b, int) for b, _ in pairs):
            raise ValueError("a batch size is not an integer")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise InputError(f"{path} has no batching table ({exc}); pass the file written by qkit bench --json") from exc
    if not pairs:
        raise InputError(f"{path} has an empty batching table; re-run qkit bench")
    try:
        return StepCost(tuple(b for b, _ in pairs), tuple(c for _, c in pairs), "s", f"measured by qkit bench ({path})")
    except InputError as exc:
        raise InputError(f"{path}: {exc}; pass the file written by qkit bench --json") from None


def _read_text(path: str | Path, what: str, fix: str, max_bytes: int | None = None) -> str:
    """A UTF-8 file's text, or one line: missing, unreadable (permission, a directory), larger than
    ``max_bytes``, or not UTF-8."""
    p = Path(path)
    try:  # a FIFO or a device is refused before it is opened (qkit.reading)
        if reading.check_file(p, f"{what} {path}", fix).st_size > (max_bytes or reading.MAX_TEXT_BYTES):
            raise InputError(f"{what} {path} is larger than {max_bytes or reading.MAX_TEXT_BYTES:,} bytes"
                             + (f" (more than {MAX_REQUESTS:,} requests)" if max_bytes else "") + f"; {fix}")
        return reading.read_text(p, f"{what} {path}", fix, limit=max_bytes or reading.MAX_TEXT_BYTES)
    except FileNotFoundError:
        raise InputError(f"no such {what}: {path}; {fix}") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory; {fix}") from None
    except PermissionError:
        raise InputError(f"{what} {path}: permission denied; make it readable or {fix}") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path} ({exc.strerror or exc}); {fix}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path} is not UTF-8 text ({exc.reason}); {fix}") from None


def check_requests(requests: int, what: str = "--requests") -> None:
    """Refuse a request count the simulation cannot take: below 1, above ``MAX_REQUESTS``, or more than the
    memory free holds at ``BYTES_PER_REQUEST`` each (``qkit.threads.available_memory``)."""

    if requests < 1:
        raise InputError(f"{what} must be at least 1 (got {requests})")
    if requests > MAX_REQUESTS:
        raise InputError(
            f"{what} {show_number(requests)} is more than the simulation takes ({MAX_REQUESTS:,}: one event step and about "
            f"{BYTES_PER_REQUEST} bytes per request); pass at most {MAX_REQUESTS:,} requests"
        )
    free = available_memory()
    if free is not None and requests * BYTES_PER_REQUEST > free:
        raise InputError(
            f"{what} {requests:,} needs about {requests * BYTES_PER_REQUEST / 2**30:,.1f} GiB ({BYTES_PER_REQUEST} bytes per "
            f"request), more than the {free / 2**30:,.1f} GiB free; pass at most {free // BYTES_PER_REQUEST:,} requests"
        )


def draw_lengths(requests: int = DEFAULT_REQUESTS, seed: int = DEFAULT_SEED) -> list[int]:
    """``requests`` output lengths, lognormal with median ``LENGTH_MEDIAN`` and sigma ``LENGTH_SIGMA``,
    rounded up and clipped to ``[1, LENGTH_MAX]``; the same seed gives the same lengths."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mean=math.log(LENGTH_MEDIAN), sigma=LENGTH_SIGMA, size=requests)
    return np.clip(np.ceil(x), 1, LENGTH_MAX).astype(int).tolist()


def read_lengths(path: str | Path) -> list[int]:
    """Output lengths from a file: integers separated by whitespace or commas, or a JSON list."""
    # Each length is at least 2 bytes of text ("1\n"): a larger file holds more than MAX_REQUESTS of them.
    text = _read_text(path, "lengths file", "pass a file of integers, one per line", max_bytes=24 * MAX_REQUESTS)
    try:
        if text.lstrip().startswith("["):
            values = json.loads(text)
            # JSON numbers must be integers already: 1.5 or true is not a length (int() would cut or cast it)
            if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise ValueError("a JSON list of integers is needed")
            lengths = values
        else:
            lengths = [int(v) for v in text.replace(",", " ").split()]
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path} must hold integer output lengths, one per line ({str(exc)[:80]})") from exc
    check_requests(len(lengths), f"lengths file {path}: its number of requests")
    if lengths and max(lengths) > MAX_LENGTH:
        raise InputError(f"{path}: output length {max(lengths):,} is more than {MAX_LENGTH:,} steps; pass shorter lengths")
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
    # Slots beyond the number of requests never hold one: arrays of min(slots, n) (a huge --slots allocates
    # nothing), while the slot-steps paid for still count every slot.
    width = min(slots, len(L))
    remaining = np.zeros(width, dtype=np.int64)
    owner = np.full(width, -1)
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
    if seed < 0:
        raise InputError(f"--seed must be a non-negative integer (got {seed})")
    whole(slots, "--slots", 1, MAX_REQUESTS)  # more slots than requests change nothing; a 309-digit count overflowed
    whole(seed, "--seed", 0, MAX_SEED)
    if lengths_file is not None:
        lengths = read_lengths(lengths_file)
        source = str(lengths_file)
    elif lengths is not None:
        source = "given"
    else:
        check_requests(requests)
        lengths = draw_lengths(requests, seed)
        source = f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}, max {LENGTH_MAX}), seed {seed}"
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise InputError("output lengths must be positive integers, at least one request")
    if max(lengths) > MAX_LENGTH:
        raise InputError(f"output length {max(lengths):,} is more than {MAX_LENGTH:,} steps; pass shorter lengths")
    cost = cost or StepCost()
    static = simulate_static(lengths, slots, cost)
    cont = simulate_continuous(lengths, slots, cost)
    return BatchingReport(
        len(lengths), slots, seed if lengths_file is None and source.startswith("lognormal") else None, source,
        lengths, asdict(cost), static, cont, cont.throughput / static.throughput,
        static.mean_latency / cont.mean_latency, static.p95_latency / cont.p95_latency,
    )
