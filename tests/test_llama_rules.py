"""``qkit.schemes.llama_rules``: llama-quant.cpp's per-tensor rules, hand-computed from the pinned source
(``src/llama-quant.cpp``) on models that the tiny golden files do not reach (8 experts, 70B, fused and
MLA attention, tied heads), and ``quantize_gguf``'s refusals and expert weighting on small synthetic GGUFs.
The golden test (test_golden_requantize.py) checks the rules against llama-quantize --dry-run on every
ftype of nine converted architectures."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from qkit.errors import InputError, QkitError, SchemeError
from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import llama_quantize_args, quantize_gguf, tensor_bytes, to_bf16, to_f16
from qkit.methods.imatrix import Imatrix, ImatrixEntry
from qkit.schemes import get_scheme
from qkit.schemes.llama_rules import (
    ModelFacts,
    Params,
    allows_quantization,
    category,
    llama_order,
    tensor_types,
    use_more_bits,
)
from qkit.schemes.recipes import scheme_for_type

T, F = gguf.GGMLQuantizationType, gguf.LlamaFileType


def _mixtral(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], T]]:
    """Mixtral-8x7B's tensors (hidden 4096, 8 KV heads of 128, ffn 14336), ``ne`` fastest first."""
    out = [("token_embd.weight", (4096, 32000), T.F32), ("output.weight", (4096, 32000), T.F32),
           ("output_norm.weight", (4096,), T.F32)]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_q.weight", (4096, 4096), T.F32), (b + "attn_k.weight", (4096, 1024), T.F32),
                (b + "attn_v.weight", (4096, 1024), T.F32), (b + "attn_output.weight", (4096, 4096), T.F32),
                (b + "attn_norm.weight", (4096,), T.F32), (b + "ffn_norm.weight", (4096,), T.F32),
                (b + "ffn_gate_inp.weight", (4096, experts), T.F32),
                (b + "ffn_gate_exps.weight", (4096, 14336, experts), T.F32),
                (b + "ffn_up_exps.weight", (4096, 14336, experts), T.F32),
                (b + "ffn_down_exps.weight", (14336, 4096, experts), T.F32)]
    return out


def test_eight_experts_get_llama_cpps_moe_rules_at_q4_k_m():
    """n_expert == 8: attn_v and attn_k Q8_0, attn_output Q5_K; ffn_down_exps Q6_K where use_more_bits of
    the layer in its name (32 layers: 0-3, 28-31, 6, 9, ..., 27); the router and norms stay F32."""
    got = tensor_types(_mixtral(32, 8), ModelFacts("llama", 32, 8, 32, 8), Params(F.MOSTLY_Q4_K_M))
    for i in range(32):
        b = f"blk.{i}."
        assert got[b + "attn_v.weight"] == T.Q8_0 and got[b + "attn_k.weight"] == T.Q8_0
        assert got[b + "attn_output.weight"] == T.Q5_K and got[b + "attn_q.weight"] == T.Q4_K
        more = i < 4 or i >= 28 or (i - 4) % 3 == 2
        assert got[b + "ffn_down_exps.weight"] == (T.Q6_K if more else T.Q4_K), i
        assert got[b + "ffn_gate_exps.weight"] == got[b + "ffn_up_exps.weight"] == T.Q4_K
        assert got[b + "ffn_gate_inp.weight"] == got[b + "attn_norm.weight"] == T.F32
    assert got["output.weight"] == T.Q6_K and got["token_embd.weight"] == T.Q4_K and got["output_norm.weight"] == T.F32


def test_the_same_names_without_eight_experts_follow_the_dense_rules():
    """4 experts: no Q8_0 attention, attn_output the default; attn_v by its counter (one per layer: the layer)."""
    got = tensor_types(_mixtral(32, 4), ModelFacts("llama", 32, 4, 32, 8), Params(F.MOSTLY_Q4_K_M))
    for i in range(32):
        b = f"blk.{i}."
        assert got[b + "attn_k.weight"] == got[b + "attn_output.weight"] == T.Q4_K
        assert got[b + "attn_v.weight"] == (T.Q6_K if use_more_bits(i, 32) else T.Q4_K)
    # Q2_K on 4 experts at IQ2_XXS: attn_v Q4_K by n_expert >= 4 (n_gqa is 4 here too); with n_gqa 1 and 2 experts, Q2_K
    iq2 = tensor_types(_mixtral(2, 4), ModelFacts("llama", 2, 4, 32, 32), Params(F.MOSTLY_IQ2_XXS, imatrix=True))
    assert iq2["blk.0.attn_v.weight"] == T.Q4_K
    iq2 = tensor_types(_mixtral(2, 2), ModelFacts("llama", 2, 2, 32, 32), Params(F.MOSTLY_IQ2_XXS, imatrix=True))
    assert iq2["blk.0.attn_v.weight"] == T.Q2_K


