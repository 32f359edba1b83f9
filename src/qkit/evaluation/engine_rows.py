"""An engine's rows (``--runtime torch,vllm,llama.cpp``): every row measured the same way, in every engine.

Layer 6 (``evaluation``): above ``engines`` (the ``Engine`` protocol, its sessions), ``measuring`` (the
values a row passes around) and ``row_files`` (how a row's file is written). The runner calls
``measure_rows``, which measures every engine's rows (``measure_in``), torch first, then pairs them
(``pairing``); the torch reference is measured before any of them
(``engines.torch_engine.measure_reference``), since every row is compared with it. With ``--executor ray``
the torch rows are measured in other processes (``fan_out``, ``measure_elsewhere``), each as here.

For each target (an engine's own reference, a saved checkpoint, every spec), in order:

1. ``refusal`` gives a reason known before anything is written (a scheme the engine's format has no type
   for, a simulation the engine does not run, a plan for another format, a saved qkit checkpoint in an
   engine that reads another format, a file row in an engine that does not load GGUF files): a row that
   says so (``Row.refused``), nothing written.
2. The row's file is written by the runner's writer (``row_files.write_row``: ``qkit.api.quantize_model``
   with the engine's ``export_options``, exactly as ``qkit quantize --format ...`` writes it; the
   reference's is the same exporter with nothing quantized: ``row_files.write_reference``) into the row's temporary directory
   (``$TMPDIR/qkit-eval-PID-RANDOM``). The engine loads that very file: a row is scored from the file a
   user would deploy (torch: qkit's own checkpoint, streamed into the reference model).
3. ``Session.measure`` measures it against the reference; ``EngineRefused`` becomes a refused row.
4. The row is assembled (``measuring.assemble_row``); with the full distribution it gets llama-perplexity's
   KL statistics. Once every row is in, ``pairing.pair_rows`` pairs each engine row with the torch row of
   its spec (``Row.versus_torch``) and each method's row with rtn's (``Row.versus``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkit.checkpoint import checkpoint_bytes, read_manifest
from qkit.evaluation.engines import DTYPES, TORCH, Engine, EngineOptions, EngineRefused, Session
from qkit.evaluation.engines.torch_engine import ENGINE as TORCH_ENGINE
from qkit.evaluation.file_rows import file_refusal
from qkit.evaluation.klstats import llama_kl_stats
from qkit.evaluation.measuring import (
    REFERENCE,
    Reference,
    RowFile,
    assemble_row,
    refused_row,
)
from qkit.evaluation.pairing import pair_rows
from qkit.evaluation.token_scores import TokenScores
from qkit.evaluation.report import Row
from qkit.evaluation.row_files import write_row
from qkit.evaluation.specs import RowSettings, RowSpec, parse_plan_word
from qkit.executors import Executor
from qkit.export import QKIT, get_format
from qkit.models import ModelRef, load
from qkit.plan import read_plan
from qkit.staging import temporary_directory
from qkit.transform import entry_to_spec

TMP_PREFIX = "qkit-eval-"  # a row's temporary directory: $TMPDIR/qkit-eval-PID-RANDOM (qkit.staging.temporary_directory)

# How a row's file is written: (engine, spec or None for the reference, directory to write in, label) -> RowFile.
Writer = Callable[[Engine, "RowSpec | None", Path, str], RowFile]
# The torch rows measured in other processes (``--executor ray``: the runner's ``fan_out``): targets in, each
# one's row and its scores (None: refused) out, in the targets' order.
Elsewhere = Callable[[list["Target"]], Iterator[tuple[Row, "TokenScores | None"]]]


@dataclass(frozen=True)
class Target:
    """A row before an engine measures it: ``name`` (the reference's, a saved checkpoint's label, or the
    spec's), its ``spec`` (None for the reference and a checkpoint), and for a saved checkpoint the file
    it is (``checkpoint``), which is loaded as it is, never written."""

    name: str
    spec: RowSpec | None = None
    checkpoint: RowFile | None = None


def row_name(name: str, runtime: str) -> str:
    """A row's name in the table: ``q4_k_m`` for torch, ``q4_k_m [llama.cpp]`` for an engine."""
    return name if runtime == TORCH else f"{name} [{runtime}]"


def targets_for(engine: Engine, reference: Reference, saved: list[Target], specs: list[RowSpec]) -> list[Target]:
    """What ``engine`` measures: the reference (unless its row is this engine's: torch's), a ``saved``
    checkpoint, then every spec."""
    own = [Target(REFERENCE)] if reference.ref_row.runtime != engine.name else []
    return [*own, *saved, *(Target(s.name, s) for s in specs)]


def plan_refusal(spec: RowSpec, engine: Engine) -> str | None:
    """A plan row is written in the engine's format, which must take the plan (``Format.takes_plan``: the
    format it was planned for; qkit's own format stores whatever types a plan chose)."""
    if spec.plan is None:
        return None
    fmt = read_plan(spec.plan).format if spec.plan.endswith(".json") else parse_plan_word(spec.plan)[0]
    if not get_format(engine.format).takes_plan(get_format(fmt)):
        return (f"the plan chose {fmt} types; {engine.name} loads {engine.format}: plan for it "
                f"(plan:{engine.format}@TARGET)")
    return None


def refusal(engine: Engine, target: Target) -> str | None:
    """Why ``engine`` cannot measure ``target``, known before anything is written, or None."""
    if target.checkpoint is not None and not engine.loads_file(get_format(QKIT)):  # a saved checkpoint is qkit's
        return (f"a saved qkit checkpoint is qkit's format, not {engine.format}: write the row with qkit quantize "
                f"--format {engine.format} from the reference, or eval the reference with --runtime {engine.name} "
                "--schemes ...")
    spec = target.spec
    if spec is None:
        return engine.cannot_run(None, ())
    return plan_refusal(spec, engine) or file_refusal(spec, engine) or engine.cannot_run(spec.scheme, spec.simulation)


def saved_rows(checkpoint: ModelRef | None) -> list[Target]:
    """A saved qkit checkpoint as a row whose file is given, with its name and ``Row`` facts from its
    headers and manifest alone: ``checkpoint (SCHEMES)``; bits per weight ``8 * sum(nbytes) / sum(numel)``
    over its quantized weights (``nbytes_for``: the bytes of exactly the parts ``iter_quantized`` checks are
    stored); its files' size; how many weights are quantized; what its method recorded."""
    if checkpoint is None:
        return []
    manifest = read_manifest(checkpoint.directory) or {}
    entries = [entry_to_spec(e) for e in (manifest.get("tensors") or {}).values()]
    nbytes = sum(scheme.nbytes_for(tuple(shape)) for scheme, shape, _ in entries)
    numel = sum(math.prod(shape) for _, shape, _ in entries)
    label = f"checkpoint ({'+'.join(sorted({scheme.name for scheme, _, _ in entries}))})"
    facts = {"bits_per_weight": 8 * nbytes / max(1, numel), "size_bytes": checkpoint_bytes(checkpoint.directory),
             "matrices": len(entries), "method_record": manifest.get("method") or {}}
    return [Target(label, checkpoint=RowFile(None, checkpoint.directory, facts))]


def measure_rows(engines: list[Engine], reference: Reference, saved: list[Target], specs: list[RowSpec], write: Writer,
                 options: EngineOptions, say: Callable[[str], None], elsewhere: Elsewhere | None = None) -> list[Row]:
    """The reference's row, then every engine's rows (``measure_in``), torch first, then the rows paired
    (``pairing.pair_rows``). ``elsewhere``: the torch rows measured in other processes instead (each row
    by ``measure_row``, as here, on a model loaded from the reference's files), returned in order."""
    scores: dict[str, TokenScores] = {REFERENCE: reference.ref_scores}
    rows = [reference.ref_row]
    for engine in engines:
        if elsewhere is not None and engine.name == TORCH:
            rows += measured_elsewhere(elsewhere, targets_for(engine, reference, saved, specs), scores, say)
        else:
            rows += measure_in(engine, reference, saved, specs, write, options, scores, say)
    pair_rows(rows, specs, scores)
    return rows


def measured_elsewhere(elsewhere: Elsewhere, targets: list[Target], scores: dict[str, TokenScores],
                       say: Callable[[str], None]) -> list[Row]:
    """``targets``' rows from ``elsewhere``, in order; ``scores`` gets each measured row's scores."""
    rows = []
    for k, (row, measured) in enumerate(elsewhere(targets)):
        if measured is not None:
            scores[row.scheme] = measured
        say(f"{row.scheme}: measured in another process ({k + 1} of {len(targets)} rows)")
        rows.append(row)
    return rows


def measure_in(engine: Engine, reference: Reference, saved: list[Target], specs: list[RowSpec], write: Writer,
               options: EngineOptions, scores: dict[str, TokenScores], say: Callable[[str], None]) -> list[Row]:
    """What ``engine`` measures (``targets_for``) measured in it (see the module docstring), in order;
    ``scores`` gets each measured row's scores by its table name."""
    targets = targets_for(engine, reference, saved, specs)
    session = engine.open(reference, options, say)
    try:
        return [measure_row(engine, session, t, reference, write, scores, say) for t in targets]
    finally:
        session.close()


def measure_row(engine: Engine, session: Session, target: Target, reference: Reference, write: Writer,
                scores: dict[str, TokenScores], say: Callable[[str], None]) -> Row:
    label = row_name(target.name, engine.name)
    base: dict[str, Any] = {"runtime": engine.name, "spec": target.spec.to_dict() if target.spec is not None else {}}
    t0 = time.perf_counter()
    reason = refusal(engine, target)
    if reason is not None:
        say(f"{label}: not run ({reason})")
        return refused_row(label, reason, **base)
    try:
        with temporary_directory(TMP_PREFIX) as tmp:  # the writer's PID in the name: a killed eval's is removed
            row = target.checkpoint or write(engine, target.spec, Path(tmp), label)
            measured = session.measure(row, label)
    except EngineRefused as e:
        say(f"{label}: {engine.name} refused it ({e})")
        return refused_row(label, str(e), seconds=time.perf_counter() - t0, **base)
    scores[label] = measured.scores
    out = assemble_row(label, measured, reference.battery, reference, time.perf_counter() - t0, **row.facts,
                       **measured.facts, **base)
    if measured.full:
        out.llama_kl = llama_kl_stats(measured.scores, reference.ref_scores)
    return out


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


def fan_out(executor: Executor, reference: Reference, settings: RowSettings, engine: EngineOptions) -> Elsewhere:
    """The torch rows as ``executor``'s tasks (``measure_elsewhere``), results in the targets' order: each
    written with ``settings`` and measured with ``engine`` (whose dtype the tasks load the reference in). The
    reference's log-probabilities are copied to a named file in a ``qkit-eval-PID-*`` directory (removed
    after the rows, on an error too), and the driver's model is released first: each task loads its own
    from the reference's files, so the driver holds no model while the rows run."""

    def run(targets: list[Target]) -> Iterator[tuple[Row, TokenScores | None]]:
        with temporary_directory(TMP_PREFIX) as tmp:
            reference.corpus.share(Path(tmp) / "reference-logprobs.f32")
            reference.release_model()
            job = RowJob(reference, settings, engine, reference.device, engine.dtype)
            yield from executor.map(measure_elsewhere, targets, job)
    return run


def measure_elsewhere(job: RowJob, target: Target) -> tuple[Row, TokenScores | None]:
    """One torch row in this (worker) process, exactly as ``measure_in`` measures it in the driver:
    the reference model loaded from its files, the row written here (``row_files.write_row``) and swapped
    into it (``TorchSession``). The model is loaded per row and dropped after it (no model outlives a task)."""
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


def _quiet(_message: str) -> None:
    pass


__all__ = ["Elsewhere", "RowJob", "TMP_PREFIX", "Target", "Writer", "fan_out", "measure_elsewhere", "measure_in",
           "measured_elsewhere", "measure_row", "measure_rows", "plan_refusal", "refusal", "row_name", "saved_rows",
           "targets_for"]
