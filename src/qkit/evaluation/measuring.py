"""What measuring a row passes around, in every engine alike.

Layer 6 (``evaluation``), below the engines and the runner: ``Reference`` (what every row is compared
with, computed once by the torch engine on the reference model), ``RowFile`` (a row's weights as an engine
loads them, and what writing them settled), ``Measured`` (what an engine measured for one row), and the
table ``Row`` assembled from them (``assemble_row``; ``refused_row`` for a row an engine could not run).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import iter_quantized
from qkit.evaluation.agreement import ReferenceContinuation
from qkit.evaluation.battery import Question, is_correct
from qkit.evaluation.domains import domain_rows
from qkit.evaluation.perplexity import CorpusReference, TokenScores
from qkit.evaluation.report import Row
from qkit.evaluation.specs import RowSpec
from qkit.evaluation.stats import mcnemar_exact, wilson_interval
from qkit.models import ModelRef
from qkit.schemes import QuantizedTensor

REFERENCE = "reference"  # the reference row's name in the table (an engine's: "reference [ENGINE]")


@dataclass
class Reference:
    """What every row is measured against, computed once by the torch engine on the reference model.

    ``corpus``: the reference's log-probabilities over the corpus windows; ``ref_scores`` / ``ref_row``: its
    own scores and table row; ``battery``: the questions answered (empty with ``--no-battery``);
    ``prompts``: the battery prompts (agreement reads them either way); ``continuation``: the reference's
    greedy tokens after each prompt; ``text``: the eval texts (a list: one, or the suite's; a simulation's
    context, what its calibration is checked against); ``model``: the
    loaded reference model, into which the torch engine swaps each row's weights, released (None) before an
    engine that loads its own copy runs; ``device``: where it was loaded; ``started``: when its measuring
    began (``time.perf_counter()``)."""

    ref: ModelRef
    tokenizer: Any
    corpus: CorpusReference
    ref_scores: TokenScores
    ref_row: Row
    battery: list[Question]
    prompts: list[str]
    continuation: ReferenceContinuation
    repetition_penalty: float
    battery_tokens: int
    text: Any = None
    model: torch.nn.Module | None = None
    device: str = "cpu"
    started: float = 0.0

    def release_model(self) -> None:
        """Let go of the reference model (an engine is about to load its own copy of the weights)."""
        if self.model is not None:
            self.model = None
            gc.collect()


@dataclass
class RowFile:
    """One row's weights as an engine loads them. ``spec``: None for the reference or a saved checkpoint;
    ``path``: the file or directory written in the engine's format (the reference's own directory where its
    weights are the row's); ``facts``: the ``Row`` fields writing it settled (``bits_per_weight``,
    ``size_bytes``, ``matrices``, and where known ``method_record``, ``plan``, ``build_seconds``);
    ``simulation_options``: what the row's simulations are built with; ``read``: how the torch engine reads
    the file's tensors (None: a qkit checkpoint, ``iter_quantized``; a given GGUF file's reader otherwise)."""

    spec: RowSpec | None
    path: Path
    facts: dict[str, Any]
    simulation_options: dict[str, Any] = field(default_factory=dict)
    read: Callable[[], Iterator[tuple[str, QuantizedTensor | torch.Tensor]]] | None = None

    def tensors(self) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
        """The file's tensors by the reference's names, one at a time: quantized ones as ``QuantizedTensor``
        (a qkit checkpoint) or already dense (a GGUF file), the others as stored."""
        return self.read() if self.read is not None else iter_quantized(self.path)

    @property
    def simulations(self) -> tuple[str, ...]:
        return self.spec.simulation if self.spec is not None else ()


@dataclass
class Measured:
    """What an engine measured for one row: ``scores`` on the reference's positions, the battery's decoded
    ``outputs``, ``agree`` (bool ``[B, n]``: the row's argmax equals the reference's greedy token), ``full``
    (the full distribution was given: KL is computable), and ``facts``: the ``Row`` fields only this engine
    knows (torch: the simulated bits, the hooks' statistics, the weights changed; a worker: its record)."""

    scores: TokenScores
    outputs: list[str]
    agree: torch.Tensor
    full: bool = True
    facts: dict[str, Any] = field(default_factory=dict)


def assemble_row(name: str, measured: Measured, battery: list[Question], against: Reference | None, seconds: float,
                 **facts) -> Row:
    """One table row from its measurements (every engine's alike). ``against`` None: the reference itself
    (no change, McNemar against nothing). ``facts``: the row's other ``Row`` fields."""
    scores, agree = measured.scores, measured.agree
    answers = [is_correct(o, q.answers) for o, q in zip(measured.outputs, battery)]
    k, n = int(agree.sum()), int(agree.numel())
    if against is None:
        change, change_se, (only_ref, only_row, p) = 0.0, 0.0, (0, 0, 1.0)
    else:
        change, change_se = scores.change_against(against.ref_scores)
        only_ref, only_row, p = mcnemar_exact(against.ref_row.battery_answers, answers)
    return Row(
        scheme=name,
        perplexity=scores.perplexity, perplexity_se=scores.perplexity_se,
        perplexity_change_pct=change, perplexity_change_se_pct=change_se,
        kld=scores.kld, kld_se=scores.kld_se, top1_match=scores.top1_match,
        battery_correct=sum(answers), battery_total=len(answers), battery_ci95=wilson_interval(sum(answers), len(answers)),
        battery_answers=answers, battery_outputs=measured.outputs,
        mcnemar_only_reference=only_ref, mcnemar_only_row=only_row, mcnemar_p=p,
        agreement=k, agreement_total=n, agreement_ci95=wilson_interval(k, n),
        seconds=seconds, domains=domain_rows(scores, against.ref_scores if against is not None else None), **facts,
    )


def refused_row(name: str, reason: str, seconds: float = 0.0, **facts) -> Row:
    """A row the engine could not run: its reason, and no numbers (NaN, ``null`` in JSON)."""
    nan = math.nan
    return Row(scheme=name, bits_per_weight=nan, size_bytes=0, perplexity=nan, perplexity_se=nan,
               perplexity_change_pct=nan, perplexity_change_se_pct=nan, kld=nan, kld_se=nan, top1_match=nan,
               battery_correct=0, battery_total=0, battery_ci95=(nan, nan), battery_answers=[], battery_outputs=[],
               mcnemar_only_reference=0, mcnemar_only_row=0, mcnemar_p=nan, agreement=0, agreement_total=0,
               agreement_ci95=(nan, nan), seconds=seconds, matrices=0, refused=reason, **facts)


__all__ = ["REFERENCE", "Measured", "Reference", "RowFile", "assemble_row", "refused_row"]
