"""Granularity: which weights share one scale, as a value (``PerGroup(128)``), never a parsed mode.

Each granularity turns a 2-D weight ``W`` of shape ``[rows, cols]`` into a 2-D "unit view" of shape
``[units, unit_len]`` where every row of the view shares one scale, and back again:

* ``PerTensor()``: one unit, the whole matrix: view ``[1, rows*cols]``, scales shape ``[1, 1]``.
* ``PerRow()``: one unit per output row: view ``[rows, cols]``, scales ``[rows, 1]``.
* ``PerGroup(g)``: ``g`` consecutive weights of one row. Groups never cross rows: when ``cols % g != 0``
  the last group of every row is shorter and has its own scale. View ``[rows * ceil(cols/g), g]``
  (the short group zero-padded, which cannot change an absmax), scales ``[rows, ceil(cols/g)]``.

(NF4's flattened blocks of 64, which *do* cross rows as in bitsandbytes, live in ``schemes/nf4.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkit.errors import SchemeError


@dataclass(frozen=True)
class PerTensor:
    label = "tensor"

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (1, 1)

    def to_units(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(1, -1)

    def from_units(self, units: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return units.reshape(shape)


@dataclass(frozen=True)
class PerRow:
    label = "row"

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (shape[0], 1)

    def to_units(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def from_units(self, units: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return units.reshape(shape)


@dataclass(frozen=True)
class PerGroup:
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise SchemeError(f"group size must be a positive integer, got {self.size!r}")

    @property
    def label(self) -> str:
        return f"g{self.size}"

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (shape[0], math.ceil(shape[1] / self.size))

    def to_units(self, w: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        pad = (-cols) % self.size
        if pad:  # a short last group per row; zeros never raise an absmax
            w = torch.nn.functional.pad(w, (0, pad))
        return w.reshape(-1, self.size)

    def from_units(self, units: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        rows, cols = shape
        padded = units.reshape(rows, -1)
        return padded[:, :cols] if padded.shape[1] != cols else padded


Granularity = PerTensor | PerRow | PerGroup
