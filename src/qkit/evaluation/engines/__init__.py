"""Eval runtimes, every one an ``Engine``: ``torch`` (qkit's own forward pass, in process) and the engines
a row's file is loaded into in a worker subprocess (``vllm``, ``llama.cpp``).

The contract is ``qkit.evaluation.engines.base``; each engine module registers itself into ``ENGINES``
when this package is imported (a worker engine's Python package is imported only in its subprocess).
``torch_engine`` is the in-process one (it also measures the reference every row is compared with);
``scoring`` is what the worker engines share (their job, their answers as scores); ``worker`` runs a worker
script in a subprocess (the file exchange, refusals, nothing left running).
"""

from qkit.evaluation.engines.base import (
    DTYPES,
    ENGINES,
    EXECUTOR_BACKENDS,
    TORCH,
    Engine,
    EngineJob,
    EngineOptions,
    EngineRefused,
    EngineScores,
    Session,
    check_engine_lengths,
    check_runtimes,
    engines_named,
    get_engine,
    runtime_names,
)

# Each engine registers itself when imported, after the contract above: torch, vllm, then llama.cpp, the
# order --runtime lists them in (neither worker engine's module imports its engine: only their workers do).
# isort: off
from qkit.evaluation.engines import torch_engine  # noqa: F401
from qkit.evaluation.engines import vllm  # noqa: F401
from qkit.evaluation.engines import llama_cpp  # noqa: F401
# isort: on

__all__ = ["DTYPES", "ENGINES", "EXECUTOR_BACKENDS", "Engine", "EngineJob", "EngineOptions", "EngineRefused",
           "EngineScores", "Session", "TORCH", "check_engine_lengths", "check_runtimes", "engines_named", "get_engine",
           "runtime_names"]
