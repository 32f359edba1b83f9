"""``qkit inspect outliers``: planted activations found in the right layers; INT8 levels by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.inspect.outliers import (
    analyse_hidden,
    default_prompt,
    int8_analysis,
    octave_bins,
    outlier_mask,
    persistent_outliers,
    residual_outliers,
    typical_dims,
)
from qkit.models import load

# h [T=4, H=5]; columns are dimensions. Maxima: d0 127, d1 1.0, d2 2.0, d3 3.0, d4 12.7.
H = torch.tensor(
    [
        # d0     d1    d2    d3    d4
        [127.0, 0.3, 2.0, 3.0, 12.7],
        [-50.0, -0.6, -2.0, 2.5, -6.3],
        [0.0, 1.0, 0.4, -1.2, 0.04],
        [3.0, 0.2, 1.6, 0.0, 1.27],
    ]
)


def test_octave_bins_by_hand():
    bins = octave_bins(torch.tensor([0.5, 1.0, 1.5, 3.0, 3.9, 4.0, 100.0]))
    assert [(b["lo"], b["hi"]) for b in bins] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128)]
    assert [b["count"] for b in bins] == [1, 2, 2, 1, 0, 0, 0, 1]
    assert [b["count"] for b in octave_bins(torch.tensor([0.1, 0.9]))] == [2]


def test_typical_dims_are_the_quartile_and_median_sized():
    # sorted maxima: d1 1.0, d2 2.0, d3 3.0, d4 12.7, d0 127 -> positions 1, 2, 3 of 0..4
    assert typical_dims(H.abs().amax(0)) == [2, 3, 4]


def test_int8_levels_match_a_hand_computation():
    r = int8_analysis(H, exclude_top=1)
    # all dims: scale = 127 / 127 = 1, q = round(h) (half to even: 2.5 -> 2)
    assert r["all"]["scale"] == 1.0
    # d0 {127,-50,0,3} d1 {0,-1,1} d2 {2,-2,0} d3 {3,2,-1,0} d4 {13,-6,0,1} -> 10 distinct values
    assert r["all"]["levels_used"] == 10
    assert [(t["dim"], t["levels"]) for t in r["all"]["typical"]] == [(2, 3), (3, 4), (4, 4)]
    # without d0: scale = 12.7 / 127 = 0.1; q = round(10 h):
    # d1 {3,-6,10,2} d2 {20,-20,4,16} d3 {30,25,-12,0} d4 {127,-63,0,13} -> 16 values, 0 twice -> 15
    assert r["excluded_dims"] == [0]
    assert r["without_top"]["scale"] == pytest.approx(0.1, rel=1e-6)
    assert r["without_top"]["levels_used"] == 15
    assert [(t["dim"], t["levels"]) for t in r["without_top"]["typical"]] == [(2, 4), (3, 4), (4, 4)]
    assert r["scale_shrink"] == pytest.approx(10.0, rel=1e-6)
    a = np.abs(H.numpy().astype(np.float64)).reshape(-1)
    assert r["abs_median"] == pytest.approx(np.percentile(a, 50))
    assert r["abs_p99"] == pytest.approx(np.percentile(a, 99))
    assert r["median_in_steps"] == pytest.approx(np.percentile(a, 50) / 1.0)
    with pytest.raises(InputError):
        int8_analysis(H, exclude_top=5)


def test_planted_hidden_tensor_outlier_layers():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 8, 32, generator=g)
    hidden[1:, 0, 5] = 1000.0  # dimension 5 from layer 1 on
    hidden[3, 2, 9] = -800.0  # dimension 9 only at layer 3
    r = analyse_hidden(hidden, exclude_top=2)
    assert r.layer == 2  # the middle one
    assert [p["outliers"] for p in r.per_layer] == [[], [5], [5], [5, 9]]
    dims = {d["dim"]: d for d in r.outlier_dims}
    assert dims[5]["layers"] == [1, 2, 3] and dims[5]["layer_ranges"] == "1-3" and dims[5]["peak"] == 1000.0
    assert dims[5]["near_peak_layers"] == "1-3"
    assert dims[9]["layers"] == [3]
    assert [d["dim"] for d in r.outlier_dims] == [5, 9]
    assert r.per_layer[3]["top"][0] == {"dim": 5, "value": 1000.0}
    assert sum(b["count"] for b in r.histogram) == 32
    assert r.histogram[-1]["lo"] == 512 and r.histogram[-1]["count"] == 1  # 1000 in [512, 1024)
    assert r.int8["excluded_dims"][0] == 5


def test_outlier_mask_threshold():
    m = torch.tensor([[1.0, 1.0, 1.0, 20.0, 19.9]])
    assert outlier_mask(m, 20.0).tolist() == [[False, False, False, True, False]]


def test_persistence_reports_values_per_layer():
    maxima = torch.tensor([[1.0, 1.0, 1.0], [1.0, 100.0, 1.0], [1.0, 98.0, 1.0], [1.0, 50.0, 1.0]])
    (d,) = persistent_outliers(maxima, outlier_mask(maxima, 20.0))
    assert d["dim"] == 1 and d["layers"] == [1, 2, 3] and d["near_peak_layers"] == "1-2"
    assert (d["value_first"], d["peak_layer"], d["value_last"]) == (100.0, 1, 50.0)


@pytest.fixture(scope="module")
def planted_model(tiny_model_dir):
    """The tiny model (2 layers) with embedding dimension 7 set to 300 for every token (present in the
    residual stream from the start) and dimension 3 forced to 5000 at the output of layer 1 by a hook."""
    loaded = load(tiny_model_dir, device="cpu")
    with torch.no_grad():
        loaded.model.model.embed_tokens.weight[:, 7] = 300.0

    def force(_mod, _args, output):
        h = output[0] if isinstance(output, tuple) else output
        h[..., 3] = 5000.0
        return output

    handle = loaded.model.model.layers[1].register_forward_hook(force)
    yield loaded
    handle.remove()


def test_planted_activation_found_in_the_right_layers(planted_model):
    r = residual_outliers(loaded=planted_model, prompt="The quick brown fox jumps over the lazy dog.")
    assert [p["outliers"] for p in r.per_layer] == [[7], [3, 7]]
    dims = {d["dim"]: d for d in r.outlier_dims}
    assert dims[7]["layers"] == [0, 1] and dims[3]["layers"] == [1]
    assert dims[3]["peak"] == 5000.0
    assert r.per_layer[1]["top"][0] == {"dim": 3, "value": 5000.0}
    assert r.int8["all"]["scale"] == pytest.approx(5000.0 / 127, rel=1e-6)


def test_default_prompt_is_about_80_tokens(tiny_model_dir):
    text = default_prompt()
    assert 300 < len(text) < 600 and text[0].isupper() and text.endswith(".")


def test_cli_outliers_json(tiny_model_dir, tmp_path):
    out = tmp_path / "o.json"
    res = CliRunner().invoke(app, ["inspect", "outliers", str(tiny_model_dir), "--prompt", "Paris is the capital of France.",
                                   "--layer", "0", "--exclude-top", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["layer"] == 0 and len(d["per_layer"]) == 2 and len(d["int8"]["excluded_dims"]) == 2
    assert "what tensor-wide INT8 does" in res.output


def test_cli_outliers_bad_layer_is_one_line(tiny_model_dir):
    res = CliRunner().invoke(app, ["inspect", "outliers", str(tiny_model_dir), "--prompt", "Hi there.", "--layer", "9"])
    assert res.exit_code == 2 and "--layer must be between 0 and 1" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_default_model_outlier_dimension():
    r = residual_outliers(device="cpu")
    mid = r.per_layer[r.layer]
    assert mid["max"] > 20_000
    top_dim = r.outlier_dims[0]
    assert top_dim["dim"] == mid["top"][0]["dim"]
    assert top_dim["n_layers"] >= len(r.per_layer) // 2
    assert r.int8["scale_shrink"] > 10
