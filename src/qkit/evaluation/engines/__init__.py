"""Eval runtimes: ``torch`` (qkit's own forward pass) and the engines a row's file is loaded into.

The contract is ``qkit.evaluation.engines.base``; each engine module registers itself into ``ENGINES``
when this package is imported (its engine's Python package is imported only in its worker subprocess).
``worker`` runs a worker script in a subprocess (the file exchange, refusals, nothing left running).
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
    check_runtimes,
    get_engine,
    runtime_names,
)

# Each engine registers itself when imported, after the contract above: vllm, then llama.cpp, the order
# they are listed in (neither module imports its engine: only their workers do).
# isort: off
from qkit.evaluation.engines import vllm  # noqa: F401
from qkit.evaluation.engines import llama_cpp  # noqa: F401
# isort: on

__all__ = ["DTYPES", "ENGINES", "EXECUTOR_BACKENDS", "Engine", "EngineJob", "EngineOptions", "EngineRefused",
           "EngineScores", "TORCH", "check_runtimes", "get_engine", "runtime_names"]
