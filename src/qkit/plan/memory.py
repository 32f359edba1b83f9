"""How much memory ``qkit plan`` needs, from the model's headers and config alone (before the model
loads), and the groups of targets whose Fisher is held at once so that a budget holds.

The Fisher of the targets inside the transformer blocks is measured by one walk down the blocks
(``qkit.plan.fisher_walk``), which holds one block's diagonal at a time; targets outside them (an
embedding, a head) by whole-model passes (``sensitivity.fisher_diagonal``), packed into groups. The plan's
peak, estimated (every term in bytes; ``a`` is the load dtype's item size, ``n`` the calibration windows
of ``T`` tokens, ``V`` the vocabulary, ``h``/``i``/``kv`` hidden, intermediate and key-value width, ``L``
the layers; see docs/plan-measurements.md, Memory, for the measurements that set the constants)::

    peak = baseline + weights + reference + kept + RETENTION * max(load, backward + gradient, candidates) + fisher(group)

    baseline    python, torch, transformers, qkit, the tokenizer (CPU only)          BASELINE
    weights     every stored tensor at the load dtype                                 a * sum(numel)
                (mixture of experts) and the expert tensors as stored: the loader     + sum(stored bytes of experts)
                reads them from the mapped file to stack each layer's into one
                fused parameter, and those pages stay mapped with the file (CPU)
    reference   the check windows' reference log-probabilities, kept for the check   4 * check_windows * T * V (CPU)
    kept        the walk's inputs of every block and window, and the gradients at    a * n * T * h * (L + 2)
                one block boundary
    load        the loader's transient: the largest stored tensor in its file dtype, twice
    backward    the walk: one block's forward saved for its backward pass, one       T * (16 h + 2 kv + 5 i) * a
                window, with one layer's attention scores (eager or math attention)  + 2 * heads * T^2 * 4
                or the top's logits chain (logits, float32 copy, log-softmax, grad)  (the larger of the two:
                                                                                      T * V * (a + 14))
                a whole-model pass (a group holding a target outside the blocks):    L * T * (16 h + 2 kv + 5 i) * a
                                                                                      + scores + logits chain
                (a mixture of experts: i is the widths of a token's top-k experts, and the shared expert's,
                where that is larger)
    gradient    one target's gradient while its square is added                      2 * a * largest target
                (an expert matrix's: its layer's fused parameter's, and the full-size   FUSED_GRADIENT * a * largest
                gradient each expert's slice reaches it through)                       fused parameter
    candidates  quantizing, dequantizing and costing the largest target              CANDIDATE_COPIES * 4 * largest target
    fisher      the group's float32 diagonal                                         4 * sum(numel of the group)

The coefficients are upper bounds fitted to measured peaks (``benchmarks/bench_plan_memory.py``,
``tests/test_memory_bounds.py``), not a derivation: the saved activations depend on the attention
kernel and on transformers' version. ``groups`` gives one group per block and the targets outside the
blocks packed, in layer order, into the fewest groups that fit; a budget below the peak of the largest
such group is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qkit.errors import InputError
from qkit.memory import gib
from qkit.methods.expert_storage import fused_numel
from qkit.methods.experts import routed_width
from qkit.methods.memory import BASELINE, QUANTIZE_COPIES, RETENTION, Dims, block_of

CANDIDATE_COPIES = QUANTIZE_COPIES  # candidate_cost's peak over the target's float32 size
# per token and layer, saved for the backward pass, in units of the load dtype: the norms' inputs and
# outputs, q/k/v and the rotated q/k, the attention output, the residuals (h and kv terms), the MLP's gate,
# up, activation and product (the i term). Measured on CPU with SDPA (flash: no T^2 scores), one backward
# pass over every layer (hidden 1024, intermediate 2816, 2-8 layers, T 256-2048, fp32 and bf16): 17-27 h
# units per layer, against 31.75 here; the logits' chain 12-13 bytes per logit against a + 14.
_PER_LAYER = (16, 2, 5)  # (h, kv, i)
_LOGITS_FP32 = 14  # bytes per logit beyond the model's own logits: float32 copy, log-softmax, exp, two grads
# An expert matrix's gradient over its fused parameter's size: the walk's backward pass through transformers'
# experts (grouped_mm over the whole fused parameter, through its transpose) computes that parameter's whole
# gradient, with full-size transients. Measured 2.45x on a 16-expert qwen3_moe (fused gate_up 134 MB fp32; 2-core
# Intel Xeon, AVX-512, torch 2.13, transformers 5.25): the walk's peak over the loaded model's resident memory,
# less one block's Fisher and the other terms; docs/moe.md.
FUSED_GRADIENT = 3


@dataclass(frozen=True)
class Estimate:
    """The terms of the plan's peak (bytes), from the headers and config; ``fisher`` per target, ``blocks``
    each target's transformer block (None: outside the blocks, measured by a whole-model pass)."""

    baseline: int
    weights: int
    reference: int
    kept: int
    load: int
    backward: int
    backward_model: int
    gradient: int
    candidates: int
    fisher: dict[str, int]
    blocks: dict[str, int | None]

    @property
    def fixed(self) -> int:
        """What the whole plan holds: the process, the model, the check's reference, the walk's kept inputs."""
        return self.baseline + self.weights + self.reference + self.kept

    def transient(self, group: Sequence[str] = ()) -> int:
        """The largest working set of one step while ``group`` is measured (the load, a backward pass, or a
        tensor's candidates), with what the allocator keeps of it (``RETENTION``): the walk's one block, or
        the whole model's pass for a group that holds a target outside the blocks."""
        backward = self.backward_model if any(self.blocks.get(t) is None for t in group) else self.backward
        return int(RETENTION * max(self.load, backward + self.gradient, self.candidates))

    def peak(self, group: Sequence[str]) -> int:
        """The estimated peak while ``group``'s diagonal is held."""
        return self.fixed + self.transient(group) + sum(self.fisher[t] for t in group)

    @property
    def minimum(self) -> int:
        """The least any budget must give: the peak of the largest group that cannot be split (a block's
        targets, or one target outside the blocks)."""
        return max((self.peak(g) for g in _finest(self)), default=self.fixed + self.transient())

    def to_dict(self) -> dict[str, int]:
        return {"baseline": self.baseline, "weights": self.weights, "reference": self.reference, "kept": self.kept,
                "load": self.load, "backward": self.backward, "backward_model": self.backward_model,
                "gradient": self.gradient, "candidates": self.candidates, "fisher_all": sum(self.fisher.values())}


