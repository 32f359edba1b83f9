"""Where a row is measured, a *runtime*: an ``Engine`` that loads the row's written file and measures it.

Layer 6 (``evaluation``). Every runtime is an ``Engine`` registered in ``ENGINES`` (``--runtime`` names
them): ``torch`` (qkit's own forward pass, in this process, on the reference model itself; the default,
``engines.torch_engine``), ``vllm`` and ``llama.cpp``. The runner measures every row the same way, through
this protocol: ``cannot_run`` refuses what the engine cannot do before anything is written; the row's
file is written by the same ``quantize_model`` path as every checkpoint, in the format the engine reads
(``Engine.format``: qkit's own for torch, compressed-tensors for vLLM, GGUF for llama.cpp, with
``export_options``); ``open(reference, ...)`` gives a ``Session`` whose ``measure(row_file)`` returns the
row's ``Measured`` scores against the reference.

vLLM and llama.cpp never run in qkit's process (``engines.scoring.WorkerEngine``): ``run`` starts a worker
subprocess (its process model, memory and logging stay out of qkit's), hands it the row's written file and
an ``EngineJob`` (the same token ids every runtime scores), and reads back ``EngineScores``. Their Python
packages are optional installs (``qkit[llama-cpp]``; vLLM in an environment of its own, docs/vllm.md),
imported only inside the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError, QkitError
from qkit.evaluation.measuring import Measured, Reference, RowFile
from qkit.export import Format
from qkit.registry import Registry

TORCH = "torch"  # qkit's own forward pass (dequantized weights, simulation hooks): the default runtime

# --dtype: the torch runtime's model dtype, and the reference's.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

EXECUTOR_BACKENDS = ("mp", "ray")  # vLLM's --distributed-executor-backend
MAX_DEVICES = 65536  # --tensor-parallel-size, --pipeline-parallel-size: more devices than any cluster gives one model


@dataclass(frozen=True)
class EngineOptions:
    """The engines' settings, defined once (``qkit eval`` and ``qkit verify`` pass them through).

    ``tensor_parallel_size`` / ``pipeline_parallel_size`` / ``distributed_executor_backend``: vLLM's
    sharding over devices (and, with Ray, nodes); ``max_model_len``: the engine's context (default: the
    eval window); ``python``: the interpreter that has the engine installed (default: qkit's own; or
    ``$QKIT_ENGINE_PYTHON``), for an engine kept in a virtual environment of its own."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_model_len: int | None = None
    python: str | None = None
    dtype: str | None = None  # what the engine computes in, a DTYPES key (qkit eval passes --dtype); None: the file's

    def validate(self) -> None:
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if value < 1:
                raise InputError(f"{flag} must be at least 1, got {value}")
            whole(value, flag, 1, MAX_DEVICES)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InputError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.max_model_len is not None:
            whole(self.max_model_len, "--max-model-len", 2, MAX_COUNT)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.distributed_executor_backend is not None and self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise InputError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")

    @property
    def parallel(self) -> bool:
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.distributed_executor_backend is not None


@dataclass
class EngineJob:
    """What every runtime is asked for one row: the same token ids, so rows pair position by position.

    ``windows``: int64 ``[w]`` corpus windows (position t is predicted from positions < t, t >= 1);
    ``battery_prompts``: each battery prompt's token ids (chat template applied), generated greedily for
    ``battery_tokens`` tokens with ``repetition_penalty``; ``agreement_inputs``: each battery prompt
    followed by the reference's ``agreement_n`` greedy tokens (unpadded), read teacher-forced;
    ``top_k``: how many log-probabilities per position an engine without the full distribution returns."""

    windows: list[torch.Tensor]
    battery_prompts: list[list[int]]
    battery_tokens: int
    repetition_penalty: float
    agreement_inputs: list[list[int]]
    agreement_n: int
    top_k: int = 20


@dataclass
class EngineScores:
    """What an engine measured, per window and per prompt of ``EngineJob``.

    ``target_logprobs``: float64 ``[w-1]``, log q(x_t) of each scored token; ``full``: float32
    ``[w-1, V]`` log-probabilities over the whole vocabulary (None where the engine gives only the top
    ``k``: then ``top_ids`` / ``top_logprobs`` int64 / float32 ``[w-1, k]``); ``argmax``: int64 ``[w-1]``;
    ``battery_ids``: the generated token ids per prompt; ``agreement_argmax``: int64 ``[agreement_n]``
    per prompt, the argmax at each of the reference's continuation positions; ``load_seconds`` /
    ``run_seconds``: loading the file, then scoring and generating; ``version``: the engine's version;
    ``notes``: what the engine said that a reader should see (e.g. the kernel it chose)."""

    target_logprobs: list[torch.Tensor]
    argmax: list[torch.Tensor]
    battery_ids: list[list[int]]
    agreement_argmax: list[torch.Tensor]
    full: list[torch.Tensor] | None = None
    top_ids: list[torch.Tensor] | None = None
    top_logprobs: list[torch.Tensor] | None = None
    load_seconds: float = 0.0
    run_seconds: float = 0.0
    version: str = ""
    notes: list[str] = field(default_factory=list)


class EngineRefused(QkitError):
    """The engine could not load or run this row's file (e.g. no W4A16 kernel on this CPU build). The
    message is the engine's reason in one line; the runner turns it into a row that says so."""


