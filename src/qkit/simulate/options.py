"""Simulation options: one frozen dataclass per simulation family, one shared ``{key: value}`` mapping.

``qkit eval`` passes the same simulation options (``--threshold``, ``--kv-residual``, ...) to every simulation
of a row, so each family takes the keys its dataclass defines and ignores the others' keys; a key that
*no* family defines is refused in one line (a misspelt option must never be silently dropped). The
defaults live in the dataclasses, once; the CLI reads them from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from qkit.errors import InputError

_FAMILIES: dict[str, type] = {}
T = TypeVar("T")


def register_options(family: str, options_type: type) -> None:
    """Declare the options dataclass of a simulation family (``activations``, ``llm-int8``, ``kv-cache``)."""
    _FAMILIES[family] = options_type


def known_keys() -> dict[str, str]:
    """``{option key: family}`` over every registered family."""
    return {f.name: family for family, t in _FAMILIES.items() for f in dataclasses.fields(t)}


def check_keys(given: Mapping[str, Any] | None) -> None:
    """Refuse keys that no simulation family defines."""
    known = known_keys()
    unknown = sorted(k for k in (given or {}) if k not in known)
    if unknown:
        raise InputError(
            f"no run-time simulation takes the option {', '.join(unknown)}; the options are {', '.join(sorted(known)) or '-'}"
        )


def build(options_type: type[T], given: Mapping[str, Any] | None) -> T:
    """``options_type`` from the keys of ``given`` it defines (others belong to other families)."""
    check_keys(given)
    mine = {f.name for f in dataclasses.fields(options_type)}
    return options_type(**{k: v for k, v in (given or {}).items() if k in mine and v is not None})


__all__ = ["build", "check_keys", "known_keys", "register_options"]
