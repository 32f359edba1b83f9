"""``--method gptq``: calibration, the block walk, one solve per linear, the record.

Layer 5 (``qkit.methods``). The lifecycle around ``qkit.methods.gptq.solver`` (the maths), as
llm-compressor splits its GPTQ modifier from ``gptq_quantize``: calibration ids
(``qkit.methods.calibration``), the block walk (``qkit.methods.sequential.walk_blocks``), each block's
Hessians collected from its linears' inputs (``HessianInputs``), each linear solved and its weights
replaced by what will be stored (``solve_linear``), and the manifest record (``gptq_record``).

Layer by layer: by default all calibration windows go through a block in one batch and each linear is
quantized in its forward pre-hook, before it runs (the reference's "true sequential" order; one forward
pass per block, ``quantize_in_forward``); with ``batch_size`` below the number of windows the Hessians
are accumulated with the block's original weights, the linears quantized, and the block run again
(``quantize_after_forward``). Linears fed the same tensor (q/k/v, gate/up) share one Hessian and factor.
Details: docs/gptq.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from qkit.bounds import show_number
from qkit.checkpoint import iter_tensors, tensor_dtypes, tensor_shapes
from qkit.dtypes import check_finite
from qkit.errors import InputError
from qkit.llama_names import expert_index
from qkit.methods import CalibratedOptions, MethodResult
from qkit.methods.calibration import calibration_ids
from qkit.methods.expert_options import ExpertOptions, expert_of
from qkit.methods.expert_options import experts_record as _experts_record
from qkit.methods.expert_options import few_tokens as _few_tokens
from qkit.methods.expert_storage import expert_reader, split_experts, virtual_experts
from qkit.methods.experts import check_method, routed_tokens, unfused_experts
from qkit.methods.gptq.errors import output_error, output_errors, rtn_dequantized, rtn_parts
from qkit.methods.gptq.solver import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DAMPENING,
    PreparedHessian,
    accumulate_gram,
    check_scheme,
    gptq_solve,
    prepare_hessian,
    symmetrize,
    whole_blocks,
)
from qkit.methods.memory import RETENTION, Model, largest, walked_weights
from qkit.methods.sequential import BlockInputs, walk_blocks
from qkit.models import load, load_tokenizer, read_config
from qkit.schemes import QuantizedTensor, Scheme, is_llama_type, quantize_tensor
from qkit.schemes.fidelity import check_written
from qkit.schemes.observers import SCALE_RULES as _RULES
from qkit.schemes.base import as_2d
from qkit.threads import one_torch_thread

SCALE_RULES = tuple(_RULES.names())  # the values ``--scale-rule`` takes (see ``qkit.schemes.observers``)

# linears that read the same tensor as the one before them (q/k/v, gate/up): one Gram for the group
_SHARES_INPUT = re.compile(r"\.(?:k_proj|v_proj|up_proj)\.weight$")


@dataclass(frozen=True)
class GPTQOptions(CalibratedOptions, ExpertOptions):
    """Options of ``--method gptq``; every default defined here once."""

    dampening: float = DEFAULT_DAMPENING
    # H + hessian_shrink * diag(H): H pulled toward its diagonal, so the solve leans less on correlations
    # between input channels that the calibration text has and other text may not (docs/gptq.md). 0.5
    # measured better than 0 on every held-out domain for q4_k_m, q3_k_m, q2_k, int4-g64, NF4, MXFP4, NVFP4
    hessian_shrink: float = 0.5
    # columns by descending diag(H), static group scales: measured on the default model (docs), int4-g64
    # perplexity 19.26 with it against 21.25 without; act_order=False gives the reference's default order
    act_order: bool = True
    # scales from the original weights without act order too (the reference's static_groups; with act
    # order they always are). Measured for llama.cpp's types in docs/gptq.md.
    static_groups: bool = False
    scale_rule: str = "absmax"  # see SCALE_RULES
    block_size: int = DEFAULT_BLOCK_SIZE
    # calibration windows per forward call; None: all in one batch, one pass per block (true sequential)
    batch_size: int | None = None
    # calibration windows kept out of the Hessian, spread evenly over the windows; on them each tensor's GPTQ
    # codes and RTN's are compared by output error and the better is written (0: GPTQ's always)
    holdout: int = 0
    # ``min_expert_tokens`` (``ExpertOptions``): an expert matrix (mixture-of-experts) whose Hessian got fewer
    # tokens is written by rtn (with the importance matrix when given): a Hessian of a few tokens fits the
    # solve to those tokens alone

    def __post_init__(self) -> None:
        self.check()  # malformed options are refused when the options are made, before any model is read

    def check(self) -> None:
        if not (isinstance(self.dampening, (int, float)) and 0 < self.dampening < 1e3 and math.isfinite(self.dampening)):
            raise InputError(f"--dampening must be a positive fraction of the mean Hessian diagonal (e.g. 0.01) below 1000, "
                             f"got {show_number(self.dampening)}")
        if not (isinstance(self.hessian_shrink, (int, float)) and not isinstance(self.hessian_shrink, bool)
                and math.isfinite(self.hessian_shrink) and 0 <= self.hessian_shrink <= 1e3):
            raise InputError(f"--hessian-shrink must be a number from 0 to 1000 (the fraction of H's diagonal added to it), "
                             f"got {show_number(self.hessian_shrink)}")
        if self.scale_rule not in SCALE_RULES:
            raise InputError(f"unknown GPTQ scale rule {self.scale_rule!r}; use one of {', '.join(SCALE_RULES)}")
        if not isinstance(self.static_groups, bool):
            raise InputError(f"static_groups must be true or false, got {self.static_groups!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InputError(f"GPTQ block size must be a positive integer, got {self.block_size!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise InputError(f"calibration batch size must be a positive integer, got {self.batch_size!r}")
        self.calibration_options().check()
        if not (isinstance(self.holdout, int) and not isinstance(self.holdout, bool)
                and 0 <= self.holdout < self.calibration_samples):
            raise InputError(f"--holdout must be a whole number of windows from 0 to --calibration-samples - 1 "
                             f"({show_number(self.calibration_samples - 1)}), got {show_number(self.holdout)}")
        self.check_experts()

    def held_out(self) -> torch.Tensor:
        """bool ``[calibration_samples]``: the windows kept out of the Hessian, ``holdout`` of them spread evenly
        (window ``floor((j + 1/2) N / holdout)`` for ``j < holdout``), so they span the whole text (a mix's
        parts, not its last)."""
        n = self.calibration_samples
        mask = torch.zeros(n, dtype=torch.bool)
        mask[[int((j + 0.5) * n / self.holdout) for j in range(self.holdout)]] = True
        return mask


# --------------------------------------------------------------------------- Hessians of one block


class HessianInputs:
    """``Xᵀ X`` (fp32) per distinct input tensor: linears called in a row with the *same* tensor object
    (q/k/v on the attention norm's output, gate/up on the MLP norm's) share one accumulator and one
    prepared factor."""

    def __init__(self, prefix: str = "", held_out: torch.Tensor | None = None) -> None:
        self.prefix = prefix  # the block's, for messages
        # bool [windows]: those accumulated apart (``held``), never into the Hessian; None: none
        self.held_out = held_out
        self._sums: dict[str, torch.Tensor] = {}
        self._held: dict[str, torch.Tensor] = {}
        self._complete: set[str] = set()
        self.owner: dict[str, str] = {}
        self.tokens: dict[str, int] = {}
        self._windows: dict[str, int] = {}  # windows seen per owner: where the next batch starts
        self._last: tuple[torch.Tensor, str] | None = None

    def add(self, name: str, x: torch.Tensor) -> str:
        """Account ``x`` (the input of linear ``name``, ``[windows, L, in]``, the batches in window order);
        returns the name owning its accumulator."""
        if self._last is not None and self._last[0] is x:
            self.owner[name] = self._last[1]
            return self._last[1]
        check_finite(x, f"the input of {self.prefix}{name}")  # a Gram of NaN or inf is garbage, never a fallback
        self._last = (x, name)
        self.owner[name] = name
        if name not in self._sums:
            self._sums[name] = torch.zeros(x.shape[-1], x.shape[-1], device=x.device)
            self.tokens[name], self._windows[name] = 0, 0
        self._complete.discard(name)
        fit = x
        if self.held_out is not None:
            start = self._windows[name]
            mask = self.held_out[start : start + x.shape[0]].to(x.device)
            self._windows[name] = start + x.shape[0]
            if bool(mask.any()):
                if name not in self._held:
                    self._held[name] = torch.zeros_like(self._sums[name])
                accumulate_gram(self._held[name], x[mask].reshape(-1, x.shape[-1]).to(torch.float32))
                fit = x[~mask]
        x2 = fit.reshape(-1, x.shape[-1]).to(torch.float32)
        accumulate_gram(self._sums[name], x2)
        self.tokens[name] += x2.shape[0]
        return name

    def gram(self, owner: str) -> torch.Tensor:
        """The full ``Xᵀ X`` of ``owner``'s input (the held-out windows' not in it)."""
        if owner not in self._complete:
            symmetrize(self._sums[owner])
            if owner in self._held:
                symmetrize(self._held[owner])
            self._complete.add(owner)
        return self._sums[owner]

    def held(self, owner: str) -> torch.Tensor | None:
        """``Xᵀ X`` of ``owner``'s input over the held-out windows, or None without any."""
        self.gram(owner)
        return self._held.get(owner)

    def release(self) -> None:
        self._last = None