def estimate(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype | None], config: Mapping,
             targets: Mapping[str, tuple[int, ...]], *, dtype: torch.dtype, samples: int, seqlen: int,
             check_windows: int, on_cpu: bool = True) -> Estimate:
    """The plan's peak terms (the module docstring's formula) for a model of stored ``shapes``/``dtypes``
    and ``config``, planning ``targets``, loaded in ``dtype``, with ``samples`` calibration windows of
    ``seqlen`` tokens of which ``check_windows`` are kept for the check. ``on_cpu`` False (a CUDA device):
    the baseline and the reference, which stay in host memory, are not counted against the device."""
    a = torch.empty((), dtype=dtype).element_size()
    numel = {n: math.prod(s) for n, s in shapes.items()}
    stored = {n: (dtypes.get(n) or torch.float32) for n in shapes}
    fused = fused_numel(shapes, config)  # {} for a dense model
    mapped = sum(numel[n] * stored[n].itemsize for n in fused) if on_cpu else 0  # host pages, not the device's
    weights = a * sum(numel[n] for n in shapes if stored[n].is_floating_point) + mapped
    largest_stored = max((numel[n] * stored[n].itemsize for n in shapes), default=0)
    largest_target = max((math.prod(s) for s in targets.values()), default=0)
    largest_fused = max((fused[n] for n in targets if n in fused), default=0)
    d = Dims.of(config, shapes)
    hidden, inter, layers, heads, kv, vocab = d.hidden, max(d.inter, routed_width(config)), d.layers, d.heads, d.kv, d.vocab
    ch, ckv, ci = _PER_LAYER
    layer = seqlen * (ch * hidden + ckv * kv + ci * inter) * a
    scores = 2 * heads * seqlen * seqlen * 4
    logits = seqlen * vocab * (a + _LOGITS_FP32)
    blocks = {n: block_of(n) for n in targets}
    walk = any(b is not None for b in blocks.values())
    return Estimate(
        baseline=BASELINE if on_cpu else 0,
        weights=weights,
        reference=4 * check_windows * seqlen * vocab if on_cpu else 0,
        kept=a * samples * seqlen * hidden * (layers + 2) if walk else 0,
        load=2 * largest_stored,
        backward=max(layer + scores, logits),
        backward_model=layers * layer + scores + logits,
        gradient=max(2 * a * largest_target, FUSED_GRADIENT * a * largest_fused),
        candidates=CANDIDATE_COPIES * 4 * largest_target,
        fisher={n: 4 * math.prod(s) for n, s in targets.items()},
        blocks=blocks,
    )


