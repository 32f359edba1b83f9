"""``--runtime torch`` (the default): qkit's own forward pass, in this process, on the reference model itself.

Layer 6 (``evaluation.engines``): an ``Engine`` beside vLLM and llama.cpp, registered first. It reads
qkit's own format, every scheme (dequantized to the model's dtype) and every run-time simulation
(``qkit.simulate``), and gives the full distribution.

It is also the engine every row is compared with: ``measure_reference`` scores the loaded reference model
once (its log-probabilities over the corpus windows, held on disk: ``CorpusReference``), greedily extends
each battery prompt (``reference_continuation``) and measures the reference's own row; the ``Reference``
it returns is what every engine's rows are measured against.

A row (``TorchSession.measure``): the row's written qkit checkpoint is streamed into the reference model
in place (``Swapper``: quantized tensors dequantized, the others, such as norms a method folded scales
into, copied where they differ), the row's simulations are installed, the corpus is scored against the
stored reference (perplexity, KL, top-1), one prefill of the battery prompts serves agreement and the
battery, then the hooks are removed and the reference's weights put back. Nothing else changes between
rows, so a row and a saved checkpoint of the same scheme give the same numbers. On a mixture-of-experts
model each expert matrix is streamed into its slice of the fused parameters (``swap``); a row that simulates
quantized activations is refused there (``EngineRefused``, before its weights are swapped in), since the
hooks quantize the inputs of ``nn.Linear`` modules and the experts are none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from qkit.checkpoint import checkpoint_bytes, tensor_shapes
from qkit.evaluation.agreement import (
    PromptCache,
    agreement,
    prefill_prompts,
    reference_continuation,
)
from qkit.evaluation.battery import (
    encode_batch,
    generate_answers,
    model_repetition_penalty,
)
from qkit.evaluation.engines.base import ENGINES, TORCH, EngineOptions, EngineRefused
from qkit.evaluation.measuring import (
    REFERENCE,
    Measured,
    Reference,
    RowFile,
    assemble_row,
)
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.windows import check_corpus_tokens, choose_window
from qkit.evaluation.swap import Swapper, model_tensors
from qkit.export import QKIT, Format
from qkit.methods.experts import fused_paths
from qkit.models import ModelRef
from qkit.simulate import SimulationContext, apply_simulation, simulation_bits
from qkit.transform import is_block_projection

ROW_SHARD_BYTES = 256 << 20  # a row's temporary checkpoint: the shard writer holds one shard (safetensors a copy)


class TorchEngine:
    """qkit's torch forward pass as an eval runtime (``ENGINES["torch"]``)."""

    name = TORCH
    extra = ""  # part of qkit: nothing to install
    format = QKIT
    full_distribution = True

    def check_available(self, options: EngineOptions) -> None:
        return None  # qkit's own

    def cannot_run(self, scheme: str | None, simulations: tuple[str, ...]) -> str | None:
        return None  # every scheme dequantizes to the model's dtype; every simulation is a torch hook

    def export_options(self, simulations: tuple[str, ...]) -> dict[str, Any]:
        """qkit's format in small shards: a row is streamed into the model one tensor at a time, and the
        shard writer holds one shard."""
        return {"format": QKIT, "max_shard_bytes": ROW_SHARD_BYTES}

    def open(self, reference: Reference, options: EngineOptions, say: Callable[[str], None]) -> TorchSession:
        return TorchSession(reference, say)

    def loads_file(self, fmt: Format) -> bool:
        """A file qkit reads tensor by tensor (``Format.torch_loads``): a saved qkit checkpoint, streamed into the
        reference model; a GGUF file, its tensors dequantized by the gguf package (``RowFile.tensors``)."""
        return fmt.torch_loads


def answer(model, reference: Reference, cache: PromptCache, label: str, say: Callable[[str], None]) -> tuple[list[str], torch.Tensor]:
    """Agreement (bool ``[B, n]``) and the battery's outputs from one prefill of the prompts (``cache``,
    consumed): agreement reads a copy of it, the battery generates on it."""
    say(f"{label}: agreement and battery" if reference.battery else f"{label}: agreement")
    agree = agreement(model, reference.continuation, prompt_cache=cache)
    outputs = (generate_answers(model, reference.tokenizer, reference.prompts, reference.battery_tokens,
                                reference.repetition_penalty, prompt_cache=cache) if reference.battery else [])
    cache.cache = None  # consumed by the battery, or not needed: its keys and values go now
    return outputs, agree


