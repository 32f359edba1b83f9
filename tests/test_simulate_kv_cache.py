"""Quantized KV cache: the quantizers, the per-query semantics against a naive oracle, both attention
paths (no cache and cached generation), identity, removal, padding, bad inputs."""

from __future__ import annotations

import pytest
import torch

from qkit.errors import QkitError
from qkit.models import load
from qkit.simulate import SimulationContext, apply_simulation, get_simulation, simulation_bits
from qkit.simulate.kv_cache import (
    KVCacheOptions,
    KVCacheSimulation,
    make_kv_simulation,
    mixed_attention,
    quantize_per_channel,
    quantize_per_token,
    quantized_bound,
)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load(tiny_model_dir, device="cpu").model


def ids(batch=1, length=40, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_per_token_and_per_channel_golden():
    x = torch.tensor([[7.0, -3.5, 1.75, 0.0], [14.0, 5.0, -3.0, 1.0]]).reshape(1, 1, 2, 4)
    # int4: qmax 7; token 0: s = 7/7 = 1 -> [7, -3.5 -> -4 (half to even), 1.75 -> 2, 0]
    # token 1: s = 14/7 = 2 -> x/s = [7, 2.5 -> 2, -1.5 -> -2, 0.5 -> 0] -> times 2
    q = quantize_per_token(x, 4)[0, 0]
    assert q.tolist() == [[7.0, -4.0, 2.0, 0.0], [14.0, 4.0, -4.0, 0.0]]
    # per channel, one group of 2 tokens: channel scales [8, 4, 2, 1] / 7
    c = quantize_per_channel(x, 4, group=2)[0, 0]
    s = torch.tensor([14.0, 5.0, 3.0, 1.0]) / 7
    assert torch.allclose(c, (x[0, 0] / s).round().clamp(-7, 7) * s)
    # groups of 1 token: per channel over a single token is exact
    assert torch.allclose(quantize_per_channel(x, 8, group=1), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_at_most_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 50, 16, generator=g) * torch.logspace(-2, 2, 16)
    qmax = 2 ** (bits - 1) - 1
    tok = quantize_per_token(x, bits)
    assert bool(((tok - x).abs() <= x.abs().amax(-1, keepdim=True) / qmax / 2 * (1 + 1e-5)).all())
    ch = quantize_per_channel(x, bits, group=8)
    for start in range(0, 50, 8):
        part = x[:, :, start : start + 8]
        bound = part.abs().amax(2, keepdim=True) / qmax / 2 * (1 + 1e-5)
        assert bool(((ch[:, :, start : start + 8] - part).abs() <= bound).all())


def test_bounds():
    t = torch.arange(10)
    assert quantized_bound(t, 0, None).tolist() == list(range(1, 11))  # per token: everything up to itself
    assert quantized_bound(t, 3, None).tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    # per channel, G = 4: a group is quantized once complete (t = 3 completes group 0)
    assert quantized_bound(t, 0, 4).tolist() == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8]
    assert quantized_bound(t, 2, 4).tolist() == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8]


def naive_attention(q, k, v, k_hat, v_hat, kb, vb, scaling):
    """One query at a time, each with the cache exactly as it stands for it."""
    n_rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    s = k.shape[2]
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            t = s - q.shape[2] + i
            kk = torch.where((torch.arange(t + 1) < kb[b, i])[None, :, None], k_hat[b, :, : t + 1], k[b, :, : t + 1])
            vv = torch.where((torch.arange(t + 1) < vb[b, i])[None, :, None], v_hat[b, :, : t + 1], v[b, :, : t + 1])
            kk, vv = kk.repeat_interleave(n_rep, 0), vv.repeat_interleave(n_rep, 0)
            p = torch.softmax((q[b, :, i : i + 1] @ kk.transpose(-1, -2)) * scaling, dim=-1)
            out[b, i] = (p @ vv)[:, 0]
    return out


