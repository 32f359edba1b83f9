"""An engine's rows (``--runtime torch,vllm,llama.cpp``): every row measured the same way, in every engine.

Layer 6 (``evaluation``): above ``engines`` (the ``Engine`` protocol, its sessions) and ``measuring`` (the
values a row passes around). The runner calls ``measure_rows``, which measures every engine's rows
(``measure_in``), torch first, then pairs them (``pairing``); the torch reference is measured before any of
them (``engines.torch_engine.measure_reference``), since every row is compared with it.

For each target (an engine's own reference, a saved checkpoint, every spec), in order:

1. ``refusal`` gives a reason known before anything is written (a scheme the engine's format has no type
   for, a simulation the engine does not run, a plan for another format, a saved qkit checkpoint in an
   engine that reads another format, a file row in an engine that does not load GGUF files): a row that
   says so (``Row.refused``), nothing written.
2. The row's file is written by the runner's writer (``qkit.api.quantize_model`` with the engine's
   ``export_options``, exactly as ``qkit quantize --format ...`` writes it; the reference's is the same
   exporter with nothing quantized: ``write_reference``) into the row's temporary directory
   (``$TMPDIR/qkit-eval-PID-RANDOM``). The engine loads that very file: a row is scored from the file a
   user would deploy (torch: qkit's own checkpoint, streamed into the reference model).
3. ``Session.measure`` measures it against the reference; ``EngineRefused`` becomes a refused row.
4. The row is assembled (``measuring.assemble_row``); with the full distribution it gets llama-perplexity's
   KL statistics. Once every row is in, ``pairing.pair_rows`` pairs each engine row with the torch row of
   its spec (``Row.versus_torch``) and each method's row with rtn's (``Row.versus``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkit.checkpoint import checkpoint_bytes, iter_tensors, read_manifest, tensor_shapes
from qkit.evaluation.engines import TORCH, Engine, EngineOptions, EngineRefused, Session
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
from qkit.evaluation.perplexity import TokenScores
from qkit.evaluation.report import Row
from qkit.evaluation.specs import RowSpec, parse_plan_word
from qkit.export import QKIT, atomic_output, get_format, prepare_export
from qkit.models import ModelRef
from qkit.plan import read_plan
from qkit.schemes import get_scheme
from qkit.schemes.registry import DEFAULT_SCHEME
from qkit.staging import temporary_directory
from qkit.transform import Rules, entry_to_spec, new_manifest

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


__all__ = ["Elsewhere", "TMP_PREFIX", "Target", "Writer", "measure_in", "measured_elsewhere", "measure_row", "measure_rows", "plan_refusal", "refusal",
           "row_name", "saved_rows", "targets_for", "write_reference"]
