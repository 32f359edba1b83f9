"""``qkit quantize`` (write a checkpoint) and ``qkit verify`` (check an exported one with its library)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkit import console
from qkit.api import QuantizeOptions, QuantizeProgress, quantize_model
from qkit.cli.common import (
    AlphaOpt,
    CalibrateAllExpertsOpt,
    CalibrationOpt,
    CalibrationSamplesOpt,
    CalibrationSeqlenOpt,
    DeviceOpt,
    ExecutorBackendOpt,
    ForceOpt,
    JsonOpt,
    MaxMemoryOpt,
    MaxModelLenOpt,
    ModelArg,
    NoClipOpt,
    PickleOpt,
    PipelineParallelOpt,
    ScaleDtypeOpt,
    TensorParallelOpt,
    ThreadsOpt,
    TrustOpt,
    calibration_options,
    engine_options,
    handles_errors,
    human_bytes,
    model_inputs,
    parse_list,
    reads,
    start,
)
from qkit.errors import InputError
from qkit.export import QKIT, check_format_output, format_help
from qkit.export.gguf import is_gguf_name
from qkit.export.gguf.tensor_types import (
    is_tensor_type_file,
    read_tensor_type_file,
    types_by_kind,
)
from qkit.memory import parse_size
from qkit.methods import RTN, method_names
from qkit.methods.gptq import DEFAULT_DAMPENING, SCALE_RULES, GPTQOptions
from qkit.methods.expert_options import ExpertOptions
from qkit.outputs import check_output_path
from qkit.plan import PlanOptions
from qkit.plan.options import DEFAULT_CHECK_WINDOWS
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, DEFAULT_SCHEME
from qkit.schemes.table import scheme_help
from qkit.threads import check_threads
from qkit.verify import verify_checkpoint
from qkit.verify.vllm import verify_in_vllm

SchemeOpt = Annotated[str, typer.Option("--scheme", "-s", help=scheme_help())]  # every registered scheme
# A str, not a Path: typer turns an empty -o '' into Path('.'), the current directory.
OutputOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Output directory, or FILE.gguf with --format gguf (an existing one is replaced only with --force, and only if qkit wrote it; never a path that is or holds an input).", metavar="PATH")]
IncludeOpt = Annotated[list[str], typer.Option("--include", help="Also quantize tensors matching this glob (repeatable).")]
ExcludeOpt = Annotated[list[str], typer.Option("--exclude", help="Never quantize tensors matching this glob (repeatable).")]
KeepOpt = Annotated[list[str], typer.Option("--keep", help="SCHEME:GLOB, e.g. int8:'*.down_proj.weight' or none:GLOB (repeatable).")]
FormatOpt = Annotated[str, typer.Option("--format", help=format_help())]
ActivationsOpt = Annotated[Optional[str], typer.Option("--activations", help="int8-token: with --format compressed-tensors and int8-row weights, a W8A8 checkpoint (dynamic per-token int8 activations, the layout vLLM serves); use after --method smoothquant.", show_default=False)]
MethodOpt = Annotated[str, typer.Option("--method", help=f"How the integers and scales are chosen: {', '.join(method_names())} (rtn: round to nearest, no calibration; gptq/awq: calibrated, see --calibration).")]
ActOrderOpt = Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", help=f"gptq: quantize columns by descending Hessian diagonal, scales as static groups; the checkpoint keeps the original column order (default: {'on' if GPTQOptions.act_order else 'off'}; off: the reference's order, group scales from the error-updated weights).", show_default=False)]
ScaleRuleOpt = Annotated[Optional[str], typer.Option("--scale-rule", help=f"gptq: how absmax scales are chosen: {', '.join(SCALE_RULES)} (default absmax: qkit's rule, what rtn writes; full-range: absmax/(qmax+0.5) with codes in [-qmax-1, qmax], compressed-tensors' rule; mse: per-group shrink search). Every rule writes the same scheme.", show_default=False)]
DampeningOpt = Annotated[Optional[float], typer.Option("--dampening", help=f"gptq: fraction of the mean Hessian diagonal added to it (default {DEFAULT_DAMPENING}).", show_default=False)]
HessianShrinkOpt = Annotated[Optional[float], typer.Option("--hessian-shrink", help=f"gptq: add this fraction of the Hessian's own diagonal to it, pulling it toward its diagonal (default {GPTQOptions.hessian_shrink:g}, which generalised best to held-out text on the default model, docs/gptq.md; 0: the reference's Hessian).", show_default=False)]
HoldoutOpt = Annotated[Optional[int], typer.Option("--holdout", help=f"gptq: calibration windows kept out of the Hessian, spread over the text; on them each tensor's GPTQ codes and RTN's are compared by output error and the better is written (default {GPTQOptions.holdout}: GPTQ's always).", metavar="N", show_default=False)]
MinExpertTokensOpt = Annotated[Optional[int], typer.Option("--min-expert-tokens", help=f"gptq or awq on a mixture-of-experts model: an expert matrix calibrated on fewer routed tokens is written by rtn (gptq: with --imatrix's entry when given; awq: at scale 1, unclipped), and the record names it (default {ExpertOptions.min_expert_tokens}).", metavar="N", show_default=False)]
ImatrixOpt = Annotated[Optional[str], typer.Option("--imatrix", help="An importance matrix (qkit imatrix, or llama-imatrix's .gguf / legacy .dat): llama.cpp's block types quantize through their weighted searches, as llama-quantize --imatrix does.", metavar="FILE")]
TensorTypeOpt = Annotated[list[str], typer.Option("--tensor-type", help="PATTERN=TYPE as llama-quantize --tensor-type: a regex searched in llama.cpp's tensor names (blk.3.attn_v.weight), a ggml type (repeatable; the first match wins).", metavar="PATTERN=TYPE")]
TensorTypeFileOpt = Annotated[Optional[str], typer.Option("--tensor-type-file", help="A file of PATTERN=TYPE words separated by spaces or newlines (llama-quantize's --tensor-type-file).", metavar="FILE")]
TokenEmbeddingTypeOpt = Annotated[Optional[str], typer.Option("--token-embedding-type", help="A recipe's token_embd in this type instead of llama.cpp's (as llama-quantize's option): a ggml type (q8_0, q6_k, ...) or f32/f16/bf16 to keep it unquantized.", metavar="TYPE")]
OutputTensorTypeOpt = Annotated[Optional[str], typer.Option("--output-tensor-type", help="A recipe's output head (and a tied token_embd, without --token-embedding-type) in this type instead of llama.cpp's: a ggml type or f32/f16/bf16.", metavar="TYPE")]
EmitTensorTypesOpt = Annotated[Optional[str], typer.Option("--emit-tensor-types", help="Also write the --tensor-type-file with which llama-quantize gives every quantized tensor the type qkit gave it.", metavar="PATH")]
PlanFileOpt = Annotated[Optional[str], typer.Option("--plan", help="Write every planned tensor in the type a plan chose (qkit plan -o PLAN.json); replaces --scheme.", metavar="PLAN.json")]
QTargetBitsOpt = Annotated[Optional[float], typer.Option("--target-bits", help="Plan (as qkit plan does, for this --format) and quantize in one step: bits per weight over the block projections.", metavar="B")]
QTargetSizeOpt = Annotated[Optional[str], typer.Option("--target-size", help="Plan and quantize in one step: bytes of the whole file's tensors (the tensors outside the plan count against it), e.g. 100MB.", metavar="SIZE")]
QCandidatesOpt = Annotated[Optional[str], typer.Option("--candidates", help="With --target-bits/--target-size: only these types (comma-separated; default: the format's whole ladder).", metavar="LIST")]
MaxShardOpt = Annotated[Optional[str], typer.Option("--max-shard-size", help="Largest output shard, e.g. 500MB or 2GB (default 2GiB); bounds peak memory.", metavar="SIZE")]


QDtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="The dtype the model runs in while a calibrated --method (gptq, imatrix) or a --target-bits plan runs it: fp32, bf16, fp16 (bf16 halves the model's memory; the weights are quantized from the file's own dtype) [default: fp32].")]


@handles_errors
def quantize(
    model: ModelArg = None,
    scheme: SchemeOpt = DEFAULT_SCHEME,
    output: OutputOpt = None,
    force: ForceOpt = False,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    include: IncludeOpt = [],
    exclude: ExcludeOpt = [],
    keep: KeepOpt = [],
    fmt: FormatOpt = QKIT,
    method: MethodOpt = RTN,
    calibration: CalibrationOpt = None,
    calibration_samples: CalibrationSamplesOpt = None,
    calibration_seqlen: CalibrationSeqlenOpt = None,
    act_order: ActOrderOpt = None,
    dampening: DampeningOpt = None,
    holdout: HoldoutOpt = None,
    hessian_shrink: HessianShrinkOpt = None,
    calibrate_all_experts: CalibrateAllExpertsOpt = False,
    min_expert_tokens: MinExpertTokensOpt = None,
    scale_rule: ScaleRuleOpt = None,
    alpha: AlphaOpt = None,
    no_clip: NoClipOpt = False,
    activations: ActivationsOpt = None,
    max_shard_size: MaxShardOpt = None,
    imatrix: ImatrixOpt = None,
    tensor_type: TensorTypeOpt = [],
    tensor_type_file: TensorTypeFileOpt = None,
    token_embedding_type: TokenEmbeddingTypeOpt = None,
    output_tensor_type: OutputTensorTypeOpt = None,
    emit_tensor_types: EmitTensorTypesOpt = None,
    plan: PlanFileOpt = None,
    target_bits: QTargetBitsOpt = None,
    target_size: QTargetSizeOpt = None,
    candidates: QCandidatesOpt = None,
    device: DeviceOpt = None,
    dtype: QDtypeOpt = None,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
    threads: ThreadsOpt = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Write a quantized safetensors checkpoint of MODEL (qkit's format, or one vLLM/transformers load)."""

    # Every check that needs no model comes first: the outputs against each other (qkit.outputs.check_apart:
    # --json and --emit-tensor-types may go inside a directory -o, written after it is in place, never be it or
    # hold it) and -o against what the arguments name, the files only the command line reads (the tensor-type
    # file) among them; quantize_model checks both outputs again, against the resolved model too, and the
    # scheme, rules, method options and device, before it reads the model.
    run = start(json_path, force, threads, reads(model, ("the calibration text", calibration),
                                                  ("the importance matrix", imatrix), ("the tensor-type file", tensor_type_file),
                                                  ("the plan", plan)),
                writes=[("-o", output), ("--emit-tensor-types", emit_tensor_types)],
                may_hold=() if output is None or is_gguf_name(output) else ("-o",))
    if output is None:
        raise InputError("missing -o/--output: the directory to write the quantized checkpoint to")
    check_format_output(fmt, output, force, run.inputs)  # an unknown --format first, in the registry's words
    if emit_tensor_types is not None:
        check_output_path(emit_tensor_types, kind="file", force=force, inputs=run.inputs, what="--emit-tensor-types",
                          owned=is_tensor_type_file, describe="a tensor-type file qkit wrote")
    words = [*tensor_type, *read_tensor_type_file(tensor_type_file)]
    dtype = dtype.lower() if dtype is not None else None
    limit = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    planned = _plan_option(plan, target_bits, target_size, fmt, scheme, scale_dtype, calibration, candidates,
                           calibration_samples, calibration_seqlen, dtype, limit)
    if isinstance(planned, PlanOptions) and method == RTN:  # the calibration options and --dtype are the plan's
        calibration = calibration_samples = calibration_seqlen = dtype = None
    shard = {"max_shard_bytes": parse_size(max_shard_size, "--max-shard-size")} if max_shard_size else {}
    check_threads(threads)
    method_options = calibration_options(calibration, calibration_samples, calibration_seqlen,
                                         act_order=act_order, dampening=dampening, hessian_shrink=hessian_shrink, holdout=holdout, scale_rule=scale_rule,
                                         alpha=alpha, clip=False if no_clip else None, dtype=dtype,
                                         calibrate_all_experts=calibrate_all_experts or None,
                                         min_expert_tokens=min_expert_tokens)
    run.use_threads()
    with console.progress() as bar:

        def progress(step: QuantizeProgress) -> None:
            if step.stage == "calibrating" and step.done == 1:
                bar.start(f"calibrating ({method}), block by block", step.total)
            elif step.stage == "quantizing" and step.done == 0:
                bar.start(f"quantizing ({scheme})", step.total)
                return
            bar.advance()

        options = QuantizeOptions(scheme=scheme, scale_dtype=scale_dtype, include=include, exclude=exclude, keep=keep,
                                  format=fmt, activations=activations, method=method,
                                  method_options=method_options or None, device=device, allow_pickle=allow_pickle,
                                  trust_remote_code=trust_remote_code, force=force, imatrix=imatrix,
                                  tensor_types=tuple(words), plan=planned, max_memory=limit,
                                  token_embedding_type=token_embedding_type, output_tensor_type=output_tensor_type,
                                  emit_tensor_types=emit_tensor_types, **shard)
        result = quantize_model(model, output=output, options=options, progress=progress)
    render_quantize(result)
    for note in result.notes:
        console.warn(note)
    if result.tensor_types is not None:
        console.note(f"wrote {result.tensor_types}: llama-quantize --tensor-type-file {result.tensor_types} gives every "
                     "quantized tensor the type it has here")
    run.write_json(result.to_dict)


