"""qkit kv: the formula with known values, the attention variants, and --measure equal to the formula."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError, ModelLoadError
from qkit.serving.kv import (
    architecture_from_config,
    cache_tensors,
    kv_bytes_per_token,
    kv_report,
    measure_kv,
)

# Qwen2.5-0.5B's published config (the fields the cache depends on, plus its real sizes).
QWEN25_05B = {
    "model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False,
}


@pytest.fixture
def qwen_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN25_05B))
    return p


def test_formula_known_values():
    assert kv_bytes_per_token(24, 2, 64, 2) == 12_288
    assert kv_bytes_per_token(24, 2, 64, 2) * 295 == 3_624_960
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080  # SmolLM2-135M in fp32


def test_report_from_config_qwen(qwen_config):
    r = kv_report(config=qwen_config, tokens=295, users=3, dtype="fp16")
    a = r.architecture
    assert (a.layers, a.kv_heads, a.head_dim, a.heads) == (24, 2, 64, 14)  # head_dim = 896 / 14
    assert r.bytes_per_token == 12_288
    assert r.total_bytes == 3_624_960 * 3
    by = {v["kv_heads"]: v for v in r.variants}
    assert by[14]["bytes_per_token"] == 2 * 24 * 14 * 64 * 2 == 86_016  # MHA: 7x the GQA cache
    assert by[14]["relative_to_model"] == 7.0
    assert by[1]["bytes_per_token"] == 6_144  # MQA
    totals = {s["total_bytes"] for s in r.equivalent_splits}
    assert totals == {12_288 * 65_536}
    assert [(s["users"], s["tokens"]) for s in r.equivalent_splits] == [(32, 2048), (64, 1024), (128, 512)]


def test_dtypes_and_fallback_names():
    a = architecture_from_config({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768})
    assert (a.kv_heads, a.head_dim) == (12, 64)  # no kv-head field: full multi-head attention
    assert a.kv_bytes_per_token("fp32") == 2 * 12 * 12 * 64 * 4
    assert a.kv_bytes_per_token("bf16") == 2 * 12 * 12 * 64 * 2
    assert a.kv_bytes_per_token("fp8") == 2 * 12 * 12 * 64 * 1
    mq = architecture_from_config({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8,
                                   "hidden_size": 64, "multi_query": True})
    assert mq.kv_heads == 1 and mq.attention == "MQA"


def test_bad_inputs(qwen_config, tmp_path):
    with pytest.raises(InputError, match="either MODEL or --config"):
        kv_report(model="x", config=qwen_config)
    with pytest.raises(InputError, match="unknown cache dtype"):
        kv_report(config=qwen_config, dtype="int3")
    with pytest.raises(InputError, match="at least 1"):
        kv_report(config=qwen_config, tokens=0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        kv_report(config=bad)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 3, "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="kv heads|not a multiple of num_key_value_heads"):
        kv_report(config=odd)


def test_measure_tiny_model_equals_formula(tiny_model_dir):
    # tiny llama: 2 layers, 2 kv heads, head dim 64/4 = 16 -> 2*2*2*16*2 = 256 B per fp16 token.
    m = measure_kv(model=str(tiny_model_dir), tokens=37, dtype="fp16")
    assert m["bytes"] == 256 * 37 == 9_472
    assert m["tensors"] == 4 and m["shape"] == [1, 2, 37, 16] and m["dtype"] == "float16"
    r = kv_report(model=str(tiny_model_dir), tokens=37, measure=True, dtype="fp32")
    assert r.measured["bytes"] == r.measured["formula_bytes"] == 512 * 37
    assert r.measured["matches_formula"] is True


def test_cache_tensors_legacy_tuples():
    k = torch.zeros(1, 2, 5, 4, dtype=torch.float16)
    assert len(cache_tensors(((k, k.clone()), (k.clone(), k.clone())))) == 4
    with pytest.raises(ModelLoadError):
        cache_tensors(object())


@pytest.mark.slow
def test_measure_qwen_architecture_from_config(tmp_path):
    # Qwen2.5-0.5B's attention shapes (everything the cache depends on), small MLP and vocabulary so
    # the random model builds fast: the measured cache of 295 tokens is the 3,624,960 bytes.
    cfg = {**QWEN25_05B, "intermediate_size": 64, "vocab_size": 512}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = kv_report(config=p, tokens=295, measure=True)
    assert r.measured["bytes"] == 3_624_960 == r.total_bytes
    assert r.measured["shape"] == [1, 2, 295, 64]


@pytest.mark.slow
def test_measure_default_model(default_model_dir):
    r = kv_report(model=str(default_model_dir), tokens=295, measure=True)
    assert r.bytes_per_token == 23_040  # 2 * 30 * 3 * 64 * 2
    assert r.measured["bytes"] == 23_040 * 295 == 6_796_800


def test_cli_kv_json_and_errors(qwen_config):
    runner = CliRunner()
    res = runner.invoke(app, ["kv", "--config", str(qwen_config), "--tokens", "295", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert data["bytes_per_token"] == 12_288 and data["total_bytes"] == 3_624_960
    res = runner.invoke(app, ["kv", "somemodel", "--config", str(qwen_config)])
    assert res.exit_code == 2
    assert "either MODEL or --config" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["kv", "--config", str(qwen_config), "--measure", "--dtype", "fp8"])
    assert res.exit_code == 2 and "fp16, bf16 or fp32" in res.output
