"""The named simulation rows through ``qkit.evaluation.evaluate`` and ``qkit eval``: specs, bits columns,
statistics, one-line errors; one slow run on the real default model."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from qkit.cli import app
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.specs import RowSpec, resolve_rows
from qkit.evaluation.rows import ACTIVATIONS_PRESET

FAST = dict(tokens=96, battery_tokens=4, agree_tokens=2)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from conftest import TINY_TEXT

    f = tmp_path_factory.mktemp("corpus") / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return str(f)


def test_named_rows_and_the_activations_preset():
    specs = {s.name: s for s in resolve_rows(["activations"])}
    assert list(specs) == list(ACTIVATIONS_PRESET)
    assert specs["w8a8-tensor"] == RowSpec("int8-row", "rtn", ("act-int8-tensor",), "w8a8-tensor")
    assert specs["w8a8-token"].simulation == ("act-int8-token",) and specs["w8a8-token"].scheme == "int8-row"
    assert specs["llm-int8"] == RowSpec("int8-row", "rtn", ("llm-int8",), "llm-int8")
    assert specs["smoothquant-w8a8"] == RowSpec("int8-row", "smoothquant", ("act-int8-token",), "smoothquant-w8a8")
    assert specs["kv-int8"] == RowSpec(None, "rtn", ("kv-int8-token",), "kv-int8")
    assert specs["kv-int4"].simulation == ("kv-int4-channel",) and specs["kv-int4"].scheme is None
    assert specs["kv-int8-channel"].simulation == ("kv-int8-channel",) and specs["kv-int4-token"].simulation == ("kv-int4-token",)
    assert [s.name for s in resolve_rows(["w8a8-static", "kv-int4-channel"])] == ["w8a8-static", "kv-int4-channel"]


ROWS = ("int8-row", "w8a8-tensor", "w8a8-token", "llm-int8", "kv-int8", "kv-int4")
SIMULATION_OPTIONS = (("kv_group", 16), ("threshold", 2.0))


@pytest.fixture(scope="module")
def report(tiny_model_dir, corpus_file):
    return evaluate(tiny_model_dir, options=EvalOptions(schemes=ROWS, corpus=corpus_file, simulation_options=SIMULATION_OPTIONS, **FAST))


def test_simulation_rows_through_evaluate(report):
    by = {r.scheme: r for r in report.rows}
    assert list(by) == ["reference", *ROWS]
    for name in ROWS:
        assert math.isfinite(by[name].perplexity) and by[name].kld >= 0
    assert (by["int8-row"].act_bits, by["int8-row"].kv_bits) == (None, None)
    assert (by["w8a8-token"].act_bits, by["llm-int8"].act_bits, by["kv-int8"].kv_bits, by["kv-int4"].kv_bits) == (8, 8, 8, 4)
    # the same weights: W8A8 rows store exactly what int8-row stores; KV rows keep the reference's
    assert by["w8a8-token"].size_bytes == by["int8-row"].size_bytes == by["llm-int8"].size_bytes
    assert by["kv-int4"].bits_per_weight == by["reference"].bits_per_weight == 32.0
    # quantizing activations on top of int8 weights moves the distribution further than the weights alone
    assert by["w8a8-tensor"].kld > by["int8-row"].kld
    assert by["llm-int8"].simulation_stats["llm-int8"]["threshold"] == 2.0
    assert 0 < by["llm-int8"].simulation_stats["llm-int8"]["mac_fraction"] < 1
    kv = by["kv-int4"].simulation_stats["kv-int4-channel"]
    assert kv["calls_no_cache"] > 0 and kv["calls_decode"] > 0 and kv["group"] == 16
    assert by["kv-int4"].kld > 0


def test_cli_passes_simulation_options_and_adds_a_bits_column_only_for_simulation_rows(report, monkeypatch):
    import dataclasses

    import qkit.evaluation

    seen = {}

    def fake_evaluate(model, *, options, on_status=None):
        seen["options"] = options
        return seen.get("report", report)

    monkeypatch.setattr(qkit.evaluation, "evaluate", fake_evaluate)
    runner = CliRunner()
    sim = runner.invoke(app, ["eval", "--schemes", ",".join(ROWS), "--threshold", "2", "--kv-group", "16"])
    assert sim.exit_code == 0, sim.output
    assert seen["options"].simulation_options == SIMULATION_OPTIONS
    assert "A/KV bits" in sim.output and "A8" in sim.output and "KV4" in sim.output
    assert "groups of 16 tokens" in sim.output and "threshold 2:" in sim.output  # the simulations' summary notes
    seen["report"] = dataclasses.replace(report, rows=report.rows[:2])  # reference + int8-row only
    plain = runner.invoke(app, ["eval", "--schemes", "int8-row"])
    assert plain.exit_code == 0, plain.output
    assert "A/KV bits" not in plain.output and seen["options"].simulation_options == ()


@pytest.mark.parametrize("args,needle", [
    (["--schemes", "llm-int8", "--threshold", "0"], "--threshold must be a positive number"),
    (["--schemes", "kv-int8", "--kv-residual", "-1"], "--kv-residual must be an integer >= 0"),
    (["--schemes", "kv-int4", "--kv-group", "0"], "--kv-group must be an integer >= 1"),
    (["--schemes", "kv-int16"], "unknown scheme 'kv-int16'"),
])
def test_cli_bad_simulation_options_one_line_before_loading(args, needle, tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "no-such-model"), *args])
    text = (result.stdout or "") + (result.stderr or "")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and needle in lines[0], text  # the missing model was never touched


@pytest.mark.slow
def test_default_model_simulation_rows(default_model_dir):
    rows = ("w8a8-tensor", "llm-int8", "kv-int4")
    report = evaluate(default_model_dir, options=EvalOptions(schemes=rows, tokens=256, battery_tokens=4, agree_tokens=2))
    by = {r.scheme: r for r in report.rows}
    ref = by["reference"]
    for name in rows:
        r = by[name]
        assert math.isfinite(r.perplexity) and math.isfinite(r.perplexity_change_pct) and r.kld > 0
    assert by["w8a8-tensor"].act_bits == by["llm-int8"].act_bits == 8 and by["kv-int4"].kv_bits == 4
    # the outlier features of this model: LLM.int8 sends some columns to 16-bit and recovers most of
    # what per-tensor W8A8 loses
    assert by["llm-int8"].simulation_stats["llm-int8"]["linears_with_outliers"] > 0
    assert by["llm-int8"].kld < by["w8a8-tensor"].kld
    assert ref.perplexity < by["w8a8-tensor"].perplexity
