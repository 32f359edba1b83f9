"""How much memory ``qkit plan`` needs, from the model's headers and config alone (before the model
loads), and the groups the Fisher is measured in so that a budget holds.

The plan's peak, estimated (every term in bytes; ``a`` is the load dtype's item size, ``T`` the
calibration window, ``V`` the vocabulary, ``h``/``i``/``kv`` hidden, intermediate and key-value width,
``L`` the layers; see docs/plan.md, Memory, for the measurements that set the constants)::

    peak = baseline + weights + reference + RETENTION * max(load, backward + gradient, candidates) + fisher(group)

    baseline    python, torch, transformers, qkit, the tokenizer (CPU only)          BASELINE
    weights     every stored tensor at the load dtype                                 a * sum(numel)
    reference   the check windows' reference log-probabilities, kept for the check   4 * check_windows * T * V (CPU)
    load        the loader's transient: the largest stored tensor in its file dtype, twice
    backward    one window's forward saved for its backward pass                      L * T * (16 h + 2 kv + 5 i) * a
                + the attention scores of one layer (eager or math attention)        + 2 * heads * T^2 * 4
                + the logits' chain (logits, float32 copy, log-softmax, its grad)    + T * V * (a + 14)
    gradient    one target's gradient while its square is added                      2 * a * largest target
    candidates  quantizing, dequantizing and costing the largest target              CANDIDATE_COPIES * 4 * largest target
    fisher      the group's float32 diagonal                                         4 * sum(numel of the group)

The coefficients are upper bounds fitted to measured peaks (``benchmarks/bench_plan_memory.py``,
``tests/test_memory_bounds.py``), not a derivation: the saved activations depend on the attention
kernel and on transformers' version. ``groups`` packs the targets, in layer order, into the fewest
groups whose peak fits a budget; a budget below the peak with the largest target alone is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qkit.errors import InputError
from qkit.memory import gib
from qkit.methods.memory import (  # re-exported: the plan's estimate is built on them
    BASELINE,
    HEADROOM,
    QUANTIZE_COPIES,
    RETENTION,
    Dims,
    default_budget,
)

CANDIDATE_COPIES = QUANTIZE_COPIES  # candidate_cost's peak over the target's float32 size
# per token and layer, saved for the backward pass, in units of the load dtype: the norms' inputs and
# outputs, q/k/v and the rotated q/k, the attention output, the residuals (h and kv terms), the MLP's gate,
# up, activation and product (the i term). Measured on CPU with SDPA (flash: no T^2 scores), one backward
# pass over every layer (hidden 1024, intermediate 2816, 2-8 layers, T 256-2048, fp32 and bf16): 17-27 h
# units per layer, against 31.75 here; the logits' chain 12-13 bytes per logit against a + 14.
_PER_LAYER = (16, 2, 5)  # (h, kv, i)
_LOGITS_FP32 = 14  # bytes per logit beyond the model's own logits: float32 copy, log-softmax, exp, two grads


@dataclass(frozen=True)
class Estimate:
    """The terms of the plan's peak (bytes), from the headers and config; ``fisher`` per target."""

    baseline: int
    weights: int
    reference: int
    load: int
    backward: int
    gradient: int
    candidates: int
    fisher: dict[str, int]

    @property
    def fixed(self) -> int:
        """What the whole plan holds: the process, the model, the check's reference."""
        return self.baseline + self.weights + self.reference

    @property
    def transient(self) -> int:
        """The largest working set of one step (the load, a backward pass, or a tensor's candidates), with
        what the allocator keeps of it (``RETENTION``)."""
        return int(RETENTION * max(self.load, self.backward + self.gradient, self.candidates))

    def peak(self, group: Sequence[str]) -> int:
        """The estimated peak while ``group``'s diagonal is held."""
        return self.fixed + self.transient + sum(self.fisher[t] for t in group)

    @property
    def minimum(self) -> int:
        """The least any budget must give: the largest target's diagonal alone."""
        return self.fixed + self.transient + max(self.fisher.values(), default=0)

    def to_dict(self) -> dict[str, int]:
        return {"baseline": self.baseline, "weights": self.weights, "reference": self.reference, "load": self.load,
                "backward": self.backward, "gradient": self.gradient, "candidates": self.candidates,
                "fisher_all": sum(self.fisher.values())}