# --------------------------------------------------------------------------- one run


@dataclass
class GPTQRun:
    """One model's run: what it was given and what it has collected so far."""

    targets: dict[str, Scheme]
    options: GPTQOptions
    dtypes: dict[str, torch.dtype | None]  # source dtypes (the stored tensors keep them)
    one_pass: bool  # all windows in one batch: quantize in the forward pre-hooks
    quant_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # importance matrix entries (llama.cpp types)
    tensor_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # nvfp4: a fused group's largest max |w| (GroupScaled)
    # the source weights from the file (``--dtype bf16``/``fp16``: the model runs narrower than it is stored);
    # None: the model's own fp32 weights are the source
    read: Callable[[str], torch.Tensor] | None = None
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    checked: dict[str, float] = field(default_factory=dict)  # tensor -> relative error (check_written)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    routed: dict[str, int] = field(default_factory=dict)  # expert (``...mlp.experts.3``) -> tokens the router sent it


def prepare(run: GPTQRun, XtX: torch.Tensor) -> PreparedHessian:
    """Dead columns, act-order permutation and ``U`` of one input's ``XtX`` (the column maths on one thread)."""
    with one_torch_thread():
        return prepare_hessian(XtX, run.options.dampening, run.options.act_order, run.options.hessian_shrink)