def _plan_option(plan: str | None, target_bits: float | None, target_size: str | None, fmt: str, scheme: str,
                 scale_dtype: str, calibration: str | None, candidates: str | None = None,
                 samples: int | None = None, seqlen: int | None = None, dtype: str | None = None,
                 max_memory: int | None = None):
    """``--plan FILE``, or ``--target-bits``/``--target-size`` as the options of a plan made first; None."""
    given = [w for w, v in (("--plan", plan), ("--target-bits", target_bits), ("--target-size", target_size)) if v is not None]
    allowed = parse_list(candidates, "--candidates", what="type", where="e.g. q4_k,q6_k", spaces=True)
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} both choose the types: give one of them")
    if not given:
        if allowed is not None:
            raise InputError("--candidates chooses what --target-bits/--target-size may plan; add one of them, or drop it")
        return None
    if scheme != DEFAULT_SCHEME:
        raise InputError(f"{given[0]} chooses every planned tensor's type; drop --scheme {scheme}")
    if candidates is not None and plan is not None:
        raise InputError("--candidates chooses what --target-bits/--target-size may plan; a --plan file has its types")
    if plan is not None:
        return plan
    size = parse_size(target_size, "--target-size") if target_size is not None else None
    sizes = {k: v for k, v in (("samples", samples), ("seqlen", seqlen), ("dtype", dtype), ("max_memory", max_memory))
             if v is not None}
    if samples is not None:  # the check measures on the first windows: never more than there are
        sizes["check_windows"] = min(DEFAULT_CHECK_WINDOWS, samples)
    options = PlanOptions(format=fmt, target_bits=target_bits, target_size=size, scale_dtype=scale_dtype,
                          calibration=calibration, candidates=allowed or (),
                          **sizes)
    options.check()
    return options


