"""``qkit inspect outliers``' tie-back table: int8 levels of the linears' inputs under each W8A8 row."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from qkit.cli import app
from qkit.inspect.linear_inputs import linear_input_levels, linear_inputs_report
from qkit.models import load


def test_planted_outlier_levels_by_hand():
    # column 0 is 1000 in every token; each ordinary column reaches 1 (its token's maximum) once, 0.5 elsewhere
    x = torch.full((4, 5), 0.5)
    x[:, 0] = 1000.0
    for t in range(4):
        x[t, t + 1] = 1.0
    r = linear_input_levels(x, torch.ones(5), alpha=0.5, threshold=6.0)
    assert r["max"] == 1000.0 and r["median_dim_max"] == 1.0 and r["max_over_median"] == 1000.0
    # per tensor and per token: step 1000/127 = 7.9, every ordinary value rounds to 0 -> 1 level
    assert r["levels"]["per_tensor"] == 1 and r["levels"]["per_token"] == 1
    # LLM.int8: column 0 to 16-bit; per token over the rest, each column reaches its token's max: 127 -> 255
    assert r["llm_int8_columns"] == 1 and r["levels"]["llm_int8"] == 255
    # SmoothQuant (|W| = 1): s = sqrt(max|x|): column 0 becomes sqrt(1000) = 31.6, the others stay <= 1;
    # per token: 1 * 127 / 31.6 = 4.02 -> code 4 -> 9 levels; the max/median ratio falls to 1000^(1 - 0.5)
    assert r["levels"]["smoothquant"] == 9
    assert r["max_over_median_smoothed"] == pytest.approx(math.sqrt(1000), rel=1e-5)


def test_no_column_above_the_threshold():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    r = linear_input_levels(x, torch.ones(2))
    assert r["llm_int8_columns"] == 0 and r["levels"]["llm_int8"] == r["levels"]["per_token"]
    everything = linear_input_levels(torch.full((2, 3), 7.0), torch.ones(3))  # every column to 16-bit
    assert everything["llm_int8_columns"] == 3 and everything["levels"]["llm_int8"] is None


def test_every_projection_input_of_the_tiny_model(tiny_model_dir):
    loaded = load(tiny_model_dir, device="cpu")
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    rows = linear_inputs_report(loaded.model, ids)
    assert [(r["layer"], r["input"]) for r in rows] == [
        (l, src) for l in (0, 1) for src in ("input_layernorm", "o_proj input", "post_attention_layernorm", "down_proj input")
    ]
    assert [r["linears"] for r in rows[:4]] == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    for r in rows:
        assert 1 <= r["levels"]["per_tensor"] <= r["levels"]["per_token"] <= 255  # a token's max never exceeds the tensor's
        assert r["smoothed"] == (r["input"] in ("input_layernorm", "post_attention_layernorm"))
        if not r["smoothed"]:
            assert r["levels"]["smoothquant"] == r["levels"]["per_token"]


def test_cli_prints_the_table(tiny_model_dir):
    result = CliRunner().invoke(app, ["inspect", "outliers", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    assert "INT8 levels the typical dimension spans under each W8A8 row" in result.output
    assert "median over the 8 inputs of the levels a typical dimension spans" in result.output
