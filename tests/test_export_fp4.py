"""compressed-tensors export of the FP4 schemes: ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` in the
layout vLLM and llm-compressor use, read back by compressed-tensors' own decompressor bit for bit, and
``qkit verify`` through transformers + compressed-tensors on CPU (in bf16: see
``qkit.export.compressed_tensors_fp4``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import fused_amax

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError
from qkit.verify import verify_checkpoint
from qkit.schemes import get_scheme, quantize_tensor

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402

FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
PRESET = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


def stored(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def projections(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(directory / "model.safetensors")).items() if k.endswith("proj.weight")}


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in FORMAT:
        d = tmp_path_factory.mktemp("fp4") / name
        r = quantize_model(tiny_model_dir, output=d, scheme=name, format="compressed-tensors",
                           options=QuantizeOptions(device="cpu"))
        assert r.format == "compressed-tensors" and r.matrices == 14
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(FORMAT))
def test_layout_and_config_are_the_librarys(exports, name):
    d = exports[name]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", FORMAT[name], ["lm_head"])
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == FORMAT[name] and group["input_activations"] is None
    preset = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[PRESET[name]]).weights
    assert QuantizationScheme(targets=["Linear"], weights=group["weights"]).weights == preset
    # the compressor the library picks for such a weight is the one named by the format
    compressor = BaseCompressor.get_value_from_registry(FORMAT[name])
    assert compressor.can_compress(torch.nn.Linear, QuantizationScheme(targets=["Linear"], weights=preset))

    tensors = stored(d)
    m = "model.layers.0.mlp.down_proj"  # [64, 160]
    assert tensors[f"{m}.weight_packed"].dtype == torch.uint8 and tuple(tensors[f"{m}.weight_packed"].shape) == (64, 80)
    scale = tensors[f"{m}.weight_scale"]
    if name == "nvfp4":
        assert scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (64, 10)
        gs = tensors[f"{m}.weight_global_scale"]
        assert gs.dtype == torch.float32 and tuple(gs.shape) == (1,)
    else:
        assert scale.dtype == torch.uint8 and tuple(scale.shape) == (64, 5) and f"{m}.weight_global_scale" not in tensors
    assert f"{m}.weight_shape" not in tensors and f"{m}.weight" not in tensors


@pytest.mark.parametrize("name", list(FORMAT))
def test_librarys_decompressor_gives_qkits_weights_bit_for_bit(exports, tiny_model_dir, name):
    """compressed-tensors' own ``decompress`` (which returns bf16) on the exported tensors of every module
    equals qkit's dequantization of the same weight rounded to bf16, bit for bit; nvfp4 rounds once from
    the identical fp32 product, mxfp4 is exact in bf16 (so also equal to qkit's fp32)."""
    from compressed_tensors.quantization import QuantizationScheme

    tensors = stored(exports[name])
    s = get_scheme(name)
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[PRESET[name]])
    compressor = BaseCompressor.get_value_from_registry(FORMAT[name])
    for key, w in projections(tiny_model_dir).items():
        module = key.removesuffix(".weight")
        state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        dense = compressor.decompress(state, scheme)["weight"]
        # nvfp4: q/k/v and gate/up quantized with their fused group's largest amax (tests/test_nvfp4_fused_scales.py)
        amax = fused_amax(projections(tiny_model_dir), key) if name == "nvfp4" else None
        ours = quantize_tensor(w, s, name=key, tensor_amax=amax).dequantize(torch.float32)
        assert dense.dtype == torch.bfloat16 and torch.equal(dense, ours.to(torch.bfloat16)), key
        if name == "mxfp4":
            assert torch.equal(dense.float(), ours), key


@pytest.mark.parametrize("name", list(FORMAT))
def test_verify_through_transformers_in_bf16(exports, name):
    r = verify_checkpoint(exports[name], device="cpu")
    assert r.passed and r.dtype == "bfloat16" and len(r.tensors) == 14
    assert "cannot run them in a float32 model on CPU, so both sides are compared in bfloat16" in r.weight_rule
    assert all(t.identical and t.matches_export for t in r.tensors)
    assert r.logits_max_abs_diff <= r.logits_tolerance


def test_verify_without_qkits_sidecar_infers_the_schemes(exports, tmp_path):
    import shutil

    for name in FORMAT:
        d = tmp_path / name
        shutil.copytree(exports[name], d)
        (d / "qkit-export.json").unlink()
        r = verify_checkpoint(d, device="cpu")
        assert r.passed and set(r.by_scheme()) == {name}
        assert all(t.identical and t.matches_export is None for t in r.tensors)


def test_bf16_model_is_verified_as_it_is(tmp_path):
    from conftest import make_tiny_llama

    src = tmp_path / "bf16"
    make_tiny_llama(src, dtype=torch.bfloat16, layers=1)
    out = tmp_path / "ct"
    quantize_model(src, output=out, scheme="nvfp4", format="compressed-tensors", options=QuantizeOptions(device="cpu"))
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.dtype == "bfloat16" and "cannot run" not in r.weight_rule
    assert all(t.identical for t in r.tensors)


def test_mixed_with_int_groups_is_mixed_precision(tiny_model_dir, tmp_path):
    out = tmp_path / "mixed"
    quantize_model(tiny_model_dir, output=out, scheme="nvfp4", format="compressed-tensors",
                   options=QuantizeOptions(keep=["int8-row:*.down_proj.weight"], device="cpu"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["format"] == "mixed-precision"
    formats = {g["format"]: g for g in qc["config_groups"].values()}
    assert set(formats) == {"nvfp4-pack-quantized", "pack-quantized"}
    assert sorted(formats["pack-quantized"]["targets"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and set(r.by_scheme()) == {"nvfp4", "int8-row"}
    assert r.by_scheme()["nvfp4"]["identical"] == 12


@pytest.mark.parametrize("name", list(FORMAT))
def test_width_that_is_not_whole_blocks_is_refused_before_any_work(tmp_path, name):
    from conftest import make_tiny_llama

    src = tmp_path / "odd"
    make_tiny_llama(src, layers=1, intermediate=168)  # 168 = 10.5 x 16
    out = tmp_path / "refused"
    with pytest.raises(ExportError) as err:
        quantize_model(src, output=out, scheme=name, format="compressed-tensors", options=QuantizeOptions(device="cpu"))
    msg = str(err.value)
    assert f"{name} stores blocks of {16 if name == 'nvfp4' else 32} along each row, but model.layers.0.mlp.down_proj.weight is 168 wide" in msg
    assert "--exclude" in msg and "\n" not in msg and not out.exists()