def test_attn_v_like_tensors_share_one_counter_in_the_loaders_order():
    """attn_kv_b and attn_v are both attn_v-like: 8 of them in 4 layers, counted in name order within a
    layer (attn_kv_b first). Q4_K_M gives Q6_K where use_more_bits(i, 8): i = 0, 3, 6, 7."""
    names = [(f"blk.{i}.{r}.weight", (512, 512), T.F32) for i in range(4) for r in ("attn_v", "attn_kv_b")]
    got = tensor_types(names, ModelFacts("deepseek2", 4, 0, 8, 8), Params(F.MOSTLY_Q4_K_M))
    assert list(got) == [f"blk.{i}.{r}.weight" for i in range(4) for r in ("attn_kv_b", "attn_v")]
    assert [t.name for t in got.values()] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]


def test_fused_qkv_takes_the_attn_v_branch():
    """attn_qkv at Q3_K_M: Q5_K for the first two, Q4_K after (llama.cpp's own attn_qkv branch, Q4_K for
    Q3_K_M and Q5_K for Q4_K_M, is never reached); at Q4_K_M use_more_bits(i, 4) (n/8 = 0, 7n/8 = 3): i = 2, 3 get Q6_K."""
    names = [(f"blk.{i}.attn_qkv.weight", (3072, 9216), T.F32) for i in range(4)]
    facts = ModelFacts("phi3", 4, 0, 32, 32)
    assert [t.name for t in tensor_types(names, facts, Params(F.MOSTLY_Q3_K_M)).values()] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert [t.name for t in tensor_types(names, facts, Params(F.MOSTLY_Q4_K_M)).values()] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]


def test_70b_and_falcon():
    """llama with 80 layers and GQA: attn_v Q4_K -> Q5_K (not at n_head == n_head_kv, the 65B); falcon's output Q8_0."""
    names = [(f"blk.{i}.attn_v.weight", (8192, 1024), T.F32) for i in range(80)]
    gqa = tensor_types(names, ModelFacts("llama", 80, 0, 64, 8), Params(F.MOSTLY_Q4_K_M))
    mha = tensor_types(names, ModelFacts("llama", 80, 0, 64, 64), Params(F.MOSTLY_Q4_K_M))
    assert gqa["blk.11.attn_v.weight"] == T.Q5_K and mha["blk.11.attn_v.weight"] == T.Q4_K  # use_more_bits(11, 80) is false
    assert gqa["blk.0.attn_v.weight"] == mha["blk.0.attn_v.weight"] == T.Q6_K
    assert ModelFacts("qwen2", 80).is_70b and ModelFacts("jais2", 68).is_70b and not ModelFacts("qwen3", 80).is_70b
    falcon = tensor_types([("output.weight", (4096, 65024), T.F32)], ModelFacts("falcon", 32), Params(F.MOSTLY_Q4_K_M))
    assert falcon["output.weight"] == T.Q8_0


