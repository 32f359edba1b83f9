"""bitsandbytes NF4 export: byte-identical to what bitsandbytes itself saves, loaded by transformers with
bitsandbytes on CPU, dequantized weights bit-identical to qkit's, logits matching qkit's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_llama, prompt_ids
from safetensors.torch import load_file

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError
from qkit.models import load
from qkit.schemes import get_scheme, quantize_tensor

bnb = pytest.importorskip("bitsandbytes")

LOGITS_RTOL = 1e-4  # fp32, bitsandbytes' generic CPU path (qkit.verify); measured: 0


def load_with_transformers(directory: Path):
    """transformers + bitsandbytes on CPU, as a user loads it; bitsandbytes' generic CPU path.

    On a CPU with AVX512-BF16, bitsandbytes 0.50.2 repacks weights on the first forward into a bf16 kernel
    layout (absmax in bf16): machine-dependent numerics, checked separately below with a bf16 tolerance.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), device_map="cpu").eval()
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def test_export_is_byte_identical_to_bitsandbytes_own_save(llama128, tmp_path):
    """bitsandbytes quantizes the same fp32 weights and saves them; qkit's export (fp32 absmax) is the same file content."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    theirs_dir = tmp_path / "bnb-own"
    AutoModelForCausalLM.from_pretrained(str(llama128), quantization_config=cfg, device_map="cpu").save_pretrained(str(theirs_dir))
    ours_dir = tmp_path / "qkit"
    quantize_model(llama128, output=ours_dir, scheme="nf4", format="bitsandbytes",
                   options=QuantizeOptions(scale_dtype="fp32", device="cpu"))
    theirs, ours = load_file(str(theirs_dir / "model.safetensors")), load_file(str(ours_dir / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    ours_qc = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
    theirs_qc = json.loads((theirs_dir / "config.json").read_text())["quantization_config"]
    for k in ("quant_method", "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
        assert ours_qc[k] == theirs_qc[k], k
    assert ours_qc["llm_int8_skip_modules"] == ["lm_head"]


def test_layout_golden(llama128, tmp_path):
    out = tmp_path / "nf4"
    quantize_model(llama128, output=out, scheme="nf4", format="bitsandbytes", options=QuantizeOptions(device="cpu"))
    t = load_file(str(out / "model.safetensors"))
    k = "model.layers.0.mlp.down_proj.weight"  # [128, 256]
    assert t[k].dtype == torch.uint8 and tuple(t[k].shape) == (128 * 256 // 2, 1)
    assert t[k + ".absmax"].dtype == torch.float32 and tuple(t[k + ".absmax"].shape) == (128 * 256 // 64,)
    assert t[k + ".quant_map"].tolist()[:2] == [-1.0, pytest.approx(-0.6961928009986877, abs=0)]
    state = bytes(t[k + ".quant_state.bitsandbytes__nf4"].tolist()).decode()
    assert state == '{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [128, 256]}'
    # The even element in the high nibble: byte 0 holds codes of w[0, 0] (high) and w[0, 1] (low).
    src = load_file(str(llama128 / "model.safetensors"))[k]
    qt = quantize_tensor(src, get_scheme("nf4"))
    assert int(t[k][0, 0]) == int(qt.qweight[0])


@pytest.mark.parametrize("dtype,scale", [(torch.float32, "fp16"), (torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_transformers_loads_export(tmp_path, llama128, dtype, scale):
    src_dir = llama128 if dtype == torch.float32 else make_llama(tmp_path / "half", dtype=dtype)
    out = tmp_path / "nf4"
    r = quantize_model(src_dir, output=out, scheme="nf4", format="bitsandbytes",
                       options=QuantizeOptions(scale_dtype=scale, device="cpu"))
    assert r.format == "bitsandbytes" and r.matrices == 14
    theirs = load_with_transformers(out)
    assert isinstance(theirs.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    assert not isinstance(theirs.lm_head, bnb.nn.Linear4bit)
    s = get_scheme("nf4", scale)
    src = load_file(str(src_dir / "model.safetensors"))
    for name, w in src.items():
        if name.endswith("proj.weight"):
            p = theirs.get_submodule(name.removesuffix(".weight")).weight
            got = bnb.functional.dequantize_4bit(p.data, p.quant_state)
            expected = quantize_tensor(w, s).dequantize(torch.float32)
            if dtype == torch.float32:
                assert got.dtype == torch.float32 and torch.equal(got, expected), name
            else:  # bitsandbytes rounds its fp32 product once to the weight dtype: at most one rounding step
                assert got.dtype == dtype
                assert torch.allclose(got.float(), expected, rtol=torch.finfo(dtype).eps, atol=0), name
    ids = prompt_ids(src_dir)
    ours = load(quantize_model(src_dir, output=tmp_path / "qkit", scheme="nf4",
                               options=QuantizeOptions(scale_dtype=scale, device="cpu")).output,
                device="cpu", dtype=dtype).model
    with torch.no_grad():
        a, b = theirs(ids).logits.float(), ours(ids).logits.float()
    rtol = LOGITS_RTOL if dtype == torch.float32 else 2e-2
    assert float((a - b).abs().max()) <= rtol * max(1.0, float(b.abs().max()))


def test_skipped_modules_and_cpu_block_rule(tiny_model_dir, tmp_path):
    # The conftest tiny llama's MLP is 160 wide: bitsandbytes' CPU kernels would misread its blocks.
    with pytest.raises(ExportError) as err:
        quantize_model(tiny_model_dir, output=tmp_path / "x", scheme="nf4", format="bitsandbytes",
                       options=QuantizeOptions(device="cpu"))
    assert "model.layers.0.mlp.down_proj.weight is 160 wide; leave such matrices unquantized with --keep none:'*.down_proj.weight'" in str(err.value)
    out = tmp_path / "kept"
    quantize_model(tiny_model_dir, output=out, scheme="nf4", format="bitsandbytes",
                   options=QuantizeOptions(keep=["none:*.down_proj.weight"], device="cpu"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["llm_int8_skip_modules"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    theirs = load_with_transformers(out)
    down = theirs.model.layers[1].mlp.down_proj
    assert type(down) is torch.nn.Linear
    assert torch.equal(down.weight, load_file(str(tiny_model_dir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize(
    "scheme,needle",
    [("int4-g64", "writes nf4 only, not int4-g64; use nf4 here, or --format compressed-tensors for int4-g64"),
     ("int4-tensor", "--format compressed-tensors with int4-row"),
     ("int8-row", "--format compressed-tensors for int8-row")],
)
def test_refused(llama128, tmp_path, scheme, needle):
    with pytest.raises(ExportError) as err:
        quantize_model(llama128, output=tmp_path / "x", scheme=scheme, format="bitsandbytes",
                       options=QuantizeOptions(device="cpu"))
    assert needle in str(err.value)
    assert not (tmp_path / "x").exists()
