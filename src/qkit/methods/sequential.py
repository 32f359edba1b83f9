"""Layer by layer: walk a causal LM's transformer blocks with calibration activations (GPTQ's scheme).

Peak memory on the compute device is one block plus the calibration activations (``samples x seqlen x
hidden`` floats, twice: a block's inputs and its outputs), never the whole model: the blocks stay where
the model was loaded (CPU) and each is moved to ``device`` only while it is processed.

How it works (Frantar et al. 2022, the reference ``gptq`` code's ``llama_sequential``):

1. **Capture** the first block's inputs: the modules before the blocks (embeddings, rotary embedding)
   are moved to ``device`` and the model is called on each calibration batch with every block replaced
   by a stand-in that records the keyword arguments the model calls it with (attention mask,
   ``position_ids``, ``position_embeddings``, cache = None, ...: a layer of another attention type, such
   as a sliding-window layer, gets its own mask) and block 0's ``hidden_states``; the last stand-in raises
   ``_Stop`` so nothing after the blocks runs.
2. For each block ``i``: ``process_block(i, block, inputs)`` is called. The method does what it needs
   with ``inputs`` (``BlockInputs``, below): accumulate statistics of its linears' inputs with
   ``inputs.forward(on_input=...)``, store them with ``inputs.record(...)``, grid-search with
   ``inputs.run_module(...)``, and **leaves the block's weights as they should be seen downstream**
   (GPTQ: the dequantized weights; AWQ: scales folded and weights dequantized).
3. The walker then runs the block again on every batch with those weights: its outputs are block
   ``i + 1``'s ``hidden_states`` (each block is called with the keyword arguments recorded for it).
   ``on_block(i + 1, n_blocks)`` reports progress. A ``process_block`` that already ran the block
   with its final weights (e.g. GPTQ quantizing each linear inside a forward pre-hook, in one pass) may
   return those outputs (``list[Tensor]``, one per batch, as ``inputs.forward()`` returns them); the
   walker then uses them instead of running the block again. Returning ``None`` means: run it again.

Usage (a method's ``run``)::

    loaded = qkit.models.load(ref=ref, device="cpu")
    ids, provenance = calibration_ids(loaded.tokenizer, CalibrationOptions(...))   # [N, L]

    def process(i: int, block: torch.nn.Module, inputs: BlockInputs) -> None:
        linears = inputs.linears()                       # {"self_attn.q_proj": nn.Linear, ...}
        H = {}
        def acc(name, x):                               # x: [batch, L, in_features] on device
            x = x.reshape(-1, x.shape[-1]).float()
            H[name] = H.get(name, 0) + x.T @ x
        inputs.forward(on_input=acc, modules=linears)    # one pass over every batch, original weights
        for name, lin in linears.items():               # weights as the next blocks should see them
            lin.weight.data.copy_(quantize_and_dequantize(lin.weight, H[name]))
        # full names for the method's targets: inputs.prefix + name + ".weight"

    walk_blocks(loaded.model, ids, process, device=torch.device("cpu"), batch_size=8, on_block=on_block)

``BlockInputs`` (what ``process_block`` gets):

* ``hidden``: ``list[Tensor [b, L, hidden]]``, the block's inputs per batch, on ``device``
  (``torch.cat(hidden)`` is ``[N, L, hidden]``); ``kwargs``: ``list[dict]``, the keyword arguments
  the model calls this block with, per batch (on ``device``); ``prefix``: the block's parameter-name prefix, e.g.
  ``"model.layers.3."``; ``block``: the module (on ``device`` during the call).
* ``linears()``: the block's ``nn.Linear`` submodules by their name inside the block, as the checkpoint
  names their weights (an expert's linears inside ``qkit.methods.experts.unfused_experts``:
  ``block_sparse_moe.experts.3.w1`` for mixtral).
* ``forward(on_input=None, on_output=None, modules=None) -> list[Tensor]``: run the block on every
  batch; for each module of ``modules`` (``{name: module}``), call ``on_input(name, x)`` with the
  module's first positional input and ``on_output(name, y)`` with its output, batch by batch (so
  statistics can be accumulated without storing activations). Returns the block outputs per batch.
* ``record(modules) -> dict[name, Tensor [N, L, in]]``: every batch's inputs of each module,
  concatenated (memory: what it holds; for AWQ's grid search over one group of layers at a time).
* ``run_module(module, xs, **kwargs) -> list[Tensor]``: call a submodule on each tensor of ``xs``
  (e.g. ``block.mlp`` on recorded inputs, or ``block.self_attn`` with ``inputs.kwargs[k]``); for a
  block-level call use ``forward``.

The model is changed in place (the block weights ``process_block`` leaves) and left on the CPU
(blocks are moved back after processing). Everything runs under ``torch.no_grad``.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qkit.dtypes import check_finite
from qkit.errors import InputError
from qkit.methods.experts import linear_names

DEFAULT_BATCH_SIZE = 8  # calibration windows per forward call


class _Stop(Exception):
    """Raised by the capture hook on block 0: the rest of the model need not run."""


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The transformer blocks: the ``nn.ModuleList`` of ``config.num_hidden_layers`` modules
    (``model.layers`` for llama, ``transformer.h`` for gpt2, ...), with its name."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n):
            if best is None or len(name) < len(best[0]):
                best = (name, module)
    if best is None:
        raise InputError(
            f"cannot find the transformer blocks of {type(model).__name__} (no module list of "
            f"{n} layers); calibrated methods need a decoder-only model with a list of blocks"
        )
    return best


def to_device(obj: Any, device: torch.device, memo: dict[int, Any] | None = None) -> Any:
    """Move every tensor inside ``obj`` (tensors, tuples, lists, dicts) to ``device``; with ``memo``, a tensor
    met again (the same object) is moved once and shared."""
    if isinstance(obj, torch.Tensor):
        if memo is None:
            return obj.to(device)
        if id(obj) not in memo:
            memo[id(obj)] = (obj, obj.to(device))  # the source kept alive: its id is not reused meanwhile
        return memo[id(obj)][1]
    if isinstance(obj, tuple):
        return tuple(to_device(o, device, memo) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device, memo) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device, memo) for k, v in obj.items()}
    return obj


def first_output(out: Any) -> torch.Tensor:
    """A block's output hidden states (blocks of older transformers return a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class BlockInputs:
    """One block's calibration inputs (see the module docstring)."""

    block: torch.nn.Module
    prefix: str
    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]]

    def linears(self) -> dict[str, torch.nn.Linear]:
        return linear_names(self.block)  # an expert's under its checkpoint name (qkit.methods.experts)

    @torch.no_grad()
    def forward(
        self,
        on_input: Callable[[str, torch.Tensor], None] | None = None,
        on_output: Callable[[str, torch.Tensor], None] | None = None,
        modules: Mapping[str, torch.nn.Module] | None = None,
    ) -> list[torch.Tensor]:
        handles = []

        # The hooks return None whatever the callbacks return: a value returned from a forward (pre-)hook
        # would replace the module's inputs (outputs).
        def pre(name: str):
            def hook(_m, args):
                on_input(name, args[0])  # type: ignore[misc]
            return hook

        def post(name: str):
            def hook(_m, _args, out):
                on_output(name, first_output(out))  # type: ignore[misc]
            return hook

        for name, module in (modules or {}).items():
            if on_input is not None:
                handles.append(module.register_forward_pre_hook(pre(name)))
            if on_output is not None:
                handles.append(module.register_forward_hook(post(name)))
        try:
            return [first_output(self.block(h, **kw)) for h, kw in zip(self.hidden, self.kwargs)]
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def record(self, modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
        got: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
        self.forward(on_input=lambda n, x: got[n].append(x.detach()), modules=modules)
        return {n: torch.cat(xs) for n, xs in got.items()}

    @torch.no_grad()
    def run_module(self, module: torch.nn.Module, xs: Iterable[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
        return [first_output(module(x, **kwargs)) for x in xs]


class _Recorder(torch.nn.Module):
    """A block's stand-in while the inputs are captured: records the keyword arguments the model calls the
    block with (block 0 also its ``hidden_states``), returns its input unchanged, and stops the model at the
    last block. Attributes the model's forward reads off a block (its attention type, its index) are the
    real block's, so that each block is given what the model gives it (a sliding-window layer its own mask)."""

    def __init__(self, block: torch.nn.Module, index: int, last: bool, hidden: list, kwargs: list):
        super().__init__()
        object.__setattr__(self, "_real", block)  # not a submodule: its parameters are not this module's
        object.__setattr__(self, "_record", (index, last, hidden, kwargs))

    def forward(self, *args, **kw):
        index, last, hidden, kwargs = self._record
        h = args[0] if args else kw.pop("hidden_states")
        if index == 0:
            hidden.append(h)
        kwargs[index].append({k: v for k, v in kw.items() if k != "hidden_states"})
        if last:
            raise _Stop
        return h

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


@torch.no_grad()
def capture_block_inputs(
    model: torch.nn.Module, ids: torch.Tensor, device: torch.device, batch_size: int = DEFAULT_BATCH_SIZE
) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
    """Block 0's ``hidden_states`` for each batch of ``ids`` ``[N, L]``, and every block's keyword arguments
    per batch (``kwargs[i][b]``), on ``device``. The model runs with each block replaced by a stand-in that
    records what the model calls it with (``_Recorder``): blocks of different attention types get the
    mask of their own type, as in the model's forward. A tensor shared by several blocks' arguments (the
    position embeddings, a mask) is moved to ``device`` once."""
    blocks_name, blocks = find_blocks(model)
    # Move the modules outside the blocks that hold parameters or buffers of their own (embeddings, rotary
    # embedding, final norm, head) to the device; only the first two run before the last stand-in stops the
    # call. Ancestors of the blocks are skipped (moving them would move every block).
    def inside_or_above(n: str) -> bool:
        return n == blocks_name or n.startswith(blocks_name + ".") or blocks_name.startswith(n + ".") or n == ""

    moved = [m for n, m in model.named_modules() if not inside_or_above(n)
             and (any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)))]
    for m in moved:
        m.to(device)
    hidden: list[torch.Tensor] = []
    kwargs: list[list[dict[str, Any]]] = [[] for _ in blocks]
    real = list(blocks)
    try:
        for i, b in enumerate(real):
            blocks[i] = _Recorder(b, i, i == len(real) - 1, hidden, kwargs)
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for i, b in enumerate(real):
            blocks[i] = b
        for m in moved:
            m.to("cpu")
    memo: dict[int, Any] = {}
    return hidden, [[to_device(k, device, memo) for k in per_block] for per_block in kwargs]


_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings (``/proc/self/maps`` lines with an inode);
    empty where there is no ``/proc``."""
    ranges = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 6 and fields[4] != "0":
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError):
        return []
    return ranges


def _hand_back(tensors: Iterable[torch.Tensor]) -> int:
    """``madvise(MADV_DONTNEED)`` the whole pages strictly inside each of ``tensors`` that lie in a file
    mapping (see ``release_parameters``); returns the bytes handed back. Linux only; elsewhere 0."""
    maps = _file_mappings()
    if not maps:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0
    page = mmap.PAGESIZE
    released = 0
    for t in tensors:
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = -(-start // page) * page, (start + nbytes) // page * page
        if hi > lo and t.is_contiguous() and t.device.type == "cpu" and any(a <= lo and hi <= b for a, b in maps):
            if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                released += hi - lo
    return released


def release_parameters(module: torch.nn.Module) -> int:
    """Free ``module``'s parameters (each becomes an empty tensor) and return the bytes whose pages were
    handed back to the kernel.

    Dropping the tensors is not enough for weights loaded from a safetensors file in its own dtype:
    transformers then keeps them as views of the file's copy-on-write mapping, which stays mapped (and
    resident) while any tensor of the file lives. The whole pages strictly inside such a tensor are
    therefore released with ``madvise(MADV_DONTNEED)`` first: for a private file mapping the kernel drops
    them (a later read would fetch the file's bytes again), so nothing another tensor holds changes.
    Memory that is not file-backed is only dropped (the allocator frees it). Linux only; elsewhere the
    pages stay until the file is closed."""
    params = list(module.parameters())
    released = _hand_back(p.data for p in params)
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype)
    return released


def upcast(module: torch.nn.Module, dtype: torch.dtype = torch.float32, recurse: bool = True) -> int:
    """Give ``module``'s floating parameters and buffers of another dtype a ``dtype`` copy (in place: the
    module then computes in ``dtype``), handing the pages of the originals that lie in a file mapping back
    to the kernel (``release_parameters``); returns the elements converted. A bf16 file loaded in its own
    dtype and upcast block by block computes exactly what the same file loaded whole in float32 does, with
    one block in float32 at a time."""
    tensors = [t for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))
               if t.is_floating_point() and t.dtype != dtype]
    olds = [t.data for t in tensors]
    for t in tensors:
        t.data = t.data.to(dtype)
    _hand_back(olds)
    return sum(t.numel() for t in olds)


def upcast_outside_blocks(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """``upcast`` every module outside the transformer blocks that runs before them or after them, except
    an untied output head (the calibrated walks never run it): the embeddings, the rotary embedding and the
    final norm."""
    _, blocks = find_blocks(model)
    inside = {id(m) for b in blocks for m in b.modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    skip = inside | ({id(head)} if head is not None and not tied else set())
    return sum(upcast(m, dtype, recurse=False) for m in model.modules() if id(m) not in skip)


@torch.no_grad()
def walk_blocks(
    model: torch.nn.Module,
    ids: torch.Tensor,
    process_block: Callable[[int, torch.nn.Module, BlockInputs], list[torch.Tensor] | None],
    *,
    device: torch.device = torch.device("cpu"),
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_block: Callable[[int, int], None] | None = None,
    release: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> int:
    """Call ``process_block(i, block, inputs)`` for every block in order, feeding each block the
    outputs of the previous one *after* ``process_block`` changed it (or the outputs it returned; see the
    module docstring).

    ``model``: a transformers causal LM on the CPU (float32); ``ids``: LongTensor ``[N, L]``.
    ``release``: free each block's parameters once its outputs are computed (a method that keeps what it
    needs, as GPTQ keeps the quantized parts, and never runs the model again): the model's memory then
    falls block by block as the method's results grow, instead of both being held to the end. The model
    is left unusable. ``compute_dtype``: a model loaded in another dtype (a bf16 file, memory-mapped) is
    run in this one: the modules outside the blocks are upcast first and each block just before it is
    processed (``upcast``), so one block at a time is held at ``compute_dtype``. Returns the number of blocks.
    """
    if ids.ndim != 2 or ids.numel() == 0:
        raise InputError(f"calibration ids must be a non-empty [samples, seqlen] tensor, got shape {list(ids.shape)}")
    if batch_size < 1:
        raise InputError(f"batch size must be positive, got {batch_size}")
    was_training = model.training
    model.eval()
    blocks_name, blocks = find_blocks(model)
    if compute_dtype is not None:
        upcast_outside_blocks(model, compute_dtype)
    hidden, kwargs = capture_block_inputs(model, ids, device, batch_size)
    for h in hidden:  # statistics of NaN or inf (an fp16 overflow) are garbage: refused, never written
        check_finite(h, f"the input of {blocks_name}.0")
    total = len(blocks)
    for i, block in enumerate(blocks):
        if compute_dtype is not None:
            upcast(block, compute_dtype)
        block.to(device)
        inputs = BlockInputs(block, f"{blocks_name}.{i}.", hidden, kwargs[i])
        outputs = process_block(i, block, inputs)
        hidden = inputs.forward() if outputs is None else list(outputs)
        for h in hidden:
            check_finite(h, f"the output of {blocks_name}.{i}")
        block.to("cpu")
        if release:
            release_parameters(block)
        if on_block is not None:
            on_block(i + 1, total)
    model.train(was_training)
    return total


__all__ = [
    "DEFAULT_BATCH_SIZE", "BlockInputs", "capture_block_inputs", "find_blocks", "first_output", "release_parameters", "to_device",
    "upcast", "upcast_outside_blocks", "walk_blocks",
]