def test_tied_heads_options_pure_and_mxfp4():
    """No output.weight: token_embd takes the output's rule (Q6_K), or --output-tensor-type; --token-embedding-type
    wins over both; --pure: the default type with its width fallback; MXFP4_MOE: 3-D experts MXFP4, else Q8_0."""
    tied = [("token_embd.weight", (256, 1000), T.F32), ("blk.0.ffn_down.weight", (544, 256), T.F32)]
    facts = ModelFacts("gemma3", 1, 0, 4, 1)
    assert tensor_types(tied, facts, Params(F.MOSTLY_Q4_K_M))["token_embd.weight"] == T.Q6_K
    assert tensor_types(tied + [("output.weight", (256, 1000), T.F32)], facts,
                        Params(F.MOSTLY_Q4_K_M))["token_embd.weight"] == T.Q4_K
    assert tensor_types(tied, facts, Params(F.MOSTLY_Q4_K_M, output_tensor_type=T.Q8_0))["token_embd.weight"] == T.Q8_0
    both = Params(F.MOSTLY_Q4_K_M, output_tensor_type=T.Q8_0, token_embedding_type=T.F16)
    assert tensor_types(tied, facts, both)["token_embd.weight"] == T.F16
    pure = tensor_types(tied, facts, Params(F.MOSTLY_Q4_K_M, pure=True))
    assert pure == {"token_embd.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q5_0}  # 544 wide: Q4_K -> Q5_0
    moe = [("blk.0.ffn_down_exps.weight", (512, 256, 4), T.F32), ("blk.0.attn_q.weight", (256, 256), T.F32),
           ("output.weight", (256, 1000), T.F32)]
    got = tensor_types(moe, ModelFacts("gpt-oss", 1, 4, 4, 1), Params(F.MOSTLY_MXFP4_MOE))
    assert got == {"output.weight": T.Q8_0, "blk.0.attn_q.weight": T.Q8_0, "blk.0.ffn_down_exps.weight": T.MXFP4}


def test_which_tensors_are_quantized_and_in_what_order():
    assert allows_quantization("blk.0.attn_q.weight", (256, 256), "llama")
    assert allows_quantization("blk.0.ffn_down_exps.weight", (256, 256, 4), "qwen3moe")
    for name, ne in [("blk.0.attn_norm.weight", (256, 256)), ("blk.0.ffn_gate_inp.weight", (256, 4)),
                     ("position_embd.weight", (256, 512)), ("blk.0.attn_q.bias", (256, 256)),
                     ("blk.0.attn_q.weight", (256,)), ("blk.0.attn_q.weight", (256, 1, 1)),
                     ("blk.0.ssm_conv1d.weight", (4, 256))]:
        assert not allows_quantization(name, ne, "llama"), name
    assert allows_quantization("a.b.c", (256, 256), "llama")  # C's size_t rfind arithmetic: a 5-character name passes
    assert not allows_quantization("blk.0.attn_k_b.weight", (256, 256), "glm5-next")
    assert category("blk.0.ffn_down_shexp.weight") == "ffn_down" and category("per_layer_token_embd.weight") == "token_embd"
    assert category("blk.0.attn_kv_b.weight") == "attn_kv_b" and category("blk.0.attn_sinks.weight") == "other"
    assert llama_order(["output.weight", "blk.10.attn_q.weight", "blk.2.attn_v.weight", "token_embd.weight",
                        "blk.2.attn_k.weight"]) == ["output.weight", "token_embd.weight", "blk.2.attn_k.weight",
                                                    "blk.2.attn_v.weight", "blk.10.attn_q.weight"]


def test_model_facts_from_metadata():
    facts = ModelFacts.from_metadata({"general.architecture": "llama", "llama.block_count": 80,
                                      "llama.attention.head_count": [64] * 80, "llama.attention.head_count_kv": 8})
    assert (facts.n_gqa, facts.is_70b, facts.n_expert) == (8, True, 0)
    with pytest.raises(SchemeError, match="block_count"):
        ModelFacts.from_metadata({"general.architecture": "llama"})


def test_float_targets_round_as_ggml():
    """``ggml_compute_fp32_to_bf16`` / ``_fp16`` by hand: ties to even, NaN quiet (bf16 keeps its top bits)."""
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, np.float32(np.nan), 65520.0, -0.0], dtype=np.float32)
    assert to_bf16(x).tolist() == [0x3F80, 0x3F82, 0x7FC0, 0x4780, 0x8000]
    x = np.array([1.0 + 2**-11, 1.0 + 3 * 2**-11, np.float32(np.nan), 65520.0, -0.0], dtype=np.float32)
    assert to_f16(x).tolist() == [0x3C00, 0x3C02, 0x7E00, 0x7C00, 0x8000]


# --------------------------------------------------------------------------- quantize_gguf on synthetic files


def _gguf(path, tensors: dict[str, np.ndarray], experts: int = 0):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    if experts:
        w.add_expert_count(experts)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def moe(tmp_path):
    rng = np.random.default_rng(7)
    t = {"token_embd.weight": rng.standard_normal((64, 256)).astype(np.float32),
         "blk.0.attn_q.weight": rng.standard_normal((256, 256)).astype(np.float32),
         "blk.0.ffn_down_exps.weight": rng.standard_normal((2, 256, 256)).astype(np.float32),
         "blk.0.attn_norm.weight": np.ones(256, np.float32)}
    return _gguf(tmp_path / "moe.gguf", t, experts=2), t


def _imatrix(rows: dict[str, np.ndarray]) -> Imatrix:
    return Imatrix({n: ImatrixEntry(r.astype(np.float32), np.full(r.shape[0], 10.0, np.float32)) for n, r in rows.items()},
                   chunk_count=1, chunk_size=10, datasets=["d"], source="im.gguf")


def _bytes(path, name):
    h = read_header(path)
    t = next(t for t in h.tensors if t.name == name)
    with open(path, "rb") as fh:
        fh.seek(h.data_offset + t.offset)
        return fh.read(tensor_bytes(t.ggml_type, t.ne))


