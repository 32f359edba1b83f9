"""The corpus in windows: the positions a number of tokens scores, the window chosen, the counts refused.

Layer 6 (``evaluation``), below ``options`` (``check_scored``: ``--tokens`` against ``--window`` before
anything is resolved), ``inputs`` (``choose_window`` against the model's context, ``scored_ids``: the corpus's
tokens, each text's checked by ``check_corpus_tokens``) and ``perplexity`` (``split_windows``, the windows
``CorpusReference`` scores).

The corpus's first ``tokens`` tokens are cut into non-overlapping windows of ``window`` tokens; within each
window, position ``t`` (1..w-1) is predicted from positions ``< t``, so ``tokens - n_windows`` positions are
scored (the first token of each window has no context and is not scored; a last window of one token is
dropped): ``scored_positions(tokens, window)``. A standard error needs at least ``MIN_SCORED`` = 2 scored
positions; fewer is refused before the model is loaded (``check_scored``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qkit.bounds import MAX_COUNT, whole
from qkit.catalog import suite_name
from qkit.errors import InputError
from qkit.evaluation.token_scores import MIN_SCORED
from qkit.methods.calibration import text_ids
from qkit.texts import Corpus

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedTokenizerBase


def scored_positions(tokens: int, window: int) -> int:
    """Positions scored from ``tokens`` tokens in non-overlapping windows of ``window`` (``split_windows``):
    each full window scores ``window - 1``; a last shorter window of ``r >= 2`` tokens scores ``r - 1``."""
    full, rest = divmod(tokens, window)
    return full * (window - 1) + max(0, rest - 1)


def min_tokens(window: int | None) -> int:
    """The fewest tokens that score ``MIN_SCORED`` positions: 3 in one window of 3 or more, else two windows
    of 2 (``window`` 2). ``None`` (window not known yet: any default window is at least 3) gives 3."""
    return 2 * MIN_SCORED if window == 2 else MIN_SCORED + 1


def check_scored(tokens: int, window: int | None) -> None:
    """Refuse, in one line and before any model work, a ``window`` under 2 tokens and ``tokens`` too few for a
    standard error with it, and either beyond ``bounds.MAX_COUNT``."""
    least = min_tokens(window)
    if window is not None and window < 2:
        raise InputError(f"--window must be at least 2, got {window}")
    if tokens < least:
        scored = f"{scored_positions(tokens, window)} position(s)" if window else f"at most {max(0, tokens - 1)} position(s)"
        raise InputError(
            f"--tokens must be at least {least}" + (f" with --window {window}" if window else "")
            + f", got {tokens}: that scores {scored} (the first token of each window has no context), and a "
            f"standard error needs {MIN_SCORED}; pass --tokens {least} or more"
        )
    if window is not None:
        whole(window, "--window", 2, MAX_COUNT)  # the upper bounds, named
    whole(tokens, "--tokens", least, MAX_COUNT)


def choose_window(window: int | None, tokens: int, config) -> int:
    """The window (``--window`` or min(2048, the model's context)), checked against the context and the tokens."""
    max_ctx = int(getattr(config, "max_position_embeddings", 2048) or 2048)
    window = window or min(2048, max_ctx)
    if window > max_ctx:
        raise InputError(f"--window {window} exceeds the model's maximum context {max_ctx}; pass --window {max_ctx} or less")
    check_scored(tokens, window)
    return window


def check_corpus_tokens(corpus, n: int, window: int) -> None:
    """A corpus shorter than ``--tokens`` must still score ``MIN_SCORED`` positions."""
    scored = scored_positions(n, window)
    if scored < MIN_SCORED:
        raise InputError(
            f"the corpus {corpus.name} has only {n} token(s), which score {scored} position(s) in windows of {window} "
            f"(the first token of each window has no context); a standard error needs {MIN_SCORED}: pass a longer --corpus"
        )


def split_windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Non-overlapping windows of ``window`` tokens; a last shorter window is kept if it has >= 2 tokens."""
    if window < 2:
        raise InputError(f"--window must be at least 2 tokens, got {window}")
    chunks = [ids[i : i + window] for i in range(0, ids.numel(), window)]
    return [c for c in chunks if c.numel() >= 2]


def scored_ids(tok: PreTrainedTokenizerBase, texts: list[Corpus], tokens: int,
               window: int | None) -> tuple[torch.Tensor, tuple[tuple[str, int], ...]]:
    """The scored token ids, int64 ``[n]``: one text's first ``tokens`` as the model is given it
    (``methods.calibration.text_ids``: tokenized by ``tok`` without special tokens); a suite's first ``tokens // len(texts)``
    of each domain, one after another, with each domain's ``(name, tokens)`` (windows never cross a domain;
    ``()`` for one text). With the ``window`` known, a text too short to score a standard error in it is
    refused, naming it."""
    per = tokens // len(texts)
    ids = [text_ids(tok, t)[:per] for t in texts]
    if window is not None:
        for t, i in zip(texts, ids):
            if len(texts) > 1 and int(i.numel()) < 3:
                raise InputError(f"--tokens {tokens} gives {per} token(s) to each of the {len(texts)} domains of "
                                 f"{suite_name(texts)}, too few for a standard error; pass --tokens {3 * len(texts)} or more")
            check_corpus_tokens(t, int(i.numel()), window)
    segments = tuple((t.name, int(i.numel())) for t, i in zip(texts, ids)) if len(texts) > 1 else ()
    return torch.cat(ids), segments


__all__ = ["check_corpus_tokens", "check_scored", "choose_window", "min_tokens", "scored_ids", "scored_positions",
           "split_windows"]
