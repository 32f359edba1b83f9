"""What every command module shares: option aliases (each option defined once), error handling, parsing.

A new option that more than one command takes belongs here as an ``Annotated`` alias; its default comes
from the library (the config dataclass or the function's keyword default), never from a second literal.
Library errors (``QkitError``) become one line on stderr and the error's exit code, never a traceback.
Every command's preamble is ``start`` (the ``--json`` target checked against what the command reads),
then the command's own checks, then ``Run.use_threads()``, the work, and ``Run.write_json``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Optional

import typer

from qkit import claims, console, outputs
from qkit.errors import QkitError
from qkit.lists import check_words, numbers, split_list, split_values  # noqa: F401 (check_words, numbers: for the commands)
from qkit.methods.calibration import DEFAULT_SAMPLES as _CAL_SAMPLES
from qkit.methods.calibration import DEFAULT_SEQLEN as _CAL_SEQLEN
from qkit.methods.smoothquant import DEFAULT_ALPHA as _SQ_ALPHA
from qkit.pinned_models import PINNED_MODELS
from qkit.texts import joined_sources
from qkit.threads import set_threads
from qkit.version import __version__

# --------------------------------------------------------------------------- shared options (defined once)

ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Model directory, hub id, .gguf file, qkit checkpoint or a pinned model's name "
        f"({', '.join(PINNED_MODELS.names())}: fetched once); omitted: the pinned default model.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    Optional[str], typer.Option("--json", help="Also write everything the table shows as JSON to PATH ('-': stdout).", metavar="PATH")
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output (-o, --json) that qkit wrote.")]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N. Default: CUDA when available, else CPU.")
]
DeviceMapOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device-map",
        help="auto | balanced | sequential: spread the model over all GPUs and CPU memory (accelerate); "
        "CPU-placed layers run slower, see docs/models-devices-threads.md.",
    ),
]
ScaleDtypeOpt = Annotated[str, typer.Option("--scale-dtype", help="Dtype the scales are stored (and applied) in: fp16, bf16, fp32.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow custom model code from the model's repository.")]
# Eval runtimes and the engines' settings (qkit.evaluation.engines.EngineOptions holds the defaults).
RuntimeOpt = Annotated[Optional[str], typer.Option("--runtime", help="Where rows are measured, comma-separated: torch (qkit's forward pass), vllm, llama.cpp (the engine loads the row's written file) [default: torch].", metavar="LIST")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="The torch runtime's model dtype: fp32, bf16, fp16; the reference is scored in it too [default: fp32].")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", help="The most memory the command may peak at: 8GiB, 512MiB, 20G (binary), 1500MB; refused before the model loads when too small (default: the memory available, less a tenth).", metavar="SIZE")]
TensorParallelOpt = Annotated[Optional[int], typer.Option("--tensor-parallel-size", help="vLLM: shard each layer over this many devices [default: 1].")]
PipelineParallelOpt = Annotated[Optional[int], typer.Option("--pipeline-parallel-size", help="vLLM: split the layers over this many devices or nodes [default: 1].")]
ExecutorBackendOpt = Annotated[Optional[str], typer.Option("--distributed-executor-backend", help="vLLM: mp (one node) or ray (several nodes) [default: vLLM's choice].")]
# Where independent work runs (qkit.executors; ExecutorOptions holds the defaults).
ExecutorOpt = Annotated[Optional[str], typer.Option("--executor", help="Where independent work runs: serial (here, one after another) or ray (each item a Ray task; needs qkit[ray]) [default: serial].")]
RayAddressOpt = Annotated[Optional[str], typer.Option("--ray-address", help="With --executor ray: HOST:PORT of a running Ray cluster (what `ray start --head` prints) [default: a local cluster for this run, stopped after].", metavar="ADDR")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="The engine's context length [default: the eval window].")]


def engine_options(tensor_parallel_size=None, pipeline_parallel_size=None, distributed_executor_backend=None,
                   max_model_len=None):
    """The engine options given on the command line over ``EngineOptions``' defaults (an option left out
    keeps its default)."""
    # qkit.evaluation imports torch; cli.common stays light
    from qkit.evaluation.engines import EngineOptions

    given = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
             "distributed_executor_backend": distributed_executor_backend, "max_model_len": max_model_len}
    return EngineOptions(**{k: v for k, v in given.items() if v is not None})
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickled .bin/.pt weights (can run code).")]
ConfigOpt = Annotated[
    Optional[str], typer.Option("--config", help="A config.json (or a directory holding one) instead of MODEL.", metavar="PATH")
]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        help="CPU threads for torch (default: the cores available to this process; "
        "on a machine shared with busy processes, fewer is faster, see docs/models-devices-threads.md).",
        show_default=False,
    ),
]

# Calibration text of the calibrated methods (gptq, awq, smoothquant), imatrix and plan: shared by quantize,
# eval, imatrix and plan. The defaults live in qkit.methods.calibration and qkit.catalog; a value not given
# is not passed, so each method's options dataclass applies its own default. Repeatable: a list, which
# calibration_options and the options dataclasses join into one value (qkit.texts.joined_sources).
CalibrationOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--calibration",
        help="Calibration text: a UTF-8 file, a directory (its files), several (comma-separated, or repeat the option), "
        "kjv:BOOK[,BOOK...] or hf:DATASET[:CONFIG[:SPLIT]]; several are mixed (default: qkit's mix of prose, technical "
        "prose, code, dialogue and other languages, docs/corpora.md; a text sharing any 12-word run with an eval text "
        "is refused).",
        metavar="LIST",
        show_default=False,
    ),
]
CalibrationSamplesOpt = Annotated[
    Optional[int],
    typer.Option("--calibration-samples", help=f"Calibration windows (default {_CAL_SAMPLES}).", metavar="N", show_default=False),
]
CalibrationSeqlenOpt = Annotated[
    Optional[int],
    typer.Option("--calibration-seqlen", help=f"Tokens per calibration window (default {_CAL_SEQLEN}, or the model's context "
                 "where that is shorter).", metavar="L", show_default=False),
]

# SmoothQuant's migration strength and AWQ's clipping search; defaults in their options dataclasses.
AlphaOpt = Annotated[
    Optional[float],
    typer.Option("--alpha", help=f"smoothquant: migration strength in [0, 1], s = max|X|^alpha / max|W|^(1-alpha) "
                 f"(default {_SQ_ALPHA}).", show_default=False),
]
NoClipOpt = Annotated[bool, typer.Option("--no-clip", help="awq: skip the clipping search (on by default, as in AutoAWQ).")]
# Mixture-of-experts calibration (qkit.methods.experts): quantize's gptq and imatrix, and qkit imatrix
CalibrateAllExpertsOpt = Annotated[bool, typer.Option("--calibrate-all-experts", help="Mixture-of-experts models: every expert computes on every calibration token for its statistics (llm-compressor's moe_calibrate_all_experts), while each layer's output still combines only the router's top-k with its weights (default: each expert sees the tokens routed to it).")]


def calibration_options(calibration: str | list[str] | None, samples: int | None, seqlen: int | None, **more) -> dict:
    """The method options the user gave (None: not given, the method's default applies); a repeated
    ``--calibration`` as one value (``texts.joined_sources``)."""
    given = {"calibration": joined_sources(calibration), "calibration_samples": samples, "calibration_seqlen": seqlen,
             **more}
    return {k: v for k, v in given.items() if v is not None}


# --------------------------------------------------------------------------- errors, output targets, threads


def handles_errors(fn):
    """Turn ``QkitError`` into one line and its exit code; release the outputs the command claimed
    (``qkit.claims.scope``) when it ends, however it ends."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with claims.scope():
                return fn(*args, **kwargs)
        except QkitError as exc:
            console.error(str(exc))
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def json_target(json_path: str | None, force: bool = False, inputs: Iterable[outputs.Input] = ()) -> None:
    """Check the ``--json`` target before any work: not empty, not a directory, not one of ``inputs`` (or
    inside one) whatever ``force``, an existing file only with ``force`` and only if it is JSON, a writable
    place (``qkit.outputs.check_output_path``); then claim it for this run (``qkit.outputs.claim_output``: a
    second qkit process writing it refuses). With ``--json -`` the JSON owns stdout and the tables move to stderr."""
    if json_path is not None and json_path != "-":
        outputs.check_output_path(json_path, kind="json", force=force, inputs=inputs, what="--json")
        outputs.claim_output(json_path, "--json")
    console.use_stderr_for_tables(json_path == "-")


model_inputs = outputs.model_inputs  # what a MODEL argument reads, for the output checks
file_inputs = outputs.file_inputs  # a file option (a corpus, --calibration, --config; hf:... is none)


def reads(model: str | os.PathLike | None, *files: tuple[str, str | None]) -> list[outputs.Input]:
    """What a command with a MODEL argument and file options reads: ``model_inputs(model)`` and, for each
    ``(label, value)``, ``file_inputs(label, value)``."""
    return [*model_inputs(model), *(i for label, value in files for i in file_inputs(label, value))]


def use_threads(threads: int | None) -> int:
    """Set torch's CPU threads once, before any work (``--threads``, else the cores this process may use)."""
    return set_threads(threads)


@dataclasses.dataclass(frozen=True)
class Run:
    """What a command's preamble (``start``) hands on: the ``--json`` target, ``--threads`` and the inputs
    the outputs were checked against."""

    json_path: str | None
    threads: int | None
    inputs: tuple[outputs.Input, ...]

    def use_threads(self) -> int:
        """Set torch's CPU threads (``use_threads``); called after the command's own checks, before any work."""
        return use_threads(self.threads)

    def write_json(self, data: Callable[[], Any]) -> None:
        """With ``--json``, write what ``data()`` returns there (computed only then), with the
        ``qkit_version`` that wrote it at the top where the document records none (an eval's is in its
        provenance), so ``qkit report`` can refuse files of different versions."""
        if self.json_path:
            doc = data()
            if isinstance(doc, dict) and "qkit_version" not in doc and "qkit_version" not in (doc.get("provenance") or {}):
                doc = {"qkit_version": __version__, **doc}
            console.write_json(self.json_path, doc)


def start(json_path: str | None, force: bool, threads: int | None = None, inputs: Iterable[outputs.Input] = (),
          writes: Iterable[outputs.Output] = (), may_hold: Iterable[str] = ()) -> Run:
    """Every command's first line, before any work: the ``--json`` target against ``inputs`` (``json_target``),
    then the command's outputs against each other (``--json`` and ``writes``, its other outputs as ``(option,
    path)``; ``qkit.outputs.check_apart``, where only the options in ``may_hold`` may hold another). Returns
    what the rest of the command needs."""
    inputs = tuple(inputs)
    json_target(json_path, force, inputs)
    outputs.check_apart([*writes, ("--json", json_path)], may_hold=may_hold)
    return Run(json_path, threads, inputs)


# --------------------------------------------------------------------------- parsing and formatting


def human_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f} B"


def parse_list(text: str | None, option: str, *, what: str = "name", where: str = "", spaces: bool = False,
               lower: bool = False) -> tuple[str, ...] | None:
    """A comma-separated list option: ``None`` (left out: the library's default) -> ``None``; else its
    entries (``qkit.lists.split_list``: an empty value or an empty entry is refused, naming ``option``)."""
    if text is None:
        return None
    words = split_list(text, option, what=what, where=where, spaces=spaces)
    return tuple(w.lower() for w in words) if lower else tuple(words)


def repeated_list(values: Iterable[str] | None, option: str, *, what: str = "name", where: str = "") -> tuple[str, ...] | None:
    """An option that is both repeatable and comma-separated (``-s nf4 -s int8-row,int4-g64``): every value
    through ``split_list`` (``qkit.lists.split_values``); not given -> ``None``."""
    values = list(values or [])
    return tuple(split_values(values, option, what=what, where=where)) if values else None
