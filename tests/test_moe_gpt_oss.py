"""gpt_oss's experts through the calibrated methods (``qkit.methods.experts``: ``GPT_OSS``, ``virtual_experts``).

transformers' ``GptOssExperts`` holds a layer's experts as ``gate_up_proj`` ``[E, H, 2I]`` (gate and up
interleaved by alternate columns) and ``down_proj`` ``[E, I, H]``, with biases, a router with a bias and a
softmax over its top-k, and a clamped SwiGLU. The oracles here are independent of qkit's expert views: the
router's top-k computed by hand from its weight and bias, the fused tensors sliced by hand, and transformers'
own ``GptOssExperts._apply_gate`` for the down projection's input. The unfused forward against the fused one
is in ``tests/test_moe_calibration.py`` (``gpt_oss`` among its architectures); the GGUF file's rows against
GPTQ's codes in ``tests/test_gguf_converted.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer
from helpers_moe import cal, moe_model  # noqa: F401 (cal: a fixture)

from qkit.errors import InputError
from qkit.methods.expert_storage import virtual_experts
from qkit.methods.experts import check_method, expert_slices, layout_for, unfused_experts
from qkit.checkpoint import tensor_shapes
from qkit.methods import get_method, make_options
from qkit.methods.gptq.method import FEW_TOKENS, GPTQOptions, HessianInputs
from qkit.methods.imatrix import ImatrixOptions, collect
from qkit.methods.sequential import BlockInputs, walk_blocks
from qkit.models import read_config, resolve
from qkit.schemes import get_scheme, quantize_tensor

EXPERTS, TOP_K, HIDDEN = 4, 2, 64
SAMPLES, SEQLEN = 4, 64


@pytest.fixture(scope="module")
def oss():
    """A tiny gpt_oss (hidden 64, 4 experts of width 64, top-2, routers and biases drawn, the clamp reached) and
    its calibration ids."""
    model = moe_model("gpt_oss", experts=EXPERTS, top_k=TOP_K)
    ids = torch.randint(3, 300, (SAMPLES, SEQLEN), generator=torch.Generator().manual_seed(0))
    return model, ids


def by_hand(params: dict[str, torch.Tensor], experts: torch.nn.Module, h: torch.Tensor, every: bool):
    """Per expert ``(rows, X, A)``: the tokens of ``h`` ``[T, H]`` (float64) the router sends it (top-k of
    ``h Wrᵀ + br``; all with ``every``), their rows, and the down projection's input on them, from the layer's
    fused tensors as loaded (``params``, by name under ``mlp``) and transformers' ``experts._apply_gate``."""
    p = {k: v.double() for k, v in params.items()}
    chosen = (h @ p["router.weight"].T + p["router.bias"]).topk(TOP_K, dim=-1).indices
    out = []
    for e in range(EXPERTS):
        rows = torch.ones(h.shape[0], dtype=torch.bool) if every else (chosen == e).any(-1)
        x = h[rows]
        out.append((rows, x, experts._apply_gate(x @ p["experts.gate_up_proj"][e] + p["experts.gate_up_proj_bias"][e])))
    return out