FEW_TOKENS = "rtn (an expert whose Hessian got fewer than --min-expert-tokens tokens)"
NO_TOKENS = "rtn (an expert no calibration token reached)"


def few_tokens(run: GPTQRun, full: str, tokens: int) -> bool:
    """Whether ``full`` is an expert matrix whose Hessian got fewer than ``--min-expert-tokens`` tokens (rtn)."""
    return _few_tokens(full, tokens, run.options)


def rtn_linear(run: GPTQRun, full: str, linear: torch.nn.Linear, XtX: torch.Tensor, tokens: int) -> None:
    """Write ``full`` by rtn (with its importance-matrix entry) instead of GPTQ's solve: an expert whose Hessian
    got too few tokens (``few_tokens``); record it and put the dequantized weights into ``linear``."""
    W = (linear.weight.detach() if run.read is None else run.read(full)).to(device=XtX.device, dtype=torch.float32)
    with one_torch_thread():
        qt, W_hat = rtn_parts(full, W, run.targets[full], run.quant_weights.get(full), tuple(linear.weight.shape),
                              run.dtypes.get(full) or torch.float32, run.tensor_amax.get(full))
    run.checked[full] = check_written(full, W, qt, decoded=W_hat, cause="rtn (an expert with too few calibration tokens)")
    run.layers[full] = {"rtn_error": output_error(W, W_hat, XtX) if tokens else 0.0, "tokens": tokens,
                        "dampening_retries": 0, "fallback": FEW_TOKENS}
    run.quantized[full] = qt
    linear.weight.data.copy_(W_hat.to(linear.weight.device))


