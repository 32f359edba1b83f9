"""Calibration tokens for calibrated methods (GPTQ, AWQ, SmoothQuant): pinned, disjoint from the eval texts.

Layer 5 (``methods``). The texts themselves, pinned and checked for overlap with the eval texts, are
data below every layer that uses them: ``qkit.catalog`` (the default is ``DEFAULT_MIX``, ten registered
corpora of seven domains; ``catalog.checked_calibration`` refuses any part that shares a run of
``texts.SHINGLE_WORDS`` words with an eval text, and returns the set once checked). This module chooses the
tokens: what a model is given of a text (``model_text``: dialogue in its chat template) and its token ids
(``text_ids``, which the eval's scored windows read too), and the windows sampled from them.

Sampling. Each part of the calibration set is given to the model as it would be (``model_text``), tokenized
once (no special tokens: ``text_ids``) and cut into ``floor(tokens / seqlen)``
non-overlapping windows of ``seqlen`` tokens. The ``samples`` windows are shared out among the parts by
their weights, largest remainder first (``allocate``; a part without a weight, such as one of several
files, weighs the windows it holds), and each part's are chosen by a ``torch.randperm`` of its windows
from one generator seeded with ``seed``, drawn part by part (then kept in text order; the parts in
order), so the same options give the same ids everywhere. A single text is one part: the windows are
``torch.randperm(fits)[:samples]``, as they always were. A part with fewer windows than its share is
refused with the number of samples that fits.

    calibration_ids(tokenizer, CalibrationOptions()) -> (ids LongTensor [samples, seqlen], provenance dict)
"""

from __future__ import annotations

import hashlib
import os
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.catalog import CalibrationSet, checked_calibration
from qkit.errors import InputError
from qkit.texts import Corpus, joined_sources, split_sources

if TYPE_CHECKING:  # annotations only: transformers is imported where a model or its tokenizer is read
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    ModelConfig = PretrainedConfig | Mapping[str, object]  # a transformers config, or its dict

# Defaults, defined once (the CLI reads them from here). 32 x 512 tokens is what llm-compressor's GPTQ
# was measured with in issue 9; on the 2-core reference machine it keeps GPTQ on the default model near
# a minute (docs/calibrated-methods.md has the measurement).
DEFAULT_SAMPLES = 32
DEFAULT_SEQLEN = 512
DEFAULT_SEED = 0


@dataclass(frozen=True)
class CalibrationOptions:
    """Which calibration tokens: ``source`` None (the default mix, ``catalog.DEFAULT_MIX``), a UTF-8 file, a
    directory or several files (comma-separated, or the values of a repeated ``--calibration``), ``kjv:``
    or ``hf:DATASET[:CONFIG[:SPLIT]]`` (``catalog.calibration_set``); ``samples`` windows of ``seqlen``
    tokens chosen with ``seed``. Checked when made (``check``): a value of this class is never malformed."""

    source: str | None = None
    samples: int = DEFAULT_SAMPLES
    seqlen: int | None = None  # None: DEFAULT_SEQLEN, or the model's context where that is shorter (fit_seqlen)
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        # a repeated --calibration's list of values, as one hashable value (texts.joined_sources)
        object.__setattr__(self, "source", joined_sources(self.source))
        self.check()

    @property
    def window(self) -> int:
        """Tokens per window: ``seqlen`` as given or fitted (``fitted``), else ``DEFAULT_SEQLEN``."""
        return DEFAULT_SEQLEN if self.seqlen is None else self.seqlen

    def fitted(self, config: ModelConfig | None) -> CalibrationOptions:
        """These options with the default window fitted to the model (``fit_seqlen``); a given one is kept."""
        return dataclasses.replace(self, seqlen=fit_seqlen(self.seqlen, config))

    def check(self) -> None:
        """Refuse malformed numbers in one line (before any model is loaded)."""
        if not isinstance(self.samples, int) or self.samples < 1:
            raise InputError(f"--calibration-samples must be a positive integer, got {self.samples!r}")
        if self.seqlen is not None and (not isinstance(self.seqlen, int) or self.seqlen < 2):
            raise InputError(f"--calibration-seqlen must be an integer of at least 2 tokens, got {self.seqlen!r}")
        whole(self.samples, "--calibration-samples", 1, MAX_COUNT)  # the upper bounds (a 309-digit count overflowed a float)
        whole(self.window, "--calibration-seqlen", 2, MAX_COUNT)
        if self.source is not None:  # an empty value or entry ("a,,b": an empty shell variable) named now
            split_sources(joined_sources(self.source))


