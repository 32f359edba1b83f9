"""``qkit eval``: one row per spec and runtime, each computed from the file ``qkit quantize`` writes.

Layer 6 (``evaluation``): above ``methods`` and ``simulate`` (layer 5) and ``models``; it calls
``qkit.api.quantize_model``, the one path that writes checkpoints, which imports nothing of evaluation.
``evaluate`` is a short pipeline of named steps, each given only the options it reads
(``qkit.evaluation.options``):

1. ``EvalOptions.validate``: every check that needs no model (milliseconds); it returns the specs
   (``RowSpec``: storage scheme or plan, method, simulations) ``--schemes`` and ``--methods`` name.
2. MODEL (and ``--reference`` for a saved checkpoint) resolved to local directories (``inputs.pair_models``).
3. ``inputs.check_inputs``: every refusal that needs no model loaded (the window against the model's
   context, token counts too small for a standard error, the corpus and calibration texts, a checkpoint's
   and a plan file's tensor names and shapes against the reference's headers, the engines' lengths).
4. The reference model, loaded once and measured once by the torch engine (its corpus log-probabilities,
   battery answers and greedy continuations: ``engines.torch_engine.measure_reference``).
5. ``engine_rows.measure_rows``: every engine ``--runtime`` names (``qkit.evaluation.engines``, torch
   first) measures the reference (but torch, whose row it is), a saved checkpoint and every spec, the same
   way: the row's file is written by ``write_row`` in the engine's format (torch: qkit's own, streamed into
   the reference model with the row's simulation hooks installed; vLLM, llama.cpp: compressed-tensors or
   GGUF, loaded in a worker subprocess, which first releases qkit's model), and the engine measures it
   against the reference. The rows are then paired (``pairing``: methods against rtn, engines against torch).
6. The report: the rows, the provenance (``provenance``), the notes under the table (``notes``).

``--executor ray`` (``EvalOptions.executor``, ``qkit.executors``): step 5's torch rows, each independent
given the reference, run as Ray tasks (``fan_out``): each task loads the reference model from its files,
writes and measures its row exactly as step 5 does here (``measure_elsewhere``), and the rows come back
in the serial order, with the same numbers (tests/test_executors.py compares every one). A worker that
dies stops the eval with one line (``ExecutorError``; not retried) and no ``--json`` is written.

A saved checkpoint (``qkit eval CHECKPOINT --reference MODEL``) is a row like the others whose file is
given: every tensor it stores (quantized ones dequantized, the others, such as norms a method folded
scales into, as stored) is copied into the reference model, so it gives exactly the row ``qkit eval
MODEL`` computes from the file it writes.

Each row's file is written under ``$TMPDIR/qkit-eval-PID-RANDOM`` (removed after the row, on an exception
and on Ctrl-C); one left by a killed eval (SIGKILL) is removed by the next eval, which says so in a
status line.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qkit.api import QuantizeOptions, QuantizeResult, quantize_model
from qkit.plan import KeptMeasurements
from qkit.errors import ExportError
from qkit.evaluation.engine_rows import (
    TMP_PREFIX,
    Elsewhere,
    Target,
    measure_row,
    measure_rows,
    saved_rows,
    write_reference,
)
from qkit.evaluation.engines import DTYPES, Engine, EngineOptions, EngineRefused, engines_named
from qkit.evaluation.engines.torch_engine import ENGINE as TORCH_ENGINE
from qkit.evaluation.engines.torch_engine import ROW_SHARD_BYTES, measure_reference
from qkit.evaluation.file_rows import file_row
from qkit.evaluation.inputs import check_inputs, pair_models
from qkit.evaluation.measuring import REFERENCE, Reference, RowFile
from qkit.evaluation.notes import interpret
from qkit.evaluation.options import EvalOptions
from qkit.evaluation.pairing import compare_methods
from qkit.evaluation.perplexity import TokenScores
from qkit.evaluation.provenance import provenance
from qkit.evaluation.report import EvalReport, Row
from qkit.evaluation.specs import RowSettings, RowSpec, row_plan
from qkit.executors import Executor
from qkit.export import get_format
from qkit.methods import RTN
from qkit.models import ModelRef, load, pinned_of, resolve
from qkit.staging import (
    remove_stale_temporary,  # the same liveness test as every output's staging siblings
    temporary_directory,
)

__all__ = ["REFERENCE", "ROW_SHARD_BYTES", "TMP_PREFIX", "EvalOptions", "EvalReport", "Row",
           "compare_methods", "evaluate", "quantize_row", "remove_stale_row_dirs", "write_row"]


def evaluate(
    model: str | Path | None = None,
    *,
    options: EvalOptions = EvalOptions(),
    on_status: Callable[[str], None] | None = None,
) -> EvalReport:
    """Evaluate MODEL under every spec in every runtime (or a saved qkit checkpoint against its reference).

    Every input is checked before the reference model is loaded (see the module docstring)."""
    say = on_status or _quiet
    specs = options.validate()  # a bad option fails before anything is resolved or loaded
    torch.manual_seed(options.seed)
    remove_killed_rows(say)
    target = resolve(model, trust_remote_code=options.trust_remote_code)
    base = resolve(options.reference, trust_remote_code=options.trust_remote_code) if target.is_quantized else None
    models = pair_models(target, base, options.reference)
    specs = [] if models.checkpoint is not None else specs  # a saved checkpoint is its own row
    engines = engines_named(options.runtimes)  # each installed (validate): their lengths checked before loading
    inputs = check_inputs(models, specs, engines, options.inputs)
    with options.executor.open(torch.get_num_threads()) as executor:  # Ray connected (or started) before the model loads
        say("loading the reference model")
        lm = load(ref=models.ref, device=options.device, device_map=options.device_map, dtype=DTYPES[options.dtype]).model
        reference = measure_reference(lm, models.ref, inputs, options.answering, say)
        del lm  # the reference holds it now: released before an engine loads its own copy
        # the plan rows' sensitivity, measured once for every row of the same format and method: kept for this run only
        writer = functools.partial(write_row, reference=reference, settings=options.rows, say=say,
                                   kept=KeptMeasurements())
        elsewhere = fan_out(executor, reference, options) if executor.parallel else None
        rows = measure_rows(engines, reference, saved_rows(models.checkpoint), specs, writer, options.engine_options, say,
                            elsewhere)
    facts = provenance(rows, reference, inputs, models, engines, options.engine_options, options.scale_dtype, options.seed)
    return EvalReport(rows, facts, interpret(rows, reference.corpus.scored_tokens, model=pinned_of(models.ref)))


def _quiet(_message: str) -> None:
    pass


# --------------------------------------------------------------------------- torch rows in other processes


@dataclass(frozen=True)
class RowJob:
    """What every torch row measured in another process shares (``--executor ray``: put in Ray's object
    store once): the reference without its model (its corpus log-probabilities in a named file,
    ``CorpusReference.share``), how rows are written, and how the reference model is loaded."""

    reference: Reference
    settings: RowSettings
    engine: EngineOptions
    device: str
    dtype: str


def fan_out(executor: Executor, reference: Reference, options: EvalOptions) -> Elsewhere:
    """The torch rows as ``executor``'s tasks (``measure_elsewhere``), results in the targets' order. The
    reference's log-probabilities are copied to a named file in a ``qkit-eval-PID-*`` directory (removed
    after the rows, on an error too), and the driver's model is released first: each task loads its own
    from the reference's files, so the driver holds no model while the rows run."""

    def run(targets: list) -> Iterator[tuple[Row, TokenScores | None]]:
        with temporary_directory(TMP_PREFIX) as tmp:
            reference.corpus.share(Path(tmp) / "reference-logprobs.f32")
            reference.release_model()
            job = RowJob(reference, options.rows, options.engine_options, reference.device, options.dtype)
            yield from executor.map(measure_elsewhere, targets, job)
    return run