def estimate(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype | None], config: Mapping,
             targets: Mapping[str, tuple[int, ...]], *, dtype: torch.dtype, seqlen: int, check_windows: int,
             on_cpu: bool = True) -> Estimate:
    """The plan's peak terms (the module docstring's formula) for a model of stored ``shapes``/``dtypes``
    and ``config``, planning ``targets``, loaded in ``dtype``, with calibration windows of ``seqlen`` tokens
    of which ``check_windows`` are kept for the check. ``on_cpu`` False (a CUDA device): the baseline and
    the reference, which stay in host memory, are not counted against the device."""
    a = torch.empty((), dtype=dtype).element_size()
    numel = {n: math.prod(s) for n, s in shapes.items()}
    stored = {n: (dtypes.get(n) or torch.float32) for n in shapes}
    weights = a * sum(numel[n] for n in shapes if stored[n].is_floating_point)
    largest_stored = max((numel[n] * stored[n].itemsize for n in shapes), default=0)
    largest_target = max((math.prod(s) for s in targets.values()), default=0)
    d = Dims.of(config, shapes)
    hidden, inter, layers, heads, kv, vocab = d.hidden, d.inter, d.layers, d.heads, d.kv, d.vocab
    ch, ckv, ci = _PER_LAYER
    backward = (layers * seqlen * (ch * hidden + ckv * kv + ci * inter) * a + 2 * heads * seqlen * seqlen * 4
                + seqlen * vocab * (a + _LOGITS_FP32))
    return Estimate(
        baseline=BASELINE if on_cpu else 0,
        weights=weights,
        reference=4 * check_windows * seqlen * vocab if on_cpu else 0,
        load=2 * largest_stored,
        backward=backward,
        gradient=2 * a * largest_target,
        candidates=CANDIDATE_COPIES * 4 * largest_target,
        fisher={n: 4 * math.prod(s) for n, s in targets.items()},
    )


def layer_order(name: str) -> list[tuple[int, int | str]]:
    """A sort key that puts ``layers.2`` before ``layers.10``: the model's order, so that a later group's
    backward pass stops at its first layer."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name)]


def groups(est: Estimate, budget: int) -> list[list[str]]:
    """The targets in layer order, packed greedily into consecutive groups whose estimated peak is within
    ``budget`` (one group when everything fits). The caller has refused a budget below ``est.minimum``."""
    out: list[list[str]] = [[]]
    held = 0
    room = budget - est.fixed - est.transient
    for name in sorted(est.fisher, key=layer_order):
        if out[-1] and held + est.fisher[name] > room:
            out.append([])
            held = 0
        out[-1].append(name)
        held += est.fisher[name]
    return out if out[-1] else []


@dataclass(frozen=True)
class MemoryPlan:
    """A budget (``given``: by ``--max-memory``, else the default from the memory available), the estimate,
    and the Fisher's groups that honour it."""

    budget: int
    given: bool
    estimate: Estimate
    groups: list[list[str]]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "budget_from": "--max-memory" if self.given else "available memory",
                "groups": len(self.groups), "estimated_peak_bytes": max((self.estimate.peak(g) for g in self.groups), default=0),
                "estimate": self.estimate.to_dict()}


def plan_memory(est: Estimate, budget: int, *, given: bool, available: int | None = None, dtype: str = "fp32") -> MemoryPlan:
    """The groups for ``budget``; an ``InputError`` (one line) when even the largest target's group alone
    does not fit, naming what the estimate holds and what would help."""
    if budget < est.minimum:
        parts = (f"the model's weights {gib(est.weights)} in {dtype}, one window's backward pass {gib(est.backward)}, "
                 f"the largest tensor's Fisher {gib(max(est.fisher.values(), default=0))}, the process {gib(est.baseline)}")
        helps = "pass --dtype bf16, a shorter --calibration-seqlen, or " if dtype == "fp32" else "pass a shorter --calibration-seqlen or "
        if given:
            raise InputError(f"--max-memory {gib(budget)} is below the {gib(est.minimum)} this plan needs with one tensor's "
                             f"Fisher at a time ({parts}); {helps}raise --max-memory")
        raise InputError(f"this plan needs {gib(est.minimum)} with one tensor's Fisher at a time ({parts}), but only "
                         f"{gib(available or 0)} is available; {helps}free memory (--max-memory SIZE overrides the check)")
    return MemoryPlan(budget, given, est, groups(est, budget))


__all__ = ["BASELINE", "CANDIDATE_COPIES", "HEADROOM", "RETENTION", "Estimate", "MemoryPlan", "default_budget", "estimate", "groups", "layer_order", "plan_memory"]