def solve_linear(run: GPTQRun, full: str, linear: torch.nn.Linear, XtX: torch.Tensor, prepared: PreparedHessian,
                 tokens: int, shared_seconds: float, held: torch.Tensor | None = None) -> None:
    """Solve the weight ``full`` of ``linear``, keep its ``QuantizedTensor`` and its record, and put the
    dequantized weights into ``linear`` (later linears and blocks see the quantized layer)."""
    scheme = run.targets[full]
    ts = time.perf_counter()
    W = (linear.weight.detach() if run.read is None else run.read(full)).to(device=XtX.device, dtype=torch.float32)
    qw, amax = run.quant_weights.get(full), run.tensor_amax.get(full)
    # Packing and RTN's reference are many small operations on uint8 tensors: on one thread too (with two
    # busy cores a pool made them 20-50x slower: q5_0's packing of a 1536x576 matrix 144 ms, 2 ms on one).
    with one_torch_thread():
        solved = gptq_solve(W, None, scheme, block_size=run.options.block_size, prepared=prepared,
                            scale_rule=run.options.scale_rule, quant_weights=qw,
                            static_groups=run.options.static_groups, tensor_amax=amax)
        seconds = time.perf_counter() - ts
        parts = {k: v.cpu() for k, v in solved.grid.parts(solved.codes, slice(0, W.shape[0])).items()}
        rtn = rtn_dequantized(W, scheme, qw, amax)
    dtype = run.dtypes.get(full) or torch.float32
    qt = QuantizedTensor.from_parts(scheme, parts, tuple(linear.weight.shape), dtype)
    # The solve's dequantized weights are what the stored parts decode to (bit for bit: tested), so
    # the codes need not be unpacked again here.
    W_hat = solved.dequantized
    chosen = {}
    if held is not None:  # RTN's codes where they do better on windows the solve never saw
        gptq_held, rtn_held = output_errors(W, [W_hat, rtn], held)
        chosen = {"gptq_error_held_out": gptq_held, "rtn_error_held_out": rtn_held}
        if rtn_held < gptq_held and not solved.fallback:
            qt, _ = rtn_parts(full, W, scheme, qw, tuple(linear.weight.shape), dtype, amax)
            W_hat, chosen["fallback"] = rtn, "rtn (lower output error on the held-out windows)"
    run.checked[full] = check_written(full, W, qt, decoded=W_hat, cause=(
        f"GPTQ's solve on {tokens} calibration tokens (dampening {solved.dampening:g}); compare --method rtn"))
    rtn_err, gptq_err = output_errors(W, [rtn, W_hat], XtX)
    run.layers[full] = {
        "rtn_error": rtn_err,
        "gptq_error": gptq_err,
        "seconds": round(seconds + shared_seconds, 4),
        "tokens": tokens,
        "dampening": solved.dampening,
        "dampening_retries": solved.retries,
        "dead_columns": solved.dead,
        **({"fallback": "rtn (H not positive definite)"} if solved.fallback else {}),
        **chosen,
    }
    run.quantized[full] = qt
    linear.weight.data.copy_(W_hat.to(linear.weight.device))


