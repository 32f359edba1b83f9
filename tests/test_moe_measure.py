"""The measuring commands on a mixture-of-experts model: ``qkit eval``, ``qkit inspect errors`` and
``sensitivity``, ``qkit report``.

transformers holds a layer's experts fused in two 3-D parameters; the checkpoint, every row's file and every
table name one 2-D matrix per expert. The oracles: the weights ``qkit quantize`` writes, read back and
dequantized (``iter_quantized``), against the weights the eval's model holds while the row is scored;
int4-g128 computed by hand from the safetensors file; the routed tokens taken from the router's top-k by
hand. The model: ``helpers_archs``' tiny qwen3_moe (2 layers, 4 experts, 2 per token, 256 wide) with the
tests' 300-token byte-level BPE tokenizer, so it is 8 MB.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_TEXT, make_tokenizer
from helpers_archs import make_arch_model
from safetensors import safe_open

from qkit.api import quantize_model
from qkit.checkpoint import iter_quantized
from qkit.errors import InputError
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.swap import Swapper, model_tensors
from qkit.inspect.errors import weight_errors
from qkit.inspect.outliers import capture
from qkit.inspect.sensitivity import rank_sensitivity
from qkit.models import load
from qkit.schemes import get_scheme, quantize_tensor
from qkit.transform import is_router

FAST = dict(tokens=64, battery=False, agree_tokens=2)
EXPERTS = [f"model.layers.{layer}.mlp.experts.{e}.{m}.weight" for layer in (0, 1) for e in range(4)
           for m in ("gate_proj", "up_proj", "down_proj")]
ATTENTION = [f"model.layers.{layer}.self_attn.{m}.weight" for layer in (0, 1) for m in ("q_proj", "k_proj", "v_proj", "o_proj")]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    make_tokenizer(root / "tok")
    (root / "tok" / "config.json").write_text('{"vocab_size": 304}')  # the vocabulary make_arch_model gives the model
    return make_arch_model(root / "qwen3_moe", "qwen3_moe", root / "tok")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    f = tmp_path_factory.mktemp("corpus") / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return str(f)


def test_the_eval_row_scores_exactly_the_weights_quantize_writes_every_expert_included(moe, corpus, tmp_path, monkeypatch):
    """While the int4-g128 row is scored, the model's 24 expert matrices (slices of the fused parameters)
    equal, bit for bit, ``qkit quantize``'s file dequantized, and the routers are the reference's."""
    saved = quantize_model(model=moe, output=tmp_path / "q", scheme="int4-g128")
    want = {n: qt.dequantize(torch.float32) for n, qt in iter_quantized(tmp_path / "q") if not isinstance(qt, torch.Tensor)}
    assert sorted(want) == sorted(EXPERTS + ATTENTION) and saved.matrices == 32
    seen = []
    score = CorpusReference.score

    def spy(self, model):
        seen.append({n: t.detach().clone() for n, t in model_tensors(model).items() if n in want or is_router(n)})
        return score(self, model)

    monkeypatch.setattr(CorpusReference, "score", spy)
    row = evaluate(moe, options=EvalOptions(schemes=("int4-g128",), corpus=corpus, **FAST)).rows[1]
    assert row.weights_changed == 32 and row.matrices == 32 and row.refused is None
    assert len(seen) == 1
    for name in want:
        assert torch.equal(seen[0][name], want[name]), name
    routers = sorted(n for n in seen[0] if is_router(n))
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    with safe_open(str(moe / "model.safetensors"), "pt") as f:
        assert all(torch.equal(seen[0][n], f.get_tensor(n)) for n in routers)


def test_a_row_simulating_activations_is_refused_before_its_weights_go_in(moe):
    """The activation hooks quantize the inputs of linears, which the experts are not: the torch runtime
    refuses the row in one line instead of scoring it with the experts' inputs in full precision."""
    from qkit.evaluation.engines import ENGINES, EngineOptions, EngineRefused
    from qkit.evaluation.measuring import RowFile
    from qkit.evaluation.specs import RowSpec
    from qkit.models import resolve

    reference = SimpleNamespace(model=load(moe).model, ref=resolve(str(moe)), tokenizer=None, text=None)
    session = ENGINES.get("torch").open(reference, EngineOptions(), lambda _: None)
    for simulation in ("act-int8-token", "llm-int8"):
        row = RowFile(RowSpec("int8-row", simulation=(simulation,)), moe, {})
        with pytest.raises(EngineRefused) as refused:
            session.measure(row, simulation)
        assert str(refused.value) == (f"{simulation} quantizes the inputs of linear modules, and this model's experts are "
                                      "held fused in 3-D parameters (2 modules), not linears: their inputs would stay "
                                      "in full precision")


