"""Bad input through the CLI: one line naming the problem and the fix, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from qkit.cli import app

runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, list(args))
    return result, (result.stdout or "") + (result.stderr or "")


def assert_clean_error(result, text: str, *needles: str) -> None:
    assert result.exit_code != 0, text
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text  # one line
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, lines[0])


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    out = tmp_path / "out"
    result, text = run("quantize", str(tmp_path / "nope"), "-o", str(out))
    assert_clean_error(result, text, "no such file or directory", "nope")
    assert not out.exists()


def test_unknown_scheme_lists_valid_names(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result, text = run("quantize", str(tiny_model_dir), "--scheme", "int3-row", "-o", str(out))
    assert_clean_error(result, text, "unknown scheme", "int8-tensor", "int8-row", "int4-tensor", "int4-row", "int4-g128", "nf4")
    assert not out.exists()


def test_malformed_config_json(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path / "m")
    (model / "config.json").write_text("{ not json")
    out = tmp_path / "out"
    result, text = run("quantize", str(model), "-o", str(out))
    assert_clean_error(result, text, "malformed", "config.json")
    assert not out.exists()


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path / "m")
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    result, text = run("quantize", str(model), "-o", str(out))
    assert_clean_error(result, text, "model.safetensors", "truncated or corrupt")
    assert not out.exists()
    assert not list(tmp_path.glob(".out.qkit-tmp-*"))  # no temporary leftovers either


def test_corrupt_safetensors_header(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    result, text = run("quantize", str(model), "-o", str(tmp_path / "out"))
    assert_clean_error(result, text, "truncated or corrupt")


def test_unreachable_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    result, text = run("quantize", "nobody-qkit-test/definitely-not-a-model", "-o", str(out))
    assert_clean_error(result, text, "hugging face hub", "local model directory")
    assert not out.exists()


def test_existing_output_directory_is_refused_and_untouched(tiny_model_dir, tmp_path):
    # Not something qkit wrote: --force would not help either, so the refusal does not suggest it.
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out))
    assert_clean_error(result, text, "already exists", "not something qkit wrote")
    assert "--force" not in text
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_existing_qkit_output_is_refused_with_a_force_hint(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out), "--scheme", "int8-row")
    assert result.exit_code == 0, text
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out), "--scheme", "int8-row")
    assert_clean_error(result, text, "already exists", "--force")


def test_force_replaces_a_qkit_output(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out), "--scheme", "int8-row")
    assert result.exit_code == 0, text
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out), "--force", "--scheme", "int4-row")
    assert result.exit_code == 0, text
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["scheme"]["name"] == "int4-row"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the replaced output is gone, no sibling left


def test_force_refuses_a_directory_qkit_did_not_write(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    result, text = run("quantize", str(tiny_model_dir), "-o", str(out), "--force", "--scheme", "int8-row")
    assert_clean_error(result, text, "not something qkit wrote")
    assert "--force" not in text
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and (out / "old.txt").read_text() == "old"


def test_pinned_asset_hash_mismatch(tmp_path, monkeypatch):
    import dataclasses

    from qkit import pinned_models

    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cache"))
    bad = dataclasses.replace(pinned_models.DEFAULT,
                              asset=dataclasses.replace(pinned_models.DEFAULT.asset, member_sha256="0" * 64))
    # Plant a cached file where the bad pin points, so no download is needed: its hash cannot match.
    bad.asset.path.parent.mkdir(parents=True)
    bad.asset.path.write_bytes(b"not the model")
    monkeypatch.setattr(pinned_models, "DEFAULT", bad)
    out = tmp_path / "out"
    result, text = run("quantize", "-o", str(out))
    assert_clean_error(result, text, "sha256", "expected " + "0" * 64)
    assert not out.exists()


def test_non_finite_weight_names_the_tensor(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path / "m")
    from safetensors.torch import load_file

    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(model / "model.safetensors"))
    out = tmp_path / "out"
    result, text = run("quantize", str(model), "-o", str(out))
    assert_clean_error(result, text, name, "nan or infinite")
    assert not out.exists()


def test_pickled_weights_are_refused_without_flag(tmp_path, tiny_model_dir):
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model / "config.json")
    torch.save({"x": torch.zeros(1)}, model / "pytorch_model.bin")
    result, text = run("quantize", str(model), "-o", str(tmp_path / "out"))
    assert_clean_error(result, text, "pickled", "--allow-pickle")


def test_missing_output_option(tiny_model_dir):
    result, text = run("quantize", str(tiny_model_dir))
    assert_clean_error(result, text, "-o/--output")


def test_bad_keep_rule(tiny_model_dir, tmp_path):
    result, text = run("quantize", str(tiny_model_dir), "-o", str(tmp_path / "o"), "--keep", "int8")
    assert_clean_error(result, text, "SCHEME:GLOB")


def test_eval_unknown_scheme_fails_before_any_work(tiny_model_dir):
    result, text = run("eval", str(tiny_model_dir), "--schemes", "int8-row,bogus")
    assert result.exit_code != 0 and "unknown scheme 'bogus'" in text and "Traceback" not in text


def test_quantize_json_to_stdout(tiny_model_dir, tmp_path):
    result = runner.invoke(app, ["quantize", str(tiny_model_dir), "-o", str(tmp_path / "o"), "--scheme", "int4-row", "--json", "-"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["matrices"] == 14 and data["scheme"] == "int4-row"
    # int4-row on widths 64 (q,k,v,o,gate,up) and 160 (down): bits = 4 + 16/in per matrix, weighted by size
    assert 4.0 < data["bits_per_weight"] < 4.3


@pytest.mark.parametrize(
    "args, needle",
    [
        (["quantize", "--bogus"], "No such option: --bogus"),
        (["eval", "--tokens", "abc"], "Invalid value for '--tokens'"),
        (["inspect", "next-token"], "Missing argument"),
    ],
)
def test_usage_errors_are_one_line_from_the_real_entry_point(args, needle):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "qkit", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bare_command_shows_help_and_exits_zero():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "qkit"], capture_output=True, text=True)
    assert proc.returncode == 0 and "quantize" in proc.stdout