class Session(Protocol):
    """An engine opened on one eval's reference: it measures one row's file after another."""

    def measure(self, row: RowFile, label: str) -> Measured:
        """Load ``row`` (its file, and its simulations where the engine runs them) and measure it against the
        reference; ``label``: the row's name in the table. ``EngineRefused``: the engine could not."""
        ...

    def close(self) -> None:
        """Leave nothing of the rows behind (torch: the reference's own weights back in place)."""
        ...


class Engine(Protocol):
    """One runtime: where eval rows are measured (registered in ``ENGINES``)."""

    name: str  # "torch", "vllm", "llama.cpp": the --runtime word
    extra: str  # the pip extra that installs it: qkit[<extra>] ("": part of qkit)
    format: str  # the qkit export format it reads: "qkit", "compressed-tensors" or "gguf"
    full_distribution: bool  # True: it returns every vocabulary entry's log-probability (KL computable)

    def check_available(self, options: EngineOptions) -> None:
        """Raise ``InputError`` in one line naming the extra when the engine is not installed, or when
        ``options`` ask for more devices than exist; milliseconds, before any model is loaded."""
        ...

    def cannot_run(self, scheme: str | None, simulations: tuple[str, ...]) -> str | None:
        """Why this engine cannot run a row of ``scheme`` (None: the unquantized reference) with these
        run-time simulations, known before anything is written (e.g. a scheme GGUF has no type for), or
        None. A reason only the engine can tell comes later, from ``run``, as ``EngineRefused``."""
        ...

    def export_options(self, simulations: tuple[str, ...]) -> dict[str, Any]:
        """The ``QuantizeOptions`` fields a row's file is written with: at least ``{"format": self.format}``,
        plus what the file must declare for the row's run-time simulations (vLLM's W8A8 rows:
        ``{"activations": "int8-token"}``) or how it is best written for this engine (torch: small shards)."""
        ...

    def open(self, reference: Reference, options: EngineOptions, say: Callable[[str], None]) -> Session:
        """A session measuring rows against ``reference`` with ``options``; ``say``: status lines."""
        ...

    def loads_file(self, fmt: Format) -> bool:
        """Whether the engine measures a file given in format ``fmt`` (a registered ``export.Format``: GGUF for
        ``qkit eval --schemes file:PATH.gguf``, qkit's own for a saved checkpoint) as it is, nothing written:
        torch reads what ``Format.torch_loads`` says, llama.cpp loads a GGUF file; vLLM neither."""
        ...


ENGINES: Registry[Engine] = Registry("runtime", error=InputError, normalize=lambda n: n.strip().lower())


def get_engine(name: str) -> Engine:
    return ENGINES.get(name)


def runtime_names() -> list[str]:
    """Every ``--runtime`` word, torch first (the order the engines registered in)."""
    return ENGINES.names()


def engines_named(runtimes: tuple[str, ...]) -> list[Engine]:
    """The engines ``--runtime`` names, torch first (its rows are measured on the reference model, which the
    other engines release before loading their own copy), the others in the order given, each once."""
    engines = list(dict.fromkeys(get_engine(r) for r in runtimes))
    return sorted(engines, key=lambda e: e.name != TORCH)


def check_engine_lengths(engines: list[Engine], options: EngineOptions, window: int, prompt_lengths: list[int],
                         battery_tokens: int, agree_tokens: int) -> None:
    """Refuse, before any model is loaded, an eval whose sequences exceed ``--max-model-len``: the window,
    the longest battery prompt plus its new tokens, or plus the agreement tokens. It is the context of the
    engines that load their own copy of the weights (torch runs the model's own, which the window is checked
    against from the model's config)."""
    engines = [e for e in engines if e.name != TORCH]
    if not engines or options.max_model_len is None:
        return
    longest = max(prompt_lengths, default=0)
    need = max(window, longest + battery_tokens, longest + agree_tokens)
    if options.max_model_len < need:
        what = (f"the eval window is {window} tokens" if need == window else
                f"the longest battery prompt ({longest} tokens) with {max(battery_tokens, agree_tokens)} more is {need}")
        raise InputError(f"--max-model-len {options.max_model_len} is too short for --runtime "
                         f"{', '.join(e.name for e in engines)}: {what}; pass --max-model-len {need} or more"
                         + (", or a smaller --window" if need == window else ""))


def check_runtimes(runtimes: tuple[str, ...], dtype: str, options: EngineOptions) -> None:
    """``--runtime``, ``--dtype`` and the engine options, in milliseconds: unknown names, a duplicate, an
    engine that is not installed (one line naming its extra), parallelism asked of the torch runtime."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not runtimes:
        raise InputError(f"--runtime names no runtime; choose from {', '.join(runtime_names())}")
    seen: set[str] = set()
    for name in runtimes:
        key = name.strip().lower()
        if key in seen:
            raise InputError(f"--runtime names {key} twice")
        seen.add(key)
        ENGINES.get(key)  # an unknown name: the registry's words
    options.validate()
    if options.parallel and seen == {TORCH}:
        raise InputError("--tensor-parallel-size, --pipeline-parallel-size and --distributed-executor-backend are "
                         "vLLM's; add --runtime vllm (the torch runtime spreads a model with --device-map)")
    for key in sorted(seen):
        ENGINES.get(key).check_available(options)


__all__ = ["DTYPES", "ENGINES", "EXECUTOR_BACKENDS", "Engine", "EngineJob", "EngineOptions", "EngineRefused",
           "EngineScores", "Session", "TORCH", "check_engine_lengths", "check_runtimes", "engines_named", "get_engine",
           "runtime_names"]
