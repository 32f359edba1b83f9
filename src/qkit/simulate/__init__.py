"""Run-time simulations: what happens while the model runs, not in storage.

Layer 5 (beside ``methods``, ``export`` and ``serving``; below ``evaluation``, whose runner applies
them). Activation fake-quantization (W8A8), LLM.int8's mixed-precision decomposition, SmoothQuant's W8A8
after folding, and a quantized KV cache are installed on a loaded model as hooks (or replaced forward
functions) and removed afterwards, leaving the model exactly as it was.

The protocol and the registry are in ``qkit.simulate.base`` (``RUNTIMES``); each module below registers
its runtimes there on import. ``apply_runtime(model, names, context, options)`` is the one entry the
eval runner uses. The named eval rows that use these runtimes are in ``qkit.evaluation.rows``.
"""

from __future__ import annotations

from qkit.simulate import activations, kv_cache, llm_int8  # noqa: F401 (each registers its runtimes)
from qkit.simulate.base import (
    RUNTIMES,
    Handle,
    Runtime,
    RuntimeContext,
    apply_runtime,
    get_runtime,
    register_runtime,
    runtime_bits,
    runtime_names,
)

__all__ = [
    "RUNTIMES",
    "Handle",
    "Runtime",
    "RuntimeContext",
    "apply_runtime",
    "get_runtime",
    "register_runtime",
    "runtime_bits",
    "runtime_names",
]
