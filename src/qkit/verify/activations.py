"""W8A8 exports: the library's logits against qkit's own run-time simulation of the activations.

compressed-tensors' CPU rule (``compressed_tensors_w8a8.library_fake_quant``: ``max|x| / 127.5``) is what
``qkit verify`` holds the library to exactly; what a serving engine computes (vLLM's int8 kernels:
``max|x| / 127``) is qkit's ``act-int8-token`` simulation (``qkit.simulate``), reported here alongside.
"""

from __future__ import annotations

import torch

from qkit.export.compressed_tensors_w8a8 import INT8_TOKEN
from qkit.simulate import apply_simulation

# The simulation of qkit.simulate that models what a serving engine does with each declared activation rule.
SIMULATION = {INT8_TOKEN: "act-int8-token"}

# A stated tolerance: qkit's simulation and the library's rule put activations on grids of steps
# absmax/127 and absmax/127.5, so their rounding errors are about as large as each other and mostly
# independent: the logits they give differ by about sqrt(2) times the effect of the activation
# quantization itself (max |simulated W8A8 - W8A16 logits|). Twice that effect is the bound checked.
SIMULATION_FACTOR = 2.0


@torch.no_grad()
def simulation_report(model: torch.nn.Module, ids: torch.Tensor, lib_logits: torch.Tensor, activations: str) -> dict:
    """Compare the library's logits with qkit's own run-time simulation of ``activations`` (``qkit.simulate``,
    e.g. ``act-int8-token``) on ``model`` (qkit's dequantized weights), and with no activation quantization.

    Returns ``{"simulation", "max_abs_diff", "activation_effect", "tolerance", "ok"}``: ``max_abs_diff`` =
    ``max |library - simulation|``; ``activation_effect`` = ``max |simulation - weights only|``; ``ok`` when
    ``max_abs_diff <= SIMULATION_FACTOR * activation_effect`` (see the constant's comment)."""
    simulation = SIMULATION[activations]
    weights_only = model(ids).logits.float()
    with apply_simulation(model, [simulation]):
        simulated = model(ids).logits.float()
    diff = float((lib_logits - simulated).abs().max())
    effect = float((simulated - weights_only).abs().max())
    return {"simulation": simulation, "max_abs_diff": diff, "activation_effect": effect,
            "tolerance": SIMULATION_FACTOR * effect, "ok": diff <= SIMULATION_FACTOR * effect}


__all__ = ["SIMULATION", "SIMULATION_FACTOR", "simulation_report"]
