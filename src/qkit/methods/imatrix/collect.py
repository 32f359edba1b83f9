"""Collect an importance matrix from calibration text, as ``llama-imatrix`` does.

What is collected (``tools/imatrix/imatrix.cpp::collect_imatrix`` at the pinned commit), for every
linear weight inside the transformer blocks (llama.cpp's ``blk.*`` matrix multiplications) and, with
``process_output``, the untied ``output.weight``: the sum over every token of ``x[j]**2`` for each input
column ``j``, and the number of tokens. Tied heads are ``token_embd.weight`` in llama.cpp, which it
never collects. Batches under 16 tokens are skipped (llama.cpp's ``src1->ne[1] < 16``); with
``chunk_size >= 16`` there are none.

The tokens (``compute_imatrix``): one text (a file, ``kjv:``, ``hf:``) is tokenized once (with
llama.cpp's ``add_special``: a BOS first when the tokenizer adds one) and cut into consecutive chunks of
``chunk_size`` tokens from the start (not sampled: llama-imatrix takes the first ``--chunks``). The
default calibration mix (``qkit.catalog.DEFAULT_MIX``) and several texts are sampled instead, as the
calibrated methods sample them (``qkit.methods.calibration.sample_parts``, seed 0: ``--chunks`` windows
of ``--chunk-size`` tokens shared out among the parts by their weights), since the first chunks of a mix
would be its first part. Either way the first token of every chunk is replaced by BOS when the model
adds one. A text shorter than two chunks is refused, as llama-imatrix refuses it.

The statistics are accumulated in float64 and stored as float32 (llama.cpp adds fp32 squares one token
at a time); the difference against llama-imatrix on the same tokens is measured in
``benchmarks/bench_imatrix.py``. Inputs shared by several linears (q/k/v, gate/up) are squared once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.catalog import checked_calibration
from qkit.checkpoint import tensor_dtypes, tensor_shapes
from qkit.dtypes import load_dtype, non_finite_activations
from qkit.errors import InputError
from qkit.methods.calibration import (
    DEFAULT_SAMPLES,
    DEFAULT_SEED,
    DEFAULT_SEQLEN,
    part_ids,
    sample_parts,
    set_provenance,
)
from qkit.llama_names import expert_index
from qkit.methods.imatrix.file import Imatrix, ImatrixEntry
from qkit.methods.imatrix.names import gguf_names, refuse_unsupported
from qkit.methods.memory import BASELINE, RETENTION, Model, Need, check_need
from qkit.methods.experts import linear_names, routers, unfused_experts
from qkit.methods.sequential import find_blocks
from qkit.schemes.recipes import expert_count

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedTokenizerBase
from qkit.texts import Corpus, split_sources

MIN_BATCH_TOKENS = 16  # imatrix.cpp: "why are small batches ignored (<16 tokens)?"


@dataclass(frozen=True)
class ImatrixOptions:
    """``source``: the calibration text (None: the default mix; a UTF-8 file, a directory or several files;
    ``kjv:``, ``hf:...``: ``qkit.catalog.calibration_set``); ``chunks``
    of ``chunk_size`` tokens (llama-imatrix's ``--chunks`` and ``-c``); ``batch`` chunks per forward pass;
    ``process_output``: also collect the untied ``output.weight`` (llama-imatrix's ``--process-output``);
    ``dtype``: what the model runs in (``--dtype``: fp32, bf16, fp16; the sums are accumulated in fp32);
    ``calibrate_all_experts``: a mixture-of-experts model's experts each summed over every token, not only
    those routed to them (``qkit.methods.experts``)."""

    source: str | None = None
    chunks: int = DEFAULT_SAMPLES
    chunk_size: int = DEFAULT_SEQLEN
    batch: int = 4
    process_output: bool = False
    dtype: str = "fp32"
    calibrate_all_experts: bool = False

    def check(self) -> None:
        load_dtype(self.dtype)
        if not isinstance(self.calibrate_all_experts, bool):
            raise InputError(f"calibrate_all_experts must be true or false, got {self.calibrate_all_experts!r}")
        for name, v, low in (("--chunks", self.chunks, 1), ("--chunk-size", self.chunk_size, MIN_BATCH_TOKENS),
                             ("--batch", self.batch, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InputError(f"{name} must be an integer of at least {low}, got {v!r}")
            whole(v, name, low, MAX_COUNT)  # the upper bound: a 309-digit count overflowed the memory estimate
        if self.source is not None:  # an empty value or entry ("a,,b": an empty shell variable) named now
            split_sources(self.source)


def imatrix_ids(tokenizer: PreTrainedTokenizerBase | None, options: ImatrixOptions,
                evaluation: Corpus | list[Corpus] | None = None) -> tuple[torch.Tensor, dict]:
    """The chunks ``LongTensor [chunks, chunk_size]`` llama-imatrix would evaluate (one text), or the mix's
    sampled windows (several: see the module docstring), and their provenance."""
    options.check()
    calibration = checked_calibration(options.source, evaluation)  # a calibration text never contains an eval text
    if tokenizer is None:
        raise InputError("the model has no tokenizer files; qkit imatrix needs one (tokenizer.json or similar)")
    bos = _bos(tokenizer)
    n = options.chunk_size
    parts = part_ids(tokenizer, calibration)
    if len(parts) == 1:
        ids_t = torch.cat([torch.tensor([bos]), parts[0]]) if bos is not None else parts[0]
        name = calibration.name
        if ids_t.numel() < 2 * n:
            raise InputError(f"calibration text {name} has {ids_t.numel()} tokens, fewer than two chunks of {n} "
                             "(llama-imatrix refuses it too); pass a smaller --chunk-size")
        fits = ids_t.numel() // n
        if options.chunks > fits:
            raise InputError(f"calibration text {name} holds {fits} chunks of {n} tokens, not {options.chunks}; "
                             f"pass --chunks {fits} or less")
        chunks, shares = ids_t[: options.chunks * n].view(options.chunks, n).clone(), [options.chunks]
    else:
        chunks, shares = sample_parts(parts, [p.weight for p in calibration.parts], options.chunks, n, DEFAULT_SEED,
                                      [p.corpus.name for p in calibration.parts], ("--chunks", "--chunk-size"))
    if bos is not None:
        chunks[:, 0] = bos
    provenance = {
        **set_provenance(calibration, parts, shares), "chunks": options.chunks, "chunk_size": n, "bos": bos,
        "ids_sha256": hashlib.sha256(chunks.numpy().astype("<i8").tobytes()).hexdigest(),
    }
    if len(parts) == 1:
        provenance["tokens"] = int(ids_t.numel())  # with the BOS, as llama-imatrix counts them
    return chunks, provenance


def _bos(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The BOS id when the tokenizer adds one (llama.cpp's ``add_bos``), else None."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(with_special) > len(plain) and with_special[0] == bos:
        return int(bos)
    return None


def collect(model: torch.nn.Module, config: dict, chunks: torch.Tensor, options: ImatrixOptions, *,
            on_chunk: Callable[[int, int], None] | None = None, provenance: dict | None = None) -> Imatrix:
    """Run ``model`` (a transformers causal LM) on ``chunks`` ``[n, chunk_size]`` and return the matrix.

    The head is not run (its input is the final norm's output, hooked when ``process_output``), so the
    collection costs the blocks' forward pass and the squares of their inputs. A mixture-of-experts model
    runs with one linear per expert matrix (``qkit.methods.experts``): each expert's sums cover the tokens
    the router sends it (every token with ``calibrate_all_experts``), stored as llama-imatrix stores a
    stacked ``_exps`` tensor's (``expert_entries``); its router's input is collected too (``ffn_gate_inp``)."""
    refuse_unsupported(config)
    with unfused_experts(model, config, options.calibrate_all_experts):
        return _collect(model, config, chunks, options, on_chunk, provenance)


def _collect(model: torch.nn.Module, config: dict, chunks: torch.Tensor, options: ImatrixOptions,
             on_chunk: Callable[[int, int], None] | None, provenance: dict | None) -> Imatrix:
    prefix, blocks = find_blocks(model)
    inside = [(f"{prefix}.{i}.", b) for i, b in enumerate(blocks)]
    linears = {p + n + ".weight": m for p, b in inside for n, m in linear_names(b).items()}
    # a router is no nn.Linear in transformers; llama.cpp's ffn_gate_inp is a matrix product it collects
    linears.update({p + n + ".weight": m for p, b in inside for n, m in routers(b).items()})
    head = model.get_output_embeddings()  # transformers' API: the lm_head
    tied = bool(config.get("tie_word_embeddings", False))
    if options.process_output and not tied and isinstance(head, torch.nn.Linear):
        linears["lm_head.weight"] = head
    names = gguf_names(config, list(linears))
    sums = {n: torch.zeros(_width(m), dtype=torch.float64) for n, m in linears.items()}
    counts = dict.fromkeys(linears, 0)
    # The last input and its squares: q/k/v (and gate/up) are called one after another on the same tensor
    # object. Held by reference, so its memory cannot be reused by another tensor while it is compared.
    last: list = [None, None]

    def hook(name: str) -> Callable:
        # an expert's product is llama.cpp's MUL_MAT_ID, collected whatever its tokens; a plain one from 16
        least = 1 if expert_index(name) is not None else MIN_BATCH_TOKENS

        def pre(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            tokens = x.numel() // x.shape[-1]
            if tokens < least:
                return
            if last[0] is x:
                sq = last[1]
            else:
                x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
                sq = x2.mul_(x2).sum(dim=0).cpu()
                if not bool(torch.isfinite(sq).all()):  # an fp16 overflow: a matrix of NaN is never written
                    raise non_finite_activations(f"the input of {names.get(name, name)}", x.dtype)
                last[0], last[1] = x, sq
            sums[name] += sq
            counts[name] += tokens
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    base = model.base_model  # transformers' API: the model without its head (what llama.cpp's blk.* run in)
    run_base = base is not model and "lm_head.weight" not in linears
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for i in range(0, chunks.shape[0], options.batch):
                batch = chunks[i : i + options.batch].to(device)
                (base if run_base else model)(input_ids=batch, use_cache=False)
                if on_chunk is not None:
                    on_chunk(min(i + options.batch, chunks.shape[0]), chunks.shape[0])
    finally:
        for h in handles:
            h.remove()
        last[0] = last[1] = None
    experts = {n for n in linears if expert_index(n) is not None}
    entries = {names[n]: ImatrixEntry(sums[n].to(torch.float32).numpy().reshape(1, -1),
                                      torch.tensor([counts[n]], dtype=torch.float32).numpy())
               for n in linears if counts[n] > 0 and n not in experts}
    entries.update(expert_entries({n: (names[n], sums[n], counts[n]) for n in experts}, expert_count(config)))
    datasets = [provenance["name"]] if provenance else []
    return Imatrix(entries, chunk_count=chunks.shape[0], chunk_size=options.chunk_size, datasets=datasets)


def _width(module: torch.nn.Module) -> int:
    """The input width of a linear or a router (a module with a ``weight [out, in]``)."""
    return int(module.weight.shape[-1])


def expert_entries(collected: dict[str, tuple[str, torch.Tensor, int]], experts: int) -> dict[str, ImatrixEntry]:
    """llama-imatrix's entries of the stacked ``_exps`` tensors from each expert matrix's ``(llama.cpp name, sums
    fp64 [in], tokens)``: ``sums`` ``[experts, in]`` with expert ``e``'s in row ``e`` and ``counts`` ``[experts]``
    (0 and a row of zeros for an expert no token reached, as llama-imatrix writes "partial data")."""
    out: dict[str, ImatrixEntry] = {}
    for name, (g, sq, tokens) in sorted(collected.items()):
        if g not in out:
            out[g] = ImatrixEntry(np.zeros((experts, sq.numel()), dtype=np.float32), np.zeros(experts, dtype=np.float32))
        e = expert_index(name)
        out[g].sums[e] = sq.to(torch.float32).numpy()
        out[g].counts[e] = tokens
    return out


def collect_memory(model: Model, options: ImatrixOptions) -> dict[str, int]:
    """What ``collect`` holds beside the process (``qkit.methods.memory``): the whole model at the load
    dtype, and one batch's forward with the float64 squares of the widest input (with ``process_output``,
    the head's logits too)."""
    batch, T, d = min(options.batch, options.chunks), options.chunk_size, model.dims
    squares = 2 * 8 * batch * T * max(d.hidden, d.inter)
    logits = batch * T * d.vocab * (model.a + 4) if options.process_output else 0
    work = max(model.load, model.block_forward(batch, T) + squares + logits)
    return {f"the model's weights in {model.dtype_name}": model.loaded(), "one batch's forward": int(RETENTION * work)}


def check_collect_memory(directory: Path, config: dict, options: ImatrixOptions, max_memory: int | None,
                         device: torch.device) -> Need:
    """Refuse, in one line before the model loads, a collection whose estimate (the process and
    ``collect_memory``, from the headers) is above ``max_memory`` or, without it, what the CPU has free (on
    CUDA only ``max_memory`` is checked). Returns the need."""
    model = Model.of(dict(tensor_shapes(directory)), tensor_dtypes(directory), config, load_dtype(options.dtype))
    need = Need("this imatrix", {"the process": BASELINE, **collect_memory(model, options)})
    helps = "pass --dtype bf16, a smaller --batch, or " if options.dtype == "fp32" else "pass a smaller --batch or "
    if max_memory is not None or device.type != "cuda":
        check_need(need, max_memory, torch.device("cpu"), helps)
    return need


__all__ = ["ImatrixOptions", "check_collect_memory", "collect", "collect_memory", "imatrix_ids"]