def render_quantize(result) -> None:
    used = ", ".join(f"{k} x{v}" for k, v in sorted(result.schemes_used.items()))
    imatrix = result.imatrix
    console.table(
        ["", ""],
        [
            ["output", str(result.output)],
            ["format", result.format],
            ["scheme", used],
            ["matrices quantized", f"{result.matrices:,}"],
            ["parameters quantized", f"{result.parameters:,}"],
            ["bits per weight", f"{result.bits_per_weight:.3f}"],
            ["size before", human_bytes(result.bytes_before)],
            ["size after", human_bytes(result.bytes_after)],
            ["kept unquantized", kept_row(result.kept, result.bytes_after)],
            ["seconds", f"{result.seconds:.1f}"],
            *_method_rows(result),
            *([["importance matrix", f"{imatrix['file']} ({imatrix['entries']} entries, {imatrix['chunk_count']} chunks; "
                                     f"{imatrix['weighted_tensors']} tensors weighted)"]] if imatrix else []),
        ],
        title=f"qkit quantize: {result.model}",
        show_header=False,
    )
    if len(result.schemes_used) > 1:  # a recipe, a fallback or overrides: which tensors got which type
        kinds = types_by_kind(result.types)
        names = sorted({t for per in kinds.values() for t in per})
        console.table(["tensor", *names], [[k, *(str(per.get(t, "")) for t in names)] for k, per in kinds.items()],
                      title="types written, by tensor (count of layers)")


