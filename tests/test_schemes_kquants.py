"""llama.cpp's k-quants (q4_k, q6_k), their width fallback, and the q4_k_m recipe.

Oracles: ``tests/golden/kquants.json`` holds llama.cpp's own bytes for fixed inputs (recorded with
``python benchmarks/build_llama_ref.py --record-golden``: llama.cpp commit, compiler and flags are in the
file); ``gguf.quants.dequantize`` decodes every type. Where the reference library has been built in the
qkit cache (the same script), the slow tests also compare fresh random and real-model matrices with it.
"""

from __future__ import annotations

import base64
import math

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module
from helpers_ggml import ALL_TYPES, GOLDEN, K_TYPES, NAME_OF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, quantize_tensor, scheme_names
from qkit.schemes.kquant_search import seq_sum, sqrtf
from qkit.schemes.llama_rules import use_more_bits
from qkit.schemes.recipes import Q4KMRecipe
from qkit.schemes.registry import scheme_from_dict

T = gguf.GGMLQuantizationType
PROPS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


def golden_params():
    for case in GOLDEN["cases"]:
        for t in case["expected"]:
            yield pytest.param(case, t, id=f"{case['name']}-{t}")


@pytest.mark.parametrize(("case", "type_name"), list(golden_params()))
def test_bytes_equal_llama_cpp_recorded(case, type_name):
    """qkit's bytes equal llama.cpp's ``ggml_quantize_chunk`` output recorded in kquants.json."""
    x = np.frombuffer(base64.b64decode(case["input_f32_le"]), dtype="<f4").reshape(case["shape"]).copy()
    expected = np.frombuffer(base64.b64decode(case["expected"][type_name]), dtype=np.uint8)
    qt = quantize_tensor(torch.from_numpy(x), get_scheme(NAME_OF[type_name]))
    got = qt.qweight.numpy().reshape(-1)
    assert got.shape == expected.shape
    size = gguf.GGML_QUANT_SIZES[T[type_name]][1]
    bad = np.nonzero((got.reshape(-1, size) != expected.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {got.size // size} blocks differ, first {bad[:4].tolist()}"


def test_golden_file_says_where_it_came_from():
    assert GOLDEN["llama_cpp_commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert GOLDEN["command"] == "python benchmarks/build_llama_ref.py --record-golden"
    names = {c["name"] for c in GOLDEN["cases"]}
    assert {"normal", "small_integers_ties", "all_zero", "signed_zeros", "subnormal_2e-140"} <= names


@pytest.mark.parametrize("name", list(K_TYPES))
@pytest.mark.parametrize("scale", [1.0, 0.02, 1e-3, 1e3])
def test_decode_equals_gguf_dequantize(name, scale):
    x = (torch.randn(8, 512, generator=torch.Generator().manual_seed(3)) * scale)
    x[2, :300] = 0.0
    qt = quantize_tensor(x, get_scheme(name))
    assert qt.scheme.name == name
    ours = qt.dequantize(torch.float32).numpy()
    assert bits_equal(ours, gguf.quants.dequantize(qt.qweight.numpy(), K_TYPES[name]))


@pytest.mark.parametrize("name", list(K_TYPES))
def test_decode_of_arbitrary_blocks_equals_gguf(name):
    """Random block bytes (finite fp16 d / dmin), not only ones qkit wrote."""
    t = K_TYPES[name]
    size = gguf.GGML_QUANT_SIZES[t][1]
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (16, 2 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    halfs = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if name == "q4_k":
        blocks[:, 0:4] = halfs
    else:
        blocks[:, 208:210] = halfs[:, :2]
    ours = get_scheme(name).decode({"qweight": torch.from_numpy(raw)}, (16, 512), torch.float32).numpy()
    assert bits_equal(ours, gguf.quants.dequantize(raw, t))


# --------------------------------------------------------------------------- against the built reference


def _reference():
    return benchmark_module("build_llama_ref").load()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL_TYPES))
def test_random_matrices_equal_the_built_llama_cpp(name):
    ref = _reference()
    if ref is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    rng = np.random.default_rng(5)
    for kind in range(6):
        x = rng.standard_normal((48, 1024))
        x = [x, x / (rng.random(x.shape) + 0.01), rng.integers(-20, 21, x.shape) / 3, rng.laplace(size=x.shape),
             np.where(rng.random(x.shape) < 0.5, 0, x), x + rng.standard_normal((48, 1))][kind]
        x = (x * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
        got = quantize_tensor(torch.from_numpy(x), get_scheme(name)).qweight.numpy()
        assert np.array_equal(got, ref.quantize(x, ALL_TYPES[name])), (name, kind)


@pytest.mark.slow
def test_default_model_matrices_equal_the_built_llama_cpp(default_model_dir):
    """Every 256-divisible projection of three layers (the 1536-wide down_proj), every type."""
    ref = _reference()
    if ref is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    from qkit.checkpoint import iter_tensors

    want = {f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 14, 29)}
    mats = {n: t.float().numpy() for n, t in iter_tensors(default_model_dir) if n in want}
    assert set(mats) == want
    for x in mats.values():
        for name, t in ALL_TYPES.items():
            qt = quantize_tensor(torch.from_numpy(x), get_scheme(name))
            assert qt.scheme.name == name
            assert np.array_equal(qt.qweight.numpy(), ref.quantize(x, t)), name
            assert bits_equal(qt.dequantize(torch.float32).numpy(), gguf.quants.dequantize(qt.qweight.numpy(), t))


# --------------------------------------------------------------------------- exact fp32 helpers


@pytest.mark.parametrize("index_add", [True, False])
def test_seq_sum_is_the_c_loop(monkeypatch, index_add):
    """``seq_sum`` adds in order with fp32 rounding at each step (torch.sum does not: it differs here),
    through CPU ``index_add_`` and through the plain loop other devices use."""
    from qkit.schemes import kquant_search

    monkeypatch.setattr(kquant_search, "_SEQUENTIAL", [index_add])
    x = (torch.randn(32, 4000, generator=torch.Generator().manual_seed(6)) * torch.exp(torch.randn(32, 4000) * 4)).float()
    xs = x.numpy()
    acc = np.zeros(4000, np.float32)
    for i in range(32):
        acc = (acc + xs[i]).astype(np.float32)
    assert np.array_equal(seq_sum(x).numpy(), acc)
    assert np.array_equal(seq_sum(x, from_zero=False).numpy(), acc)  # 0 + t0 = t0 for these (no -0.0)
    assert not torch.equal(x.sum(dim=0), seq_sum(x))


def test_sqrtf_is_correctly_rounded():
    """numpy's fp32 sqrt is the IEEE operation; torch.sqrt on fp32 CPU tensors is not always (it can be an ulp off)."""
    v = np.random.default_rng(7).random(500_000).astype(np.float32) * np.float32(1e3)
    assert np.array_equal(sqrtf(torch.from_numpy(v)).numpy(), np.sqrt(v))


# --------------------------------------------------------------------------- widths and fallback


def test_width_fallback_follows_llama_cpp():
    """llama-quant.cpp's tensor_type_fallback: ncols % 256 != 0 -> Q4_K becomes Q5_0, Q6_K becomes Q8_0."""
    q4k, q6k = get_scheme("q4_k"), get_scheme("q6_k")
    assert q4k.resolve((576, 576), "w").name == "q5_0"
    assert q6k.resolve((576, 576), "w").name == "q8_0"
    assert q4k.resolve((576, 1536), "w") is q4k and q6k.resolve((576, 1536), "w") is q6k
    w = torch.randn(8, 576)
    qt = quantize_tensor(w, q4k, name="model.layers.0.mlp.up_proj.weight")
    assert qt.scheme.name == "q5_0"
    assert np.array_equal(qt.qweight.numpy(), gguf.quants.quantize(w.numpy(), T.Q5_0))
    assert quantize_tensor(w, q6k).scheme.name == "q8_0"
    assert q4k.nbytes_for((8, 576)) == qt.nbytes == 8 * 18 * 22


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q4_k_m"])
def test_width_100_is_refused_in_one_line(name):
    with pytest.raises(SchemeError) as exc:
        quantize_tensor(torch.randn(4, 100), get_scheme(name), name="model.layers.0.mlp.up_proj.weight")
    msg = str(exc.value)
    assert "\n" not in msg and "width 100" in msg and "multiple of 32" in msg and "model.layers.0.mlp.up_proj.weight" in msg


# --------------------------------------------------------------------------- registry, sizes, refusals


@pytest.mark.parametrize(("name", "bpw", "size"), [("q4_k", 4.5, 144), ("q6_k", 6.5625, 210)])
def test_registered_with_exact_bits_per_weight(name, bpw, size):
    s = get_scheme(name)
    assert name in scheme_names()
    assert (s.kind, s.ggml_type, s.block_size, s.type_size, s.bits_per_weight) == ("ggml", K_TYPES[name], 256, size, bpw)
    qt = quantize_tensor(torch.randn(4, 512), s)
    assert qt.bits_per_weight == bpw and tuple(qt.qweight.shape) == (4, 2 * size) and qt.scales.numel() == 0
    assert scheme_from_dict(s.to_dict()) is s
    assert s.to_dict()["ggml_type"] == K_TYPES[name].name
    assert get_scheme(name, scale_dtype="fp32") is s


@pytest.mark.parametrize("name", list(K_TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(name, bad):
    w = torch.randn(2, 256)
    w[1, 200] = bad
    with pytest.raises(NonFiniteWeightError, match="NaN or infinite"):
        quantize_tensor(w, get_scheme(name), name="w")


@pytest.mark.parametrize("name", list(K_TYPES))
def test_a_super_block_scale_overflowing_fp16_is_refused(name):
    w = torch.randn(2, 256)
    w[0, 9] = 1e9
    with pytest.raises(SchemeError, match="overflows fp16"):
        quantize_tensor(w, get_scheme(name), name="w")


@pytest.mark.parametrize("name", list(K_TYPES))
@PROPS
@given(seed=st.integers(0, 2**31), scale=st.sampled_from([1e-3, 1.0, 100.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_shape_dtype_zeros_determinism_and_error(name, seed, scale, dtype):
    """Shape and dtype kept; all-zero super-blocks give zeros; the same bytes for the same values in any
    memory layout; and the relative RMS error of a Gaussian matrix is what 4 / 6 bits give (loose bounds:
    the exact values are pinned by the golden bytes)."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(3, 512, generator=gen) * scale).to(dtype)
    w[1] = 0
    s = get_scheme(name)
    qt = quantize_tensor(w, s)
    out = qt.dequantize()
    assert out.shape == w.shape and out.dtype == dtype
    assert (out[1] == 0).all()
    assert torch.equal(quantize_tensor(w.t().contiguous().t(), s).qweight, qt.qweight)
    rel = ((out.float() - w.float()).norm() / w.float().norm()).item()
    assert rel < {"q4_k": 0.12, "q6_k": 0.03}[name]


# --------------------------------------------------------------------------- q4_k_m


def test_use_more_bits_for_30_layers_by_hand():
    """n = 30: n/8 = 3, 7n/8 = 26 (integer division); (i - 3) % 3 == 2 picks 5, 8, ..., 23."""
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def _names(n_layers: int) -> list[str]:
    projs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return [f"model.layers.{i}.{p}.weight" for i in range(n_layers) for p in projs]


def test_q4_k_m_assignment_on_30_layers():
    """The default model's shapes (hidden 576, intermediate 1536): Q6_K on attn_v / ffn_down of the
    use_more_bits layers, else Q4_K; then the width fallback (576 -> Q5_0 / Q8_0; 1536 stays)."""
    recipe = get_scheme("q4_k_m").bind({"num_hidden_layers": 30, "model_type": "llama", "num_attention_heads": 9,
                                               "num_key_value_heads": 3, "tie_word_embeddings": True})
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    shapes = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
              "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
    got = {n: recipe.resolve(shapes[n.split(".")[-2]], n).name for n in _names(30)}
    for n, t in got.items():
        i, proj = int(n.split(".")[2]), n.split(".")[-2]
        if proj == "v_proj":
            want = "q8_0" if i in more else "q5_0"  # Q6_K / Q4_K on a 576-wide matrix
        elif proj == "down_proj":
            want = "q6_k" if i in more else "q4_k"  # 1536 = 6 * 256
        else:
            want = "q5_0"  # Q4_K on a 576-wide matrix
        assert t == want, n
    # Without the width fallback (256-divisible widths): the recipe's own choice.
    plain = {n: recipe.ggml_type_for((4096, 4096), n).name for n in _names(30)}
    assert sorted(n for n, t in plain.items() if t == "Q6_K") == sorted(
        f"model.layers.{i}.{p}.weight" for i in more for p in ("self_attn.v_proj", "mlp.down_proj"))
    assert set(plain.values()) == {"Q4_K", "Q6_K"}
    # Output and (tied) token embedding: Q6_K, or Q8_0 for a width that is not a multiple of 256.
    assert recipe.resolve((49152, 576), "lm_head.weight").name == "q8_0"
    assert recipe.resolve((49152, 576), "model.embed_tokens.weight").name == "q8_0"  # tied
    assert recipe.resolve((32000, 4096), "lm_head.weight").name == "q6_k"
    untied = Q4KMRecipe(n_layers=30, tied_embeddings=False)
    assert untied.resolve((32000, 4096), "model.embed_tokens.weight").name == "q4_k"
    assert untied.resolve((32000, 576), "model.embed_tokens.weight").name == "q5_0"


def test_q4_k_m_quantizes_by_name_and_records_the_type_it_wrote():
    recipe = get_scheme("q4_k_m").bind({"num_hidden_layers": 30})
    w = torch.randn(64, 1536)
    more = quantize_tensor(w, recipe, name="model.layers.5.mlp.down_proj.weight")
    less = quantize_tensor(w, recipe, name="model.layers.6.mlp.down_proj.weight")
    assert (more.scheme.name, less.scheme.name) == ("q6_k", "q4_k")
    assert torch.equal(more.qweight, quantize_tensor(w, get_scheme("q6_k")).qweight)
    assert scheme_from_dict(more.scheme.to_dict()) is get_scheme("q6_k")
    assert recipe.decode(more.parts, more.shape, torch.float32).equal(more.dequantize(torch.float32))
    assert recipe.nbytes_for((64, 1536), "model.layers.5.mlp.down_proj.weight") == more.nbytes
    assert recipe.nbytes_for((64, 1536)) == less.nbytes  # no name: the default type


def test_q4_k_m_needs_the_layer_count_for_attn_v_and_ffn_down():
    recipe = get_scheme("q4_k_m")
    assert recipe.n_layers is None
    assert recipe.resolve((576, 576), "model.layers.3.self_attn.q_proj.weight").name == "q5_0"  # no count needed
    with pytest.raises(SchemeError) as exc:
        recipe.resolve((192, 576), "model.layers.3.self_attn.v_proj.weight")
    assert "scheme.bind(config)" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(SchemeError, match="layer index"):
        recipe.bind({"num_hidden_layers": 4}).resolve((192, 576), "model.layers.9.self_attn.v_proj.weight")


def test_q4_k_m_to_dict_and_registry():
    recipe = get_scheme("q4_k_m")
    d = recipe.to_dict()
    assert d["kind"] == "ggml" and d["ggml_type"] == "Q4_K" and d["recipe"] == "LLAMA_FTYPE_MOSTLY_Q4_K_M"
    assert "n_layers" not in d and scheme_from_dict(d) is recipe
    bound = recipe.bind({"num_hidden_layers": 30, "tie_word_embeddings": True})
    assert bound.to_dict()["n_layers"] == 30 and bound.to_dict()["tied_embeddings"] is True
    assert scheme_from_dict(bound.to_dict()) is recipe  # the recipe; each tensor's entry holds its type
    assert get_scheme("q4_0").bind({"num_hidden_layers": 30}) is get_scheme("q4_0")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"num_hidden_layers": 32, "num_local_experts": 8}, "mixture-of-experts"),
        ({"num_hidden_layers": 32, "model_type": "gpt2"}, "llama"),
        ({}, "num_hidden_layers"),
    ],
)
def test_bind_model_refuses_what_the_recipe_does_not_cover(config, match):
    with pytest.raises(SchemeError, match=match):
        get_scheme("q4_k_m").bind(config)


def test_bind_model_keeps_an_80_layer_llama_without_gqa():
    """llama.cpp's 70B type is llama with 80 layers *and* grouped-query attention (65B has none): only the
    70B type's attn_v gets Q5_K (tests/test_recipes_ladder.py checks the whole 70B table)."""
    cfg = {"num_hidden_layers": 80, "model_type": "llama", "num_attention_heads": 64, "num_key_value_heads": 64}
    assert get_scheme("q4_k_m").bind(cfg).n_layers == 80
    v = "model.layers.40.self_attn.v_proj.weight"  # use_more_bits(40, 80) is false: Q4_K, or Q5_K for 70B
    gqa = get_scheme("q4_k_m").bind({**cfg, "num_key_value_heads": 8})
    assert get_scheme("q4_k_m").bind(cfg).resolve((8192, 8192), v).name == "q4_k"
    assert gqa.resolve((1024, 8192), v).name == "q5_k"


def test_deterministic_across_thread_counts():
    """The same bytes with 1 and 2 torch threads, every type (no reduction depends on the split)."""
    w = torch.randn(384, 1536, generator=torch.Generator().manual_seed(8)) * 0.02
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([quantize_tensor(w, get_scheme(n)).qweight for n in ALL_TYPES])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_encode_called_directly_refuses_a_width_it_would_fall_back_from():
    """``quantize_tensor`` resolves q4_k on a 576-wide matrix to q5_0; ``encode`` itself never writes q5_0
    bytes under the name q4_k."""
    with pytest.raises(SchemeError, match="resolves it to q5_0"):
        get_scheme("q4_k").encode(torch.randn(2, 576))
