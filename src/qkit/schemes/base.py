"""What every scheme is (the ``Scheme`` protocol) and the optional capabilities some have.

Layer 2 (``schemes/``): tensors in, tensors out; no I/O. A scheme is one registered name and one
frozen config (``qkit.schemes.registry``). Its two halves of a storage format::

    encode(w: float Tensor[any shape]) -> {part name: Tensor}          (no I/O, runs on w's device)
    decode(parts, shape, dtype)        -> Tensor[shape] in dtype

and what can be said of a weight of ``shape`` without a tensor: ``part_layout(shape)`` (the name, shape
and dtype of each stored part, checked on reading) and ``nbytes_for(shape)`` (their bytes, exactly what
``encode`` returns). Weights are quantized as ``[shape[0], prod(shape[1:])]`` (:func:`as_2d`).

Capabilities beyond that are their own protocols, checked with ``isinstance``, never probed with
``hasattr``: :class:`Recipe` (a scheme that picks a stored type per tensor, such as ``q4_k_m``) and
:class:`GGMLCodable` (a scheme llama.cpp's GGUF stores as one of its block types). Every scheme has
``resolve`` and ``bind`` (:class:`SchemeDefaults` gives both as "this scheme itself"), so callers call
them unconditionally.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from qkit.errors import SchemeError

if TYPE_CHECKING:  # annotations only: the gguf package is imported by the GGML family (``schemes.ggml``)
    import gguf

# A ``qkit.schemes.quantized.QuantizedTensor`` (quantized.py imports this module, so it is named, not imported).
QuantizedTensor = Any

# ``{part name: (shape, dtype)}``: what a scheme stores for one weight (``part_layout``).
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]

# The scale dtypes a scheme with a free scale type takes (``--scale-dtype``), by their manifest names.
SCALE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SCALE_DTYPES.items()}


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view a scheme quantizes: ``[shape[0], prod(shape[1:])]``; 1-D as ``[1, n]``."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


def layout_nbytes(layout: Layout) -> int:
    """Bytes of the parts ``layout`` describes: ``sum(prod(shape) * itemsize)``."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