def test_mixed_attention_against_the_per_query_oracle():
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 23, 8
    q, k, v = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    k_hat, v_hat = quantize_per_channel(k, 4, 4), quantize_per_token(v, 4)
    pos = torch.arange(s).expand(b, s)
    kb, vb = quantized_bound(pos, 2, 4), quantized_bound(pos, 2, None)
    allowed = (torch.arange(s)[None, :] <= torch.arange(s)[:, None]).expand(b, 1, s, s)
    kq = pos[:, None, None, :] < kb[:, None, :, None]
    vq = pos[:, None, None, :] < vb[:, None, :, None]
    got = mixed_attention(q, k, k_hat, v, v_hat, allowed, kq, vq, d**-0.5)
    assert torch.allclose(got, naive_attention(q, k, v, k_hat, v_hat, kb, vb, d**-0.5), atol=1e-5)


def identity(x, layout, positions, valid):
    return x


def test_identity_quantizer_changes_nothing_bit_for_bit(lm):
    x = ids()
    with torch.no_grad():
        ref = lm(x, use_cache=False).logits
        ref_gen = lm.generate(x[:, :8], max_new_tokens=6, do_sample=False)
        sim = KVCacheSimulation("kv-identity", 8, "token", quantizer=identity)
        handle = sim.install(lm, SimulationContext())
        try:
            out = lm(x, use_cache=False).logits
            gen = lm.generate(x[:, :8], max_new_tokens=6, do_sample=False)
            calls = handle.stats()
        finally:
            handle.remove()
    assert torch.equal(out, ref) and torch.equal(gen, ref_gen)
    assert calls["calls_no_cache"] >= 2 and calls["calls_decode"] >= 2  # the function ran in both paths


@pytest.mark.parametrize("layout,residual,path", [("channel", 0, "calls_runs"), ("token", 3, "calls_mixed")])
def test_identity_on_the_run_and_mixed_paths_changes_nothing_but_rounding(lm, layout, residual, path):
    x = ids()
    with torch.no_grad():
        ref = lm(x, use_cache=False).logits
        sim = KVCacheSimulation("kv-identity", 4, layout, KVCacheOptions(kv_residual=residual), quantizer=identity)
        handle = sim.install(lm, SimulationContext())
        try:
            out = lm(x, use_cache=False).logits
            calls = handle.stats()
        finally:
            handle.remove()
    # one call per layer, on the path expected: KIVI's unfinished key groups make queries see different caches
    # in runs of G = 32 queries; a per-token residual window changes at every query
    assert calls[path] == 2 and calls["calls_runs"] + calls["calls_mixed"] == 2
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("simulation", ["kv-int8-token", "kv-int8-channel", "kv-int4-token", "kv-int4-channel"])
@pytest.mark.parametrize("residual", [0, 3])
def test_no_cache_pass_equals_step_by_step_cached_decoding(lm, simulation, residual):
    """The perplexity pass (one forward, no cache) and generation (the cache filled one token at a time)
    see the same quantized cache: logits agree to fp32 rounding, up to a code moved at a rounding tie (on
    every path: the original kernel on a fully quantized cache, runs of queries, mixed attention)."""
    x = ids(length=40, seed=3)
    opts = {"kv_group": 8, "kv_residual": residual}
    with torch.no_grad():
        ref = lm(x, use_cache=False).logits
        with apply_simulation(lm, [simulation], options=opts) as stats:
            full = lm(x, use_cache=False).logits
            from transformers import DynamicCache

            cache, steps = DynamicCache(config=lm.config), []
            for t in range(x.shape[1]):
                out = lm(x[:, t : t + 1], cache=cache, use_cache=True)
                steps.append(out.logits[:, 0])
        after = lm(x, use_cache=False).logits
    stepwise = torch.stack(steps, dim=1)
    # a key computed for one token or for forty differs in its last bits, which can move a value at a rounding
    # tie to the next code (measured: int8 per channel, residual 3, one flip from position 25 on, 7.9e-5 in
    # the logits against 1.1e-3 for the quantization itself). Most positions agree to fp32 rounding; every
    # position within a tenth of what quantizing the cache did.
    gap = (full - stepwise).abs().amax(dim=-1)[0]
    effect = (full - ref).abs().max()
    assert effect > 1e-4  # quantization changed what attention saw
    assert gap.median() <= 2e-5 and gap.max() <= 0.1 * effect, (gap, effect)
    assert torch.equal(after, ref)  # removed: bit-identical again
    s = stats[simulation]
    assert s["calls_no_cache"] == 2 and s["calls_decode"] == 2 * 40
    expected = "calls_runs" if simulation.endswith("channel") and residual == 0 else "calls_mixed" if residual else None
    assert s["calls_runs"] + s["calls_mixed"] == (2 if expected else 0) and (expected is None or s[expected] == 2)


