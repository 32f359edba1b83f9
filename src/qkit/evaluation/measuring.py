"""What measuring a row passes around, in every engine alike.

Layer 6 (``evaluation``), below the engines and the runner: ``Reference`` (what every row is compared
with, computed once by the torch engine on the reference model), ``RowFile`` (a row's weights as an engine
loads them, and what writing them settled), ``Measured`` (what an engine measured for one row), and the
table ``Row`` assembled from them by the registered measures (``assemble_row``; ``refused_row`` for a row an
engine could not run).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkit.checkpoint import iter_quantized
from qkit.evaluation.agreement import ReferenceContinuation
from qkit.evaluation.battery import Question
from qkit.evaluation.domains import domain_rows
from qkit.evaluation.measures import Evidence, blank_values, measure_values
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.token_scores import TokenScores
from qkit.evaluation.report import Row
from qkit.evaluation.specs import RowSpec
from qkit.models import ModelRef
from qkit.schemes import QuantizedTensor
from qkit.texts import Corpus

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedTokenizerBase

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
    tokenizer: PreTrainedTokenizerBase
    corpus: CorpusReference
    ref_scores: TokenScores
    ref_row: Row
    battery: list[Question]
    prompts: list[str]
    continuation: ReferenceContinuation
    repetition_penalty: float
    battery_tokens: int
    text: list[Corpus] | None = None
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
    """One table row from its measurements (every engine's alike): every registered measure computed from
    them (``evaluation.measures``), over all positions and per domain of an eval suite. ``against`` None: the
    reference itself (no change, McNemar against nothing). ``facts``: the row's other ``Row`` fields."""
    ref_scores = against.ref_scores if against is not None else None
    evidence = Evidence(measured.scores, ref_scores, measured.outputs, battery,
                        against.ref_row.battery_answers if against is not None else None, measured.agree)
    return Row.build(scheme=name, **measure_values(evidence), seconds=seconds,
                     domains=domain_rows(measured.scores, ref_scores), **facts)


def refused_row(name: str, reason: str, seconds: float = 0.0, **facts) -> Row:
    """A row the engine could not run: its reason, and no numbers (NaN, ``null`` in JSON)."""
    return Row.build(scheme=name, bits_per_weight=math.nan, size_bytes=0, **blank_values(), seconds=seconds, matrices=0,
                     refused=reason, **facts)


__all__ = ["REFERENCE", "Measured", "Reference", "RowFile", "assemble_row", "refused_row"]
