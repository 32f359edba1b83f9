"""Resolving MODEL arguments: directories, qkit checkpoints, .gguf files, hub ids, the pinned default."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkit import assets
from qkit.api import quantize_model
from qkit.errors import InputError, ModelLoadError
from qkit.texts import load_corpus
from qkit.models import resolve
from qkit.pinned_models import DEFAULT


def test_directory_and_checkpoint_kinds(tiny_model_dir, tmp_path):
    assert resolve(tiny_model_dir).kind == "directory"
    quantize_model(tiny_model_dir, output=tmp_path / "q", scheme="int8-row")
    ref = resolve(tmp_path / "q")
    assert ref.kind == "qkit" and ref.is_quantized


def test_quantizing_a_checkpoint_again_is_refused(tiny_model_dir, tmp_path):
    quantize_model(tiny_model_dir, output=tmp_path / "q", scheme="int8-row")
    with pytest.raises(InputError, match="already a qkit checkpoint"):
        quantize_model(tmp_path / "q", output=tmp_path / "q2")


def test_a_plain_file_is_not_a_model(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("hi")
    with pytest.raises(InputError, match="neither a model directory nor a .gguf"):
        resolve(f)


def test_hub_dataset_unreachable_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="local text file"):
        load_corpus("hf:nobody-qkit-test/no-such-dataset")


def test_python_dash_m_qkit_runs():
    proc = subprocess.run([sys.executable, "-m", "qkit", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "quantize" in proc.stdout and "eval" in proc.stdout


def test_cache_dir_follows_qkit_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "a"))
    assert assets.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("QKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x" / "qkit"


@pytest.mark.slow
def test_default_model_is_the_pinned_smollm2(default_model_dir):
    from qkit.checkpoint import tensor_shapes
    from qkit.models import read_config
    from qkit.transform import is_block_projection

    config = read_config(default_model_dir)
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert sum(is_block_projection(n, s) for n, s in tensor_shapes(default_model_dir)) == 210
    # the cached GGUF is verified by sha256 on every use
    assert assets.sha256_file(DEFAULT.asset.path) == DEFAULT.asset.sha256


@pytest.mark.slow
def test_a_gguf_path_resolves_to_the_same_cached_conversion(default_model_dir):
    ref = resolve(DEFAULT.asset.path)
    assert ref.kind == "gguf" and ref.directory == default_model_dir
