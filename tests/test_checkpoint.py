"""The checkpoint: bit-exact round trip, self-describing manifest, sharding, atomic writes, loading back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import qkit
from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import INDEX_FILE, ShardWriter, atomic_directory, iter_quantized, read_manifest, weight_files
from qkit.errors import CheckpointError, OutputExistsError
from qkit.schemes import QuantizedTensor, Recipe, get_scheme, quantize_tensor, scheme_names
from qkit.transform import Rules, is_block_projection

SCHEMES = scheme_names() + ["int4-g64", "int8-g32"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_is_bit_exact(tiny_model_dir, tmp_path, scheme):
    out = tmp_path / "q"
    result = quantize_model(tiny_model_dir, output=out, scheme=scheme, collect=True)
    whole = isinstance(get_scheme(scheme), Recipe)  # a recipe's file quantizes the (tied) embedding too
    assert result.matrices == 14 + whole and result.output == out
    loaded = dict(iter_quantized(out))
    for name, qt in result.quantized.items():
        back = loaded[name]
        assert isinstance(back, QuantizedTensor)
        assert back.scheme == qt.scheme and back.shape == qt.shape and back.dtype == qt.dtype
        assert torch.equal(back.qweight, qt.qweight) and torch.equal(back.scales, qt.scales)
        assert torch.equal(back.dequantize(), qt.dequantize())
    # qkit.load gives a model whose weights are exactly the dequantized ones, the rest untouched
    model = qkit.load(out).model
    for name, qt in result.quantized.items():
        assert torch.equal(model.get_parameter(name).detach(), qt.dequantize())
    ref = qkit.load(tiny_model_dir).model
    if not whole:
        assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_manifest_and_config_describe_the_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    quantize_model(tiny_model_dir, output=out, scheme="int4-g128")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "qkit" and qc["format_version"] == 1
    assert qc["scheme"] == {"name": "int4-g128", "kind": "absmax", "bits": 4, "granularity": "group",
                            "group_size": 128, "scale_dtype": "fp16", "symmetric": True}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["qkit"])
        keys = set(f.keys())
    entry = meta["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert entry == {"scheme": qc["scheme"], "shape": [64, 160], "dtype": "float32"}
    assert "model.layers.0.mlp.down_proj.weight.qweight" in keys and "model.layers.0.mlp.down_proj.weight.scales" in keys
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    # tokenizer and chat template came along
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_packed_storage_is_really_four_bits(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    quantize_model(tiny_model_dir, output=out, scheme="int4-g128")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight.qweight")
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight.scales")
    assert q.dtype == torch.uint8 and q.numel() == 64 * 160 // 2
    # 160 = 128 + 32: two groups per row, the second one short, each with its own fp16 scale
    assert s.dtype == torch.float16 and tuple(s.shape) == (64, 2)


def test_plain_python_can_decode_a_checkpoint(tiny_model_dir, tmp_path):
    """The documented layout, decoded without qkit: int4 codes q+8, even element in the high nibble."""
    out = tmp_path / "q"
    result = quantize_model(tiny_model_dir, output=out, scheme="int4-row", collect=True)
    name = "model.layers.1.self_attn.q_proj.weight"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(name + ".qweight")
        scales = f.get_tensor(name + ".scales").float()
    hi, lo = (packed >> 4).to(torch.int16), (packed & 15).to(torch.int16)
    codes = torch.stack([hi, lo], dim=1).reshape(-1)[: 64 * 64] - 8
    w = codes.reshape(64, 64).float() * scales
    assert torch.equal(w, result.quantized[name].dequantize())


def test_sharded_write_with_index(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    result = quantize_model(tiny_model_dir, output=out, scheme="nf4", collect=True,
                            options=QuantizeOptions(max_shard_bytes=40_000))
    files = weight_files(out)
    assert len(files) > 2 and (out / INDEX_FILE).is_file()
    assert all(p.name.endswith(f"-of-{len(files):05d}.safetensors") for p in files)
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["metadata"]["qkit"]["tensors"]) == set(result.quantized)
    assert read_manifest(out)["tensors"] == index["metadata"]["qkit"]["tensors"]
    for path in files:  # each shard's manifest lists exactly the quantized tensors whose parts it stores
        with safe_open(str(path), framework="pt") as f:
            listed = set(json.loads(f.metadata()["qkit"])["tensors"])
            stored = {k.rsplit(".", 1)[0] for k in f.keys() if k.rsplit(".", 1)[0] in result.quantized}
        assert listed == stored, path.name
    back = dict(iter_quantized(out))
    for name, qt in result.quantized.items():
        assert torch.equal(back[name].dequantize(), qt.dequantize())


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_interrupted_quantize_leaves_no_output(tiny_model_dir, tmp_path):
    out = tmp_path / "out"

    def boom(name):
        if "layers.1" in name:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny_model_dir, output=out, scheme="nf4", progress=lambda step: step.done and boom(step.name))
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_before_work(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputExistsError):
        quantize_model(tiny_model_dir, output=out)


def test_duplicate_tensor_names_are_refused(tmp_path):
    w = ShardWriter(tmp_path)
    w.add("a", torch.zeros(2))
    with pytest.raises(CheckpointError):
        w.add("a", torch.zeros(2))


def test_rules_select_block_projections_and_apply_overrides(tiny_model_dir, tmp_path):
    assert is_block_projection("model.layers.3.mlp.down_proj.weight", (576, 1536))
    assert not is_block_projection("model.embed_tokens.weight", (49152, 576))
    assert not is_block_projection("lm_head.weight", (49152, 576))
    assert not is_block_projection("model.layers.3.input_layernorm.weight", (576,))
    assert not is_block_projection("model.layers.3.self_attn.q_proj.bias", (576,))
    # mixture-of-experts routers stay unquantized (llama.cpp's ffn_gate_inp); the experts and gate_proj do not
    for router in ("model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight",
                   "model.layers.0.mlp.router.weight", "model.layers.0.mlp.shared_expert_gate.weight"):
        assert not is_block_projection(router, (4, 256)), router
    for expert in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                   "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight"):
        assert is_block_projection(expert, (512, 256)), expert
    rules = Rules.parse(exclude=["*.layers.0.*"], keep=["int8:*.down_proj.weight", "none:*.v_proj.weight"])
    nf4 = get_scheme("nf4")
    assert rules.scheme_for("model.layers.0.mlp.up_proj.weight", (4, 4), nf4) is None
    assert rules.scheme_for("model.layers.1.mlp.up_proj.weight", (4, 4), nf4) is nf4
    assert rules.scheme_for("model.layers.1.mlp.down_proj.weight", (4, 4), nf4).name == "int8-row"
    assert rules.scheme_for("model.layers.1.self_attn.v_proj.weight", (4, 4), nf4) is None
    assert Rules.parse(include=["lm_head.weight"]).scheme_for("lm_head.weight", (8, 4), nf4) is nf4
    out = tmp_path / "mixed"
    result = quantize_model(tiny_model_dir, output=out, scheme="nf4",
                            options=QuantizeOptions(keep=["int8:*.down_proj.weight"]))
    assert result.schemes_used == {"nf4": 12, "int8-row": 2}
    kinds = {n: e["scheme"]["name"] for n, e in read_manifest(out)["tensors"].items()}
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "int8-row" and kinds["model.layers.1.mlp.up_proj.weight"] == "nf4"


def test_in_memory_transform_equals_quantize_tensor(tiny_model_dir, tmp_path):
    from qkit.checkpoint import iter_tensors

    result = quantize_model(tiny_model_dir, output=tmp_path / "q", scheme="int4-g128", collect=True)
    for name, w in iter_tensors(tiny_model_dir):
        if name in result.quantized:
            direct = quantize_tensor(w, get_scheme("int4-g128"), name=name)
            assert torch.equal(direct.qweight, result.quantized[name].qweight)