@runtime_checkable
class Scheme(Protocol):
    """A stored format for one weight matrix (see the module docstring for the two halves)."""

    name: str  # the registered name, e.g. "int4-g128"
    kind: str  # the family: "absmax", "nf4", "fp4", "ggml"
    bits: int  # bits of one code (scales not counted: ``nbytes_for`` counts everything)
    scale_dtype: torch.dtype
    fixed_scale_dtype: bool  # True where the format fixes the scale type (``--scale-dtype`` does not apply)
    parts: tuple[str, ...]  # the stored part names, ``("qweight", "scales", ...)``
    description: str  # one line, for ``--help`` and the docs' table

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def part_layout(self, shape: tuple[int, ...]) -> Layout: ...

    def nbytes_for(self, shape: tuple[int, ...]) -> int: ...

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> Scheme:
        """The scheme actually used for tensor ``name`` of ``shape`` (a recipe's type, a width fallback), or
        ``SchemeError`` for a tensor it cannot store."""
        ...

    def bind(self, model_config: dict[str, Any]) -> Scheme:
        """This scheme with what it needs from a model's ``config.json`` filled in (a recipe's layer count)."""
        ...

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class Recipe(Scheme, Protocol):
    """A scheme that picks a stored type per tensor (llama.cpp's ``q4_k_m``): ``resolve(shape, name)`` gives
    one of ``types``, and ``bind(model_config)`` fills in what the choice depends on. It stores no parts
    of its own (``part_layout`` refuses); each tensor's manifest entry names the type it got."""

    types: tuple[Scheme, ...]  # the stored types ``resolve`` can give

    def with_imatrix(self, used: bool) -> Recipe:
        """This recipe for a file quantized with (``used``) or without an importance matrix: llama.cpp's
        choice of some tensors' types reads ``has_imatrix`` (the IQ4 recipes' ffn_down)."""
        ...

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the recipe's file quantizes ``name`` beyond the block projections (llama-quantize's whole
        file: the token embedding and the output head); ``transform.Rules`` targets those too."""
        ...


@runtime_checkable
class GGMLCodable(Protocol):
    """A scheme whose tensors GGUF stores as one llama.cpp block type, ``ggml_type``.

    ``to_ggml_blocks(qt)`` gives the block bytes, uint8 ``[rows, bytes_per_row]`` (row ``r`` the blocks of
    row ``r``), and ``from_ggml_blocks(blocks, shape, dtype)`` rebuilds the ``QuantizedTensor`` from them,
    bit for bit. For llama.cpp's own types (``kind == "ggml"``) the blocks are the ``qweight`` itself."""

    ggml_type: gguf.GGMLQuantizationType

    def to_ggml_blocks(self, qt: QuantizedTensor) -> torch.Tensor: ...

    def from_ggml_blocks(self, blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor: ...


@runtime_checkable
class ImportanceWeighted(Protocol):
    """A scheme whose encoder takes an importance matrix's entry for the tensor (llama.cpp's block types):
    ``encode(w, quant_weights=qw)``, ``qw`` fp32 ``[cols]`` the importance of each input column (mean
    ``x**2`` over the calibration tokens). ``quant_weights=None`` is the unweighted path."""

    def encode(self, w: torch.Tensor, quant_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class GroupScaled(Protocol):
    """A scheme with one scale per tensor that several tensors may share (nvfp4's global scale): vLLM serves
    q/k/v and gate/up as one fused layer with one such scale, so they are quantized with the scale of the
    group's ``tensor_amax`` (fp32 scalar, the largest ``max |w|`` of the group) instead of their own:
    ``encode_grouped(w, tensor_amax)``; ``encode(w)`` is ``encode_grouped(w, None)``, the tensor's own."""

    def encode_grouped(self, w: torch.Tensor, tensor_amax: torch.Tensor | None) -> dict[str, torch.Tensor]: ...


class SchemeDefaults:
    """The members most schemes share: no per-tensor choice, nothing to bind, a free scale dtype, and
    ``nbytes_for`` from ``part_layout``. A scheme class lists this as its base and overrides what differs.

    ``row_block``: the columns of a row one stored unit spans (a group, a block); a weight is stored as the
    scheme itself, with no short last unit, only when its width is a multiple of it (``stores_natively``).
    1 for schemes whose units need no whole count (per-row, per-tensor scales; nf4's flat blocks)."""

    fixed_scale_dtype: ClassVar[bool] = False
    row_block: ClassVar[int] = 1

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> Any:
        return self

    def bind(self, model_config: dict[str, Any]) -> Any:
        return self

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Stored bytes of a weight of ``shape``: the bytes of ``part_layout(shape)``."""
        return layout_nbytes(self.part_layout(tuple(shape)))  # type: ignore[attr-defined]


def stores_natively(scheme: Any, shape: tuple[int, int]) -> bool:
    """Whether ``scheme`` stores a ``[out, in]`` weight as itself: ``resolve`` gives it back (no width
    fallback, no recipe choice), and the width is whole units of ``row_block`` (no short last group)."""
    try:
        if scheme.resolve(tuple(shape), "<tensor>") != scheme:
            return False  # a k-quant written as its fallback type, a recipe's choice
    except SchemeError:
        return False  # a width the type cannot take at all
    return int(shape[1]) % scheme.row_block == 0


__all__ = [
    "DTYPE_NAMES",
    "GGMLCodable",
    "GroupScaled",
    "ImportanceWeighted",
    "Layout",
    "Recipe",
    "SCALE_DTYPES",
    "Scheme",
    "SchemeDefaults",
    "as_2d",
    "layout_nbytes",
    "stores_natively",
]
