"""Library entry points the CLI wraps: ``quantize_model`` and ``load``.

Layer 6, below ``evaluation`` and ``inspect``, which build their rows through ``quantize_model``. Each is
a plain function a script calls; ``quantize_model``'s settings are one ``QuantizeOptions`` value (every
default defined there, once), its progress one callback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from qkit import converted
from qkit.choice import Choice, QuantizeOptions, Request, check_memory, compile_choice, llama_names_of, request
from qkit.checkpoint import checkpoint_bytes, tensor_dtypes, tensor_shapes
from qkit.dtypes import load_dtype
from qkit.errors import InputError, OutputError
from qkit.export import PreparedExport, atomic_output, check_format_output, prepare_export
from qkit.export.gguf import is_gguf_name
from qkit.export.gguf.tensor_types import is_tensor_type_file, write_tensor_type_file
from qkit.methods import RTN, CalibratedOptions, MethodResult
from qkit.methods.calibration import model_context
from qkit.methods.gptq import GPTQMethod
from qkit.methods.imatrix import (
    Imatrix,
    ImatrixOptions,
    check_collect_memory,
    collect,
    imatrix_ids,
    imatrix_record,
    quant_weights_for,
    refuse_unsupported,
    write_gguf,
)
from qkit.methods.imatrix import read as read_imatrix
from qkit.methods.imatrix.file import is_qkit_imatrix
from qkit.methods.imatrix.method import matrix_for
from qkit.models import ModelRef, load_tokenizer, parse_device, read_config, resolve_clear_of
from qkit.models import load as _load
from qkit.outputs import check_apart, claim_output, file_inputs, model_inputs, scoped
from qkit.outputs import check_output_path
from qkit.plan import (
    KeptMeasurements,
    Plan,
    PlanOptions,
    choose,
    is_plan_file,
    planned_targets,
    precheck,
    sensitivity_table,
    write_plan,
)
from qkit.plan.planfile import plan_llama_types
from qkit.plan import check as check_plan
from qkit.schemes import get_scheme
from qkit.staging import remove_stale_siblings, staged
from qkit.transform import shapes_fingerprint
from qkit.version import __version__
from qkit.writing import (
    Progress,
    QuantizeProgress,
    QuantizeResult,
    block_progress,
    check_tensor_types,
    emit_tensor_types,
    report,
    write_checkpoint,
)

__all__ = ["ImatrixOptions", "ImatrixResult", "PlanResult", "QuantizeOptions", "QuantizeProgress", "QuantizeResult",
           "block_progress", "imatrix_model", "load", "plan_model", "quantize_model", "resolve_clear_of"]

load = _load
_log = logging.getLogger("qkit")  # INFO records: status lines on the command line (console.show_library_status)


@scoped  # the outputs it claims are released when it returns or raises
def quantize_model(
    model: str | Path | ModelRef | None = None,
    *,
    output: str | Path,
    options: QuantizeOptions | None = None,
    progress: Progress | None = None,
    collect: bool = False,
    scheme: str | None = None,
    method: str | None = None,
    method_options: Mapping[str, object] | None = None,
    format: str | None = None,
    kept: KeptMeasurements | None = None,
) -> QuantizeResult:
    """Quantize MODEL's block projections and write a checkpoint to ``output``; returns what it did.

    ``model``: a local directory, a hub id, a GGUF file, None (the default model), or a ``ModelRef``
    already resolved (``qkit.models.resolve``). ``options``: a ``QuantizeOptions``; ``scheme``,
    ``method``, ``method_options`` and ``format`` given here replace the options' own, so a script
    says the common things in one call::

        quantize_model("HuggingFaceTB/SmolLM2-135M", output="out/nf4", scheme="nf4")
        quantize_model(None, output="out/g64", scheme="int4-g64", method="gptq",
                       method_options={"calibration_samples": 16},
                       options=QuantizeOptions(device="cuda", keep=("int8-row:*.down_proj.weight",)))

    ``progress(QuantizeProgress)`` (optional) is told each calibrated block and each written tensor.
    ``collect``: keep the quantized tensors (and any full-precision tensors a method replaced) in the result.

    Streams: one source tensor at a time (memory-mapped), output flushed shard by shard.
    ``format``: ``qkit`` (default), or ``compressed-tensors`` / ``bitsandbytes`` for a checkpoint those
    libraries load, or ``gguf`` for one llama.cpp file (``output`` ending in ``.gguf``, else a directory
    holding ``model.gguf``; see ``qkit.export``); a scheme the format cannot express is refused before any work.
    ``output`` is refused before any work (``qkit.outputs.check_output_path``) if it is, contains or lies inside
    an input (the model as given and as resolved, the calibration file), whatever ``force``; if it exists,
    unless ``force`` and qkit wrote it; and if its place cannot be written (read-only, full, not a directory).
    ``method``: ``rtn`` (default: round to nearest, streamed) or a calibrated method (``qkit.methods``:
    ``gptq``, ``awq``, ...) with its ``method_options``; a method runs over the whole model first (its
    progress as ``"calibrating"`` steps), then the same writer stores its tensors. What the method
    did (options, calibration text and sha256) goes into the manifest under ``method``.
    ``trust_remote_code``: allow the model's own Python (``qkit.models.custom_code``); without it such a
    model is refused before any work, and every transformers call is told ``False``.
    ``plan``: a plan file or ``Plan`` gives every planned tensor its type; ``PlanOptions`` plans first
    (``_plan_first``: ``plan_model`` on the resolved model, in memory; ``quantize --target-bits``), then writes
    that plan as a plan file would be written; ``kept`` (``qkit.plan.KeptMeasurements``, one per run): the
    sensitivity measured for it is kept there for the run's next plan of the same model (None: nothing kept).
    ``activations``: with ``format="compressed-tensors"`` and ``int8-row`` weights, ``"int8-token"`` writes
    a W8A8 checkpoint (dynamic per-token int8 activations, ``int-quantized``: the layout vLLM serves; see
    ``qkit.export.compressed_tensors_w8a8``), typically after ``method="smoothquant"``.
    """
    t0 = time.perf_counter()
    given_here = {"scheme": scheme, "method": method, "method_options": method_options, "format": format}
    opts = dataclasses.replace(options or QuantizeOptions(), **{k: v for k, v in given_here.items() if v is not None})
    if output is None or str(output) == "":
        raise OutputError("-o is empty; give the directory (or FILE.gguf with --format gguf) to write to")
    out = Path(output)
    # The outputs are checked before any work, against what the arguments name and (once resolved) the model.
    given = [*(model_inputs(model) if not isinstance(model, ModelRef) else []),
             *file_inputs("the calibration text", opts.calibration()), *file_inputs("the importance matrix", opts.imatrix),
             *file_inputs("the plan", opts.plan if isinstance(opts.plan, (str, Path)) else None)]
    # --emit-tensor-types may go inside a directory -o (written after it is in place), never be it or hold it
    check_apart([("-o", out), ("--emit-tensor-types", opts.emit_tensor_types)],
                may_hold=() if is_gguf_name(out) else ("-o",))
    _check_quantize_outputs(opts, out, given)
    req = request(opts)  # every option parsed and checked before the model is read
    _remove_stale(out)
    dev = parse_device(opts.device)
    ref, inputs = resolve_clear_of(model, given, partial(_check_quantize_outputs, opts, out),
                                   allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code,
                                   quantized="{spec} is already a qkit checkpoint; quantize the original model instead")
    shapes, config = dict(tensor_shapes(ref.directory)), read_config(ref.directory)
    if isinstance(req.method_options, CalibratedOptions):  # a default window fitted to the context, then checked
        req = dataclasses.replace(req, method_options=req.method_options.fitted(config))
    if converted.takes(opts.format, config):  # GGUF of another architecture: llama.cpp's converter, then llama-quantize's file
        converted.check(req, opts, ref, config)
        return converted.quantize(req, opts, ref, config, out, t0, dev)
    if isinstance(req.plan, PlanOptions):  # the estimate (compile_choice checks it again) before the plan's work
        check_memory(req, ref, shapes, config)
    choice = compile_choice(req, ref, shapes, config, _plan_first(req, ref, opts, kept))
    if opts.emit_tensor_types is not None:
        check_tensor_types(choice)
    export = prepare_export(opts.format, ref.directory, choice.targets, shapes, choice.manifest, ref=ref,
                            activations=opts.activations)
    done = _run_method(req, ref, choice, export, dev, progress)
    result = QuantizeResult(out, ref.spec, choice.default.name, 0, 0, 0.0, checkpoint_bytes(ref.directory), 0, 0.0,
                            format=export.format.name, method=req.method.name if req.method else RTN,
                            method_record=choice.manifest.get("method", {}), imatrix=choice.manifest.get("imatrix"),
                            plan=choice.manifest.get("plan"), notes=list(choice.notes))
    with atomic_output(export, out, opts.force, inputs) as tmp:
        write_checkpoint(tmp, ref, choice, export, done, result, opts, dev, progress, collect)
    if opts.emit_tensor_types is not None:  # after -o is in place: the file may lie inside its directory
        emit_tensor_types(opts.emit_tensor_types, result)
    result.bytes_after = export.format.output_bytes(out)
    result.seconds = time.perf_counter() - t0
    return result


def _check_quantize_outputs(opts: QuantizeOptions, out: Path, inputs: list) -> None:
    """``-o`` and ``--emit-tensor-types`` checked against ``inputs`` (what the arguments name, then the resolved
    model too: ``qkit.outputs.check_output_path``) and claimed for this run: a second run writing either refuses
    until this one has put it in place."""
    check_format_output(opts.format, out, opts.force, inputs)
    claim_output(out, "-o")
    if opts.emit_tensor_types is not None:
        check_output_path(opts.emit_tensor_types, kind="file", force=opts.force, inputs=inputs, what="--emit-tensor-types",
                          owned=is_tensor_type_file, describe="a tensor-type file qkit wrote")
        claim_output(opts.emit_tensor_types, "--emit-tensor-types")


def _remove_stale(out: Path) -> None:
    """Remove the staging siblings killed runs left beside ``out`` (their writer process gone), before the work:
    told as a status line (the ``qkit`` logger's INFO, which the command line shows)."""
    removed = remove_stale_siblings(out)
    if removed:
        _log.info(f"removed {len(removed)} temporary director{'ies' if len(removed) > 1 else 'y'} of killed runs "
                  f"(their writer process is gone): {', '.join(str(p) for p in removed)}")


def _plan_first(req: Request, ref: ModelRef, opts: QuantizeOptions, kept: KeptMeasurements | None) -> Plan | None:
    """The plan to write: the one ``opts.plan`` gave (a file or ``Plan``, read by ``request``), or, for
    ``PlanOptions`` (``quantize --target-bits``), one ``plan_model`` makes now, in memory, with the same
    importance matrix and method; None without a plan."""
    if not isinstance(req.plan, PlanOptions):
        return req.plan
    gptq = req.method_options if isinstance(req.method, GPTQMethod) else None
    planned = dataclasses.replace(req.plan, imatrix=opts.imatrix, method=opts.method, device=opts.device,
                                  trust_remote_code=opts.trust_remote_code, gptq_options=gptq)
    return plan_model(ref, options=planned, kept=kept).plan


def _run_method(req: Request, ref: ModelRef, choice: Choice, export: PreparedExport, dev: torch.device,
                progress: Progress | None) -> MethodResult | None:
    """Run a calibrated method over the whole model (None for rtn); its record goes into the manifest (and an
    export's copy of it)."""
    if req.method is None:
        return None
    on_block = None if progress is None else partial(report, progress, "calibrating")
    extras = {"quant_weights": choice.weights} if req.matrix is not None else {}
    if choice.tensor_amax and req.method.name == "gptq":  # nvfp4's fused layers: one global scale (GroupScaled)
        extras["tensor_amax"] = choice.tensor_amax
    done = req.method.run(ref, choice.targets, req.method_options, device=dev, on_block=on_block, **extras)
    choice.manifest["method"] = {"name": req.method.name, **done.record}
    if "imatrix" in done.record:
        choice.manifest["imatrix"] = done.record["imatrix"]
    # a format that copied the manifest when it was prepared sees what the method did
    export.manifest.update({k: choice.manifest[k] for k in ("method", "imatrix") if k in choice.manifest})
    return done



# --------------------------------------------------------------------------- planning


@dataclass
class PlanResult:
    """What ``plan_model`` chose (``plan``), where it wrote it, and the seconds it took."""

    plan: Plan
    output: Path | None
    tensor_types: Path | None
    seconds: float

    def to_dict(self) -> dict:
        return {"output": str(self.output) if self.output else None,
                "tensor_types": str(self.tensor_types) if self.tensor_types else None,
                "seconds": self.seconds, "plan": self.plan.to_dict(timings=True)}  # the file leaves timings out


@scoped
def plan_model(
    model: str | Path | ModelRef | None = None,
    *,
    options: PlanOptions,
    output: str | Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    kept: KeptMeasurements | None = None,
) -> PlanResult:
    """Plan MODEL's types for a byte budget (``qkit.plan``): measured sensitivity, the exact solve,
    the measured check; write the plan JSON to ``output`` (None: keep it in memory) and, for GGUF, the
    ``llama-quantize --tensor-type-file`` that gives every tensor its planned type to
    ``options.emit_tensor_types``. ``options``: a ``PlanOptions``, the budget and how the plan is run
    (method, importance matrix, device, executor, ...; every default defined there, once)::

        plan_model("HuggingFaceTB/SmolLM2-135M", output="plan.json",
                   options=PlanOptions(format="gguf", target_bits=4.5, method="imatrix"))

    Refused before any work: bad options (``PlanOptions.check``), a format that cannot mix, an output that is
    an input or exists (unless ``options.force`` and qkit wrote it), a calibration text that overlaps the eval
    text, a budget below the smallest mix or above the unquantized size (checked from the headers, before the
    model runs), an ``options.max_memory`` below what one tensor's Fisher group needs (estimated from the
    headers and config), a tensor-type file for a model without llama.cpp names.
    ``progress(stage, done, total)``: ``fisher`` windows (over every group's pass), ``candidates`` tensors
    (``gptq``: tensors whose GPTQ candidates are solved). The per-tensor candidate costs run on
    ``options.executor`` (``--executor ray``: one Ray task per tensor, the same costs; the Fisher, the GPTQ
    feedback and the check stay in this process). ``kept``: a ``KeptMeasurements`` the run's plans share (the
    sensitivity table and the loaded model, for the next plan of the same model); None: nothing outlives the call."""
    t0 = time.perf_counter()
    options.check()  # the budget and how the plan is run: no file of the model read yet
    given = [*(model_inputs(model) if not isinstance(model, ModelRef) else []),
             *file_inputs("the calibration text", options.calibration),
             *file_inputs("the importance matrix", options.imatrix)]
    check_apart([("-o", output), ("--emit-tensor-types", options.emit_tensor_types)])
    _check_plan_outputs(options, output, given)
    matrix = read_imatrix(options.imatrix) if options.imatrix is not None else None
    ref, _ = resolve_clear_of(model, given, partial(_check_plan_outputs, options, output), allow_pickle=options.allow_pickle,
                              trust_remote_code=options.trust_remote_code,
                              quantized="{spec} is already a qkit checkpoint; plan for the original model")
    dev = parse_device(options.device)
    shapes, config = dict(tensor_shapes(ref.directory)), read_config(ref.directory)
    options = options.fitted(config)  # the default window fitted to the context; a given one checked against it
    precheck(ref, options, config, device=dev, kept=kept)  # the byte budget and the memory (--max-memory): from the headers
    names = _tensor_type_names(options, config, shapes)  # before the work: a model llama.cpp does not name
    if options.collects:
        refuse_unsupported(config)
        matrix, _ = matrix_for(ref, ImatrixOptions(), dev)
    weights, key = _plan_weights(ref, options, config, shapes, matrix)
    with options.executor.open(torch.get_num_threads()) as ex:  # Ray connected (or started) for the costs, shut down after
        table = sensitivity_table(ref, options, device=dev, quant_weights=weights, imatrix_key=key, on_step=progress,
                                  gptq=options.gptq, executor=ex, kept=kept)
    record = imatrix_record(matrix, len(weights)) if matrix is not None else None
    plan = choose(table, options, model_spec=ref.spec, shapes_all=shapes, method=options.method, imatrix=record,
                  config=config, dtypes_all=tensor_dtypes(ref.directory))
    check_plan(plan, table, ref, weights, kept)
    out, tt = _write_plan_files(plan, output, options.emit_tensor_types, names, tensor_dtypes(ref.directory))
    return PlanResult(plan, out, tt, time.perf_counter() - t0)


def _check_plan_outputs(options: PlanOptions, output: str | Path | None, inputs: list) -> None:
    """Both files a plan writes (``-o``, ``--emit-tensor-types``) checked against ``inputs`` (what the
    arguments name, then the resolved model too) and claimed for this run."""
    for path, option, owned, what in ((output, "-o", is_plan_file, "a plan qkit wrote"),
                                      (options.emit_tensor_types, "--emit-tensor-types", is_tensor_type_file,
                                       "a tensor-type file qkit wrote")):
        if path is not None:
            check_output_path(path, kind="file", force=options.force, inputs=inputs, what=option, owned=owned,
                              describe=what)
            claim_output(path, option)  # a second run writing it refuses until this one has put it in place


def _tensor_type_names(options: PlanOptions, config: dict, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """llama.cpp's names of the model's tensors, which ``--emit-tensor-types`` writes ({} without it); a model
    llama.cpp does not name is refused before the plan's work."""
    if options.emit_tensor_types is None:
        return {}
    names = llama_names_of(config, shapes)
    if not names:
        raise InputError("--emit-tensor-types needs llama.cpp names: a llama or qwen2 model")
    return names


def _plan_weights(ref: ModelRef, options: PlanOptions, config: dict, shapes: Mapping[str, tuple[int, ...]],
                  matrix: Imatrix | None) -> tuple[dict[str, torch.Tensor], str | None]:
    """The importance vectors llama.cpp's candidate types are measured through, and the matrix's sha256 (the
    sensitivity table's key); ``({}, None)`` without a matrix."""
    if matrix is None:
        return {}, None
    probe = {n: get_scheme("q4_0") for n, s in planned_targets(ref, options).items() if s[-1] % 32 == 0}
    return quant_weights_for(matrix, config, shapes, probe), matrix.sha256


def _write_plan_files(plan: Plan, output: str | Path | None, emit_tensor_types: str | Path | None,
                      names: Mapping[str, str], dtypes: Mapping[str, torch.dtype | None]) -> tuple[Path | None, Path | None]:
    """Write the plan JSON to ``output`` and the tensor-type file to ``emit_tensor_types`` (each where given);
    returns the two paths written (None where not)."""
    out = Path(output) if output is not None else None
    if out is not None:
        write_plan(plan, out)
    tt = Path(emit_tensor_types) if emit_tensor_types is not None else None
    if tt is not None:
        write_tensor_type_file(tt, plan_llama_types(plan, names, dtypes))
    return out, tt


# --------------------------------------------------------------------------- importance matrix


@dataclass
class ImatrixResult:
    """What ``imatrix_model`` wrote: the file, its entries, the chunks and the seconds it took."""

    output: Path
    model: str
    entries: int
    chunks: int
    chunk_size: int
    tokens: int
    calibration: dict
    seconds: float
    # a mixture-of-experts model: {llama.cpp name of a stacked ``_exps`` tensor: tokens per expert}; {} for a dense one
    expert_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"output": str(self.output)}


@scoped
def imatrix_model(
    model: str | Path | ModelRef | None = None,
    *,
    output: str | Path,
    options: ImatrixOptions | None = None,
    device: str | None = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_memory: int | None = None,
) -> ImatrixResult:
    """Collect MODEL's importance matrix from the calibration text (as ``llama-imatrix`` does: see
    ``qkit.methods.imatrix``) and write it as llama.cpp's GGUF imatrix file to ``output``.

    Refused before any work: an ``output`` that is or lies inside an input (the model, the calibration
    file), an existing one unless ``force`` and qkit wrote it, a model without llama.cpp names here or a
    mixture-of-experts one whose experts qkit does not route calibration to, a calibration text that overlaps the eval text or is shorter than two chunks, an
    estimate (``check_collect_memory``) above ``max_memory`` bytes. ``progress(done, total)``: chunks evaluated."""
    opts = options or ImatrixOptions()
    opts.check()
    t0 = time.perf_counter()
    given = [*(model_inputs(model) if not isinstance(model, ModelRef) else []),
             *file_inputs("the calibration text", opts.source)]
    check = partial(check_output_path, output, kind="file", force=force, owned=is_qkit_imatrix,
                    describe="an importance matrix qkit wrote")
    check(inputs=given)
    claim_output(output, "-o")
    dev = parse_device(device)
    ref, inputs = resolve_clear_of(model, given, lambda found: check(inputs=found), allow_pickle=allow_pickle,
                                   trust_remote_code=trust_remote_code,
                                   quantized="{spec} is a qkit checkpoint; collect the importance matrix of the original model")
    config = read_config(ref.directory)
    refuse_unsupported(config)
    context = model_context(config)
    if context is not None and opts.chunk_size > context:
        raise InputError(f"--chunk-size {opts.chunk_size} exceeds the model's maximum context {context}; pass {context} or less")
    check_collect_memory(ref.directory, config, opts, max_memory, dev)  # before the model loads
    # the text (overlap with the eval text, too short, too few chunks) is refused before the model loads
    chunks, provenance = imatrix_ids(load_tokenizer(ref.directory, trust_remote_code or ref.trust_remote_code), opts)
    loaded = _load(ref=ref, device=dev, trust_remote_code=trust_remote_code, dtype=load_dtype(opts.dtype))
    matrix = collect(loaded.model, config, chunks, opts, on_chunk=progress, provenance=provenance)
    matrix.record = {"qkit_version": __version__, "model": ref.spec, "calibration": provenance,
                     "model_fingerprint": shapes_fingerprint(tensor_shapes(ref.directory)),
                     "process_output": opts.process_output, "dtype": opts.dtype,
                     "calibrate_all_experts": opts.calibrate_all_experts}
    out = Path(output)
    with staged(out, directory=False, what="-o") as tmp:
        write_gguf(matrix, tmp)
        os.replace(tmp, out)
    per_expert = {g: [int(c) for c in e.counts] for g, e in sorted(matrix.entries.items()) if e.counts.size > 1}
    return ImatrixResult(out, ref.spec, len(matrix.entries), int(chunks.shape[0]), opts.chunk_size,
                         int(chunks.numel()), provenance, time.perf_counter() - t0, per_expert)
