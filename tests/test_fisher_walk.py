"""The Fisher walked block by block (``qkit.plan.fisher_walk``) against the whole-model passes of
``sensitivity.fisher_diagonal``: the same diagonal bit for bit, one block's diagonal held at a time, the walk
stopping at the lowest block with a target, and the model left as it was."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from qkit.plan.fisher_walk import block_targets, fisher_by_blocks
from qkit.plan.sensitivity import fisher_diagonal


def _llama(dtype=torch.float32, layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _qwen2_sliding():
    """Layers of two attention types: the first full, the others a sliding window of 8 (shorter than the
    windows): each gets its own mask from the model's forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    return Qwen2ForCausalLM(cfg).eval()


def _gpt2():
    """Blocks under ``transformer.h``, a tied head, learned positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


def _targets(model):
    inside, _ = block_targets(model, [n for n, p in model.named_parameters() if p.ndim == 2])
    return [t for ts in inside.values() for t in ts]


IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("make", [lambda: _llama(torch.float32), lambda: _llama(torch.bfloat16), _qwen2_sliding, _gpt2],
                         ids=["llama-fp32", "llama-bf16", "qwen2-sliding", "gpt2"])
def test_the_walk_is_the_whole_model_fisher_bit_for_bit(make):
    """Every target's diagonal, the sampled labels and the check windows' reference log-probabilities equal
    those of one whole-model pass per window, bit for bit (float32 diagonals for a bf16 model)."""
    m = make()
    targets = _targets(m)
    whole = fisher_diagonal(m, IDS, targets, seed=3, check_windows=2)
    got: dict[str, torch.Tensor] = {}
    f = fisher_by_blocks(m, IDS, targets, got.update, seed=3, check_windows=2)
    assert sorted(got) == sorted(targets) and f.diag == {}
    for t in targets:
        assert got[t].dtype == torch.float32
        assert torch.equal(got[t], whole.diag[t]), t
    assert torch.equal(f.labels, whole.labels) and f.positions == whole.positions == IDS.numel()
    assert len(f.reference) == 2 and all(torch.equal(a, b) for a, b in zip(f.reference, whole.reference))
    assert torch.equal(f.check_ids, IDS[:2])
    assert all(p.requires_grad and p.grad is None for p in m.parameters())


def test_given_labels_give_the_same_diagonal_and_no_reference():
    m = _llama()
    targets = _targets(m)
    first = fisher_diagonal(m, IDS, targets[:1], seed=3)
    got: dict[str, torch.Tensor] = {}
    f = fisher_by_blocks(m, IDS, targets, got.update, labels=first.labels)
    whole = fisher_diagonal(m, IDS, targets, seed=3)
    assert all(torch.equal(got[t], whole.diag[t]) for t in targets)
    assert f.reference == [] and torch.equal(f.labels, first.labels)


def test_one_blocks_diagonal_at_a_time_last_block_first():
    """``consume`` gets each block's complete diagonals, last block first; a consumer that drops them frees
    them before the next block's are allocated (the walk keeps no reference)."""
    m = _llama(layers=4)
    targets = _targets(m)
    order: list[set[str]] = []
    previous: list[weakref.ref] = []

    def consume(diag):
        gc.collect()
        assert all(r() is None for r in previous), "an earlier block's diagonal is still alive"
        previous[:] = [weakref.ref(v) for v in diag.values()]
        order.append({t.split(".")[2] for t in diag})

    fisher_by_blocks(m, IDS, targets, consume, seed=3)
    assert order == [{"3"}, {"2"}, {"1"}, {"0"}]


def test_the_walk_stops_at_the_lowest_block_with_a_target():
    """Targets only in the last two blocks: the blocks below run once (the forward pass), never again, and
    keep no inputs; the diagonals equal the whole-model ones."""
    m = _llama(layers=4)
    targets = [t for t in _targets(m) if ".layers.2." in t or ".layers.3." in t]
    calls = {i: 0 for i in range(4)}
    hooks = [b.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1)) for i, b in enumerate(m.model.layers)]
    steps: list[tuple[int, int]] = []
    got: dict[str, torch.Tensor] = {}
    try:
        fisher_by_blocks(m, IDS, targets, got.update, seed=3, on_step=lambda i, k: steps.append((i, k)))
    finally:
        for h in hooks:
            h.remove()
    n = IDS.shape[0]
    assert calls == {0: n, 1: n, 2: 2 * n, 3: 2 * n}
    assert steps == [(1, 3), (2, 3), (3, 3)]
    whole = fisher_diagonal(m, IDS, targets, seed=3)
    assert all(torch.equal(got[t], whole.diag[t]) for t in targets)


def test_a_target_outside_the_blocks_and_bad_labels_are_a_callers_bug():
    m = _llama(layers=1)
    assert block_targets(m, ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]) == (
        {0: ["model.layers.0.mlp.up_proj.weight"]}, ["model.embed_tokens.weight", "lm_head.weight"])
    with pytest.raises(ValueError, match="lm_head.weight is not inside"):
        fisher_by_blocks(m, IDS, ["lm_head.weight"], lambda d: None)
    with pytest.raises(ValueError, match="labels of shape"):
        fisher_by_blocks(m, IDS, _targets(m), lambda d: None, labels=torch.zeros(4, 15, dtype=torch.long))


def test_an_error_in_the_consumer_leaves_the_model_as_it_was():
    m = _llama(layers=2)
    m.lm_head.weight.requires_grad_(False)
    was = {n: p.requires_grad for n, p in m.named_parameters()}
    hooks_before = {n: len(p._post_accumulate_grad_hooks or {}) for n, p in m.named_parameters()}

    def boom(_):
        raise RuntimeError("the consumer failed")

    with pytest.raises(RuntimeError, match="the consumer failed"):
        fisher_by_blocks(m, IDS, _targets(m), boom)
    assert {n: p.requires_grad for n, p in m.named_parameters()} == was
    assert {n: len(p._post_accumulate_grad_hooks or {}) for n, p in m.named_parameters()} == hooks_before
    assert all(p.grad is None for p in m.parameters())
    assert not m.model.layers[0]._forward_pre_hooks and not m.model.layers[1]._forward_hooks
