"""Scheme registry: one registered name -> one frozen scheme config.

A scheme is any frozen dataclass with ``name``, ``kind``, ``bits``, ``scale_dtype``, ``to_dict()``,
``parts`` (the stored tensor names, ``("qweight", "scales")`` plus any extra), and the two halves of
its storage format::

    encode(w: float Tensor[any shape]) -> dict[part name, Tensor]      (no I/O, runs on w's device)
    decode(parts: dict[part name, Tensor], shape, dtype) -> Tensor[shape] in dtype

Scheme families register here too (``register_family``): a regular expression over names and a
factory, e.g. ``int{4,8}-g{N}``. Other modules (``qkit.schemes.ggml``, ``qkit.schemes.fp4``) register
their schemes on import; ``qkit.schemes`` imports them all.

The six named schemes of the quality table are registered at import. The absmax group family
parses on demand: ``int{4,8}-g{N}`` (``int4-g64``, ``int8-g128``, ...) gives ``AbsmaxScheme(bits,
PerGroup(N))``, the same family as the registered ``int4-g128``. ``scale_dtype`` (fp16 by default, the
bits-per-weight column of the README) is a parameter: ``get_scheme("nf4", scale_dtype="fp32")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.granularity import Granularity, PerGroup, PerRow, PerTensor
from qkit.schemes.absmax import dequantize_absmax, quantize_absmax
from qkit.schemes.nf4 import dequantize_nf4, quantize_nf4
from qkit.schemes.packing import pack_nibbles, unpack_nibbles

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

    parts = ("qweight", "scales")

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_absmax(w.reshape(as_2d(tuple(w.shape))), self.bits, self.granularity, self.scale_dtype)
        return {"qweight": self.pack_codes(q), "scales": scales}

    def pack_codes(self, q: torch.Tensor) -> torch.Tensor:
        """int8 codes ``[rows, cols]`` -> stored ``qweight``: 4-bit codes offset-binary (``q + 8``) and packed."""
        return pack_nibbles((q + 8).to(torch.uint8)) if self.packed else q.to(torch.int8)

    def codes(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Stored ``qweight`` -> int8 codes ``[rows, cols]`` in ``[-qmax-1, qmax]``."""
        rows, cols = as_2d(shape)
        if self.packed:
            return (unpack_nibbles(parts["qweight"], rows * cols).to(torch.int8) - 8).view(rows, cols)
        return parts["qweight"].view(rows, cols)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        q = self.codes(parts, shape)
        return dequantize_absmax(q, parts["scales"], self.granularity, dtype).reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{part: (shape, dtype)}`` that ``encode`` stores for a weight of ``shape`` (checked on reading)."""
        rows, cols = as_2d(tuple(shape))
        q = ((-(-rows * cols // 2),), torch.uint8) if self.packed else ((rows, cols), torch.int8)
        return {"qweight": q, "scales": (self.granularity.scale_shape((rows, cols)), self.scale_dtype)}

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

    parts = ("qweight", "scales")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError(f"NF4 block size must be positive, got {self.block_size}")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales = quantize_nf4(w, self.block_size, self.scale_dtype)
        return {"qweight": qweight, "scales": scales}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4(parts["qweight"], parts["scales"], shape, self.block_size, dtype)

    def part_layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{part: (shape, dtype)}`` that ``encode`` stores: codes of the flattened tensor, one absmax per block."""
        n = math.prod(shape)
        return {"qweight": ((-(-n // 2),), torch.uint8), "scales": ((-(-n // self.block_size),), self.scale_dtype)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": 4,
            "granularity": "block",
            "block_size": self.block_size,
            "scale_dtype": _DTYPE_NAMES[self.scale_dtype],
        }


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view a scheme quantizes: ``[shape[0], prod(shape[1:])]``; 1-D as ``[1, n]``."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


# Any registered scheme class (AbsmaxScheme, NF4Scheme, and those of qkit.schemes.ggml / fp4).
Scheme = Any

_REGISTRY: dict[str, Scheme] = {}
_FAMILIES: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Scheme | None], str]] = []


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


def register_family(pattern: str, factory: Callable[[re.Match[str]], Scheme | None], spelling: str) -> None:
    """Register a family of names: ``factory(match)`` builds the scheme (or None: not a member).

    ``spelling`` is how error messages name the family, e.g. ``"int4-gN / int8-gN"``.
    """
    _FAMILIES.append((re.compile(pattern), factory, spelling))


register_family(
    r"^int(\d+)-g(\d+)$",
    lambda m: AbsmaxScheme(m.group(0), int(m.group(1)), PerGroup(int(m.group(2))))
    if int(m.group(1)) in SUPPORTED_BITS and int(m.group(2)) > 0 else None,
    "int4-gN / int8-gN for another group size N",
)


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
    for pattern, factory, _ in _FAMILIES:
        if scheme is not None:
            break
        m = pattern.match(name)
        scheme = factory(m) if m else None
    if scheme is None:
        close = difflib.get_close_matches(name, scheme_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        families = "".join(f", or {spelling}" for _, _, spelling in _FAMILIES)
        raise SchemeError(f"unknown scheme {name!r}{hint}; valid schemes: {', '.join(scheme_names())}{families}")
    if scale_dtype is not None and not getattr(scheme, "fixed_scale_dtype", False):
        scheme = dataclasses.replace(scheme, scale_dtype=parse_scale_dtype(scale_dtype))
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
        if d.get("kind") == "nf4" == scheme.kind and block != scheme.block_size:
            # NF4 with another block size is real (bitsandbytes' blocksize); any other type is not one.
            if not isinstance(block, int) or isinstance(block, bool):
                raise SchemeError(f"block_size {block!r} is not an integer")
            scheme = dataclasses.replace(scheme, block_size=block)
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
