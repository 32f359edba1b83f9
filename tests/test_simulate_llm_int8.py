"""LLM.int8: exact integer sums, a hand-computed planted outlier, bitsandbytes as the oracle, statistics."""

from __future__ import annotations

import logging

import pytest
import torch

from qkit.errors import QkitError
from qkit.models import load
from qkit.simulate import apply_simulation, get_simulation, simulation_bits
from qkit.granularity import PerTensor
from qkit.simulate.activations import quantize_activations
from qkit.simulate.llm_int8 import CHUNK, EXACT_FP32_TERMS, Int8Weight, LLMInt8Options, exact_int_matmul, llm_int8_matmul, rowwise_int8


def test_the_fp32_exactness_bound_and_the_chunked_sum():
    assert EXACT_FP32_TERMS == 1040 and CHUNK <= EXACT_FP32_TERMS  # 127*127*1040 < 2**24 < 127*127*1041
    assert 127 * 127 * 1040 < 2**24 < 127 * 127 * 1041
    g = torch.Generator().manual_seed(0)
    # K = 1536 (the default model's down_proj) with large same-sign codes: sums near 2.5e7 > 2**24
    a = torch.randint(100, 128, (8, 1536), generator=g).float()
    b = torch.randint(100, 128, (16, 1536), generator=g).float()
    exact = a.long() @ b.long().T
    assert torch.equal(exact_int_matmul(a, b).long(), exact)
    assert not torch.equal((a @ b.T).long(), exact)  # one fp32 sum of 1536 terms is not exact here
    small = torch.randint(-127, 128, (4, 1024), generator=g).float(), torch.randint(-127, 128, (5, 1024), generator=g).float()
    assert torch.equal(exact_int_matmul(*small).long(), small[0].long() @ small[1].long().T)


def test_rowwise_int8_golden():
    a = torch.tensor([[1.0, -2.0, 8.0, 0.5], [4.0, 1.0, -7.0, 0.0]], dtype=torch.float16)
    codes, absmax, cols = rowwise_int8(a, 6.0)
    # column 2 holds |x| >= 6: outlier; rows keep absmax over the rest: 2 and 4
    assert cols.tolist() == [False, False, True, False]
    assert absmax.tolist() == [2.0, 4.0]
    # row 0: [1, -2, -, .5] * 127/2 = [63.5, -127, -, 31.75] -> [64 (half to even), -127, 0, 32]
    assert codes.tolist() == [[64.0, -127.0, 0.0, 32.0], [127.0, 32.0, 0.0, 0.0]]  # 31.75 -> 32
    zero_codes, zero_max, _ = rowwise_int8(torch.zeros(2, 3))
    assert torch.equal(zero_codes, torch.zeros(2, 3)) and torch.equal(zero_max, torch.zeros(2))


def planted():
    """The planted-outlier linear, every number exact in fp32: input column 0 is 4000 (1000x the others),
    the ordinary inputs are k/32 (per-token scale 1/32, codes k), the weights m/64 (per-row scale 1/64)."""
    k = torch.tensor([[127, -64, 3, 10, -1], [5, 127, -127, 0, 2], [-127, 1, 40, 99, -8]], dtype=torch.float32)
    x = torch.cat([torch.full((3, 1), 4000.0), k / 32], dim=1)
    m = torch.tensor([[127, 5, -3, 0, 9, -20], [-50, 127, 7, 1, -1, 3], [2, -127, 64, 33, 0, 8], [10, 11, -12, 127, 14, -15]],
                     dtype=torch.float32)
    return x, m / 64, k, m


def test_planted_outlier_llm_int8_reproduces_the_16bit_result_exactly():
    x, w, k, m = planted()
    y, cols = llm_int8_matmul(x, Int8Weight.from_weight(w), threshold=6.0)
    assert cols.tolist() == [True, False, False, False, False, False]
    # by hand: the ordinary part is (k @ m[:, 1:]^T) / (32 * 64), the outlier column 4000 * m[:, 0] / 64 in 16-bit
    by_hand = (k @ m[:, 1:].T) / 2048 + 4000 * m[:, 0] / 64
    assert torch.equal(y, by_hand)
    assert torch.equal(y, x @ w.T)  # here that is the full-precision product itself
    # per-tensor W8A8 of the same input keeps only the outlier: its error is the whole ordinary product
    w8a8 = quantize_activations(x, PerTensor()) @ w.T
    assert torch.allclose(w8a8 - x @ w.T, -(k @ m[:, 1:].T) / 2048, atol=2e-3)
    # without the split (threshold above the outlier) int8 per-token rows lose the ordinary columns too
    y_no_split, none = llm_int8_matmul(x, Int8Weight.from_weight(w), threshold=1e6)
    assert not none.any() and torch.allclose(y_no_split, 4000 * m[:, 0] / 64 * torch.ones(3, 1), atol=1e-2)