class _PreHookSolver:
    """The forward pre-hook of ``quantize_in_forward``: accounts a linear's input, then solves the linear
    before it runs. A new input tensor replaces the cached factor (linears sharing one input come in a row)."""

    def __init__(self, run: GPTQRun, inputs: BlockInputs, linears: dict[str, torch.nn.Linear], acc: HessianInputs):
        self.run, self.inputs, self.linears, self.acc = run, inputs, linears, acc
        self.cache: dict[str, PreparedHessian] = {}

    def __call__(self, n: str, x: torch.Tensor) -> None:
        tp = time.perf_counter()
        owner = self.acc.add(n, x)
        full = self.inputs.prefix + n + ".weight"
        if few_tokens(self.run, full, self.acc.tokens[owner]):
            rtn_linear(self.run, full, self.linears[n], self.acc.gram(owner), self.acc.tokens[owner])
            return
        if owner == n:
            self.cache.clear()
            self.cache[owner] = prepare(self.run, self.acc.gram(owner))
        shared = time.perf_counter() - tp
        solve_linear(self.run, self.inputs.prefix + n + ".weight", self.linears[n], self.acc.gram(owner),
                     self.cache[owner], self.acc.tokens[owner], shared, self.acc.held(owner))


def quantize_in_forward(run: GPTQRun, inputs: BlockInputs, linears: dict[str, torch.nn.Linear],
                        acc: HessianInputs) -> list[torch.Tensor]:
    """True sequential, one pass: each linear quantized in its forward pre-hook, from inputs that already
    went through the block's quantized earlier linears; returns the block's outputs (the next block's inputs)."""
    return inputs.forward(on_input=_PreHookSolver(run, inputs, linears, acc), modules=linears)


def quantize_after_forward(run: GPTQRun, inputs: BlockInputs, linears: dict[str, torch.nn.Linear],
                           acc: HessianInputs) -> None:
    """Batches: every Hessian accumulated with the block's original weights, then each linear solved (the
    walker runs the block again with the quantized weights)."""
    inputs.forward(on_input=acc.add, modules=linears)
    prepared: dict[str, PreparedHessian] = {}
    for n in linears:
        owner = acc.owner.get(n)
        full = inputs.prefix + n + ".weight"
        if owner is None:  # an expert no token reached: written by rtn after the walk
            continue
        if few_tokens(run, full, acc.tokens[owner]):
            rtn_linear(run, full, linears[n], acc.gram(owner), acc.tokens[owner])
            continue
        tp = time.perf_counter()
        if owner not in prepared:
            prepared[owner] = prepare(run, acc.gram(owner))
        solve_linear(run, full, linears[n], acc.gram(owner), prepared[owner], acc.tokens[owner],
                     time.perf_counter() - tp, acc.held(owner))


def quantize_block(run: GPTQRun, i: int, block: torch.nn.Module, inputs: BlockInputs) -> list[torch.Tensor] | None:
    """``walk_blocks``' callback: solve block ``i``'s target linears; returns its outputs when computed."""
    t0 = time.perf_counter()
    linears = {n: m for n, m in inputs.linears().items() if inputs.prefix + n + ".weight" in run.targets}
    if not linears:
        return None
    acc = HessianInputs(inputs.prefix, run.options.held_out() if run.options.holdout else None)
    routed_tokens(block, reset=True)  # counted from here: the pass the Hessians are accumulated on
    if run.one_pass:
        outputs = quantize_in_forward(run, inputs, linears, acc)
    else:
        quantize_after_forward(run, inputs, linears, acc)
        outputs = None
    run.routed.update({inputs.prefix + k: v for k, v in routed_tokens(block).items()})
    acc.release()
    run.blocks.append({"block": i, "seconds": round(time.perf_counter() - t0, 3)})
    return outputs


