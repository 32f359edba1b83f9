"""Where llama.cpp's converter puts each row of each Hugging Face tensor: the row map.

GPTQ and AWQ quantize Hugging Face tensors; a GGUF holds them where the converter put them (renamed, the
q/k rows of llama permuted, experts stacked into one 3-D tensor, fused tensors split). Every ggml block
lies inside one row and is computed from that row alone, so a quantized row can follow any transform that
moves whole rows. ``converter.row_map`` measures the transforms by running the converter on probe tensors
(``_converter_worker.py``); this module holds the result.

Rows are counted over all dimensions but the last (a 3-D ``[experts, out, in]`` tensor has
``experts * out`` rows; a 1-D tensor's every element is a row of one column). Each GGUF tensor is one of:

* ``rows``: every GGUF row is one Hugging Face row, its columns untouched (``Placement.hf_rows``; a 3-D
  source's row within its expert, and the expert, ``hf_experts``);
* ``transposed``: every GGUF row is one *column* of one expert's matrix (gpt-oss stores its experts
  ``[experts, in, out]``); ``hf_rows`` holds that column. A quantizer working on output rows refuses it;
* ``other``: not a movement of whole rows (a value changed, as Gemma's norm weight + 1, columns reordered,
  a type other than F32): ``source`` names the tensor read when it was added; quantized data cannot follow;
* ``generated``: made by the converter from the config, no Hugging Face tensor (llama 3's ``rope_freqs``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MOVED = ("rows", "transposed")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor the converter writes: its name and (numpy-order) shape, ``kind`` (see the module), the
    Hugging Face tensor being read when it was added (``source``), and for a moved tensor, per GGUF row,
    its source's index in ``RowMap.hf`` (``src``, int32 ``[rows]``) and the source's flat row (``rows``) or
    ``expert * columns + column`` (``transposed``) (``flat``, int64 ``[rows]``)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    source: str | None
    src: np.ndarray | None = None
    flat: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else (self.shape[0] if self.shape else 1)


@dataclass(frozen=True)
class Placement:
    """Where one Hugging Face tensor's rows land in one GGUF tensor. ``gguf_rows`` (int64 ``[k]``): flat
    GGUF rows (a 3-D GGUF tensor's expert is ``gguf_rows // gguf_shape[-2]``); ``hf_rows`` (int64 ``[k]``):
    for each, the Hugging Face row it holds (``rows``), within its expert when the source is 3-D or more
    (``hf_experts``, else None), or the column (``transposed``). ``other``: no arrays."""

    gguf_name: str
    gguf_shape: tuple[int, ...]
    kind: str
    gguf_rows: np.ndarray | None = None
    hf_rows: np.ndarray | None = None
    hf_experts: np.ndarray | None = None

    @property
    def columns_kept(self) -> bool:
        return self.kind == "rows"


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows of one matrix, columns) of a tensor: a 1-D tensor is one column; a 3-D one, experts of matrices."""
    if len(shape) <= 1:
        return (shape[0] if shape else 1), 1
    return shape[-2], shape[-1]


@dataclass(frozen=True)
class RowMap:
    """The converter's placement of every row of a model (``converter.row_map``). ``hf``: every Hugging Face
    tensor the converter reads, with its shape, in its order; ``gguf``: every tensor it writes, in order;
    ``left_out``: the tensors its class's ``filter_tensors`` leaves out unread (Gemma's ``lm_head.weight``:
    llama.cpp's Gemma reads the token embedding as the output)."""

    hf: dict[str, tuple[int, ...]]
    gguf: dict[str, GGUFTensor]
    left_out: tuple[str, ...] = ()

    def placements(self, hf_name: str) -> list[Placement]:
        """Every GGUF tensor that holds rows of ``hf_name`` (moved, or ``other`` where it was the tensor being
        read); empty when the converter drops it."""
        index = list(self.hf).index(hf_name)
        rows, cols = _matrix(self.hf[hf_name])
        out = []
        for t in self.gguf.values():
            if t.kind in MOVED and t.src is not None and t.flat is not None:
                (where,) = np.nonzero(t.src == index)
                if not len(where):
                    continue
                flat = t.flat[where]
                if t.kind == "rows":
                    experts = flat // rows if len(self.hf[hf_name]) > 2 else None
                    hf_rows = flat % rows if experts is not None else flat
                else:
                    experts, hf_rows = (flat // cols if len(self.hf[hf_name]) > 2 else None), flat % cols
                out.append(Placement(t.name, t.shape, t.kind, where.astype(np.int64), hf_rows, experts))
            elif t.source == hf_name and t.kind == "other":
                out.append(Placement(t.name, t.shape, "other"))
        return out

    @property
    def dropped(self) -> list[str]:
        """Hugging Face tensors the converter writes nowhere: those its class leaves out, then those it
        reads and writes to no tensor (``.rotary_emb.inv_freq``)."""
        used = {int(k) for t in self.gguf.values() if t.src is not None for k in np.unique(t.src)}
        used_names = {list(self.hf)[k] for k in used} | {t.source for t in self.gguf.values() if t.kind == "other"}
        return [*self.left_out, *(n for n in self.hf if n not in used_names)]

    def apply(self, tensor: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], gguf_name: str) -> torch.Tensor:
        """GGUF tensor ``gguf_name`` built from Hugging Face tensors (``tensor(name)`` or a mapping) by the map
        alone: equal to the converter's F32 tensor when the map is right. ``ValueError`` for ``other``."""
        t = self.gguf[gguf_name]
        if t.kind not in MOVED or t.src is None or t.flat is None:
            raise ValueError(f"{gguf_name} is {t.kind}: not made of whole rows")
        get = tensor.__getitem__ if isinstance(tensor, Mapping) else tensor
        names = list(self.hf)
        cols = t.shape[-1] if len(t.shape) > 1 else 1
        out: torch.Tensor | None = None
        for k in np.unique(t.src):
            hf = get(names[int(k)])
            rows, hf_cols = _matrix(tuple(hf.shape))
            view = hf.reshape(-1, hf_cols) if t.kind == "rows" else hf.reshape(-1, rows, hf_cols).transpose(-1, -2).reshape(-1, rows)
            if out is None:
                out = torch.empty((t.rows, cols), dtype=hf.dtype)
            (where,) = np.nonzero(t.src == k)
            out[torch.from_numpy(where)] = view[torch.from_numpy(t.flat[where])]
        assert out is not None
        return out.reshape(t.shape)

    # --- files: PREFIX.json (names, shapes, kinds) and PREFIX.npz (the integer arrays) ---------------

    @staticmethod
    def exists(prefix: Path) -> bool:
        return _json(prefix).is_file() and _npz(prefix).is_file()

    @staticmethod
    def publish(made: Path, prefix: Path) -> None:
        """Move a map the worker wrote at ``made`` into place at ``prefix`` (the JSON last: it marks it whole)."""
        os.replace(_npz(made), _npz(prefix))
        os.replace(_json(made), _json(prefix))

    @classmethod
    def load(cls, prefix: Path) -> RowMap:
        doc = json.loads(_json(prefix).read_text(encoding="utf-8"))
        with np.load(_npz(prefix), allow_pickle=False) as arrays:
            loaded = {k: arrays[k] for k in arrays.files}
        names = {filtered: original for original, filtered, _ in doc["hf"]}
        hf = {original: tuple(shape) for original, _, shape in doc["hf"]}
        gguf = {}
        for i, e in enumerate(doc["gguf"]):
            during = e.get("during")
            gguf[e["name"]] = GGUFTensor(e["name"], tuple(e["shape"]), e["kind"], names.get(during, during),
                                         loaded.get(f"src{i}"), loaded.get(f"flat{i}"))
        return cls(hf, gguf, tuple(doc.get("left_out", ())))


def _json(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".json")


def _npz(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".npz")


__all__ = ["GGUFTensor", "MOVED", "Placement", "RowMap"]
