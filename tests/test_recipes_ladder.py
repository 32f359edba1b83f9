"""llama.cpp's file types (q2_k-llama ... q5_k_m): the type every tensor gets, as ``llama_tensor_get_type``.

Oracles: (1) hand-checked tables read off ``src/llama-quant.cpp`` (``llama_tensor_get_type_impl``, then
``tensor_type_fallback``) for the default model (SmolLM2-135M: 30 layers, hidden 576, intermediate 1536,
9 / 3 heads, tied embeddings), a Qwen2-0.5B-like model (24 layers, hidden 896, intermediate 4864,
14 / 2 heads: n_gqa 7, tied) and Llama-70B; (2) llama.cpp's own snapshots of its type choice
(``tests/snapshots/*.schema`` of the pinned source, written by ``test-quant-type-selection`` from
``llama_quant_compute_types``) for Llama-3.1-70B, Qwen3-0.6B, Qwen3-14B and Gemma-3-4B, where the
reference source is in the qkit cache. The tables are of ggml types (``llama_type``); every type they
name must be a registered scheme.
"""

from __future__ import annotations

import json
from collections import Counter

import gguf
import pytest
import torch
from helpers_recipes import (
    GGUF_PROJ,
    LLAMA70_CONFIG,
    SNAPSHOT_MODELS,
    SNAPSHOTS,
    read_snapshot,
    recipe,
    type_names,
)

from qkit.errors import SchemeError
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.base import Recipe
from qkit.schemes.recipes import (
    DEFAULT_TYPES,
    RECIPES,
    LlamaRecipe,
    assignment,
    llama_types,
    type_counts,
)
from qkit.schemes.llama_log import llama_quantize_types
from qkit.schemes.llama_rules import ModelFacts, Params, tensor_type_fallback, tensor_types, use_more_bits
from qkit.schemes.registry import REGISTRY, scheme_from_dict

T = gguf.GGMLQuantizationType
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")
SHORT = {p: p.split(".")[1] for p in PROJ}  # q_proj, ..., down_proj
FTYPE_OF = {"iq1_s-llama": "IQ1_S", "iq1_m-llama": "IQ1_M", "iq2_xxs-llama": "IQ2_XXS", "iq2_xs-llama": "IQ2_XS",
            "iq2_s-llama": "IQ2_S", "iq2_m": "IQ2_M", "q2_k-llama": "Q2_K", "iq3_xxs-llama": "IQ3_XXS", "iq3_xs": "IQ3_XS",
            "iq3_s-llama": "IQ3_S", "iq3_m": "IQ3_M", "q3_k_s": "Q3_K_S", "q3_k_m": "Q3_K_M", "q3_k_l": "Q3_K_L",
            "iq4_nl-llama": "IQ4_NL", "iq4_xs-llama": "IQ4_XS", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S",
            "q5_k_m": "Q5_K_M", "tq1_0-llama": "TQ1_0", "tq2_0-llama": "TQ2_0", "mxfp4_moe": "MXFP4_MOE"}