def gptq_record(run: GPTQRun, provenance: dict[str, Any], rtn_fallback: list[str], seconds: float) -> dict[str, Any]:
    """The manifest's ``method`` record (JSON-able; see docs/gptq.md)."""
    options = run.options
    return {
        "options": dataclasses.asdict(options),
        "calibration": provenance,
        "passes": "one per block (true sequential: each linear quantized in its forward pre-hook)" if run.one_pass
        else "two per block (Hessians with the original weights, then the block re-run quantized)",
        "hessian": "X^T X accumulated in fp32; dampening and the Cholesky factor of the inverse in fp32",
        "scales": ("static groups from the original weights, original column order" if options.act_order or options.static_groups
                   else "per group when its first column is reached, from the error-updated weights"),
        "layers": dict(sorted(run.layers.items())),
        "blocks": run.blocks,
        "dampening_retries": {n: r["dampening_retries"] for n, r in sorted(run.layers.items()) if r["dampening_retries"]},
        # every tensor written by rtn instead of GPTQ's solve, and why (the summary counts them)
        "rtn_fallback": sorted({*rtn_fallback, *(n for n, r in run.layers.items() if "fallback" in r)}),
        "rtn_fallback_reasons": {**{n: "outside the blocks (not a block linear)" for n in rtn_fallback},
                                 **{n: r["fallback"] for n, r in sorted(run.layers.items()) if "fallback" in r}},
        "seconds": round(seconds, 3),
        **({"experts": experts_record(run)} if run.routed else {}),
    }


def experts_record(run: GPTQRun) -> dict[str, Any]:
    """A mixture-of-experts model's part of the record (``methods.experts.experts_record``): an expert's
    tokens calibrated on are those its Hessians were accumulated on."""
    seen: dict[str, int] = {}
    for name, layer in run.layers.items():
        if (expert := expert_of(name)) is not None:
            seen[expert] = min(seen.get(expert, layer["tokens"]), layer["tokens"])
    return _experts_record(run.options, run.routed, seen,
                           (n for n, r in run.layers.items() if r.get("fallback") in (FEW_TOKENS, NO_TOKENS)))


