"""compressed-tensors export: the layout matches the library's own packer, transformers loads it, and the
weights it dequantizes are bit-identical to qkit's; logits match qkit's own checkpoint loaded by qkit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_llama, prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError
from qkit.export.compressed_tensors import _pack_int32, _unpack_int32
from qkit.models import load
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.packing import unpack_nibbles

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

LOGITS_RTOL = 1e-4  # the stated tolerance for fp32 (qkit.verify.LOGITS_RTOL); measured: 0


def source_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def load_with_transformers(directory: Path):
    """The library's reader, as a user calls it: transformers + compressed-tensors, on CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), device_map="cpu").eval()


# --------------------------------------------------------------------------- the packing itself


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 70), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_packing_equals_compressed_tensors_packer(rows, cols, bits, seed):
    g = torch.Generator().manual_seed(seed)
    half = 2 ** (bits - 1)
    q = torch.randint(-half, half, (rows, cols), generator=g, dtype=torch.int8)
    ours = _pack_int32((q.to(torch.int16) + half).to(torch.uint8), bits)
    theirs = pack_to_int32(q, bits)
    assert ours.dtype == torch.int32 and ours.shape == theirs.shape == (rows, -(-cols * bits // 32))
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size([rows, cols])), q)
    assert torch.equal(_unpack_int32(ours, bits, cols).to(torch.int16) - half, q.to(torch.int16))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 40), scheme=st.sampled_from(["int4-row", "int8-row", "int4-g8"]),
       seed=st.integers(0, 2**16))
def test_encode_decode_against_compressed_tensors(rows, cols, scheme, seed):
    """Both encode paths (nibble swap when cols % 8 == 0, unpack + repack otherwise) equal the library's packer."""
    from qkit.export.compressed_tensors import FORMAT

    s = get_scheme(scheme)
    if "-g" in scheme and cols % 8:
        cols += 8 - cols % 8
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    qt = quantize_tensor(w, s)
    stored = FORMAT.encode("m.weight", qt)
    ints = ((unpack_nibbles(qt.qweight, rows * cols).to(torch.int16) - 8).view(rows, cols) if s.bits == 4
            else qt.qweight.to(torch.int16))
    assert torch.equal(stored["m.weight_packed"], pack_to_int32(ints.to(torch.int8), s.bits))
    back = FORMAT.decode({k.removeprefix("m."): v for k, v in stored.items()}, s, torch.float32)
    assert torch.equal(back.qweight, qt.qweight) and torch.equal(back.scales, qt.scales) and back.shape == qt.shape


def test_packing_golden_word():
    # Eight 4-bit values q = -8..-1 -> stored q + 8 = 0..7, first column in the lowest nibble:
    # 0x76543210. Values q = 0..7 -> 8..15 -> 0xFEDCBA98 = -19088744 as int32.
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int16)
    packed = _pack_int32((q + 8).to(torch.uint8), 4)
    assert packed.tolist() == [[0x76543210], [0xFEDCBA98 - 2**32]]


# --------------------------------------------------------------------------- conformance, per scheme offered