class TorchSession:
    """Rows measured on the reference model itself, one after another (see the module docstring)."""

    def __init__(self, reference: Reference, say: Callable[[str], None]):
        if reference.model is None:
            raise RuntimeError("the reference model was released; the torch engine measures its rows before any other")
        self.reference, self.model, self.say = reference, reference.model, say
        self.swapper = Swapper(self.model, reference.ref.directory)
        self.experts = len(fused_paths(self.model))  # modules holding experts in 3-D parameters, not linears
        self.context = SimulationContext(device=next(self.model.parameters()).device, extra={
            "tokenizer": reference.tokenizer, "model_ref": reference.ref, "corpus": reference.text})

    def measure(self, row: RowFile, label: str) -> Measured:
        ref, model = self.reference, self.model
        act_bits, kv_bits = simulation_bits(row.simulations, row.simulation_options)
        if act_bits is not None and self.experts:  # the hooks quantize nn.Linear inputs; the experts are not linears
            raise EngineRefused(
                f"{'+'.join(row.simulations)} quantizes the inputs of linear modules, and this model's experts are held "
                f"fused in 3-D parameters ({self.experts} modules), not linears: their inputs would stay in full precision")
        loads = row.path != ref.ref.directory  # the reference's own files: its weights are in the model already
        if loads:  # the row's own file, one tensor in memory at a time (docs/eval-memory.md)
            self.swapper.apply(row.tensors())
        changed = self.swapper.changed if loads else None
        try:
            with apply_simulation(model, row.simulations, self.context, row.simulation_options) as stats:
                self.say(f"{label}: perplexity and KL divergence")
                scores = ref.corpus.score(model)
                # one prefill of the prompts for both (agreement reads on a copy of its cache; the battery consumes it)
                outputs, agree = answer(model, ref, prefill_prompts(model, *ref.continuation.prompts), label, self.say)
        finally:
            self.swapper.restore()
        return Measured(scores, outputs, agree, True, {"act_bits": act_bits, "kv_bits": kv_bits,
                                                       "simulation_stats": stats, "weights_changed": changed})

    def close(self) -> None:
        self.swapper.restore()


def measure_reference(model, ref: ModelRef, inputs, answering, say: Callable[[str], None]) -> Reference:
    """The reference, measured once on the loaded ``model``: its corpus log-probabilities (``inputs``:
    ``checks.Inputs``, the token ids in windows), its greedy continuations of the battery prompts
    (``answering``: ``options.AnswerSettings``) and its own row, from one prefill of the prompts shared
    with its battery."""
    settings = inputs.settings
    if inputs.window is None:  # only when the config could not be read before but transformers loaded it anyway
        inputs.window = choose_window(settings.window, settings.tokens, model.config)
        check_corpus_tokens(inputs.corpus, int(inputs.ids.numel()), inputs.window)
    if not inputs.segments and inputs.ids.numel() < settings.tokens:
        say(f"note: the corpus has only {inputs.ids.numel()} tokens; using all of them")
    t0 = time.perf_counter()
    say("reference: perplexity" + (f" on {len(inputs.segments)} domains" if inputs.segments else ""))
    corpus = CorpusReference(model, inputs.ids, inputs.window, segments=inputs.segments)
    rp = model_repetition_penalty(model) if answering.repetition_penalty else 1.0
    say("reference: greedy continuations for agreement")
    tok, prompts = inputs.tokenizer, inputs.prompts
    batch = encode_batch(tok, prompts)
    cache = prefill_prompts(model, batch["input_ids"], batch["attention_mask"])  # shared with its battery
    continuation = reference_continuation(model, tok, prompts, answering.agree_tokens, prompt_cache=cache)
    battery = inputs.questions if answering.battery else []  # the questions answered (--no-battery: none)
    reference = Reference(ref, tok, corpus, corpus.own_scores(), None, battery, prompts, continuation, rp,
                          answering.battery_tokens, inputs.texts or [inputs.corpus], model,
                          str(next(model.parameters()).device), t0)
    outputs, agree = answer(model, reference, cache, REFERENCE, say)
    targets = [n for n, s in tensor_shapes(ref.directory) if is_block_projection(n, s)]
    bits = 8 * model_tensors(model)[targets[0]].element_size() if targets else float("nan")
    reference.ref_row = assemble_row(REFERENCE, Measured(reference.ref_scores, outputs, agree), battery, None,
                                     time.perf_counter() - t0, bits_per_weight=bits,
                                     size_bytes=checkpoint_bytes(ref.directory), matrices=0, runtime=TORCH)
    return reference


ENGINE = TorchEngine()
ENGINES.register(TORCH, ENGINE)

__all__ = ["ENGINE", "ROW_SHARD_BYTES", "TorchEngine", "TorchSession", "answer", "measure_reference"]
