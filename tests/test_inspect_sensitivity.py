"""``qkit inspect sensitivity``: a planted fragile matrix ranks first, an exact layer costs zero KL, and the
suggested ``--keep int8:PATTERN`` checkpoint carries mixed schemes that load and evaluate."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import qkit
from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import iter_tensors, read_manifest
from qkit.cli import app
from qkit.inspect import sensitivity as sens
from qkit.inspect.sensitivity import group_units, mean_kl, rank_sensitivity
from qkit.models import load
from qkit.schemes import get_scheme, quantize_tensor

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. Water boils at one hundred degrees."
FRAGILE = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory):
    from conftest import make_tiny_llama

    d = tmp_path_factory.mktemp("tiny3") / "model"
    make_tiny_llama(d, layers=3, seed=1)
    return d


def _projections(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}


@pytest.fixture
def fragile_model(three_layer_dir):
    """Projections scaled x5 (so that every matrix matters), and one weight of FRAGILE set to 50x its max:
    per-tensor int4 then rounds every other weight of that matrix to zero."""
    loaded = load(three_layer_dir, device="cpu")
    with torch.no_grad():
        for w in _projections(loaded.model).values():
            w.mul_(5.0)
        w = _projections(loaded.model)[FRAGILE]
        w[5, 7] = 50 * w.abs().max()
    return loaded


def test_planted_fragile_matrix_ranks_first(fragile_model):
    before = {n: p.detach().clone() for n, p in fragile_model.model.named_parameters()}
    r = rank_sensitivity(loaded=fragile_model, scheme="int4-tensor", by="matrix", text=TEXT)
    assert len(r.units) == 21
    assert r.units[0].name == FRAGILE
    assert r.units[0].kl > 1.3 * r.units[1].kl
    assert r.units[0].max_over_std > 50 > max(u.max_over_std for u in r.units[1:])
    assert [u.kl for u in r.units] == sorted((u.kl for u in r.units), reverse=True)
    # weights restored bit for bit after the analysis
    after = dict(fragile_model.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    # the suggestion keeps the fragile matrix and recovers part of the whole-model KL
    assert r.kept[0] == FRAGILE and r.keep_args()[0] == f"int8:{FRAGILE}"
    assert 0 < r.kl_mixed < r.kl_all and 0 < r.recovered < 1
    assert r.bytes_mixed > r.bytes_all
    assert "--keep 'int8:model.layers.1.mlp.down_proj.weight'" in r.command()


def test_unit_kl_is_the_kl_of_the_swapped_model(fragile_model):
    """Independent check of the fast path (layers re-run from the quantized one): swap by hand, full forward."""
    ids = fragile_model.tokenizer(TEXT, return_tensors="pt").input_ids
    r = rank_sensitivity(loaded=fragile_model, scheme="int4-row", by="layer", input_ids=ids, suggest=0)
    lm = fragile_model.model
    with torch.no_grad():
        ref = torch.log_softmax(lm(ids).logits[0].float(), dim=-1)
        params = _projections(lm)
        unit = next(u for u in r.units if u.name == "model.layers.2")
        saved = {n: params[n].clone() for n in unit.matrices}
        for n in unit.matrices:
            params[n].copy_(quantize_tensor(saved[n], get_scheme("int4-row")).dequantize())
        kl = mean_kl(ref, lm(ids).logits[0])
        for n, w in saved.items():
            params[n].copy_(w)
    assert unit.kl == pytest.approx(kl, rel=1e-4, abs=1e-9)
    assert r.kept == [] and r.kl_mixed == r.kl_all


def test_identity_preserving_layer_contributes_zero_kl(three_layer_dir):
    """Layer 0's weights on the int8 grid (integers times 2^-9, a +-127 in every matrix): int8-tensor
    reproduces them exactly, so quantizing that layer alone changes nothing."""
    loaded = load(three_layer_dir, device="cpu")
    with torch.no_grad():
        for n, w in _projections(loaded.model).items():
            if n.startswith("model.layers.0."):
                q = torch.round(w / w.abs().max() * 127)
                q.view(-1)[0] = 127
                w.copy_(q * 2.0**-9)
                assert torch.equal(quantize_tensor(w, get_scheme("int8-tensor")).dequantize(), w)
    r = rank_sensitivity(loaded=loaded, scheme="int8-tensor", by="layer", text=TEXT)
    kl = {u.name: u.kl for u in r.units}
    assert set(kl) == {"model.layers.0", "model.layers.1", "model.layers.2"}
    assert kl["model.layers.0"] == 0.0
    assert kl["model.layers.1"] > 0 and kl["model.layers.2"] > 0
    assert r.units[-1].name == "model.layers.0"
    zero = next(u for u in r.units if u.name == "model.layers.0")
    assert zero.rel_error == 0.0 and zero.glob == "model.layers.0.*"


def test_fast_path_is_used_on_llama(three_layer_dir, monkeypatch):
    """The layer-skipping runner reproduces the full forward (its own check) and agrees with the slow path."""
    loaded = load(three_layer_dir, device="cpu")
    fast = rank_sensitivity(loaded=loaded, scheme="int4-tensor", by="layer", text=TEXT, suggest=1)
    seen = []
    original = sens._Runner.check

    def spy(self, reference):
        original(self, reference)
        seen.append(self.partial_ok)
        self.partial_ok = False  # force full forward passes

    monkeypatch.setattr(sens._Runner, "check", spy)
    slow = rank_sensitivity(loaded=loaded, scheme="int4-tensor", by="layer", text=TEXT, suggest=1)
    assert seen == [True]
    assert [u.name for u in fast.units] == [u.name for u in slow.units]
    for a, b in zip(fast.units, slow.units):
        assert a.kl == pytest.approx(b.kl, rel=1e-4, abs=1e-9)


def test_group_units():
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.10.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    assert group_units(names, "layer") == {
        "model.layers.0": [names[0], names[2]],
        "model.layers.10": [names[1]],
    }
    assert list(group_units(names, "matrix")) == names


def test_residual_outlier_dims_flag_the_matrices_that_read_them(three_layer_dir):
    loaded = load(three_layer_dir, device="cpu")
    with torch.no_grad():
        loaded.model.model.embed_tokens.weight[:, 11] = 400.0
        # let the planted dimension through the input norms of layer 1 only
        loaded.model.model.layers[1].input_layernorm.weight[11] = 1.0
        loaded.model.model.layers[0].input_layernorm.weight[11] = 0.0
    r = rank_sensitivity(loaded=loaded, scheme="int4-row", by="matrix", text=TEXT, suggest=0)
    assert r.residual_outlier_dims == [11]
    flagged = {u.name for u in r.units if u.residual_outlier_dims == [11]}
    assert "model.layers.1.self_attn.q_proj.weight" in flagged
    assert "model.layers.0.self_attn.q_proj.weight" not in flagged
    assert all("down_proj" not in n and "o_proj" not in n for n in flagged)


def test_keep_int8_pattern_writes_mixed_checkpoint_that_loads(tiny_model_dir, tmp_path):
    out = tmp_path / "mixed"
    r = quantize_model(tiny_model_dir, output=out, scheme="nf4",
                       options=QuantizeOptions(keep=["int8:*.mlp.down_proj.weight", "int8:model.layers.1.*"]))
    assert r.schemes_used == {"int8-row": 8, "nf4": 6}
    manifest = read_manifest(out)
    schemes = {n: e["scheme"]["name"] for n, e in manifest["tensors"].items()}
    assert schemes["model.layers.0.mlp.down_proj.weight"] == "int8-row"
    assert schemes["model.layers.1.self_attn.q_proj.weight"] == "int8-row"
    assert schemes["model.layers.0.self_attn.q_proj.weight"] == "nf4"
    assert manifest["rules"]["keep"] == [["*.mlp.down_proj.weight", "int8-row"], ["model.layers.1.*", "int8-row"]]
    # qkit.load of the mixed checkpoint gives each matrix dequantized with its own scheme
    loaded = qkit.load(out, device="cpu")
    params = dict(loaded.model.named_parameters())
    for name, w in iter_tensors(tiny_model_dir):
        if name in schemes:
            expect = quantize_tensor(w, get_scheme(schemes[name])).dequantize()
            assert torch.equal(params[name].detach(), expect), name


def test_keep_checkpoint_evaluates(tiny_model_dir, tmp_path):
    evaluation = pytest.importorskip("qkit.evaluation")
    from conftest import TINY_TEXT

    out = tmp_path / "mixed"
    quantize_model(tiny_model_dir, output=out, scheme="nf4",
                   options=QuantizeOptions(keep=["int8:*.mlp.down_proj.weight"]))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT * 3)
    report = evaluation.evaluate(
        out, options=evaluation.EvalOptions(reference=str(tiny_model_dir), corpus=str(corpus), tokens=128, battery_tokens=8)
    )
    assert [row.scheme for row in report.rows][0] == "reference"
    assert len(report.rows) == 2 and report.rows[1].kld > 0


def test_cli_sensitivity(three_layer_dir, tmp_path):
    out = tmp_path / "s.json"
    res = CliRunner().invoke(app, ["inspect", "sensitivity", str(three_layer_dir), "--scheme", "int4-tensor", "--text", TEXT,
                                   "--suggest", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert len(d["units"]) == 3 and d["suggestion"]["kept"] == [d["units"][0]["name"]]
    assert "qkit quantize" in res.output and "--keep 'int8:model.layers." in res.output


def test_cli_sensitivity_needs_a_scheme(three_layer_dir):
    res = CliRunner().invoke(app, ["inspect", "sensitivity", str(three_layer_dir)])
    assert res.exit_code == 2 and "missing --scheme" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["inspect", "sensitivity", str(three_layer_dir), "-s", "nf4", "--by", "head"])
    assert res.exit_code == 2 and "--by must be one of layer, matrix" in res.output
