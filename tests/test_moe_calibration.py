"""Mixture-of-experts through the calibrated methods (``qkit.methods.experts``): each expert one linear per
matrix, calibrated on exactly the tokens the router sends it (or every token), GPTQ's fallback to rtn for an
expert with too few tokens, the importance matrix's per-expert rows as llama-imatrix writes them, the refusals.

The oracles: the fused module's own forward (transformers'), a naive Gram of the routed tokens computed by
hand from the router's top-k, rtn's own bytes, and the gguf package's reading of the written file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers_moe import SAMPLES, SEQLEN, cal, cli, moe2, moe_model, refused  # noqa: F401 (fixtures)

from qkit.errors import InputError
from qkit.methods.experts import LAYOUTS, layout_for, linear_names, routed_tokens, unfused_experts
from qkit.methods.gptq.method import FEW_TOKENS, HessianInputs
from qkit.methods.imatrix import ImatrixOptions, collect, quant_weights_for, read, unreached_experts, write_gguf
from qkit.methods.imatrix.file import ImatrixEntry
from qkit.methods.sequential import BlockInputs, walk_blocks
from qkit.models import load, read_config
from qkit.schemes import get_scheme, quantize_tensor

MIN_TOKENS = 128  # GPTQOptions' default --min-expert-tokens


# --------------------------------------------------------------------------- the unfused module


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_the_unfused_experts_compute_what_the_fused_module_does(arch):
    """Logits with one linear per expert (routed, and every token through every expert) equal transformers'
    fused forward, and the fused weights come back unchanged."""
    model = moe_model(arch, experts=4, top_k=2)
    config = model.config.to_dict()
    ids = torch.randint(0, 304, (3, 24), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for every in (False, True):
            with unfused_experts(model, config, every) as unfused:
                assert len(unfused) == 2 and all(len(u) == 4 for u in unfused)
                got = model(input_ids=ids).logits
                counts = routed_tokens(model)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert len(counts) == 2 * 4 and sum(counts.values()) == 2 * ids.numel() * 2  # layers x tokens x top-k
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_each_expert_linear_is_named_as_the_checkpoint_stores_it(arch, tmp_path):
    model = moe_model(arch)
    model.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = {k for k in f.keys() if ".experts." in k}
    with unfused_experts(model, model.config.to_dict()):
        named = {n + ".weight" for n in linear_names(model) if ".experts." in n}
        block = {n for n in linear_names(model.model.layers[1]) if ".experts." in n}
    assert named == stored and len(stored) == 2 * 2 * 3
    parent = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert block == {f"{parent}.experts.{e}.{m}" for e in range(2) for m in layout_for(model.config.to_dict()).names}


# --------------------------------------------------------------------------- the routed Hessians, by hand


def test_each_experts_hessian_is_the_gram_of_the_tokens_routed_to_it(moe2):
    """GPTQ's accumulator (``HessianInputs`` over ``BlockInputs.forward``) against a naive reference: the MoE
    layer's input h, the router's top-1 by hand (softmax of h Wrᵀ), and per expert Xᵀ X of exactly the rows it
    chose (gate/up), and of act(h Wgᵀ) * (h Wuᵀ) on those rows (down). With every token sent to every expert,
    every row."""
    loaded = load(moe2, device="cpu")
    config = read_config(moe2)
    ids = torch.randint(3, 300, (SAMPLES, SEQLEN), generator=torch.Generator().manual_seed(0))
    checked = []

    for every in (False, True):
        def process(i: int, block: torch.nn.Module, inputs: BlockInputs, every=every) -> None:
            seen: list[torch.Tensor] = []
            hook = block.mlp.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().reshape(-1, 64)))
            acc = HessianInputs(inputs.prefix)
            linears = inputs.linears()
            inputs.forward(on_input=acc.add, modules=linears)
            hook.remove()
            h = torch.cat(seen).double()
            router = block.mlp.gate.weight.double()
            chosen = torch.softmax(h @ router.T, dim=-1).argmax(-1)  # top-1
            for e in range(2):
                rows = torch.ones_like(chosen, dtype=torch.bool) if every else chosen == e
                x = h[rows]
                gate, up, down = (linears[f"mlp.experts.{e}.{m}"].weight.double() for m in ("gate_proj", "up_proj", "down_proj"))
                a = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
                for m, want in (("gate_proj", x.T @ x), ("up_proj", x.T @ x), ("down_proj", a.T @ a)):
                    owner = acc.owner[f"mlp.experts.{e}.{m}"]
                    assert acc.tokens[owner] == int(rows.sum())
                    torch.testing.assert_close(acc.gram(owner).double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
                assert acc.owner[f"mlp.experts.{e}.up_proj"] == f"mlp.experts.{e}.gate_proj"  # one Gram for gate and up
                checked.append((every, i, e, int(rows.sum())))

        with unfused_experts(loaded.model, config, every):
            walk_blocks(loaded.model, ids, process)
    routed = [n for every, _, _, n in checked if not every]
    assert sum(routed) == 2 * ids.numel() and min(routed) > 0  # both experts reached in both layers
    assert all(n == ids.numel() for every, _, _, n in checked if every)


# --------------------------------------------------------------------------- GPTQ on the experts


@pytest.fixture(scope="module")
def gptq_runs(moe2, cal, tmp_path_factory):
    """``qkit quantize --method gptq`` routed and with --calibrate-all-experts: (record, screen) of each."""
    out = tmp_path_factory.mktemp("gptq")
    runs = {}
    for every in (False, True):
        code, text = cli("quantize", moe2, "-s", "int4-g32", "--method", "gptq", "--calibration", cal,
                         "--calibration-samples", SAMPLES, "--calibration-seqlen", SEQLEN, "-o", out / f"q{every}",
                         "--json", out / f"r{every}.json", *(["--calibrate-all-experts"] if every else []))
        assert code == 0, text
        runs[every] = json.loads((out / f"r{every}.json").read_text())["method_record"], text
    return runs


def test_gptq_beats_rtn_on_every_expert_with_enough_tokens_and_the_others_fall_back(gptq_runs):
    record, screen = gptq_runs[False]
    experts = record["experts"]
    assert experts["calibrate_all_experts"] is False and experts["min_expert_tokens"] == MIN_TOKENS
    layers = {n: r for n, r in record["layers"].items() if ".experts." in n}
    assert len(layers) == 2 * 2 * 3
    fell = []
    for name, r in layers.items():
        expert = name.rsplit(".", 2)[0]
        assert r["tokens"] == experts["tokens"][expert]["calibrated_on"] == experts["tokens"][expert]["routed"]
        if r["tokens"] >= MIN_TOKENS:
            assert r["gptq_error"] < r["rtn_error"], name
        else:
            assert r["fallback"] == FEW_TOKENS and "gptq_error" not in r
            fell.append(name)
    assert fell and len(fell) < len(layers)  # the seed routes some experts below the threshold, not all
    assert experts["rtn_fallback"] == sorted(fell) and set(fell) <= set(record["rtn_fallback"])
    assert sum(v["routed"] for v in experts["tokens"].values()) == 2 * SAMPLES * SEQLEN  # 2 layers, top-1
    assert f"{len(fell)} of 20 matrices" in screen and "--min-expert-tokens" in screen


def test_with_every_token_sent_to_every_expert_no_expert_falls_back(gptq_runs):
    record, screen = gptq_runs[True]
    experts = record["experts"]
    assert experts["calibrate_all_experts"] is True and experts["rtn_fallback"] == []
    assert all(v["calibrated_on"] == SAMPLES * SEQLEN for v in experts["tokens"].values())
    assert record["rtn_fallback"] == [] and "written by rtn instead" not in screen
    assert all(r["gptq_error"] < r["rtn_error"] for n, r in record["layers"].items() if ".experts." in n)
    assert record["options"]["calibrate_all_experts"] is True


def test_an_expert_that_falls_back_is_written_with_rtns_bytes(moe2, cal):
    """A fallen-back expert matrix of the first block (whose source weights are the file's) holds exactly what
    ``--method rtn`` writes for it."""
    from qkit.methods import get_method, make_options
    from qkit.models import resolve

    method = get_method("gptq")
    options = make_options(method, {"calibration": str(cal), "calibration_samples": SAMPLES,
                                    "calibration_seqlen": SEQLEN, "min_expert_tokens": 10**6})
    ref = resolve(str(moe2))
    scheme = get_scheme("int4-g32")
    names = [f"model.layers.0.mlp.experts.{e}.{m}.weight" for e in range(2) for m in ("gate_proj", "down_proj")]
    result = method.run(ref, dict.fromkeys(names, scheme), options, device=torch.device("cpu"))
    from safetensors.torch import load_file

    source = load_file(str(moe2 / "model.safetensors"))
    for n in names:
        assert result.record["layers"][n]["fallback"] == FEW_TOKENS
        rtn = quantize_tensor(source[n], scheme)
        assert all(torch.equal(result.quantized[n].parts[k], v) for k, v in rtn.parts.items()), n


# --------------------------------------------------------------------------- the importance matrix


@pytest.fixture(scope="module")
def matrix(moe2, cal, tmp_path_factory):
    """``qkit imatrix`` of the 2-expert model: (the file, its reading)."""
    out = tmp_path_factory.mktemp("im") / "im.gguf"
    code, text = cli("imatrix", moe2, "-o", out, "--calibration", cal, "--chunks", SAMPLES, "--chunk-size", SEQLEN)
    assert code == 0 and "2 experts (one row each, as llama-imatrix)" in text, text
    return out, read(out)


def test_the_imatrix_holds_one_row_per_expert_as_llama_imatrix_does(matrix):
    """Every ``_exps`` entry is ``in_sum2`` ggml ``[width, experts]`` and ``counts`` ``[1, experts]`` (llama-imatrix's
    ``save_imatrix``: ``ggml_new_tensor_2d(F32, nval / nmat, nmat)`` and ``(1, nmat)``); the router's input is
    collected as ``ffn_gate_inp``; per expert the tokens routed to it, the layer's tokens in all."""
    import gguf

    path, m = matrix
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for i in range(2):
        exps = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        for g in exps:
            assert [int(x) for x in tensors[g + ".in_sum2"].shape] == [64, 2]
            assert [int(x) for x in tensors[g + ".counts"].shape] == [1, 2]
            assert m.entries[g].sums.shape == (2, 64)
        counts = m.entries[exps[0]].counts
        assert all(np.array_equal(m.entries[g].counts, counts) for g in exps)
        assert counts.sum() == SAMPLES * SEQLEN and (counts > 0).all()
        assert m.entries[f"blk.{i}.ffn_gate_inp.weight"].counts.tolist() == [SAMPLES * SEQLEN]
    assert len(m.entries) == 2 * (4 + 3 + 1)  # attention, three _exps, the router's input
    assert read(path).record["calibrate_all_experts"] is False


def test_the_imatrix_reads_back_and_weights_each_expert_by_its_row(matrix, moe2, tmp_path):
    path, m = matrix
    again = tmp_path / "again.gguf"
    write_gguf(m, again)
    back = read(again)
    assert back.entries.keys() == m.entries.keys()
    assert all(np.array_equal(back.entries[k].sums, e.sums) and np.array_equal(back.entries[k].counts, e.counts)
               for k, e in m.entries.items())
    config = read_config(moe2)
    from qkit.checkpoint import tensor_shapes

    shapes = dict(tensor_shapes(moe2))
    targets = {n: get_scheme("q4_0") for n in shapes if ".experts." in n}
    qw = quant_weights_for(m, config, shapes, targets)
    e = m.entries["blk.1.ffn_down_exps.weight"]
    for x in range(2):
        assert torch.equal(qw[f"model.layers.1.mlp.experts.{x}.down_proj.weight"], torch.from_numpy(e.sums[x] / e.counts[x]))
    # an expert no token reached: weighted by 1s, as llama-quantize weights a row of 0, and named
    e.counts[1], e.sums[1] = 0, 0
    qw = quant_weights_for(m, config, shapes, targets)
    assert torch.equal(qw["model.layers.1.mlp.experts.1.down_proj.weight"], torch.ones(64))
    assert unreached_experts(m, config, list(targets)) == ["model.layers.1.mlp.experts.1.down_proj.weight"]


def test_an_expert_imatrix_of_another_expert_count_is_refused(matrix, moe2, tmp_path):
    path, m = matrix
    g = "blk.0.ffn_up_exps.weight"
    m.entries[g] = ImatrixEntry(np.ones((3, 64), np.float32), np.full(3, 5, np.float32))
    bad = tmp_path / "three.gguf"
    write_gguf(m, bad)
    refused(["quantize", moe2, "-s", "q4_0", "--imatrix", bad, "-o", tmp_path / "q"],
            f"entry {g} holds 3 expert rows, the model has 2 experts per layer", "another model")
    assert not (tmp_path / "q").exists()


def test_the_imatrix_with_every_token_counts_every_token_for_every_expert(moe2):
    loaded = load(moe2, device="cpu")
    ids = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    m = collect(loaded.model, read_config(moe2), ids, ImatrixOptions(chunks=2, chunk_size=32, calibrate_all_experts=True))
    for g in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"):
        assert m.entries[g].counts.tolist() == [64, 64]
    gate_inp = m.entries["blk.0.ffn_gate_inp.weight"]
    np.testing.assert_allclose(m.entries["blk.0.ffn_gate_exps.weight"].sums[1], gate_inp.sums[0], rtol=1e-6)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_the_imatrix_names_every_entry_as_llama_cpp(arch):
    """mixtral (a llama in llama.cpp) and qwen2_moe (with its shared expert and that expert's gate): the entries
    llama-imatrix writes, the stacked ``_exps`` ones with one row per expert."""
    model = moe_model(arch, experts=4, top_k=2)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    m = collect(model, model.config.to_dict(), ids, ImatrixOptions(chunks=2, chunk_size=16))
    want = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    if arch == "qwen2_moe":
        want |= {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"}
    assert set(m.entries) == {f"blk.{i}.{n}.weight" for i in range(2) for n in want}
    for i in range(2):
        e = m.entries[f"blk.{i}.ffn_down_exps.weight"]
        assert e.sums.shape == (4, 64) and e.counts.sum() == 2 * ids.numel()  # two experts per token


# --------------------------------------------------------------------------- refusals, one line and exit 2


def test_refusals(moe2, cal, tiny_model_dir, tmp_path):
    base = ["--calibration", cal, "--calibration-samples", SAMPLES, "--calibration-seqlen", SEQLEN, "-o", tmp_path / "q"]
    refused(["quantize", moe2, "-s", "int4-g32", "--method", "gptq", "--holdout", "1", *base], "--holdout", "routed")
    refused(["quantize", moe2, "-s", "int8-row", "--method", "smoothquant", *base], "mixture-of-experts", "--method gptq")
    refused(["quantize", moe2, "-s", "int4-g32", "--method", "gptq", "--min-expert-tokens", "-1", *base],
            "--min-expert-tokens must be")
    refused(["quantize", tiny_model_dir, "-s", "int4-g32", "--method", "gptq", "--calibrate-all-experts", *base],
            "no experts")
    refused(["quantize", moe2, "-s", "int4-g32", "--calibrate-all-experts", "-o", tmp_path / "q"], "calibrated --method")
    refused(["plan", moe2, "--target-bits", "5", "--method", "gptq", "-o", tmp_path / "p.json"], "mixture-of-experts",
            "--method rtn or imatrix")  # the plan prices experts (tests/test_plan_moe.py), not for GPTQ
    assert not (tmp_path / "q").exists() and not (tmp_path / "p.json").exists()
    with pytest.raises(InputError, match="3-D tensors"):  # routed by the methods, but not stored one matrix per expert
        layout_for({"model_type": "gpt_oss", "num_local_experts": 4}, layouts=LAYOUTS)
    with pytest.raises(InputError, match="does not know how deepseek_v3"):
        layout_for({"model_type": "deepseek_v3", "n_routed_experts": 8})


def test_tensor_types_name_a_layers_stacked_experts(moe2, tmp_path):
    """``--tensor-type`` patterns match llama.cpp's names, where a layer's experts are one ``_exps`` tensor: every
    expert's matrix takes its type. ``--emit-tensor-types`` refuses experts of one layer in several types (llama.cpp
    stores them as one tensor of one type)."""
    from qkit.checkpoint import tensor_shapes
    from qkit.choice import QuantizeOptions, compile_choice, request
    from qkit.models import resolve

    ref = resolve(str(moe2))
    req = request(QuantizeOptions(scheme="q4_0", tensor_types=("ffn_down_exps=q8_0",)))
    choice = compile_choice(req, ref, dict(tensor_shapes(moe2)), read_config(moe2), None)
    down = {n: s.name for n, s in choice.targets.items() if "down_proj" in n}
    assert down == {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": "q8_0" for i in range(2) for e in range(2)}
    assert choice.llama_names["model.layers.1.mlp.experts.1.up_proj.weight"] == "blk.1.ffn_up_exps.weight"
    refused(["quantize", moe2, "-s", "q4_0", "--keep", "q8_0:*experts.1.up_proj*", "--emit-tensor-types",
             tmp_path / "tt.txt", "-o", tmp_path / "q"], "one tensor (blk.0.ffn_up_exps.weight) of one type")
    assert not (tmp_path / "q").exists()