def test_int8_values_move_attention_outputs_by_at_most_half_a_step():
    """Keys exact, values int8 per token: each attention output is a convex combination of the values it
    reads, so it moves by at most the largest half step among them."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 24, 16, generator=g), torch.randn(1, 4, 24, 16, generator=g), torch.randn(1, 4, 24, 16, generator=g) * 3
    v_hat = quantize_per_token(v, 8)
    half_step = v.abs().amax(-1).max() / 127 / 2
    sdpa = torch.nn.functional.scaled_dot_product_attention
    moved = (sdpa(q, k, v_hat, is_causal=True) - sdpa(q, k, v, is_causal=True)).abs().max()
    assert 0 < float(moved) <= float(half_step) * (1 + 1e-5)
    assert float((v_hat - v).abs().max()) <= float(half_step) * (1 + 1e-5)


def test_left_padding_is_quantized_as_the_unpadded_prompt(lm):
    short, long = ids(1, 12, seed=7), ids(1, 20, seed=8)
    batch = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1), torch.ones(1, 20, dtype=torch.long)])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), apply_simulation(lm, ["kv-int4-channel"], options={"kv_group": 4}):
        alone = lm(short, use_cache=False).logits
        padded = lm(batch, attention_mask=mask, position_ids=pos, use_cache=False).logits
    assert torch.allclose(padded[0, 8:], alone[0], atol=1e-4)


def test_simulation_bits_and_named_simulations():
    assert simulation_bits(["kv-int8-token"]) == (None, 8)
    assert simulation_bits(["kv-int4-channel"]) == (None, 4)
    r = get_simulation("kv-int4-channel", {"kv_group": 16, "threshold": 6.0})  # other families' keys are ignored
    assert (r.bits, r.key_layout, r.options.kv_group, r.options.kv_residual) == (4, "channel", 16, 0)


@pytest.mark.parametrize("call,match", [
    (lambda: make_kv_simulation(3, "token"), "bits must be 8 or 4"),
    (lambda: make_kv_simulation(16, "token"), "bits must be 8 or 4"),
    (lambda: make_kv_simulation(8, "row"), "unknown KV-cache layout 'row'"),
    (lambda: get_simulation("kv-int8-token", {"kv_residual": -1}), "--kv-residual must be an integer >= 0"),
    (lambda: get_simulation("kv-int8-channel", {"kv_group": 0}), "--kv-group must be an integer >= 1"),
    (lambda: get_simulation("kv-int8-channel", {"kv_groups": 8}), "no run-time simulation takes the option kv_groups"),
    (lambda: get_simulation("kv-int3-token"), "unknown run-time simulation"),
])
def test_bad_inputs_one_line(call, match):
    with pytest.raises(QkitError, match=match) as exc:
        call()
    assert "\n" not in str(exc.value)


def test_two_kv_layouts_on_one_model_are_refused(lm):
    with pytest.raises(QkitError, match="already installed"):
        with apply_simulation(lm, ["kv-int8-token", "kv-int4-token"]):
            pass
    assert lm.config._attn_implementation == "sdpa"
