"""The scheme registry: one registered name -> one frozen scheme config (a :class:`~qkit.schemes.base.Scheme`).

Built on ``qkit.registry.Registry``. Each family module registers its schemes on import
(``qkit.schemes.absmax``: ``int8-tensor`` ... ``int4-g128`` and the ``int{4,8}-g{N}`` family; ``nf4``;
``fp4``: ``mxfp4``, ``nvfp4``; ``ggml``: ``q8_0`` ... ``q5_1``; ``kquants``: ``q4_k``, ``q6_k``;
``recipes``: ``q4_k_m``), and ``qkit.schemes`` imports them all, in that order: the order of
``scheme_names()``, of ``--help`` and of the docs' table. A family (``register_family``) is a pattern
over names and a factory: ``int4-g64`` gives ``AbsmaxScheme(4, PerGroup(64))``, the family of the
registered ``int4-g128``.

``scale_dtype`` (fp16 by default, the bits-per-weight column of the docs) is a parameter of the
lookup: ``get_scheme("nf4", scale_dtype="fp32")``; schemes whose format fixes it ignore it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.registry import Registry
from qkit.schemes.base import DTYPE_NAMES, SCALE_DTYPES, Scheme, as_2d  # noqa: F401  as_2d: for qkit.methods.gptq.method

DEFAULT_SCHEME = "nf4"  # what ``qkit quantize`` writes when no --scheme is given
DEFAULT_SCALE_DTYPE = "fp16"  # the bits-per-weight column of the docs assumes fp16 scales
# The quality table's schemes, in its row order (what ``qkit eval`` and ``qkit inspect`` run by default).
DEFAULT_SCHEMES: tuple[str, ...] = ("int8-tensor", "int8-row", "int4-tensor", "int4-row", "int4-g128", "nf4")

# Names are matched stripped and in lower case, nothing more ("q4-k" is not "q4_k").
REGISTRY: Registry[Scheme] = Registry("scheme", error=SchemeError, normalize=lambda n: n.strip().lower())


@dataclass(frozen=True)
class Family:
    """A family of names too many to list: how messages spell it, one member, and a one-line description."""

    spelling: str  # e.g. "int4-gN / int8-gN for another group size N"
    names: tuple[str, ...]  # the family's names as the docs' table writes them, e.g. ("int4-gN", "int8-gN")
    example: str  # a member, e.g. "int4-g64" (the docs' table shows its numbers)
    description: str


FAMILIES: list[Family] = []


def register(scheme: Scheme) -> Scheme:
    """Register ``scheme`` under its name; a second scheme with the same name is an error."""
    if REGISTRY.canonical(scheme.name) is not None:
        raise SchemeError(f"scheme {scheme.name!r} is already registered")
    return REGISTRY.register(scheme.name, scheme)


def register_family(
    pattern: str,
    factory: Callable[[re.Match[str]], Scheme | None],
    spelling: str,
    *,
    names: tuple[str, ...],
    example: str,
    description: str,
) -> None:
    """Register a family of names: ``factory(match)`` builds the scheme (or None: not a member) for a name
    ``pattern`` matches whole. ``spelling`` is how error messages name the family."""
    REGISTRY.register_family(pattern, factory, spelling)  # type: ignore[arg-type]  # None: no member
    FAMILIES.append(Family(spelling, names, example, description))


def scheme_names() -> list[str]:
    """Registered scheme names, in registration order (family members not included)."""
    return REGISTRY.names()


def parse_scale_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in DTYPE_NAMES:
            return value
        raise SchemeError(f"scale dtype {value} is not supported; use one of {', '.join(SCALE_DTYPES)}")
    key = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(
        value, value
    )
    if key not in SCALE_DTYPES:
        raise SchemeError(f"unknown scale dtype {value!r}; use one of {', '.join(SCALE_DTYPES)}")
    return SCALE_DTYPES[key]


def get_scheme(name: str, scale_dtype: str | torch.dtype | None = None) -> Scheme:
    """Look up ``name`` (a registered name or a family member such as ``int4-g64``).

    Raises ``SchemeError`` in the registry's words (the closest match, every name and family) for anything else.
    """
    scheme = REGISTRY.get(name)
    if scale_dtype is not None and not scheme.fixed_scale_dtype:
        scheme = dataclasses.replace(scheme, scale_dtype=parse_scale_dtype(scale_dtype))  # type: ignore[type-var]
    return scheme


def scheme_from_dict(d: dict[str, Any]) -> Scheme:
    """Rebuild a scheme from its manifest entry, checking that the registry still agrees with it.

    Raises ``SchemeError`` for an entry that is not a dict, has no string ``name``, names an unknown
    scheme, or differs in any recorded field (bits, group or block size, scale dtype, ...) from what the
    registry builds under that name: a hand-edited entry is refused, never decoded with other numbers.
    """
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise SchemeError(f"manifest scheme entry {d!r} is malformed (not an object with a scheme name); re-create the checkpoint")
    try:
        scale_dtype = d.get("scale_dtype")
        scheme = get_scheme(d["name"], scale_dtype if isinstance(scale_dtype, str) else None)  # else: mismatch below
        block = d.get("block_size")
        if d.get("kind") == "nf4" == scheme.kind and block != scheme.block_size:  # type: ignore[attr-defined]
            # NF4 with another block size is real (bitsandbytes' blocksize); any other type is not one.
            if not isinstance(block, int) or isinstance(block, bool):
                raise SchemeError(f"block_size {block!r} is not an integer")
            scheme = dataclasses.replace(scheme, block_size=block)  # type: ignore[type-var]
    except SchemeError as exc:
        raise SchemeError(f"manifest scheme entry {d!r} is malformed ({exc}); re-create the checkpoint") from None
    want = scheme.to_dict()
    differ = [k for k in want if d.get(k) != want[k]]
    if differ:
        raise SchemeError(
            f"manifest scheme entry {d.get('name')!r} does not match this qkit's: "
            + ", ".join(f"{k} {d.get(k)!r} where it has {want[k]!r}" for k in differ)
            + "; re-create the checkpoint with this version of qkit"
        )
    return scheme


__all__ = [
    "DEFAULT_SCALE_DTYPE",
    "DEFAULT_SCHEME",
    "DEFAULT_SCHEMES",
    "FAMILIES",
    "REGISTRY",
    "Family",
    "get_scheme",
    "parse_scale_dtype",
    "register",
    "register_family",
    "scheme_from_dict",
    "scheme_names",
]
