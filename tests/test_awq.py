"""AWQ (qkit.methods.awq): the search never loses to RTN on its data, folding keeps the fp model, and the
result is an ordinary checkpoint (qkit.load, eval, compressed-tensors export)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.api import quantize_model
from qkit.errors import InputError
from qkit.methods import get_method, make_options
from qkit.methods.awq import AWQOptions, awq_model, search_group
from qkit.methods.awq_search import apply_clip, awq_scales, clip_thresholds, clip_width, fake_quant
from qkit.methods.folding import FoldGroup
from qkit.models import load
from qkit.schemes import get_scheme, quantize_tensor

CAL = {"calibration_samples": 4, "calibration_seqlen": 32}


def _ids(n=4, length=32, vocab=300, seed=0):
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _targets(model, scheme):
    s = get_scheme(scheme)
    return {n: s for n, p in model.named_parameters() if p.dim() == 2 and "_proj" in n}


# --------------------------------------------------------------------------- maths


@pytest.mark.parametrize("scheme", ["int4-g64", "int4-g32", "int8-row", "int4-tensor", "int4-g48", "int4-g40"])
def test_fast_fake_quant_is_the_writer_path_bit_for_bit(scheme):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    s = get_scheme(scheme)
    assert torch.equal(fake_quant(w, s), quantize_tensor(w, s).dequantize(torch.float32))


def test_ratio_zero_is_plain_rtn():
    x = torch.rand(64) * 10
    assert torch.equal(awq_scales(x, 0.0), torch.ones(64))
    s = awq_scales(torch.tensor([1.0, 4.0, 16.0]), 0.5)  # x^0.5 = 1, 2, 4; / sqrt(4 * 1) = 2
    assert torch.allclose(s, torch.tensor([0.5, 1.0, 2.0]))


class _OneLinear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.proj.weight.data = w.clone()


def _planted(seed, salient=(5, 17), factor=50.0, cols=128, rows=48, tokens=256):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    x = torch.randn(tokens, cols, generator=g)
    x[:, list(salient)] *= factor  # salient input channels: their weights matter most
    return w, x


def test_awq_beats_rtn_on_a_planted_salient_channel_layer():
    w, x = _planted(0)
    block = _OneLinear(w)
    group = FoldGroup("g", "down", "prev", True, ("proj",), "proj")
    target = [block.proj(x)]
    s, ratio, loss_rtn, loss_best = search_group(block, group, x.abs().mean(0), [(x, {})], target,
                                                 {"proj": get_scheme("int4-g32")})
    # the RTN loss is what quantize_tensor's RTN weights give
    rtn = torch.nn.functional.linear(x, fake_quant(w, get_scheme("int4-g32")))
    assert loss_rtn == pytest.approx(float((rtn - target[0]).pow(2).mean()), rel=1e-5)
    assert ratio > 0 and loss_best < 0.7 * loss_rtn  # scaling the salient channels up pays here
    assert torch.equal(block.proj.weight.data, w)  # the search restores the weights
    # the scales are larger on the salient channels
    assert s[[5, 17]].min() > s.median() * 2


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["int4-g32", "int4-row", "nf4", "int8-g64"]))
def test_search_never_worse_than_rtn_on_its_data(seed, scheme):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 64, generator=g) * 0.1
    x = torch.randn(64, 64, generator=g) * torch.rand(64, generator=g) * 5
    block = _OneLinear(w)
    group = FoldGroup("g", "down", "prev", True, ("proj",), "proj")
    _, _, loss_rtn, loss_best = search_group(block, group, x.abs().mean(0), [(x, {})], [block.proj(x)],
                                             {"proj": get_scheme(scheme)}, n_grid=8)
    assert loss_best <= loss_rtn


def test_clip_widths_follow_the_scale_unit():
    assert clip_width(get_scheme("int4-g64"), 576) == 64
    assert clip_width(get_scheme("int8-row"), 576) == 576
    assert clip_width(get_scheme("nf4"), 576) == 64
    assert clip_width(get_scheme("nf4"), 100) is None  # NF4 blocks would cross rows
    assert clip_width(get_scheme("int4-tensor"), 576) is None


def test_clip_search_hand_case_and_never_worse_than_no_clip():
    # One row, one group of 4: a lone outlier 1.0 among small weights. Unclipped int4: scale 1/7, the small
    # weights 0.05 round to 0 (0.35 steps) and their inputs are large; clipping to 0.5 (i = 10, the last
    # level) gives scale 0.5/7 and 0.05 -> 1 step (0.0714): the small weights' error drops.
    w = torch.tensor([[1.0, 0.05, 0.05, 0.05]])
    x = torch.tensor([[0.0, 10.0, 10.0, 10.0], [0.1, 10.0, 10.0, 10.0]])
    th = clip_thresholds(w, x, get_scheme("int4-g4"), 4)
    assert th.shape == (1, 1) and float(th) < 1.0
    clipped = apply_clip(w, th, 4)
    err = lambda v: float(((x @ (fake_quant(v, get_scheme("int4-g4")) - w).T) ** 2).mean())  # noqa: E731
    assert err(clipped) < err(w)
    # random case: per-group error never above the unclipped one (i = 0 is a candidate)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 96, generator=g)
    x = torch.randn(128, 96, generator=g)
    s = get_scheme("int4-g32")
    th = clip_thresholds(w, x, s, 32)
    dw0 = (fake_quant(w, s) - w).reshape(16, 3, 32)
    dw1 = (fake_quant(apply_clip(w, th, 32), s) - w).reshape(16, 3, 32)
    xu = x.reshape(128, 3, 32)
    e0 = torch.einsum("tgk,rgk->rgt", xu, dw0).pow(2).mean(-1)
    e1 = torch.einsum("tgk,rgk->rgt", xu, dw1).pow(2).mean(-1)
    assert (e1 <= e0 * (1 + 1e-5)).all()


# --------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("next_inputs", ["fp", "quantized"])
def test_awq_folding_keeps_the_fp_model_and_never_loses_to_rtn(tiny_model_dir, next_inputs):
    model = load(tiny_model_dir).model
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    opts = AWQOptions(next_inputs=next_inputs, n_grid=10)
    result = awq_model(model, ids, _targets(model, "int4-g32"), opts)
    groups = result.record["groups"]
    assert len(groups) == 2 * 4  # qkv, o (GQA: tied per kv head), gate_up, down per block
    for rec in groups.values():
        assert rec["loss_search"] <= rec["loss_rtn"]
    assert any(rec["ratio"] > 0 for rec in groups.values())
    assert "model.layers.0.input_layernorm.weight" in result.replaced
    if next_inputs == "fp":  # the model is left folded at full precision: the same function
        with torch.no_grad():
            after = model(input_ids=ids).logits
        assert (after - before).abs().max() / before.abs().max() < 1e-5
    # the written tensors are ordinary QuantizedTensors of the scheme
    qt = result.quantized["model.layers.1.mlp.down_proj.weight"]
    assert qt.scheme.name == "int4-g32" and qt.shape == (64, 160)


def test_awq_nf4_and_per_tensor_run_and_record_clipping(tiny_model_dir):
    model = load(tiny_model_dir).model
    res = awq_model(model, _ids(2), _targets(model, "int4-tensor"), AWQOptions(n_grid=4, clip_grid=4))
    clipped = res.record["groups"]["model.layers.0.mlp.down"]["clipped"]["down_proj"]
    assert clipped.startswith("skipped")
    model = load(tiny_model_dir).model
    res = awq_model(model, _ids(2), _targets(model, "nf4"), AWQOptions(n_grid=4, clip_grid=4))
    assert res.quantized["model.layers.0.self_attn.q_proj.weight"].scheme.name == "nf4"


def test_awq_checkpoint_loads_and_matches_the_in_memory_row(tiny_model_dir, tmp_path):
    out = tmp_path / "awq"
    opts = {**CAL, "n_grid": 5, "clip_grid": 6}
    res = quantize_model(tiny_model_dir, output=out, scheme="int4-g32", method="awq", method_options=opts, collect=True)
    assert res.method == "awq" and res.method_record["calibration"]["samples"] == 4
    assert res.method_record["options"]["n_grid"] == 5
    loaded = load(out)
    assert loaded.manifest["method"]["name"] == "awq"
    mem = load(tiny_model_dir).model
    state = {**{k: v for k, v in res.replaced.items()}, **{k: q.dequantize() for k, q in res.quantized.items()}}
    mem.load_state_dict(state, strict=False)
    ids = _ids(1, 24)
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, mem(input_ids=ids).logits)


def test_awq_checkpoint_exports_to_compressed_tensors_and_verifies(tiny_model_dir, tmp_path):
    from qkit.verify import verify_checkpoint

    out = tmp_path / "ct"
    quantize_model(tiny_model_dir, output=out, scheme="int4-g32", method="awq",
                   method_options={**CAL, "n_grid": 4, "clip": False}, format="compressed-tensors")
    result = verify_checkpoint(out)
    assert result.passed, result.to_dict()


def test_eval_rows_rtn_and_awq(tiny_model_dir, tmp_path):
    from conftest import TINY_TEXT

    from qkit.evaluation import EvalOptions, evaluate

    corpus = tmp_path / "text.txt"
    corpus.write_text(TINY_TEXT * 3)
    report = evaluate(tiny_model_dir, options=EvalOptions(
        schemes=("int4-g32",), methods=("rtn", "awq"), method_options=tuple(sorted({**CAL, "n_grid": 4}.items())),
        corpus=str(corpus), tokens=128, battery_tokens=4))
    assert [r.scheme for r in report.rows] == ["reference", "int4-g32", "int4-g32+awq"]


@pytest.mark.parametrize("bad", [{"next_inputs": "bf16"}, {"n_grid": 0}, {"max_shrink": 1.0},
                                 {"search_samples": 0}, {"calibration_samples": 0}])
def test_bad_options_are_one_line(bad):
    with pytest.raises(InputError) as exc:
        make_options(get_method("awq"), bad)
    assert "\n" not in str(exc.value)


def test_unsupported_model_is_refused_before_anything_is_written(tmp_path):
    import json

    from conftest import make_tiny_llama

    d = tmp_path / "m"
    make_tiny_llama(d, layers=1, hidden=32)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gemma"  # a norm of (1 + w): folding would be wrong, so it is refused
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="scale folding supports"):
        quantize_model(d, output=tmp_path / "out", scheme="int4-g32", method="awq", method_options=CAL)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_default_model_awq_folding_is_exact_and_every_group_beats_rtn(default_model_dir):
    """The real default model (GQA: 3 kv heads for 9 query heads, so v->o scales are tied per kv head):
    after AWQ the fp model is the same function, and no group's search loses to RTN on its data."""
    from qkit.methods.calibration import CalibrationOptions, calibration_ids

    loaded = load(default_model_dir)
    model = loaded.model
    ids, _ = calibration_ids(loaded.tokenizer, CalibrationOptions(samples=4, seqlen=128))
    probe = ids[:1, :64]
    with torch.no_grad():
        before = model(input_ids=probe).logits
    res = awq_model(model, ids, _targets(model, "int4-g64"), AWQOptions(n_grid=10, clip=False, search_samples=2))
    with torch.no_grad():
        after = model(input_ids=probe).logits
    assert (after - before).abs().max() / before.abs().max() < 1e-5
    groups = res.record["groups"]
    assert len(groups) == 30 * 4
    assert all(g["loss_search"] <= g["loss_rtn"] for g in groups.values())
    assert sum(g["loss_final"] for g in groups.values()) < sum(g["loss_rtn"] for g in groups.values())


