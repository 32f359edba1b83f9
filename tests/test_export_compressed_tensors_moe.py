"""compressed-tensors export of mixture-of-experts models (qkit.export.compressed_tensors_moe): every expert matrix is
written as its own quantized linear under the checkpoint's name, the routers are ignored, and compressed-tensors'
own readers decompress each expert bit for bit to qkit's decode of it, which is qkit's quantization of the source
(and transformers, which fuses a layer's experts on load, holds those very weights).

The models are helpers_archs' tiny seeded ones (2 layers, 4 experts, hidden 256) over its 512-piece SentencePiece
vocabulary, so each file is a few MB; qwen2_moe (with its shared expert and shared_expert_gate) is built here from
the same sizes, as helpers_archs' ARCHS feeds the GGUF tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_archs import EXPERTS, HIDDEN, INTER, LAYERS, _SPM_IDS, SPM_VOCAB, make_arch_model, spm_tokenizer
from safetensors.torch import load_file

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError
from qkit.export.compressed_tensors import FORMAT
from qkit.export.compressed_tensors_w8a8 import FORMAT as W8A8
from qkit.schemes import dequantize, get_scheme, quantize_tensor

pytest.importorskip("sentencepiece")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

# Each architecture's router modules, as the config's ignore list names them (beside lm_head).
ROUTERS = {
    "qwen3_moe": ["mlp.gate"],
    "mixtral": ["block_sparse_moe.gate"],
    "qwen2_moe": ["mlp.gate", "mlp.shared_expert_gate"],
}


def _qwen2_moe(directory: Path) -> Path:
    """A tiny seeded qwen2_moe (helpers_archs' sizes, a shared expert of INTER) with the SentencePiece vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2_moe", vocab_size=SPM_VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=INTER // 2, shared_expert_intermediate_size=INTER,
        decoder_sparse_step=1, mlp_only_layers=[], **_SPM_IDS)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    spm = spm_tokenizer(root / "spm")
    out = {a: make_arch_model(root / a, a, spm) for a in ("qwen3_moe", "mixtral", "gpt_oss")}
    out["qwen2_moe"] = _qwen2_moe(root / "qwen2_moe")
    return out


def _export(model: Path, out: Path, scheme: str, **kw) -> dict:
    quantize_model(model, output=out, options=QuantizeOptions(scheme=scheme, format="compressed-tensors", **kw))
    return json.loads((out / "config.json").read_text())["quantization_config"]


def _experts(source: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in source if ".experts." in n)


def _parts(stored: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(module + "."): v for k, v in stored.items() if k.rpartition(".")[0] == module}


def _check_layout(arch: str, qc: dict, stored: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> list[str]:
    """The config's targets and ignore list, the routers kept as they were, and no expert in the source dtype."""
    QuantizationConfig.model_validate(qc)  # the library's own schema
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]]
    routers = [f"model.layers.{i}.{r}" for i in range(LAYERS) for r in ROUTERS[arch]]
    assert qc["ignore"] == sorted(["lm_head", *routers])
    for r in routers:
        assert torch.equal(stored[f"{r}.weight"], source[f"{r}.weight"])  # unquantized, bit for bit
    experts = _experts(source)
    assert len(experts) == LAYERS * EXPERTS * 3
    assert not [e for e in experts if e in stored and stored[e].is_floating_point()]  # none left in the source dtype
    return experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_int4_experts_bit_identical_through_compressed_tensors(models, tmp_path, arch):
    out = tmp_path / "ct"
    qc = _export(models[arch], out, "int4-g128")
    assert qc["format"] == "pack-quantized"
    stored, source = load_file(str(out / "model.safetensors")), load_file(str(models[arch] / "model.safetensors"))
    experts = _check_layout(arch, qc, stored, source)
    first = experts[0].removesuffix(".weight")  # model.layers.0.{mlp|block_sparse_moe}.experts.0.{down_proj|w1}
    assert sorted(_parts(stored, first)) == ["weight_packed", "weight_scale", "weight_shape"]
    # The library's model-free reader: it matches the config's targets and ignore list against the checkpoint's
    # names, decompresses every targeted module and refuses a quantization parameter it did not consume.
    library = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(dict(stored))
    s = get_scheme("int4-g128")
    for e in experts:
        ours = dequantize(FORMAT.decode(_parts(stored, e.removesuffix(".weight")), s, torch.float32))
        assert torch.equal(library[e], ours), e
    assert torch.equal(ours, dequantize(quantize_tensor(source[e], s)))  # qkit's quantization of that expert
    if arch == "mixtral":  # transformers fuses each layer's w1/w3 into gate_up_proj on load: the same weights
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out), device_map="cpu")
        for i, layer in enumerate(model.model.layers):
            fused = layer.mlp.experts
            for x in range(EXPERTS):
                p = f"model.layers.{i}.block_sparse_moe.experts.{x}"
                gate, up = fused.gate_up_proj[x].chunk(2)
                for w, name in ((gate, "w1"), (up, "w3"), (fused.down_proj[x], "w2")):
                    assert torch.equal(w, library[f"{p}.{name}.weight"]), f"{p}.{name}"


@pytest.mark.parametrize("arch, scheme, activations",
                         [("qwen2_moe", "int8-row", "int8-token"), ("qwen3_moe", "mxfp4", None)])
def test_w8a8_and_fp4_experts_through_the_library_compressor(models, tmp_path, arch, scheme, activations):
    """W8A8 (int-quantized) and MXFP4: each expert through the compressor of its group's format (the model-free
    reader above cannot tell an int-quantized linear's ``weight`` from the embedding's). compressed-tensors 0.20.1
    decompresses FP4 to bf16 (compressed_tensors_fp4), so there the library's weight is bf16 of qkit's."""
    out = tmp_path / "ct"
    qc = _export(models[arch], out, scheme, activations=activations)
    stored, source = load_file(str(out / "model.safetensors")), load_file(str(models[arch] / "model.safetensors"))
    experts = _check_layout(arch, qc, stored, source)
    group = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    fmt, s = (W8A8 if activations else FORMAT), get_scheme(scheme)
    for e in experts:
        module = e.removesuffix(".weight")
        parts = _parts(stored, module)
        assert sorted(parts) == sorted(compressor.compression_param_names(group)), e
        library = compressor.decompress(dict(parts), group)["weight"]
        ours = dequantize(fmt.decode(parts, s, torch.float32))
        assert torch.equal(library, ours.to(library.dtype)), e
    assert torch.equal(ours, dequantize(quantize_tensor(source[e], s)))  # qkit's quantization of that expert
    if arch == "qwen2_moe":  # the shared expert is a plain MLP: quantized as any linear
        assert stored["model.layers.0.mlp.shared_expert.down_proj.weight"].dtype == torch.int8


@pytest.mark.parametrize("arch, kw, needle", [
    ("gpt_oss", {}, "stores its experts fused (model.layers.0.mlp.experts.down_proj [4, 512, 256])"),
    ("qwen3_moe", {"keep": ["none:*experts.1.*"]},
     "6 of 24 expert matrices would stay in their source dtype (model.layers.0.mlp.experts.1.down_proj.weight)"),
    ("qwen3_moe", {"keep": ["int8-row:*self_attn*"]}, "but this export mixes int4-g128, int8-row"),
])
def test_refused_in_one_line_before_any_work(models, tmp_path, arch, kw, needle):
    out = tmp_path / "ct"
    with pytest.raises(ExportError) as info:
        _export(models[arch], out, "int4-g128", **kw)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()
