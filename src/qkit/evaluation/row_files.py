"""A row's file, written as ``qkit quantize`` writes it, in the format of the engine that measures it.

Layer 6 (``evaluation``), above ``api`` (``quantize_model``, the one path that writes checkpoints, which
imports nothing of evaluation), ``engines`` (each one's format and ``export_options``) and ``file_rows`` (a
given GGUF file is its row's file, never written again). ``write_row`` is the ``engine_rows.Writer`` the runner
hands the row loop (with the reference, how rows are written, and the run's ``KeptMeasurements``); a row's
file goes into its temporary directory (``$TMPDIR/qkit-eval-PID-RANDOM``), and the engine loads that very
file: a row is scored from the file a user would deploy (torch: qkit's own checkpoint, streamed into the
reference model). A row and a saved checkpoint of the same scheme therefore have bit-identical weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from qkit.api import QuantizeOptions, QuantizeResult, quantize_model
from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import ExportError
from qkit.evaluation.engines import Engine, EngineRefused
from qkit.evaluation.file_rows import file_row
from qkit.evaluation.measuring import Reference, RowFile
from qkit.evaluation.specs import RowSettings, RowSpec, row_plan
from qkit.export import atomic_output, get_format, prepare_export
from qkit.methods import RTN
from qkit.models import ModelRef
from qkit.plan import KeptMeasurements
from qkit.schemes import get_scheme
from qkit.schemes.registry import DEFAULT_SCHEME
from qkit.transform import Rules, new_manifest


def write_row(engine: Engine, spec: RowSpec | None, out: Path, label: str, *, reference: Reference,
              settings: RowSettings, say: Callable[[str], None], kept: KeptMeasurements | None = None) -> RowFile:
    """``spec``'s file for ``engine`` under ``out`` (``spec`` None: the reference's), as ``qkit quantize``
    writes it: ``quantize_model`` (the path that writes checkpoints) with the engine's ``export_options``.
    Unquantized weights are the reference's file in the engine's format (``write_reference``: its own
    directory for a safetensors format); a file row's is its given GGUF file (``file_rows.file_row``). Returns
    the file and the ``Row`` facts writing it settled.
    ``EngineRefused``: the engine's format cannot store the row. ``kept``: the run's ``KeptMeasurements``
    (a plan row's sensitivity, kept for the next plan row of the same model; None: nothing kept)."""
    t0 = time.perf_counter()
    if spec is not None and spec.file is not None:  # a given file is the row's file, never written again
        say(f"{label}: {spec.file}, as it is")
        return file_row(spec, reference.ref)
    if spec is not None and spec.quantized:
        result = quantize_row(engine, spec, reference.ref, settings, out / "row", label, say, kept)
        path = out / "row"
        facts = {"bits_per_weight": result.bits_per_weight, "size_bytes": result.bytes_after,
                 "matrices": result.matrices, "method_record": result.method_record, "plan": result.plan or {}}
    else:
        fmt = get_format(engine.format)
        if spec is None and fmt.written_as:
            say(f"{label}: writing the unquantized reference{fmt.written_as}")
        path = write_reference(reference.ref, engine.format, out / "reference")
        facts = {"bits_per_weight": reference.ref_row.bits_per_weight, "matrices": 0,
                 "size_bytes": reference.ref_row.size_bytes if path == reference.ref.directory else fmt.output_bytes(path)}
    written = path != reference.ref.directory  # else nothing was written: the reference's own files
    facts["build_seconds"] = time.perf_counter() - t0 if written else None
    return RowFile(spec, path, facts, settings.simulations.for_row(spec) if spec is not None else {})


def quantize_row(engine: Engine, spec: RowSpec, ref: ModelRef, settings: RowSettings, out: Path, label: str,
                 say: Callable[[str], None], kept: KeptMeasurements | None = None) -> QuantizeResult:
    """``spec``'s weights (a scheme or a plan) written to ``out`` as ``engine`` reads them: ``write_row``'s
    quantized half, also what the benchmarks call to build a torch row without an eval around it (then
    streamed into the model with ``Swapper.apply(iter_quantized(out))``, as ``TorchSession.measure`` does).
    ``EngineRefused``: the engine's format cannot store the row."""
    planned = row_plan(spec, settings) if spec.plan is not None else None
    say(f"{label}: " + ("planning and quantizing" if planned is not None else "quantizing")
        + get_format(engine.format).written_as + (f" ({spec.method})" if spec.method != RTN else ""))
    try:
        return quantize_model(
            model=ref, output=out, scheme=spec.scheme, method=spec.method,
            method_options=dict(spec.method_options) or None,
            options=QuantizeOptions(scale_dtype=settings.scale_dtype, device="cpu", plan=planned,
                                    **engine.export_options(spec.simulation)),
            kept=kept,
        )
    except ExportError as e:  # the engine's format cannot hold this row (e.g. int4-g128 on 576-wide matrices)
        raise EngineRefused(f"{engine.format} cannot store it: {e}") from None


def write_reference(ref: ModelRef, fmt: str, out: Path) -> Path:
    """The reference in format ``fmt``, unquantized; returns what the engine loads. For a safetensors
    format (qkit, compressed-tensors) that is the reference's own directory: with nothing quantized those
    formats store exactly its tensors. For another container (GGUF: one file) it is the exporter
    ``quantize_model`` uses, given no target: every tensor in the source's float type (F32 for an fp32
    model), written to ``out``."""
    if get_format(fmt).unquantized_is_source:
        return ref.directory
    shapes = dict(tensor_shapes(ref.directory))
    manifest = new_manifest(get_scheme(DEFAULT_SCHEME), Rules())  # names a default even with nothing quantized
    export = prepare_export(fmt, ref.directory, {}, shapes, manifest, ref=ref)
    with atomic_output(export, out) as tmp:
        writer = export.writer(tmp, 1 << 62)  # one file or shard: the engine reads it as written
        for name, tensor in iter_tensors(ref.directory):
            writer.add(name, tensor)
        writer.close()
    return out


__all__ = ["quantize_row", "write_reference", "write_row"]
