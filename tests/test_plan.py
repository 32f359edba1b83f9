"""The planner end to end on a tiny llama: the Fisher against a finite difference, the budget, exact bytes
against the written files, determinism, a plan's quantize against its eval row, and the refusals."""

from __future__ import annotations

import json
import math

import gguf
import pytest
import torch
from conftest import make_tiny_llama, make_tokenizer
from typer.testing import CliRunner

from qkit.api import QuantizeOptions, plan_model, quantize_model
from qkit.cli import app
from qkit.errors import InputError
from qkit.plan import Candidate, PlanOptions, read_plan
from qkit.plan.sensitivity import candidate_cost, fisher_diagonal

runner = CliRunner()
FAST = dict(samples=2, seqlen=32, check_windows=2)


@pytest.fixture(scope="module")
def gguf_plan(wide_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    tt = out.with_name("types.txt")
    r = plan_model(str(wide_model), options=PlanOptions(format="gguf", target_bits=4.6, emit_tensor_types=tt, **FAST),
                   output=out)
    return r, out, tt


def test_fisher_predicts_the_kl_of_a_small_change():
    """1/2 d^T F d against the measured mean KL for a small random change of one matrix (second order: the
    two agree as the change shrinks); labels sampled, so agreement is statistical: within 35% here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (64, 32))
    name = "model.layers.0.mlp.down_proj.weight"
    f = fisher_diagonal(m, ids, [name], seed=1, check_windows=64)
    assert f.positions == 64 * 32 and f.diag[name].shape == (32, 64) and (f.diag[name] >= 0).all()
    p = dict(m.named_parameters())[name]
    assert all(q.requires_grad for q in m.parameters()) and p.grad is None  # restored as it was
    delta = 0.02 * torch.randn_like(p)
    predicted = 0.5 * float((f.diag[name].double() * delta.double() ** 2).sum())
    from qkit.plan.sensitivity import measured_kl

    with torch.no_grad():
        p.add_(delta)
    kl, se = measured_kl(m, f)
    assert predicted > 0 and kl > 0
    assert abs(predicted / kl - 1) < 0.35, (predicted, kl, se)


def _small_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_the_fisher_holds_one_targets_gradient_at_a_time_and_equals_the_naive_sum():
    """Memory: each target's squared gradient is added the moment autograd has it, and the gradient freed then,
    so a backward pass never holds more than one target's gradient (not a second copy of every target). Values:
    exactly the per-window sum of squares of ``autograd.grad`` with the same sampled labels."""
    m = _small_llama()
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    targets = [n for n, p in m.named_parameters() if p.ndim == 2]
    params = dict(m.named_parameters())
    alive: list[int] = []

    def spy(_):  # registered before fisher_diagonal's own hook, so it runs first: the others are freed by now
        alive.append(sum(params[t].grad is not None for t in targets))
    spies = [params[t].register_post_accumulate_grad_hook(spy) for t in targets]
    try:
        f = fisher_diagonal(m, ids, targets, seed=3)
    finally:
        for h in spies:
            h.remove()
    assert len(alive) == len(targets) * len(ids) and set(alive) == {1}
    assert all(p.grad is None for p in m.parameters())

    from qkit.plan.sensitivity import _logprobs
    g = torch.Generator().manual_seed(3)
    naive = {t: torch.zeros_like(params[t]) for t in targets}
    for window in ids:
        lp = _logprobs(m, window)
        y = torch.multinomial(lp.detach().exp(), 1, generator=g)
        grads = torch.autograd.grad(lp.gather(1, y).sum(), [params[t] for t in targets])
        for t, gr in zip(targets, grads):
            naive[t] += gr * gr
    for t in targets:
        torch.testing.assert_close(f.diag[t], naive[t] / ids.numel(), rtol=1e-5, atol=0)


def test_the_check_restores_every_swapped_weight_bit_for_bit_without_a_copy(wide_model, monkeypatch):
    """``check`` swaps the plan's codes into the table's model and puts the file's tensors back (no clone of
    the weights): afterwards every parameter equals a fresh load, bit for bit."""
    from qkit.models import load, resolve
    from qkit.plan import planner

    kept = planner.KeptMeasurements()
    r = plan_model(str(wide_model), options=PlanOptions(format="gguf", target_bits=4.6, **FAST), kept=kept)
    (table,) = kept.tables.values()
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: clones.append(self.shape) or real_clone(self, *a, **k))
    planner.check(r.plan, table, resolve(str(wide_model)))
    monkeypatch.undo()
    assert r.plan.check["measured_kl"] > 0 and not [s for s in clones if len(s) == 2]
    fresh = dict(load(ref=resolve(str(wide_model))).model.named_parameters())
    for name, p in table.model.named_parameters():
        assert torch.equal(p, fresh[name]), name


def test_candidate_cost_is_zero_for_weights_on_the_grid():
    from qkit.schemes import get_scheme, quantize_tensor

    w = torch.randn(4, 64)
    on_grid = quantize_tensor(w, get_scheme("q4_1")).dequantize(torch.float32)
    f = torch.ones_like(w)
    assert candidate_cost(on_grid, f, get_scheme("q4_1")) == (0.0, True)
    cost, lossless = candidate_cost(w, f, get_scheme("q4_0"))
    delta = w - quantize_tensor(w, get_scheme("q4_0")).dequantize(torch.float32)
    assert not lossless and cost == pytest.approx(0.5 * float((delta.double() ** 2).sum()), rel=1e-6)


def test_plan_fits_the_budget_and_its_bytes_are_the_files(wide_model, gguf_plan, tmp_path):
    r, out, tt = gguf_plan
    p = r.plan
    budget = p.target["budget_bytes"]
    assert budget == math.floor(4.6 * p.weights / 8) and p.nbytes <= budget
    assert p.solver["exact"] and p.nbytes == p.solver["nbytes"]
    assert p.predicted_kl == pytest.approx(sum(t.predicted_kl for t in p.tensors.values()))
    # every tensor's chosen candidate is its cheapest among those that the solver could afford: none cheaper and smaller
    for t in p.tensors.values():
        assert (t.nbytes, t.predicted_kl) == tuple(t.candidates[t.type])
    assert p.check["measured_kl"] > 0 and p.check["predicted_kl"] == pytest.approx(p.predicted_kl)
    written = tmp_path / "w.gguf"
    quantize_model(str(wide_model), output=written, options=QuantizeOptions(plan=str(out), format="gguf"))
    reader = gguf.GGUFReader(str(written))
    from qkit.llama_names import tensor_names

    by_gguf = {t.name: t for t in reader.tensors}
    cfg = json.loads((wide_model / "config.json").read_text())
    names = tensor_names("llama", cfg["num_hidden_layers"], list(p.tensors), tied=True)
    for name, t in p.tensors.items():
        g = by_gguf[names[name]]
        assert int(g.n_bytes) == t.nbytes, name
        assert g.tensor_type.name.lower() == (t.type if t.scheme is not None else "f32"), name
    words = tt.read_text().split()
    assert len(words) == len(p.tensors) and all(w.startswith("^blk") for w in words)


def test_target_scheme_budgets_what_that_recipe_writes(wide_model, tmp_path):
    """--target-scheme q4_k_m: the budget is the bytes llama-quantize's q4_k_m file gives the planned tensors
    (read back from a q4_k_m file qkit writes, whose tensors are llama-quantize's)."""
    out, g = tmp_path / "p.json", tmp_path / "q4_k_m.gguf"
    r = runner.invoke(app, ["plan", str(wide_model), "-o", str(out), "--format", "gguf", "--target-scheme", "q4_k_m",
                            "--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "1"])
    assert r.exit_code == 0, r.output
    plan = read_plan(out)
    quantize_model(str(wide_model), output=g, format="gguf", scheme="q4_k_m")
    from qkit.llama_names import tensor_names

    cfg = json.loads((wide_model / "config.json").read_text())
    names = set(tensor_names("llama", cfg["num_hidden_layers"], list(plan.tensors), tied=True).values())
    written = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(g)).tensors if t.name in names)
    assert plan.target["budget_bytes"] == written and plan.target["scheme"] == "q4_k_m" and plan.nbytes <= written


def test_the_same_inputs_give_the_same_plan(wide_model, gguf_plan, tmp_path):
    again = plan_model(str(wide_model), options=PlanOptions(format="gguf", target_bits=4.6, **FAST), output=tmp_path / "p.json")
    first = json.loads(gguf_plan[1].read_text())
    second = json.loads((tmp_path / "p.json").read_text())
    for doc in (first, second):
        for k in ("sensitivity", "solver", "check"):
            doc.pop(k)
    assert first == second
    assert again.plan.sha256() and read_plan(tmp_path / "p.json").schemes().keys() == again.plan.schemes().keys()


def test_a_plan_measured_in_groups_under_max_memory_is_the_same_plan(wide_model, gguf_plan, tmp_path):
    """``--max-memory`` at the least the plan can take (one block's Fisher at a time, freed as the walk goes
    down the blocks): the same tensors, types, bytes and predicted costs as the plan with the default
    budget, and the summary says how it was measured."""
    from qkit.models import resolve
    from qkit.plan import planner

    ref = resolve(str(wide_model))
    least = planner.memory_plan(ref, PlanOptions(format="gguf", target_bits=4.6, max_memory=1 << 40, **FAST)).estimate.minimum
    out = tmp_path / "grouped.json"
    r = runner.invoke(app, ["plan", str(wide_model), "-o", str(out), "--format", "gguf", "--target-bits", "4.6",
                            "--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "2",
                            "--max-memory", str(least)])
    assert r.exit_code == 0, r.output
    assert "the Fisher walked block by block, 1 pass" in r.output, r.output
    grouped, whole = json.loads(out.read_text()), json.loads(gguf_plan[1].read_text())
    assert grouped["sensitivity"]["memory"]["groups"] == 2 == whole["sensitivity"]["memory"]["groups"]  # the 2 blocks
    assert grouped["sensitivity"]["memory"]["passes"] == 1 == whole["sensitivity"]["memory"]["passes"]
    assert grouped["tensors"] == whole["tensors"] and grouped["totals"] == whole["totals"]
    assert grouped["check"]["measured_kl"] == whole["check"]["measured_kl"]


def test_a_planned_row_is_the_plans_checkpoint(wide_model, gguf_plan, tmp_path):
    """plan:FILE as an eval row and the checkpoint quantize --plan writes, evaluated against the model: the same row."""
    from qkit.evaluation import EvalOptions, evaluate

    out = gguf_plan[1]
    ck = tmp_path / "ck"
    quantize_model(str(wide_model), output=ck, options=QuantizeOptions(plan=str(out)))
    common = dict(tokens=200, window=100, battery_tokens=4, agree_tokens=3)
    mem = evaluate(str(wide_model), options=EvalOptions(schemes=(f"plan:{out}",), **common)).rows[1]
    disk = evaluate(str(ck), options=EvalOptions(reference=str(wide_model), **common)).rows[1]
    assert mem.kld == disk.kld and mem.perplexity == disk.perplexity and mem.bits_per_weight == disk.bits_per_weight
    assert mem.plan["sha256"] == read_plan(out).sha256()
    assert mem.llama_kl["kld_mean"] == pytest.approx(mem.kld, rel=1e-9)


def test_compressed_tensors_and_qkit_plans_write_what_they_planned(wide_model, tmp_path):
    for fmt in ("compressed-tensors", "qkit"):
        r = plan_model(str(wide_model), options=PlanOptions(format=fmt, target_bits=5.0, **FAST), output=tmp_path / f"{fmt}.json")
        q = quantize_model(str(wide_model), output=tmp_path / fmt, options=QuantizeOptions(plan=str(tmp_path / f"{fmt}.json"), format=fmt))
        assert q.types == {n: t.type for n, t in r.plan.tensors.items() if t.scheme is not None}
        assert r.plan.nbytes <= r.plan.target["budget_bytes"]


def _fused_key(name: str) -> str:
    return name.replace("q_proj", "qkv").replace("k_proj", "qkv").replace("v_proj", "qkv").replace("gate_proj", "gu").replace("up_proj", "gu")


def test_a_compressed_tensors_plan_gives_each_fused_vllm_layer_one_type(wide_model, tmp_path):
    """vLLM fuses q/k/v and gate/up and refuses shards of one fused layer in different schemes: the
    compressed-tensors plan ties them (and is the exact optimum of the tied problem, brute force over the
    tied items); the gguf plan of the same budget is free to split them, and here does."""
    from itertools import product

    from qkit.plan.solve import tied_items
    from qkit.plan.solve import brute_force

    opts = PlanOptions(format="compressed-tensors", target_bits=5.0, candidates=("int4-g64", "int8-row", "none"), **FAST)
    r = plan_model(str(wide_model), options=opts, output=tmp_path / "ct.json")
    by_fused: dict[str, set[str]] = {}
    for name, t in r.plan.tensors.items():
        by_fused.setdefault(_fused_key(name), set()).add(t.type)
    assert all(len(types) == 1 for types in by_fused.values()), by_fused
    assert len(r.plan.solver["tied"]) == 4 and r.plan.solver["items"] == 2 * 4  # per layer: qkv, o, gate_up, down
    names = list(r.plan.tensors)
    options = [[Candidate(k, None, b) for k, (b, _) in r.plan.tensors[n].candidates.items()] for n in names]
    costs = [[c for _, c in r.plan.tensors[n].candidates.values()] for n in names]
    groups, items, merged = tied_items(names, options, "compressed-tensors", costs)
    choice, best = brute_force(merged, [[c.nbytes for c in row] for row in items], r.plan.target["budget_bytes"])
    assert r.plan.predicted_kl == pytest.approx(best, rel=1e-12)
    assert len(list(product(*items))) > 1000  # the brute force had a real choice to make
    free = plan_model(str(wide_model), options=PlanOptions(format="qkit", target_bits=5.0, candidates=("int4-g64", "int8-g128", "none"), **FAST),
                      output=tmp_path / "qkit.json")
    assert any(len({free.plan.tensors[n].type for n in names if _fused_key(n) == k}) > 1 for k in by_fused), \
        "the untied plan never splits a fused group, so the tie above is not what made those types equal"


@pytest.mark.parametrize("args, message", [
    (["--target-bits", "1.0", "--format", "gguf"], "below the smallest mix"),
    (["--target-bits", "40", "--format", "gguf"], "above the unquantized size"),
    (["--target-bits", "4", "--format", "bitsandbytes"], "cannot mix types"),
    (["--target-bits", "4", "--target-size", "1MB"], "exactly one of"),
    (["--target-scheme", "q4_k_m", "--target-bits", "4"], "--target-scheme SCHEME"),
    (["--target-scheme", "q4_k_n", "--format", "gguf"], "q4_k_m"),
    (["--target-bits", "4", "--candidates", "q4_k_m"], "q4_k_m"),
    (["--target-bits", "4", "--method", "awq"], "rtn, the importance matrix (--method imatrix / --imatrix) or gptq"),
])
def test_refusals_are_one_line_and_write_nothing(wide_model, tmp_path, args, message):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["plan", str(wide_model), "-o", str(out), *args, "--calibration-samples", "2",
                            "--calibration-seqlen", "32", "--check-windows", "1"])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 3, r.output
    assert not out.exists()