@dataclass
class GPTQMethod:
    """``--method gptq`` (see the module docstring and docs/gptq.md)."""

    name: str = "gptq"
    calibrated: bool = True
    options_type: type = GPTQOptions

    def check(self, scheme: Scheme) -> None:
        check_scheme(scheme)  # nf4 / fp4 rows that are not whole blocks are refused per matrix, before any pass

    def memory(self, model: Model, targets: Mapping[str, Scheme], options: GPTQOptions) -> dict[str, int]:
        """Beside the process (``qkit.methods.memory``). The weights: a memory-mapped load (safetensors at
        their stored dtype, Linux) holds the tensors outside the blocks, one block, and the blocks quantized
        so far (each finished block's pages are handed back); another load, the model at the load dtype
        (each finished block's tensors give way to its codes). Then every window's block inputs and outputs,
        and one block's working set: its forward, a float32 Gram per distinct input (q/k/v and gate/up share
        one), and the solver (``prepare_hessian``: the Gram and three factors of the widest input; the
        column loop: the widest input's factor and six float32 copies of the largest linear)."""
        N, T = options.calibration_samples, options.seqlen
        blocks = model.blocks()
        inside = {n for ns in blocks.values() for n in ns if n in targets}
        weights = walked_weights(model, targets)
        cols = {n: as_2d(model.shapes[n])[1] for n in inside}
        grams = max((4 * sum(cols[n] ** 2 for n in ns if n in cols and not _SHARES_INPUT.search(n))
                     for ns in blocks.values()), default=0) * (2 if options.holdout else 1)  # the held-out Grams
        widest, big = max(cols.values(), default=0), largest(inside, model)
        solver = max(4 * 4 * widest**2, 4 * widest**2 + 6 * 4 * big)
        work = model.block_forward(min(options.batch_size or N, N), T) + grams + solver + 4 * big
        return {**weights, "calibration activations": model.activations(N, T),
                "one block's Hessians and solve": int(RETENTION * max(model.load, work))}

    def run(self, ref: Any, targets: dict[str, Scheme], options: GPTQOptions, *, device: torch.device,
            on_block: Callable[[int, int], None] | None = None,
            quant_weights: Mapping[str, torch.Tensor] | None = None,
            tensor_amax: Mapping[str, torch.Tensor] | None = None) -> MethodResult:
        """``quant_weights``: an importance matrix's entries by tensor (``qkit quantize --imatrix``), which
        weight the llama.cpp types' scale searches; the other schemes refuse one. ``tensor_amax``: nvfp4's
        fused groups' largest ``max |w|`` by tensor (``Choice.tensor_amax``), whose global scale each shard shares."""
        options.check()
        for scheme in targets.values():
            self.check(scheme)
        shapes = dict(tensor_shapes(ref.directory))
        config = read_config(ref.directory)
        # gpt_oss's expert matrices, which its checkpoint stores fused: targets under their per-expert names
        virtual = {n: v for n, v in virtual_experts(shapes, config).items() if n in targets}
        shapes.update({n: v.shape for n, v in virtual.items()})
        for name, scheme in targets.items():  # a matrix a block scheme cannot serve row-wise: refused before any work
            if name in shapes:
                whole_blocks(scheme, as_2d(shapes[name])[1], name)
        # Every recipe resolved per tensor first (q4_k_m: q4_k / q6_k by name, q5_0 / q8_0 for widths that
        # are not whole super-blocks): each linear is solved for the type it will be written as.
        targets = {n: (s.resolve(tuple(shapes[n]), n) if n in shapes else s) for n, s in targets.items()}
        for name, scheme in targets.items():
            if is_llama_type(scheme) and options.scale_rule != "absmax":
                raise InputError(f"--scale-rule {options.scale_rule} applies to absmax schemes; {name} is {scheme.name}, "
                                 "whose scales come from llama.cpp's own search: drop --scale-rule")
        weights = dict(quant_weights or {})
        for name in weights:
            if not is_llama_type(targets.get(name)):
                raise InputError(f"an importance matrix weights llama.cpp's block types; {name} is not one")
        t_start = time.perf_counter()
        check_method(config, self.name, options)  # a mixture-of-experts model gptq cannot route: refused now
        # The calibration text (unreadable, too short, overlapping the eval text) is refused before the model loads.
        ids, provenance = calibration_ids(load_tokenizer(ref.directory, ref.trust_remote_code),
                                          options.calibration_options(config))
        loaded = load(ref=ref, device="cpu", dtype=options.load_dtype)
        batch = options.batch_size or ids.shape[0]
        read = None if options.load_dtype == torch.float32 else expert_reader(ref.directory, targets, virtual)
        dtypes = tensor_dtypes(ref.directory, floating_only=True)
        dtypes.update({n: dtypes.get(v.fused) for n, v in virtual.items()})
        run = GPTQRun(targets, options, dtypes, batch >= ids.shape[0], weights, dict(tensor_amax or {}), read=read)
        # each block's weights are freed once solved: its quantized parts (kept in ``run``) take their place;
        # each expert is one linear per matrix meanwhile, calibrated on the tokens routed to it
        with unfused_experts(loaded.model, config, options.calibrate_all_experts):
            walk_blocks(loaded.model, ids, partial(quantize_block, run), device=device, batch_size=batch,
                        on_block=on_block, release=True)
        del loaded
        rtn_fallback = sorted(set(targets) - set(run.quantized))
        if rtn_fallback:  # targets outside the blocks, experts no token reached: round to nearest (+ imatrix), streamed
            for name, tensor in split_experts(iter_tensors(ref.directory), virtual):
                if name in rtn_fallback:
                    run.quantized[name] = quantize_tensor(tensor, targets[name], name=name, quant_weights=weights.get(name),
                                                          tensor_amax=run.tensor_amax.get(name))
        unreached = [n for n in rtn_fallback if expert_index(n) is not None]
        run.layers.update({n: {"tokens": 0, "dampening_retries": 0, "fallback": NO_TOKENS} for n in unreached})
        record = gptq_record(run, provenance, sorted(set(rtn_fallback) - set(unreached)), time.perf_counter() - t_start)
        if weights:
            record["imatrix_tensors"] = len(weights)
        return MethodResult(quantized=run.quantized, replaced={}, record=record, checked=run.checked)


METHOD = GPTQMethod()

__all__ = ["SCALE_RULES", "GPTQMethod", "GPTQOptions", "GPTQRun", "HessianInputs", "METHOD", "gptq_record",
           "quantize_block", "solve_linear"]
