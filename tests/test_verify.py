"""``qkit verify`` and the CLI side of the export formats: verdicts, detection of a wrong encoding, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkit.api import QuantizeOptions, quantize_model
from qkit.cli import app
from qkit.export import compressed_tensors as ct_format
from qkit.verify import iter_decoded, verify_checkpoint
from qkit.schemes import QuantizedTensor, get_scheme, quantize_tensor

pytest.importorskip("compressed_tensors")
pytest.importorskip("bitsandbytes")

runner = CliRunner()


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "int4-g64"), ("compressed-tensors", "int8-row"), ("bitsandbytes", "nf4")])
def test_verify_passes_and_decode_reproduces_quantization(llama128, tmp_path, fmt, scheme):
    out = tmp_path / "export"
    quantize_model(llama128, output=out, scheme=scheme, format=fmt, options=QuantizeOptions(device="cpu"))
    from safetensors.torch import load_file

    src = load_file(str(llama128 / "model.safetensors"))
    decoded = {n: v for n, v, _ in iter_decoded(out) if isinstance(v, QuantizedTensor)}
    assert len(decoded) == 14
    for name, qt in decoded.items():  # qkit's reading of the export gives back the very codes and scales
        expected = quantize_tensor(src[name], get_scheme(scheme))
        assert torch.equal(qt.qweight, expected.qweight) and torch.equal(qt.scales, expected.scales), name
        assert qt.shape == expected.shape and qt.scheme == expected.scheme
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.format == fmt and r.dtype == "float32"
    assert len(r.tensors) == 14 and all(t.identical and t.matches_export for t in r.tensors)
    assert r.logits_max_abs_diff <= r.logits_tolerance == pytest.approx(1e-4 * max(1.0, r.logits_scale))
    assert r.to_dict()["by_scheme"] == {scheme: {"tensors": 14, "identical": 14, "within_tolerance": 14,
                                                 "max_abs_diff": 0.0, "match_export": 14}}


def test_verify_catches_a_wrong_encoding(llama128, tmp_path, monkeypatch):
    """An encoder with the wrong nibble order writes a file both readers agree on, but not what qkit quantized."""
    # Writing qkit's own byte order (first column in the high nibble) instead of swapping the nibbles.
    monkeypatch.setattr(ct_format, "_swap_nibbles", lambda b: b)
    out = tmp_path / "bad"
    quantize_model(llama128, output=out, scheme="int4-g64", format="compressed-tensors",
                   options=QuantizeOptions(device="cpu"))
    monkeypatch.undo()
    r = verify_checkpoint(out, device="cpu")
    assert not r.passed and not r.weights_ok
    assert all(t.matches_export is False for t in r.tensors)
    res = runner.invoke(app, ["verify", str(out), "--device", "cpu"])
    assert res.exit_code == 1 and "NOT verified" in res.output


def test_verify_without_sidecar_reads_config(llama128, tmp_path):
    """A compressed-tensors checkpoint qkit did not write (no qkit-export.json): schemes come from the config."""
    out = tmp_path / "export"
    quantize_model(llama128, output=out, scheme="int4-g32", format="compressed-tensors",
                   options=QuantizeOptions(device="cpu"))
    (out / "qkit-export.json").unlink()
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and all(t.matches_export is None for t in r.tensors)
    assert {t.scheme for t in r.tensors} == {"int4-g32"}


def test_cli_quantize_format_and_verify(llama128, tmp_path):
    out = tmp_path / "ct"
    res = runner.invoke(app, ["quantize", str(llama128), "-s", "int4-g64", "--format", "compressed-tensors",
                              "--max-shard-size", "100kB", "-o", str(out), "--device", "cpu", "--json", str(tmp_path / "q.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "q.json").read_text())["format"] == "compressed-tensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size took effect
    res = runner.invoke(app, ["verify", str(out), "--device", "cpu", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert data["passed"] and data["by_scheme"]["int4-g64"]["identical"] == 14


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-s", "int4-g48", "--format", "compressed-tensors"], "cannot be exported; int4-g32 can"),
        (["-s", "nf4", "--format", "compressed-tensors"], "--format bitsandbytes"),
        (["-s", "int4-g64", "--format", "bitsandbytes"], "writes nf4 only"),
        (["-s", "nf4", "--format", "onnx"], "unknown format 'onnx'; use one of: qkit, compressed-tensors, bitsandbytes, gguf"),
        (["-s", "nf4", "--format", "gguf"], "nf4 is not one of them; use q8_0, q4_0"),
        (["-s", "nf4", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
    ],
)
def test_cli_refusals_are_one_line(llama128, tmp_path, args, needle):
    out = tmp_path / "o"
    res = runner.invoke(app, ["quantize", str(llama128), *args, "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith("error: ")
    assert not out.exists()


def test_verify_refuses_non_exports(llama128, tmp_path):
    res = runner.invoke(app, ["verify", str(llama128)])
    assert res.exit_code == 2 and "is not a compressed-tensors pack-quantized or bitsandbytes nf4 checkpoint" in res.output
    res = runner.invoke(app, ["verify", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such checkpoint directory" in res.output


# --------------------------------------------------------------------------- devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_requested_without_cuda_is_one_line(llama128, tmp_path):
    out = tmp_path / "ct"
    quantize_model(llama128, output=out, scheme="int4-g64", format="compressed-tensors",
                   options=QuantizeOptions(device="cpu"))
    res = runner.invoke(app, ["verify", str(out), "--device", "cuda"])
    assert res.exit_code == 2 and "CUDA is not available here; use --device cpu" in res.output


def test_device_map_auto_matches_plain_load(llama128, tmp_path):
    """``load(device_map="auto")`` (accelerate's dispatch; all on the CPU here) gives the same logits."""
    from qkit.models import load

    q = quantize_model(llama128, output=tmp_path / "q", scheme="int8-row", options=QuantizeOptions(device="cpu")).output
    ids = torch.arange(1, 20).unsqueeze(0)
    for src in (llama128, q):
        plain, spread = load(src, device="cpu").model, load(src, device_map="auto").model
        with torch.no_grad():
            assert torch.equal(plain(ids).logits, spread(ids.to(spread.device)).logits.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "int4-g64"), ("bitsandbytes", "nf4"), ("qkit", "nf4")])
