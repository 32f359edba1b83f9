"""``qkit eval``: one row per spec and runtime, each computed from the file ``qkit quantize`` writes.

Layer 6 (``evaluation``): above ``methods`` and ``simulate`` (layer 5) and ``models``; a row's file is
written by ``qkit.api.quantize_model`` (``row_files``), the one path that writes checkpoints, which imports
nothing of evaluation. ``evaluate`` is a short pipeline of named steps, each given only its part of the
options, resolved once at the top (``qkit.evaluation.options.EvalRun``):

1. ``EvalOptions.resolve``: every check that needs no model (milliseconds); it returns the specs
   (``RowSpec``: storage scheme or plan, method, simulations) ``--schemes`` and ``--methods`` name, the
   engines ``--runtime`` names, the calibrations the rows read, and each step's settings.
2. MODEL (and ``--reference`` for a saved checkpoint) resolved to local directories (``inputs.pair_models``).
3. ``inputs.check_inputs``: every refusal that needs no model loaded (the window against the model's
   context, token counts too small for a standard error, the corpus and calibration texts, a checkpoint's
   and a plan file's tensor names and shapes against the reference's headers, the engines' lengths).
4. The reference model, loaded once and measured once by the torch engine (its corpus log-probabilities,
   battery answers and greedy continuations: ``engines.torch_engine.measure_reference``).
5. ``engine_rows.measure_rows``: every engine ``--runtime`` names (``qkit.evaluation.engines``, torch
   first) measures the reference (but torch, whose row it is), a saved checkpoint and every spec, the same
   way: the row's file is written by ``row_files.write_row`` in the engine's format (torch: qkit's own, streamed into
   the reference model with the row's simulation hooks installed; vLLM, llama.cpp: compressed-tensors or
   GGUF, loaded in a worker subprocess, which first releases qkit's model), and the engine measures it
   against the reference. The rows are then paired (``pairing``: methods against rtn, engines against torch).
6. The report: the rows, the provenance (``provenance``), the notes under the table (``notes``).

``--executor ray`` (``EvalOptions.executor``, ``qkit.executors``): step 5's torch rows, each independent
given the reference, run as Ray tasks (``engine_rows.fan_out``): each task loads the reference model from its
files, writes and measures its row exactly as step 5 does here (``engine_rows.measure_elsewhere``), and the rows come back
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

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from qkit.evaluation.engine_rows import TMP_PREFIX, fan_out, measure_rows, saved_rows
from qkit.evaluation.engines import DTYPES
from qkit.evaluation.engines.torch_engine import measure_reference
from qkit.evaluation.inputs import check_inputs, pair_models
from qkit.evaluation.notes import interpret
from qkit.evaluation.options import EvalOptions
from qkit.evaluation.provenance import provenance
from qkit.evaluation.report import EvalReport
from qkit.evaluation.row_files import write_row
from qkit.models import load, pinned_of, resolve
from qkit.plan import KeptMeasurements
from qkit.staging import remove_stale_temporary  # the same liveness test as every output's staging siblings

__all__ = ["evaluate", "remove_killed_rows", "remove_stale_row_dirs"]


def evaluate(
    model: str | Path | None = None,
    *,
    options: EvalOptions = EvalOptions(),
    on_status: Callable[[str], None] | None = None,
) -> EvalReport:
    """Evaluate MODEL under every spec in every runtime (or a saved qkit checkpoint against its reference).

    Every input is checked before the reference model is loaded (see the module docstring)."""
    say = on_status or _quiet
    run = options.resolve()  # a bad option fails before anything is resolved or loaded; each step's part apart
    torch.manual_seed(run.seed)
    remove_killed_rows(say)
    target = resolve(model, trust_remote_code=run.models.trust_remote_code)
    given = run.models.reference
    base = resolve(given, trust_remote_code=run.models.trust_remote_code) if target.is_quantized else None
    models = pair_models(target, base, given)
    specs = [] if models.checkpoint is not None else run.specs  # a saved checkpoint is its own row
    inputs = check_inputs(models, specs, run.engines, run.inputs)  # the engines' lengths too, before loading
    with run.executor.open(torch.get_num_threads()) as executor:  # Ray connected (or started) before the model loads
        say("loading the reference model")
        loading = run.loading
        lm = load(ref=models.ref, device=loading.device, device_map=loading.device_map, dtype=DTYPES[loading.dtype]).model
        reference = measure_reference(lm, models.ref, inputs, run.answering, say)
        del lm  # the reference holds it now: released before an engine loads its own copy
        # the plan rows' sensitivity, measured once for every row of the same format and method: kept for this run only
        writer = functools.partial(write_row, reference=reference, settings=run.rows, say=say, kept=KeptMeasurements())
        elsewhere = fan_out(executor, reference, run.rows, run.engine) if executor.parallel else None
        rows = measure_rows(run.engines, reference, saved_rows(models.checkpoint), specs, writer, run.engine, say,
                            elsewhere)
    facts = provenance(rows, reference, inputs, models, run.engines, run.engine, run.scale_dtype, run.seed)
    return EvalReport(rows, facts, interpret(rows, reference.corpus.scored_tokens, model=pinned_of(models.ref)))


def _quiet(_message: str) -> None:
    pass


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

