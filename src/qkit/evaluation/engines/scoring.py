"""The engines that run in a worker subprocess (vLLM, llama.cpp): one job per eval, their answers as scores.

Layer 6 (``evaluation.engines``). ``WorkerEngine`` gives such an engine its ``open``: a ``WorkerSession``
that builds the eval's ``EngineJob`` once (``build_job``: the torch reference's windows, the battery
prompts as the torch battery tokenizes them, the reference's greedy continuations unpadded) and, for
each row, has the engine ``run`` it on the row's file and turns the ``EngineScores`` into ``Measured``:

- ``engine_scores``: NLL from the engine's target log-probabilities; KL (``kl_per_position``) only from a
  full distribution (else NaN: the table shows "-" and says why); top-1 from the engine's argmax;
- ``agreement_of``: the engine's teacher-forced argmax against the reference's greedy tokens;
- the battery: the engine's generated ids decoded by the tokenizer.

A worker engine loads its own copy of the weights: opening a session releases the torch reference model
(``Reference.release_model``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from qkit.evaluation.agreement import ReferenceContinuation
from qkit.evaluation.engines.base import (
    EngineJob,
    EngineOptions,
    EngineRefused,
    EngineScores,
)
from qkit.evaluation.measuring import Measured, Reference, RowFile
from qkit.evaluation.perplexity import CorpusReference, kl_per_position
from qkit.evaluation.token_scores import TokenScores
from qkit.export import Format, get_format

NO_KL = "returns only the top-k log-probabilities per position: KL needs the full distribution"


def build_job(reference: Reference) -> EngineJob:
    """The job every engine row measures: the reference's windows, the battery prompts' ids (as
    ``encode_batch`` tokenizes them, without the padding) and the reference's greedy continuations
    (prompt + ``agree_tokens`` ids, the left padding removed)."""
    tok = reference.tokenizer
    prompts = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in reference.prompts] if reference.battery else []
    c = reference.continuation
    inputs = [row[mask.bool()].tolist() for row, mask in zip(c.input_ids, c.attention_mask)]
    return EngineJob(windows=reference.corpus.windows, battery_prompts=prompts, battery_tokens=reference.battery_tokens,
                     repetition_penalty=reference.repetition_penalty, agreement_inputs=inputs, agreement_n=c.n)


def engine_scores(scores: EngineScores, corpus: CorpusReference, runtime: str) -> TokenScores:
    """``EngineScores`` -> ``TokenScores`` on the torch reference's positions.

    ``nll = -target_logprobs`` (float64 ``[n]``); ``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))`` with
    ``p`` the torch reference and ``q`` the engine's full distribution (``kl_per_position``; NaN ``[n]``
    without one); ``top1 = argmax q == argmax p``. Raises ``EngineRefused`` when the engine's shapes do
    not pair with the reference's (another vocabulary, another number of positions)."""
    windows = corpus.windows
    if len(scores.target_logprobs) != len(windows) or len(scores.argmax) != len(windows):
        raise EngineRefused(f"{runtime} scored {len(scores.target_logprobs)} windows, the reference {len(windows)}")
    nll, kl, top1 = [], [], []
    for i, (w, ref_top) in enumerate(zip(windows, corpus.ref_argmax)):
        target, argmax = scores.target_logprobs[i], scores.argmax[i]
        if target.numel() != w.numel() - 1 or argmax.numel() != w.numel() - 1:
            raise EngineRefused(f"{runtime} scored {target.numel()} positions of window {i}, the reference {w.numel() - 1}")
        nll.append(-target.double())
        top1.append(argmax.long() == ref_top)
        if scores.full is not None:
            lp = scores.full[i]
            ref_lp = corpus.logprobs(i)  # read back from the reference's store: one window at a time
            if lp.shape != ref_lp.shape:
                raise EngineRefused(f"{runtime}'s log-probabilities are {tuple(lp.shape)} per window, the "
                                    f"reference's {tuple(ref_lp.shape)}: another vocabulary cannot be paired")
            kl.append(kl_per_position(ref_lp, lp.float()).clamp_(min=0.0))
            del ref_lp
        else:
            kl.append(torch.full((w.numel() - 1,), math.nan, dtype=torch.float64))
    nll_all = torch.cat(nll)
    # a NaN log-probability: the engine's argmax (its top-1) means nothing for this row
    return TokenScores(nll_all, torch.cat(kl), torch.cat(top1), measurable=not bool(torch.isnan(nll_all).any()),
                       domains=corpus.domains)


def agreement_of(scores: EngineScores, continuation: ReferenceContinuation, runtime: str) -> torch.Tensor:
    """Bool ``[B, n]``: the engine's teacher-forced argmax equals the reference's greedy token."""
    targets = continuation.targets
    got = [a.long().reshape(-1) for a in scores.agreement_argmax]
    if len(got) != targets.shape[0] or any(a.numel() != targets.shape[1] for a in got):
        raise EngineRefused(f"{runtime} returned {len(got)} agreement rows, the reference {targets.shape[0]} of "
                            f"{targets.shape[1]} tokens")
    return torch.stack(got) == targets


class WorkerSession:
    """One worker engine opened on an eval's reference (see the module docstring)."""

    def __init__(self, engine: WorkerEngine, reference: Reference, options: EngineOptions, say: Callable[[str], None]):
        reference.release_model()  # the engine loads its own copy of the weights: qkit's goes first
        self.engine, self.reference, self.options, self.say = engine, reference, options, say
        self.job = build_job(reference)

    def measure(self, row: RowFile, label: str) -> Measured:
        engine, ref = self.engine, self.reference
        self.say(f"{label}: loading and measuring in {engine.name}")
        measured = engine.run(row.path, self.job, self.options)
        scores = engine_scores(measured, ref.corpus, engine.name)
        agree = agreement_of(measured, ref.continuation, engine.name)
        if len(measured.battery_ids) != len(ref.battery):
            raise EngineRefused(f"{engine.name} answered {len(measured.battery_ids)} battery prompts of {len(ref.battery)}")
        outputs = [ref.tokenizer.decode(ids, skip_special_tokens=True) for ids in measured.battery_ids]
        full = measured.full is not None
        record = {"name": engine.name, "version": measured.version, "format": engine.format,
                  "file_bytes": row.facts["size_bytes"], "write_seconds": row.facts.get("build_seconds"),
                  "load_seconds": measured.load_seconds, "run_seconds": measured.run_seconds,
                  "full_distribution": full, "notes": list(measured.notes) + ([] if full else [f"{engine.name} {NO_KL}"])}
        return Measured(scores, outputs, agree, full, {"engine": record})

    def close(self) -> None:
        pass  # each row's worker is gone when its run returns


class WorkerEngine:
    """What a worker engine shares: its sessions. A subclass has the ``Engine`` attributes and ``run``."""

    name: str
    format: str

    def run(self, path: Path, job: EngineJob, options: EngineOptions) -> EngineScores:
        raise NotImplementedError

    def open(self, reference: Reference, options: EngineOptions, say: Callable[[str], None]) -> WorkerSession:
        return WorkerSession(self, reference, options, say)

    def loads_file(self, fmt: Format) -> bool:
        """A worker loads a given file in its own format (llama.cpp: a GGUF file) and no other."""
        return get_format(self.format) is fmt


__all__ = ["NO_KL", "WorkerEngine", "WorkerSession", "agreement_of", "build_job", "engine_scores"]
