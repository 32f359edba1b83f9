"""The candidates' costs, tensor by tensor, from the model's files: in this process (``file_tensors``) or
as tasks of an executor (``costs_elsewhere``: ``qkit plan --executor ray``), the same numbers either way."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qkit.checkpoint import open_safetensors, tensor_shards, weight_files
from qkit.executors import Executor
from qkit.plan.candidates import Candidate
from qkit.plan.sensitivity import candidate_cost
from qkit.schemes.ggml import GGMLScheme, uses_importance
from qkit.staging import temporary_directory


def candidate_weights(weights: Mapping[str, torch.Tensor], name: str, cand: Candidate) -> torch.Tensor | None:
    """The importance weights ``cand`` quantizes ``name`` with: llama.cpp's weighted types only."""
    s = cand.scheme
    return weights.get(name) if isinstance(s, GGMLScheme) and uses_importance(s.ggml_type) else None


@dataclass(frozen=True)
class CostItem:
    """One tensor's candidates to cost in another process: the tensor ``name`` read from ``shard`` (the
    model's safetensors file holding it), its Fisher diagonal from ``fisher`` (a file of one tensor,
    ``"fisher"``, written by ``costs_elsewhere``), and per candidate its importance weights (or None)."""

    name: str
    shard: str
    fisher: str
    candidates: tuple[Candidate, ...]
    quant_weights: tuple[torch.Tensor | None, ...]


PLAN_TMP_PREFIX = "qkit-plan-"  # the Fisher diagonals handed to other processes: $TMPDIR/qkit-plan-PID-RANDOM


def cost_item(_shared: None, item: CostItem) -> list[tuple[float, bool]]:
    """``candidate_cost`` of every candidate of ``item``, from the files (a task of ``costs_elsewhere``)."""
    with open_safetensors(item.shard) as f:
        w = f.get_tensor(item.name)
    with open_safetensors(item.fisher) as f:
        fisher = f.get_tensor("fisher")
    return [candidate_cost(w, fisher, c.scheme, name=item.name, quant_weights=q)
            for c, q in zip(item.candidates, item.quant_weights)]


def costs_elsewhere(executor: Executor, directory, names: list[str], diag: Mapping[str, torch.Tensor],
                    opts: Mapping[str, list[Candidate]], weights: Mapping[str, torch.Tensor]):
    """``(name, [(cost, lossless) per candidate])`` for ``names`` in order, each tensor one ``executor`` task
    (``cost_item``): the driver writes each diagonal to a file of its own (one tensor in memory at a time
    beyond the Fisher it holds anyway, removed after) and sends paths, never the weights."""
    where = tensor_shards(directory, names)
    with temporary_directory(PLAN_TMP_PREFIX) as tmp:
        items = []
        for i, name in enumerate(names):
            path = Path(tmp) / f"fisher-{i}.safetensors"
            save_file({"fisher": diag[name].contiguous()}, str(path))
            items.append(CostItem(name, str(where[name]), str(path), tuple(opts[name]),
                                  tuple(candidate_weights(weights, name, c) for c in opts[name])))
        yield from zip(names, executor.map(cost_item, items))


def file_tensors(directory, names: set[str], device: str):
    """``(name, tensor)`` of the file's tensors named ``names`` (what quantize reads: the source weights, not
    the loaded model's), one at a time, each by itself from its shard (``open_safetensors``: a private
    mapping of that tensor, released when it is dropped), so that a plan costing block after block reads
    the checkpoint once in all."""
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            keys = sorted(names.intersection(f.keys()))
        for key in keys:
            with open_safetensors(path) as f:
                w = f.get_tensor(key)
            yield key, (w if device == "cpu" else w.to(device))
            del w


__all__ = ["PLAN_TMP_PREFIX", "CostItem", "candidate_weights", "cost_item", "costs_elsewhere", "file_tensors"]
