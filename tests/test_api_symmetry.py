"""The library and the command line hold the same rules: a script calling ``quantize_model`` / ``plan_model``
meets every refusal ``qkit quantize`` / ``qkit plan`` gives, in the same one line, and gets the same files.

Each refusal is asked of both with the same bad input; the CLI's line is ``error: `` and the library's
``QkitError`` message. Every one comes before the model is resolved (``tripwire``), and leaves nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from adversarial import Unchanged, assert_refused, invoke, tripwire
from qkit.api import QuantizeOptions, plan_model, quantize_model
from qkit.errors import QkitError
from qkit.executors import ExecutorOptions
from qkit.plan import PlanOptions
from qkit.staging import TMP_MARK

PLAN_FAST = ["--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "1"]
PLAN_FAST_OPTIONS = dict(samples=2, seqlen=32, check_windows=1)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the model is resolved: these refusals come before any work."""
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")


def _same_refusal(cli_args: list, call, tmp_path: Path, model: Path) -> str:
    """The CLI's one line for ``cli_args`` and the library's message for ``call()``: the same; nothing written."""
    with Unchanged(inputs=[model], dirs=[tmp_path]):
        line = assert_refused(invoke(*cli_args))
    with Unchanged(inputs=[model], dirs=[tmp_path]), pytest.raises(QkitError) as err:
        call()
    assert line == f"error: {err.value}"
    return line


# --------------------------------------------------------------------------- quantize


def test_dtype_with_rtn_is_refused_alike(tiny_model_dir, tmp_path, no_work):
    out = tmp_path / "out"
    line = _same_refusal(
        ["quantize", tiny_model_dir, "-s", "int8-row", "--dtype", "bf16", "-o", out],
        lambda: quantize_model(tiny_model_dir, output=out,
                               options=QuantizeOptions(scheme="int8-row", method_options={"dtype": "bf16"})),
        tmp_path, tiny_model_dir)
    assert "rtn streams the weights and never runs the model: drop --dtype" in line


def test_dtype_with_rtn_and_a_plan_file_is_refused_alike(tiny_model_dir, tmp_path, no_work):
    """A plan file does not run the model either: only a plan made first (``--target-bits``) takes --dtype."""
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    plan.write_text("{}")
    _same_refusal(
        ["quantize", tiny_model_dir, "--plan", plan, "--dtype", "bf16", "-o", out],
        lambda: quantize_model(tiny_model_dir, output=out,
                               options=QuantizeOptions(plan=str(plan), method_options={"dtype": "bf16"})),
        tmp_path, tiny_model_dir)


@pytest.mark.parametrize("fmt, name", [("gguf", "q.gguf"), ("qkit", "q")])
def test_emit_tensor_types_equal_to_o_is_refused_alike(tiny_model_dir, tmp_path, no_work, fmt, name):
    q = tmp_path / name
    line = _same_refusal(
        ["quantize", tiny_model_dir, "-s", "q8_0", "--format", fmt, "-o", q, "--emit-tensor-types", q],
        lambda: quantize_model(tiny_model_dir, output=q,
                               options=QuantizeOptions(scheme="q8_0", format=fmt, emit_tensor_types=q)),
        tmp_path, tiny_model_dir)
    assert line == f"error: --emit-tensor-types {q} is the same path as -o {q}; one would replace the other: give each " \
                   "output its own path"


def test_emit_tensor_types_holding_o_is_refused_alike(tiny_model_dir, tmp_path, no_work):
    """It may lie inside a directory ``-o`` (written once that is in place), never hold it."""
    q = tmp_path / "t" / "q"
    _same_refusal(
        ["quantize", tiny_model_dir, "-s", "q8_0", "-o", q, "--emit-tensor-types", tmp_path / "t"],
        lambda: quantize_model(tiny_model_dir, output=q,
                               options=QuantizeOptions(scheme="q8_0", emit_tensor_types=tmp_path / "t")),
        tmp_path, tiny_model_dir)


def test_emit_tensor_types_without_llama_types_is_refused_alike_before_the_write(tiny_model_dir, tmp_path):
    """int8-row is none of llama.cpp's types: no tensor would have a line, refused before anything is written
    (the command line once wrote the checkpoint first)."""
    out, tt = tmp_path / "out", tmp_path / "tt.txt"
    line = _same_refusal(
        ["quantize", tiny_model_dir, "-s", "int8-row", "-o", out, "--emit-tensor-types", tt],
        lambda: quantize_model(tiny_model_dir, output=out, options=QuantizeOptions(scheme="int8-row", emit_tensor_types=tt)),
        tmp_path, tiny_model_dir)
    assert line == "error: --emit-tensor-types needs llama.cpp names: a llama or qwen2 model quantized with llama.cpp types"


