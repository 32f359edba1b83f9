"""Run-time simulations: what happens while the model runs, not in storage.

Layer 5 (beside ``methods``, ``export`` and ``serving``; below ``evaluation``, whose torch engine applies
them). Activation fake-quantization (W8A8), LLM.int8's mixed-precision decomposition, SmoothQuant's W8A8
after folding, and a quantized KV cache are installed on a loaded model as hooks (or replaced forward
functions) and removed afterwards, leaving the model exactly as it was.

The protocol and the registry are in ``qkit.simulate.base`` (``SIMULATIONS``); each module below
registers its simulations there on import. ``apply_simulation(model, names, context, options)`` is the
one entry the torch engine uses. The named eval rows that use these simulations are in
``qkit.evaluation.rows``.
"""

from __future__ import annotations

from qkit.simulate import activations, kv_cache, llm_int8  # noqa: F401 (each registers its simulations)
from qkit.simulate.base import (
    SIMULATIONS,
    Handle,
    Simulation,
    SimulationContext,
    apply_simulation,
    get_simulation,
    register_simulation,
    simulation_bits,
    simulation_names,
)

__all__ = [
    "SIMULATIONS",
    "Handle",
    "Simulation",
    "SimulationContext",
    "apply_simulation",
    "get_simulation",
    "register_simulation",
    "simulation_bits",
    "simulation_names",
]
