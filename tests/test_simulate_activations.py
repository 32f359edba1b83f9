"""Activation fake-quantization (W8A8): golden values, the planted-outlier linear, hooks, static scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.errors import InputError, QkitError
from qkit.granularity import PerRow, PerTensor
from qkit.models import load
from qkit.simulate import SimulationContext, apply_simulation, get_simulation, simulation_bits
from qkit.simulate.activations import absmax_scale, fake_quantize, quantize_activations, target_linears


def planted_outlier_input() -> torch.Tensor:
    """3 tokens x 6 features: column 0 is 4000 in every token (about 1000x the others); the ordinary
    columns are k/32 with |k| <= 127, so a per-token scale of 127/32 / 127 = 1/32 represents them exactly."""
    k = torch.tensor([[127, -64, 3, 10, -1], [5, 127, -127, 0, 2], [-127, 1, 40, 99, -8]], dtype=torch.float32)
    return torch.cat([torch.full((3, 1), 4000.0), k / 32], dim=1)


def test_golden_per_tensor_per_token_values():
    x = torch.tensor([[254.0, 1.0, -0.5, 2.0], [4.0, -2.0, 1.0, 0.5]])
    # per tensor: s = 254/127 = 2; x/s = [127, .5, -.25, 1], [2, -1, .5, .25] -> round half to even
    assert torch.equal(quantize_activations(x, PerTensor()), torch.tensor([[254.0, 0.0, -0.0, 2.0], [4.0, -2.0, 0.0, 0.0]]))
    # per token: row 0 as above (s = 2); row 1 s = 4/127: every value is a multiple... check codes instead
    s = absmax_scale(x, PerRow())
    assert torch.equal(s, torch.tensor([[2.0], [4.0 / 127]]))
    q = quantize_activations(x, PerRow())
    codes = torch.round(q[1] / s[1]).tolist()
    assert codes == [127.0, -64.0, 32.0, 16.0]  # 63.5 -> 64 (half to even), 31.75 -> 32, 15.875 -> 16
    assert torch.equal(quantize_activations(torch.zeros(2, 3), PerRow()), torch.zeros(2, 3))  # scale 0 -> zeros, no NaN


def test_static_scale_saturates_at_127_steps():
    x = torch.tensor([10.0, 1.0, -10.0, -0.025])
    out = fake_quantize(x, torch.tensor(0.05))
    # 10/0.05 = 200 -> clamp 127 -> 6.35; 1/0.05 = 20; -0.025/0.05 = -0.5 -> -0 (half to even); symmetric clamp
    assert torch.allclose(out, torch.tensor([6.35, 1.0, -6.35, 0.0]), atol=1e-6)


def test_planted_outlier_per_tensor_loses_the_ordinary_columns():
    x = planted_outlier_input()
    w = torch.randn(4, 6)
    xq = quantize_activations(x, PerTensor())
    # s = 4000/127 = 31.50; the largest ordinary value 127/32 = 3.97 is 0.126 steps: every one rounds to 0
    assert torch.equal(xq[:, 1:], torch.zeros(3, 5))
    assert torch.allclose(xq[:, 0], torch.full((3,), 4000.0))
    # the output keeps only the outlier column's contribution; the error is the ordinary columns' whole product
    err = xq @ w.T - x @ w.T
    assert torch.allclose(err, -(x[:, 1:] @ w[:, 1:].T), atol=1e-3)
    # per token cannot help here (every token holds the outlier): the same loss
    assert torch.equal(quantize_activations(x, PerRow())[:, 1:], torch.zeros(3, 5))
    # a token without the outlier keeps its values exactly under per-token scales (they are on its grid)
    x2 = x.clone()
    x2[1, 0] = 0.0
    assert torch.equal(quantize_activations(x2, PerRow())[1], x2[1])
    assert torch.equal(quantize_activations(x2, PerTensor())[1, 1:], torch.zeros(5))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.floats(1e-3, 1e3), st.sampled_from(["tensor", "token"]))
def test_error_at_most_half_a_step_and_idempotent(rows, cols, magnitude, unit):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * magnitude
    gran = PerTensor() if unit == "tensor" else PerRow()
    s = absmax_scale(x, gran)
    q = quantize_activations(x, gran)
    # q - x is rounded to fp32 at x's magnitude: one ulp of |x| beside the relative slack on s / 2
    ulp = torch.finfo(torch.float32).eps * x.abs()
    assert bool(((q - x).abs() <= s / 2 * (1 + 1e-5) + ulp).all())
    assert torch.equal(quantize_activations(q, gran), q)


def _capture_inputs(model):
    seen = {}

    def rec(name):
        def hook(_m, args):
            seen[name] = args[0].detach().clone()

        return hook

    return seen, [m.register_forward_pre_hook(rec(n)) for n, m in target_linears(model).items()]


@pytest.mark.parametrize("simulation,unit", [("act-int8-tensor", PerTensor()), ("act-int8-token", PerRow())])
def test_every_block_projection_input_is_on_the_int8_grid(tiny_model_dir, simulation, unit):
    lm = load(tiny_model_dir, device="cpu").model
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = lm(ids, use_cache=False).logits
        with apply_simulation(lm, [simulation]) as stats:
            seen, hooks = _capture_inputs(lm)  # registered after the simulation's hooks: sees what the linear sees
            out = lm(ids, use_cache=False).logits
            for h in hooks:
                h.remove()
        after = lm(ids, use_cache=False).logits
    assert len(seen) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for name, x in seen.items():
        flat = x.reshape(-1, x.shape[-1])
        s = absmax_scale(flat, unit)
        codes = flat / torch.where(s > 0, s, torch.ones_like(s))
        assert torch.allclose(codes, codes.round(), atol=1e-3), name
        assert float(codes.abs().max()) <= 127.001
    assert not torch.equal(out, ref)  # it changed what the model computes
    assert torch.equal(after, ref)  # and removal leaves the model bit-identical
    assert stats[simulation]["linears"] == 14
    assert simulation_bits([simulation]) == (8, None)


def test_static_scales_come_from_the_calibration_forward(tiny_model_dir):
    lm = load(tiny_model_dir, device="cpu").model
    calib = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    lin = "model.layers.1.mlp.down_proj"
    seen = {}
    h = dict(lm.named_modules())[lin].register_forward_pre_hook(lambda _m, a: seen.setdefault("x", []).append(a[0].abs().amax()))
    with torch.no_grad():
        for row in calib:
            lm(row[None], use_cache=False)
    h.remove()
    expected = max(float(v) for v in seen["x"]) / 127
    context = SimulationContext(calibration_ids=calib)
    with torch.no_grad(), apply_simulation(lm, ["act-int8-static"], context) as stats:
        lm(calib[:1], use_cache=False)
    assert stats["act-int8-static"]["static_scales"][lin] == pytest.approx(expected, rel=1e-6)
    assert len(stats["act-int8-static"]["static_scales"]) == 14


def test_bad_inputs_one_line():
    for call in (
        lambda: get_simulation("act-int9-token"),
        lambda: get_simulation("act-int8-token", {"treshold": 6.0}),
        lambda: fake_quantize(torch.ones(2), torch.ones(()), bits=3),
        lambda: get_simulation("act-int8-static", {"calibration_samples": 0}),
    ):
        with pytest.raises(QkitError) as exc:
            call()
        assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="unknown run-time simulation 'act-int8-tokn'; did you mean act-int8-token\\? "):
        get_simulation("act-int8-tokn")
