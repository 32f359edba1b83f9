"""W8A8 export (compressed-tensors int-quantized, dynamic per-token int8 activations) and its verify."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError, InputError
from qkit.export.compressed_tensors_w8a8 import library_fake_quant

CAL = {"calibration_samples": 4, "calibration_seqlen": 32}


def test_library_rule_is_compressed_tensors_own_bit_for_bit():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 48, generator=g) * torch.rand(1, 7, 1, generator=g) * 10
    x[0, 3] = 0.0  # an all-zero token: the library's eps scale, zeros out
    x[1, 2, 5] = 1e4  # an outlier channel
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(48, 4))
    theirs = fake_quantize(x, scale, zp, args)
    assert torch.equal(library_fake_quant(x), theirs)


@pytest.fixture(scope="module")
def w8a8_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("w8a8") / "sq"
    quantize_model(tiny_model_dir, output=out, scheme="int8-row", method="smoothquant", method_options=CAL,
                   format="compressed-tensors", options=QuantizeOptions(activations="int8-token"))
    return out


def test_w8a8_layout_is_what_vllm_reads(w8a8_dir):
    qc = json.loads((w8a8_dir / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized" and qc["quant_method"] == "compressed-tensors"
    (group,) = qc["config_groups"].values()
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "group_size": None, "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "group_size": None, "dynamic": True}
    assert qc["ignore"] == ["lm_head"]
    with safe_open(str(w8a8_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert w.dtype == torch.int8 and w.shape == (64, 160) and int(w.abs().max()) == 127
    assert s.shape == (64, 1) and s.dtype == torch.float32
    assert not torch.allclose(norm, torch.ones_like(norm))  # the SmoothQuant-folded norm is an ordinary tensor
    sidecar = json.loads((w8a8_dir / "qkit-export.json").read_text())
    assert sidecar["activations"] == "int8-token" and sidecar["method"]["name"] == "smoothquant"


def test_w8a8_verifies_against_the_library_rule_exactly_and_the_simulation_within_tolerance(w8a8_dir):
    from qkit.verify import verify_checkpoint

    r = verify_checkpoint(w8a8_dir)
    assert r.passed, r.to_dict()
    assert r.weights_ok and all(t.identical for t in r.tensors) and len(r.tensors) == 14
    assert r.logits_max_abs_diff <= r.logits_tolerance  # qkit weights + compressed-tensors' rule: fp32 rounding
    act = r.activations
    assert act["simulation"] == "act-int8-token" and act["activation_effect"] > 0
    assert act["max_abs_diff"] <= act["tolerance"]
    assert "activations" in r.to_dict()


def test_activations_need_compressed_tensors_and_int8_row(tiny_model_dir, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(InputError, match="--activations declares run-time activation quantization"):
        quantize_model(tiny_model_dir, output=out, scheme="int8-row", options=QuantizeOptions(activations="int8-token"))
    with pytest.raises(InputError, match="unknown --activations"):
        quantize_model(tiny_model_dir, output=out, scheme="int8-row", format="compressed-tensors",
                       options=QuantizeOptions(activations="int4-token"))
    with pytest.raises(ExportError, match="stores int8 per-channel weights, not int4-g32"):
        quantize_model(tiny_model_dir, output=out, scheme="int4-g32", format="compressed-tensors",
                       options=QuantizeOptions(activations="int8-token"))
    with pytest.raises(InputError, match="only compressed-tensors W8A8 .* stores; --format bitsandbytes stores weights only"):
        quantize_model(tiny_model_dir, output=out, scheme="nf4", format="bitsandbytes",
                       options=QuantizeOptions(activations="int8-token"))
    assert not out.exists()
