"""Every option check that needs no model runs before the model is touched.

Each case passes a MODEL path that does not exist: had the command resolved (fetched, converted, loaded)
its model before checking the option, the error would name the missing path instead of the option.
Each refusal is one line, exit code 2, and takes well under the time a model load takes.
"""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from qkit.cli import app

MISSING = "/nonexistent-qkit-model"
runner = CliRunner()

CASES = [
    # quantize
    (["quantize", MISSING, "-o", "OUT", "--format", "bogus"], "unknown format 'bogus'"),
    (["quantize", MISSING, "-o", "OUT", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
    (["quantize", MISSING, "-o", "OUT", "--threads", "0"], "--threads must be at least 1"),
    (["quantize", MISSING, "-o", "OUT", "--scheme", "int3-row"], "unknown scheme 'int3-row'"),
    (["quantize", MISSING, "-o", "OUT", "--keep", "int8"], "SCHEME:GLOB"),
    (["quantize", MISSING, "-o", "OUT", "--device", "bogus"], "unknown device 'bogus'"),
    # eval
    (["eval", MISSING, "--window", "1"], "--window must be at least 2"),
    (["eval", MISSING, "--tokens", "1"], "--tokens must be at least 3"),
    (["eval", MISSING, "--agree-tokens", "0"], "--agree-tokens must be at least 1"),
    (["eval", MISSING, "--schemes", "int8-row,bogus"], "'bogus'"),
    (["eval", MISSING, "--scale-dtype", "fp7"], "scale dtype 'fp7'"),
    (["eval", MISSING, "--device", "bogus"], "unknown device 'bogus'"),
    (["eval", MISSING, "--device-map", "everywhere"], "unknown device map 'everywhere'"),
    (["eval", MISSING, "--threads", "0"], "--threads must be at least 1"),
    # verify
    (["verify", MISSING, "--threads", "0"], "--threads must be at least 1"),
    # inspect
    (["inspect", "errors", MISSING, "-s", "int3-row"], "unknown scheme 'int3-row'"),
    (["inspect", "errors", MISSING, "--scale-dtype", "fp7"], "scale dtype 'fp7'"),
    (["inspect", "errors", MISSING, "--threads", "0"], "--threads must be at least 1"),
    (["inspect", "matrix", MISSING, "--top", "0"], "--top must be at least 1"),
    (["inspect", "matrix", MISSING, "model.layers.0.mlp.up_proj.weight", "-s", "int3-row"], "unknown scheme 'int3-row'"),
    (["inspect", "outliers", MISSING, "--threshold", "1"], "--threshold must be above 1"),
    (["inspect", "outliers", MISSING, "--exclude-top", "-1"], "--exclude-top must be at least 0"),
    (["inspect", "outliers", MISSING, "--prompt", "x", "--corpus-tokens", "5"], "either --prompt or --corpus-tokens"),
    (["inspect", "outliers", MISSING, "--corpus-tokens", "0"], "--corpus-tokens must be at least 1"),
    (["inspect", "outliers", MISSING, "--device-map", "everywhere"], "unknown device map"),
    (["inspect", "sensitivity", MISSING, "-s", "int4-row", "--tokens", "1"], "--tokens must be at least 2"),
    (["inspect", "sensitivity", MISSING, "-s", "int4-row", "--by", "column"], "--by must be one of"),
    (["inspect", "sensitivity", MISSING, "-s", "int4-row", "--suggest", "-1"], "--suggest must be at least 0"),
    (["inspect", "sensitivity", MISSING, "-s", "int4-row", "--keep-scheme", "int3"], "unknown scheme 'int3'"),
    (["inspect", "sensitivity", MISSING, "-s", "int4-row", "--device", "bogus"], "unknown device 'bogus'"),
    (["inspect", "next-token", MISSING, "hello", "--top", "2"], "--top must be at least 3"),
    (["inspect", "next-token", MISSING, "hello", "--temperature", "0"], "--temperature takes"),
    (["inspect", "next-token", MISSING, "hello", "--device", "bogus"], "unknown device 'bogus'"),
    # serving
    (["kv", MISSING, "--measure", "--dtype", "fp8"], "--measure runs the model in the cache dtype"),
    (["kv", MISSING, "--tokens", "0"], "--tokens and --users must be at least 1"),
    (["kv", MISSING, "--measure", "--device", "bogus"], "unknown device 'bogus'"),
    (["kv", MISSING, "--measure", "--threads", "0"], "--threads must be at least 1"),
    (["bench", MISSING, "--repeats", "0"], "--repeats must be positive"),
    (["bench", MISSING, "--threads", "0"], "--threads must be at least 1"),
    (["bench", MISSING, "--device", "bogus"], "unknown device 'bogus'"),
    (["budget", MISSING, "--reserve", "-1"], "--reserve must be >= 0"),
    (["budget", MISSING, "--chapter"], "--chapter applies the chapter's nominal sizes to the presets"),
    (["budget", MISSING, "--gpu", "0"], "--gpu needs positive card sizes"),
]


@pytest.mark.parametrize("args, needle", CASES, ids=[" ".join(a[:3]) + " " + " ".join(a[-2:]) for a, _ in CASES])
def test_bad_option_is_refused_before_the_model(args, needle, tmp_path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    t0 = time.perf_counter()
    result = runner.invoke(app, args)
    seconds = time.perf_counter() - t0
    text = (result.stdout or "") + (result.stderr or "")
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert result.exit_code == 2, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert needle in lines[0], (needle, lines[0])
    assert MISSING not in lines[0]  # the model was never looked at
    assert seconds < 3, f"{seconds:.1f} s"
    assert not (tmp_path / "out").exists()


def test_default_model_is_not_loaded_for_a_bad_window(monkeypatch):
    # Without MODEL the default model would be fetched, converted and loaded; none of it may happen.
    import qkit.models

    def no_resolve(*_a, **_k):
        raise AssertionError("the model was resolved before the options were checked")

    monkeypatch.setattr(qkit.models, "resolve", no_resolve)
    monkeypatch.setattr("qkit.evaluation.runner.resolve", no_resolve)
    result = runner.invoke(app, ["eval", "--window", "1"])
    assert result.exit_code == 2 and "--window must be at least 2" in result.stderr, result.output
