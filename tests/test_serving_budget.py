"""qkit budget: stored bytes equal qkit's own storage, preset parameter counts, fits and refusals at the boundary."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.schemes import get_scheme, quantize_tensor
from qkit.serving.budget import (
    GIB,
    PRESETS,
    budget,
    directory_shapes,
    fit_status,
    llama_shapes,
    max_tokens,
    stored_bytes,
    weight_bytes,
)
from qkit.serving.kv import architecture_from_config

SHAPES = [(128, 256), (64, 72), (3, 5), (96, 1536), (7,), (2, 3, 40)]


@pytest.mark.parametrize("scheme", ["int8-row", "int8-tensor", "int4-row", "int4-tensor", "int4-g128", "int8-g64", "nf4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_stored_bytes_equal_quantized_tensor(scheme, shape):
    # Oracle: the bytes of the tensors qkit actually stores for that weight.
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert stored_bytes(get_scheme(scheme), shape) == quantize_tensor(w, get_scheme(scheme)).nbytes


def test_bits_per_weight_formulas():
    def bpw(name, shape):
        return 8 * stored_bytes(get_scheme(name), shape) / (shape[0] * shape[1])

    assert bpw("int4-g128", (256, 4096)) == 4 + 16 / 128
    assert bpw("nf4", (256, 4096)) == 4.25
    assert bpw("int8-row", (256, 4096)) == 8 + 16 / 4096
    assert bpw("int4-g128", (10, 576)) == 4 + 5 * 16 / 576  # 576 = 4.5 groups: five scales per row


def test_preset_parameter_counts():
    counts = {k: sum(torch.Size(s).numel() for _, s in llama_shapes(architecture_from_config(v, k))) for k, v in PRESETS.items()}
    # Published counts of the models whose layouts the presets follow.
    assert counts == {"7b": 7_241_732_096, "13b": 13_015_864_320, "70b": 68_976_648_192}
    a13 = architecture_from_config(PRESETS["13b"])
    assert (a13.layers, a13.kv_heads, a13.heads, a13.head_dim) == (40, 40, 40, 128)
    assert a13.kv_bytes_per_token("fp16") == 819_200


def test_qwen_config_parameter_count(tmp_path):
    # Qwen2.5-0.5B's config.json (q/k/v biases, tied embeddings): its published 494,032,768 parameters.
    cfg = {"model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = budget(configs=[p], gpus_gib=[1], formats=["fp16"])
    assert r.models[0]["parameters"] == 494_032_768
    assert r.tables[0].rows[0].kv_bytes_per_token == 12_288


def test_config_layout_matches_real_checkpoint(tiny_model_dir):
    # The analytic llama layout of a config equals the shapes stored in the safetensors headers.
    arch = architecture_from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert sorted(llama_shapes(arch)) == sorted(directory_shapes(tiny_model_dir))


def test_quantized_checkpoint_reports_original_shapes(tiny_model_dir, tmp_path):
    from qkit.api import quantize_model

    quantize_model(str(tiny_model_dir), output=tmp_path / "q", scheme="nf4")
    assert sorted(directory_shapes(tmp_path / "q")) == sorted(directory_shapes(tiny_model_dir))


def test_weight_bytes_split(tiny_model_dir):
    shapes = directory_shapes(tiny_model_dir)
    fp16 = weight_bytes(shapes, "fp16")
    nf4 = weight_bytes(shapes, "nf4")
    assert fp16.total_bytes == 2 * fp16.parameters and fp16.quantized_parameters == 0
    # 14 block projections are quantized; embeddings and norms stay fp16.
    proj = [(n, s) for n, s in shapes if n.endswith("proj.weight")]
    assert len(proj) == 14 and nf4.quantized_parameters == sum(torch.Size(s).numel() for _, s in proj)
    expect = sum(stored_bytes(get_scheme("nf4"), s) for _, s in proj) + 2 * (nf4.parameters - nf4.quantized_parameters)
    assert nf4.total_bytes == expect
    with pytest.raises(InputError, match="unknown weight format"):
        weight_bytes(shapes, "int2")


def test_fit_boundary_units():
    W, R, kv = 1_000_000, 1000, 256
    assert max_tokens(W + R + 10 * kv, W, R, kv) == 10
    assert max_tokens(W + R + 10 * kv - 1, W, R, kv) == 9
    assert max_tokens(W + R, W, R, kv) == 0
    assert fit_status(W + R, W, R, 0, 4096) == "no room for cache"
    assert fit_status(W + R - 1, W, R, 0, 4096) == "does not fit"
    assert fit_status(W + R + 10 * kv, W, R, 10, 10) == "fits"
    assert fit_status(W + R + 10 * kv, W, R, 10, 11) == "fits, < 1 conversation"


def test_budget_boundary_end_to_end(tiny_model_dir):
    cfg = tiny_model_dir / "config.json"
    w = weight_bytes(llama_shapes(architecture_from_config(json.loads(cfg.read_text()))), "fp16").total_bytes
    kv = 256  # 2 layers x 2 kv heads x 16 x 2 bytes x 2
    reserve = 1024
    conv = 100
    # Exact byte counts as GiB: dividing by 2**30 is exact in binary floating point.
    gpus = [(w + reserve + conv * kv) / GIB, (w + reserve + conv * kv - 1) / GIB, (w + reserve) / GIB, (w + reserve - 1) / GIB]
    r = budget(configs=[cfg], gpus_gib=gpus, reserve_gib=reserve / GIB, formats=["fp16"], conversation=conv)
    got = [(t.rows[0].max_tokens, t.rows[0].status) for t in r.tables]
    assert got == [(100, "fits"), (99, "fits, < 1 conversation"), (0, "no room for cache"), (0, "does not fit")]
    assert "misleading" in r.tables[1].sentence and "(99 tokens)" in r.tables[1].sentence
    assert "every row that fits" in r.tables[0].sentence
    assert r.tables[0].rows[0].kv_bytes_per_token == kv


def test_budget_presets_default_and_misleading():
    r = budget(gpus_gib=[8])
    rows = {(x.model, x.format): x for x in r.tables[0].rows}
    assert len(rows) == 12
    assert rows[("7b", "fp16")].status == "does not fit"  # 13.5 GiB of weights
    assert rows[("13b", "int4-g128")].misleading  # weights fit in 8 GiB, a few hundred tokens left
    assert rows[("7b", "int4-g128")].status == "fits"
    assert "13b int4-g128" in r.tables[0].sentence


def test_bad_inputs():
    with pytest.raises(InputError, match="unknown preset"):
        budget(presets=["3b"])
    with pytest.raises(InputError, match="positive card sizes"):
        budget(gpus_gib=[0])
    with pytest.raises(InputError, match="reserve"):
        budget(reserve_gib=-1)


def test_cli(tiny_model_dir):
    runner = CliRunner()
    res = runner.invoke(app, ["budget", str(tiny_model_dir), "--gpu", "1", "--preset", "7b", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert [m["label"] for m in data["models"]] == ["7b", "model"]
    assert data["tables"][0]["rows"][0]["status"] == "does not fit"
    res = runner.invoke(app, ["budget", "--gpu", "8,x"])
    assert res.exit_code == 2 and "comma-separated numbers" in res.output


def test_chapter_reproduces_the_chapters_figures():
    # The chapter: nominal parameters, every weight at the format's bits, a 1.5 GiB reserve, GiB cards.
    # By hand: 13B int4 on 8 GiB: (8 * 2**30 - 13e9 * 4.125 / 8 - 1.5 * 2**30) / 819,200 = 337.15 -> 337;
    # 7B int8 on 16 GiB: (16 * 2**30 - 7e9 - 1.5 * 2**30) / 131,072 (Mistral-7B: 8 kv heads) = 65,378.3;
    # 13B int8 on 16 GiB: (16 * 2**30 - 13e9 - 1.5 * 2**30) / 819,200 = 3,136.3.
    r = budget(chapter=True, gpus_gib=[8, 16], formats=["int8", "int4-g128"])
    rows = {(t.gpu_gib, row.model, row.format): row for t in r.tables for row in t.rows}
    assert rows[(8, "13b", "int4-g128")].max_tokens == 337
    assert rows[(16, "7b", "int8")].max_tokens == 65_378
    assert rows[(16, "13b", "int8")].max_tokens == 3_136
    assert rows[(8, "13b", "int4-g128")].weight_bytes == 6_703_125_000
    assert (rows[(16, "7b", "int8")].kv_bytes_per_token, rows[(16, "13b", "int8")].kv_bytes_per_token) == (131_072, 819_200)
    assert r.reserve_gib == 1.5 and "1.5 GiB reserve" in r.assumptions
    assert rows[(16, "7b", "int8")].projection_bits_per_weight == 8.0
    assert rows[(8, "13b", "int4-g128")].projection_bits_per_weight == 4.125
    # The default is unchanged: real parameter counts and a 1 GiB reserve give other numbers.
    d = budget(gpus_gib=[16], formats=["int8"])
    assert d.reserve_gib == 1.0 and d.assumptions is None and "assumptions" not in d.to_dict()
    assert {row.model: row.max_tokens for row in d.tables[0].rows}["13b"] != 3_136


def test_chapter_cli_states_its_assumptions():
    runner = CliRunner()
    res = runner.invoke(app, ["budget", "--chapter", "--gpu", "8,16", "--formats", "int8,int4-g128"])
    assert res.exit_code == 0, res.output
    assert "the chapter's assumptions (--chapter): nominal parameters (7b = 7e9, 13b = 13e9, 70b = 70e9)" in res.stdout
    assert "qkit budget: 8 GiB card, 1.5 GiB reserve, fp16 cache (the chapter's assumptions)" in res.stdout
    lines = res.stdout.splitlines()
    assert any("13b" in l and "int4-g128" in l and " 337 " in l for l in lines)
    assert any("7b" in l and "int8" in l and " 65,378 " in l for l in lines)
    assert any("13b" in l and "int8" in l and " 3,136 " in l for l in lines)
    # --reserve given on the command line wins over the chapter's 1.5 GiB
    res = runner.invoke(app, ["budget", "--chapter", "--reserve", "1", "--gpu", "16", "--json", "-"])
    assert json.loads(res.stdout[res.stdout.index("{"):])["reserve_gib"] == 1.0


@pytest.mark.parametrize("fmt", ["int4-g64", "q8_0", "q4_k_m", "mxfp4", "nvfp4"])
def test_block_formats_price_what_quantize_writes(tiny_model_dir, tmp_path, fmt):
    # Oracle: the bytes quantize_model stores for the block projections (q4_k_m: bound to the model's
    # layer count, each tensor's type chosen by the recipe and the width fallback).
    from qkit.api import quantize_model

    r = quantize_model(str(tiny_model_dir), output=tmp_path / "q", scheme=fmt, collect=True)
    w = weight_bytes(directory_shapes(tiny_model_dir), fmt)
    assert w.quantized_bytes == sum(q.nbytes for q in r.quantized.values())
    assert w.quantized_parameters == sum(q.numel for q in r.quantized.values())


def test_q4_k_m_on_the_7b_preset_by_hand():
    # llama.cpp's Q4_K_M on 32 layers: attn_v and ffn_down of layers 0-3, 28-31 and 6, 9, ..., 27 (16 layers)
    # in Q6_K (210 bytes per 256 weights), every other projection Q4_K (144 per 256); all widths are
    # multiples of 256 (4096, 14336), so no fallback. The whole file: the untied token embedding (32000 x
    # 4096) at the recipe's type, Q4_K, and the head (output) at Q6_K, as llama-quantize writes them.
    w = weight_bytes(llama_shapes(architecture_from_config(PRESETS["7b"], "7b")), "q4_k_m")
    q6 = 16 * (1024 * 4096 + 4096 * 14336)
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
    embedding = 32000 * 4096
    assert w.quantized_parameters == 32 * per_layer + 2 * embedding
    assert w.quantized_bytes == (q6 // 256 * 210 + (32 * per_layer - q6) // 256 * 144
                                 + embedding // 256 * 144 + embedding // 256 * 210)
    assert w.fp16_parameters == 65 * 4096  # the norms


def test_chapter_prices_fixed_rate_formats_only():
    r = budget(presets=["13b"], gpus_gib=[8], formats=["mxfp4"], chapter=True)
    assert r.tables[0].rows[0].weight_bytes == 13 * 10**9 * 17 // 32  # 4.25 bits, every weight
    assert "mxfp4 = 4.25" in r.assumptions
    with pytest.raises(InputError, match="fixed-rate formats only"):
        budget(presets=["13b"], gpus_gib=[8], formats=["q4_k_m"], chapter=True)
