"""Integer KV caches in ``qkit kv`` and ``qkit budget``: codes plus one fp16 scale per token and kv head."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import QkitError
from qkit.serving.budget import budget
from qkit.serving.kv import architecture_from_config, check_options, head_bytes_per_token, kv_formula

SMOL = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152}


def test_bytes_per_token_by_hand():
    assert head_bytes_per_token("fp16", 64) == 128
    assert head_bytes_per_token("int8", 64) == 64 + 2  # 64 one-byte codes + an fp16 scale
    assert head_bytes_per_token("int4", 64) == 32 + 2  # 64 half-byte codes + an fp16 scale
    assert head_bytes_per_token("int4", 63) == 32 + 2  # an odd head dim rounds up to whole bytes
    arch = architecture_from_config(SMOL, "smol")
    # the default model: 2 x 30 layers x 3 kv heads x bytes per head
    assert arch.kv_bytes_per_token("fp16") == 2 * 30 * 3 * 128 == 23_040
    assert arch.kv_bytes_per_token("int8") == 2 * 30 * 3 * 66 == 11_880  # 0.516x of fp16: the scales cost 3%
    assert arch.kv_bytes_per_token("int4") == 2 * 30 * 3 * 34 == 6_120  # 0.266x
    assert kv_formula(30, 3, 64, "int4").startswith("2 x 30 x 3 x (64 x 4/8 + 2)")


def test_budget_with_integer_caches():
    by = {}
    for dtype in ("fp16", "int8", "int4"):
        r = budget(presets=["7b"], gpus_gib=[16], formats=["int4-g128"], kv_dtype=dtype)
        by[dtype] = r.tables[0].rows[0]
        assert r.kv_dtype == dtype
    # the 7b preset: 32 layers, 8 kv heads of dim 128
    assert by["fp16"].kv_bytes_per_token == 2 * 32 * 8 * 256 == 131_072
    assert by["int8"].kv_bytes_per_token == 2 * 32 * 8 * 130 == 66_560
    assert by["int4"].kv_bytes_per_token == 2 * 32 * 8 * 66 == 33_792
    for dtype, row in by.items():
        assert row.max_tokens == row.free_bytes // row.kv_bytes_per_token
    assert by["int4"].max_tokens > by["int8"].max_tokens > by["fp16"].max_tokens


def test_cli_budget_int4_and_bad_dtypes():
    runner = CliRunner()
    ok = runner.invoke(app, ["budget", "--preset", "7b", "--gpu", "16", "--kv-dtype", "int4"])
    assert ok.exit_code == 0, ok.output
    assert "int4 cache" in ok.output and "33,792 B" in ok.output
    bad = runner.invoke(app, ["budget", "--kv-dtype", "int3"])
    lines = [line for line in bad.output.strip().splitlines() if line.strip()]
    assert bad.exit_code != 0 and len(lines) == 1 and "int8, int4" in lines[0]


def test_measure_refuses_an_integer_cache_in_one_line():
    with pytest.raises(QkitError, match="int8 cache has no torch dtype") as exc:
        check_options(dtype="int8", measure=True)
    assert "\n" not in str(exc.value)
    check_options(dtype="int4")  # the formula alone is fine
