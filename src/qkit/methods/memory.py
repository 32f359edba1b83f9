"""What a step that runs over a model needs in memory, from its headers and config alone (before the model
loads), and the one check of it against ``--max-memory`` or the memory available.

Layer 5 (``qkit.methods``): each method answers for its own working set (``Method.memory``: a ``Need``
of named parts, in bytes); ``qkit.plan.memory`` builds the plan's estimate on the constants here;
``choice.check_memory`` (quantize) and ``api.imatrix_model`` call ``check_need`` before any load.

The terms (``a`` the load dtype's item size, ``N`` calibration windows of ``T`` tokens, ``h``/``i``/``kv``
hidden, intermediate and key-value width, ``V`` the vocabulary; docs/scale.md, "--max-memory", for the
measured peaks they bound)::

    the process            python, torch, transformers, qkit, the tokenizer               BASELINE
    the weights            every stored tensor at the load dtype                          a * sum(numel)
    the load               the loader's transient: the largest stored tensor, twice
    one tensor's quantize  the tensor as stored, and its quantize's float32 copies        stored + copies(scheme) * 4 * numel
    the writer             a safetensors shard held, its serialized copy, freed heap      3 * min(shard, output)
    activations            every window's hidden states into and out of a block (fp32)   2 * N * T * h * 4
    one block's forward    its intermediates for one batch, and the attention scores      B*T*(4h + 2kv + 3i)*a + B*heads*T^2*4

plus what each method adds (``qkit.methods.gptq``: the block's Hessians and the solver's factor;
``awq``: the recorded inputs and the clipping search; ``imatrix``: the float64 squares of one input).
Working sets are multiplied by ``RETENTION`` (what the allocator keeps of freed memory). The estimate is
an upper bound, not a prediction: a memory-mapped model's pages are resident only once read, so a
bf16 GPTQ run peaks well below it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qkit.checkpoint import DEFAULT_MAX_SHARD_BYTES
from qkit.errors import InputError, SchemeError
from qkit.memory import GIB, available_ram, gib, process_rss
from qkit.threads import available_memory

# Everything but the model: python, torch, transformers' modeling code, qkit, the quantization kernels
# (numba) and the tokenizer. A gguf plan of a 64-wide, 2-layer llama peaked at 0.54 GiB in a venv installed
# days before (measured as in benchmarks/bench_plan_memory.py), and the same process holds 0.14 GiB more in
# a venv just installed with the same packages and versions (``import torch`` alone: 0.19 GiB against
# 0.24 GiB resident; a 4-layer 1024-wide plan peaked at 0.84 GiB against 0.98 GiB; why the new install's
# libraries hold more resident pages is not pinned down). The constant covers the fresh install, which is
# what CI and a user's first run see.
BASELINE = int(0.75 * GIB)
# A step's working set is freed into the allocator, which keeps part of it: the process's resident memory
# after a backward pass stays above what is alive. With this factor the plan's estimate was 5-8% above every
# measured peak of bench_plan_memory.py's synthetic llama (fp32 and bf16; 1, 7 and 10 groups).
RETENTION = 1.25
# Quantizing one tensor (and, in the plan, dequantizing and costing it) over its float32 size: 2.0x to 4.1x
# measured across the ladder (q3_k the largest: its search holds float32 copies of the weights), plus a margin.
QUANTIZE_COPIES = 5
# Quantizing one tensor alone (the stream, every method's final write), by scheme kind: float32 copies of
# the tensor at its peak above the tensor's own bytes. Measured on one 11008 x 4096 bf16 tensor
# (``quantize_tensor``, one thread, VmHWM less the RSS before): every llama.cpp type 1.09x (q2_k) to 1.36x
# (q8_0), with an importance matrix 1.10x-1.29x, mxfp4/nvfp4 1.35x (all chunked); absmax int4/int8 by
# group, row or tensor 2.25x-2.31x (whole-tensor float32 ops); nf4 5.03x. With a margin:
STREAM_COPIES = {"absmax": 3, "nf4": 6}
STREAM_COPIES_DEFAULT = 2
# What a step without --max-memory leaves of the available RAM, at least (with a tenth of it): the page
# cache the checkpoint's reads go through, and other processes' growth while the step runs.
HEADROOM = GIB // 2


def config_int(config: Mapping, *names: str) -> int | None:
    """The first of ``names`` that ``config`` (or its ``text_config``) holds as a positive int."""
    for c in (config, config.get("text_config") or {}):
        for n in names:
            v = c.get(n) if isinstance(c, Mapping) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


@dataclass(frozen=True)
class Dims:
    """The widths the working sets scale with, from the config (or the shapes where it is silent)."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv: int
    vocab: int

    @classmethod
    def of(cls, config: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> Dims:
        mats = [s for s in shapes.values() if len(s) == 2]
        hidden = config_int(config, "hidden_size", "n_embd", "d_model") or max((min(s) for s in mats), default=1)
        heads = config_int(config, "num_attention_heads", "n_head") or max(1, hidden // 64)
        kv = (config_int(config, "num_key_value_heads") or heads) * (config_int(config, "head_dim") or hidden // heads)
        return cls(hidden=hidden, inter=config_int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden,
                   layers=config_int(config, "num_hidden_layers", "n_layer", "num_layers") or layers_in(shapes),
                   heads=heads, kv=kv, vocab=config_int(config, "vocab_size") or max((max(s) for s in mats), default=1))


_BLOCK = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def block_of(name: str) -> int | None:
    """The decoder block a tensor belongs to (``model.layers.3.mlp.up_proj.weight``: 3), None outside them."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def layers_in(names: Iterable[str]) -> int:
    found = {b for n in names if (b := block_of(n)) is not None}
    return max(found) + 1 if found else 1


@dataclass(frozen=True)
class Need:
    """What one step needs: ``parts`` (label -> bytes, in the order a message names them)."""

    step: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{label} {gib(v)}" for label, v in self.parts.items() if v > 0)

    def to_dict(self) -> dict:
        return {"step": self.step, "total_bytes": self.total, "parts": dict(self.parts)}


@dataclass(frozen=True)
class Model:
    """A model's stored tensors as the estimates read them: shapes, stored dtypes and the load dtype."""

    shapes: Mapping[str, tuple[int, ...]]
    stored: Mapping[str, torch.dtype | None]
    dtype: torch.dtype
    dims: Dims

    @classmethod
    def of(cls, shapes, stored, config, dtype: torch.dtype = torch.float32) -> Model:
        return cls(shapes, stored, dtype, Dims.of(config, shapes))

    @property
    def a(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def loaded(self, names: Iterable[str] | None = None) -> int:
        """Bytes of ``names`` (every tensor when None) once loaded: floating tensors at the load dtype."""
        total = 0
        for n in self.shapes if names is None else names:
            d = self.stored.get(n) or torch.float32
            total += self.numel(n) * (self.a if d.is_floating_point else d.itemsize)
        return total

    @property
    def checkpoint(self) -> int:
        return sum(stored_bytes(self, n) for n in self.shapes)

    @property
    def load(self) -> int:
        """The loader's transient: the largest stored tensor in its file dtype, twice."""
        return 2 * max((stored_bytes(self, n) for n in self.shapes), default=0)

    @property
    def mapped(self) -> bool:
        """Whether the loaded weights stay pages of the file (safetensors at their stored dtype, on Linux,
        where a finished block's pages are handed back: ``sequential.release_parameters``)."""
        floating = [d for d in self.stored.values() if d is not None and d.is_floating_point]
        return sys.platform.startswith("linux") and bool(floating) and all(d == self.dtype for d in floating)

    def blocks(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for n in self.shapes:
            b = block_of(n)
            if b is not None:
                out.setdefault(b, []).append(n)
        return out

    def activations(self, samples: int, seqlen: int) -> int:
        """Every window's hidden states into and out of one block, in float32."""
        return 2 * samples * seqlen * self.dims.hidden * 4

    def block_forward(self, batch: int, seqlen: int) -> int:
        """One block's intermediates for one batch, and its attention scores (eager or math attention)."""
        d = self.dims
        return batch * seqlen * (4 * d.hidden + 2 * d.kv + 3 * d.inter) * self.a + batch * d.heads * seqlen * seqlen * 4


def _resolved(scheme: Any, shape: tuple[int, ...], name: str) -> Any:
    """The scheme a tensor is stored in, or None where it cannot be (refused later, by the step itself, in
    its own words: ``Method.check``, the writer)."""
    try:
        return scheme.resolve(shape, name)
    except SchemeError:
        return None


def quantized_bytes(model: Model, targets: Mapping[str, Any]) -> int:
    """The stored bytes of ``targets`` ({name: scheme}; a recipe resolved per tensor; one it cannot store,
    at the load dtype)."""
    total = 0
    for n, s in targets.items():
        if n in model.shapes and s is not None:
            shape = tuple(model.shapes[n])
            r = _resolved(s, shape, n)
            total += r.nbytes_for(shape) if r is not None else model.loaded([n])
    return total


def walk_dtype(stored: Mapping[str, torch.dtype | None]) -> torch.dtype:
    """The dtype to load a model in for a walk that computes in fp32 block by block
    (``sequential.walk_blocks(compute_dtype=torch.float32)``), from its tensors' stored dtypes: the files' own
    when every floating tensor has the same one (safetensors then maps the weights instead of converting
    them, and only the block being processed is held in fp32); fp32 otherwise."""
    floating = {d for d in stored.values() if d is not None and d.is_floating_point}
    return floating.pop() if len(floating) == 1 else torch.float32


def walked_weights(model: Model, targets: Mapping[str, Any], compute: torch.dtype | None = None) -> dict[str, int]:
    """The weights a block walk that frees each finished block holds (``sequential.walk_blocks(release=True)``).
    Memory-mapped (``Model.mapped``): the tensors outside the blocks, one block, and the blocks' targets
    quantized so far; with ``compute`` (a dtype the walk upcasts to, ``walk_blocks(compute_dtype=...)``) also
    the tensors outside the blocks but an untied head, and one block, in that dtype. Otherwise the whole model
    at the load dtype (each finished block's tensors give way to its codes)."""
    if not model.mapped:
        return {f"the model's weights in {model.dtype_name}": model.loaded()}
    blocks = model.blocks()
    outside = [n for n in model.shapes if block_of(n) is None]
    one = max((model.loaded(ns) for ns in blocks.values()), default=0)
    parts = {f"the weights outside the blocks and one block in {model.dtype_name}": model.loaded(outside) + one}
    if compute is not None and compute != model.dtype:
        run = Model(model.shapes, model.stored, compute, model.dims)
        before = [n for n in outside if not n.endswith("lm_head.weight")]
        parts[f"the same upcast to {run.dtype_name} (the head aside)"] = run.loaded(before) + max(
            (run.loaded(ns) for ns in blocks.values()), default=0)
    inside = {n: targets[n] for ns in blocks.values() for n in ns if targets.get(n) is not None}
    parts["the quantized blocks"] = quantized_bytes(model, inside)
    return parts


def largest(targets: Iterable[str], model: Model) -> int:
    return max((model.numel(n) for n in targets if n in model.shapes), default=0)


def stored_bytes(model: Model, name: str) -> int:
    return model.numel(name) * (model.stored.get(name) or torch.float32).itemsize


def one_quantize(model: Model, targets: Mapping[str, Any]) -> int:
    """The largest of one target's quantize alone: the tensor as read from the file, and its scheme's float32
    copies (``STREAM_COPIES``), times ``RETENTION``."""
    def need(n: str, s: Any) -> int:
        kind = getattr(_resolved(s, tuple(model.shapes[n]), n), "kind", None)
        return stored_bytes(model, n) + STREAM_COPIES.get(kind, STREAM_COPIES_DEFAULT) * 4 * model.numel(n)
    return int(RETENTION * max((need(n, s) for n, s in targets.items() if n in model.shapes and s is not None), default=0))


def stream_parts(model: Model, targets: Mapping[str, Any], safetensors: bool,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, int]:
    """Quantizing tensor by tensor as the file is read (rtn; every method's final write): one tensor's
    quantize (``one_quantize``), and a safetensors writer's shard (held, serialized, and the freed heap the
    allocator keeps: 3x, as docs/models-devices-threads.md measured; at most the output: the targets
    quantized, the rest as stored) or nothing for GGUF's spool."""
    output = quantized_bytes(model, targets) + sum(stored_bytes(model, n) for n in model.shapes if targets.get(n) is None)
    return {"one tensor's quantize": one_quantize(model, targets),
            "the writer's shard": 3 * min(max_shard_bytes, output) if safetensors else 0}


def default_budget(device: torch.device) -> tuple[int | None, int | None]:
    """``(budget, available)``: what a step without ``--max-memory`` may peak at on ``device``. On the CPU,
    this process's resident memory plus the RAM still available (``qkit.memory.available_ram``) less a
    headroom of a tenth of it (at least ``HEADROOM``), for the page cache and other processes' growth; on
    CUDA, the memory this process holds plus 90% of the free memory. ``(None, None)`` where it cannot be told."""
    if device.type == "cuda":
        free = available_memory(str(device))
        held = torch.cuda.memory_allocated(device)
        return (held + int(0.9 * free), free) if free is not None else (None, None)
    avail = available_ram()
    if avail is None:
        return None, None
    return (process_rss() or 0) + avail - max(HEADROOM, avail // 10), avail


def check_need(need: Need, max_memory: int | None, device: torch.device | None = None, helps: str = "") -> None:
    """Refuse ``need`` in one line (``InputError``) when it is above ``max_memory``, or, without one, above
    what ``default_budget`` leaves on ``device`` (None: the CPU). ``helps``: what would lower the need
    (``"pass --dtype bf16, "``)."""
    if max_memory is not None:
        if need.total > max_memory:
            raise InputError(f"--max-memory {gib(max_memory)} is below the {gib(need.total)} {need.step} needs "
                             f"({need.describe()}); {helps}raise --max-memory")
        return
    budget, available = default_budget(device or torch.device("cpu"))
    if budget is not None and need.total > budget:
        raise InputError(f"{need.step} needs {gib(need.total)} ({need.describe()}), but only {gib(available or 0)} is "
                         f"available; {helps}free memory (--max-memory SIZE overrides the check)")


__all__ = ["BASELINE", "HEADROOM", "QUANTIZE_COPIES", "RETENTION", "STREAM_COPIES", "Dims", "Model", "Need", "block_of",
           "check_need", "config_int", "default_budget", "largest", "layers_in", "one_quantize", "quantized_bytes",
           "stored_bytes", "stream_parts", "walk_dtype", "walked_weights"]
