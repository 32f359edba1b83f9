"""nvfp4's fused layers share one global scale, as vLLM serves them and llm-compressor writes them.

vLLM loads q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (each MoE expert's gate/up into
one ``w13``) with ONE ``weight_global_scale``: the W4A16/W4A4 linear schemes take the shards' largest, the
NVFP4 MoE methods the gate's (``w1``), warning at most. llm-compressor's ``update_fused_layer_weight_global_scales``
gives the shards the least of their global scales, ``448 * 6 / max(amax)``; qkit's ``Choice.tensor_amax`` does the same,
for the written file and the eval's rows alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkit.api import QuantizeOptions, quantize_model
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.fp4 import nvfp4_global_scale
from qkit.transform import fused_groups

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402

NVFP4 = get_scheme("nvfp4")


def groups_of(names: list[str]) -> dict[str, list[str]]:
    """The fused groups by hand: a layer's q/k/v, its gate/up."""
    out: dict[str, list[str]] = {}
    for n in names:
        layer, _, last = n.removesuffix(".weight").rpartition(".")
        key = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}.get(last)
        if key:
            out.setdefault(f"{layer.rpartition('.')[0]}.{key}", []).append(n)
    return out


@pytest.fixture(scope="module")
def export(tiny_model_dir, tmp_path_factory) -> tuple[Path, object]:
    d = tmp_path_factory.mktemp("nvfp4-fused") / "ct"
    r = quantize_model(tiny_model_dir, output=d, scheme="nvfp4", format="compressed-tensors",
                       options=QuantizeOptions(device="cpu"), collect=True)
    return d, r


def test_fused_shards_share_llm_compressors_global_scale(export, tiny_model_dir):
    d, _ = export
    stored = load_file(str(d / "model.safetensors"))
    source = {k: v for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items() if k.endswith("proj.weight")}
    groups = groups_of(sorted(source))
    assert len(groups) == 4 and sorted(map(len, groups.values())) == [2, 2, 3, 3]
    for members in groups.values():
        amax = max(float(source[n].abs().max()) for n in members)
        # llm-compressor: each shard's generate_gparam, ``FP8_MAX * FP4_MAX / amax`` (a Python number over a
        # tensor: torch's fl(fl(1 / amax) * 2688)), then their min
        own = [(448.0 * 6.0) / source[n].abs().amax().float() for n in members]
        want = torch.min(torch.stack(own)).reshape(1)
        assert torch.equal(want, nvfp4_global_scale(torch.tensor(amax))), members
        for n in members:
            gs = stored[n.removesuffix(".weight") + ".weight_global_scale"]
            assert torch.equal(gs, want), n
            assert abs(float(gs) - 2688.0 / amax) <= 1e-6 * float(gs)
    for n in (k for k in source if k.endswith(("o_proj.weight", "down_proj.weight"))):  # alone: their own
        gs = stored[n.removesuffix(".weight") + ".weight_global_scale"]
        assert torch.equal(gs, nvfp4_global_scale(source[n].abs().amax())), n