SCHEMES = ["int4-g32", "int4-g64", "int4-g128", "int8-g64", "int4-row", "int8-row"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_export_bit_identical(llama128, tmp_path, scheme):
    out = tmp_path / "ct"
    result = quantize_model(llama128, output=out, scheme=scheme, format="compressed-tensors",
                            options=QuantizeOptions(device="cpu"))
    assert result.format == "compressed-tensors" and result.matrices == 14
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    s = get_scheme(scheme)
    group = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert (group["num_bits"], group["strategy"], group["group_size"]) == (
        s.bits, "group" if "-g" in scheme else "channel", s.granularity.size if "-g" in scheme else None)
    QuantizationConfig.model_validate(qc)  # the library's own schema (unknown keys in a scheme are rejected)

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        shape = f.get_tensor("model.layers.0.mlp.down_proj.weight_shape")
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (128, 256 * s.bits // 32)
    assert tuple(scale.shape) == (128, 256 // s.granularity.size if "-g" in scheme else 1)
    assert shape.dtype == torch.int64 and shape.tolist() == [128, 256]

    ids = prompt_ids(llama128)
    theirs = load_with_transformers(out)
    with torch.no_grad():
        their_logits = theirs(ids).logits  # compressed-tensors decompresses the weights on this first forward
    src = source_weights(llama128)
    compared = 0
    for name, w in src.items():
        if name.endswith("proj.weight"):
            expected = quantize_tensor(w, s, name=name).dequantize(torch.float32)
            got = theirs.get_submodule(name.removesuffix(".weight")).weight
            assert torch.equal(got, expected), name  # bit-identical in fp32 (documented)
            compared += 1
    assert compared == 14
    # Logits against qkit's own checkpoint of the same scheme, loaded by qkit (the eval path).
    ours = load(quantize_model(llama128, output=tmp_path / "qkit", scheme=scheme, options=QuantizeOptions(device="cpu")).output, device="cpu").model
    with torch.no_grad():
        our_logits = ours(ids).logits
    tol = LOGITS_RTOL * max(1.0, float(our_logits.abs().max()))
    assert float((their_logits - our_logits).abs().max()) <= tol


def test_mixed_schemes_and_kept_layers(llama128, tmp_path):
    out = tmp_path / "mixed"
    quantize_model(llama128, output=out, scheme="int4-g64", format="compressed-tensors",
                   options=QuantizeOptions(keep=["int8-row:*.down_proj.weight", "none:*.o_proj.weight"], device="cpu"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    groups = {g["weights"]["num_bits"]: g for g in qc["config_groups"].values()}
    assert sorted(groups[8]["targets"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert len(groups[4]["targets"]) == 10
    assert qc["ignore"] == ["lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    theirs = load_with_transformers(out)
    with torch.no_grad():
        theirs(prompt_ids(llama128))
    src = source_weights(llama128)
    for name, w in src.items():
        if not name.endswith("proj.weight"):
            continue
        got = theirs.get_submodule(name.removesuffix(".weight")).weight
        if "o_proj" in name:
            assert torch.equal(got, w)
        else:
            s = get_scheme("int8-row" if "down_proj" in name else "int4-g64")
            assert torch.equal(got, quantize_tensor(w, s).dequantize(torch.float32)), name


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_half_precision_model_bit_identical(tmp_path, dtype, scale):
    src_dir = make_llama(tmp_path / "half", dtype=dtype)
    out = tmp_path / "ct"
    quantize_model(src_dir, output=out, scheme="int4-g64", format="compressed-tensors",
                   options=QuantizeOptions(scale_dtype=scale, device="cpu"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype == dtype
    theirs = load_with_transformers(out)
    with torch.no_grad():
        theirs(prompt_ids(src_dir))
    s = get_scheme("int4-g64", scale)
    for name, w in source_weights(src_dir).items():
        if name.endswith("proj.weight"):
            got = theirs.get_submodule(name.removesuffix(".weight")).weight
            assert got.dtype == dtype
            # q * scale is exact in fp32 and rounded once either way: bit-identical in 16-bit dtypes too.
            assert torch.equal(got, quantize_tensor(w, s).dequantize(dtype)), name


# --------------------------------------------------------------------------- refusals: one line naming what works


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(scheme="nf4"), "--format bitsandbytes"),
        (dict(scheme="int4-tensor"), "use int4-row or int4-g64"),
        (dict(scheme="int8-tensor"), "use int8-row"),
        (dict(scheme="int4-g48"), "is 256 wide (256 = 5.33333 x 48), so int4-g48 cannot be exported; int4-g32 can"),
        (dict(scheme="int4-g64", include=["model.embed_tokens.weight"]), "model.embed_tokens.weight is not the weight of one"),
        (dict(scheme="q8_0"), "cannot store q8_0"),  # a llama.cpp block type: was an AttributeError
        (dict(scheme="q4_k_m"), "write llama.cpp's types with --format gguf"),
        (dict(scheme="int8-row", keep=["q4_k:*.down_proj.weight"]), "cannot store q4_k (model.layers.0.mlp.down_proj.weight)"),
    ],
)
def test_refused_before_any_work(llama128, tmp_path, kwargs, needle):
    out = tmp_path / "refused"
    with pytest.raises(ExportError) as err:
        quantize_model(llama128, output=out, format="compressed-tensors",
                       options=QuantizeOptions(device="cpu", **kwargs))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_fp16_scales_on_bf16_model_refused(tmp_path):
    src_dir = make_llama(tmp_path / "bf16", dtype=torch.bfloat16, layers=1)
    with pytest.raises(ExportError, match=r"weights' dtype \(bfloat16\).*--scale-dtype bf16"):
        quantize_model(src_dir, output=tmp_path / "o", scheme="int4-g64", format="compressed-tensors",
                       options=QuantizeOptions(device="cpu"))


@pytest.mark.slow
def test_default_model_g128_refused_g64_verified(default_model_dir, tmp_path):
    with pytest.raises(ExportError) as err:
        quantize_model(None, output=tmp_path / "g128", scheme="int4-g128", format="compressed-tensors",
                       options=QuantizeOptions(device="cpu"))
    msg = str(err.value)
    assert "is 576 wide (576 = 4.5 x 128), so int4-g128 cannot be exported; int4-g64 can (it divides every width: 576, 1536)" in msg

    from qkit.verify import verify_checkpoint

    out = tmp_path / "g64"
    r = quantize_model(None, output=out, scheme="int4-g64", format="compressed-tensors",
                       options=QuantizeOptions(device="cpu"))
    assert r.matrices == 210
    v = verify_checkpoint(out, device="cpu")
    assert v.passed and len(v.tensors) == 210
    assert all(t.identical and t.matches_export for t in v.tensors)
    assert v.logits_max_abs_diff <= v.logits_tolerance
