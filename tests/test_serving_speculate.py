"""qkit speculate: expected tokens per pass and speedup, known values, and the eval-JSON path."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.serving.speculate import BANDWIDTH_ASSUMPTION, expected_tokens, speculate, speedup


def test_known_values():
    assert speedup(0.9, 8, 0.1) == pytest.approx(3.4032195, abs=1e-6)
    assert f"{speedup(0.9, 8, 0.1):.2f}" == "3.40"
    assert f"{speedup(0.3, 8, 0.1):.2f}" == "0.79"
    assert expected_tokens(0.9, 8) == pytest.approx((1 - 0.9**9) / 0.1)
    assert expected_tokens(1.0, 4) == 5.0  # every draft token accepted, plus the target's own
    assert expected_tokens(0.0, 4) == 1.0  # nothing accepted: the target's token only


@given(st.floats(0, 0.999), st.integers(1, 16))
def test_expected_tokens_is_the_geometric_series(alpha, gamma):
    # Independent form: token i (0..gamma) is produced when the first i draft tokens were all accepted.
    assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)), rel=1e-9)


def test_alpha_rows_and_slower_flag():
    r = speculate(alphas=[0.9, 0.3], gammas=[8, 1], cost=0.1)
    rows = {(x.draft, x.gamma): x for x in r.rows}
    assert r.gammas == [1, 8]
    assert rows[("alpha=0.9", 8)].speedup == pytest.approx(3.4032195, abs=1e-6) and not rows[("alpha=0.9", 8)].slower
    assert rows[("alpha=0.3", 8)].slower and rows[("alpha=0.3", 8)].speedup == pytest.approx(0.7936352, abs=1e-6)
    # alpha 0.3, gamma 1: (1 + 0.3) / 1.1 = 1.1818 > 1, the best for that draft
    assert r.best["alpha=0.3"] == {"gamma": 1, "speedup": pytest.approx(1.3 / 1.1)}
    assert r.assumption is None


@pytest.fixture
def eval_json(tmp_path):
    rows = [
        {"scheme": "reference", "bits_per_weight": 32.0, "agreement": 100, "agreement_total": 100},
        {"scheme": "int8-row", "bits_per_weight": 8.0, "agreement": 90, "agreement_total": 100,
         "agreement_ci95": [0.8256, 0.9448]},
        {"scheme": "int4-tensor", "bits_per_weight": 4.0, "agreement": 12, "agreement_total": 100},
        {"scheme": "nf4", "bits_per_weight": 4.25, "agreement": 0.75, "agreement_total": 80},
    ]
    p = tmp_path / "eval.json"
    p.write_text(json.dumps({"rows": rows, "provenance": {}}))
    return p


def test_from_eval(eval_json):
    r = speculate(from_eval=eval_json, gammas=[4])
    rows = {x.draft: x for x in r.rows}
    assert set(rows) == {"int8-row", "int4-tensor", "nf4"}
    i8 = rows["int8-row"]
    assert (i8.alpha, i8.cost) == (0.9, 0.25)  # 90/100; 8 / 32 bits per weight
    assert i8.speedup == pytest.approx((1 - 0.9**5) / 0.1 / 2.0)
    assert i8.speedup_low == pytest.approx(speedup(0.8256, 4, 0.25))  # the eval's Wilson interval
    assert i8.speedup_high == pytest.approx(speedup(0.9448, 4, 0.25))
    assert rows["int4-tensor"].slower  # alpha 0.12: (1 - 0.12^5)/0.88 / 1.5 = 0.758
    assert rows["int4-tensor"].speedup == pytest.approx((1 - 0.12**5) / 0.88 / 1.5)
    nf4 = rows["nf4"]
    assert nf4.alpha == 0.75 and nf4.cost == pytest.approx(4.25 / 32)  # a float agreement is a fraction
    assert nf4.alpha_se == pytest.approx((0.75 * 0.25 / 80) ** 0.5)
    assert r.assumption == BANDWIDTH_ASSUMPTION
    assert {x.cost for x in speculate(from_eval=eval_json, gammas=[4], cost=0.05).rows} == {0.05}


def test_bad_inputs(tmp_path, eval_json):
    with pytest.raises(InputError, match="not both"):
        speculate(alphas=[0.5], from_eval=eval_json)
    with pytest.raises(InputError, match="not both"):
        speculate()
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        speculate(alphas=[1.5])
    with pytest.raises(InputError, match="positive integers"):
        speculate(alphas=[0.5], gammas=[0])
    no_ref = tmp_path / "e.json"
    no_ref.write_text(json.dumps({"rows": [{"scheme": "nf4", "bits_per_weight": 4.25, "agreement": 1, "agreement_total": 2}]}))
    with pytest.raises(InputError, match="reference"):
        speculate(from_eval=no_ref)
    with pytest.raises(InputError, match="no such eval file"):
        speculate(from_eval=tmp_path / "missing.json")


def test_cli(eval_json):
    runner = CliRunner()
    res = runner.invoke(app, ["speculate", "--alpha", "0.9", "--alpha", "0.3", "--gamma", "8", "--cost", "0.1"])
    assert res.exit_code == 0, res.output
    assert "3.40x" in res.output and "0.79x SLOWER" in res.output
    res = runner.invoke(app, ["speculate", "--from", str(eval_json)])
    assert res.exit_code == 0, res.output
    assert "bandwidth" in res.output
    res = runner.invoke(app, ["speculate", "--alpha", "0.5", "--gamma", "1,x"])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