def fit_seqlen(seqlen: int | None, config: ModelConfig | None) -> int:
    """The calibration window for a model: ``seqlen`` as given (``check_fits`` refuses one beyond the
    context), or for None the default, ``DEFAULT_SEQLEN``, shortened to the model's context where that is
    shorter: a default is never a window the model cannot take, and never skips the check."""
    if seqlen is not None:
        return seqlen
    context = model_context(config) if config is not None else None
    return DEFAULT_SEQLEN if context is None else min(DEFAULT_SEQLEN, context)


def _field(config: ModelConfig, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def model_context(config: ModelConfig) -> int | None:
    """The model's maximum context in tokens from its config (a dict or a transformers config), or None."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = _field(config, key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    text = _field(config, "text_config")  # multimodal configs nest the language model's
    return model_context(text) if text is not None else None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(options: CalibrationOptions, config: ModelConfig | None) -> None:
    """Refuse (one line, before any work) calibration numbers the model or the machine cannot take: windows
    longer than the model's context (positions it was never trained on; rotary tables end there), and
    more calibration activations than this machine has memory for. A layer-by-layer method keeps every
    window's hidden states in float32, a block's inputs and outputs at once: ``2 x samples x seqlen x
    hidden x 4`` bytes."""
    if config is None:
        return
    context = model_context(config)
    seqlen = fit_seqlen(options.seqlen, config)  # the default fitted to the context, then checked like a given one
    if context is not None and seqlen > context:
        raise InputError(f"--calibration-seqlen {seqlen} exceeds the model's maximum context {context}; "
                         f"pass --calibration-seqlen {context} or less")
    hidden = _field(config, "hidden_size")
    if hidden is None and _field(config, "text_config") is not None:
        hidden = _field(_field(config, "text_config"), "hidden_size")
    memory = _memory_bytes()
    if isinstance(hidden, int) and hidden > 0 and memory:
        need = 2 * options.samples * seqlen * hidden * 4
        if need > memory:
            fits = max(1, memory // (2 * seqlen * hidden * 4))
            raise InputError(
                f"--calibration-samples {options.samples} x --calibration-seqlen {seqlen} needs about "
                f"{need / 2**30:,.1f} GiB of calibration activations (hidden size {hidden}), more than this machine's "
                f"{memory / 2**30:,.1f} GiB of memory; pass --calibration-samples {fits} or less, or a smaller --calibration-seqlen"
            )


def sample_windows(ids: torch.Tensor, samples: int, seqlen: int, seed: int, name: str = "calibration text") -> torch.Tensor:
    """1-D token ids -> ``[samples, seqlen]``: ``samples`` of the ``floor(n / seqlen)`` non-overlapping
    windows, chosen by ``torch.randperm(n_windows, generator=seeded(seed))`` and kept in text order."""
    n = int(ids.numel())
    fits = n // seqlen
    if fits == 0:
        raise InputError(
            f"{name} has {n} tokens, shorter than one sample of {seqlen}; pass a longer text or a smaller --calibration-seqlen"
        )
    if fits < samples:
        raise InputError(
            f"{name} has {n} tokens: {fits} samples of {seqlen} fit, {samples} asked; pass --calibration-samples {fits} "
            "or less, a smaller --calibration-seqlen, or a longer text"
        )
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(fits, generator=g)[:samples].sort().values
    return ids[: fits * seqlen].view(fits, seqlen)[chosen].clone()


def allocate(samples: int, weights: list[int]) -> list[int]:
    """``samples`` shared out in proportion to ``weights`` (largest remainder; ties to the earlier part):
    ``sum == samples``, each share ``floor`` or ``ceil`` of ``samples * w / sum(weights)``."""
    total = sum(weights)
    exact = [samples * w / total for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: samples - sum(shares)]:
        shares[i] += 1
    return shares


def sample_parts(parts: list[torch.Tensor], weights: list[int | None], samples: int, seqlen: int, seed: int,
                 names: list[str], flags: tuple[str, str] = ("--calibration-samples", "--calibration-seqlen"),
                 ) -> tuple[torch.Tensor, list[int]]:
    """``samples`` windows of ``seqlen`` tokens from several parts (1-D token ids each): ``[samples, seqlen]``
    and each part's share. Weights None: each part weighs the windows it holds (as if the parts were one
    text). One generator seeded with ``seed`` draws each part's ``randperm`` in turn. ``flags``: the options
    a refusal names (imatrix's are ``--chunks`` and ``--chunk-size``)."""
    fits = [int(ids.numel()) // seqlen for ids in parts]
    if len(parts) == 1:
        return sample_windows(parts[0], samples, seqlen, seed, names[0]), [samples]
    if sum(fits) < samples:
        raise InputError(f"the calibration texts ({', '.join(names)}) hold {sum(fits)} windows of {seqlen} tokens, "
                         f"{samples} asked; pass {flags[0]} {sum(fits)} or less, or a smaller {flags[1]}")
    shares = allocate(samples, [f if w is None else w for f, w in zip(fits, weights)])
    short = [(n, f, s) for n, f, s in zip(names, fits, shares) if s > f]
    if short:
        name, fit, share = short[0]
        most = min(f * samples // s for _, f, s in short)  # the largest count whose shares all fit, about
        raise InputError(f"calibration part {name} holds {fit} windows of {seqlen} tokens, {share} of the {samples} "
                         f"samples asked are its share; pass {flags[0]} {most} or less, or a smaller {flags[1]}")
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for ids, fit, share in zip(parts, fits, shares):
        pick = torch.randperm(fit, generator=g)[:share].sort().values
        chosen.append(ids[: fit * seqlen].view(fit, seqlen)[pick])
    return torch.cat(chosen).clone(), shares


def model_text(corpus: Corpus, tokenizer: PreTrainedTokenizerBase) -> str:
    """What a model is given of ``corpus``: its conversations in the tokenizer's chat template (turns
    alternating user and assistant, no generation prompt), where it has both; else its plain text."""
    if not corpus.conversations or not getattr(tokenizer, "chat_template", None):
        return corpus.text
    roles = ("user", "assistant")
    return "".join(tokenizer.apply_chat_template([{"role": roles[i % 2], "content": t} for i, t in enumerate(conv)],
                                                 tokenize=False) for conv in corpus.conversations)


_TOKENIZED: dict[tuple, torch.Tensor] = {}  # the last few texts tokenized: the default mix is ~1M tokens
_TOKENIZED_KEPT = 32


def text_ids(tokenizer: PreTrainedTokenizerBase, corpus: Corpus) -> torch.Tensor:
    """``corpus`` as the model is given it (``model_text``), tokenized without special tokens: 1-D int64 (a
    calibration part, an eval text). Kept for the process by tokenizer (class, path, size, chat template) and
    text (sha256): the default mix takes seconds to tokenize, and a plan, an eval or a test suite asks for it
    more than once."""
    path = getattr(tokenizer, "name_or_path", None)
    key = (type(tokenizer).__name__, str(path), getattr(tokenizer, "vocab_size", None),
           str(getattr(tokenizer, "chat_template", None)), corpus.sha256, bool(corpus.conversations))
    if path and key in _TOKENIZED:
        return _TOKENIZED[key]
    ids = torch.tensor(tokenizer(model_text(corpus, tokenizer), add_special_tokens=False)["input_ids"], dtype=torch.long)
    if path:  # a tokenizer read from files (a stand-in is not kept)
        while len(_TOKENIZED) >= _TOKENIZED_KEPT:
            del _TOKENIZED[next(iter(_TOKENIZED))]
        _TOKENIZED[key] = ids
    return ids


def part_ids(tokenizer: PreTrainedTokenizerBase, calibration: CalibrationSet) -> list[torch.Tensor]:
    """Each part's tokens as the model is given it (``text_ids``): 1-D int64."""
    return [text_ids(tokenizer, p.corpus) for p in calibration.parts]


def set_provenance(calibration: CalibrationSet, ids: list[torch.Tensor], shares: list[int]) -> dict:
    """The set's name, source, sha256 and tokens, each part's (name, domain, sha256, tokens, windows chosen)
    where there are several, and the eval texts it was checked against (``CalibrationSet.disjoint_from``)."""
    out = {"name": calibration.name, "source": calibration.source, "sha256": calibration.sha256,
           "tokens": int(sum(int(t.numel()) for t in ids)), "disjoint_from": calibration.disjoint_from}
    if len(calibration.parts) > 1:
        out["parts"] = [{"name": p.corpus.name, "domain": p.corpus.domain, "sha256": p.corpus.sha256,
                         "tokens": int(t.numel()), "windows": k} for p, t, k in zip(calibration.parts, ids, shares)]
    return out


def calibration_ids(tokenizer: PreTrainedTokenizerBase | None, options: CalibrationOptions = CalibrationOptions(),
                    evaluation: Corpus | list[Corpus] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibration token ids ``LongTensor [samples, seqlen]`` and their provenance: the set
    ``options.source`` names, read and checked disjoint from ``evaluation`` (the text(s) the model will be
    evaluated on; default: every domain of qkit eval's suite) in one place, the catalog
    (``catalog.checked_calibration``), then sampled (``sample_calibration``)."""
    return sample_calibration(tokenizer, checked_calibration(options.source, evaluation), options)


def sample_calibration(tokenizer: PreTrainedTokenizerBase | None, calibration: CalibrationSet,
                       options: CalibrationOptions) -> tuple[torch.Tensor, dict[str, Any]]:
    """``options.samples`` windows of ``options.window`` tokens from a checked set (``catalog.checked_calibration``),
    ``LongTensor [samples, seqlen]``, and their provenance (for the manifest): ``name``, ``source``, ``sha256``
    (of the whole text; of the parts' for a mix), ``tokens`` (of the whole text), ``parts`` (a mix's),
    ``samples``, ``seqlen``, ``seed``, ``ids_sha256`` (of the chosen ids as little-endian int64 bytes),
    ``disjoint_from`` (the eval texts' names and sha256)."""
    if tokenizer is None:
        raise InputError("the model has no tokenizer files; calibrated methods need one (tokenizer.json or similar)")
    ids = part_ids(tokenizer, calibration)
    names = [f"calibration text {p.corpus.name}" if len(ids) == 1 else p.corpus.name for p in calibration.parts]
    chosen, shares = sample_parts(ids, [p.weight for p in calibration.parts], options.samples, options.window,
                                  options.seed, names)
    provenance = {**set_provenance(calibration, ids, shares), "samples": options.samples,
                  "seqlen": options.window, "seed": options.seed,
                  "ids_sha256": hashlib.sha256(chosen.numpy().astype("<i8").tobytes()).hexdigest()}
    return chosen, provenance


def check_calibrations(tokenizer: PreTrainedTokenizerBase, options: Sequence[CalibrationOptions],
                       sets: Mapping[str | None, CalibrationSet], config: ModelConfig | None = None) -> list[dict[str, Any]]:
    """Each calibration of ``options`` with its default window fitted to the model (``config``), refused where
    its windows do not fit the model or the machine (``check_fits``), then sampled (``sample_calibration``)
    from its set (``sets[source]``, read and checked disjoint from the eval texts by
    ``catalog.checked_calibration``), so a too short text is refused in one line before any model is loaded.
    Returns each distinct one's provenance, in order (a row reads and samples it again when it is built:
    milliseconds next to a row)."""
    seen: dict[CalibrationOptions, dict[str, Any]] = {}
    for fitted in (o.fitted(config) for o in options):
        if fitted not in seen:
            check_fits(fitted, config)
            seen[fitted] = sample_calibration(tokenizer, sets[fitted.source], fitted)[1]
    return list(seen.values())


__all__ = [
    "DEFAULT_SAMPLES",
    "DEFAULT_SEED",
    "DEFAULT_SEQLEN",
    "CalibrationOptions",
    "allocate",
    "calibration_ids",
    "check_calibrations",
    "check_fits",
    "fit_seqlen",
    "model_context",
    "model_text",
    "part_ids",
    "sample_calibration",
    "sample_parts",
    "sample_windows",
    "set_provenance",
    "text_ids",
]
