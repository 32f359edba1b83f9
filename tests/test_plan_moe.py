"""``qkit plan`` on a mixture-of-experts model: each expert matrix priced as its own tensor.

transformers holds a layer's experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
the checkpoint, and so the plan and the file quantize writes, hold one 2-D matrix per expert. The planner
walks the Fisher of the fused parameters and keeps each expert matrix's slice (``fisher_walk``'s ``views``,
``methods.experts.expert_slices``). The oracles: the file's own tensors (the slices hold them), the whole-model
Fisher of the fused parameters (bit for bit), the Fisher of one ``nn.Linear`` per expert matrix
(``unfused_experts``: each its own parameter and gradient), the formats' exact byte counts, and the bytes the
quantize of the plan writes.

One tiny qwen3_moe (``helpers_archs.make_arch_model``: hidden 256, 2 layers, 4 experts of width 256, 2 per token,
the 304-token tokenizer of ``conftest.make_tokenizer``) serves every test. For the plan, two experts are
changed by hand: layer 0's expert 1 gets its ``down_proj`` times 8 (its output, so its matrices' Fisher-weighted
error, ~64x larger) and the router never picks expert 3 (a patched router), so the solver has one expert to
widen and one no token reaches.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import TINY_TEXT, make_tokenizer
from helpers_archs import make_arch_model
from safetensors.torch import load_file, save_file

from qkit.api import QuantizeOptions, plan_model, quantize_model
from qkit.errors import QkitError
from qkit.methods.experts import expert_slices, linear_names, unfused_experts
from qkit.models import load, read_config, resolve
from qkit.plan import PlanOptions, planner
from qkit.plan.candidates import stored_nbytes
from qkit.plan.fisher_walk import fisher_by_blocks
from qkit.plan.sensitivity import fisher_diagonal

WIDE = "model.layers.0.mlp.experts.1"  # its down_proj scaled by 8: the expert the plan must widen
NEVER = 3  # the expert the patched router never picks, in every layer
EXPERT_MATRICES = [f"model.layers.{layer}.mlp.experts.{e}.{m}.weight" for layer in range(2) for e in range(4)
                   for m in ("gate_proj", "up_proj", "down_proj")]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny qwen3_moe with layer 0's expert 1 scaled (module docstring), and a calibration text."""
    root = tmp_path_factory.mktemp("moe")
    tok = root / "tok"
    make_tokenizer(tok)
    (tok / "config.json").write_text(json.dumps({"vocab_size": 304}))  # helpers_archs reads the vocabulary here
    d = make_arch_model(root / "m", "qwen3_moe", tok)
    weights = load_file(str(d / "model.safetensors"))
    weights[f"{WIDE}.down_proj.weight"] *= 8
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    cal = root / "cal.txt"
    cal.write_text(TINY_TEXT * 20)
    return d, cal


def _never_expert_3(self, hidden_states):
    """qwen3_moe's router (transformers' ``Qwen3MoeTopKRouter.forward``) with expert 3's logit at -inf."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    logits[:, NEVER] = float("-inf")
    top, index = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


# int8 with one scale per row, or per group of 64 (1,536 bytes more on a 256 x 256 matrix): the fastest pair
# of the qkit format's candidates to quantize, so the test costs little. 8.0859375 bits per weight is 21 rows
# and 3 groups exactly.
OPTIONS = PlanOptions(format="qkit", target_bits=8.0859375, candidates=("int8-row", "int8-g64"), exclude=("*self_attn*",),
                      samples=1, seqlen=32, check_windows=1)


@pytest.fixture(scope="module")
def planned(moe, tmp_path_factory):
    """The plan of the experts alone (attention excluded), int8-row or int8-g64 (``OPTIONS``), with the patched router;
    its file and the model's table (kept: the loaded model the check restored)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    d, cal = moe
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    kept = planner.KeptMeasurements()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _never_expert_3)
        r = plan_model(str(d), options=dataclasses.replace(OPTIONS, calibration=str(cal)), output=out, kept=kept)
    (table,) = kept.tables.values()
    return r.plan, out, table


