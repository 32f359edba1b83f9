"""SmoothQuant (qkit.methods.smoothquant): folding keeps the fp model; the outlier ratio falls as predicted."""

from __future__ import annotations

import pytest
import torch

from qkit.api import quantize_model
from qkit.errors import InputError, SchemeError
from qkit.methods import get_method, make_options
from qkit.methods.smoothquant import SmoothQuantOptions, smooth_model
from qkit.models import load
from qkit.schemes import get_scheme


def _ids(n=4, length=32, seed=0):
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(seed))


def _targets(model, scheme="int8-row"):
    s = get_scheme(scheme)
    return {n: s for n, p in model.named_parameters() if p.dim() == 2 and "_proj" in n}


@pytest.mark.parametrize("linear_groups", [False, True])
def test_folding_leaves_fp_logits_unchanged(tiny_model_dir, linear_groups):
    model = load(tiny_model_dir).model
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    res = smooth_model(model, ids, _targets(model), SmoothQuantOptions(linear_groups=linear_groups))
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert (after - before).abs().max() / before.abs().max() < 1e-5
    assert res.record["folded"] == (8 if linear_groups else 4)
    assert set(res.replaced) >= {"model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"}


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_planted_outlier_ratio_falls_by_the_predicted_factor(tiny_model_dir, alpha):
    """Input channel 7 of layer 0's q/k/v planted ~1000x (its norm weight), q/k/v columns of one magnitude:
    then ``max|X_j|/s_j = (max|X_j| · w)^(1-α)`` with ``w`` the same for every column, so the max/median
    ratio after smoothing is the ratio before raised to ``1 - α`` (max and median commute with a power)."""
    model = load(tiny_model_dir).model
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight[7] = 1000.0
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            lin.weight.copy_(torch.sign(lin.weight) * 0.02)
    res = smooth_model(model, _ids(), _targets(model), SmoothQuantOptions(alpha=alpha))
    rec = res.record["groups"]["model.layers.0.self_attn.qkv"]
    assert rec["outlier_ratio_before"] > 300
    assert rec["outlier_ratio_after"] == pytest.approx(rec["outlier_ratio_before"] ** (1 - alpha), rel=1e-3)


def test_checkpoint_round_trip_and_record(tiny_model_dir, tmp_path):
    out = tmp_path / "sq"
    res = quantize_model(tiny_model_dir, output=out, scheme="int8-row", method="smoothquant",
                         method_options={"alpha": 0.6, "calibration_samples": 4, "calibration_seqlen": 32}, collect=True)
    rec = load(out).manifest["method"]
    assert rec["name"] == "smoothquant" and rec["options"]["alpha"] == 0.6
    assert rec["calibration"]["disjoint_from"]["name"] == "qkit-heldout-v1"  # checked against every eval domain
    assert "outlier_ratio_after" in rec["groups"]["model.layers.0.self_attn.qkv"]
    assert res.schemes_used == {"int8-row": 14}


@pytest.mark.parametrize("alpha", [-0.01, 1.01, 2])
def test_alpha_outside_unit_interval_is_refused_before_anything_is_written(tiny_model_dir, tmp_path, alpha):
    with pytest.raises(InputError, match=r"--alpha must be in \[0, 1\]") as exc:
        quantize_model(tiny_model_dir, output=tmp_path / "o", scheme="int8-row", method="smoothquant",
                       method_options={"alpha": alpha})
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "o").exists()


def test_non_absmax_scheme_is_refused():
    with pytest.raises(SchemeError, match="smoothquant writes symmetric integer weights"):
        get_method("smoothquant").check(get_scheme("nf4"))


def test_options_are_the_calibration_options_of_gptq():
    opts = make_options(get_method("smoothquant"), {"calibration_samples": 8, "calibration_seqlen": 64})
    assert opts.calibration_options().samples == 8 and opts.alpha == 0.5


def test_smoothquant_w8a8_row_runs_in_eval(tiny_model_dir, tmp_path):
    """The named row (int8-row weights after folding, int8 per-token activations) through the eval runner."""
    from conftest import TINY_TEXT

    from qkit.evaluation import EvalOptions, evaluate

    corpus = tmp_path / "text.txt"
    corpus.write_text(TINY_TEXT * 3)
    report = evaluate(tiny_model_dir, options=EvalOptions(schemes=("w8a8-token", "smoothquant-w8a8"), corpus=str(corpus),
                                                          tokens=128, battery_tokens=4))
    rows = {r.scheme: r for r in report.rows}
    assert set(rows) == {"reference", "w8a8-token", "smoothquant-w8a8"}
    sq = rows["smoothquant-w8a8"]
    assert sq.act_bits == 8 and sq.weights_changed == 14 + 4  # 14 matrices and the 4 folded norms
    assert sq.kld > 0
