"""``qkit inspect next-token``: temperature takes roots of probability ratios."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.inspect.nexttoken import next_token, parse_temperatures, top_k_at
from qkit.models import load


def test_top_k_by_hand():
    ids, probs = top_k_at(torch.tensor([0.0, 2.0, 1.0, -1.0]), 3, 1.0)
    z = sum(math.exp(x) for x in (0, 2, 1, -1))
    assert ids == [1, 2, 0]
    assert probs == pytest.approx([math.exp(2) / z, math.exp(1) / z, 1 / z], rel=1e-12)
    _, p2 = top_k_at(torch.tensor([0.0, 2.0, 1.0, -1.0]), 3, 2.0)
    assert p2[0] / p2[2] == pytest.approx(math.exp(1.0), rel=1e-12)  # (2 - 0) / 2


def test_ratio_at_t2_is_the_square_root_of_the_ratio_at_t1(tiny_model_dir):
    loaded = load(tiny_model_dir, device="cpu")
    with torch.no_grad():  # a sharper distribution than the random init's near-uniform one
        loaded.model.lm_head.weight.mul_(30.0)
    r = next_token(loaded=loaded, text="The quick brown fox", top=5, temperatures="1,2,4")
    t1, t2, t4 = r.rows
    assert t1["ratio_first_third"] > 1.5
    assert t2["ratio_first_third"] == pytest.approx(math.sqrt(t1["ratio_first_third"]), rel=1e-6)
    assert t4["ratio_first_third"] == pytest.approx(t1["ratio_first_third"] ** 0.25, rel=1e-6)
    assert [t["id"] for t in t1["tokens"]] == [t["id"] for t in t2["tokens"]]  # same order at every T
    for row in r.rows:
        probs = [t["prob"] for t in row["tokens"]]
        assert probs == sorted(probs, reverse=True) and sum(probs) < 1
    assert t2["tokens"][0]["prob"] < t1["tokens"][0]["prob"]  # hotter: flatter


def test_parse_temperatures():
    assert parse_temperatures("1,2") == [1.0, 2.0]
    assert parse_temperatures([0.5]) == [0.5]
    for bad in ("", "0", "1,-2", "hot"):
        with pytest.raises(InputError):
            parse_temperatures(bad)


def test_cli_next_token(tiny_model_dir, tmp_path):
    out = tmp_path / "n.json"
    res = CliRunner().invoke(app, ["inspect", "next-token", str(tiny_model_dir), "Paris is the capital of", "--top", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert [row["temperature"] for row in d["rows"]] == [1.0, 2.0] and len(d["rows"][0]["tokens"]) == 4
    assert "first / third" in res.output
    res = CliRunner().invoke(app, ["inspect", "next-token", str(tiny_model_dir), "Paris", "--top", "2"])
    assert res.exit_code == 2 and "--top must be at least 3" in res.output
