"""Calibration tokens for calibrated methods (GPTQ, AWQ, SmoothQuant): pinned, disjoint from the eval text.

Layer 5 (``methods``). The texts themselves, pinned and checked for overlap with the eval text, are
data below every layer that uses them: ``qkit.texts`` (the default is KJV Genesis+Exodus; Ruth, the
evaluation text, is never in it, and ``texts.check_disjoint`` refuses any calibration text that shares
a run of ``texts.SHINGLE_WORDS`` words with it). This module chooses the tokens.

Sampling. The text is tokenized once (no special tokens), cut into ``floor(tokens / seqlen)``
non-overlapping windows of ``seqlen`` tokens, and ``samples`` of them are chosen by a ``torch.randperm``
seeded with ``seed`` (then kept in text order), so the same options give the same ids everywhere.
A text with fewer than ``samples`` windows is refused with the number that fits.

    calibration_ids(tokenizer, CalibrationOptions()) -> (ids LongTensor [samples, seqlen], provenance dict)
"""

from __future__ import annotations

import hashlib
import os
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.texts import Corpus, check_disjoint, load_calibration_text, load_corpus

# Defaults, defined once (the CLI reads them from here). 32 x 512 tokens is what llm-compressor's GPTQ
# was measured with in issue 9; on the 2-core reference machine it keeps GPTQ on the default model near
# a minute (see the README's "Calibrated methods" section for the measurement).
DEFAULT_SAMPLES = 32
DEFAULT_SEQLEN = 512
DEFAULT_SEED = 0


@dataclass(frozen=True)
class CalibrationOptions:
    """Which calibration tokens: ``source`` None (the pinned default), a UTF-8 file path, or
    ``hf:DATASET[:CONFIG[:SPLIT]]``; ``samples`` windows of ``seqlen`` tokens chosen with ``seed``."""

    source: str | None = None
    samples: int = DEFAULT_SAMPLES
    seqlen: int | None = None  # None: DEFAULT_SEQLEN, or the model's context where that is shorter (fit_seqlen)
    seed: int = DEFAULT_SEED

    @property
    def window(self) -> int:
        """Tokens per window: ``seqlen`` as given or fitted (``fitted``), else ``DEFAULT_SEQLEN``."""
        return DEFAULT_SEQLEN if self.seqlen is None else self.seqlen

    def fitted(self, config: Any) -> CalibrationOptions:
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


def fit_seqlen(seqlen: int | None, config: Any) -> int:
    """The calibration window for a model: ``seqlen`` as given (``check_fits`` refuses one beyond the
    context), or for None the default, ``DEFAULT_SEQLEN``, shortened to the model's context where that is
    shorter: a default is never a window the model cannot take, and never skips the check."""
    if seqlen is not None:
        return seqlen
    context = model_context(config) if config is not None else None
    return DEFAULT_SEQLEN if context is None else min(DEFAULT_SEQLEN, context)


def _field(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def model_context(config: Any) -> int | None:
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


def check_fits(options: CalibrationOptions, config: Any) -> None:
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


def calibration_ids(tokenizer: Any, options: CalibrationOptions = CalibrationOptions(),
                    evaluation: Corpus | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibration token ids ``LongTensor [samples, seqlen]`` and their provenance.

    ``evaluation``: the text the model will be evaluated on (default: qkit eval's pinned text, Ruth);
    a calibration text that overlaps it is refused. Provenance (for the manifest): ``name``, ``source``,
    ``sha256`` (of the whole text), ``tokens`` (of the whole text), ``samples``, ``seqlen``, ``seed``,
    ``ids_sha256`` (of the chosen ids as little-endian int64 bytes), ``disjoint_from`` (the eval text's
    name and sha256).
    """
    options.check()
    text = load_calibration_text(options.source)
    evaluation = evaluation or load_corpus(None)
    check_disjoint(text, evaluation)
    if tokenizer is None:
        raise InputError("the model has no tokenizer files; calibrated methods need one (tokenizer.json or similar)")
    ids = torch.tensor(tokenizer(text.text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    chosen = sample_windows(ids, options.samples, options.window, options.seed, f"calibration text {text.name}")
    provenance = {
        "name": text.name,
        "source": text.source,
        "sha256": text.sha256,
        "tokens": int(ids.numel()),
        "samples": options.samples,
        "seqlen": options.window,
        "seed": options.seed,
        "ids_sha256": hashlib.sha256(chosen.numpy().astype("<i8").tobytes()).hexdigest(),
        "disjoint_from": {"name": evaluation.name, "sha256": evaluation.sha256},
    }
    return chosen, provenance


__all__ = [
    "DEFAULT_SAMPLES",
    "DEFAULT_SEED",
    "DEFAULT_SEQLEN",
    "CalibrationOptions",
    "calibration_ids",
    "check_fits",
    "fit_seqlen",
    "model_context",
    "sample_windows",
]