def test_librarys_decompressor_reads_qkits_shared_scale_bit_for_bit(export, tiny_model_dir):
    d, result = export
    stored = load_file(str(d / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["NVFP4A16"])
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    source = {k: v for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items() if k.endswith("proj.weight")}
    amax = {n: max(source[m].abs().max() for m in g) for g in groups_of(sorted(source)).values() for n in g}
    for key, w in source.items():
        module = key.removesuffix(".weight")
        state = {k.removeprefix(module + "."): v for k, v in stored.items() if k.startswith(module + ".")}
        dense = compressor.decompress(state, scheme)["weight"]
        ours = quantize_tensor(w, NVFP4, name=key, tensor_amax=amax.get(key)).dequantize(torch.float32)
        assert torch.equal(dense, ours.to(torch.bfloat16)), key
        assert torch.equal(result.quantized[key].dequantize(torch.float32), ours), key  # what was collected


def test_eval_rows_weights_are_the_files(export, tiny_model_dir, tmp_path):
    """The eval writes a torch row through ``quantize_model`` in its engine's format (``quantize_row``) and swaps
    that file into the reference (``Swapper``): the model's weights then equal the compressed-tensors file's
    decode, shared global scales included."""
    from qkit.checkpoint import iter_quantized
    from qkit.evaluation.engines.torch_engine import ENGINE
    from qkit.evaluation.swap import Swapper
    from qkit.models import load

    d, result = export
    row = tmp_path / "row"
    quantize_model(tiny_model_dir, output=row, scheme="nvfp4", options=QuantizeOptions(device="cpu", **ENGINE.export_options(())))
    model = load(tiny_model_dir).model
    Swapper(model, tiny_model_dir).apply(iter_quantized(row))
    params = dict(model.named_parameters())
    for name, qt in result.quantized.items():
        assert torch.equal(params[name].data, qt.dequantize(params[name].dtype)), name


@pytest.mark.parametrize("seed", range(6))
def test_shared_scale_error_is_finite_and_bounded(seed):
    """Property: a shard far smaller than its group's largest (k at 1e-3 of q) still round-trips: no NaN, and
    each shard's relative error below nvfp4's bound for its own scale (E2M1's half step, 1/4 relative per
    block with an E4M3 block scale: under 0.2 measured here; 0.25 allowed) until the block scales underflow E4M3."""
    g = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.empty(3).uniform_(-3, 0, generator=g)
    shards = [torch.randn(32, 64, generator=g) * float(s) for s in spread]
    amax = torch.stack([w.abs().amax() for w in shards]).max()
    for w in shards:
        qt = quantize_tensor(w, NVFP4, tensor_amax=amax)
        err = qt.dequantize(torch.float32) - w
        assert bool(torch.isfinite(err).all())
        assert float(err.norm() / w.norm()) < 0.25
        assert torch.equal(qt.extra["global_scale"], nvfp4_global_scale(amax))


def test_groups_come_from_the_layout():
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")]
    names += ["model.layers.1.self_attn.qkv_proj.weight"]  # phi3: fused already, one tensor
    got = fused_groups(names)
    assert got == {"model.layers.0.self_attn.qkv_proj": names[:3],
                   "model.layers.0.mlp.experts.0.gate_up_proj": names[4:6],
                   "model.layers.0.mlp.experts.1.gate_up_proj": names[7:9]}
    from qkit.methods.experts import fused_modules
    mixtral = [f"model.layers.0.block_sparse_moe.experts.0.{p}.weight" for p in ("w1", "w2", "w3")]
    assert fused_groups(mixtral, fused_modules({"model_type": "mixtral"})) == {
        "model.layers.0.block_sparse_moe.experts.0.w13": [mixtral[0], mixtral[2]]}
    assert fused_groups(mixtral) == {}


def test_gptq_uses_the_groups_shared_scale(tmp_path):
    """GPTQ's nvfp4 observer takes the fused group's global scale too: the written q/k/v (gate/up) scales are the
    group's ``2688 / max amax`` and GPTQ's codes still decode to the weights the model was given."""
    from conftest import TINY_TEXT, make_tiny_llama

    model = tmp_path / "tiny64"
    make_tiny_llama(model, hidden=64, intermediate=128)
    cal = tmp_path / "cal.txt"
    cal.write_text(TINY_TEXT * 30)
    result = quantize_model(model, output=tmp_path / "o", scheme="nvfp4", method="gptq", collect=True,
                            method_options={"calibration": str(cal), "calibration_samples": 2, "calibration_seqlen": 32})
    source = {k: v for k, v in load_file(str(model / "model.safetensors")).items() if k.endswith("proj.weight")}
    groups = groups_of(sorted(source))
    for members in groups.values():
        want = nvfp4_global_scale(torch.stack([source[n].abs().amax() for n in members]).max())
        for n in members:
            assert torch.equal(result.quantized[n].extra["global_scale"], want), n
    assert all(v.get("fallback") is None for v in result.method_record["layers"].values())  # solved, not rtn


@pytest.mark.parametrize("arch", ["mixtral"])  # qwen3_moe's gate_proj/up_proj: the dense names (test_groups_come_from_the_layout)
def test_each_experts_gate_and_up_share_one_scale(arch, tmp_path):
    """vLLM's NVFP4 MoE methods take each expert's ``w13_weight_global_scale[:, 0]`` (the gate's) for both halves,
    warning "w1_weight_global_scale must match w3_weight_global_scale": each expert's gate/up (mixtral's w1/w3)
    share their group's scale; down (w2) and the experts apart keep their own."""
    from helpers_archs import make_arch_model, spm_tokenizer

    model = make_arch_model(tmp_path / arch, arch, spm_tokenizer(tmp_path / "spm"))
    d = tmp_path / "ct"
    quantize_model(model, output=d, scheme="nvfp4", format="compressed-tensors", options=QuantizeOptions(device="cpu"))
    stored = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    source = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = sorted({k.rsplit(".", 2)[0] for k in source if ".experts." in k})
    assert len(experts) >= 4
    for e in experts:
        pair = [source[f"{e}.{m}.weight"] for m in (gate, up)]
        want = nvfp4_global_scale(torch.stack([w.abs().amax() for w in pair]).max())
        assert torch.equal(stored[f"{e}.{gate}.weight_global_scale"], want), e
        assert torch.equal(stored[f"{e}.{up}.weight_global_scale"], want), e
        assert torch.equal(stored[f"{e}.{down}.weight_global_scale"],
                           nvfp4_global_scale(source[f"{e}.{down}.weight"].abs().amax())), e
