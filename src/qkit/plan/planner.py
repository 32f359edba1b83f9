"""The planner: measured sensitivity, the exact solver, and the plan they give, for a byte budget.

Steps (``make_plan``), each a function a script can call:

1. **Targets**: the tensors the transform quantizes (``qkit.transform.Rules``: the block projections,
   with ``--include``/``--exclude``). **The budget counts exactly these tensors' stored bytes** (codes,
   scales, minimums, global scales and shape tensors, as the format writes them; see
   ``candidates``); embeddings, norms and every tensor left out are outside it, as they are outside
   every table's bits per weight. ``--target-bits B`` is ``floor(B * weights / 8)`` bytes over them.
2. **Candidates** per tensor: the format's ladder that the tensor's shape takes natively
   (``candidates.candidates``), optionally restricted (``--candidates``).
3. **Sensitivity**: the diagonal Fisher of the reference's output distribution on calibration windows
   (``sensitivity.fisher_diagonal``), and per tensor and candidate the predicted KL of storing that one
   tensor so (``sensitivity.candidate_cost``), from exactly the codes the file would hold.
4. **Solve**: the multiple-choice knapsack, exact by DP over bytes (``solve.solve``): minimal summed
   predicted KL within the budget.
5. **Check**: the chosen mix swapped into the model and its KL measured on calibration windows, beside
   the prediction (the solver assumes costs add; this says how far they do).

The sensitivity table (steps 1-3) is kept for the last model, format, candidates and calibration
(``_TABLE``): a frontier of budgets, or a plan then its quantize, measures it once; the Fisher is kept
for the last model and calibration (``_FISHER``), so plans for another format or candidate set reuse it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from qkit.checkpoint import iter_tensors, tensor_dtypes, tensor_shapes
from qkit.errors import InputError
from qkit.methods.calibration import CalibrationOptions, calibration_ids, check_fits
from qkit.models import ModelRef, load, load_tokenizer
from qkit.plan.candidates import (
    KEEP,
    Candidate,
    candidates,
    check_format,
    fused_groups,
    ladder,
    parse_allowed,
    stored_nbytes,
)
from qkit.plan.planfile import Plan, TensorChoice, fingerprint
from qkit.plan.sensitivity import candidate_cost, fisher_diagonal, measured_kl
from qkit.plan.solve import smallest, solve
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.ggml import GGMLScheme, uses_importance
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.transform import Rules
from qkit.version import __version__

# Defaults, defined once. 8 windows of 512 tokens: the Fisher's noise averaged over ~4k positions; the
# check measures the mix on the first 4 of them (their reference log-probabilities kept from step 3).
DEFAULT_SAMPLES = 8
DEFAULT_SEQLEN = 512
DEFAULT_CHECK_WINDOWS = 4
ESTIMATOR = "fisher-diagonal"


@dataclass(frozen=True)
class PlanOptions:
    """What ``make_plan`` plans: ``format`` (gguf, compressed-tensors, qkit); exactly one of
    ``target_bits`` (bits per weight over the planned tensors) and ``target_size`` (their bytes);
    ``candidates`` the types allowed (default: the format's whole ladder); ``include``/``exclude``
    which tensors (``qkit.transform.Rules``); ``calibration`` the text, ``samples`` windows of
    ``seqlen`` tokens chosen with ``seed``, ``check_windows`` of them measured for the check."""

    format: str = "qkit"
    target_bits: float | None = None
    target_size: int | None = None
    target_scheme: str | None = None  # the bytes this scheme (a recipe such as q4_k_m) stores for the same tensors
    candidates: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    calibration: str | None = None
    samples: int = DEFAULT_SAMPLES
    seqlen: int = DEFAULT_SEQLEN
    seed: int = 0
    check_windows: int = DEFAULT_CHECK_WINDOWS

    def check(self) -> None:
        check_format(self.format)
        if sum(t is not None for t in (self.target_bits, self.target_size, self.target_scheme)) != 1:
            raise InputError("give exactly one of --target-bits B (bits per weight) and --target-size SIZE (bytes, e.g. 100MB)")
        if self.target_bits is not None and not (isinstance(self.target_bits, (int, float)) and math.isfinite(self.target_bits)
                                                 and self.target_bits > 0):
            raise InputError(f"--target-bits must be a positive number, got {self.target_bits!r}")
        if self.target_size is not None and not (isinstance(self.target_size, int) and self.target_size > 0):
            raise InputError(f"--target-size must be a positive number of bytes, got {self.target_size!r}")
        if self.target_scheme is not None:
            get_scheme(self.target_scheme)  # an unknown name: refused with "did you mean"
        if not (isinstance(self.check_windows, int) and 0 <= self.check_windows <= self.samples):
            raise InputError(f"check windows must be between 0 and --calibration-samples ({self.samples}), got {self.check_windows!r}")
        self.calibration_options().check()
        parse_allowed(self.format, self.candidates) if self.candidates else None

    def calibration_options(self) -> CalibrationOptions:
        return CalibrationOptions(self.calibration, self.samples, self.seqlen, self.seed)

    def target(self) -> dict:
        if self.target_scheme is not None:
            return {"scheme": self.target_scheme}
        return {"bits": self.target_bits} if self.target_bits is not None else {"size": self.target_size}


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

    @property
    def weights(self) -> int:
        return sum(math.prod(self.shapes[n]) for n in self.names)


_TABLE: dict[tuple, Table] = {}
_FISHER: dict[tuple, tuple] = {}  # the last model's Fisher (with its model and calibration record): one entry


def planned_targets(ref: ModelRef, options: PlanOptions) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the tensors a plan chooses for (the transform's targets), in file order."""
    shapes = tensor_shapes(ref.directory)
    rules = Rules(tuple(options.include), tuple(options.exclude))
    rules.check_matches((n for n, _ in shapes), ref.spec)  # a glob that matches no tensor: a typo, refused
    sentinel = object()
    chosen = {n: s for n, s in shapes if rules.scheme_for(n, tuple(s), sentinel) is not None}  # type: ignore[arg-type]
    if not chosen:
        raise InputError(f"no tensor of {ref.spec} matches the plan's rules; check --include/--exclude")
    bad = [n for n, s in chosen.items() if len(s) != 2]
    if bad:
        raise InputError(f"{bad[0]} is not a 2-D matrix; --exclude it from the plan")
    return chosen


def budget_bytes(options: PlanOptions, weights: int, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 config: Mapping | None = None, dtypes: Mapping[str, torch.dtype | None] | None = None) -> int:
    """The budget in bytes: ``target_size``; ``floor(target_bits * weights / 8)``; or the bytes
    ``target_scheme`` (bound to the model's ``config``: a recipe's per-tensor types) stores for ``shapes``
    in the plan's format, from each tensor's source dtype in ``dtypes`` (compressed-tensors keeps scales
    in the weight dtype, so ``plan:ct@int4-g64`` gets the bytes int4-g64 takes *there*)."""
    if options.target_size is not None:
        return int(options.target_size)
    if options.target_scheme is not None:
        s = get_scheme(options.target_scheme).bind(dict(config or {}))
        fmt, dt, offered = check_format(options.format), dict(dtypes or {}), set(ladder(options.format))

        def nbytes(scheme, name: str, shape: tuple[int, ...]) -> int:  # a type the format offers: its stored bytes
            if scheme.name in offered:
                return stored_nbytes(fmt, scheme, shape, dt.get(name) or torch.float32)
            return scheme.nbytes_for(shape)

        return sum(nbytes(s.resolve(tuple(shape), n), n, tuple(shape)) for n, shape in (shapes or {}).items())
    return int(math.floor(options.target_bits * weights / 8))


def sensitivity_table(
    ref: ModelRef,
    options: PlanOptions,
    *,
    device: torch.device,
    quant_weights: Mapping[str, torch.Tensor] | None = None,
    imatrix_key: str | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
) -> Table:
    """Steps 1-3 of the module docstring (kept for the same inputs). ``quant_weights``: per tensor, the
    importance weights llama.cpp's types quantize with (``--imatrix``), identified by ``imatrix_key``."""
    fmt = check_format(options.format)
    targets = planned_targets(ref, options)
    allowed = parse_allowed(fmt, options.candidates) if options.candidates else None
    key = (str(ref.directory), fmt, allowed, tuple(options.include), tuple(options.exclude), options.scale_dtype,
           options.calibration_options(), options.check_windows, imatrix_key, str(device))
    if key in _TABLE:
        return _TABLE[key]
    opts = candidate_sets(ref, options)
    cal = options.calibration_options()
    say = on_step or (lambda *_: None)
    fkey = (str(ref.directory), tuple(targets), cal, options.check_windows, str(device))
    t0 = time.perf_counter()
    if fkey in _FISHER:  # another format or candidate set of the same model: the Fisher does not depend on them
        fisher, model, provenance = _FISHER[fkey]
    else:
        # the text (overlap with the eval text, too short) is refused before the model loads
        ids, provenance = calibration_ids(load_tokenizer(ref.directory), cal)
        loaded = load(ref=ref, device=device)
        check_fits(cal, loaded.model.config)
        model = loaded.model
        fisher = fisher_diagonal(model, ids, list(targets), seed=options.seed, check_windows=options.check_windows,
                                 on_window=lambda i, n: say("fisher", i, n))
        _FISHER.clear()
        _FISHER[fkey] = (fisher, model, provenance)
    t1 = time.perf_counter()
    names = list(targets)
    by_name: dict[str, tuple[list[float], list[bool]]] = {}
    weights = dict(quant_weights or {})
    for name, w in iter_tensors(ref.directory, device=str(device)):
        if name not in targets:
            continue
        costed = [candidate_cost(w, fisher.diag[name], c.scheme, name=name, quant_weights=_qw(weights, name, c))
                  for c in opts[name]]
        by_name[name] = ([c for c, _ in costed], [k for _, k in costed])
        say("candidates", len(by_name), len(targets))
    costs = [by_name[n][0] for n in names]
    lossless = [by_name[n][1] for n in names]
    table = Table(names, targets, [opts[n] for n in names], costs, lossless, provenance, fisher.positions, fisher,
                  model, dtypes={n: d for n, d in tensor_dtypes(ref.directory).items() if n in targets},
                  seconds={"fisher": round(t1 - t0, 3), "candidates": round(time.perf_counter() - t1, 3)})
    _TABLE.clear()
    _TABLE[key] = table
    return table


def candidate_sets(ref: ModelRef, options: PlanOptions) -> dict[str, list[Candidate]]:
    """Step 2 from the headers alone: ``{target: its candidates}`` in file order."""
    fmt = check_format(options.format)
    allowed = parse_allowed(fmt, options.candidates) if options.candidates else None
    dtypes = tensor_dtypes(ref.directory)
    return {n: candidates(fmt, tuple(s), dtypes[n] or torch.float32, allowed=allowed, scale_dtype=options.scale_dtype)
            for n, s in planned_targets(ref, options).items()}


def check_budget(budget: int, options: Sequence[Sequence[Candidate]], weights: int) -> None:
    """Refuse a budget below the smallest mix or above the unquantized size, in one line."""
    low = smallest([[c.nbytes for c in row] for row in options])
    if budget < low:
        raise InputError(
            f"the budget of {budget:,} bytes ({8 * budget / weights:.3f} bits/w) is below the smallest mix, {low:,} bytes "
            f"({8 * low / weights:.3f} bits/w: every tensor at its smallest candidate); raise the target")
    # unquantized: every tensor at its KEEP size (the source dtype), or at its largest candidate without KEEP
    unquantized = sum(next((c.nbytes for c in row if c.name == KEEP), max(c.nbytes for c in row)) for row in options)
    if budget > unquantized:
        raise InputError(
            f"the budget of {budget:,} bytes ({8 * budget / weights:.3f} bits/w) is above the unquantized size of these "
            f"tensors, {unquantized:,} bytes ({8 * unquantized / weights:.3f} bits/w): nothing needs quantizing")


def precheck(ref: ModelRef, options: PlanOptions, config: Mapping | None = None) -> int:
    """Everything about the budget that the headers decide, before any model work: returns the budget."""
    sets = candidate_sets(ref, options)
    shapes = planned_targets(ref, options)
    weights = sum(math.prod(s) for s in shapes.values())
    budget = budget_bytes(options, weights, shapes, config, tensor_dtypes(ref.directory))
    check_budget(budget, tied_items(list(sets), list(sets.values()), options.format)[1], weights)
    return budget


def choose(table: Table, options: PlanOptions, *, model_spec: str, shapes_all: Mapping[str, tuple[int, ...]],
           method: str = "rtn", imatrix: dict | None = None, config: Mapping | None = None) -> Plan:
    """Step 4: the exact solve of ``table`` for ``options``' budget, as a ``Plan`` (no check yet)."""
    weights = table.weights
    budget = budget_bytes(options, weights, table.shapes, config, table.dtypes)
    groups, items, costs = tied_items(table.names, table.options, options.format, table.costs)
    check_budget(budget, items, weights)
    sol = solve(costs, [[c.nbytes for c in row] for row in items], budget)
    picked = {i: items[g][sol.choice[g]].name for g, members in enumerate(groups) for i in members}
    tensors = {}
    for i, name in enumerate(table.names):
        j = next(k for k, c in enumerate(table.options[i]) if c.name == picked[i])
        cand = table.options[i][j]
        tensors[name] = TensorChoice(cand.name, cand.scheme, tuple(table.shapes[name]), cand.nbytes, table.costs[i][j],
                                     table.lossless[i][j],
                                     {c.name: (c.nbytes, table.costs[i][k]) for k, c in enumerate(table.options[i])})
    target = {**options.target(), "budget_bytes": budget, "weights": weights, "counts": (
        f"the stored bytes of the {len(table.names)} planned tensors (codes, scales, minimums, as the format writes "
        "them); embeddings, norms and unplanned tensors are outside the budget")}
    sensitivity = {"estimator": ESTIMATOR, "calibration": table.calibration, "positions": table.positions,
                   "seconds": table.seconds}
    solver = {**sol.to_dict(), "items": len(groups), "tied": [[table.names[i] for i in g] for g in groups if len(g) > 1]}
    return Plan(model_spec, fingerprint(shapes_all.items()), check_format(options.format), method, target, tensors,
                imatrix=imatrix, sensitivity=sensitivity, solver=solver, qkit_version=__version__)


def tied_items(names: Sequence[str], options: Sequence[Sequence[Candidate]], format: str,
               costs: Sequence[Sequence[float]] | None = None) -> tuple[list[list[int]], list[list[Candidate]], list[list[float]]]:
    """The solver's items: each group of ``candidates.fused_groups`` (tensors that must share one type)
    is one item whose options are the types every member offers, with the members' bytes and predicted
    ``costs`` summed (so the knapsack over items is exact for the tied problem). Returns the groups
    (indices into ``names``), each item's merged candidates (``scheme`` None) and their costs."""
    groups = fused_groups(format, names)
    items, merged = [], []
    for g in groups:
        by_name = [{c.name: k for k, c in enumerate(options[i])} for i in g]
        common = [c.name for c in options[g[0]] if all(c.name in m for m in by_name)]
        if not common:
            raise InputError(f"{', '.join(names[i] for i in g)} must share one type (vLLM fuses them) but "
                             "have no candidate in common; widen --candidates")
        items.append([Candidate(n, None, sum(options[i][m[n]].nbytes for i, m in zip(g, by_name))) for n in common])
        if costs is not None:
            merged.append([sum(costs[i][m[n]] for i, m in zip(g, by_name)) for n in common])
    return groups, items, merged


def _qw(weights: Mapping[str, torch.Tensor], name: str, cand: Candidate) -> torch.Tensor | None:
    """The importance weights ``cand`` quantizes ``name`` with: llama.cpp's weighted types only."""
    s = cand.scheme
    return weights.get(name) if isinstance(s, GGMLScheme) and uses_importance(s.ggml_type) else None


def check(plan: Plan, table: Table, ref: ModelRef, quant_weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """Step 5: the plan's mix swapped into the table's model (the same codes the file holds), its KL
    measured on the check windows beside the prediction, into ``plan.check``; the weights restored."""
    fisher = table.fisher
    if fisher is None or not fisher.reference:
        plan.check = {"measured_kl": None, "windows": 0}
        return
    model = table.model
    params = dict(model.named_parameters())
    weights = dict(quant_weights or {})
    t0 = time.perf_counter()
    device = str(next(model.parameters()).device)
    # A swapped parameter is restored from the file it was loaded from when it equals that file's tensor
    # (checked before the swap; no second copy of the model's weights); any other one from a copy.
    swapped: list[str] = []
    copies: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, w in iter_tensors(ref.directory, device=device):
                t = plan.tensors.get(name)
                if t is None or t.scheme is None:
                    continue
                cand = Candidate(t.type, t.scheme, t.nbytes)
                qt = quantize_tensor(w, t.scheme, name=name, quant_weights=_qw(weights, name, cand))
                p = params[name]
                if not torch.equal(p, w.to(p.dtype)):
                    copies[name] = p.detach().clone()
                swapped.append(name)
                p.copy_(qt.dequantize(p.dtype))
        kl, se = measured_kl(model, fisher)
    finally:
        _restore(params, swapped, copies, ref, device)
    pred = plan.predicted_kl
    plan.check = {"measured_kl": kl, "measured_kl_se": se, "predicted_kl": pred,
                  "ratio": (pred / kl) if kl > 0 else None, "windows": len(fisher.reference),
                  "positions": int(fisher.check_ids.numel()), "seconds": round(time.perf_counter() - t0, 3),
                  "text": "calibration windows (the first check windows of the sensitivity pass), never the eval text"}


def _restore(params: Mapping[str, torch.Tensor], names: Sequence[str], copies: Mapping[str, torch.Tensor],
             ref: ModelRef, device: str) -> None:
    """Put back the weights ``check`` swapped: from ``copies``, else from the model's file. If that fails
    (an interrupt, a file gone), the cached model is dropped so that no later plan measures a changed one."""
    todo = set(names)
    try:
        with torch.no_grad():
            for name in todo & copies.keys():
                params[name].copy_(copies[name])
            todo -= copies.keys()
            if todo:
                for name, w in iter_tensors(ref.directory, device=device):
                    if name in todo:
                        params[name].copy_(w)
                        todo.discard(name)
    finally:
        if todo:
            _FISHER.clear()
            _TABLE.clear()


def base_type(plan: Plan) -> str:
    """The type that holds the most planned weights (the plan's "base")."""
    weights: dict[str, int] = {}
    for t in plan.tensors.values():
        weights[t.type] = weights.get(t.type, 0) + math.prod(t.shape)
    return max(sorted(weights), key=lambda k: weights[k])


def lossless_types(plan: Plan) -> dict[str, int]:
    """``{type: tensors}``: the planned types that reproduce their tensors' source weights exactly (predicted
    KL 0: the source already lies on that type's grid, e.g. a model published in it), and how many planned
    tensors each holds so; by count, most first (ties by name). Tensors kept unquantized are not counted."""
    counts: dict[str, int] = {}
    for t in plan.tensors.values():
        if t.lossless and t.scheme is not None:
            counts[t.type] = counts.get(t.type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def upgrades(plan: Plan) -> list[dict]:
    """Tensors stored in more bytes than the base type would take for them, with why: the predicted KL
    the base type would cost them against what the chosen type costs, per extra byte."""
    base = base_type(plan)
    out = []
    for name, t in sorted(plan.tensors.items()):
        at_base = t.candidates.get(base)
        if at_base is None or t.nbytes <= at_base[0]:
            continue
        out.append({"tensor": name, "type": t.type, "base": base, "extra_bytes": t.nbytes - at_base[0],
                    "kl_at_base": at_base[1], "kl": t.predicted_kl,
                    "kl_saved_per_mb": (at_base[1] - t.predicted_kl) / ((t.nbytes - at_base[0]) / 1e6)})
    return out


__all__ = ["DEFAULT_CHECK_WINDOWS", "DEFAULT_SAMPLES", "DEFAULT_SEQLEN", "ESTIMATOR", "PlanOptions", "Table", "base_type",
           "budget_bytes", "check", "choose", "lossless_types", "planned_targets", "sensitivity_table", "upgrades"]