def test_each_expert_is_quantized_with_its_own_row_of_the_matrix(moe, tmp_path):
    """The 3-D tensor's bytes are expert 0's rows with row 0 of its entry, then expert 1's with row 1
    (scheme.encode on each slice); swapping the rows changes the bytes."""
    path, t = moe
    rng = np.random.default_rng(8)
    rows = {"blk.0.attn_q.weight": rng.random((1, 256)) + 0.1, "blk.0.ffn_down_exps.weight": rng.random((2, 256)) * 10 + 0.1}
    r = quantize_gguf(path, tmp_path / "a.gguf", "Q4_K_M", imatrix=_imatrix(rows))
    assert r.tensors["blk.0.ffn_down_exps.weight"][0] == "Q6_K" and r.tensors["blk.0.attn_norm.weight"][0] == "F32"
    q6 = get_scheme("q6_k")
    w = t["blk.0.ffn_down_exps.weight"]
    mean = rows["blk.0.ffn_down_exps.weight"].astype(np.float32) / np.float32(10)  # sums / count, as llama-quantize
    want = b"".join(q6.encode(torch.from_numpy(w[e].copy()), quant_weights=torch.from_numpy(mean[e]))["qweight"]
                    .numpy().tobytes() for e in range(2))
    assert _bytes(r.path, "blk.0.ffn_down_exps.weight") == want
    swapped = {**rows, "blk.0.ffn_down_exps.weight": rows["blk.0.ffn_down_exps.weight"][::-1].copy()}
    s = quantize_gguf(path, tmp_path / "b.gguf", "Q4_K_M", imatrix=_imatrix(swapped))
    assert _bytes(s.path, "blk.0.ffn_down_exps.weight") != want
    assert _bytes(s.path, "blk.0.attn_q.weight") == _bytes(r.path, "blk.0.attn_q.weight")


def test_refusals_come_before_anything_is_written(moe, tmp_path, monkeypatch):
    path, _ = moe
    import qkit.export.gguf.requantize as requantize

    def no_iq2_xxs(t, name="<tensor>"):  # every file type has an encoder now: one taken away, as a type without
        if t == gguf.GGMLQuantizationType.IQ2_XXS:
            raise SchemeError(f"{name}: no encoder")
        return scheme_for_type(t, name)
    out = tmp_path / "o.gguf"
    rows = {"blk.0.attn_q.weight": np.ones((1, 256)), "blk.0.ffn_down_exps.weight": np.ones((2, 256))}
    cases = [
        (lambda: quantize_gguf(path, out, "Q9_K"), InputError, "not a file type of llama-quantize"),
        (lambda: (monkeypatch.setattr(requantize, "scheme_for_type", no_iq2_xxs),
                  quantize_gguf(path, out, "IQ2_XXS", imatrix=_imatrix(rows))), SchemeError, "no llama.cpp encoder"),
        (lambda: quantize_gguf(path, out, "IQ2_XXS"), QkitError, "IQ2_XXS"),
        (lambda: quantize_gguf(path, out, "Q4_K_M", imatrix=_imatrix({**rows, "blk.9.attn_q.weight": np.ones((1, 256))})),
         InputError, "name no tensor"),
        (lambda: quantize_gguf(path, out, "Q4_K_M", imatrix=_imatrix({"blk.0.attn_q.weight": np.ones((1, 256))})),
         InputError, "no entry for blk.0.ffn_down_exps.weight"),
        (lambda: quantize_gguf(path, out, "Q4_K_M", imatrix=_imatrix({**rows, "blk.0.ffn_down_exps.weight": np.ones((3, 256))})),
         InputError, "another model"),
        (lambda: quantize_gguf(path, out, "Q4_K_M", token_embedding_type="q9"), InputError, "not a ggml type"),
        (lambda: quantize_gguf(path, path, "Q4_K_M"), QkitError, "never writes over"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
        monkeypatch.undo()
        assert not out.exists()
    q8 = quantize_gguf(path, tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(InputError, match="requantizing from it is disabled"):
        quantize_gguf(q8.path, out, "Q4_K_M")


def test_scheme_arguments_map_to_llama_quantize_arguments():
    assert llama_quantize_args("q4_k") == (F.MOSTLY_Q4_K_M, False)  # llama-quantize's alias
    assert llama_quantize_args(get_scheme("q4_k")) == (F.MOSTLY_Q4_K_S, True)  # qkit's uniform type: --pure
    assert llama_quantize_args(get_scheme("q4_k_m")) == (F.MOSTLY_Q4_K_M, False)
    assert llama_quantize_args(get_scheme("q2_k-llama")) == (F.MOSTLY_Q2_K, False)
    with pytest.raises(InputError, match="not one of llama.cpp"):
        llama_quantize_args(get_scheme("int4-g128"))
