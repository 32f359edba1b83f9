"""Methods: how the integers and scales of a scheme are chosen.

A scheme names the stored format (``int4-g64``, ``nf4``, ``q4_k``); a method decides which codes and
scales go into it. ``rtn`` (round to nearest, today's path) needs nothing but the weight and streams one
tensor at a time. Calibrated methods (``gptq``, ``awq``) and scale-folding transforms (``smoothquant``)
need calibration activations and see the whole model; each returns the same ``QuantizedTensor`` objects
RTN returns, so every writer and exporter takes their output unchanged.

A method is registered under one name (``register_method``) as an object with::

    name: str
    calibrated: bool                       # needs calibration text (recorded in the manifest)
    options_type: type                     # its frozen options dataclass (defaults defined once there)
    check(scheme) -> None                  # raise SchemeError/InputError: it cannot serve this scheme
    run(ref, targets, options, *, device, on_block) -> MethodResult

``run`` gets the resolved model (``qkit.models.ModelRef``), ``targets`` ``{tensor name: scheme}``
(the same plan RTN would quantize), the method's options and a callback ``on_block(done, total)``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qkit.errors import InputError
from qkit.schemes import QuantizedTensor, Scheme

RTN = "rtn"


@dataclass
class MethodResult:
    """What a method produced for one model.

    ``quantized``: every target tensor's ``QuantizedTensor``. ``replaced``: full-precision tensors the
    method changed (AWQ / SmoothQuant fold per-channel scales into a preceding norm or linear); the
    writer stores them instead of the source's. ``record``: JSON-able facts for the manifest and
    ``--json`` (options, calibration text and its sha256, per-layer seconds and errors).
    """

    quantized: dict[str, QuantizedTensor]
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


class Method(Protocol):
    name: str
    calibrated: bool
    options_type: type

    def check(self, scheme: Scheme) -> None: ...

    def run(
        self,
        ref: Any,
        targets: dict[str, Scheme],
        options: Any,
        *,
        device: torch.device,
        on_block: Callable[[int, int], None] | None = None,
    ) -> MethodResult: ...


_METHODS: dict[str, Callable[[], Method]] = {}


def register_method(name: str, factory: Callable[[], Method]) -> None:
    """Register a method factory under ``name`` (imported lazily: torch-heavy code loads on first use)."""
    if name in _METHODS:
        raise InputError(f"method {name!r} is already registered")
    _METHODS[name] = factory


def method_names() -> list[str]:
    return [RTN, *_METHODS]


def get_method(name: str) -> Method | None:
    """The method called ``name``; ``None`` for ``rtn`` (the streaming path needs no method object)."""
    key = name.strip().lower()
    if key == RTN:
        return None
    if key not in _METHODS:
        close = difflib.get_close_matches(key, method_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"unknown method {name!r}{hint}; use one of {', '.join(method_names())}")
    return _METHODS[key]()


def make_options(method: Method, given: Mapping[str, Any] | None) -> Any:
    """The method's options dataclass from ``given`` (keys it does not know are refused in one line)."""
    given = dict(given or {})
    known = {f.name for f in dataclasses.fields(method.options_type)}
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise InputError(
            f"method {method.name} takes no option {', '.join(unknown)}; its options are {', '.join(sorted(known))}"
        )
    return method.options_type(**given)


def _register_builtin() -> None:
    # Each factory imports its module on first use, so ``import qkit`` stays light.
    import importlib
    import importlib.util

    for name, module in (("gptq", "qkit.methods.gptq"), ("awq", "qkit.methods.awq"), ("smoothquant", "qkit.methods.smoothquant")):
        spec = importlib.util.find_spec(module)
        if spec is not None:
            register_method(name, lambda module=module: importlib.import_module(module).METHOD)


_register_builtin()

__all__ = ["RTN", "Method", "MethodResult", "get_method", "make_options", "method_names", "register_method"]