@pytest.mark.parametrize("fmt, method, imatrix, emit, message", [
    ("compressed-tensors", "imatrix", False, False,
     "the importance matrix weights llama.cpp's types; plan --format gguf or qkit with it"),
    ("ct", "rtn", True, False, "the importance matrix weights llama.cpp's types; plan --format gguf or qkit with it"),
    ("gguf", "imatrix", True, False, "--imatrix FILE and --method imatrix both give the matrix: drop one of them"),
    ("qkit", "rtn", False, True, "--emit-tensor-types writes llama-quantize's --tensor-type-file: plan --format gguf"),
    ("compressed-tensors", "rtn", False, True,
     "--emit-tensor-types writes llama-quantize's --tensor-type-file: plan --format gguf"),
    ("gguf", "awq", False, False, "qkit plan measures candidates by rtn, the importance matrix (--method imatrix / "
     "--imatrix) or gptq; awq chooses codes per type and is not planned: quantize a plan's types with it instead"),
])
def test_plan_model_refuses_what_its_format_and_method_cannot_measure(wide_model, tmp_path, monkeypatch, fmt, method,
                                                                      imatrix, emit, message):
    """Asked of the format (its plan types: llama.cpp's or not) and the method's class, before the model is resolved."""
    def tripwire(*_a, **_k):
        raise AssertionError("the model was resolved before the refusal")

    monkeypatch.setattr("qkit.models.inputs.resolve", tripwire)
    out, tt = tmp_path / "p.json", tmp_path / "tt.txt"
    with pytest.raises(InputError) as err:
        plan_model(str(wide_model), output=out,
                   options=PlanOptions(format=fmt, target_bits=5.0, method=method,
                                       imatrix=str(tmp_path / "m.gguf") if imatrix else None,
                                       emit_tensor_types=tt if emit else None, **FAST))
    assert str(err.value) == message
    assert list(tmp_path.iterdir()) == []