def layer_order(name: str) -> list[tuple[int, int | str]]:
    """A sort key that puts ``layers.2`` before ``layers.10``: the model's order."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name)]


def _by_block(est: Estimate) -> tuple[list[list[str]], list[str]]:
    """The targets inside the blocks, one list per block (in block order), and those outside, in layer order."""
    inside: dict[int, list[str]] = {}
    outside = []
    for name in sorted(est.fisher, key=layer_order):
        b = est.blocks.get(name)
        if b is None:
            outside.append(name)
        else:
            inside.setdefault(b, []).append(name)
    return [inside[b] for b in sorted(inside)], outside


def _finest(est: Estimate) -> list[list[str]]:
    blocks, outside = _by_block(est)
    return blocks + [[t] for t in outside]


def groups(est: Estimate, budget: int) -> list[list[str]]:
    """The groups of targets whose diagonals are held at once within ``budget``: each block's targets (the
    walk's unit: one block's diagonals at a time, never every target's), then the targets outside the
    blocks packed greedily, in layer order, into consecutive groups (one whole-model pass each). The caller
    has refused a budget below ``est.minimum``."""
    blocks, outside = _by_block(est)
    out: list[list[str]] = [[]]
    held = 0
    room = budget - est.fixed - est.transient(outside[:1])
    for name in outside:
        if out[-1] and held + est.fisher[name] > room:
            out.append([])
            held = 0
        out[-1].append(name)
        held += est.fisher[name]
    return blocks + (out if out[-1] else [])


def passes(group_list: Sequence[Sequence[str]], est: Estimate) -> int:
    """The passes over the calibration windows these groups take: one walk down the blocks for every
    target inside them, and one whole-model pass per group holding targets outside them."""
    inside = any(est.blocks.get(t) is not None for g in group_list for t in g)
    return int(inside) + sum(any(est.blocks.get(t) is None for t in g) for g in group_list)


@dataclass(frozen=True)
class MemoryPlan:
    """A budget (``given``: by ``--max-memory``, else the default from the memory available), the estimate,
    and the groups of targets whose Fisher is held at once within it."""

    budget: int
    given: bool
    estimate: Estimate
    groups: list[list[str]]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "budget_from": "--max-memory" if self.given else "available memory",
                "fisher": "walked block by block" if any(b is not None for b in self.estimate.blocks.values())
                else "whole-model passes",
                "groups": len(self.groups), "passes": passes(self.groups, self.estimate),
                "estimated_peak_bytes": max((self.estimate.peak(g) for g in self.groups), default=0),
                "estimate": self.estimate.to_dict()}


def plan_memory(est: Estimate, budget: int, *, given: bool, available: int | None = None, dtype: str = "fp32") -> MemoryPlan:
    """The groups for ``budget``; an ``InputError`` (one line) when even the largest target's group alone
    does not fit, naming what the estimate holds and what would help."""
    if budget < est.minimum:
        largest = max(_finest(est), key=est.peak, default=[])
        parts = (f"the model's weights {gib(est.weights)} in {dtype}, the check's reference {gib(est.reference)}, "
                 f"the blocks' inputs {gib(est.kept)}, the largest step's working set {gib(est.transient(largest))} "
                 f"(loading, a window's backward pass or a tensor's candidates, with what the allocator keeps), "
                 f"the largest group's Fisher {gib(sum(est.fisher[t] for t in largest))}, the process {gib(est.baseline)}")
        helps = ("pass --dtype bf16, fewer --calibration-samples or a shorter --calibration-seqlen, or " if dtype == "fp32"
                 else "pass fewer --calibration-samples or a shorter --calibration-seqlen, or ")
        if given:
            raise InputError(f"--max-memory {gib(budget)} is below the {gib(est.minimum)} this plan needs with one block's "
                             f"Fisher at a time ({parts}); {helps}raise --max-memory")
        raise InputError(f"this plan needs {gib(est.minimum)} with one block's Fisher at a time ({parts}), but only "
                         f"{gib(available or 0)} is available; {helps}free memory (--max-memory SIZE overrides the check)")
    return MemoryPlan(budget, given, est, groups(est, budget))


__all__ = ["CANDIDATE_COPIES", "FUSED_GRADIENT", "Estimate", "MemoryPlan", "estimate", "groups",
           "layer_order", "passes", "plan_memory"]
