"""Run-time simulations: what happens while the model runs, not in storage.

Activation fake-quantization (W8A8), LLM.int8's mixed-precision decomposition, SmoothQuant's W8A8
after folding, and a quantized KV cache are installed on a loaded model as hooks (or replaced forward
functions) and removed afterwards, leaving the model exactly as it was.

A runtime is registered under a name (``register_runtime``) as a factory ``(options) -> Runtime``; a
``Runtime`` has::

    name: str
    act_bits: int | None            # bits of the activations it simulates (None: unchanged)
    kv_bits: int | None             # bits of the KV cache it simulates (None: unchanged)
    install(model, context) -> Handle      # context: RuntimeContext (calibration ids for static scales)
    Handle.remove() -> None; Handle.stats() -> dict  (e.g. the share of LLM.int8's 16-bit columns)

``apply_runtime(model, names, context, options)`` is the one entry the eval runner uses.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qkit.errors import InputError


@dataclass
class RuntimeContext:
    """What a runtime may need besides the model: calibration token ids ``[samples, seqlen]`` (for static
    activation scales), the device, and free-form facts."""

    calibration_ids: torch.Tensor | None = None
    device: torch.device | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Handle(Protocol):
    def remove(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class Runtime(Protocol):
    name: str
    act_bits: int | None
    kv_bits: int | None

    def install(self, model: torch.nn.Module, context: RuntimeContext) -> Handle: ...


_RUNTIMES: dict[str, Callable[[Mapping[str, Any]], Runtime]] = {}


def register_runtime(name: str, factory: Callable[[Mapping[str, Any]], Runtime]) -> None:
    if name in _RUNTIMES:
        raise InputError(f"runtime {name!r} is already registered")
    _RUNTIMES[name] = factory


def runtime_names() -> list[str]:
    return list(_RUNTIMES)


def get_runtime(name: str, options: Mapping[str, Any] | None = None) -> Runtime:
    key = name.strip().lower()
    if key not in _RUNTIMES:
        close = difflib.get_close_matches(key, runtime_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"unknown run-time simulation {name!r}{hint}; use one of {', '.join(runtime_names()) or '-'}")
    return _RUNTIMES[key](dict(options or {}))


@contextlib.contextmanager
def apply_runtime(
    model: torch.nn.Module,
    names: Sequence[str],
    context: RuntimeContext | None = None,
    options: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Install the named runtimes on ``model`` for the duration of the block; yields a dict that is
    filled, on exit, with each runtime's ``stats()`` under its name."""
    context = context or RuntimeContext()
    runtimes = [get_runtime(n, options) for n in names]
    handles: list[tuple[str, Handle]] = []
    stats: dict[str, Any] = {}
    try:
        for r in runtimes:
            handles.append((r.name, r.install(model, context)))
        yield stats
    finally:
        for name, h in reversed(handles):
            stats[name] = h.stats()
            h.remove()


def runtime_bits(names: Sequence[str], options: Mapping[str, Any] | None = None) -> tuple[int | None, int | None]:
    """``(activation bits, KV bits)`` the named runtimes simulate (None where unchanged)."""
    act = kv = None
    for n in names:
        r = get_runtime(n, options)
        act = r.act_bits if r.act_bits is not None else act
        kv = r.kv_bits if r.kv_bits is not None else kv
    return act, kv


def _register_builtin() -> None:
    import importlib
    import importlib.util

    for module in ("qkit.simulate.activations", "qkit.simulate.llm_int8", "qkit.simulate.kv_cache", "qkit.simulate.rows"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


_register_builtin()

__all__ = ["Handle", "Runtime", "RuntimeContext", "apply_runtime", "get_runtime", "register_runtime", "runtime_bits", "runtime_names"]
