"""Eval runtimes: ``torch`` (qkit's own forward pass) and the engines a row's file is loaded into.

The contract is ``qkit.evaluation.engines.base``; each engine module registers itself into ``ENGINES``
when this package is imported (its engine's Python package is imported only in its worker subprocess).
``worker`` runs a worker script in a subprocess (the file exchange, refusals, nothing left running).
"""

import importlib.util

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

# Each engine registers itself on import, in the order --help lists them. The vLLM module is written
# separately; until it exists the package works without it (find_spec: no import, just a lookup).
if importlib.util.find_spec("qkit.evaluation.engines.vllm") is not None:
    import qkit.evaluation.engines.vllm  # noqa: F401,E402  (registers "vllm")
import qkit.evaluation.engines.llama_cpp  # noqa: F401,E402  (registers "llama.cpp")

__all__ = ["DTYPES", "ENGINES", "EXECUTOR_BACKENDS", "Engine", "EngineJob", "EngineOptions", "EngineRefused",
           "EngineScores", "TORCH", "check_runtimes", "get_engine", "runtime_names"]
