"""The planner's byte budget: the whole file's tensors, as the user's download and memory count them.

* ``--target-size SIZE`` is the bytes of every tensor the plan's file stores: the planned tensors' chosen
  types plus every other tensor as that file keeps it (``Format.stored_nbytes(None, ...)``: the source's
  float type, norms F32 in GGUF). The solver gets what is left for the planned tensors: SIZE less the
  tensors outside the plan.
* ``--target-scheme S`` is the tensor bytes of the file ``qkit quantize -s S`` (with the plan's
  ``--include``/``--exclude``) writes in the plan's format: for a llama.cpp recipe (``q4_k_m``), its whole
  file, ``token_embd`` and ``output`` at llama.cpp's types; for another scheme, its targets quantized and the
  rest kept. A plan for a recipe's bytes in a format that stores llama.cpp's types chooses for the same
  tensors the recipe quantizes (``planner.planned_targets``), so both files spend the same bytes on the same
  tensors.
* ``--target-bits B`` is ``floor(B * weights / 8)`` over the planned tensors alone, as every table's bits
  per weight counts them; the tensors outside are outside it.

The file's header (metadata, tokenizer, qkit's record) is not counted: a few MB for a large vocabulary's
tokenizer, the same for every plan of one model and format.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import InputError
from qkit.plan.candidates import KEEP, Candidate, check_format, ladder, stored_nbytes
from qkit.plan.solve import smallest
from qkit.schemes import get_scheme
from qkit.transform import Rules


@dataclass(frozen=True)
class Budget:
    """``planned``: the bytes the solve gets for the planned tensors; ``file``: the whole file's tensor bytes the
    target names (None for ``--target-bits``); ``outside``: the bytes of the ``outside_tensors`` tensors the
    plan leaves as they are, as its file stores them."""

    planned: int
    file: int | None
    outside: int
    outside_tensors: int

    def record(self) -> dict[str, Any]:
        """The plan record's ``target`` fields (with ``budget_bytes``: the planned tensors' budget)."""
        counts = ("the stored bytes of the planned tensors (codes, scales, minimums, as the format writes them)"
                  if self.file is None else
                  "the whole file's tensors: file_bytes, less outside_bytes for the tensors outside the plan (kept as "
                  "they are), is budget_bytes for the planned tensors; the header (metadata, tokenizer) is not counted")
        return {"budget_bytes": self.planned, "file_bytes": self.file, "outside_bytes": self.outside,
                "outside_tensors": self.outside_tensors, "counts": counts}

    def why(self) -> str:
        """What the budget is made of, for a refusal: '' for --target-bits."""
        if self.file is None:
            return ""
        return (f" (the file's {self.file:,} bytes less {self.outside:,} bytes of the {self.outside_tensors} tensors "
                "outside the plan, kept as they are; --include the embedding to plan it)")


def budget_bytes(options: Any, weights: int, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 config: Mapping | None = None, dtypes: Mapping[str, torch.dtype | None] | None = None) -> int:
    """Bytes over ``shapes`` alone: ``target_size``; ``floor(target_bits * weights / 8)``; or the bytes
    ``target_scheme`` (bound to the model's ``config``: a recipe's per-tensor types) stores for ``shapes``
    in the plan's format, from each tensor's source dtype in ``dtypes`` (compressed-tensors keeps scales
    in the weight dtype, so ``plan:ct@int4-g64`` gets the bytes int4-g64 takes *there*). ``file_budget``
    is the whole file's."""
    if options.target_size is not None:
        return int(options.target_size)
    if options.target_scheme is not None:
        s = get_scheme(options.target_scheme).bind(dict(config or {}))
        fmt, dt, offered = check_format(options.format), dict(dtypes or {}), set(ladder(options.format))

        def nbytes(scheme, name: str, shape: tuple[int, ...]) -> int:  # a type the format offers: its stored bytes
            if scheme.name in offered:
                return stored_nbytes(fmt, scheme, shape, dt.get(name) or torch.float32)
            return scheme.nbytes_for(shape)

        return sum(nbytes(s.resolve(tuple(shape), n), n, tuple(shape)) for n, shape in (shapes or {}).items())
    return int(math.floor(options.target_bits * weights / 8))


def kept_bytes(format: str, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype | None]) -> int:
    """Bytes the plan's format stores for ``shapes`` kept as they are (each in its source dtype)."""
    fmt = check_format(format)
    return sum(stored_nbytes(fmt, None, tuple(s), dtypes.get(n) or torch.float32) for n, s in shapes.items())


def file_budget(options: Any, planned: Mapping[str, tuple[int, ...]], shapes_all: Mapping[str, tuple[int, ...]],
                config: Mapping | None, dtypes: Mapping[str, torch.dtype | None]) -> Budget:
    """The ``Budget`` of ``options`` (module docstring) for the ``planned`` tensors of a model whose every
    tensor is in ``shapes_all`` (each tensor's source dtype in ``dtypes``)."""
    outside = {n: s for n, s in shapes_all.items() if n not in planned}
    kept = kept_bytes(options.format, outside, dtypes)
    weights = sum(math.prod(s) for s in planned.values())
    if options.target_bits is not None:
        return Budget(budget_bytes(options, weights), None, kept, len(outside))
    if options.target_size is not None:
        whole = int(options.target_size)
    else:  # the file -s SCHEME writes: its targets in its types, the rest kept
        scheme = get_scheme(options.target_scheme)
        rules = Rules(tuple(options.include), tuple(options.exclude))
        theirs = {n: s for n, s in shapes_all.items() if rules.scheme_for(n, tuple(s), scheme) is not None}
        whole = (budget_bytes(options, weights, theirs, config, dtypes)
                 + kept_bytes(options.format, {n: s for n, s in shapes_all.items() if n not in theirs}, dtypes))
    return Budget(whole - kept, whole, kept, len(outside))


def check_budget(budget: int | Budget, options: Sequence[Sequence[Candidate]], weights: int) -> int:
    """The budget the solve gets: ``budget`` (a ``Budget``'s planned bytes), refused in one line below the
    smallest mix, or, where keeping a tensor unquantized is a candidate, above the unquantized size (nothing
    needs quantizing); where it is not (``--candidates q4_k,q6_k``), a budget above the largest mix binds
    nothing and the solve gets that mix's bytes (every tensor free to take its best candidate)."""
    why = budget.why() if isinstance(budget, Budget) else ""
    budget = budget.planned if isinstance(budget, Budget) else budget
    low = smallest([[c.nbytes for c in row] for row in options])
    if budget < low:
        raise InputError(
            f"the budget of {budget:,} bytes ({8 * budget / weights:.3f} bits/w){why} is below the smallest mix, {low:,} "
            f"bytes ({8 * low / weights:.3f} bits/w: every tensor at its smallest candidate); raise the target")
    if all(any(c.name == KEEP for c in row) for row in options):
        unquantized = sum(next(c.nbytes for c in row if c.name == KEEP) for row in options)
        if budget > unquantized:
            raise InputError(
                f"the budget of {budget:,} bytes ({8 * budget / weights:.3f} bits/w){why} is above the unquantized size "
                f"of these tensors, {unquantized:,} bytes ({8 * unquantized / weights:.3f} bits/w): nothing needs quantizing")
    return min(budget, sum(max(c.nbytes for c in row) for row in options))


__all__ = ["Budget", "budget_bytes", "check_budget", "file_budget", "kept_bytes"]
