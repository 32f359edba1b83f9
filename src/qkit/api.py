"""Library entry points the CLI wraps: ``quantize_model`` and ``load``.

Layer 6, below ``evaluation`` and ``inspect``, which build their rows through ``quantize_model``. Each is
a plain function a script calls; ``quantize_model``'s settings are one ``QuantizeOptions`` value (every
default defined there, once), its progress one callback.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    checkpoint_bytes,
    iter_tensors,
    tensor_dtypes,
    tensor_shapes,
    write_json,
)
from qkit.errors import InputError, OutputError, QkitError
from qkit.export import QKIT, atomic_output, check_output, get_format, output_bytes, prepare_export
from qkit.export.compressed_tensors_w8a8 import check_activations
from qkit.export.gguf.tensor_types import is_tensor_type_file, write_tensor_type_file
from qkit.methods import RTN, get_method, make_options
from qkit.methods.calibration import check_fits, model_context
from qkit.methods.imatrix import (
    ImatrixOptions,
    collect,
    gguf_names,
    imatrix_ids,
    imatrix_record,
    quant_weights_for,
    refuse_unsupported,
    write_gguf,
)
from qkit.methods.imatrix import read as read_imatrix
from qkit.methods.imatrix.file import is_qkit_imatrix
from qkit.methods.imatrix.method import matrix_for
from qkit.models import (
    ModelRef,
    check_complete,
    copy_aux_files,
    load_tokenizer,
    parse_device,
    read_config,
    resolve,
)
from qkit.models import load as _load
from qkit.outputs import Input, directory_inputs, file_inputs, model_inputs
from qkit.outputs import check_output as check_output_path
from qkit.plan import (
    KEEP,
    Plan,
    PlanOptions,
    base_type,
    check_format,
    check_plan_matches,
    choose,
    is_plan_file,
    planned_targets,
    precheck,
    read_plan,
    sensitivity_table,
    write_plan,
)
from qkit.plan import check as check_plan
from qkit.schemes import QuantizedTensor, Recipe, Scheme, get_scheme, quantize_tensor
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, DEFAULT_SCHEME
from qkit.staging import staged
from qkit.transform import Rules, TensorTypes, new_manifest, plan
from qkit.version import __version__

load = _load


@dataclass
class QuantizeResult:
    """What ``quantize_model`` did. ``quantized`` holds the tensors when ``collect=True``."""

    output: Path | None
    model: str
    scheme: str
    matrices: int
    parameters: int  # weights quantized
    bits_per_weight: float  # of the quantized matrices, scales included
    bytes_before: int
    bytes_after: int
    seconds: float
    schemes_used: dict[str, int] = field(default_factory=dict)
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict, repr=False)
    format: str = QKIT  # or an export format (qkit.export.FORMATS)
    method: str = RTN
    # full-precision tensors a method changed (folded scales); with ``collect=True``, for the eval swap
    replaced: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    method_record: dict = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # tensor -> the stored type it got (recipes, fallbacks)
    llama_types: dict[str, str] = field(default_factory=dict)  # llama.cpp name -> ggml type, for llama.cpp types
    imatrix: dict | None = None  # the importance matrix used (file, sha256, chunks), when one was
    plan: dict | None = None  # the plan written (Plan.record), when one was

    def to_dict(self) -> dict:
        return {
            "output": str(self.output) if self.output else None,
            "model": self.model,
            "scheme": self.scheme,
            "matrices": self.matrices,
            "parameters": self.parameters,
            "bits_per_weight": self.bits_per_weight,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "seconds": self.seconds,
            "schemes_used": dict(sorted(self.schemes_used.items())),
            "format": self.format,
            "method": self.method,
            "method_record": self.method_record,
            "types": dict(sorted(self.types.items())),
            "imatrix": self.imatrix,
            "plan": self.plan,
        }


@dataclass(frozen=True)
class QuantizeOptions:
    """What ``quantize_model`` writes and how; every default defined here, once.

    ``scheme`` the default scheme of the block projections (``qkit.schemes``), ``scale_dtype`` its scale
    type; ``include`` / ``exclude`` globs and ``keep`` ``SCHEME:GLOB`` overrides (``qkit.transform.Rules``);
    ``format`` ``qkit`` or an export format (``qkit.export.FORMATS``) and ``activations`` what it declares
    for run-time activation quantization (``int8-token``: W8A8 compressed-tensors); ``method`` how the
    codes are chosen (``qkit.methods``) with ``method_options`` (its options dataclass's fields);
    ``max_shard_bytes`` the largest output shard; ``device`` where the weights are quantized;
    ``allow_pickle`` / ``trust_remote_code`` what the model may run; ``force`` replace an output qkit wrote.
    ``imatrix``: an importance-matrix file (llama-imatrix's GGUF or legacy ``.dat``, or ``qkit imatrix``'s)
    that llama.cpp's block types quantize through (``quantize_row_*_impl``); ``tensor_types``:
    ``PATTERN=TYPE`` overrides in ``llama-quantize --tensor-type``'s terms (``qkit.transform.TensorTypes``).
    """

    scheme: str = DEFAULT_SCHEME
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    keep: Sequence[str] = ()
    format: str = QKIT
    activations: str | None = None
    method: str = RTN
    method_options: Mapping[str, Any] | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    device: str | None = "cpu"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    force: bool = False
    imatrix: str | None = None
    tensor_types: Sequence[str] = ()
    plan: str | Path | Plan | PlanOptions | None = None


@dataclass(frozen=True)
class QuantizeProgress:
    """One step of ``quantize_model``: ``stage`` ``"calibrating"`` (a method finished block ``done`` of
    ``total``) or ``"quantizing"`` (``done == 0``: ``total`` tensors are about to be written; then tensor
    ``name`` was written, ``done`` of ``total``)."""

    stage: str
    done: int
    total: int
    name: str | None = None


Progress = Callable[[QuantizeProgress], None]


def block_progress(on_block: Callable[[int, int], None]) -> Progress:
    """A ``progress`` that passes only a calibrated method's blocks on, as ``on_block(done, total)``."""

    def forward(step: QuantizeProgress) -> None:
        if step.stage == "calibrating":
            on_block(step.done, step.total)

    return forward


def quantize_model(
    model: str | Path | ModelRef | None = None,
    *,
    output: str | Path,
    options: QuantizeOptions | None = None,
    progress: Progress | None = None,
    collect: bool = False,
    scheme: str | None = None,
    method: str | None = None,
    method_options: Mapping[str, Any] | None = None,
    format: str | None = None,
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
    ``output`` is refused before any work (``qkit.outputs.check_output``) if it is, contains or lies inside
    an input (the model as given and as resolved, the calibration file), whatever ``force``; if it exists,
    unless ``force`` and qkit wrote it; and if its place cannot be written (read-only, full, not a directory).
    ``method``: ``rtn`` (default: round to nearest, streamed) or a calibrated method (``qkit.methods``:
    ``gptq``, ``awq``, ...) with its ``method_options``; a method runs over the whole model first (its
    progress as ``"calibrating"`` steps), then the same writer stores its tensors. What the method
    did (options, calibration text and sha256) goes into the manifest under ``method``.
    ``trust_remote_code``: allow the model's own Python (``qkit.models.custom_code``); without it such a
    model is refused before any work, and every transformers call is told ``False``.
    ``activations``: with ``format="compressed-tensors"`` and ``int8-row`` weights, ``"int8-token"`` writes
    a W8A8 checkpoint (dynamic per-token int8 activations, ``int-quantized``: the layout vLLM serves; see
    ``qkit.export.compressed_tensors_w8a8``), typically after ``method="smoothquant"``.
    """
    given_here = {"scheme": scheme, "method": method, "method_options": method_options, "format": format}
    opts = dataclasses.replace(options or QuantizeOptions(), **{k: v for k, v in given_here.items() if v is not None})
    scheme, scale_dtype, format, method, method_options = (opts.scheme, opts.scale_dtype, opts.format, opts.method,
                                                           opts.method_options)
    force, device, activations, max_shard_bytes = opts.force, opts.device, opts.activations, opts.max_shard_bytes
    ref = model if isinstance(model, ModelRef) else None
    model = None if ref is not None else model
    t0 = time.perf_counter()
    if output is None or str(output) == "":
        raise OutputError("-o is empty; give the directory (or FILE.gguf with --format gguf) to write to")
    out = Path(output)
    # The output is checked before any work: first against what the arguments name, then (below) against
    # the resolved model too. One that is, contains or lies inside an input is refused whatever ``force``.
    cal = (method_options or {}).get("calibration")
    given = [*(model_inputs(model) if ref is None else []),
             *file_inputs("the calibration text", None if cal is None else str(cal)),
             *file_inputs("the importance matrix", opts.imatrix)]
    check_output(format, out, force, given)
    default = get_scheme(scheme, scale_dtype)
    rules = Rules.parse(opts.include, opts.exclude, opts.keep, scale_dtype)
    dev = parse_device(device)
    if activations is not None:  # refused before any work: only an export format can declare them
        check_activations(activations)
        if format == QKIT:
            raise InputError("--activations declares run-time activation quantization for --format compressed-tensors "
                             "(W8A8); a qkit checkpoint stores weights only: simulate it with qkit eval --schemes smoothquant-w8a8")
    chooser = get_method(method)
    options = make_options(chooser, method_options) if chooser else None
    overrides = TensorTypes.parse(opts.tensor_types)
    overrides.check_format(QKIT if format == QKIT else get_format(format).name)  # before the model is read
    planned = opts.plan
    if planned is not None:
        if opts.keep or opts.tensor_types or opts.include or opts.exclude:
            raise InputError("a plan sets every planned tensor's type; drop --keep/--tensor-type/--include/--exclude "
                             "(plan with --include/--exclude instead)")
        if isinstance(planned, (str, Path)):
            planned = read_plan(planned)  # a malformed file: refused now
        if isinstance(planned, Plan) and format != QKIT and check_format(format) != planned.format:
            raise InputError(f"the plan was made for --format {planned.format}: its types and byte counts are that format's; "
                             f"write it with --format {planned.format} (or re-plan for {format})")
        if isinstance(planned, PlanOptions):
            planned.check()
    matrix = read_imatrix(opts.imatrix) if opts.imatrix is not None else None  # a malformed file: refused now
    if matrix is not None and chooser is not None:
        raise InputError(f"--imatrix weights llama.cpp's own searches (--method rtn); {chooser.name} chooses the codes "
                         "itself: drop one of them")
    if chooser is None and method_options:
        raise InputError(f"options {', '.join(sorted(method_options))} need a calibrated --method (gptq, awq, ...)")
    ref = ref or resolve(model, allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code)
    if ref.is_quantized:
        raise InputError(f"{ref.spec} is already a qkit checkpoint; quantize the original model instead")
    check_complete(ref, trust_remote_code=opts.trust_remote_code)  # missing tensors: refused before any method runs
    inputs = [*given, *resolved_inputs(ref)]
    check_output(format, out, force, inputs)  # a few stat calls: the resolved directory was not known above
    shapes = dict(tensor_shapes(ref.directory))
    # A recipe (q4_k_m) needs facts of the model (layer count, tied embeddings): bound here, once.
    config = read_config(ref.directory)
    default = default.bind(config)
    weighted = matrix is not None or (chooser is not None and chooser.name == "imatrix")
    if weighted and isinstance(default, Recipe):  # llama.cpp's choice reads has_imatrix (IQ4 recipes)
        default = default.with_imatrix(True)
    rules = Rules(rules.include, rules.exclude, tuple((g, s and s.bind(config)) for g, s in rules.overrides))
    rules.check_matches(shapes, ref.spec)  # a glob that matches no tensor: a typo, refused
    targets = {n: s for n, s in plan(shapes.items(), default, rules).items() if s is not None}
    if not targets:
        raise InputError(f"no tensor of {ref.spec} matches the quantization rules; check --include/--exclude")
    if planned is not None:
        if isinstance(planned, PlanOptions):  # plan first, in memory (quantize --target-bits)
            planned = plan_model(ref, options=planned, imatrix=opts.imatrix, method=method, device=device,
                                 trust_remote_code=opts.trust_remote_code).plan
        check_plan_matches(planned, shapes, ref.spec)
        _check_plan_method(planned, matrix, chooser)
        targets = {n: s for n, s in planned.schemes().items() if s is not None}
        default = get_scheme(base_type(planned)) if base_type(planned) != KEEP else default
    llama_names = _llama_names(config, shapes) if overrides or format == "gguf" or matrix is not None else {}
    if overrides:
        if not llama_names:
            raise InputError(f"--tensor-type matches llama.cpp tensor names; {ref.spec} is not a llama/qwen2 model qkit names")
        targets = overrides.apply(targets, llama_names)
    if matrix is not None and not any(s.kind == "ggml" for s in targets.values()):
        raise InputError(f"--imatrix weights llama.cpp's block types' searches; {default.name} is not one (use q2_k ... q8_0, "
                         "iq4_nl, iq4_xs or a llama.cpp recipe such as q4_k_m)")
    weights = quant_weights_for(matrix, config, shapes, targets) if matrix is not None else {}
    if chooser is not None:
        for s in {s.name: s for s in targets.values()}.values():
            chooser.check(s)
        if chooser.calibrated:  # windows beyond the model's context, activations beyond memory: refused now
            check_fits(options.calibration_options(), config)
    manifest = new_manifest(default, rules)
    if overrides:
        manifest["rules"]["tensor_types"] = list(overrides.words)
    if planned is not None:
        manifest["plan"] = planned.record()
    if matrix is not None:
        manifest["imatrix"] = imatrix_record(matrix, len(weights))
    export = None if format == QKIT else prepare_export(format, ref.directory, targets, shapes, manifest, ref=ref,
                                                         activations=activations)
    precomputed = None
    if chooser is not None:
        on_block = None if progress is None else partial(_report, progress, "calibrating")
        done = chooser.run(ref, targets, options, device=dev, on_block=on_block)
        precomputed, replaced = done.quantized, done.replaced
        manifest["method"] = {"name": chooser.name, **done.record}
        if "imatrix" in done.record:
            manifest["imatrix"] = done.record["imatrix"]
        if export is not None:  # a format that copied the manifest when it was prepared sees what the method did
            export.manifest.update({k: manifest[k] for k in ("method", "imatrix") if k in manifest})
    if progress is not None:
        progress(QuantizeProgress("quantizing", 0, len(targets)))
    result = QuantizeResult(out, ref.spec, default.name, 0, 0, 0.0, checkpoint_bytes(ref.directory), 0, 0.0)
    result.format = QKIT if export is None else export.format.name
    result.method = RTN if chooser is None else chooser.name
    result.method_record = manifest.get("method", {})
    result.imatrix = manifest.get("imatrix")
    result.plan = manifest.get("plan")
    qbytes = 0
    with atomic_output(export, out, force, inputs) as tmp:
        writer = export.writer(tmp, max_shard_bytes) if export else ShardWriter(tmp, manifest, max_shard_bytes)
        for name, tensor in iter_tensors(ref.directory):
            s = targets.get(name)
            if s is None:
                if precomputed is not None and name in replaced:
                    tensor = replaced[name].to(tensor.dtype)
                    if collect:
                        result.replaced[name] = tensor
                writer.add(name, tensor)
                continue
            qt = precomputed[name] if precomputed is not None else _quantize_on(tensor, s, name, dev, weights.get(name))
            writer.add(name, qt)
            result.matrices += 1
            result.parameters += qt.numel
            qbytes += qt.nbytes
            result.schemes_used[qt.scheme.name] = result.schemes_used.get(qt.scheme.name, 0) + 1
            result.types[name] = qt.scheme.name
            if name in llama_names and isinstance(qt.scheme, GGMLScheme):
                result.llama_types[llama_names[name]] = qt.scheme.ggml_type.name
            if collect:
                result.quantized[name] = qt
            if progress is not None:
                progress(QuantizeProgress("quantizing", result.matrices, len(targets), name))
        writer.close()
        config = read_config(ref.directory)
        config["quantization_config"] = export.quantization_config() if export else {
            "quant_method": "qkit",
            "format_version": manifest["format_version"],
            "qkit_version": __version__,
            "scheme": default.to_dict(),
            "rules": manifest["rules"],
            **({"method": manifest["method"]} if "method" in manifest else {}),
            **({"plan": manifest["plan"]} if "plan" in manifest else {}),
        }
        write_json(tmp / "config.json", config)
        # a trusted model's own code files too: its config names them, the copy cannot load without them
        copy_aux_files(ref.directory, tmp, trust_remote_code=opts.trust_remote_code or ref.trust_remote_code)
    result.bits_per_weight = 8 * qbytes / max(result.parameters, 1)
    result.bytes_after = output_bytes(out)
    result.seconds = time.perf_counter() - t0
    return result


def _llama_names(config: dict, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Hugging Face name -> llama.cpp's for every weight, or ``{}`` for a model llama.cpp does not name here."""
    try:
        return gguf_names(config, [n for n in shapes if n.endswith(".weight")])
    except QkitError:
        return {}


def _report(progress: Progress, stage: str, done: int, total: int) -> None:
    progress(QuantizeProgress(stage, done, total))


def resolved_inputs(ref: ModelRef) -> list[Input]:
    """What a resolved model reads: its local directory (with its symlinks' targets), the GGUF it was
    converted from, the hub snapshot it came from; an output must stay clear of all of them."""
    found = directory_inputs("the model", ref.directory)
    for key, label in (("gguf", "the source GGUF"), ("snapshot", "the model's hub snapshot")):
        if ref.provenance.get(key):
            found.append((label, ref.provenance[key]))
    return found


def _quantize_on(tensor: torch.Tensor, scheme: Scheme, name: str, device: torch.device,
                 quant_weights: torch.Tensor | None = None) -> QuantizedTensor:
    return quantize_tensor(tensor.to(device) if tensor.device != device else tensor, scheme, name=name,
                           quant_weights=quant_weights)


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
                "seconds": self.seconds, "plan": self.plan.to_dict()}


PLAN_METHODS = (RTN, "imatrix")


def plan_model(
    model: str | Path | ModelRef | None = None,
    *,
    options: PlanOptions,
    output: str | Path | None = None,
    method: str = RTN,
    imatrix: str | None = None,
    emit_tensor_types: str | Path | None = None,
    device: str | None = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> PlanResult:
    """Plan MODEL's types for a byte budget (``qkit.plan``): measured sensitivity, the exact solve,
    the measured check; write the plan JSON to ``output`` (None: keep it in memory) and, for GGUF, the
    ``llama-quantize --tensor-type-file`` that gives every tensor its planned type to ``emit_tensor_types``.

    ``method``: ``rtn``, or ``imatrix`` (collect the importance matrix as ``qkit imatrix`` does; llama.cpp's
    types are then measured through their weighted searches); ``imatrix``: such a file instead.
    Refused before any work: bad options, a format that cannot mix, an output that is an input or exists
    (unless ``force`` and qkit wrote it), a calibration text that overlaps the eval text, a budget below the
    smallest mix or above the unquantized size (checked from the headers, before the model runs).
    ``progress(stage, done, total)``: ``fisher`` windows, ``candidates`` tensors."""
    t0 = time.perf_counter()
    options.check()
    fmt = check_format(options.format)
    if method not in PLAN_METHODS:
        raise InputError(f"qkit plan measures candidates by rtn or the importance matrix (--method imatrix / --imatrix); "
                         f"{method} chooses codes per type and is not planned: quantize a plan's types with it instead")
    if (imatrix is not None or method == "imatrix") and fmt == "compressed-tensors":
        raise InputError("the importance matrix weights llama.cpp's types; plan --format gguf or qkit with it")
    if imatrix is not None and method == "imatrix":
        raise InputError("--imatrix FILE and --method imatrix both give the matrix: drop one of them")
    if emit_tensor_types is not None and fmt != "gguf":
        raise InputError("--emit-tensor-types writes llama-quantize's --tensor-type-file: plan --format gguf")
    given = [*(model_inputs(model) if not isinstance(model, ModelRef) else []),
             *file_inputs("the calibration text", options.calibration), *file_inputs("the importance matrix", imatrix)]
    for path in (output, emit_tensor_types):
        if path is not None:
            check_output_path(path, kind="file", force=force, inputs=given,
                              owned=is_plan_file if path is output else is_tensor_type_file,
                              describe="a plan qkit wrote" if path is output else "a tensor-type file qkit wrote")
    matrix = read_imatrix(imatrix) if imatrix is not None else None
    ref = model if isinstance(model, ModelRef) else resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if ref.is_quantized:
        raise InputError(f"{ref.spec} is already a qkit checkpoint; plan for the original model")
    check_complete(ref, trust_remote_code=trust_remote_code)
    dev = parse_device(device)
    shapes = dict(tensor_shapes(ref.directory))
    config = read_config(ref.directory)
    precheck(ref, options, config)  # the budget against the smallest and the unquantized mix: from the headers
    if method == "imatrix":
        refuse_unsupported(config)
        matrix, _ = matrix_for(ref, ImatrixOptions(), dev)
    weights, key = {}, None
    if matrix is not None:
        probe = {n: get_scheme("q4_0") for n, s in planned_targets(ref, options).items() if s[-1] % 32 == 0}
        weights, key = quant_weights_for(matrix, config, shapes, probe), matrix.sha256
    table = sensitivity_table(ref, options, device=dev, quant_weights=weights, imatrix_key=key, on_step=progress)
    record = imatrix_record(matrix, len(weights)) if matrix is not None else None
    plan = choose(table, options, model_spec=ref.spec, shapes_all=shapes, method=method, imatrix=record, config=config)
    check_plan(plan, table, ref, weights)
    out = Path(output) if output is not None else None
    if out is not None:
        write_plan(plan, out)
    tt = Path(emit_tensor_types) if emit_tensor_types is not None else None
    if tt is not None:
        write_tensor_type_file(tt, plan_llama_types(plan, config, shapes, tensor_dtypes(ref.directory)))
    return PlanResult(plan, out, tt, time.perf_counter() - t0)


def plan_llama_types(plan: Plan, config: dict, shapes: Mapping[str, tuple[int, ...]],
                     dtypes: Mapping[str, torch.dtype | None]) -> dict[str, str]:
    """``{llama.cpp name: ggml type}`` of every planned tensor (a kept one: its source float type, as qkit's
    GGUF writer stores it), for ``llama-quantize --tensor-type-file``."""
    names = _llama_names(config, shapes)
    if not names:
        raise InputError("--emit-tensor-types needs llama.cpp names: a llama or qwen2 model")
    floats = {torch.float16: "F16", torch.bfloat16: "BF16"}
    out = {}
    for name, t in plan.tensors.items():
        s = t.scheme
        out[names[name]] = s.ggml_type.name if isinstance(s, GGMLScheme) else floats.get(dtypes.get(name), "F32")
    return out


def _check_plan_method(plan: Plan, matrix, chooser) -> None:
    """A plan's costs were measured with one matrix or none: its quantize must use the same."""
    if chooser is not None and chooser.name != "imatrix":
        raise InputError(f"the plan's costs were measured with {plan.method}; {chooser.name} chooses other codes for the same "
                         "types: quantize the plan with its own method (drop --method)")
    if plan.imatrix is None and (matrix is not None or chooser is not None):
        raise InputError("the plan was measured without an importance matrix; re-plan with --imatrix/--method imatrix, "
                         "or quantize it without one")
    if plan.imatrix is not None and chooser is None:
        if matrix is None:
            raise InputError(f"the plan was measured with the importance matrix {plan.imatrix.get('file') or ''} "
                             f"(sha256 {str(plan.imatrix.get('sha256'))[:12]}...): pass it with --imatrix (or --method imatrix)")
        if matrix.sha256 != plan.imatrix.get("sha256"):
            raise InputError(f"--imatrix {matrix.source}: not the matrix the plan was measured with (sha256 "
                             f"{matrix.sha256[:12]}... against {str(plan.imatrix.get('sha256'))[:12]}...); re-plan with it")


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"output": str(self.output)}


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
) -> ImatrixResult:
    """Collect MODEL's importance matrix from the calibration text (as ``llama-imatrix`` does: see
    ``qkit.methods.imatrix``) and write it as llama.cpp's GGUF imatrix file to ``output``.

    Refused before any work: an ``output`` that is or lies inside an input (the model, the calibration
    file), an existing one unless ``force`` and qkit wrote it, a mixture-of-experts model or one without
    llama.cpp names, a calibration text that overlaps the eval text or is shorter than two chunks.
    ``progress(done, total)``: chunks evaluated."""
    opts = options or ImatrixOptions()
    opts.check()
    t0 = time.perf_counter()
    given = [*(model_inputs(model) if not isinstance(model, ModelRef) else []),
             *file_inputs("the calibration text", opts.source)]
    check_output_path(output, kind="file", force=force, inputs=given, owned=is_qkit_imatrix,
                 describe="an importance matrix qkit wrote")
    dev = parse_device(device)
    ref = model if isinstance(model, ModelRef) else resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if ref.is_quantized:
        raise InputError(f"{ref.spec} is a qkit checkpoint; collect the importance matrix of the original model")
    config = read_config(ref.directory)
    refuse_unsupported(config)
    context = model_context(config)
    if context is not None and opts.chunk_size > context:
        raise InputError(f"--chunk-size {opts.chunk_size} exceeds the model's maximum context {context}; pass {context} or less")
    inputs = [*given, *resolved_inputs(ref)]
    check_output_path(output, kind="file", force=force, inputs=inputs, owned=is_qkit_imatrix,
                 describe="an importance matrix qkit wrote")
    # the text (overlap with the eval text, too short, too few chunks) is refused before the model loads
    chunks, provenance = imatrix_ids(load_tokenizer(ref.directory, trust_remote_code or ref.trust_remote_code), opts)
    loaded = _load(ref=ref, device=dev, trust_remote_code=trust_remote_code)
    matrix = collect(loaded.model, config, chunks, opts, on_chunk=progress, provenance=provenance)
    matrix.record = {"qkit_version": __version__, "model": ref.spec, "calibration": provenance,
                     "process_output": opts.process_output}
    out = Path(output)
    with staged(out, directory=False, what="-o") as tmp:
        write_gguf(matrix, tmp)
        os.replace(tmp, out)
    return ImatrixResult(out, ref.spec, len(matrix.entries), int(chunks.shape[0]), opts.chunk_size,
                         int(chunks.numel()), provenance, time.perf_counter() - t0)