def model_shapes(n_layers, hidden, inter, heads, kv, head_dim, vocab, tied):
    """A llama/qwen2 checkpoint's 2-D weights, Hugging Face names, ``[out, in]`` shapes (``in`` = ggml's ne[0])."""
    q, k = heads * head_dim, kv * head_dim
    per = {"q_proj": (q, hidden), "k_proj": (k, hidden), "v_proj": (k, hidden), "o_proj": (hidden, q),
           "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    out = [("model.embed_tokens.weight", (vocab, hidden))] + ([] if tied else [("lm_head.weight", (vocab, hidden))])
    return out + [(f"model.layers.{i}.{p}.weight", per[SHORT[p]]) for i in range(n_layers) for p in PROJ]


DEFAULT_CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "tie_word_embeddings": True, "hidden_size": 576, "intermediate_size": 1536}
DEFAULT_SHAPES = model_shapes(30, 576, 1536, 9, 3, 64, 49152, tied=True)
QWEN2_CONFIG = {"model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                "tie_word_embeddings": True}
QWEN2_SHAPES = model_shapes(24, 896, 4864, 14, 2, 64, 151936, tied=True)
LLAMA70_SHAPES = model_shapes(80, 8192, 28672, 64, 8, 128, 128256, tied=False)


def expand(table: dict, n_layers: int) -> dict[str, str]:
    """``{proj: "TYPE" | (layers, "TYPE there", "TYPE elsewhere")}`` -> ``{hf name: "TYPE"}`` for every projection."""
    out = {}
    for i in range(n_layers):
        for p in PROJ:
            rule = table[SHORT[p]]
            out[f"model.layers.{i}.{p}.weight"] = rule if isinstance(rule, str) else (rule[1] if i in rule[0] else rule[2])
    return out


def _uniform(t, down, v=None, o=None, qkgu=None):
    """A table: every 576/896-wide projection ``t`` unless given, down_proj ``down``."""
    qkgu = qkgu or t
    return {"q_proj": qkgu, "k_proj": qkgu, "gate_proj": qkgu, "up_proj": qkgu, "v_proj": v or t, "o_proj": o or t,
            "down_proj": down}


# ------------------------------------------------------------------ the default model, by hand

# n = 30: n/8 = 3, 7n/8 = 26, n/16 = 1 (C integer division); use_more_bits: i < 3, i >= 26, (i - 3) % 3 == 2.
MORE30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
# Widths: q, k, v, o, gate, up are 576 wide (not whole 256-blocks: Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0,
# Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL); down_proj is 1536 = 6 * 256 wide (no fallback).
# n_gqa = 9 / 3 = 3 < 4: no n_gqa rule applies.
DEFAULT_TABLE = {
    "Q2_K": _uniform("Q4_0", "Q3_K"),  # Q2_K -> Q4_0; attn_v, attn_output Q3_K -> Q4_0; ffn_down Q3_K
    "Q3_K_S": _uniform("Q4_0", "Q3_K"),
    "Q3_K_M": _uniform("Q4_0", ({0}, "Q5_K", "Q4_K"), v=({0, 1}, "Q5_1", "Q5_0"), o="Q5_0"),
    "Q3_K_L": _uniform("Q4_0", "Q5_K", v="Q5_1", o="Q5_1"),
    "IQ4_NL": _uniform("IQ4_NL", ({0, 1, 2}, "Q5_K", "IQ4_NL")),
    "IQ4_XS": _uniform("IQ4_NL", ({0, 1, 2}, "Q5_K", "IQ4_XS")),
    "Q4_K_S": _uniform("Q5_0", ({0, 1, 2}, "Q5_K", "Q4_K"), v=({0, 1, 2, 3}, "Q5_1", "Q5_0")),
    "Q4_K_M": _uniform("Q5_0", (MORE30, "Q6_K", "Q4_K"), v=(MORE30, "Q8_0", "Q5_0")),
    "Q5_K_S": _uniform("Q5_1", "Q5_K"),
    "Q5_K_M": _uniform("Q5_1", (MORE30, "Q6_K", "Q5_K"), v=(MORE30, "Q8_0", "Q5_1")),
    "Q6_K": _uniform("Q8_0", "Q6_K"),
    "Q8_0": _uniform("Q8_0", "Q8_0"),
    "TQ1_0": _uniform("Q4_0", "TQ1_0"),  # TQ1_0 -> Q4_0 below 256-blocks
    "TQ2_0": _uniform("Q4_0", "TQ2_0"),
    "MXFP4_MOE": _uniform("Q8_0", "Q8_0"),  # no expert tensor: Q8_0 throughout
}
# The same, counted by hand over the 210 projections.
DEFAULT_COUNTS = {
    "Q2_K": {"Q4_0": 180, "Q3_K": 30},
    "Q3_K_S": {"Q4_0": 180, "Q3_K": 30},
    "Q3_K_M": {"Q4_0": 120, "Q5_0": 58, "Q4_K": 29, "Q5_1": 2, "Q5_K": 1},
    "Q3_K_L": {"Q4_0": 120, "Q5_1": 60, "Q5_K": 30},
    "IQ4_NL": {"IQ4_NL": 207, "Q5_K": 3},
    "IQ4_XS": {"IQ4_NL": 180, "IQ4_XS": 27, "Q5_K": 3},
    "Q4_K_S": {"Q5_0": 176, "Q4_K": 27, "Q5_1": 4, "Q5_K": 3},
    "Q4_K_M": {"Q5_0": 166, "Q4_K": 16, "Q8_0": 14, "Q6_K": 14},
    "Q5_K_S": {"Q5_1": 180, "Q5_K": 30},
    "Q5_K_M": {"Q5_1": 166, "Q5_K": 16, "Q8_0": 14, "Q6_K": 14},
    "Q6_K": {"Q8_0": 180, "Q6_K": 30},
    "Q8_0": {"Q8_0": 210},
    "TQ1_0": {"Q4_0": 180, "TQ1_0": 30},
    "TQ2_0": {"Q4_0": 180, "TQ2_0": 30},
    "MXFP4_MOE": {"Q8_0": 210},
    # only down_proj (1536 wide) takes a 256-block type; attn_v Q2_K -> Q4_0, the first 3 down_proj Q2_K / IQ3_S
    "IQ1_S": {"IQ4_NL": 150, "Q4_0": 30, "IQ1_S": 27, "Q2_K": 3},  # o_proj IQ2_XXS -> IQ4_NL
    "IQ1_M": {"IQ4_NL": 150, "Q4_0": 30, "IQ1_M": 27, "Q2_K": 3},
    "IQ2_XXS": {"IQ4_NL": 150, "Q4_0": 30, "IQ2_XXS": 27, "Q2_K": 3},
    "IQ2_XS": {"IQ4_NL": 150, "Q4_0": 30, "IQ2_XS": 27, "Q2_K": 3},
    "IQ2_S": {"IQ4_NL": 180, "IQ2_XS": 27, "IQ3_S": 3},
    "IQ2_M": {"IQ4_NL": 180, "IQ2_S": 27, "IQ3_S": 3},
    "IQ3_XXS": {"IQ4_NL": 180, "Q3_K": 27, "Q4_K": 3},  # without an imatrix: down_proj Q4_K for the first eighth, Q3_K
    "IQ3_XS": {"IQ4_NL": 180, "IQ3_S": 30},
    "IQ3_S": {"IQ4_NL": 180, "IQ3_S": 30},
    "IQ3_M": {"IQ4_NL": 120, "Q5_0": 60, "IQ3_S": 27, "Q4_K": 3},  # attn_v and o_proj Q4_K -> Q5_0
}


@pytest.mark.parametrize("ftype", list(DEFAULT_TABLE))
def test_default_model_every_projection_by_hand(ftype):
    got = type_names(recipe(ftype, DEFAULT_CONFIG), DEFAULT_SHAPES)
    want = expand(DEFAULT_TABLE[ftype], 30)
    assert {n: got[n] for n in want} == want
    assert dict(Counter(want.values())) == DEFAULT_COUNTS[ftype] and sum(DEFAULT_COUNTS[ftype].values()) == 210
    # tied, 576 wide: output's rule gives Q8_0 (not whole blocks of the default type, or IQ4's Q6_K -> Q8_0)
    assert got["model.embed_tokens.weight"] == "Q8_0"


def test_default_model_named_tensors():
    r = {f: recipe(f, DEFAULT_CONFIG) for f in DEFAULT_TABLE}
    v, down, o = "model.layers.{}.self_attn.v_proj.weight", "model.layers.{}.mlp.down_proj.weight", "model.layers.{}.self_attn.o_proj.weight"
    assert r["Q3_K_M"].llama_type((192, 576), v.format(1)) == T.Q5_1  # Q5_K for i < 2, fallen back
    assert r["Q3_K_M"].llama_type((192, 576), v.format(2)) == T.Q5_0  # Q4_K
    assert r["Q3_K_M"].ggml_type_for((192, 576), v.format(2)) == T.Q4_K
    assert r["Q3_K_M"].llama_type((576, 1536), down.format(0)) == T.Q5_K  # i < 30/16 = 1
    assert r["Q3_K_M"].llama_type((576, 1536), down.format(1)) == T.Q4_K
    assert r["Q4_K_S"].llama_type((192, 576), v.format(3)) == T.Q5_1 and r["Q4_K_S"].llama_type((192, 576), v.format(4)) == T.Q5_0
    assert r["Q4_K_S"].llama_type((576, 1536), down.format(2)) == T.Q5_K and r["Q4_K_S"].llama_type((576, 1536), down.format(3)) == T.Q4_K
    assert r["Q2_K"].ggml_type_for((576, 576), o.format(7)) == T.Q3_K and r["Q2_K"].llama_type((576, 576), o.format(7)) == T.Q4_0
    assert r["Q4_K_M"].llama_type((576, 1536), down.format(23)) == T.Q6_K and r["Q4_K_M"].llama_type((576, 1536), down.format(24)) == T.Q4_K
    assert r["IQ4_XS"].llama_type((576, 1536), down.format(2)) == T.Q5_K and r["IQ4_XS"].llama_type((576, 1536), down.format(3)) == T.IQ4_XS
    assert r["IQ4_XS"].llama_type((1536, 576), "model.layers.3.mlp.up_proj.weight") == T.IQ4_NL  # 576 wide


def test_default_model_real_checkpoint_names_and_shapes():
    """The table's names and shapes are the default model's own (its 2-D tensors, its config)."""
    from qkit.checkpoint import tensor_shapes
    from qkit.models import resolve
    from qkit.models.files import read_config

    ref = resolve(None)
    config = read_config(ref.directory)
    assert {k: config.get(k) for k in DEFAULT_CONFIG} == DEFAULT_CONFIG
    real = [(n, s) for n, s in tensor_shapes(ref.directory) if len(s) == 2]
    assert sorted(real) == sorted(DEFAULT_SHAPES)
    r = get_scheme("q4_k_m").bind(config)
    assert type_names(r, real) == type_names(recipe("Q4_K_M", DEFAULT_CONFIG), DEFAULT_SHAPES)


@pytest.mark.parametrize("ftype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_ffn_down_rule_reads_the_imatrix_flag(ftype):
    got = Counter(type_names(recipe(ftype, DEFAULT_CONFIG, imatrix=True), DEFAULT_SHAPES[1:]).values())
    assert got == ({"IQ4_NL": 210} if ftype == "IQ4_NL" else {"IQ4_NL": 180, "IQ4_XS": 30})
    # no other ftype reads it
    for other in ("Q4_K_M", "Q3_K_M", "Q5_K_S"):
        assert type_names(recipe(other, DEFAULT_CONFIG, True), DEFAULT_SHAPES) == type_names(recipe(other, DEFAULT_CONFIG), DEFAULT_SHAPES)


# ------------------------------------------------------------------ qwen2 (n_gqa 7), by hand

# n = 24: n/8 = 3, 7n/8 = 21, n/16 = 1; use_more_bits: i < 3, i >= 21, (i - 3) % 3 == 2. Widths 896
# (falls back like 576) and 4864 = 19 * 256 (down_proj). n_gqa = 14 / 2 = 7 >= 4: Q2_K's attn_v is
# Q4_K (-> Q5_0), IQ4's attn_v Q5_K (-> Q5_1).
MORE24 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
QWEN2_TABLE = {
    "Q2_K": _uniform("Q4_0", "Q3_K", v="Q5_0"),
    "Q3_K_S": _uniform("Q4_0", "Q3_K"),
    "Q3_K_M": _uniform("Q4_0", ({0}, "Q5_K", "Q4_K"), v=({0, 1}, "Q5_1", "Q5_0"), o="Q5_0"),
    "Q3_K_L": _uniform("Q4_0", "Q5_K", v="Q5_1", o="Q5_1"),
    "IQ4_NL": _uniform("IQ4_NL", ({0, 1, 2}, "Q5_K", "IQ4_NL"), v="Q5_1"),
    "IQ4_XS": _uniform("IQ4_NL", ({0, 1, 2}, "Q5_K", "IQ4_XS"), v="Q5_1"),
    "Q4_K_S": _uniform("Q5_0", ({0, 1, 2}, "Q5_K", "Q4_K"), v=({0, 1, 2, 3}, "Q5_1", "Q5_0")),
    "Q4_K_M": _uniform("Q5_0", (MORE24, "Q6_K", "Q4_K"), v=(MORE24, "Q8_0", "Q5_0")),
    "Q5_K_S": _uniform("Q5_1", "Q5_K"),
    "Q5_K_M": _uniform("Q5_1", (MORE24, "Q6_K", "Q5_K"), v=(MORE24, "Q8_0", "Q5_1")),
}
QWEN2_COUNTS = {
    "Q2_K": {"Q4_0": 120, "Q5_0": 24, "Q3_K": 24},
    "Q3_K_S": {"Q4_0": 144, "Q3_K": 24},
    "Q3_K_M": {"Q4_0": 96, "Q5_0": 46, "Q4_K": 23, "Q5_1": 2, "Q5_K": 1},
    "Q3_K_L": {"Q4_0": 96, "Q5_1": 48, "Q5_K": 24},
    "IQ4_NL": {"IQ4_NL": 141, "Q5_1": 24, "Q5_K": 3},
    "IQ4_XS": {"IQ4_NL": 120, "Q5_1": 24, "IQ4_XS": 21, "Q5_K": 3},
    "Q4_K_S": {"Q5_0": 140, "Q4_K": 21, "Q5_1": 4, "Q5_K": 3},
    "Q4_K_M": {"Q5_0": 132, "Q8_0": 12, "Q6_K": 12, "Q4_K": 12},
    "Q5_K_S": {"Q5_1": 144, "Q5_K": 24},
    "Q5_K_M": {"Q5_1": 132, "Q8_0": 12, "Q6_K": 12, "Q5_K": 12},
}


@pytest.mark.parametrize("ftype", list(QWEN2_TABLE))
def test_qwen2_gqa7_every_projection_by_hand(ftype):
    got = type_names(recipe(ftype, QWEN2_CONFIG), QWEN2_SHAPES)
    want = expand(QWEN2_TABLE[ftype], 24)
    assert {n: got[n] for n in want} == want
    assert dict(Counter(want.values())) == QWEN2_COUNTS[ftype] and sum(QWEN2_COUNTS[ftype].values()) == 168
    assert got["model.embed_tokens.weight"] == "Q8_0"  # tied, 896 wide


# ------------------------------------------------------------------ llama.cpp's 70B type, by hand

MORE80 = {i for i in range(80) if i < 10 or i >= 70 or (i - 10) % 3 == 2}


def test_use_more_bits_for_80_layers_by_hand():
    assert len(MORE80) == 40 and {i for i in range(80) if use_more_bits(i, 80)} == MORE80


@pytest.mark.parametrize(("ftype", "v", "down"), [
    ("Q4_K_M", (MORE80, "Q6_K", "Q5_K"), (MORE80, "Q6_K", "Q4_K")),  # attn_v's Q4_K -> Q5_K (70B)
    ("Q4_K_S", "Q5_K", ({i for i in range(10)}, "Q5_K", "Q4_K")),  # i < 4: Q5_K; else Q4_K -> Q5_K
    ("Q3_K_S", "Q5_K", "Q3_K"),  # Q3_K -> Q5_K
    ("Q2_K", "Q5_K", "Q3_K"),  # n_gqa 8: Q4_K -> Q5_K
    ("Q5_K_M", (MORE80, "Q6_K", "Q5_K"), (MORE80, "Q6_K", "Q5_K")),
])
def test_llama_70b_attn_v_by_hand(ftype, v, down):
    got = type_names(recipe(ftype, LLAMA70_CONFIG), LLAMA70_SHAPES)
    for n, t in expand({"q_proj": "-", "k_proj": "-", "o_proj": "-", "gate_proj": "-", "up_proj": "-", "v_proj": v,
                        "down_proj": down}, 80).items():
        assert t == "-" or got[n] == t, n
    assert got["lm_head.weight"] == "Q6_K" and got["model.embed_tokens.weight"] == DEFAULT_TYPES[ftype].name  # untied


def test_65b_and_qwen2_80_layers():
    """80 layers is llama.cpp's 70B for llama only with grouped-query attention; for qwen2 always."""
    v = "model.layers.40.self_attn.v_proj.weight"
    mha = recipe("Q4_K_M", {**LLAMA70_CONFIG, "num_key_value_heads": 64})
    assert mha.ggml_type_for((8192, 8192), v) == T.Q4_K
    assert recipe("Q4_K_M", {**LLAMA70_CONFIG, "model_type": "qwen2"}).ggml_type_for((1024, 8192), v) == T.Q5_K
    assert recipe("Q4_K_M", {**LLAMA70_CONFIG, "num_hidden_layers": 81}).ggml_type_for((1024, 8192), v) == T.Q4_K


# ------------------------------------------------------------------ llama.cpp's own snapshots

@pytest.mark.parametrize("ftype", list(DEFAULT_TYPES))
@pytest.mark.parametrize("model", list(SNAPSHOT_MODELS))
def test_equals_llama_cpp_snapshot(model, ftype):
    path = SNAPSHOTS / f"{model}.schema"
    if not path.exists():
        pytest.skip(f"llama.cpp's snapshot {path} is not in the qkit cache")
    config, *widths = SNAPSHOT_MODELS[model]
    default, overrides = read_snapshot(path)[ftype]
    assert default == DEFAULT_TYPES[ftype].name
    n = config["num_hidden_layers"]
    shapes = [("token_embd.weight", (1000, widths[0]))] + ([] if config["tie_word_embeddings"] else [("output.weight", (1000, widths[0]))])
    shapes += [(f"blk.{i}.{p}.weight", (64, widths[w])) for i in range(n) for p, w in GGUF_PROJ.items()]
    got = type_names(recipe(ftype, config), shapes)
    assert set(overrides) <= set(got)  # the snapshot's tensors are these
    want = {name: overrides.get(name, default) for name in got}
    assert got == want


def test_snapshots_say_tied_where_qkit_binds_tied():
    if not SNAPSHOTS.exists():
        pytest.skip("llama.cpp's snapshots are not in the qkit cache")
    for model, (config, *_) in SNAPSHOT_MODELS.items():
        text = (SNAPSHOTS / f"{model}.schema").read_text()
        assert ("\noutput.weight " not in text) == config["tie_word_embeddings"], model


# ------------------------------------------------------------------ names, registration, uniform ftypes


def test_registered_names_and_ftypes():
    assert list(RECIPES) == list(FTYPE_OF)
    for name, ftype in FTYPE_OF.items():
        r = get_scheme(name)
        assert isinstance(r, Recipe) and r.ftype == ftype and r.llama_ftype == gguf.LlamaFileType[f"MOSTLY_{ftype}"]
        assert r.ggml_type == DEFAULT_TYPES[ftype] and r.kind == "ggml" and "\n" not in r.description
    for name in ("q6_k-llama", "q8_0-llama"):
        assert REGISTRY.find(name) is None


@pytest.mark.parametrize("ftype", ["Q6_K", "Q8_0"])
def test_q6_k_and_q8_0_write_only_their_type_and_its_fallback(ftype):
    assert written_by_enumeration(ftype) == set(LlamaRecipe("x", ftype).ggml_types)


@pytest.mark.parametrize("ftype", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, QWEN2_CONFIG, LLAMA70_CONFIG, {**DEFAULT_CONFIG, "tie_word_embeddings": False}])
def test_q6_k_and_q8_0_ftypes_are_the_uniform_types(ftype, config):
    """Why there is no q6_k-llama / q8_0-llama: every tensor gets the uniform type (with its fallback)."""
    r = recipe(ftype, config)
    for width in (576, 896, 4096, 4096 + 32, 100):
        names = ["lm_head.weight", "model.embed_tokens.weight"] + [f"model.layers.{i}.{p}.weight" for i in (0, 5, 23) for p in PROJ]
        for n in names:
            assert r.llama_type((64, width), n) == tensor_type_fallback(DEFAULT_TYPES[ftype], width), (n, width)


@pytest.mark.parametrize("name", [n for n in FTYPE_OF if n.endswith("-llama")])
def test_llama_suffixed_ftypes_differ_from_the_uniform_type(name):
    r = get_scheme(name).bind(DEFAULT_CONFIG)
    uniform = {n: tensor_type_fallback(r.ggml_type, s[-1]) for n, s in DEFAULT_SHAPES}
    differ = [n for n, t in llama_types(r, DEFAULT_SHAPES).items() if t != uniform[n]]
    # only the (tied) embedding differs: Q6_K's fallback Q8_0, not TQ's Q4_0 / IQ3_S's IQ4_NL (IQ3_S's attn_v rule
    # needs 4+ query heads per KV head; the default model has 3)
    if r.ftype.startswith("TQ") or r.ftype == "IQ3_S":
        assert differ == ["model.embed_tokens.weight"]
    else:
        assert "model.embed_tokens.weight" in differ and len(differ) > 1


def test_mxfp4_moe_is_mxfp4_for_expert_tensors_and_q8_0_elsewhere():
    """llama_tensor_get_type_impl's MXFP4_MOE branch: a 3-D tensor of more than one expert is MXFP4, every other
    quantized tensor Q8_0 (output and token_embd too); a dense model's recipe is Q8_0 throughout."""
    facts = ModelFacts("qwen3moe", 2, n_expert=4, n_head=4, n_head_kv=2)
    tensors = [("token_embd.weight", (256, 1000), T.F32), ("output.weight", (256, 1000), T.F32),
               ("blk.0.attn_v.weight", (256, 128), T.F32), ("blk.0.ffn_down_exps.weight", (512, 256, 4), T.F32),
               ("blk.0.ffn_up_exps.weight", (256, 512, 4), T.F32), ("blk.0.ffn_down_shexp.weight", (512, 256), T.F32),
               ("blk.0.ffn_gate_inp.weight", (256, 4), T.F32), ("blk.1.ffn_up_exps.weight", (256, 512, 1), T.F32)]
    got = tensor_types(tensors, facts, Params(gguf.LlamaFileType.MOSTLY_MXFP4_MOE))
    assert {n: t.name for n, t in got.items()} == {
        "token_embd.weight": "Q8_0", "output.weight": "Q8_0", "blk.0.attn_v.weight": "Q8_0",
        "blk.0.ffn_down_exps.weight": "MXFP4", "blk.0.ffn_up_exps.weight": "MXFP4", "blk.0.ffn_down_shexp.weight": "Q8_0",
        "blk.0.ffn_gate_inp.weight": "F32", "blk.1.ffn_up_exps.weight": "Q8_0"}  # one expert: ne[2] == 1
    dense = llama_types(get_scheme("mxfp4_moe").bind(DEFAULT_CONFIG), DEFAULT_SHAPES)
    assert set(dense.values()) == {T.Q8_0}


def written_by_enumeration(ftype: str) -> set[T]:
    """The rules run over every category, every layer of a 30- and an 80-layer model, n_gqa 1 / 2 / 8,
    70B or not, with and without an imatrix, tied or not, 4096 and 4128 wide (whole 256-blocks; 32-blocks only)."""
    found = set()
    models = [("llama", 30, 8, 8), ("llama", 30, 8, 1), ("qwen2", 30, 8, 4), ("llama", 80, 8, 8), ("llama", 80, 8, 1),
              ("qwen2", 80, 8, 2)]
    for arch, n, heads, kv in models:
        for tied in (False, True):
            for im in (False, True):
                r = recipe(ftype, {"model_type": arch, "num_hidden_layers": n, "num_attention_heads": heads,
                                   "num_key_value_heads": kv, "tie_word_embeddings": tied}, im)
                names = ["lm_head.weight", "model.embed_tokens.weight", "model.other.weight"] + [
                    f"model.layers.{i}.{p}.weight" for i in range(n) for p in PROJ]
                for name in names:
                    for cols in (4096, 4096 + 32):
                        found.add(r.llama_type((8, cols), name))
    return found


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_types_are_every_type_written(name):
    r = get_scheme(name)
    # MXFP4_MOE's MXFP4 is for 3-D expert tensors only, which no dense model has (its rule: test_mxfp4_moe_*)
    experts = {T.MXFP4} if r.ftype == "MXFP4_MOE" else set()
    assert set(r.ggml_types) == written_by_enumeration(r.ftype) | experts and r.ggml_types[0] == r.ggml_type
    assert list(r.ggml_types[1:]) == sorted(r.ggml_types[1:], key=int)
    assert all(not isinstance(s, Recipe) and s.ggml_type in r.ggml_types for s in r.types)
    seen = set()
    for config, shapes in ((DEFAULT_CONFIG, DEFAULT_SHAPES), (QWEN2_CONFIG, QWEN2_SHAPES), (LLAMA70_CONFIG, LLAMA70_SHAPES)):
        seen |= set(llama_types(r.bind(config), shapes).values())
    assert seen <= set(r.ggml_types)


# ------------------------------------------------------------------ binding, refusals, the manifest


@pytest.mark.parametrize(("config", "match"), [
    ({"num_hidden_layers": 32, "num_local_experts": 8, "model_type": "llama"}, "mixture-of-experts"),
    ({"num_hidden_layers": 24, "num_experts": 60, "model_type": "qwen2"}, "mixture-of-experts"),
    ({"num_hidden_layers": 32, "model_type": "falcon"}, "not model_type 'falcon'"),
    ({"num_hidden_layers": 28, "model_type": "qwen3"}, "llama and qwen2"),
    ({"num_hidden_layers": 80}, "70B"),
    ({"num_hidden_layers": 80, "model_type": "llama"}, "70B"),
    ({}, "num_hidden_layers"),
    ({"num_hidden_layers": "many"}, "num_hidden_layers"),
])
@pytest.mark.parametrize("name", ["q3_k_m", "iq4_xs-llama"])
def test_bind_refuses_in_one_line(name, config, match):
    with pytest.raises(SchemeError, match=match) as exc:
        get_scheme(name).bind(config)
    assert "\n" not in str(exc.value)


def test_facts_a_rule_needs_are_refused_when_missing():
    layers_only = get_scheme("q2_k-llama").bind({"num_hidden_layers": 30})  # as qkit budget binds
    assert layers_only.llama_type((576, 1536), "model.layers.0.mlp.down_proj.weight") == T.Q3_K
    with pytest.raises(SchemeError, match="head counts") as exc:
        layers_only.llama_type((192, 576), "model.layers.0.self_attn.v_proj.weight")  # Q2_K's n_gqa rule
    assert "scheme.bind(config)" in str(exc.value) and "\n" not in str(exc.value)
    unbound = get_scheme("q3_k_m")
    assert unbound.llama_type((576, 576), "model.layers.3.self_attn.o_proj.weight") == T.Q5_0  # Q4_K: no fact needed
    with pytest.raises(SchemeError, match="layer count"):
        unbound.llama_type((576, 1536), "model.layers.3.mlp.down_proj.weight")
    with pytest.raises(SchemeError, match="1-D"):
        get_scheme("q4_k_s").bind(DEFAULT_CONFIG).resolve((576,), "model.norm.weight")


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_width_not_a_multiple_of_32_is_refused_as_llama_cpp_writes_f16(name):
    r = get_scheme(name).bind(DEFAULT_CONFIG)
    for n in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert r.llama_type((4, 100), n) == T.F16
        with pytest.raises(SchemeError) as exc:
            r.resolve((4, 100), n)
        assert "width 100" in str(exc.value) and "F16" in str(exc.value) and n in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_to_dict_round_trip(name):
    r = get_scheme(name)
    d = r.to_dict()
    assert set(d) == {"name", "kind", "ggml_type", "recipe", "llama_cpp_commit"}
    assert d["recipe"] == f"LLAMA_FTYPE_MOSTLY_{FTYPE_OF[name]}" and d["ggml_type"] == r.ggml_type.name
    assert scheme_from_dict(d) is r
    bound = r.bind(QWEN2_CONFIG).with_imatrix(True)
    bd = bound.to_dict()
    facts = {"n_layers": 24, "tied_embeddings": True}
    if r.ftype in ("Q2_K", "IQ4_NL", "IQ4_XS"):
        facts["n_gqa"] = 7
    if r.ftype.startswith("IQ4"):
        facts["imatrix"] = True
    assert bd == {**d, **facts}
    assert json.loads(json.dumps(bd)) == bd and scheme_from_dict(bd) is r
    assert r.bind(LLAMA70_CONFIG).to_dict()["llama_70b"] is True
    assert r.bind({**LLAMA70_CONFIG, "num_key_value_heads": 64}).to_dict()["llama_70b"] is False
    with pytest.raises(SchemeError, match="does not match"):
        scheme_from_dict({**d, "recipe": "LLAMA_FTYPE_MOSTLY_Q8_0"})


def test_an_old_q4_k_m_manifest_entry_is_still_read():
    old = {"name": "q4_k_m", "kind": "ggml", "ggml_type": "Q4_K", "recipe": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
           "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f", "n_layers": 30, "tied_embeddings": True}
    assert scheme_from_dict(old) is get_scheme("q4_k_m")


def test_with_imatrix_and_bind_return_new_recipes():
    r = get_scheme("iq4_nl-llama")
    assert r.with_imatrix(True).imatrix and not r.imatrix and r.with_imatrix(True) != r
    assert r.bind(DEFAULT_CONFIG).with_imatrix(True).n_layers == 30


# ------------------------------------------------------------------ schemes (where the types are registered)


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_assignment_gives_the_registered_scheme_of_each_type(name):
    r = get_scheme(name).bind(DEFAULT_CONFIG)
    want = llama_types(r, DEFAULT_SHAPES)
    missing = sorted({t.name.lower() for t in want.values()} - set(REGISTRY.names()))
    assert not missing, f"{name} on the default model needs {', '.join(missing)}, which no scheme registers"
    got = assignment(r, DEFAULT_SHAPES)
    assert {n: s.ggml_type for n, s in got.items()} == want
    assert all(s is get_scheme(s.ggml_type.name.lower()) for s in got.values())
    counts = type_counts({n: s for n, s in got.items() if n != "model.embed_tokens.weight"})
    assert counts == {k.lower(): v for k, v in sorted(DEFAULT_COUNTS[r.ftype].items(), key=lambda kv: (-kv[1], kv[0].lower()))}


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_quantize_tensor_writes_the_assigned_type(name):
    r = get_scheme(name).bind(DEFAULT_CONFIG)
    gen = torch.Generator().manual_seed(1)
    for n, shape in (("model.layers.0.mlp.down_proj.weight", (8, 1536)), ("model.layers.0.self_attn.v_proj.weight", (8, 576))):
        want = r.llama_type(shape, n).name.lower()
        assert REGISTRY.find(want) is not None, f"{want} is not registered"
        qt = quantize_tensor(torch.randn(shape, generator=gen), r, name=n)
        assert qt.scheme is get_scheme(want) and qt.nbytes == r.nbytes_for(shape, n)
        assert scheme_from_dict(qt.scheme.to_dict()) is qt.scheme


def test_each_types_own_resolve_applies_the_same_fallback():
    """``tensor_type_fallback`` here and the registered types' ``resolve`` agree on every width."""
    for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.IQ4_NL, T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1):
        s = REGISTRY.find(t.name.lower())
        if s is None:
            continue
        for cols in (256, 512, 576, 896, 1536, 4864, 4096 + 32):
            assert s.resolve((4, cols), "w").ggml_type == tensor_type_fallback(t, cols), (t.name, cols)