def test_quantize_model_writes_the_tensor_type_file_the_cli_writes(tiny_model_dir, tmp_path):
    cli, lib = tmp_path / "cli", tmp_path / "lib"
    r = invoke("quantize", tiny_model_dir, "-s", "q4_k_m", "--format", "gguf", "-o", cli / "q.gguf",
               "--emit-tensor-types", cli / "types.txt")
    assert r.code == 0, r.text
    assert f"wrote {cli / 'types.txt'}: llama-quantize --tensor-type-file" in r.stdout
    result = quantize_model(tiny_model_dir, output=lib / "q.gguf",
                            options=QuantizeOptions(scheme="q4_k_m", format="gguf", emit_tensor_types=lib / "types.txt"))
    assert result.tensor_types == lib / "types.txt"
    assert result.to_dict()["tensor_types"] == str(lib / "types.txt")
    written = (lib / "types.txt").read_text()
    assert written == (cli / "types.txt").read_text()
    assert written.split() and all(w.startswith("^") and "$=" in w for w in written.split())
    assert (lib / "q.gguf").read_bytes() == (cli / "q.gguf").read_bytes()


def test_emit_tensor_types_may_lie_inside_a_directory_output(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = quantize_model(tiny_model_dir, output=out,
                            options=QuantizeOptions(scheme="q8_0", emit_tensor_types=out / "types.txt"))
    assert result.tensor_types == out / "types.txt" and (out / "types.txt").read_text().split()
    assert (out / "model.safetensors").is_file()


def test_quantize_model_removes_what_killed_runs_left_and_says_so(tiny_model_dir, tmp_path, caplog):
    """The stale staging siblings beside -o are removed by the library (a script gets it too), before the
    model is read; the ``qkit`` logger says so, which the command line shows as a status line."""
    stale = tmp_path / f".out{TMP_MARK}999999999-deadbeef"
    stale.mkdir()
    with caplog.at_level(logging.INFO, logger="qkit"):
        quantize_model(tiny_model_dir, output=tmp_path / "out", options=QuantizeOptions(scheme="int8-row"))
    assert not os.path.lexists(stale)
    said = [r.getMessage() for r in caplog.records if "temporary director" in r.getMessage()]
    assert said == [f"removed 1 temporary directory of killed runs (their writer process is gone): {stale}"]


# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize("args, options, needle", [
    (["--format", "gguf", "--method", "awq"], dict(format="gguf", method="awq"), "awq chooses codes per type"),
    (["--format", "qkit", "--emit-tensor-types", "{tt}"], dict(format="qkit", emit_tensor_types="{tt}"),
     "--emit-tensor-types writes llama-quantize's --tensor-type-file: plan --format gguf"),
    (["--format", "compressed-tensors", "--method", "imatrix"], dict(format="compressed-tensors", method="imatrix"),
     "the importance matrix weights llama.cpp's types"),
    (["--format", "gguf", "--executor", "dask"], dict(format="gguf", executor=ExecutorOptions("dask")),
     "unknown executor 'dask'"),
    (["--format", "gguf", "--dtype", "fp8"], dict(format="gguf", dtype="fp8"), "fp8"),
])
def test_plan_with_a_bad_option_is_refused_alike(tiny_model_dir, tmp_path, no_work, args, options, needle):
    out, tt = tmp_path / "p.json", str(tmp_path / "tt.txt")
    given = {k: v.format(tt=tt) if isinstance(v, str) else v for k, v in options.items()}
    line = _same_refusal(
        ["plan", tiny_model_dir, "--target-bits", "6", *PLAN_FAST, *[a.format(tt=tt) for a in args], "-o", out],
        lambda: plan_model(tiny_model_dir, output=out, options=PlanOptions(target_bits=6.0, **PLAN_FAST_OPTIONS, **given)),
        tmp_path, tiny_model_dir)
    assert needle in line


def test_plan_emit_tensor_types_equal_to_o_is_refused_alike(tiny_model_dir, tmp_path, no_work):
    p = tmp_path / "p.json"
    line = _same_refusal(
        ["plan", tiny_model_dir, "--format", "gguf", "--target-bits", "6", *PLAN_FAST, "-o", p, "--emit-tensor-types", p],
        lambda: plan_model(tiny_model_dir, output=p,
                           options=PlanOptions(format="gguf", target_bits=6.0, emit_tensor_types=p, **PLAN_FAST_OPTIONS)),
        tmp_path, tiny_model_dir)
    assert "--emit-tensor-types" in line and "-o" in line


def test_a_plan_made_first_takes_its_run_settings_from_the_quantize(tiny_model_dir, tmp_path, no_work):
    """``QuantizeOptions.plan`` as ``PlanOptions`` is run with the quantize's method, matrix and device: the
    same setting given in the plan's options too is refused, never one of them silently dropped."""
    with pytest.raises(QkitError) as err:
        quantize_model(tiny_model_dir, output=tmp_path / "out",
                       options=QuantizeOptions(plan=PlanOptions(format="qkit", target_bits=6.0, method="gptq",
                                                                **PLAN_FAST_OPTIONS)))
    assert str(err.value) == ("a plan made first by quantize runs with the quantize's own settings; give method in "
                              "QuantizeOptions, not in its PlanOptions")
    assert list(tmp_path.iterdir()) == []
