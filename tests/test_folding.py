"""Scale folding (qkit.methods.folding): the folded model is the same function; SmoothQuant's scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.errors import InputError
from qkit.methods.folding import (
    ChannelStats,
    fold,
    fold_groups,
    folded_tensors,
    model_fold_groups,
    outlier_ratio,
    smoothing_factors,
    weight_absmax,
)


def _tiny(layers=2, hidden=64, heads=4, kv_heads=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so a wrong fold cannot hide behind weights of 1
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA (2 query heads per kv head), MQA
def test_fold_leaves_fp32_logits_unchanged(kv_heads):
    model = _tiny(kv_heads=kv_heads)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    groups = model_fold_groups(model)
    assert [g.kind for g in groups] == ["qkv", "o", "gate_up", "down"] * 2
    gen = torch.Generator().manual_seed(2)
    changed = {}
    for g in groups:
        c = model.get_submodule(g.prev).weight.shape[0]
        s = torch.exp(torch.randn(c, generator=gen))  # scales over ~e^±3: a real change of every tensor
        changed.update(fold(model, g, s))
    with torch.no_grad():
        after = model(input_ids=ids).logits
    rel = (after - before).abs().max() / before.abs().max()
    assert rel < 1e-5, rel
    # Every norm and every projection of each block was changed.
    assert "model.layers.0.input_layernorm.weight" in changed
    assert "model.layers.1.mlp.down_proj.weight" in changed
    assert len([k for k in changed if k.endswith("_proj.weight")]) == 7 * 2


def test_gqa_o_group_ties_scales_per_kv_head():
    model = _tiny(heads=4, kv_heads=2)
    g = next(g for g in model_fold_groups(model) if g.kind == "o")
    assert (g.repeat, g.head_dim) == (2, 16)
    s = torch.arange(1.0, 33.0)  # one scale per v_proj output row (2 kv heads x 16)
    cols = g.expand(s)
    # o_proj columns of query heads 0,1 read kv head 0; heads 2,3 read kv head 1.
    assert torch.equal(cols, torch.cat([s[:16], s[:16], s[16:], s[16:]]))
    stat = torch.cat([torch.full((16,), 1.0), torch.full((16,), 3.0), torch.full((16,), 2.0), torch.full((16,), 5.0)])
    assert torch.equal(g.reduce(stat, "max"), torch.cat([torch.full((16,), 3.0), torch.full((16,), 5.0)]))
    assert torch.equal(g.reduce(stat, "mean"), torch.cat([torch.full((16,), 2.0), torch.full((16,), 3.5)]))


def test_folded_tensors_hand_values():
    g = fold_groups({"model_type": "llama", "num_attention_heads": 1, "hidden_size": 2},
                    ["model.layers.0.input_layernorm.weight"], linear_groups=False)[0]
    state = {
        "model.layers.0.input_layernorm.weight": torch.tensor([2.0, 3.0]),
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[1.0, 1.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[1.0, -2.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[0.5, 4.0]]),
    }
    new = folded_tensors(state, g, torch.tensor([2.0, 0.5]))
    assert torch.equal(new["model.layers.0.input_layernorm.weight"], torch.tensor([1.0, 6.0]))
    assert torch.equal(new["model.layers.0.self_attn.k_proj.weight"], torch.tensor([[2.0, -1.0]]))
    assert torch.equal(new["model.layers.0.self_attn.v_proj.weight"], torch.tensor([[1.0, 2.0]]))
    assert torch.equal(state["model.layers.0.input_layernorm.weight"], torch.tensor([2.0, 3.0]))  # input untouched


def test_smoothing_factors_golden():
    # s = a^0.5 / w^0.5: a = [4, 100, 1e-9 (dead channel, clamped to 1e-5)], w = [1, 4, 1]
    s = smoothing_factors(torch.tensor([4.0, 100.0, 1e-9]), torch.tensor([1.0, 4.0, 1.0]), 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 5.0, 1e-5 ** 0.5]))
    assert torch.equal(smoothing_factors(torch.tensor([4.0]), torch.tensor([3.0]), 1.0), torch.tensor([4.0]))
    assert torch.equal(smoothing_factors(torch.tensor([4.0]), torch.tensor([2.0]), 0.0), torch.tensor([0.5]))


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_outside_unit_interval_is_one_line(alpha):
    with pytest.raises(InputError, match=r"--alpha must be in \[0, 1\]"):
        smoothing_factors(torch.ones(3), torch.ones(3), alpha)


def test_planted_outlier_ratio_falls_by_predicted_factor():
    """One input channel 1000x the others: after smoothing with α, the activations' max/median ratio is
    the ratio before times (1000^-α) when the weights' column absmax is uniform (here: all equal)."""
    torch.manual_seed(0)
    act = torch.ones(64)
    act[7] = 1000.0
    w = torch.ones(32, 64) * torch.where(torch.rand(32, 64) > 0.5, 1.0, -1.0)
    for alpha in (0.25, 0.5, 0.8):
        s = smoothing_factors(act, weight_absmax([w]), alpha)
        assert outlier_ratio(act) == pytest.approx(1000.0)
        assert outlier_ratio(act / s) == pytest.approx(1000.0 ** (1 - alpha), rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_channel_stats_match_one_pass(batches, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, 8, generator=g) * 3 for _ in range(batches)]
    stats = ChannelStats()
    for x in xs:
        stats.update(x)
    allx = torch.cat(xs)
    assert torch.equal(stats.absmax, allx.abs().amax(0))
    assert torch.allclose(stats.absmean, allx.abs().mean(0), atol=1e-6)
    assert stats.count == batches * tokens


def test_unsupported_model_type_is_one_line():
    with pytest.raises(InputError, match="scale folding supports"):
        fold_groups({"model_type": "gpt2", "num_attention_heads": 4, "hidden_size": 64}, [])