def test_an_expert_matrix_fisher_is_its_slice_of_the_fused_parameters_diagonal(moe):
    """The slices hold the file's tensors bit for bit; the walk's diagonal of each expert matrix is the
    whole-model Fisher of the fused parameter, sliced, bit for bit (the same operations: the walk checkpoints
    the blocks); and it is the Fisher of that matrix as an ``nn.Linear`` of its own (``unfused_experts``),
    whose gradient is its own parameter's: the same sums computed by other kernels (transformers' grouped_mm
    multiplies every expert's tokens in one call, gate and up together; the linears one product each), so
    equal to float32 rounding (measured 6e-7 of each diagonal's largest; allowed 1e-5)."""
    d, _ = moe
    ref = resolve(str(d))
    config = read_config(ref.directory)
    model = load(ref=ref).model
    views = expert_slices(model, config)
    assert sorted(views) == sorted(EXPERT_MATRICES)
    assert views[f"{WIDE}.up_proj.weight"] == ("model.layers.0.mlp.experts.gate_up_proj", (1, slice(256, 512)))
    params = dict(model.named_parameters())
    stored = load_file(str(d / "model.safetensors"))
    for name, (p, k) in views.items():
        assert torch.equal(params[p][k], stored[name]), name

    ids = torch.randint(0, 304, (1, 16), generator=torch.Generator().manual_seed(0))
    walked: dict[str, torch.Tensor] = {}
    walk = fisher_by_blocks(model, ids, EXPERT_MATRICES, walked.update, views=views, seed=1)
    fused = fisher_diagonal(model, ids, sorted({p for p, _ in views.values()}), seed=1)
    assert torch.equal(walk.labels, fused.labels)
    for name, (p, k) in views.items():
        assert walked[name].shape == stored[name].shape and bool(walked[name].any()), name
        assert torch.equal(walked[name], fused.diag[p][k]), name

    with unfused_experts(model, config):
        path = {id(m): n for n, m in model.named_modules()}
        own = {path[id(m)] + ".weight": s + ".weight" for s, m in linear_names(model).items() if ".experts." in s}
        alone = fisher_diagonal(model, ids, sorted(own), labels=walk.labels)
    assert sorted(own.values()) == sorted(EXPERT_MATRICES)
    for param, name in own.items():
        torch.testing.assert_close(alone.diag[param], walked[name], rtol=0, atol=1e-5 * float(walked[name].max()))


@pytest.mark.parametrize("arch, stored", [("mixtral", "block_sparse_moe.experts.{e}.{m}"),
                                          ("qwen2_moe", "mlp.experts.{e}.{m}")])
def test_each_expert_view_holds_its_file_tensor(arch, stored, tmp_path):
    """mixtral (stored as ``block_sparse_moe.experts.E.w1/w3/w2``) and qwen2_moe (beside its shared expert, a
    plain MLP): every expert matrix the file stores has a view, and the view holds it bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"mixtral": {"num_local_experts": 2},
             "qwen2_moe": {"num_experts": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                           "decoder_sparse_step": 1, "mlp_only_layers": []}}[arch]
    config = AutoConfig.for_model(arch, vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=1, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(str(tmp_path))
    model = load(ref=resolve(str(tmp_path))).model
    views = expert_slices(model, read_config(tmp_path))
    matrices = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert sorted(views) == sorted(f"model.layers.0.{stored.format(e=e, m=m)}.weight" for e in range(2) for m in matrices)
    params = dict(model.named_parameters())
    for name, w in load_file(str(tmp_path / "model.safetensors")).items():
        if name in views:
            p, k = views[name]
            assert torch.equal(params[p][k], w), name


def test_the_plan_prices_every_expert_and_meets_its_budget_exactly(planned):
    """Every expert matrix is planned (the router is not), each at the bytes its format stores for it; the
    budget is floor(8.0859375 bits x every expert weight / 8), which 21 int8-row and 3 int8-g64 matrices fill
    to the byte."""
    plan, _, _ = planned
    assert sorted(plan.tensors) == sorted(EXPERT_MATRICES)  # no router (mlp.gate), no attention (excluded)
    weights = 24 * 256 * 256
    assert plan.target["weights"] == plan.weights == weights
    assert plan.target["budget_bytes"] == math.floor(8.0859375 * weights / 8) == 1_589_760
    for name, t in plan.tensors.items():
        assert t.nbytes == stored_nbytes("qkit", t.scheme, (256, 256), torch.float32), name
    row, g64 = 256 * 256 + 256 * 2, 256 * 256 + 256 * 4 * 2  # int8 codes and fp16 scales: one per row, 4 per row
    assert all((t.candidates["int8-row"][0], t.candidates["int8-g64"][0]) == (row, g64) for t in plan.tensors.values())
    types = [t.type for t in plan.tensors.values()]
    assert types.count("int8-g64") == 3 and types.count("int8-row") == 21
    assert plan.nbytes == 21 * row + 3 * g64 == plan.target["budget_bytes"]


def test_the_expert_with_the_larger_fisher_gets_the_wider_type(planned):
    """Layer 0's expert 1 (down_proj x8) costs the most at int8-row, matrix by matrix, and its three matrices are
    the three the budget widens to int8-g64."""
    plan, _, _ = planned
    wide = {f"{WIDE}.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    assert {n for n, t in plan.tensors.items() if t.type == "int8-g64"} == wide
    at_row = {n: t.candidates["int8-row"][1] for n, t in plan.tensors.items()}
    assert min(at_row[n] for n in wide) > 10 * max(c for n, c in at_row.items() if n not in wide)


def test_an_expert_no_token_reaches_is_priced_zero_given_its_smallest_type_and_listed(planned):
    """Expert 3, which the router never picks, has a zero Fisher in both layers: every candidate of its six
    matrices costs 0, each gets int8-row (the smallest), and the plan lists the two experts with how they were
    priced; every other expert's matrices cost more than 0."""
    plan, out, _ = planned
    record = json.loads(out.read_text())["sensitivity"]["experts"]
    assert record["unreached"] == [f"model.layers.{layer}.mlp.experts.{NEVER}" for layer in range(2)]
    assert record["matrices"] == 24 and record["experts"] == 8
    assert record["unreached_priced"] == planner.UNREACHED
    for name, t in plan.tensors.items():
        if f".experts.{NEVER}." in name:
            assert t.type == "int8-row" and {c for _, c in t.candidates.values()} == {0.0}, name
        else:
            assert t.candidates["int8-row"][1] > 0, name


