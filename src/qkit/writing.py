"""Writing a quantize's checkpoint: every tensor of the model streamed into the format's writer, and what
the run did (``QuantizeResult``) and tells as it goes (``QuantizeProgress``).

Layer 6, beside ``api`` (whose ``quantize_model`` is the pipeline that ends in ``write_checkpoint``). The
targets are quantized (or taken from the method's result), every other tensor is written as read (as a
method replaced it, or cast to the float dtype ``--token-embedding-type f16`` gave it), and each of those is
counted in ``QuantizeResult.kept`` with the bytes the file stores for it: the summary's "kept unquantized".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkit.checkpoint import iter_tensors, write_json
from qkit.choice import Choice, QuantizeOptions
from qkit.errors import InputError
from qkit.export import QKIT, PreparedExport
from qkit.export.gguf.tensor_types import NEEDS_LLAMA_TYPES, write_tensor_type_file
from qkit.methods import RTN, MethodResult
from qkit.models import ModelRef, copy_aux_files, read_config
from qkit.schemes import QuantizedTensor, is_llama_type, quantize_tensor
from qkit.schemes.fidelity import check_written
from qkit.schemes.ggml import GGMLScheme


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
    format: str = QKIT  # the --format written (qkit.export.format_names())
    method: str = RTN
    # full-precision tensors a method changed (folded scales); with ``collect=True``, for the eval swap
    replaced: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    method_record: dict = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # tensor -> the stored type it got (recipes, fallbacks)
    llama_types: dict[str, str] = field(default_factory=dict)  # llama.cpp name -> ggml type, for llama.cpp types
    imatrix: dict | None = None  # the importance matrix used (file, sha256, chunks), when one was
    plan: dict | None = None  # the plan written (Plan.record), when one was
    notes: list[str] = field(default_factory=list)  # what a user should know of the inputs (shown, never silent)
    kept: dict[str, int] = field(default_factory=dict)  # tensor kept unquantized -> the bytes the file stores for it
    tensor_types: Path | None = None  # the llama-quantize --tensor-type-file written (emit_tensor_types), if one was

    def to_dict(self) -> dict:
        """Every field but the tensors (``quantized``, ``replaced``) and ``llama_types``, as JSON values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("quantized", "replaced", "llama_types")}
        return {**out, "output": str(self.output) if self.output else None, "notes": list(self.notes),
                "tensor_types": str(self.tensor_types) if self.tensor_types else None,
                "schemes_used": dict(sorted(self.schemes_used.items())), "types": dict(sorted(self.types.items())),
                "kept": dict(sorted(self.kept.items()))}


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


def write_checkpoint(tmp: Path, ref: ModelRef, choice: Choice, export: PreparedExport, done: MethodResult | None,
                     result: QuantizeResult, opts: QuantizeOptions, dev: torch.device, progress: Progress | None,
                     collect: bool) -> None:
    """Stream every tensor of ``ref`` into ``tmp`` through ``export``'s writer (``--format``'s, qkit's own
    included): the targets quantized (or the method's, ``done``; None for rtn), the rest as read (or as the
    method replaced them); then config.json with the format's ``quantization_config`` and the model's other
    files. Fills ``result``."""
    targets, manifest = choice.targets, choice.manifest
    if progress is not None:
        progress(QuantizeProgress("quantizing", 0, len(targets)))
    precomputed, replaced = (done.quantized, done.replaced) if done is not None else (None, {})
    checked = done.checked if done is not None else {}
    result.method_record = manifest.get("method", {})
    result.imatrix = manifest.get("imatrix")
    qbytes = 0
    writer = export.writer(tmp, opts.max_shard_bytes)
    for name, tensor in iter_tensors(ref.directory):
        s = targets.get(name)
        if s is None:
            if name in replaced:
                tensor = replaced[name].to(tensor.dtype)
                if collect:
                    result.replaced[name] = tensor
            if name in choice.kept_dtypes:  # --token-embedding-type f16: kept, stored in that dtype
                tensor = tensor.to(choice.kept_dtypes[name])
                if collect:
                    result.replaced[name] = tensor
            writer.add(name, tensor)
            if kept := export.kept_nbytes(name, tensor):
                result.kept[name] = kept
            continue
        if precomputed is not None:
            qt = precomputed[name]
        else:
            tensor = tensor.to(dev) if tensor.device != dev else tensor
            qt = quantize_tensor(tensor, s, name=name, quant_weights=choice.weights.get(name),
                                 tensor_amax=choice.tensor_amax.get(name))
        if name not in checked:  # a tensor that decodes to garbage refuses the run before anything is in place
            check_written(name, tensor, qt, cause=choice.likely_cause(name, qt.scheme.name, result.method))
        writer.add(name, qt)
        result.matrices += 1
        result.parameters += qt.numel
        qbytes += qt.nbytes
        result.schemes_used[qt.scheme.name] = result.schemes_used.get(qt.scheme.name, 0) + 1
        result.types[name] = qt.scheme.name
        if name in choice.llama_names and isinstance(qt.scheme, GGMLScheme):
            result.llama_types[choice.llama_names[name]] = qt.scheme.ggml_type.name
        if collect:
            result.quantized[name] = qt
        if progress is not None:
            progress(QuantizeProgress("quantizing", result.matrices, len(targets), name))
    writer.close()
    config = read_config(ref.directory)
    # where the source was read from (a GGUF's converted copy records qkit's cache): not a function of the
    # inputs, so not written; transformers sets it again when the checkpoint is loaded
    config.pop("_name_or_path", None)
    config["quantization_config"] = export.quantization_config()
    write_json(tmp / "config.json", config)
    # a trusted model's own code files too: its config names them, the copy cannot load without them
    copy_aux_files(ref.directory, tmp, trust_remote_code=opts.trust_remote_code or ref.trust_remote_code)
    result.bits_per_weight = 8 * qbytes / max(result.parameters, 1)


def check_tensor_types(choice: Choice) -> None:
    """``--emit-tensor-types``, refused before any work where no quantized tensor would have a line in the file:
    the model has no llama.cpp names, or none of its chosen types is one of llama.cpp's."""
    if not any(is_llama_type(s) for n, s in choice.targets.items() if n in choice.llama_names):
        raise InputError(NEEDS_LLAMA_TYPES)
    stacked: dict[str, set[str]] = {}  # a mixture-of-experts layer's experts: one llama.cpp tensor, one type
    for n, s in choice.targets.items():
        if n in choice.llama_names:
            stacked.setdefault(choice.llama_names[n], set()).add(s.name)
    mixed = sorted(g for g, kinds in stacked.items() if len(kinds) > 1)
    if mixed:
        raise InputError(f"--emit-tensor-types: llama.cpp stacks a layer's experts into one tensor ({mixed[0]}) of one type; "
                         "these experts were given several: give every expert of a layer the same type")


def emit_tensor_types(path: str | Path, result: QuantizeResult) -> None:
    """The last step of a quantize with ``emit_tensor_types``, once the checkpoint is in place (the file may lie
    inside its directory): the ``llama-quantize --tensor-type-file`` that gives every quantized tensor the
    type it was written in (``result.llama_types``), written atomically; ``result.tensor_types`` names it."""
    write_tensor_type_file(path, result.llama_types)
    result.tensor_types = Path(path)


def report(progress: Progress, stage: str, done: int, total: int) -> None:
    progress(QuantizeProgress(stage, done, total))


__all__ = ["Progress", "QuantizeProgress", "QuantizeResult", "block_progress", "check_tensor_types", "emit_tensor_types",
           "report", "write_checkpoint"]
