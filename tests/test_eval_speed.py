"""The eval's fast paths give exactly the values of a naive reference implementation (tiny model, fast).

- ``kl_per_position`` (reused buffers, the reference's probabilities computed once) against the
  straightforward formula, bit for bit, and against a float64 oracle and a hand-computed value;
- ``CorpusReference.score`` against the implementation it replaced, line for line (below), with every
  window one chunk of positions and with several chunks per window, bit for bit (the memory bounds
  themselves: tests/test_eval_memory.py);
- agreement's restricted argmax against the argmax over all positions;
- the battery's one left-padded batch against one prompt at a time (the greedy answers the table reports);
- one prompt prefill shared by agreement and the battery against each computed on its own.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.evaluation.agreement import (
    ReferenceContinuation,
    agreement,
    prefill_prompts,
    reference_continuation,
)
from qkit.evaluation.battery import (
    build_prompts,
    encode_batch,
    generate_answers,
    load_battery,
)
from qkit.evaluation.perplexity import CorpusReference, kl_per_position
from qkit.evaluation.token_scores import TokenScores
from helpers_eval import assert_same_scores, whole_window_score  # the scoring before chunking


def naive_score(ref: CorpusReference, model, chunk: int = 512) -> TokenScores:
    """``CorpusReference.score`` as it was before the fast path: fresh temporaries, exp(ref) per row."""
    return whole_window_score(ref.ref_logprobs, ref.ref_argmax, ref.windows, model, chunk)


def naive_kl(ref_lp: torch.Tensor, lp: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([(ref_lp[s : s + chunk].exp() * (ref_lp[s : s + chunk] - lp[s : s + chunk])).sum(-1).double()
                      for s in range(0, lp.shape[0], chunk)])


def test_kl_hand_computed():
    # p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); p = q: 0
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log()
    q = torch.tensor([[0.75, 0.25], [0.5, 0.5]]).log()
    kl = kl_per_position(p, q)
    assert kl.dtype == torch.float64
    assert kl[0].item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6) and kl[1].item() == 0.0


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), v=st.integers(1, 70), chunk=st.integers(1, 17), seed=st.integers(0, 2**16))
def test_kl_per_position_is_the_straightforward_formula_bit_for_bit(n, v, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    ref_lp = torch.log_softmax(3 * torch.randn(n, v, generator=gen), -1)
    lp = torch.log_softmax(3 * torch.randn(n, v, generator=gen), -1)
    expected = naive_kl(ref_lp, lp, chunk)
    assert torch.equal(kl_per_position(ref_lp, lp, None, chunk), expected)
    assert torch.equal(kl_per_position(ref_lp, lp, ref_lp.exp(), chunk), expected)
    # and the value is the KL divergence: float64 oracle (float32 rounding only)
    oracle = (ref_lp.double().exp() * (ref_lp.double() - lp.double())).sum(-1)
    assert torch.allclose(expected, oracle, atol=1e-5, rtol=1e-4)


def test_kl_per_position_of_inference_tensors_as_score_gives_them():
    with torch.inference_mode():
        ref_lp = torch.log_softmax(torch.randn(9, 13), -1)
        lp = torch.log_softmax(torch.randn(9, 13), -1)
    assert torch.equal(kl_per_position(ref_lp, lp, chunk=4), naive_kl(ref_lp, lp, 4))


@pytest.mark.parametrize("window", [16, 37])  # 16: 4 windows of 16 (one of 8 left); 37: two windows, the last short
def test_score_equals_the_naive_implementation_bit_for_bit(perturbed, window):
    ref_model, row, _ = perturbed
    ids = torch.randint(3, 300, (72,), generator=torch.Generator().manual_seed(window))
    whole = CorpusReference(ref_model, ids, window)  # every window one chunk of positions
    chunked = CorpusReference(ref_model, ids, window, chunk=16)  # a window of 37: two spans of 18 and 19 rows
    for model in (row, ref_model):
        expected = naive_score(whole, model, chunk=5)
        for ref in (whole, chunked):
            assert_same_scores(ref.score(model), expected)
    s = whole.score(row)
    assert s.kld > 1e-3 and s.top1_match < 1.0  # the perturbed row really differs: the comparison can fail
    assert whole.score(ref_model).kld == 0.0


def test_agreement_equals_the_argmax_over_all_positions(perturbed):
    ref_model, row, tok = perturbed
    prompts = build_prompts(tok, [q.question for q in load_battery()])
    cont = reference_continuation(ref_model, tok, prompts, 5)
    # naive: the reference's continuation one full argmax at a time, then the row's full argmax sliced
    batch = encode_batch(tok, prompts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for _ in range(5):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            nxt = ref_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.argmax(-1)[:, -1:]
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    assert torch.equal(cont.input_ids, ids) and torch.equal(cont.attention_mask, mask)
    naive = ReferenceContinuation(ids, mask, 5)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        full = row(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.argmax(-1)
    expected = full[:, -6:-1] == naive.targets
    got = agreement(row, cont)
    assert got.shape == (16, 5) and torch.equal(got, expected)
    assert 0 < int(got.sum()) < got.numel()  # the perturbed row agrees on some positions, not all
    assert bool(agreement(ref_model, cont).all())


def test_battery_batch_equals_one_prompt_at_a_time(perturbed):
    _, row, tok = perturbed
    prompts = build_prompts(tok, [q.question for q in load_battery()])
    assert len({len(encode_batch(tok, [p])["input_ids"][0]) for p in prompts}) > 1  # the batch really pads
    batched = generate_answers(row, tok, prompts, 6, 1.0)
    single = [generate_answers(row, tok, [p], 6, 1.0)[0] for p in prompts]
    assert batched == single
    assert len(set(batched)) > 8  # distinct answers: equality is not that of 16 identical strings


def test_one_prefill_serves_agreement_and_the_battery(perturbed):
    """The runner's path (one ``prefill_prompts`` per model, agreement on a copy of its cache, then the
    battery continuing from it) gives exactly the answers and agreement of each computed on its own."""
    ref_model, row, tok = perturbed
    prompts = build_prompts(tok, [q.question for q in load_battery()])
    batch = encode_batch(tok, prompts)
    ref_cache = prefill_prompts(ref_model, batch["input_ids"], batch["attention_mask"])
    cont = reference_continuation(ref_model, tok, prompts, 5, prompt_cache=ref_cache)
    assert torch.equal(cont.input_ids, reference_continuation(ref_model, tok, prompts, 5).input_ids)
    assert bool(agreement(ref_model, cont, prompt_cache=ref_cache).all())  # the cache is left as it was
    for model in (row, ref_model):
        cached = prefill_prompts(model, *cont.prompts)
        first = agreement(model, cont, prompt_cache=cached)
        assert torch.equal(agreement(model, cont, prompt_cache=cached), first)  # extend does not move the cache
        assert torch.equal(first, agreement(model, cont))
        answers = generate_answers(model, tok, prompts, 6, 1.0, prompt_cache=cached)
        assert answers == generate_answers(model, tok, prompts, 6, 1.0)
        assert cached.cache is None  # consumed: a second use is refused, not silently wrong
        with pytest.raises(RuntimeError, match="consumed"):
            agreement(model, cont, prompt_cache=cached)
        with pytest.raises(RuntimeError, match="consumed"):
            generate_answers(model, tok, prompts, 6, 1.0, prompt_cache=cached)
    assert 0 < int(agreement(row, cont).sum()) < cont.targets.numel()  # the row differs: the equalities can fail
