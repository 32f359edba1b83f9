"""The planner: measured sensitivity, the exact solver, and the plan they give, for a byte budget.

Steps (``qkit.api.plan_model`` runs them), each a function a script can call:

1. **Targets**: the tensors the transform quantizes (``qkit.transform.Rules``: the block projections,
   with ``--include``/``--exclude``; for ``--target-scheme RECIPE`` in a format that stores llama.cpp's
   types, also what the recipe's whole file quantizes, ``token_embd`` and ``output``). **The budget is the
   whole file's tensors** (``qkit.plan.budget``): ``--target-size`` and ``--target-scheme`` name the file's
   bytes, and the tensors outside the plan (kept as they are: the embedding of a plan of the projections,
   the norms) count against it; ``--target-bits B`` is ``floor(B * weights / 8)`` bytes over the planned
   tensors alone, as every table's bits per weight counts them. A mixture-of-experts model's targets are
   its expert matrices as the checkpoint stores them, one tensor each (docs/moe.md); its router is never
   one (``transform.is_router``).
2. **Candidates** per tensor: the format's ladder that the tensor's shape takes natively
   (``candidates.candidates``), optionally restricted (``--candidates``).
3. **Sensitivity**: the diagonal Fisher of the reference's output distribution on calibration windows
   (``sensitivity.fisher_diagonal``), and per tensor and candidate the predicted KL of storing that one
   tensor so (``sensitivity.candidate_cost``), from exactly the codes the file would hold. An expert
   matrix's diagonal is its slice of the fused parameter transformers holds a layer's experts in
   (``methods.experts.expert_slices``, ``fisher_walk``'s ``views``); an expert no calibration token reached
   has a zero Fisher, every candidate priced 0, and the plan lists it (``experts_record``). For a plan
   GPTQ will write (``--method gptq``), each cost is then scaled by GPTQ's held-out output error over
   RTN's for that tensor and type (``qkit.plan.feedback``).
4. **Solve**: the multiple-choice knapsack, exact by DP over bytes (``solve.solve``): minimal summed
   predicted KL within the budget.
5. **Check**: the chosen mix swapped into the model (GPTQ's weights for a GPTQ plan) and its KL measured
   on calibration windows, beside the prediction (the solver assumes costs add; this says how far they do).

Nothing is kept between calls unless the caller passes one ``KeptMeasurements`` (created per run, e.g. one
per eval): then the sensitivity table (steps 1-3) is kept for the last model, format, candidates and
calibration, so a frontier of budgets measures it once; and the loaded model, its labels and the check's
reference for the last model and calibration, so a plan for another format or candidate set walks the
Fisher again without loading the model.

Memory: the model, one block's float32 Fisher (the walk down the blocks, ``qkit.plan.fisher_walk``), the
blocks' kept inputs and one block's backward pass at a time (``memory_plan``, ``qkit.plan.memory``);
``PlanOptions.max_memory`` (``--max-memory``) bounds it, and a budget too small even for one block's
group is refused before the model loads.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from qkit.checkpoint import (
    tensor_reader,
    tensor_dtypes,
    tensor_shapes,
)
from qkit.errors import InputError
from qkit.executors import SERIAL_EXECUTOR, Executor
from qkit.methods.calibration import calibration_ids, check_fits
from qkit.dtypes import LOAD_DTYPES, non_finite_activations
from qkit.models import ModelRef, load, load_tokenizer, read_config
from qkit.methods.experts import LAYOUTS, expert_slices, layout_for
from qkit.methods.gptq.method import GPTQOptions
from qkit.plan import feedback
from qkit.plan.candidates import (
    KEEP,
    Candidate,
    candidates,
    check_format,
    ladder,
    plan_format,
    parse_allowed,
    stored_nbytes,
)
from qkit.plan.budget import check_budget, file_budget
from qkit.plan.costing import file_tensors, candidate_weights, costs_elsewhere
from qkit.plan.memory import (
    MemoryPlan,
    estimate,
    groups,
    layer_order,
    plan_memory,
)
from qkit.methods.memory import default_budget
from qkit.plan.options import DEFAULT_DTYPE, PlanOptions
from qkit.plan.planfile import Plan, TensorChoice
from qkit.plan.checking import check_mix
from qkit.plan.fisher_walk import block_targets, fisher_by_blocks
from qkit.plan.sensitivity import Fisher, candidate_cost, fisher_diagonal
from qkit.plan.solve import solve, tied_items
from qkit.schemes import get_scheme
from qkit.schemes.recipes import expert_count
from qkit.transform import Rules, shapes_fingerprint
from qkit.version import __version__

ESTIMATOR = "fisher-diagonal"


@dataclass
class Table:
    """The measured sensitivity: per target ``names[i]``, its candidates and their predicted costs."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    options: list[list[Candidate]]
    costs: list[list[float]]
    lossless: list[list[bool]]
    calibration: dict
    positions: int
    fisher: object = field(repr=False, default=None)  # sensitivity.Fisher: the check's reference windows
    model: object = field(repr=False, default=None)  # the loaded reference, for the check
    dtypes: dict = field(default_factory=dict)  # each planned tensor's source dtype
    seconds: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # the memory plan: budget, groups, estimated peak (MemoryPlan.to_dict)
    ids: object = field(repr=False, default=None)  # the calibration windows (int64 [n, w])
    gptq: GPTQOptions | None = None  # costs for GPTQ's codes (feedback): the options they were measured with
    feedback: dict = field(default_factory=dict)  # feedback.output_error_ratios' record
    # a mixture-of-experts model: each planned expert matrix's slice of a fused parameter (experts.expert_slices)
    views: dict = field(default_factory=dict)
    unreached: list = field(default_factory=list)  # the experts whose every planned matrix has a zero Fisher

    @property
    def weights(self) -> int:
        return sum(math.prod(self.shapes[n]) for n in self.names)