def test_each_gpt_oss_experts_hessian_is_the_gram_of_the_tokens_routed_to_it(oss):
    """GPTQ's accumulator over the unfused experts against the naive reference: gate and up share one Gram, the
    Gram of the rows the router chose; the down projection's, of the clamped SwiGLU on them. With every token
    sent to every expert, every row. Then each expert matrix's importance entry (``qkit imatrix``'s sums of
    squares and token counts, llama-imatrix's ``ffn_*_exps`` rows) from the same reference."""
    model, ids = oss
    config = model.config.to_dict()
    fused = {i: {k: v.detach().clone() for k, v in b.mlp.named_parameters()} for i, b in enumerate(model.model.layers)}
    modules = [b.mlp.experts for b in model.model.layers]  # GptOssExperts (emptied while the linears hold the weights)
    reference: dict[tuple[bool, int], list] = {}
    for every in (False, True):
        def process(i: int, block: torch.nn.Module, inputs: BlockInputs, every=every) -> None:
            seen: list[torch.Tensor] = []
            hook = block.mlp.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().reshape(-1, HIDDEN)))
            acc = HessianInputs(inputs.prefix)
            inputs.forward(on_input=acc.add, modules=inputs.linears())
            hook.remove()
            h = torch.cat(seen).double()
            reference[every, i] = by_hand(fused[i], modules[i], h, every)
            for e, (rows, x, a) in enumerate(reference[every, i]):
                for m, want in (("gate_proj", x.T @ x), ("up_proj", x.T @ x), ("down_proj", a.T @ a)):
                    owner = acc.owner[f"mlp.experts.{e}.{m}"]
                    assert acc.tokens[owner] == int(rows.sum())
                    torch.testing.assert_close(acc.gram(owner).double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
                assert acc.owner[f"mlp.experts.{e}.up_proj"] == f"mlp.experts.{e}.gate_proj"

        with unfused_experts(model, config, every):
            walk_blocks(model, ids, process)
    routed = [int(rows.sum()) for (every, _), r in reference.items() if not every for rows, _, _ in r]
    assert sum(routed) == 2 * TOP_K * ids.numel() and min(routed) > 0  # every expert reached in both layers
    assert all(torch.equal(p.data, fused[i][n]) for i, b in enumerate(model.model.layers)
               for n, p in b.mlp.named_parameters())  # restored, interleaved and transposed back

    matrix = collect(model, config, ids, ImatrixOptions(chunks=SAMPLES, chunk_size=SEQLEN, batch=SAMPLES))
    for i in range(2):
        for g, which in (("gate", 1), ("up", 1), ("down", 2)):
            entry = matrix.entries[f"blk.{i}.ffn_{g}_exps.weight"]
            assert entry.sums.shape == (EXPERTS, HIDDEN)
            for e, ref in enumerate(reference[False, i]):
                assert entry.counts[e] == int(ref[0].sum())
                want = (ref[which] ** 2).sum(0)
                torch.testing.assert_close(torch.from_numpy(entry.sums[e]).double(), want, rtol=1e-5, atol=1e-5 * float(want.max()))
        assert matrix.entries[f"blk.{i}.ffn_gate_inp.weight"].counts.tolist() == [ids.numel()]


def test_each_virtual_expert_is_its_slice_of_the_fused_tensor(oss):
    """``virtual_experts`` names each expert matrix as llama.cpp's converter splits it and takes it out of the
    stored ``[E, in, out]`` tensor: gate the even columns, up the odd, transposed to ``[out, in]``."""
    model, _ = oss
    state = model.state_dict()
    virtual = virtual_experts({k: tuple(v.shape) for k, v in state.items()}, model.config.to_dict())
    assert len(virtual) == 2 * EXPERTS * 3
    gu = state["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(EXPERTS):
        for m, want in (("gate_proj", gu[e][:, 0::2].T), ("up_proj", gu[e][:, 1::2].T),
                        ("down_proj", state["model.layers.1.mlp.experts.down_proj"][e].T)):
            v = virtual[f"model.layers.1.mlp.experts.{e}.{m}.weight"]
            assert torch.equal(v.take(state[v.fused]), want) and v.shape == tuple(want.shape)
    assert virtual_experts({k: tuple(v.shape) for k, v in moe_model("qwen3_moe").state_dict().items()},
                           moe_model("qwen3_moe").config.to_dict()) == {}


@pytest.fixture(scope="module")
def saved(oss, tmp_path_factory):
    """The tiny gpt_oss saved, with the tiny tokenizer."""
    d = tmp_path_factory.mktemp("oss") / "m"
    oss[0].save_pretrained(str(d))
    make_tokenizer(d)
    return d


def test_qkit_format_keeps_the_fused_experts_and_says_so(saved, tmp_path):
    """``--format qkit`` has no stored name per expert matrix: the fused experts are written as they were
    stored, bit for bit, and the summary says so; the attention is quantized."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from qkit.checkpoint import read_manifest
    from qkit.cli import app

    r = CliRunner().invoke(app, ["quantize", str(saved), "-s", "int4-g32", "-o", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    assert "gpt_oss stores its experts fused" in r.output and "--format gguf quantizes them" in r.output
    source = load_file(str(saved / "model.safetensors"))
    written = {k: v for f in sorted((tmp_path / "q").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    fused = [k for k in source if ".experts." in k]
    assert len(fused) == 2 * 4 and all(torch.equal(written[k], source[k]) for k in fused)
    assert sorted(read_manifest(tmp_path / "q")["tensors"]) == sorted(
        k for k in source if k.endswith("_proj.weight") and "self_attn" in k)


def test_gptq_beats_rtn_on_every_gpt_oss_expert_with_enough_tokens_and_the_others_fall_back(saved, cal):
    """GPTQ on each expert matrix, named as llama.cpp splits it (``virtual_experts``): with at least
    ``--min-expert-tokens`` routed tokens its output error is below rtn's; with fewer it is written by rtn, with
    exactly the bytes rtn gives its slice of the stored fused tensor. The model runs in bf16, so each source
    matrix is read from the file (``VirtualExpert.take`` of the fused fp32 tensor), not from the model."""
    from safetensors.torch import load_file

    method = get_method("gptq")
    options = make_options(method, {"calibration": str(cal), "calibration_samples": SAMPLES, "calibration_seqlen": SEQLEN,
                                    "dtype": "bf16"})  # the source weights read from the file: VirtualExpert.take
    virtual = virtual_experts(dict(tensor_shapes(saved)), read_config(saved))
    scheme = get_scheme("int4-g32")
    result = method.run(resolve(str(saved)), dict.fromkeys(virtual, scheme), options, device=torch.device("cpu"))
    source = load_file(str(saved / "model.safetensors"))
    layers, fell = result.record["layers"], []
    for name, v in virtual.items():
        r = layers[name]
        assert r["tokens"] == result.record["experts"]["tokens"][name.rsplit(".", 2)[0]]["routed"]
        if r["tokens"] >= options.min_expert_tokens:
            assert r["gptq_error"] < r["rtn_error"], name
        else:
            assert r["fallback"] == FEW_TOKENS
            rtn = quantize_tensor(v.take(source[v.fused]).contiguous(), scheme)
            assert all(torch.equal(result.quantized[name].parts[k], p) for k, p in rtn.parts.items()), name
            fell.append(name)
    assert 0 < len(fell) < len(virtual), fell  # the seed routes some experts below the threshold, not all
    assert sorted(result.quantized) == sorted(virtual)


def test_what_gpt_oss_still_refuses(oss):
    """gptq and imatrix route through its experts; awq and a plan (whose slices must be plain views) still refuse."""
    config = oss[0].config.to_dict()
    check_method(config, "gptq", GPTQOptions())
    assert layout_for(config).transposed
    with pytest.raises(InputError, match="awq folds scales into the experts of mixtral, qwen2_moe, qwen3_moe models only; "
                                         "gpt_oss stores each layer's experts as 3-D tensors"):
        check_method(config, "awq", None)
    with pytest.raises(InputError, match="gpt_oss stores each layer's experts as 3-D tensors"):
        expert_slices(oss[0], config)