def kept_row(kept: dict[str, int], file_bytes: int) -> str:
    """What stays unquantized and its share of the file: "61 tensors (model.layers.N.input_layernorm x30,
    ...), 140.5 kB, 0.1% of the file" (the two kinds of tensor that take the most bytes first)."""
    if not kept:
        return "nothing"
    by_kind: dict[str, list[int]] = {}
    for name, n in kept.items():
        (kind,) = types_by_kind({name: ""})  # the name without its layer index
        count = by_kind.setdefault(kind, [0, 0])
        count[0], count[1] = count[0] + 1, count[1] + n
    kinds = sorted(by_kind.items(), key=lambda kv: (-kv[1][1], kv[0]))
    shown = ", ".join(f"{k} x{c}" for k, (c, _) in kinds[:2]) + (", ..." if len(kinds) > 2 else "")
    total = sum(kept.values())
    share = 100 * total / file_bytes if file_bytes else 0.0
    return f"{len(kept):,} tensors ({shown}), {human_bytes(total)}, {share:.1f}% of the file"


def _method_rows(result) -> list[list[str]]:
    """What a calibrated method did: its name, calibration text and, where recorded, the output error."""
    if result.method == RTN:
        return []
    rec = result.method_record or {}
    cal = rec.get("calibration") or {}
    rows = [["method", result.method]]
    if cal:
        # gptq/awq sample windows (samples x seqlen); imatrix takes consecutive chunks, as llama-imatrix does
        windows, width = cal.get("samples", cal.get("chunks")), cal.get("seqlen", cal.get("chunk_size"))
        rows.append(["calibration", f"{cal.get('name')} ({windows} x {width} tokens, "
                                    f"sha256 {str(cal.get('sha256'))[:12]}...)"])
    layers = [v for v in (rec.get("layers") or {}).values() if "rtn_error" in v and f"{result.method}_error" in v]
    if layers:
        rtn = sum(v["rtn_error"] for v in layers) / len(layers)
        got = sum(v[f"{result.method}_error"] for v in layers) / len(layers)
        rows.append(["output error ||WX-ŴX||²/||WX||²", f"{got:.5f} ({result.method}) vs {rtn:.5f} (rtn), "
                                                        f"mean of {len(layers)} matrices on the calibration inputs"])
    reasons = rec.get("rtn_fallback_reasons") or {}
    if reasons:  # a fallback is never silent: how many, and why
        why = Counter(reasons.values())
        rows.append(["written by rtn instead", f"{len(reasons)} of {rec.get('matrices', result.matrices)} matrices ("
                     + ", ".join(f"{k}: {v}" for k, v in sorted(why.items())) + ")"])
    groups = [v for v in (rec.get("groups") or {}).values() if "loss_rtn" in v and "loss_final" in v]
    if groups:  # awq: each group's output error, its final (scaled, clipped) weights against plain RTN
        ratio = math.exp(sum(math.log(v["loss_final"] / v["loss_rtn"]) for v in groups if v["loss_rtn"] > 0
                             and v["loss_final"] > 0) / len(groups))
        rows.append(["group output MSE, awq / rtn", f"{ratio:.3f} (geometric mean over {len(groups)} groups, "
                                                    "calibration windows of the search)"])
    smoothed = [v for v in (rec.get("groups") or {}).values() if "outlier_ratio_before" in v]
    if smoothed:  # smoothquant: how far the largest input channel sits above the median one
        before = max(v["outlier_ratio_before"] for v in smoothed)
        after = max(v["outlier_ratio_after"] for v in smoothed)
        rows.append(["input max/median channel", f"{before:,.1f} -> {after:,.1f} (worst of {len(smoothed)} groups, "
                                                 f"alpha {rec.get('options', {}).get('alpha')})"])
    return rows


