"""A mixture-of-experts checkpoint's experts as stored, read from its headers and tensors without a model:
the elements of the fused parameter each stored expert matrix loads into (``fused_numel``, what the plan's
memory estimate counts), and the expert matrices of a checkpoint that stores its experts fused (gpt_oss:
``VirtualExpert``, ``virtual_experts``, ``split_experts``), under the per-expert names llama.cpp's converter
splits them to. docs/moe.md.

Layer 5 (``methods``), beside ``qkit.methods.experts`` (the layouts it reads).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import tensor_reader
from qkit.methods.experts import GATE_COLUMNS, LAYOUTS, ROUTED_LAYOUTS, UP_COLUMNS, layout_for
from qkit.schemes.recipes import expert_count


def fused_numel(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> dict[str, int]:
    """From the checkpoint's headers: ``{stored expert matrix: the elements of the fused parameter it is loaded
    into}`` (its layer's ``gate_up_proj`` for a gate or up matrix, ``down_proj`` for a down one: the sum over
    that layer's experts), which is what a gradient of it takes in the model; {} for a dense model."""
    layout = layout_for(config, layouts=LAYOUTS)
    if layout is None:
        return {}
    kind = {layout.gate: "gate_up_proj", layout.up: "gate_up_proj", layout.down: "down_proj"}
    pattern = re.compile(rf"^(.*\.{re.escape(layout.stored)}\.experts)\.\d+\.({'|'.join(map(re.escape, kind))})\.weight$")
    fused: dict[str, str] = {}
    for name in shapes:
        if m := pattern.match(name):
            fused[name] = f"{m.group(1)}.{kind[m.group(2)]}"
    sizes: dict[str, int] = {}
    for name, key in fused.items():
        sizes[key] = sizes.get(key, 0) + math.prod(shapes[name])
    return {name: sizes[key] for name, key in fused.items()}


@dataclass(frozen=True)
class VirtualExpert:
    """One expert matrix of a checkpoint that stores its experts fused (gpt_oss: ``ExpertLayout.transposed``):
    ``fused`` the stored 3-D tensor's name (``model.layers.0.mlp.experts.gate_up_proj``, ``[E, in, out]``),
    ``expert`` its index, ``columns`` the output columns it takes (gate: ``0::2``, up: ``1::2``, down: all),
    ``shape`` the matrix ``[out, in]``: ``fused_tensor[expert][:, columns].T`` (``take``)."""

    fused: str
    expert: int
    columns: slice
    shape: tuple[int, int]

    def take(self, fused: torch.Tensor) -> torch.Tensor:
        """This matrix ``[out, in]`` out of its fused tensor ``[E, in, out]`` (a strided view)."""
        return fused[self.expert][:, self.columns].T


def virtual_experts(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> dict[str, VirtualExpert]:
    """For a model whose checkpoint stores its experts fused (gpt_oss), every expert matrix under the name its
    linear carries inside ``unfused_experts`` (``model.layers.0.mlp.experts.3.gate_proj.weight``, the name
    llama.cpp's converter splits it to: ``blk.0.ffn_gate_exps`` row 3); ``shapes``: the stored tensors'. {} for
    every other model (whose checkpoint names each expert matrix itself)."""
    layout = ROUTED_LAYOUTS.get(str(config.get("model_type"))) if expert_count(dict(config)) > 1 else None
    if layout is None or not layout.transposed:
        return {}
    out: dict[str, VirtualExpert] = {}
    for name, shape in shapes.items():
        if len(shape) != 3 or not name.endswith((f".{layout.moe}.experts.gate_up_proj", f".{layout.moe}.experts.down_proj")):
            continue
        n, cols, width = shape
        head = name.rpartition(".")[0]
        kinds = (((layout.gate, GATE_COLUMNS), (layout.up, UP_COLUMNS)) if name.endswith("gate_up_proj")
                 else ((layout.down, slice(None)),))
        for e in range(n):
            for m, columns in kinds:
                out[f"{head}.{e}.{m}.weight"] = VirtualExpert(name, e, columns, (len(range(width)[columns]), cols))
    return out


def split_experts(tensors: Iterable[tuple[str, torch.Tensor]], virtual: Mapping[str, VirtualExpert]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (``(stored name, tensor)``), each followed by the expert matrices ``virtual`` takes out of it
    (contiguous copies, ``VirtualExpert.take``): a fused checkpoint streamed as the per-expert matrices it holds."""
    by_fused: dict[str, list[str]] = {}
    for name, v in virtual.items():
        by_fused.setdefault(v.fused, []).append(name)
    for name, tensor in tensors:
        yield name, tensor
        for v in by_fused.get(name, ()):
            yield v, virtual[v].take(tensor).contiguous()


def expert_reader(directory: Path, names: Iterable[str], virtual: Mapping[str, VirtualExpert]) -> Callable[[str], torch.Tensor]:
    """``read(name)``: one of ``names`` in its stored dtype, read from the checkpoint in ``directory``; an expert
    matrix its checkpoint stores fused (``virtual``) taken out of the fused tensor it lives in."""
    read = tensor_reader(directory, {v.fused for v in virtual.values()} | {n for n in names if n not in virtual})
    return lambda name: virtual[name].take(read(virtual[name].fused)) if name in virtual else read(name)


__all__ = ["VirtualExpert", "expert_reader", "fused_numel", "split_experts", "virtual_experts"]
