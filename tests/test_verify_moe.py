"""``qkit verify`` on mixture-of-experts exports (docs/moe.md "verify").

A compressed-tensors MoE export stores one matrix per expert; transformers fuses a layer's experts into
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``. verify stacks qkit's experts into
those parameters (``qkit.verify.experts.fuse``) and reads each expert back out of the library's
(``library_expert``). Tiny seeded qwen3_moe and mixtral models with a 512-piece vocabulary (helpers_archs).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers_archs import EXPERTS, HIDDEN, INTER, LAYERS, make_arch_model, spm_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qkit.api import QuantizeOptions, quantize_model
from qkit.cli import app
from qkit.errors import InputError, ModelLoadError
from qkit.export import compressed_tensors as ct_format
from qkit.methods.experts import LAYOUTS
from qkit.schemes import dequantize, get_scheme
from qkit.verify import verify_checkpoint
from qkit.verify.experts import fuse

pytest.importorskip("compressed_tensors")

runner = CliRunner()
EXPERT_MATRICES = LAYERS * EXPERTS * 3  # 24: every expert's gate, up and down of both layers


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """``{arch: its int4-g128 compressed-tensors export}`` for qwen3_moe and mixtral."""
    root = tmp_path_factory.mktemp("verify-moe")
    spm = spm_tokenizer(root / "spm")
    out = {}
    for arch in ("qwen3_moe", "mixtral"):
        model = make_arch_model(root / arch, arch, spm)
        (model / "tokenizer.model").unlink()  # transformers reads it only with tiktoken: verify's fixed ids instead
        out[arch] = root / f"{arch}-ct"
        quantize_model(model, output=out[arch],
                       options=QuantizeOptions(scheme="int4-g128", format="compressed-tensors", device="cpu"))
    return out


def _parts(stored: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(module + "."): v for k, v in stored.items() if k.rpartition(".")[0] == module}


def test_fuse_stacks_each_layer_as_transformers_does():
    """Hand-made mixtral state: expert e's w1 / w3 / w2 filled with 10e+1 / 10e+3 / 10e+2."""
    lay = LAYOUTS["mixtral"]
    head = "model.layers.0.block_sparse_moe"
    state = {f"{head}.experts.{e}.{w}.weight": torch.full((2 if w != "w2" else 3, 3 if w != "w2" else 2),
                                                          10.0 * e + int(w[1])) for e in range(3) for w in ("w1", "w2", "w3")}
    state[f"{head}.gate.weight"] = torch.arange(9.0).reshape(3, 3)
    fused = fuse(state, {"model_type": "mixtral", "num_local_experts": 3}, lay)
    assert sorted(fused) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                             "model.layers.0.mlp.gate.weight"]  # block_sparse_moe renamed mlp, as transformers does
    gate_up, down = fused["model.layers.0.mlp.experts.gate_up_proj"], fused["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (3, 4, 3) and down.shape == (3, 3, 2)
    assert gate_up[:, :2, 0].tolist() == [[1, 1], [11, 11], [21, 21]]  # w1 (gate) rows first
    assert gate_up[:, 2:, 0].tolist() == [[3, 3], [13, 13], [23, 23]]  # then w3 (up)
    assert down[:, 0, 0].tolist() == [2, 12, 22]
    del state[f"{head}.experts.1.w3.weight"]
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.0\.block_sparse_moe\.experts\.1\.w3\.weight \(1 of"):
        fuse(state, {"model_type": "mixtral", "num_local_experts": 3}, lay)


def _stored_experts(export: Path) -> list[str]:
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return sorted(n.removesuffix(".weight_packed") + ".weight" for n in f.keys()
                      if ".experts." in n and n.endswith("weight_packed"))


def test_verify_checks_every_expert(exports):
    r = verify_checkpoint(exports["qwen3_moe"], device="cpu")
    stored = _stored_experts(exports["qwen3_moe"])
    assert [t.name for t in r.tensors if ".experts." in t.name] == stored and len(stored) == EXPERT_MATRICES
    assert r.experts == EXPERT_MATRICES and len(r.tensors) == EXPERT_MATRICES + LAYERS * 4  # and the attention
    assert all(t.identical and t.matches_export and t.mismatched == 0 for t in r.tensors)
    assert r.passed and r.logits_max_abs_diff == 0.0  # the same fp32 weights in the same graph
    assert r.to_dict()["experts"] == EXPERT_MATRICES


def test_verify_reports_one_experts_error(exports, monkeypatch):
    """The library's layer-1 expert 2 up rows shifted at one weight: verify names that matrix alone, with the
    difference computed here from qkit's decode of its stored parts."""
    out = exports["qwen3_moe"]
    inter = INTER // 2  # qwen3_moe's moe_intermediate_size in helpers_archs
    row, col, delta = 5, 7, 0.25

    def shifted(self, model, fast_cpu_kernel):
        model.model.layers[1].mlp.experts.gate_up_proj.data[2, inter + row, col] += delta  # up_proj's rows
        return None

    monkeypatch.setattr(ct_format.CompressedTensorsFormat, "library_setup", shifted)
    r = verify_checkpoint(out, device="cpu")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert r.failed() == [name] and not r.passed
    t = next(t for t in r.tensors if t.name == name)
    w = dequantize(ct_format.FORMAT.decode(_parts(load_file(str(out / "model.safetensors")), name.removesuffix(".weight")),
                                           get_scheme("int4-g128"), torch.float32))[row, col]
    assert t.mismatched == 1 and not t.identical and t.max_abs_diff == float(((w + delta) - w).abs())
    assert t.shape == (inter, HIDDEN)


def test_corrupted_expert_is_named(exports, tmp_path):
    """One packed word of mixtral's layer-0 expert 3 w2 flipped: the file no longer holds what qkit quantized."""
    src = exports["mixtral"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    stored = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed"
    stored[key] = stored[key].clone()
    stored[key][0, 0] ^= 0x0F0F
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        save_file(stored, str(bad / "model.safetensors"), metadata=f.metadata())
    res = runner.invoke(app, ["verify", str(bad), "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    assert "failed: model.layers.0.block_sparse_moe.experts.3.w2.weight\n" in res.output and "NOT verified" in res.output
    assert "24 of the 32 tensors are expert matrices" in res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["experts"] == EXPERT_MATRICES and r["logits_ok"]  # read alike by both sides: same logits
    assert [t["name"] for t in r["tensors"] if ".experts." in t["name"]] == _stored_experts(src)
    bad_ones = [t for t in r["tensors"] if t["matches_export"] is not True]
    # both readers decode the flipped bytes alike; the sha256 recorded at export tells them from qkit's codes
    assert [(t["name"], t["identical"]) for t in bad_ones] == [("model.layers.0.block_sparse_moe.experts.3.w2.weight", True)]
    assert all(t["identical"] for t in r["tensors"])  # every other matrix as well, mixtral's w1/w3/w2 mapped right


def test_w8a8_moe_is_refused_in_one_line(exports, tmp_path):
    """transformers 5.25 + compressed-tensors 0.20.1 cannot load int-quantized experts: refused, not passed."""
    out = tmp_path / "w8a8"
    src = exports["qwen3_moe"].parent / "qwen3_moe"
    quantize_model(src, output=out, options=QuantizeOptions(scheme="int8-row", format="compressed-tensors",
                                                            activations="int8-token", device="cpu"))
    with pytest.raises(ModelLoadError, match="could not load .*a mixture-of-experts compressed-tensors checkpoint .*"
                                             "so this one is not verified"):
        verify_checkpoint(out, device="cpu")


def _gguf(path: Path, arch: str, experts: int) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((experts, 32, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, needle", [
    ("llama", "is a llama GGUF with 4 experts per layer .* builds a dense llama from it, so qkit verify cannot compare it"),
    ("qwen3moe", "architecture 'qwen3moe'; qkit verify reads the llama and qwen2 files qkit's own GGUF writer writes"),
])
def test_moe_gguf_is_refused_in_one_line(tmp_path, arch, needle):
    """llama.cpp's converter's MoE files (mixtral as a llama with experts, qwen3moe): refused before any load."""
    path = _gguf(tmp_path / "model.gguf", arch, EXPERTS)
    with pytest.raises(InputError, match=needle):
        verify_checkpoint(path, device="cpu")
    res = runner.invoke(app, ["verify", str(path)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