def test_the_check_puts_every_fused_parameter_back(moe, planned):
    """The check wrote the plan's codes into the fused parameters' slices (its measured KL is above 0) and
    restored them from the file: every expert matrix's slice equals the file's tensor again, bit for bit."""
    d, _ = moe
    plan, _, table = planned
    assert plan.check["measured_kl"] > 0 and sorted(table.views) == sorted(EXPERT_MATRICES)
    params = dict(table.model.named_parameters())
    for name, w in load_file(str(d / "model.safetensors")).items():
        p, k = table.views.get(name, (name, ()))
        assert torch.equal(params[p][k], w), name


def test_quantize_writes_the_plans_type_and_bytes_for_every_expert(moe, planned, tmp_path):
    """``quantize --plan``: every expert matrix in its planned type, stored in exactly the planned bytes."""
    d, _ = moe
    plan, out, _ = planned
    q = quantize_model(str(d), output=tmp_path / "q", options=QuantizeOptions(plan=str(out)))
    assert q.types == {n: t.type for n, t in plan.tensors.items()}
    stored: dict[str, int] = {}
    for f in (tmp_path / "q").glob("*.safetensors"):
        for key, t in load_file(str(f)).items():
            for name in plan.tensors:
                if key.startswith(name + "."):
                    stored[name] = stored.get(name, 0) + t.numel() * t.element_size()
    assert stored == {n: t.nbytes for n, t in plan.tensors.items()}


@pytest.mark.parametrize("options, words", [
    (dict(method="gptq"), "plan a mixture-of-experts model with --method rtn or imatrix"),
    (dict(format="compressed-tensors", candidates=()), "stores a mixture-of-experts model in one scheme"),
    (dict(format="gguf", candidates=()), "writes llama and qwen2 models"),
])
def test_a_plan_that_cannot_be_made_or_written_is_refused_in_one_line(moe, options, words):
    d, cal = moe
    with pytest.raises(QkitError, match=words) as e:
        plan_model(str(d), options=dataclasses.replace(OPTIONS, calibration=str(cal), **options))
    assert "\n" not in str(e.value)


def test_gpt_oss_is_refused_in_one_line():
    with pytest.raises(QkitError, match=r"qkit plan prices the experts of mixtral, qwen2_moe, qwen3_moe models only; "
                                        r"gpt_oss stores each layer's experts as 3-D tensors") as e:
        planner.check_experts(OPTIONS, {"model_type": "gpt_oss", "num_local_experts": 4})
    assert "\n" not in str(e.value)