def test_a_quantized_tensor_the_model_does_not_hold_is_refused_not_skipped(moe):
    model = load(moe).model
    swapper = Swapper(model, moe)
    qt = quantize_tensor(torch.ones(8, 128), get_scheme("int8-row"), name="model.layers.0.mlp.experts.9.up_proj.weight")
    with pytest.raises(InputError, match=r"quantizes model\.layers\.0\.mlp\.experts\.9\.up_proj\.weight, which the loaded "
                                         r"Qwen3MoeForCausalLM holds under no name"):
        swapper.apply([("model.layers.0.mlp.experts.9.up_proj.weight", qt)])
    swapper.apply([("model.rotary_emb.inv_freq_old", torch.ones(3))])  # full precision: skipped, as on loading
    assert swapper.changed == 0


def test_a_method_that_cannot_reach_the_experts_is_refused_before_the_model_loads(moe, corpus, monkeypatch):
    import qkit.evaluation.runner as runner

    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    with pytest.raises(InputError, match="--method smoothquant is not run on mixture-of-experts models"):
        evaluate(moe, options=EvalOptions(schemes=("int8-row",), methods=("smoothquant",), corpus=corpus, **FAST))


@pytest.fixture(scope="module")
def errors(moe):
    return weight_errors(moe, schemes=("int4-g128",))


def test_inspect_errors_lists_every_expert_matrix_and_its_error_is_int4_g128_by_hand(moe, errors):
    report = errors
    assert sorted(m.name for m in report.matrices) == sorted(EXPERTS + ATTENTION)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    with safe_open(str(moe / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name).double()
    groups = w.reshape(-1, 128)
    scale = (groups.abs().amax(dim=1, keepdim=True).float() / 7).half().double()  # fp16 scales, qmax 7
    w_hat = (groups / scale).round().clamp(-8, 7) * scale
    by_hand = float((groups - w_hat).norm() / groups.norm())
    got = next(m.rel_error for m in report.matrices if m.name == name)
    assert got == pytest.approx(by_hand, rel=1e-6) and 0.11 < got < 0.13


def test_sensitivity_quantizes_each_layers_experts_in_place_and_puts_them_back(moe):
    loaded = load(moe)
    before = {n: t.clone() for n, t in model_tensors(loaded.model).items()}
    report = rank_sensitivity(scheme="int4-g128", by="layer", tokens=16, loaded=loaded, suggest=0)
    assert sorted(n for u in report.units for n in u.matrices) == sorted(EXPERTS + ATTENTION)  # no router
    assert all(u.kl > 0 for u in report.units) and report.kl_all > 0
    after = model_tensors(loaded.model)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_an_experts_input_is_taken_over_the_tokens_routed_to_it(moe):
    """capture's input maxima of an expert matrix against the routing done by hand from the router's top-k
    (the fused module's own arguments) and its gate/up slices."""
    model = load(moe).model
    experts = model.model.layers[1].mlp.experts
    args = []
    handle = experts.register_forward_pre_hook(lambda _m, a: args.append(a))
    names = ["model.layers.1.mlp.experts.2.gate_proj", "model.layers.1.mlp.experts.2.down_proj"]
    ids = torch.randint(0, 304, (1, 40), generator=torch.Generator().manual_seed(0))
    try:
        with capture(model, residual=False, linears=names) as cap, torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden, top_k = args[0][0], args[0][1]
    x = hidden[[t for t in range(hidden.shape[0]) if 2 in top_k[t].tolist()]]
    assert 0 < len(x) < hidden.shape[0]
    gate, up = experts.gate_up_proj[2, :256], experts.gate_up_proj[2, 256:]
    with torch.no_grad():
        down_input = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    assert torch.equal(cap["inputs"][names[0]], x.abs().amax(dim=0))
    torch.testing.assert_close(cap["inputs"][names[1]], down_input.abs().amax(dim=0), rtol=1e-6, atol=0)


def test_report_draws_one_column_per_expert_matrix(moe, errors, tmp_path):
    pytest.importorskip("matplotlib", reason="qkit report needs the report extra (matplotlib)")
    from typer.testing import CliRunner

    from qkit.cli import app
    from qkit.report import data

    assert data.split_name("model.layers.1.mlp.experts.3.gate_proj.weight") == (1, "experts.3.gate_proj")
    assert data.split_name("model.layers.0.block_sparse_moe.experts.12.w1.weight") == (0, "experts.12.w1")
    errors = errors.to_dict()
    grid = data.error_grid(errors, "int4-g128")
    assert grid.layers == [0, 1] and len(grid.columns) == 4 + 12 and None not in grid.values()
    assert grid.columns[:6] == ["q_proj", "k_proj", "v_proj", "o_proj", "experts.0.gate_proj", "experts.0.up_proj"]
    assert grid.columns[-1] == "experts.3.down_proj"
    cell = grid.cells[1][grid.columns.index("experts.2.down_proj")]
    assert cell == next(m["rel_error"] for m in errors["matrices"] if m["name"] == "model.layers.1.mlp.experts.2.down_proj.weight")
    (tmp_path / "errors.json").write_text(json.dumps(errors))
    result = CliRunner().invoke(app, ["report", str(tmp_path / "errors.json"), "--model", str(moe), "--run", "none",
                                      "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    html = (tmp_path / "r.html").read_text()
    assert "Per-matrix weight error by layer" in html and re.search(r"model\.layers\.\d\.mlp\.experts\.\d\.\w+_proj", html)