def test_cuda_export_is_byte_identical_to_cpu(llama128, tmp_path, fmt, scheme):
    from safetensors.torch import load_file

    cpu = quantize_model(llama128, output=tmp_path / "cpu", scheme=scheme, format=fmt,
                         options=QuantizeOptions(device="cpu")).output
    gpu = quantize_model(llama128, output=tmp_path / "gpu", scheme=scheme, format=fmt,
                         options=QuantizeOptions(device="cuda")).output
    a, b = load_file(str(cpu / "model.safetensors")), load_file(str(gpu / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "int4-g64"), ("bitsandbytes", "nf4")])
def test_cuda_verify(llama128, tmp_path, fmt, scheme):
    out = quantize_model(llama128, output=tmp_path / "x", scheme=scheme, format=fmt,
                         options=QuantizeOptions(device="cuda")).output
    r = verify_checkpoint(out, device="cuda")
    assert r.passed and r.device.startswith("cuda") and all(t.identical for t in r.tensors)


@pytest.mark.cuda
def test_cuda_device_map_auto_places_on_gpu(llama128):
    from qkit.models import load

    spread = load(llama128, device_map="auto").model
    assert next(spread.parameters()).device.type == "cuda"
    plain = load(llama128, device="cpu").model
    ids = torch.arange(1, 20).unsqueeze(0)
    with torch.no_grad():
        a, b = plain(ids).logits, spread(ids.cuda()).logits.cpu()
    assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(a.abs().max()))