@dataclass
class KeptMeasurements:
    """What one run's plans share (created per run and passed explicitly; no module state): the sensitivity
    tables of the last model (``tables``, by their inputs) and the last model's measurement (``fisher``: its
    loaded model, labels and calibration record; one entry, so never two models at once)."""

    tables: dict[tuple, Table] = field(default_factory=dict)
    fisher: dict[tuple, _Measured] = field(default_factory=dict)

    def forget(self) -> None:
        """Drop the kept model and tables (a check that could not restore the weights)."""
        self.fisher.clear()
        self.tables.clear()


def planned_targets(ref: ModelRef, options: PlanOptions) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the tensors a plan chooses for (the transform's targets), in file order."""
    shapes = tensor_shapes(ref.directory)
    rules = Rules(tuple(options.include), tuple(options.exclude))
    rules.check_matches((n for n, _ in shapes), ref.spec)  # a glob that matches no tensor: a typo, refused
    # a recipe's bytes in a format of llama.cpp's types: the tensors its whole file quantizes (token_embd, output)
    whole = options.target_scheme is not None and plan_format(options.format).stores_llama_types
    default = get_scheme(options.target_scheme) if whole else object()
    chosen = {n: s for n, s in shapes if rules.scheme_for(n, tuple(s), default) is not None}  # type: ignore[arg-type]
    if not chosen:
        raise InputError(f"no tensor of {ref.spec} matches the plan's rules; check --include/--exclude")
    bad = [n for n, s in chosen.items() if len(s) != 2]
    if bad:
        raise InputError(f"{bad[0]} is not a 2-D matrix; --exclude it from the plan")
    return chosen


def _fisher_key(ref: ModelRef, options: PlanOptions, targets: Mapping[str, tuple[int, ...]], device) -> tuple:
    return (str(ref.directory), tuple(targets), options.calibration_options(), options.windows_checked, str(device),
            options.dtype)


def memory_plan(ref: ModelRef, options: PlanOptions, device: torch.device | str | None = None,
                kept: KeptMeasurements | None = None) -> MemoryPlan:
    """The plan's memory, from the headers and config alone (before the model loads): its estimated peak
    (``qkit.plan.memory``) and the Fisher's groups for ``options.max_memory``, else for a default budget
    from the memory available on ``device`` (None: the CPU). Refuses, in one line, a budget below what the
    largest tensor's group alone needs. For a model already loaded by an earlier plan (same targets,
    calibration, dtype, device) without ``max_memory`` and kept in ``kept``, the groups chosen then."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    targets = planned_targets(ref, options)
    cached = kept.fisher.get(_fisher_key(ref, options, targets, dev)) if kept is not None else None
    if cached is not None and options.max_memory is None:
        return cached.memory
    est = estimate(dict(tensor_shapes(ref.directory)), tensor_dtypes(ref.directory), read_config(ref.directory), targets,
                   dtype=LOAD_DTYPES[options.dtype], samples=options.samples, seqlen=options.window,
                   check_windows=options.windows_checked,
                   on_cpu=dev.type == "cpu")
    if options.max_memory is not None:
        return plan_memory(est, options.max_memory, given=True, dtype=options.dtype)
    budget, available = default_budget(dev)
    if budget is None:  # nothing tells the memory available: one group, as if it all fits
        return MemoryPlan(est.peak(list(est.fisher)), False, est, groups(est, est.peak(list(est.fisher))))
    return plan_memory(est, budget, given=False, available=available, dtype=options.dtype)


@dataclass
class _Measured:
    """The last model's measurement: its first pass (check windows, labels; no diagonal: each was freed once
    its candidates were costed), the loaded model, the calibration record and ids, the memory plan."""

    fisher: Fisher
    model: object
    provenance: dict
    ids: torch.Tensor
    memory: MemoryPlan


def sensitivity_table(
    ref: ModelRef,
    options: PlanOptions,
    *,
    device: torch.device,
    quant_weights: Mapping[str, torch.Tensor] | None = None,
    imatrix_key: str | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
    gptq: GPTQOptions | None = None,
    executor: Executor = SERIAL_EXECUTOR,
    kept: KeptMeasurements | None = None,
) -> Table:
    """Steps 1-3 of the module docstring (kept in ``kept`` for the same inputs; None: nothing kept). ``quant_weights``: per tensor, the
    importance weights llama.cpp's types quantize with (``--imatrix``), identified by ``imatrix_key``.
    ``gptq``: price the candidates for the codes GPTQ with these options writes (``qkit.plan.feedback``:
    each Fisher cost scaled by GPTQ's output-error ratio to RTN's; one more pass over the blocks).

    Memory (``memory_plan``): the targets inside the transformer blocks are measured by one walk down the
    blocks (``qkit.plan.fisher_walk``): each block's candidates are costed as soon as its diagonal is
    complete, and the diagonal freed before the next block's. Targets outside the blocks (an embedding, a
    head) take a whole-model pass per group that fits the budget, with the labels the first pass sampled
    (every target gets exactly the value one pass over all would give). No diagonal outlives its costs: a
    plan of the same model for another format or candidate set walks again, with the loaded model, the
    labels and the check's reference kept.

    ``executor`` (``qkit.executors``; ``--executor ray``): each block's (or group's) candidate costs,
    computed in other processes, one task per tensor (``costs_elsewhere``), the same numbers; the GPTQ
    feedback stays here."""
    fmt = check_format(options.format)
    targets = planned_targets(ref, options)
    allowed = parse_allowed(fmt, options.candidates) if options.candidates else None
    key = (str(ref.directory), fmt, allowed, tuple(options.include), tuple(options.exclude), options.scale_dtype,
           options.calibration_options(), options.windows_checked, imatrix_key, str(device), options.dtype,
           None if gptq is None else tuple(sorted(feedback.record(gptq).items())))
    kept = kept if kept is not None else KeptMeasurements()
    if key in kept.tables:
        return kept.tables[key]
    opts = candidate_sets(ref, options)
    cal = options.calibration_options()
    say = on_step or (lambda *_: None)
    fkey = _fisher_key(ref, options, targets, device)
    mem = memory_plan(ref, options, device, kept)  # refused here, before the model loads, when nothing fits
    t0 = time.perf_counter()
    measured = kept.fisher.get(fkey)
    if measured is None:
        # the text (overlap with the eval text, too short) is refused before the model loads
        ids, provenance = calibration_ids(load_tokenizer(ref.directory), cal)
        kept.forget()  # an earlier model is let go before this one loads: never two models at once
        loaded = load(ref=ref, device=device, dtype=LOAD_DTYPES[options.dtype])
        check_fits(cal, loaded.model.config)
        model = loaded.model
        del loaded
        first = None
    else:  # another format or candidate set of the same model: the Fisher does not depend on them
        model, provenance, ids, first = measured.model, measured.provenance, measured.ids, measured.fisher
    weights = dict(quant_weights or {})
    by_name: dict[str, tuple[list[float], list[bool]]] = {}
    t_costs = [0.0]
    # a mixture-of-experts model's expert matrices: slices of the fused parameters transformers holds
    views = {t: v for t, v in expert_slices(model, read_config(ref.directory)).items() if t in targets}
    zero: list[str] = []  # the expert matrices whose Fisher diagonal is zero: no calibration token reached them

    def cost_group(diag: Mapping[str, torch.Tensor]) -> None:
        """The candidates of ``diag``'s targets, costed now (here or as executor tasks); the diagonals are
        freed with ``diag`` once the caller drops it."""
        t = time.perf_counter()
        names = [n for n in targets if n in diag]
        zero.extend(n for n in names if n in views and not bool(diag[n].any()))
        if executor.parallel:  # each tensor's candidates a task of their own, reading the files (costs_elsewhere)
            costed_all = costs_elsewhere(executor, ref.directory, names, diag, opts, weights)
        else:
            costed_all = ((name, [candidate_cost(w, diag[name], c.scheme, name=name,
                                                 quant_weights=candidate_weights(weights, name, c)) for c in opts[name]])
                          for name, w in file_tensors(ref.directory, set(names), str(device)))
        for name, costed in costed_all:
            by_name[name] = ([c for c, _ in costed], [x for _, x in costed])
            say("candidates", len(by_name), len(targets))
        t_costs[0] += time.perf_counter() - t

    t1 = time.perf_counter()
    _, outside = block_targets(model, list(targets))
    walked = [t for t in targets if t not in set(outside)]
    outside_groups = [g for g in ([t for t in group if t in set(outside)] for group in mem.groups) if g]
    n = int(ids.shape[0])
    if walked:  # one walk down the blocks for every target inside them (qkit.plan.fisher_walk)
        walk = fisher_by_blocks(model, ids, walked, cost_group, views=views, seed=options.seed,
                                check_windows=options.windows_checked if first is None else 0,
                                labels=None if first is None else first.labels,
                                on_step=lambda i, k: say("fisher", i, k + len(outside_groups) * n))
        first = first or walk
    for k, group in enumerate(outside_groups):  # an embedding, a head: whole-model passes, the same labels
        fisher = fisher_diagonal(model, ids, group, seed=options.seed,
                                 check_windows=options.windows_checked if first is None else 0,
                                 labels=None if first is None else first.labels,
                                 on_window=lambda i, _n, k=k: say("fisher", k * n + i, len(outside_groups) * n))
        first = first or fisher
        cost_group(fisher.diag)
        fisher.diag.clear()
    t_fisher = time.perf_counter() - t1 - t_costs[0]  # the walk and passes, without the candidates costed inside them
    assert first is not None
    if measured is None:
        kept.fisher[fkey] = _Measured(first, model, provenance, ids, mem)
    names = list(targets)
    record: dict = {}
    t_gptq = 0.0
    if gptq is not None:  # the RTN costs scaled by GPTQ's output-error ratio (qkit.plan.feedback)
        t2 = time.perf_counter()
        ratios, record = feedback.output_error_ratios(
            model, ids, opts, tensor_reader(ref.directory, targets, str(device)), gptq=gptq,
            quant_weights=lambda n, c: candidate_weights(weights, n, c), device=torch.device(device),
            on_tensor=lambda i, k: say("gptq", i, k))
        for n in names:
            costs, lossless = by_name[n]
            by_name[n] = ([0.0 if free else cost * r for cost, free, r in zip(costs, lossless, ratios[n])], lossless)
        t_gptq = time.perf_counter() - t2
    table = Table(names, targets, [opts[n] for n in names], [by_name[n][0] for n in names],
                  [by_name[n][1] for n in names], provenance, first.positions, first, model,
                  dtypes={n: d for n, d in tensor_dtypes(ref.directory).items() if n in targets},
                  seconds={"fisher": round(t_fisher, 3), "candidates": round(time.perf_counter() - t0 - t_fisher - t_gptq, 3),
                           **({"gptq": round(t_gptq, 3)} if gptq is not None else {})},
                  memory={**mem.to_dict(), "dtype": options.dtype}, ids=ids, gptq=gptq,
                  feedback=record, views=views, unreached=unreached_experts(views, zero))
    kept.tables[key] = table
    return table


def _expert(matrix: str) -> str:
    """The expert a stored expert matrix belongs to: ``...experts.3.gate_proj.weight`` -> ``...experts.3``."""
    return matrix.rsplit(".", 2)[0]


def unreached_experts(views: Mapping[str, tuple[str, tuple]], zero: Sequence[str]) -> list[str]:
    """The experts (``model.layers.0.mlp.experts.3``) whose every planned matrix of ``views`` is in ``zero``
    (a zero Fisher diagonal), in layer order."""
    zeros = set(zero)
    return sorted({_expert(t) for t in views} - {_expert(t) for t in views if t not in zeros}, key=layer_order)


def candidate_sets(ref: ModelRef, options: PlanOptions) -> dict[str, list[Candidate]]:
    """Step 2 from the headers alone: ``{target: its candidates}`` in file order."""
    fmt = check_format(options.format)
    allowed = parse_allowed(fmt, options.candidates) if options.candidates else None
    dtypes = tensor_dtypes(ref.directory)
    return {n: candidates(fmt, tuple(s), dtypes[n] or torch.float32, allowed=allowed, scale_dtype=options.scale_dtype)
            for n, s in planned_targets(ref, options).items()}


def precheck(ref: ModelRef, options: PlanOptions, config: Mapping | None = None,
             device: torch.device | str | None = None, kept: KeptMeasurements | None = None) -> int:
    """Everything the headers decide, before any model work: the byte budget against the smallest and the
    unquantized mix, and the memory (``memory_plan`` on ``device``, None: the CPU; a ``--max-memory`` too
    small for one tensor's group refused), and what a mixture-of-experts plan cannot be (``check_experts``,
    ``check_writes_experts``).
    Returns the byte budget."""
    moe = config is not None and expert_count(dict(config)) > 1
    if moe:
        check_experts(options, config)
    check_fits(options.calibration_options(), config)  # windows beyond the context, a default's too: before the budget
    sets = candidate_sets(ref, options)
    if moe:
        check_writes_experts(ref, options, sets)
    shapes = planned_targets(ref, options)
    weights = sum(math.prod(s) for s in shapes.values())
    budget = file_budget(options, shapes, dict(tensor_shapes(ref.directory)), config, tensor_dtypes(ref.directory))
    check_budget(budget, tied_items(list(sets), list(sets.values()), options.format)[1], weights)
    memory_plan(ref, options, device, kept)
    return budget.planned


def check_experts(options: PlanOptions, config: Mapping) -> None:
    """A mixture-of-experts model's plan, refused in one line before any work where it cannot be made: an
    architecture whose experts qkit does not slice (gpt_oss: 3-D expert tensors) and a GPTQ plan (its feedback
    measures held-out windows, and an expert is calibrated on the tokens routed to it)."""
    layout_for(config, doing="qkit plan prices", layouts=LAYOUTS)
    if options.gptq is not None:
        raise InputError("qkit plan --method gptq prices each candidate by GPTQ's output error on held-out calibration "
                         "windows, and an expert is calibrated on the tokens routed to it, not on windows: plan a "
                         "mixture-of-experts model with --method rtn or imatrix")


def check_writes_experts(ref: ModelRef, options: PlanOptions, sets: Mapping[str, Sequence[Candidate]]) -> None:
    """A mixture-of-experts plan for a format that cannot write each expert matrix as its own tensor, refused
    in one line by the format's own check of a mix the plan may choose (``sets``: each target's candidates;
    target ``i`` takes its ``i``-th candidate, round the list, so the mix holds every scheme offered), before
    the model loads: compressed-tensors stores a MoE model in one scheme (vLLM finds a fused expert layer's
    through the config's 'Linear' target), and qkit's GGUF writer names llama and qwen2 (another
    architecture's GGUF goes through llama.cpp's converter, which stacks a layer's experts into one tensor
    and takes no plan)."""
    offered = {n: [c.scheme for c in row if c.scheme is not None] for n, row in sets.items()}
    mix = {n: schemes[i % len(schemes)] for i, (n, schemes) in enumerate(x for x in offered.items() if x[1])}
    plan_format(options.format).prepare(ref.directory, mix, dict(tensor_shapes(ref.directory)), {}, ref=ref)


def choose(table: Table, options: PlanOptions, *, model_spec: str, shapes_all: Mapping[str, tuple[int, ...]],
           method: str = "rtn", imatrix: dict | None = None, config: Mapping | None = None,
           dtypes_all: Mapping[str, torch.dtype | None] | None = None) -> Plan:
    """Step 4: the exact solve of ``table`` for ``options``' budget (``qkit.plan.budget``: the whole file's, with
    every tensor's source dtype in ``dtypes_all``; None: the planned ones' and float32), as a ``Plan`` (no check yet)."""
    weights = table.weights
    for i, row in enumerate(table.costs):  # a plan priced with NaN or inf (an overflowed Fisher) is never written
        bad = [table.options[i][k].name for k, c in enumerate(row) if not (math.isfinite(c) and c >= 0)]
        if bad:
            raise non_finite_activations(f"the predicted KL of {table.names[i]} as {', '.join(bad)} (from the "
                                         "Fisher's gradients)", LOAD_DTYPES.get(table.memory.get("dtype", DEFAULT_DTYPE),
                                                                            torch.float32))
    whole = file_budget(options, {n: table.shapes[n] for n in table.names}, shapes_all, config,
                        {**table.dtypes, **(dtypes_all or {})})
    groups, items, costs = tied_items(table.names, table.options, options.format, table.costs)
    budget = check_budget(whole, items, weights)
    sol = solve(costs, [[c.nbytes for c in row] for row in items], budget)
    picked = {i: items[g][sol.choice[g]].name for g, members in enumerate(groups) for i in members}
    tensors = {}
    for i, name in enumerate(table.names):
        j = next(k for k, c in enumerate(table.options[i]) if c.name == picked[i])
        cand = table.options[i][j]
        tensors[name] = TensorChoice(cand.name, cand.scheme, tuple(table.shapes[name]), cand.nbytes, table.costs[i][j],
                                     table.lossless[i][j],
                                     {c.name: (c.nbytes, table.costs[i][k]) for k, c in enumerate(table.options[i])})
    target = {**options.target(), **whole.record(), "budget_bytes": budget, "weights": weights}
    sensitivity = {"estimator": ESTIMATOR if table.gptq is None else feedback.ESTIMATOR, "calibration": table.calibration,
                   "positions": table.positions, "seconds": table.seconds,
                   "dtype": table.memory.get("dtype", DEFAULT_DTYPE), "memory": table.memory,
                   **({"feedback": table.feedback} if table.gptq is not None else {}),
                   **({"experts": experts_record(table)} if table.views else {})}
    solver = {**sol.to_dict(), "items": len(groups), "tied": [[table.names[i] for i in g] for g in groups if len(g) > 1]}
    return Plan(model_spec, shapes_fingerprint(shapes_all.items()), check_format(options.format), method, target, tensors,
                imatrix=imatrix, sensitivity=sensitivity, solver=solver, qkit_version=__version__)


# How an expert no calibration token reached is priced (the plan's record and its summary say it)
UNREACHED = ("an unreached expert's Fisher is zero, so every candidate of its matrices is priced 0 and the solver gives "
             "each of them its smallest candidate: the calibration shows no token using it")


def experts_record(table: Table) -> dict:
    """What a mixture-of-experts plan says of its experts: the expert matrices priced (each its own slice of its
    layer's fused parameter's Fisher), the experts no calibration token reached and how they were priced."""
    return {"matrices": len(table.views), "experts": len({_expert(t) for t in table.views}), "unreached": list(table.unreached),
            "unreached_priced": UNREACHED}


def check(plan: Plan, table: Table, ref: ModelRef, quant_weights: Mapping[str, torch.Tensor] | None = None,
          kept: KeptMeasurements | None = None) -> None:
    """Step 5 (``qkit.plan.checking.check_mix``): the plan's mix measured in the table's model, into
    ``plan.check``; if the weights cannot be restored, ``kept``'s model is dropped so that no later plan
    measures a changed one."""
    check_mix(plan, table, ref, quant_weights, forget=kept.forget if kept is not None else lambda: None)


__all__ = ["ESTIMATOR", "UNREACHED", "KeptMeasurements", "Table", "check", "check_experts", "check_writes_experts",
           "choose", "experts_record", "memory_plan", "planned_targets", "precheck", "sensitivity_table", "unreached_experts"]