def test_q4_k_m_quantizes_and_decodes_by_its_unambiguous_row_size():
    r = get_scheme("q4_k_m").bind(DEFAULT_CONFIG)
    w = torch.randn(8, 1536, generator=torch.Generator().manual_seed(0))
    qt = quantize_tensor(w, r, name="model.layers.0.mlp.down_proj.weight")
    assert qt.scheme is get_scheme("q6_k")
    assert torch.equal(r.decode(qt.parts, qt.shape, torch.float32), qt.dequantize(torch.float32))


def test_decode_refuses_a_row_size_two_types_share():
    r = get_scheme("q4_k_s")  # Q4_K and ... Q5_K and Q5_0 both store 0.6875 bytes per weight
    qt = quantize_tensor(torch.randn(4, 512), get_scheme("q5_0"))
    with pytest.raises(SchemeError, match="names its type") as exc:
        r.decode(qt.parts, qt.shape, torch.float32)
    assert "Q5_0 or Q5_K" in str(exc.value)


# ------------------------------------------------------------------ llama-quantize's log

LOG = (
    "llama_model_quantize_impl: model size  = ...\n"
    "[   1/ 272]                   output_norm.weight - [   576,      1,      1,      1], type =    f32, size =    0.002 MiB\n"
    "[   2/ 272]                    token_embd.weight - [   576,  49152,      1,      1], type =    f32, "
    "converting to q8_0 .. size =   108.00 MiB ->    28.69 MiB\n"
    "[   3/ 272]               blk.0.attn_k.weight - [   576,    192,      1,      1], type =    f32, \n"
    "====== llama_model_quantize_impl: did not find weights for blk.0.attn_k.weight\n"
    "converting to q5_0 .. size =     0.42 MiB ->     0.11 MiB\n"
    "[   4/ 272]            blk.0.ffn_down.weight - [  1536,    576,      1,      1], type =    f32, converting to q6_K .. "
    "size =     3.38 MiB ->     0.69 MiB\n"
    "[   5/ 272]              blk.0.attn_v.weight - [   576,    192,      1,      1], type =    f32, "
    "size =     0.42 MiB ->     0.11 MiB (iq4_nl)\n"
    "[   6/ 272]            blk.0.ffn_gate.weight - [   576,   1536,      1,      1], type =    f16, size =    1.688 MiB\n"
    "llama_model_quantize_impl: quant size  =    ...\n"
)


def test_llama_quantize_log_is_parsed():
    assert llama_quantize_types(LOG) == {
        "output_norm.weight": T.F32, "token_embd.weight": T.Q8_0, "blk.0.attn_k.weight": T.Q5_0,
        "blk.0.ffn_down.weight": T.Q6_K, "blk.0.attn_v.weight": T.IQ4_NL, "blk.0.ffn_gate.weight": T.F16,
    }
    with pytest.raises(SchemeError, match="q9_Z"):
        llama_quantize_types("[   1/   1]   x.weight - [ 1, 1, 1, 1], type =    f32, converting to q9_Z .. size = 1 MiB -> 1 MiB\n")
