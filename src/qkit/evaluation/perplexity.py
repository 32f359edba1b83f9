"""Perplexity, KL divergence and top-1 agreement over the same corpus tokens.

The corpus's first ``tokens`` tokens are cut into non-overlapping windows of ``window`` tokens; within
each window, position ``t`` (1..w-1) is predicted from positions ``< t``, so ``tokens - n_windows``
positions are scored (the first token of each window has no context and is not scored; a last window
of one token is dropped): ``scored_positions(tokens, window)``. A standard error needs at least
``MIN_SCORED`` = 2 scored positions; fewer is refused before the model is loaded (``check_scored``).

For a model with log-probabilities ``log q`` and the reference's ``log p`` at each scored position::

    nll_t  = -log q(x_t)
    ppl    = exp(mean nll),   SE(ppl) = ppl * SE(mean nll)          (delta method, as mlx-lm reports it)
    KL_t   = sum_v p(v) (log p(v) - log q(v))                       (nats, reference || model)
    top1_t = [argmax p == argmax q]

The reference's log-probabilities (and, when they fit ``PROBS_CACHE_BYTES``, their exponentials ``p``)
are computed once and reused by every row; each row's KL is computed exactly as the formula above is
written, in float32 over ``KL_CHUNK`` positions at a time (``kl_per_position``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkit.errors import InputError


@dataclass
class TokenScores:
    """Per scored position: ``nll`` float64 [n], ``kl`` float64 [n], ``top1`` bool [n]."""

    nll: torch.Tensor
    kl: torch.Tensor
    top1: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.nll.numel())

    @property
    def perplexity(self) -> float:
        return _exp(self.nll.mean().item())

    @property
    def perplexity_se(self) -> float:
        return self.perplexity * _se(self.nll)

    @property
    def kld(self) -> float:
        return self.kl.mean().item()

    @property
    def kld_se(self) -> float:
        return _se(self.kl)

    @property
    def top1_match(self) -> float:
        return self.top1.double().mean().item()

    def change_against(self, reference: TokenScores) -> tuple[float, float]:
        """Perplexity change vs ``reference`` in percent, with its paired standard error.

        Both score the same tokens, so the per-token difference ``d = nll - nll_ref`` gives the change
        ``exp(mean d) - 1`` and, by the delta method, SE ``exp(mean d) * SE(mean d)``; far tighter than
        comparing two independent perplexity SEs.
        """
        d = self.nll - reference.nll
        ratio = _exp(d.mean().item())
        return 100 * (ratio - 1), 100 * ratio * _se(d)


    def kl_change_against(self, other: TokenScores) -> tuple[float, float]:
        """Mean KL to the reference minus ``other``'s, with its paired standard error: both rows score the
        same positions against the same reference, so ``d = kl - kl_other`` per position."""
        d = self.kl - other.kl
        return d.mean().item(), _se(d)


def _exp(x: float) -> float:
    # math.exp raises OverflowError past ~709; a collapsed row's mean NLL can get there: its perplexity is inf
    return math.exp(x) if x < 709.0 else math.inf


def _se(x: torch.Tensor) -> float:
    """Standard error of the mean; NaN when it does not exist (fewer than ``MIN_SCORED`` values): every
    reader (``qkit.evaluation.notes.interpret``, the table) says so instead of calling a NaN significant."""
    n = x.numel()
    return x.std(unbiased=True).item() / math.sqrt(n) if n >= MIN_SCORED else float("nan")


MIN_SCORED = 2  # scored positions a standard error needs (the unbiased std divides by n - 1)


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
    """Refuse ``--tokens`` too few for a standard error with this window, in one line, before any model work."""
    least = min_tokens(window)
    if tokens < least:
        scored = f"{scored_positions(tokens, window)} position(s)" if window else f"at most {max(0, tokens - 1)} position(s)"
        raise InputError(
            f"--tokens must be at least {least}" + (f" with --window {window}" if window else "")
            + f", got {tokens}: that scores {scored} (the first token of each window has no context), and a "
            f"standard error needs {MIN_SCORED}; pass --tokens {least} or more"
        )


def split_windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Non-overlapping windows of ``window`` tokens; a last shorter window is kept if it has >= 2 tokens."""
    if window < 2:
        raise InputError(f"--window must be at least 2 tokens, got {window}")
    chunks = [ids[i : i + window] for i in range(0, ids.numel(), window)]
    return [c for c in chunks if c.numel() >= 2]