def test_bitsandbytes_linear8bitlt_is_the_oracle():
    """bitsandbytes 0.50.2 runs Linear8bitLt on the CPU (eval mode: MatMul8bitLt; AVX-512: torch._int_mm).
    Codes, scales and outlier columns must be identical; outputs differ only by bitsandbytes' fp16
    arithmetic: its int8 output rounded to fp16 and the outlier product and sum in fp16 (three roundings of
    at most 2**-11 relative to the magnitudes involved)."""
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(0)
    k_in, n_out, t = 256, 64, 16
    w = torch.randn(n_out, k_in, generator=g).half()
    layer = bnb.nn.Linear8bitLt(k_in, n_out, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.load_state_dict({"weight": w})
    layer = layer.to("cpu").eval()
    x = torch.randn(t, k_in, generator=g).half()
    x[:, [3, 77]] *= 20
    x[5, 100] = 6.0  # exactly the threshold: bitsandbytes counts >= as outlier
    with torch.no_grad():
        y_bnb = layer(x).float()
    ours = Int8Weight.from_weight(w)
    assert torch.equal(ours.codes.to(torch.int8), layer.state.CB) and torch.equal(ours.absmax, layer.state.SCB)
    ca, sca, outlier_cols = bnb.functional.int8_vectorwise_quant(x.clone(), threshold=6.0)
    codes, absmax, cols = rowwise_int8(x, 6.0)
    assert torch.equal(codes.to(torch.int8), ca) and torch.equal(absmax, sca)
    y, cols = llm_int8_matmul(x, ours, 6.0)
    assert torch.nonzero(cols).flatten().tolist() == outlier_cols.tolist() == layer.state.idx.tolist() == [3, 77, 100]
    outlier = x[:, cols].float() @ ours.dequantize_columns(cols).T
    magnitude = (y - outlier).abs() + x[:, cols].float().abs() @ ours.dequantize_columns(cols).abs().T
    assert bool(((y - y_bnb).abs() <= 3 * 2**-11 * magnitude + 1e-6).all())


def test_simulation_matches_the_function_and_reports_statistics(tiny_model_dir):
    lm = load(tiny_model_dir, device="cpu").model
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    lin = dict(lm.named_modules())["model.layers.0.mlp.down_proj"]
    seen = {}
    h = lin.register_forward_pre_hook(lambda _m, a: seen.setdefault("x", a[0].detach().clone()))
    with torch.no_grad():
        ref = lm(ids, use_cache=False).logits
        with apply_simulation(lm, ["llm-int8"], options={"threshold": 2.0}) as stats:
            hook_out = {}
            h2 = lin.register_forward_hook(lambda _m, _a, out: hook_out.setdefault("y", out.detach().clone()))
            out = lm(ids, use_cache=False).logits
            h2.remove()
        after = lm(ids, use_cache=False).logits
    h.remove()
    expected, cols = llm_int8_matmul(seen["x"].reshape(-1, seen["x"].shape[-1]), Int8Weight.from_weight(lin.weight), 2.0)
    assert torch.equal(hook_out["y"].reshape(expected.shape), expected)
    assert torch.equal(after, ref) and not torch.equal(out, ref)
    s = stats["llm-int8"]
    assert s["threshold"] == 2.0 and s["linears"] == 14
    layer = s["per_linear"]["model.layers.0.mlp.down_proj"]
    assert layer["columns_16bit"] == len(layer["outlier_columns"]) >= int(cols.sum())
    assert 0 <= layer["mac_fraction"] <= layer["column_fraction"] <= 1
    assert 0 < s["mac_fraction"] < 1
    assert simulation_bits(["llm-int8"]) == (8, None)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "6", True])
def test_threshold_must_be_positive_one_line(bad):
    with pytest.raises(QkitError) as exc:
        get_simulation("llm-int8", {"threshold": bad})
    assert "--threshold must be a positive number" in str(exc.value) and "\n" not in str(exc.value)
    assert LLMInt8Options().threshold == 6.0
