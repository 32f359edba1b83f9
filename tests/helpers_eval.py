"""What the eval's tests share (no tests here):

- the eval's implementations before its memory bounds and fast paths, frozen: the oracles that
  ``tests/test_eval_memory.py`` and ``tests/test_eval_speed.py`` hold ``CorpusReference`` to, bit for bit
  (the model pair they run on is the ``perturbed`` fixture of ``tests/conftest.py``);
- :func:`make_row`, a table row with the given perplexity change, for the notes' tests.
"""

from __future__ import annotations

import torch

from qkit.evaluation.perplexity import position_logprobs
from qkit.evaluation.token_scores import TokenScores
from qkit.evaluation.report import Row


def whole_window_reference(model, windows):
    """The reference as ``CorpusReference`` computed it before: one forward pass and one log-softmax
    per window, every window's ``[w-1, V]`` kept in memory."""
    lps = [position_logprobs(model, w) for w in windows]
    return lps, [lp.argmax(-1) for lp in lps]


def whole_window_score(ref_lps, ref_tops, windows, model, chunk: int = 512) -> TokenScores:
    """``CorpusReference.score`` before: the row's whole-window log-probs, KL in 512-row blocks."""
    nll, kl, top1 = [], [], []
    for w, ref_lp, ref_top in zip(windows, ref_lps, ref_tops):
        lp = position_logprobs(model, w)
        nll.append(-lp.gather(1, w[1:, None]).squeeze(1).double())
        for s in range(0, lp.shape[0], chunk):
            p_lp, q_lp = ref_lp[s : s + chunk], lp[s : s + chunk]
            kl.append((p_lp.exp() * (p_lp - q_lp)).sum(-1).double())
        top1.append(lp.argmax(-1) == ref_top)
    return TokenScores(torch.cat(nll), torch.cat(kl).clamp_(min=0.0), torch.cat(top1))


def assert_same_scores(got: TokenScores, expected: TokenScores) -> None:
    assert torch.equal(got.nll, expected.nll)
    assert torch.equal(got.kl, expected.kl)
    assert torch.equal(got.top1, expected.top1)


def make_row(name: str, ppl: float, change: float, se: float, changed: int | None, matrices: int = 14) -> Row:
    """A table row named ``name``: perplexity ``ppl``, its change ``change`` +- ``se`` %, ``changed`` of
    ``matrices`` quantized weights different from the reference's (``None``: not counted)."""
    return Row(
        scheme=name, bits_per_weight=4.5, size_bytes=1, perplexity=ppl, perplexity_se=0.1,
        perplexity_change_pct=change, perplexity_change_se_pct=se, kld=0.0, kld_se=0.0, top1_match=1.0,
        battery_correct=8, battery_total=16, battery_ci95=(0.28, 0.72), battery_answers=[True] * 8 + [False] * 8,
        battery_outputs=[""] * 16, mcnemar_only_reference=0, mcnemar_only_row=0, mcnemar_p=1.0, agreement=9,
        agreement_total=9, agreement_ci95=(0.7, 1.0), seconds=1.0, matrices=matrices, weights_changed=changed,
    )