def position_logprobs(model, window_ids: torch.Tensor) -> torch.Tensor:
    """log-softmax over the vocabulary at each position but the last: float32 ``[w-1, V]``.

    An inference tensor (``torch.inference_mode``): read it anywhere, modify it only in inference mode."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=window_ids[None].to(device), use_cache=False).logits[0, :-1]
        # .float() is no copy for a float32 model; half-precision logits get their log-softmax in float32
        return torch.log_softmax(logits.float(), dim=-1).cpu()


KL_CHUNK = 512  # rows of [chunk, V] temporaries: 100 MB each at V = 49152, whatever the window
PROBS_CACHE_BYTES = 2 << 30  # keep exp(log p) for every row's KL when all windows' [w-1, V] fit in this


def kl_per_position(ref_lp: torch.Tensor, lp: torch.Tensor, ref_probs: torch.Tensor | None = None,
                    chunk: int = KL_CHUNK) -> torch.Tensor:
    """``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))`` per row: float64 ``[n]`` from float32 ``[n, V]``.

    ``ref_lp`` is ``log p`` (the reference), ``lp`` is ``log q``; ``ref_probs``, when given, is
    ``ref_lp.exp()`` computed once (the reference is the same for every row). The values are exactly
    those of ``(ref_lp.exp() * (ref_lp - lp)).sum(-1).double()`` computed ``chunk`` rows at a time: the
    same elementwise float32 operations (multiplication commutes exactly) and the same row sums over
    ``[chunk, V]`` blocks, written into two reused ``[chunk, V]`` buffers instead of three fresh ones per
    chunk (fresh 100 MB blocks cost page faults on every row)."""
    n, v = lp.shape
    out = torch.empty(n, dtype=torch.float64)
    with torch.inference_mode():
        diff = torch.empty((min(chunk, n), v), dtype=lp.dtype)
        prob = torch.empty_like(diff) if ref_probs is None else None
        for s in range(0, n, chunk):
            p_lp, q_lp = ref_lp[s : s + chunk], lp[s : s + chunk]
            m = p_lp.shape[0]
            d = torch.sub(p_lp, q_lp, out=diff[:m])
            d.mul_(ref_probs[s : s + chunk] if ref_probs is not None else torch.exp(p_lp, out=prob[:m]))
            out[s : s + m] = d.sum(-1)
    return out


class CorpusReference:
    """The reference's log-probabilities over the corpus windows, computed once.

    ``ref_logprobs``: float32 ``[w-1, V]`` per window; ``ref_argmax``: int64 ``[w-1]``; ``ref_probs``:
    ``exp`` of each log-probability tensor, kept for every row's KL when all of them fit in
    ``probs_cache_bytes`` (else None: each row recomputes them chunk by chunk, the same values)."""

    def __init__(self, model, ids: torch.Tensor, window: int, probs_cache_bytes: int = PROBS_CACHE_BYTES):
        self.windows = split_windows(ids, window)
        if self.scored_tokens < MIN_SCORED:  # the runner refuses this before loading; a library caller here
            raise InputError(f"the corpus scores {self.scored_tokens} position(s) in windows of {window} tokens; a "
                             f"standard error needs {MIN_SCORED}: pass a longer text")
        self.ref_logprobs = [position_logprobs(model, w) for w in self.windows]
        self.ref_argmax = [lp.argmax(-1) for lp in self.ref_logprobs]
        size = sum(lp.numel() * lp.element_size() for lp in self.ref_logprobs)
        self.ref_probs: list[torch.Tensor] | None = None
        if size <= probs_cache_bytes:
            with torch.inference_mode():
                self.ref_probs = [lp.exp() for lp in self.ref_logprobs]

    @property
    def scored_tokens(self) -> int:
        return sum(w.numel() - 1 for w in self.windows)

    def own_scores(self) -> TokenScores:
        """The reference's own scores, from the stored log-probabilities (no second forward pass)."""
        nll = torch.cat([-lp.gather(1, w[1:, None]).squeeze(1).double() for w, lp in zip(self.windows, self.ref_logprobs)])
        return TokenScores(nll, torch.zeros_like(nll), torch.ones(nll.numel(), dtype=torch.bool))

    def score(self, model, chunk: int = KL_CHUNK) -> TokenScores:
        """Score ``model`` on the same windows against the stored reference: one forward pass per window,
        then the NLL of each target, ``kl_per_position`` and the top-1 match."""
        nll, kl, top1 = [], [], []
        probs = self.ref_probs or [None] * len(self.windows)
        for w, ref_lp, ref_p, ref_top in zip(self.windows, self.ref_logprobs, probs, self.ref_argmax):
            lp = position_logprobs(model, w)
            targets = w[1:]
            nll.append(-lp.gather(1, targets[:, None]).squeeze(1).double())
            kl.append(kl_per_position(ref_lp, lp, ref_p, chunk))
            top1.append(lp.argmax(-1) == ref_top)
            del lp  # freed before the next window's forward pass: one [w-1, V] at a time, not two
        return TokenScores(torch.cat(nll), torch.cat(kl).clamp_(min=0.0), torch.cat(top1))