# --------------------------------------------------------------------------- verify (export conformance)


@handles_errors
def verify(
    checkpoint: Annotated[str, typer.Argument(help="A directory written by qkit quantize --format compressed-tensors|bitsandbytes, or a .gguf file (or directory) of --format gguf.", show_default=False)],
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustOpt = False,
    runtime: Annotated[Optional[str], typer.Option("--runtime", help="Who reads the export: the target library (default: transformers + compressed-tensors / bitsandbytes / gguf) or vllm (vLLM serves the directory; compared on log-probabilities).", metavar="NAME")] = None,
    tensor_parallel_size: TensorParallelOpt = None,
    pipeline_parallel_size: PipelineParallelOpt = None,
    distributed_executor_backend: ExecutorBackendOpt = None,
    max_model_len: MaxModelLenOpt = None,
) -> None:
    """Load an exported CHECKPOINT with its target library and compare it with qkit, weight by weight and on logits."""
    if not checkpoint.strip():  # Path("") would be the current directory: an empty shell variable, most likely
        raise InputError("CHECKPOINT is empty; name the directory or .gguf file qkit quantize wrote")
    path = Path(checkpoint)
    engine = engine_options(tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, max_model_len)
    engine.validate()  # every number given is checked, with --runtime or without
    if runtime is not None and runtime.strip().lower() not in ("vllm",):
        raise InputError(f"--runtime for qkit verify is vllm (or leave it out for the target library), got {runtime!r}")
    if runtime is None and engine.parallel:
        raise InputError("--tensor-parallel-size, --pipeline-parallel-size and --distributed-executor-backend are vLLM's; "
                         "add --runtime vllm")
    run = start(json_path, force, threads, model_inputs(path, "the checkpoint"))
    run.use_threads()
    if runtime is not None:
        r = verify_in_vllm(path, engine, trust_remote_code=trust_remote_code)
        render_engine_verify(r)
    else:
        r = verify_checkpoint(path, device=device, trust_remote_code=trust_remote_code)
        render_verify(r)
    run.write_json(r.to_dict)
    if not r.passed:
        raise typer.Exit(1)


