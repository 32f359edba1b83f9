"""Eval runtimes: ``torch`` (qkit's own forward pass) and the engines a row's file is loaded into.

The contract is ``qkit.evaluation.engines.base``; each engine module registers itself into ``ENGINES``
when this package is imported (its engine's Python package is imported only in its worker subprocess).
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

__all__ = ["DTYPES", "ENGINES", "EXECUTOR_BACKENDS", "Engine", "EngineJob", "EngineOptions", "EngineRefused",
           "EngineScores", "TORCH", "check_runtimes", "get_engine", "runtime_names"]
