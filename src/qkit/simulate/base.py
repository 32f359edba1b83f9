"""The simulation protocol and its registry: ``SIMULATIONS``, ``get_simulation``, ``apply_simulation``.

Layer 5 (``simulate``), below ``evaluation`` (the torch engine applies a row's simulations while it measures
the row; the named rows that use them are registered in ``qkit.evaluation.rows``). Each simulation module
(``activations``, ``llm_int8``, ``kv_cache``) registers its factories here at import; ``qkit.simulate``
imports them all.

A *simulation* is what happens while the model runs, not in storage: activations or the KV cache
quantized on the fly by hooks. (A *runtime* is where a row runs: torch, vLLM, llama.cpp; see
``qkit.evaluation.engines``.) A simulation is registered under a name as a factory
``(options) -> Simulation``; a ``Simulation`` has::

    name: str
    act_bits: int | None            # bits of the activations it simulates (None: unchanged)
    kv_bits: int | None             # bits of the KV cache it simulates (None: unchanged)
    install(model, context) -> Handle      # context: SimulationContext (calibration ids for static scales)
    calibration_options() -> CalibrationOptions | None   # what it calibrates on (None: nothing)
    Handle.remove() -> None; Handle.stats() -> dict  (e.g. the share of LLM.int8's 16-bit columns)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qkit.errors import InputError  # the error SIMULATIONS raises for an unknown name
from qkit.methods.calibration import CalibrationOptions
from qkit.registry import Registry


@dataclass
class SimulationContext:
    """What a simulation may need besides the model: calibration token ids ``[samples, seqlen]`` (for static
    activation scales), the device, and free-form facts."""

    calibration_ids: torch.Tensor | None = None
    device: torch.device | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Handle(Protocol):
    def remove(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class Simulation(Protocol):
    name: str
    act_bits: int | None
    kv_bits: int | None

    def install(self, model: torch.nn.Module, context: SimulationContext) -> Handle: ...

    def calibration_options(self) -> CalibrationOptions | None:
        """The calibration tokens it calibrates on (static activation scales), or None: ``qkit eval`` reads and
        checks them against its corpus before the model loads."""
        ...


SimulationFactory = Callable[[Mapping[str, Any]], Simulation]


# Names are matched stripped and lower-cased (no "_" for "-": simulation names have always been exact).
SIMULATIONS: Registry[SimulationFactory] = Registry("run-time simulation", error=InputError,
                                                    normalize=lambda n: n.strip().lower())


def register_simulation(name: str, factory: SimulationFactory) -> None:
    SIMULATIONS.register(name, factory)


def simulation_names() -> list[str]:
    return SIMULATIONS.names()


def get_simulation(name: str, options: Mapping[str, Any] | None = None) -> Simulation:
    """The simulation called ``name`` built with ``options`` (each family takes its own keys)."""
    return SIMULATIONS.get(name)(dict(options or {}))


@contextlib.contextmanager
def apply_simulation(
    model: torch.nn.Module,
    names: Sequence[str],
    context: SimulationContext | None = None,
    options: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Install the named simulations on ``model`` for the duration of the block; yields a dict that is
    filled, on exit, with each simulation's ``stats()`` under its name."""
    context = context or SimulationContext()
    simulations = [get_simulation(n, options) for n in names]
    handles: list[tuple[str, Handle]] = []
    stats: dict[str, Any] = {}
    try:
        for s in simulations:
            handles.append((s.name, s.install(model, context)))
        yield stats
    finally:
        for name, h in reversed(handles):
            stats[name] = h.stats()
            h.remove()


def simulation_bits(names: Sequence[str], options: Mapping[str, Any] | None = None) -> tuple[int | None, int | None]:
    """``(activation bits, KV bits)`` the named simulations simulate (None where unchanged)."""
    act = kv = None
    for n in names:
        s = get_simulation(n, options)
        act = s.act_bits if s.act_bits is not None else act
        kv = s.kv_bits if s.kv_bits is not None else kv
    return act, kv


__all__ = [
    "SIMULATIONS",
    "Handle",
    "Simulation",
    "SimulationContext",
    "SimulationFactory",
    "apply_simulation",
    "get_simulation",
    "register_simulation",
    "simulation_bits",
    "simulation_names",
]