@pytest.mark.parametrize("tie", [True, False])
def test_a_bf16_file_walked_block_by_block_gives_the_fp32_loads_bytes(tmp_path, tie):
    """AWQ loads a bf16 file in bf16 (memory-mapped) and upcasts one block at a time to fp32
    (``walk_blocks(compute_dtype=...)``): every stored tensor and every folded norm equals what loading the
    whole file in fp32 gives, bit for bit, an untied head quantized outside the blocks included."""
    from conftest import make_tiny_llama

    from qkit.checkpoint import tensor_shapes
    from qkit.methods.awq import METHOD, AWQOptions
    from qkit.methods.calibration import calibration_ids
    from qkit.models import resolve

    make_tiny_llama(tmp_path / "m", hidden=128, intermediate=256, tie=tie, dtype=torch.bfloat16)
    ref = resolve(str(tmp_path / "m"))
    s = get_scheme("int4-g32")
    targets = {n: s for n, _ in tensor_shapes(ref.directory) if n.endswith("proj.weight") or n == "lm_head.weight"}
    assert ("lm_head.weight" in targets) is not tie
    opts = AWQOptions(calibration_samples=4, calibration_seqlen=64)
    walked = METHOD.run(ref, targets, opts, device=torch.device("cpu"))
    loaded = load(ref=ref, device="cpu", dtype=torch.float32)
    whole = awq_model(loaded.model, calibration_ids(loaded.tokenizer, opts.calibration_options())[0], targets, opts)
    for n in targets:
        a, b = walked.quantized[n], whole.quantized[n]
        assert a.dtype == torch.bfloat16  # the source's dtype
        assert torch.equal(a.dequantize(torch.float32), b.dequantize(torch.float32)), n
    assert sorted(walked.replaced) == sorted(whole.replaced) and walked.replaced
    assert all(torch.equal(walked.replaced[n], whole.replaced[n]) for n in whole.replaced)
