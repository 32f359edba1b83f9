"""Scheme registry: one registered name -> one frozen scheme config.

The six named schemes of the quality table are registered at import. The absmax group family
parses on demand: ``int{4,8}-g{N}`` (``int4-g64``, ``int8-g128``, ...) gives ``AbsmaxScheme(bits,
PerGroup(N))``, the same family as the registered ``int4-g128``. ``scale_dtype`` (fp16 by default, the
bits-per-weight column of the README) is a parameter: ``get_scheme("nf4", scale_dtype="fp32")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.granularity import Granularity, PerGroup, PerRow, PerTensor

SCALE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
_DTYPE_NAMES = {v: k for k, v in SCALE_DTYPES.items()}
SUPPORTED_BITS = (4, 8)
DEFAULT_SCHEME = "nf4"  # what ``qkit quantize`` writes when no --scheme is given
DEFAULT_SCALE_DTYPE = "fp16"  # the bits-per-weight column of the README assumes fp16 scales


@dataclass(frozen=True)
class AbsmaxScheme:
    """Symmetric absmax integer quantization (see ``qkit.schemes.absmax``)."""

    name: str
    bits: int
    granularity: Granularity
    scale_dtype: torch.dtype = torch.float16
    kind = "absmax"

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise SchemeError(f"scheme {self.name!r}: bits must be one of {SUPPORTED_BITS}, got {self.bits}")

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def to_dict(self) -> dict[str, Any]:
        g = self.granularity
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": self.bits,
            "granularity": "group" if isinstance(g, PerGroup) else g.label,
            "group_size": g.size if isinstance(g, PerGroup) else None,
            "scale_dtype": _DTYPE_NAMES[self.scale_dtype],
            "symmetric": True,
        }


@dataclass(frozen=True)
class NF4Scheme:
    """NF4 codebook with a flattened absmax per block (see ``qkit.schemes.nf4``)."""

    name: str = "nf4"
    block_size: int = 64
    scale_dtype: torch.dtype = torch.float16
    kind = "nf4"
    bits = 4
    packed = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError(f"NF4 block size must be positive, got {self.block_size}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": 4,
            "granularity": "block",
            "block_size": self.block_size,
            "scale_dtype": _DTYPE_NAMES[self.scale_dtype],
        }


Scheme = AbsmaxScheme | NF4Scheme

_REGISTRY: dict[str, Scheme] = {}
_GROUP_FAMILY = re.compile(r"^int(\d+)-g(\d+)$")


def register(scheme: Scheme) -> Scheme:
    """Register ``scheme`` under its name; a second scheme with the same name is an error."""
    if scheme.name in _REGISTRY:
        raise SchemeError(f"scheme {scheme.name!r} is already registered")
    _REGISTRY[scheme.name] = scheme
    return scheme


# The quality table's schemes, in its row order.
for _s in (
    AbsmaxScheme("int8-tensor", 8, PerTensor()),
    AbsmaxScheme("int8-row", 8, PerRow()),
    AbsmaxScheme("int4-tensor", 4, PerTensor()),
    AbsmaxScheme("int4-row", 4, PerRow()),
    AbsmaxScheme("int4-g128", 4, PerGroup(128)),
    NF4Scheme(),
):
    register(_s)
DEFAULT_SCHEMES: tuple[str, ...] = tuple(_REGISTRY)


def scheme_names() -> list[str]:
    return list(_REGISTRY)


def parse_scale_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES:
            return value
        raise SchemeError(f"scale dtype {value} is not supported; use one of {', '.join(SCALE_DTYPES)}")
    key = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(
        value, value
    )
    if key not in SCALE_DTYPES:
        raise SchemeError(f"unknown scale dtype {value!r}; use one of {', '.join(SCALE_DTYPES)}")
    return SCALE_DTYPES[key]


def get_scheme(name: str, scale_dtype: str | torch.dtype | None = None) -> Scheme:
    """Look up ``name`` (a registered name or an ``int{bits}-g{N}`` family member).

    Raises ``SchemeError`` listing the valid names (and the closest match) for anything else.
    """
    name = name.strip().lower()
    scheme = _REGISTRY.get(name)
    if scheme is None:
        m = _GROUP_FAMILY.match(name)
        if m and int(m.group(1)) in SUPPORTED_BITS and int(m.group(2)) > 0:
            scheme = AbsmaxScheme(name, int(m.group(1)), PerGroup(int(m.group(2))))
    if scheme is None:
        close = difflib.get_close_matches(name, scheme_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SchemeError(
            f"unknown scheme {name!r}{hint}; valid schemes: {', '.join(scheme_names())}, "
            "or int4-gN / int8-gN for another group size N"
        )
    if scale_dtype is not None:
        scheme = dataclasses.replace(scheme, scale_dtype=parse_scale_dtype(scale_dtype))
    return scheme


def scheme_from_dict(d: dict[str, Any]) -> Scheme:
    """Rebuild a scheme from its manifest entry, checking that the registry still agrees with it."""
    try:
        scheme = get_scheme(d["name"], d["scale_dtype"])
        if d.get("kind") == "nf4" and d.get("block_size") not in (None, scheme.block_size):
            scheme = dataclasses.replace(scheme, block_size=int(d["block_size"]))
    except (KeyError, TypeError) as exc:
        raise SchemeError(f"manifest scheme entry {d!r} is malformed ({exc}); re-create the checkpoint") from exc
    if scheme.to_dict() != {k: d.get(k) for k in scheme.to_dict()}:
        raise SchemeError(
            f"manifest scheme entry {d} does not match this qkit's {scheme.to_dict()}; "
            "re-create the checkpoint with this version of qkit"
        )
    return scheme