def render_engine_verify(r) -> None:
    console.table(["max |Δ log-prob|", "tolerance", "top-1 same", "positions", "top-k"],
                  [[f"{r.max_abs_diff:.3g}", f"{r.tolerance:.3g}", f"{r.top1_same}", f"{r.positions}", f"{r.top_k}"]],
                  title=f"qkit verify --runtime vllm: {r.checkpoint} ({r.format}, served by {r.engine}, {r.dtype})")
    console.note(f"log-probabilities at the engine's top-{r.top_k} ids on a fixed {r.prompt_tokens}-token prompt, "
                 f"against qkit's reading of the same files: {r.rule}")
    for n in r.notes:
        console.note(n)
    console.note("verified" if r.passed else "NOT verified", style="bold green" if r.passed else "bold red")


def render_verify(r) -> None:
    rows = [[scheme, f"{v['tensors']}", f"{v['match_export']}", f"{v['identical']}", f"{v['within_tolerance']}",
             f"{v['max_abs_diff']:.3g}"] for scheme, v in r.by_scheme().items()]
    console.table(["scheme", "tensors", "decode = written", "bit-identical", "within rule", "max |diff|"], rows,
                  title=f"qkit verify: {r.checkpoint} ({r.format}, read by {r.library}, {r.dtype} on {r.device})")
    if r.experts:
        console.note(f"{r.experts} of the {len(r.tensors)} tensors are expert matrices, each compared with its rows of "
                     "the library's fused experts (gate_up_proj, down_proj)")
    console.note(f"weights: {r.weight_rule} required: {'ok' if r.weights_ok else 'FAILED'}")
    failed = r.failed()
    if failed:
        console.note(f"failed: {', '.join(failed[:3])}" + (f" and {len(failed) - 3} more" if len(failed) > 3 else ""))
    console.note(f"logits on a fixed {r.prompt_tokens}-token prompt: max |diff| {r.logits_max_abs_diff:.3g} "
                 f"(tolerance {r.logits_tolerance:.3g}, max |logit| {r.logits_scale:.3g}): {'ok' if r.logits_ok else 'FAILED'}")
    if r.activations is not None:
        a = r.activations
        console.note(f"activations (W8A8): the logits above use compressed-tensors' own per-token rule on qkit's side; "
                     f"against qkit's {a['simulation']} simulation max |diff| {a['max_abs_diff']:.3g} (tolerance "
                     f"{a['tolerance']:.3g} = 2 x the activation quantization's own effect {a['activation_effect']:.3g}): "
                     f"{'ok' if a['ok'] else 'FAILED'}")
    console.note("verified" if r.passed else "NOT verified", style="bold green" if r.passed else "bold red")