def test_a_calibration_text_overlapping_the_eval_text_is_refused(wide_model, tmp_path):
    from qkit.texts import load_corpus

    bad = tmp_path / "ruth.txt"
    bad.write_text(load_corpus(None).text)
    with pytest.raises(InputError, match="overlap|shares"):
        plan_model(str(wide_model), options=PlanOptions(format="gguf", target_bits=5.0, calibration=str(bad), **FAST),
                   output=tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_a_plan_for_another_model_is_refused(wide_model, gguf_plan, tmp_path):
    other = tmp_path / "other"
    make_tiny_llama(other, hidden=256, intermediate=768, layers=2)
    make_tokenizer(other)
    with pytest.raises(InputError, match="was made for"):
        quantize_model(str(other), output=tmp_path / "q", options=QuantizeOptions(plan=str(gguf_plan[1]), format="gguf"))
    assert not (tmp_path / "q").exists()
    with pytest.raises(InputError, match="--format gguf"):
        quantize_model(str(wide_model), output=tmp_path / "q", options=QuantizeOptions(plan=str(gguf_plan[1]), format="compressed-tensors"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "qkit-plan", "format_version": 1, "tensors": {"a": {"shape": [1], "bytes": -1}}}))
    with pytest.raises(InputError, match="bytes -1"):
        read_plan(bad)


