"""AWQ (Lin et al., arXiv:2306.00978): activation-aware per-channel scales, folded, then RTN (+ clipping).

Per group of linears sharing an input (``qkit.methods.folding``: q/k/v after ``input_layernorm``, o after
v, gate/up after ``post_attention_layernorm``, down after up), block by block
(``qkit.methods.sequential``'s block walk):

1. **Statistics**: ``x̄[j] = mean|X_j|`` per input channel over every calibration token (for o_proj under
   grouped-query attention, averaged over the query heads that read one kv channel: the scales are tied
   per kv head, see ``folding``).
2. **Scale search** (llm-awq / AutoAWQ ``auto_scale``): for ``ratio`` in ``{0, 1/n, ..., (n-1)/n}``
   (``n_grid`` = 20)::

       s = clamp(x̄^ratio, min=1e-4);  s = s / sqrt(max(s) · min(s))
       Ŵ = deq(Q(W · s)) / s            (Q, deq: qkit's quantize_tensor / dequantize of the target scheme)
       loss = mean((M(X; Ŵ) - M(X; W))²)

   where ``M`` is the group's module (the attention block for q/k/v, the MLP for gate/up, the linear
   itself for o and down) with the other linears of the block at full precision, as in the reference.
   The ``s`` with the smallest loss is kept. ``ratio = 0`` gives ``s = 1``, plain RTN, so on the
   calibration tokens the search can never do worse than RTN (recorded: ``loss_rtn``, ``loss_search``).
   The loss is computed on the first ``search_samples`` calibration windows (all, when None); the
   statistics always use every window.
3. **Fold** ``1/s`` into the preceding norm or linear and ``s`` into the linears' input columns
   (``folding.fold``): the saved model is an ordinary model, the fp function unchanged.
4. **Clipping search** (AutoAWQ ``auto_clip``, when ``clip``): for every linear except q and k (their
   product through the attention scores makes the per-linear error a poor proxy, as the reference notes),
   per output row and group of ``width`` columns, the clamp ``t = max|W_g| · (1 - i/clip_grid)``,
   ``i < max_shrink · clip_grid``, minimising ``mean_t ((X_g · (deq(Q(clamp(W, ±t))) - W)_g)²)`` over
   ``clip_tokens`` tokens (evenly strided) of the scaled inputs. The group width is the scheme's scale
   unit: ``PerGroup(g)``: g, ``PerRow``: the row, NF4: its block when blocks do not cross rows; schemes
   whose scale units are not row groups (per-tensor, llama.cpp super-blocks) skip clipping (recorded).
   The weights are then clamped and quantized by ``quantize_tensor`` as usual, so the stored tensor is an
   ordinary ``QuantizedTensor`` of the same scheme (clipping only lowers the absmax a scale is chosen from).
5. **Next block's inputs**: ``next_inputs = "fp"`` (default, as AutoAWQ: the block's full-precision outputs;
   folding does not change them) or ``"quantized"`` (the outputs of the block with its quantized weights,
   GPTQ's sequential scheme).

Works for every registered scheme (the search quantizes with the scheme itself). Record (manifest
``method``): options, calibration provenance, per group the best ratio and the loss with plain RTN, after
the search and after clipping (the final weights), per block seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qkit.checkpoint import tensor_dtypes, tensor_shapes
from qkit.errors import InputError
from qkit.methods import CalibratedOptions, MethodResult
from qkit.methods.calibration import calibration_ids
from qkit.methods.expert_options import ExpertOptions, expert_of, experts_record, few_tokens
from qkit.methods.experts import LAYOUTS, check_method, layout_for, routed_tokens, unfused_experts
from qkit.methods.awq_search import (
    CLIP_GRID,
    MAX_SHRINK,
    N_GRID,
    apply_clip,
    awq_scales,
    clip_thresholds,
    clip_width,
    fake_quant,
    group_units,
    scaled_fake_quant,
)
from qkit.methods.folding import (
    FoldGroup,
    ChannelStats,
    fold,
    fold_groups,
    model_fold_groups,
    options_record,
    in_source_dtypes,
)
from qkit.methods.memory import RETENTION, Model, largest, walk_dtype, walked_weights
from qkit.methods.sequential import DEFAULT_BATCH_SIZE, BlockInputs, walk_blocks
from qkit.models import ModelRef, load, read_config
from qkit.schemes import QuantizedTensor, Scheme, quantize_tensor
from qkit.schemes.fidelity import check_written

CLIP_TOKENS = 512
# the clipping search's float32 copies of one linear (w, its bound, the clamp, the fake-quant and its error,
# their group views), with a margin: 2048x5632 measured 1.81 GiB peak against a 1.91 GiB estimate; a 4 x 1024
# x 2816 fp32 file walked mapped peaked at 1.17-1.33 GiB over four runs of one command (8 copies: 1.30 estimated)
AWQ_COPIES = 12
# No clipping for q/k: "due to qk bmm, it is hard to clip precisely" (AutoAWQ ``_search_best_clip``).
NO_CLIP = ("q_proj", "k_proj")
NEXT_INPUTS = ("fp", "quantized")
DEFAULT_SEARCH_SAMPLES = 4  # windows of the grid-search loss (timing: docs/calibrated-methods.md); statistics use all
# why an expert matrix is written by rtn instead (``min_expert_tokens``; the record's ``rtn_fallback_reasons``)
FEW_TOKENS = "rtn, unclipped (an expert routed fewer than --min-expert-tokens calibration tokens)"
NO_TOKENS = "rtn, unclipped (an expert no calibration token reached)"


@dataclass(frozen=True)
class AWQOptions(CalibratedOptions, ExpertOptions):
    """``calibration*``: which calibration tokens (as GPTQ's: source, samples, seqlen, seed); ``n_grid``: ratios searched;
    ``clip``: run the clipping search (``clip_grid``, ``max_shrink``, ``clip_tokens`` as in AutoAWQ);
    ``search_samples``: calibration windows the scale search's loss is computed on (None: all);
    ``next_inputs``: ``fp`` or ``quantized`` (what the next block is fed); ``linear_groups``: also scale
    o (after v) and down (after up); ``batch_size``: windows per forward call; ``min_expert_tokens``
    (``ExpertOptions``): an expert that read fewer calibration tokens is written by rtn at scale 1."""

    n_grid: int = N_GRID
    clip: bool = True
    clip_grid: int = CLIP_GRID
    max_shrink: float = MAX_SHRINK
    clip_tokens: int = CLIP_TOKENS
    search_samples: int | None = DEFAULT_SEARCH_SAMPLES
    next_inputs: str = "fp"
    linear_groups: bool = True
    batch_size: int = DEFAULT_BATCH_SIZE

    def __post_init__(self) -> None:
        for key in ("n_grid", "clip_grid", "clip_tokens", "batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"AWQ option {key} must be a positive integer, got {v!r}")
        if self.search_samples is not None and (not isinstance(self.search_samples, int) or self.search_samples < 1):
            raise InputError(f"AWQ option search_samples must be a positive integer or None (all), got {self.search_samples!r}")
        if not isinstance(self.max_shrink, (int, float)) or not 0.0 <= self.max_shrink < 1.0:
            raise InputError(f"AWQ option max_shrink must be in [0, 1), got {self.max_shrink!r}")
        if self.next_inputs not in NEXT_INPUTS:
            raise InputError(f"AWQ option next_inputs must be one of {', '.join(NEXT_INPUTS)}, got {self.next_inputs!r}")
        self.calibration_options().check()
        self.check_experts()
        self.fp32_only("awq")

    def check(self) -> None:
        """Validated on construction; kept so every method's options answer ``check()`` alike."""
        self.__post_init__()


# --------------------------------------------------------------------------- maths core


# --------------------------------------------------------------------------- one block


def _local(group: FoldGroup, prefix: str) -> FoldGroup:
    """The group with names relative to its block (``model.layers.3.``)."""
    strip = lambda n: n.removeprefix(prefix)  # noqa: E731
    return dataclasses.replace(group, prev=strip(group.prev), linears=tuple(strip(n) for n in group.linears),
                               output=strip(group.output))


class _Recorder:
    """One fp pass over a block: each group's module inputs (with their keyword arguments) and outputs, tagged
    with the batch they came from; the per-channel statistics of the group's input (its first linear's: a
    sparse MLP's router, which reads every token); the rows each linear read (an expert's: the tokens routed
    to it) and the inputs of the linears to clip (``clipped``)."""

    def __init__(self, inputs: BlockInputs, groups: list[FoldGroup], clipped: list[str]) -> None:
        self.calls: dict[str, list[tuple[int, torch.Tensor, dict[str, Any]]]] = {g.name: [] for g in groups}
        self.targets: dict[str, list[tuple[int, torch.Tensor]]] = {g.name: [] for g in groups}
        self.lin_in: dict[str, list[torch.Tensor]] = {n: [] for n in clipped}
        self.rows: dict[str, int] = {n: 0 for g in groups for n in g.linears}
        self.stats = {g.name: ChannelStats() for g in groups}
        self.batch = -1
        block = inputs.block

        def count(_m, _args):
            self.batch += 1

        handles = [block.register_forward_pre_hook(count)]
        for g in groups:
            def pre(_m, args, kwargs, name=g.name):
                x = args[0] if args else kwargs["hidden_states"]
                self.calls[name].append((self.batch, x, {k: v for k, v in kwargs.items() if k != "hidden_states"}))

            def post(_m, _args, out, name=g.name):
                self.targets[name].append((self.batch, (out[0] if isinstance(out, (tuple, list)) else out).detach()))

            def stat(_m, args, name=g.name):
                self.stats[name].update(args[0])

            mod = block.get_submodule(g.output)
            handles += [mod.register_forward_pre_hook(pre, with_kwargs=True), mod.register_forward_hook(post),
                        block.get_submodule(g.linears[0]).register_forward_pre_hook(stat)]
        for n in self.rows:
            def lin(_m, args, name=n):
                self.rows[name] += args[0].numel() // args[0].shape[-1]
                if name in self.lin_in:
                    self.lin_in[name].append(args[0].detach())

            handles.append(block.get_submodule(n).register_forward_pre_hook(lin))
        try:
            self.outputs = inputs.forward()  # the block's fp outputs: the next block's inputs with next_inputs="fp"
        finally:
            for h in handles:
                h.remove()

    def searched(self, name: str, batches: int) -> tuple[list[tuple[torch.Tensor, dict[str, Any]]], list[torch.Tensor]]:
        """Group ``name``'s recorded module calls and fp outputs from the first ``batches`` batches (an expert's
        module runs only in the batches that routed it a token)."""
        return ([(x, kw) for b, x, kw in self.calls[name] if b < batches],
                [y for b, y in self.targets[name] if b < batches])


def _run(module: torch.nn.Module, calls: list[tuple[torch.Tensor, dict[str, Any]]], scale: torch.Tensor | None = None):
    for x, kw in calls:
        out = module(x / scale if scale is not None else x, **kw)
        yield out[0] if isinstance(out, (tuple, list)) else out


def _loss(module, calls, targets, scale=None) -> float:
    """Mean squared error of ``module``'s outputs against the recorded fp outputs (fp64 sum)."""
    total, n = 0.0, 0
    for y, t in zip(_run(module, calls, scale), targets):
        total += float((y.float() - t.float()).pow(2).sum(dtype=torch.float64))
        n += t.numel()
    return total / max(n, 1)


def _take(hidden: list[torch.Tensor], samples: int | None) -> int:
    """How many batches of a block's inputs (``[windows, L, H]`` each) hold the first ``samples`` windows (all
    when None)."""
    if samples is None:
        return len(hidden)
    got = 0
    for k, t in enumerate(hidden):
        got += t.shape[0]
        if got >= samples:
            return k + 1
    return len(hidden)


@torch.no_grad()
def search_group(
    block: torch.nn.Module,
    group: FoldGroup,
    x_mean: torch.Tensor,
    calls: list[tuple[torch.Tensor, dict[str, Any]]],
    targets: list[torch.Tensor],
    schemes: dict[str, Scheme | None],
    n_grid: int = N_GRID,
) -> tuple[torch.Tensor, float, float, float]:
    """AWQ's grid search for one group (names relative to ``block``). ``x_mean``: per ``prev`` channel;
    ``calls``/``targets``: the group module's recorded inputs and fp outputs; ``schemes``: per linear name
    (None: kept full precision). Returns ``(scales [c], best ratio, loss at ratio 0 = RTN, best loss)``.
    The block's weights are restored before returning."""
    module = block.get_submodule(group.output)
    lins = {n: block.get_submodule(n) for n in group.linears}
    orig = {n: m.weight.data.clone() for n, m in lins.items()}
    best = (float("inf"), 0.0, None)
    loss_rtn = float("nan")
    try:
        for k in range(n_grid):
            ratio = k / n_grid
            s = awq_scales(x_mean, ratio)
            cols = group.expand(s).to(x_mean.device)
            for n, m in lins.items():
                if schemes.get(n) is not None:
                    m.weight.data = scaled_fake_quant(orig[n], cols, schemes[n]).to(orig[n].dtype)
            loss = _loss(module, calls, targets)
            if k == 0:
                loss_rtn = loss
            if loss < best[0]:
                best = (loss, ratio, s)
    finally:
        for n, m in lins.items():
            m.weight.data = orig[n]
    return best[2], best[1], loss_rtn, best[0]


# --------------------------------------------------------------------------- the method


class AWQMethod:
    name = "awq"
    calibrated = True
    options_type = AWQOptions

    def check(self, scheme: Scheme) -> None:
        # AWQ only rescales the weights and calls the scheme's own quantize/dequantize, so any scheme that
        # quantizes a 2-D matrix works; one that does not says so itself when quantize_tensor runs.
        if not isinstance(scheme, Scheme):
            raise InputError(f"awq needs a scheme that quantizes and dequantizes a matrix; {scheme.name} does not")

    def memory(self, model: Model, targets: Mapping[str, Scheme], options: AWQOptions) -> dict[str, int]:
        """Beside the process (``qkit.methods.memory``): the weights as the walk holds them (``walked_weights``:
        mapped in the files' dtype, each block upcast to fp32 while it is processed, then freed), every
        window's block inputs and outputs, one block's recorded group inputs and outputs
        (``N * T * (7h + i)`` floats), and the clipping search of the largest linear (its float32 copies and
        ``_group_output_error``'s chunk)."""
        N, T, d = options.calibration_samples, options.seqlen, model.dims
        recorded = N * T * (7 * d.hidden + d.inter) * 4
        search = AWQ_COPIES * 4 * largest(targets, model) + 4 * 4 * (1 << 24)
        work = max(model.load, model.block_forward(min(options.batch_size, N), T) + recorded + search)
        walk = dataclasses.replace(model, dtype=walk_dtype(model.stored))
        return {**walked_weights(walk, targets, compute=torch.float32), "calibration activations": model.activations(N, T),
                "one block's search": int(RETENTION * work)}

    def run(
        self,
        ref: ModelRef,
        targets: dict[str, Scheme],
        options: AWQOptions,
        *,
        device: torch.device,
        on_block: Callable[[int, int], None] | None = None,
    ) -> MethodResult:
        t0 = time.perf_counter()
        config = read_config(ref.directory)
        check_method(config, self.name, options)  # a mixture-of-experts model awq cannot route: refused now
        fold_groups(config, (n for n, _ in tensor_shapes(ref.directory)))  # refuse before loading
        # Loaded in the files' own dtype (memory-mapped), each block upcast to fp32 as it is processed and freed
        # after: the same fp32 computation as loading the model whole in fp32, one block in memory at a time.
        loaded = load(ref=ref, device="cpu", dtype=walk_dtype(tensor_dtypes(ref.directory)))
        ids, provenance = calibration_ids(loaded.tokenizer, options.calibration_options(loaded.model.config))
        result = awq_model(loaded.model, ids, targets, options, device=device, on_block=on_block, release=True)
        del loaded
        result.quantized = in_source_dtypes(result.quantized, ref.directory)
        result.record = {"options": options_record(options), "calibration": provenance, **result.record,
                         "seconds": round(time.perf_counter() - t0, 3)}
        return result


def awq_model(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: dict[str, Scheme],
    options: AWQOptions = AWQOptions(),
    *,
    device: torch.device = torch.device("cpu"),
    on_block: Callable[[int, int], None] | None = None,
    release: bool = False,
) -> MethodResult:
    """Run AWQ over ``model`` (a transformers llama-layout causal LM, or a mixture-of-experts one that
    ``qkit.methods.experts`` lays out, on the CPU, computed in fp32: a model in another dtype is upcast block by
    block; changed in place: its scales folded, weights left full precision or quantized per ``next_inputs``)
    with calibration ids ``[samples, seqlen]``. ``targets`` are keyed by the checkpoint's names (an expert
    matrix's: ``model.layers.0.mlp.experts.3.up_proj.weight``). Returns every target's ``QuantizedTensor``,
    the changed non-target tensors (norms, biases, a kept preceding linear, a router) and the record (without
    calibration provenance). ``release``: free each block once processed (the model is left unusable;
    ``sequential.walk_blocks``).

    A mixture-of-experts model runs with one linear per expert matrix (``unfused_experts``), so each expert's
    statistics and clipping inputs are the tokens routed to it (``calibrate_all_experts``: every token). An
    expert that read fewer than ``min_expert_tokens`` tokens keeps scale 1 after its ``up`` and is written by
    rtn without clipping; its gate and up take the scale of the norm every reader of it shares (the fold is
    what keeps the function exact) and are written by rtn of those folded weights."""
    config = model.config.to_dict()
    layout = layout_for(config, "awq folds scales into", LAYOUTS)
    stored = (lambda n: n) if layout is None else layout.stored_name  # the loaded model's names -> the checkpoint's
    quantized: dict[str, QuantizedTensor] = {}
    checked: dict[str, float] = {}  # folded targets: their relative error against the folded weight
    changed: dict[str, torch.Tensor] = {}
    per_group: dict[str, dict[str, Any]] = {}
    per_block: dict[str, float] = {}
    routed: dict[str, int] = {}  # expert (``...mlp.experts.3``) -> tokens the router sent it
    calibrated: dict[str, int] = {}  # expert -> tokens its linears read
    fallback: dict[str, str] = {}  # expert matrix -> why rtn

    def process(i: int, block: torch.nn.Module, inputs: BlockInputs) -> list[torch.Tensor] | None:
        t = time.perf_counter()
        prefix = inputs.prefix
        full = lambda n: f"{stored(prefix + n)}.weight"  # noqa: E731 (a block's module -> its stored tensor)
        groups = [_local(g, prefix) for g in all_groups if g.prev.startswith(prefix)]
        groups = [g for g in groups if any(full(n) in targets for n in g.linears)]
        schemes = {n: targets.get(full(n)) for g in groups for n in g.linears}
        clipped = [n for n, sc in schemes.items() if sc is not None and options.clip and not n.endswith(NO_CLIP)]
        routed_tokens(block, reset=True)  # counted from here: the pass the statistics are taken on
        rec = _Recorder(inputs, groups, clipped)
        routed.update({prefix + k: v for k, v in routed_tokens(block).items()})
        few = {n for n in rec.rows if few_tokens(full(n), rec.rows[n], options)}
        calibrated.update({expert_of(full(n)): rows for n, rows in rec.rows.items() if expert_of(full(n))})
        batches = _take(inputs.hidden, options.search_samples)
        found: dict[str, torch.Tensor] = {}
        for g in groups:
            if g.kind == "down" and g.linears[0] in few:  # an expert with too few tokens: scale 1, nothing folded
                continue
            calls, outs = rec.searched(g.name, batches)
            if not outs:  # an expert routed no token in the search's windows: searched on all of them
                calls, outs = rec.searched(g.name, len(inputs.hidden))
            x_mean = g.reduce(rec.stats[g.name].absmean.to(outs[0].device), "mean")
            s, ratio, loss_rtn, loss_best = search_group(block, g, x_mean, calls, outs, schemes, options.n_grid)
            found[g.name] = s
            per_group[stored(g.name)] = {"ratio": ratio, "loss_rtn": loss_rtn, "loss_search": loss_best}
        for g in groups:  # fold every group (AutoAWQ: scales are searched on the unscaled block, then applied)
            if g.name in found:
                for n, v in fold(block, g, found[g.name]).items():
                    if stored(prefix + n) not in targets:  # a target's folded weight is quantized below: no copy kept
                        changed[stored(prefix + n)] = v.detach().clone()
        # Clip and quantize each target linear of the block, from its folded weight and scaled inputs.
        final: dict[str, torch.Tensor] = {}
        for g in groups:
            cols = g.expand(found[g.name]) if g.name in found else None
            for n in g.linears:
                scheme = schemes[n]
                if scheme is None:
                    continue
                w = folded = block.get_submodule(n).weight.data
                clip_note = None
                if n in few:
                    fallback[full(n)] = FEW_TOKENS if rec.rows[n] else NO_TOKENS
                elif n in clipped:
                    width = clip_width(scheme, w.shape[1])
                    if width is None:
                        clip_note = f"skipped: {scheme.name} has no per-row scale groups to clip"
                    else:
                        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in rec.lin_in[n]])
                        x = x[:: max(1, x.shape[0] // options.clip_tokens)][: options.clip_tokens]
                        x = x / cols.to(x.device) if cols is not None else x
                        th = clip_thresholds(w, x, scheme, width, n_grid=options.clip_grid, max_shrink=options.max_shrink)
                        org = group_units(w.float(), width).abs().amax(dim=-1)
                        clip_note = round(float((th < org).float().mean()), 4)  # share of groups clipped
                        w = apply_clip(w, th, width)
                name = full(n)
                qt = quantize_tensor(w, scheme, name=name)
                quantized[name] = qt
                final[n] = qt.dequantize(w.dtype)
                # against the folded weight before clipping: what the stored tensor must still be
                checked[name] = check_written(name, folded, qt, decoded=final[n], cause=(
                    "AWQ's scales and clipping for it; compare --method rtn or pass --no-clip"))
                if clip_note is not None and g.name in found:
                    key = n.removeprefix(g.output + ".") if n != g.output else n.rpartition(".")[2]
                    per_group[stored(g.name)].setdefault("clipped", {})[key] = clip_note
        for n, linear in inputs.linears().items():  # a target in no group (down without linear_groups): rtn
            name = f"{prefix}{n}.weight"
            if name in targets and name not in quantized:
                quantized[name] = quantize_tensor(linear.weight.data, targets[name], name=name)
        # The loss with the final weights (folded, clipped, quantized) of each group, the rest of the block at
        # full precision as in the search, on the search windows.
        for g in groups:
            if g.name not in found:
                continue
            calls, outs = rec.searched(g.name, batches)
            if not outs:
                calls, outs = rec.searched(g.name, len(inputs.hidden))
            mine = {n: block.get_submodule(n) for n in g.linears if n in final}
            keep = {n: m.weight.data for n, m in mine.items()}
            try:
                for n, m in mine.items():
                    m.weight.data = final[n]
                scale = g.expand(found[g.name]).to(outs[0].device)
                per_group[stored(g.name)]["loss_final"] = _loss(block.get_submodule(g.output), calls, outs, scale)
            finally:
                for n, m in mine.items():
                    m.weight.data = keep[n]
        if options.next_inputs == "quantized":  # the walker feeds the next block this block's quantized outputs
            for n, v in final.items():
                block.get_submodule(n).weight.data = v
        per_block[prefix.rstrip(".")] = round(time.perf_counter() - t, 3)
        # fp: the recorded outputs of the block before folding (the same function) feed the next block, as in
        # AutoAWQ; quantized: None, so the block is run again with the quantized weights left in it.
        return rec.outputs if options.next_inputs == "fp" else None

    # Each expert one linear per matrix while the walk runs (none for a dense model); ``process`` returns the
    # block's fp outputs (AWQ records them in its pass anyway), sparing the walker a pass.
    with unfused_experts(model, config, options.calibrate_all_experts):
        all_groups = model_fold_groups(model, linear_groups=options.linear_groups)
        walk_blocks(model, ids, process, device=device, batch_size=options.batch_size, on_block=on_block,
                    release=release, compute_dtype=torch.float32)
    state = model.state_dict()
    for name, scheme in targets.items():  # targets outside the blocks (e.g. --include lm_head): RTN
        if name not in quantized:
            quantized[name] = quantize_tensor(state[name].detach().float(), scheme, name=name)
    replaced = {n: v for n, v in changed.items() if n not in targets}
    for g in per_group.values():
        for key in ("loss_rtn", "loss_search", "loss_final"):
            if key in g:
                g[key] = float(f"{g[key]:.6g}")
    record: dict[str, Any] = {"groups": per_group, "block_seconds": per_block, "next_inputs": options.next_inputs}
    if fallback:
        record["rtn_fallback_reasons"] = dict(sorted(fallback.items()))
    if routed:
        record["experts"] = experts_record(options, routed, calibrated, fallback)
    return MethodResult(quantized, replaced, record, checked)


METHOD = AWQMethod()

__all__ = ["AWQMethod", "AWQOptions", "METHOD", "apply_clip", "awq_model", "awq_scales", "clip_thresholds", "clip_width",
           "fake_quant", "scaled_fake_quant", "search_group"]
