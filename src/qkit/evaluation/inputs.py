"""What ``qkit eval`` reads before the reference model loads: the models, the corpus, the calibration sets,
the tokenizer, the battery prompts, each checked on the way.

Layer 6 (``evaluation``), above ``checks`` (the refusals it calls) and ``windows`` (the window and
token counts). Every refusal here costs milliseconds, not a model load; what it read (corpus, tokenizer,
token ids, battery prompts) is what the eval then uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from qkit.checkpoint import tensor_shapes
from qkit.errors import InputError
from qkit.evaluation.battery import Question, build_prompts, load_battery
from qkit.evaluation.checks import check_checkpoint_matches, read_config
from qkit.evaluation.engines import Engine, EngineOptions, check_engine_lengths
from qkit.evaluation.file_rows import check_file_matches
from qkit.evaluation.windows import choose_window, scored_ids
from qkit.evaluation.specs import RowSpec
from qkit.methods import get_method, make_options
from qkit.methods.calibration import CalibrationOptions, check_calibrations
from qkit.methods.experts import check_method
from qkit.models import ModelRef, check_complete, load_tokenizer
from qkit.plan import check_plan_matches, read_plan
from qkit.catalog import CalibrationSet, checked_calibration, eval_texts, suite_corpus
from qkit.texts import Corpus

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Models:
    """What MODEL names: the reference, and a saved qkit checkpoint of it (None: rows are built from specs)."""

    ref: ModelRef
    checkpoint: ModelRef | None = None


def pair_models(target: ModelRef, reference: ModelRef | None, given: str | None) -> Models:
    """MODEL resolved (``target``), and ``--reference`` (``given``) resolved when MODEL is a saved qkit
    checkpoint (``reference``; None otherwise): refused where the pair makes no sense."""
    if not target.is_quantized:
        if given is not None:
            raise InputError("--reference is only for evaluating a saved qkit checkpoint; drop it or pass a checkpoint as MODEL")
        return Models(target)
    if reference.is_quantized:
        raise InputError(f"--reference {reference.spec} is itself a qkit checkpoint; pass the original model it was made from")
    return Models(reference, target)


@dataclass(frozen=True)
class InputSettings:
    """What reading and checking the inputs reads of eval's options: the corpus (None: the pinned text),
    the tokens scored, the window (None: the model's default), the calibrations the rows read
    (``specs.check_rows``), and the engines' settings with the battery's and agreement's new tokens
    (their ``--max-model-len``)."""

    corpus: str | None
    tokens: int
    window: int | None
    calibrations: tuple[CalibrationOptions, ...]
    engine: EngineOptions
    battery_tokens: int
    agree_tokens: int


@dataclass
class Inputs:
    """Everything read and checked before the reference model loads: the corpus and its token ids (int64
    ``[tokens]``), the reference's config (None: transformers cannot read it; ``load`` says why), the
    window (None until the config is known), the tokenizer, the calibration texts' provenance, the
    battery's questions and their prompts (agreement's prompts too), and the settings they were read with.
    An eval suite (the default): ``texts`` its domains, ``corpus`` their summary (``catalog.suite_corpus``),
    ``ids`` the domains' tokens one after another and ``segments`` each one's ``(name, tokens)``
    (``windows.scored_ids``)."""

    corpus: Corpus
    config: PretrainedConfig | None
    window: int | None
    tokenizer: PreTrainedTokenizerBase
    ids: torch.Tensor
    calibrations: list[dict]
    questions: list[Question]
    prompts: list[str]
    settings: InputSettings
    texts: list[Corpus] = field(default_factory=list)
    segments: tuple[tuple[str, int], ...] = ()


def check_inputs(models: Models, specs: list[RowSpec], engines: list[Engine], settings: InputSettings) -> Inputs:
    """Read and check every input before anything heavy: the corpus and each calibration set the rows read
    (``catalog.checked_calibration``: read once, checked disjoint from the corpus), every tensor the
    reference's (and a checkpoint's) config implies, a checkpoint's tensors against the reference's, shape for
    shape, a plan file against the reference's shapes, a file row's GGUF against the reference's architecture,
    tensor names and shapes, the tokenizer, the window against the model's context, enough corpus tokens and calibration
    tokens (``calibration.check_calibrations``), the engines' ``--max-model-len`` against the window and the
    battery prompts."""
    ref, checkpoint = models.ref, models.checkpoint
    texts = eval_texts(settings.corpus)  # the default suite's domains, or the one --corpus
    corpus = suite_corpus(texts)
    # each calibration set the rows read, once: read and checked disjoint from those texts by the catalog
    sets: dict[str | None, CalibrationSet] = {}
    for o in settings.calibrations:
        if o.source not in sets:
            sets[o.source] = checked_calibration(o.source, texts)
    config = read_config(ref)  # None: transformers cannot read it; ``load`` says why in one line
    check_complete(ref)  # the reference too, before the status line of the load (load() reuses the build)
    if checkpoint is not None:  # headers only (and a meta-device build of the config): before anything heavy
        check_complete(checkpoint)  # every tensor its config implies (load() checks the reference's)
        check_checkpoint_matches(checkpoint, ref, config)  # ... and exactly the reference's, shape for shape
    for spec in specs:  # a plan file made for another model: refused from the headers
        if spec.plan is not None and spec.plan.endswith(".json"):
            check_plan_matches(read_plan(spec.plan), dict(tensor_shapes(ref.directory)), ref.spec)
    check_file_matches(specs, ref)  # a GGUF file of another model: refused from its header
    for spec in specs if config is not None else ():  # each row's method against the model, as quantize checks it:
        if (method := get_method(spec.method)) is not None:  # on a MoE model, only gptq and imatrix route to experts
            check_method(config.to_dict(), spec.method, make_options(method, dict(spec.method_options)))
    # The tokenizer first (milliseconds; load() reads it again): the corpus and calibration checks need no model.
    tok = load_tokenizer(ref.directory)
    if tok is None:
        raise InputError(f"{ref.spec} has no tokenizer files; eval needs one (tokenizer.json or similar)")
    window = choose_window(settings.window, settings.tokens, config) if config is not None else None
    ids, segments = scored_ids(tok, texts, settings.tokens, window)
    provenances = check_calibrations(tok, settings.calibrations, sets, config)
    questions = load_battery()
    prompts = build_prompts(tok, [q.question for q in questions])  # agreement's prompts too
    if window is not None:  # the engines' context: the window, the longest prompt and its new tokens
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        check_engine_lengths(engines, settings.engine, min(window, int(ids.numel())), lengths, settings.battery_tokens,
                             settings.agree_tokens)
    return Inputs(corpus, config, window, tok, ids, provenances, questions, prompts, settings, texts, segments)


__all__ = ["InputSettings", "Inputs", "Models", "check_inputs", "pair_models"]