def test_eval_candidates_are_taken_per_format_and_checked():
    from qkit.evaluation import EvalOptions
    from qkit.evaluation.specs import row_plan
    from qkit.evaluation.specs import resolve_rows

    opts = EvalOptions(schemes=("plan:gguf@q4_k_m", "plan:ct@4.5"), plan_candidates=("q4_k,q8_0", "int4-g64"))
    rows = opts.resolve().rows  # --candidates parsed: each word may hold several
    gguf_row, ct_row = resolve_rows(opts.schemes)
    assert row_plan(gguf_row, rows).candidates == ("q4_k", "q8_0") and row_plan(ct_row, rows).candidates == ("int4-g64",)
    assert gguf_row.name == "plan:gguf@q4_k_m" and row_plan(gguf_row, rows).target_scheme == "q4_k_m"
    for words, message in ((("int4-g64",), "no type that plan:gguf@q4_k_m"), (("q4_k", "int4-g64", "nf4"), "nf4")):
        with pytest.raises(InputError, match=message):
            EvalOptions(schemes=("plan:gguf@q4_k_m", "plan:ct@4.5"), plan_candidates=words).resolve()
    with pytest.raises(InputError, match="the table has none"):
        EvalOptions(schemes=("q4_k_m",), plan_candidates=("q4_k",)).resolve()
    with pytest.raises(InputError, match="plan:FORMAT@BITS"):
        resolve_rows(["plan:gguf"])


def test_a_plan_file_row_keeps_its_path_and_is_read_before_the_reference_loads(tmp_path):
    from qkit.evaluation import EvalOptions
    from qkit.evaluation.specs import resolve_rows

    missing = tmp_path / "My Plan.json"
    (row,) = resolve_rows([f"plan:{missing}+imatrix"])
    assert row.plan == str(missing) and row.method == "imatrix"  # the path's case kept, the method read
    with pytest.raises(InputError, match="no such file"):
        EvalOptions(schemes=(f"plan:{missing}",)).resolve()
