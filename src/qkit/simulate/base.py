"""The runtime protocol and its registry: ``RUNTIMES``, ``get_runtime``, ``apply_runtime``.

Layer 5 (``simulate``), below ``evaluation`` (the runner applies runtimes to rows; the named rows that
use them are registered in ``qkit.evaluation.rows``). Each runtime module (``activations``,
``llm_int8``, ``kv_cache``) registers its factories here at import; ``qkit.simulate`` imports them all.

A runtime is registered under a name as a factory ``(options) -> Runtime``; a ``Runtime`` has::

    name: str
    act_bits: int | None            # bits of the activations it simulates (None: unchanged)
    kv_bits: int | None             # bits of the KV cache it simulates (None: unchanged)
    install(model, context) -> Handle      # context: RuntimeContext (calibration ids for static scales)
    Handle.remove() -> None; Handle.stats() -> dict  (e.g. the share of LLM.int8's 16-bit columns)
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qkit.errors import InputError  # the error RUNTIMES raises for an unknown name
from qkit.registry import Registry


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


RuntimeFactory = Callable[[Mapping[str, Any]], Runtime]


class _RuntimeRegistry(Registry[RuntimeFactory]):
    # The wording every runtime refusal has always had ("(did you mean 'x'?)"; the tests pin it).
    def unknown(self, name: str) -> str:
        close = difflib.get_close_matches(self.normalize(str(name)), self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; use one of {', '.join(self.names()) or '-'}"


# Names are matched stripped and lower-cased (no "_" for "-": runtime names have always been exact).
RUNTIMES = _RuntimeRegistry("run-time simulation", error=InputError, normalize=lambda n: n.strip().lower())


def register_runtime(name: str, factory: RuntimeFactory) -> None:
    RUNTIMES.register(name, factory)


def runtime_names() -> list[str]:
    return RUNTIMES.names()


def get_runtime(name: str, options: Mapping[str, Any] | None = None) -> Runtime:
    """The runtime called ``name`` built with ``options`` (each family takes its own keys)."""
    return RUNTIMES.get(name)(dict(options or {}))


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


__all__ = [
    "RUNTIMES",
    "Handle",
    "Runtime",
    "RuntimeContext",
    "RuntimeFactory",
    "apply_runtime",
    "get_runtime",
    "register_runtime",
    "runtime_bits",
    "runtime_names",
]