def measure_elsewhere(job: RowJob, target: Target) -> tuple[Row, TokenScores | None]:
    """One torch row in this (worker) process, exactly as ``measure_in`` measures it in the driver:
    the reference model loaded from its files, the row written here (``write_row``) and swapped into it
    (``TorchSession``). The model is loaded per row and dropped after it (no model outlives a task)."""
    model = load(ref=job.reference.ref, device=job.device, dtype=DTYPES[job.dtype]).model
    reference = dataclasses.replace(job.reference, model=model)
    session = TORCH_ENGINE.open(reference, job.engine, _quiet)
    writer = functools.partial(write_row, reference=reference, settings=job.settings, say=_quiet)
    scores: dict[str, TokenScores] = {}
    try:
        row = measure_row(TORCH_ENGINE, session, target, reference, writer, scores, _quiet)
    finally:
        session.close()
    return row, scores.get(row.scheme)


# --------------------------------------------------------------------------- rows' files


def write_row(engine: Engine, spec: RowSpec | None, out: Path, label: str, *, reference: Reference,
              settings: RowSettings, say: Callable[[str], None], kept: KeptMeasurements | None = None) -> RowFile:
    """``spec``'s file for ``engine`` under ``out`` (``spec`` None: the reference's), as ``qkit quantize``
    writes it: ``quantize_model`` (the path that writes checkpoints) with the engine's ``export_options``.
    Unquantized weights are the reference's file in the engine's format (``write_reference``: its own
    directory for a safetensors format); a file row's is its given GGUF file (``file_rows.file_row``). Returns the file and the ``Row`` facts writing it settled.
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


# --------------------------------------------------------------------------- rows' temporary directories


def remove_stale_row_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove ``qkit-eval-PID-*`` directories under ``parent`` (default: ``tempfile.gettempdir()``, i.e.
    ``$TMPDIR``) whose writer process is gone (an eval killed by SIGKILL or a power cut); return them.
    A live eval's directory (its PID exists) is never touched (``qkit.staging.remove_stale_temporary``)."""
    return remove_stale_temporary(TMP_PREFIX, parent)


def remove_killed_rows(say: Callable[[str], None]) -> None:
    removed = remove_stale_row_dirs()
    if removed:
        say(f"removed {len(removed)} temporary row checkpoint(s) left by killed evals: {', '.join(map(str, removed))}")

