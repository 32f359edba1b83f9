"""Row specs: names on the command line -> RowSpec values, refused before any model is loaded."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from helpers_eval import make_row

from qkit.errors import InputError
from qkit.evaluation import specs
from qkit.evaluation.notes import interpret
from qkit.evaluation.specs import RowSpec, register_preset, resolve_rows


def test_scheme_names_give_one_row_per_method_in_order():
    specs = resolve_rows(["int8-row", "nf4"], ["rtn"])
    assert [s.name for s in specs] == ["int8-row", "nf4"]
    assert [(s.scheme, s.method, s.simulation) for s in specs] == [("int8-row", "rtn", ()), ("nf4", "rtn", ())]


def test_duplicates_are_dropped_and_names_normalised():
    assert [s.name for s in resolve_rows([" NF4", "nf4", "int4-g64", "int4-g64"])] == ["nf4", "int4-g64"]


def test_spec_names_are_derived_from_their_parts():
    assert RowSpec("int4-g64").name == "int4-g64"
    assert RowSpec("int4-g64", "gptq").name == "int4-g64+gptq"
    assert RowSpec("int8-row", simulation=("act-int8-token",)).name == "int8-row+act-int8-token"
    assert RowSpec(None, simulation=("kv-int8-token",)).name == "fp+kv-int8-token"
    assert RowSpec("int8-row", label="w8a8").name == "w8a8"
    assert RowSpec(None, plan="gguf@q4_k_m").name == "plan:gguf@q4_k_m"
    assert RowSpec(None, "imatrix", plan="gguf@4.5").name == "plan:gguf@4.5+imatrix"
    assert RowSpec("int4-g64", "gptq").to_dict() == {
        "name": "int4-g64+gptq", "scheme": "int4-g64", "method": "gptq", "simulation": [],
        "method_options": {}, "simulation_options": {}, "plan": None, "file": None,
    }
    assert RowSpec(None, file="/peers/iters0/model-q4_k_m.gguf").name == "model-q4_k_m"  # resolve_rows labels it
    # "runtime" names only where a row runs (an engine, not part of the spec); a spec names its simulations
    spec = RowSpec("int8-row", simulation=("act-int8-token",))
    assert spec.simulation == ("act-int8-token",) and not hasattr(spec, "runtime")


@pytest.mark.parametrize(
    "names, methods, message",
    [
        (["int4-g12x"], ["rtn"], "unknown scheme 'int4-g12x'"),
        (["nf5"], ["rtn"], "unknown scheme 'nf5'; did you mean nf4? use one of: "),
        (["nf4"], ["rnt"], "unknown method 'rnt'; did you mean rtn? use one of: rtn, gptq"),
        (["nf4+nope"], ["rtn"], "unknown method 'nope'"),
    ],
)
def test_bad_names_are_refused_in_one_line(names, methods, message):
    with pytest.raises(InputError) as exc:
        resolve_rows(names, methods)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_presets_expand_and_an_unknown_member_is_refused_when_used(monkeypatch):
    monkeypatch.setattr(specs, "PRESETS", copy.deepcopy(specs.PRESETS))  # the test's presets do not outlive it
    register_preset("test-two-rows", ["int8-row", "int4-g64"])
    assert [s.name for s in resolve_rows(["test-two-rows", "nf4"])] == ["int8-row", "int4-g64", "nf4"]
    register_preset("test-broken", ["int8-row", "no-such-scheme"])
    with pytest.raises(InputError, match="no-such-scheme"):
        resolve_rows(["test-broken"])


def test_a_row_that_reproduces_the_reference_is_flagged_and_others_are_not():
    ref = make_row("reference", 17.0, 0.0, 0.0, None, matrices=0)
    same = make_row("q4_1", 17.0, 0.0, 0.0, 0)
    other = make_row("q4_0", 18.0, 5.0, 1.0, 14)
    notes = interpret([ref, same, other])
    flagged = [n for n in notes if "bit for bit" in n]
    assert len(flagged) == 1 and flagged[0].startswith("q4_1 reproduces the reference's weights")
    assert not any(n.startswith("q4_0 reproduces") for n in notes)
    # a simulation-only row (no quantized matrices) is never flagged
    kv = dataclasses.replace(make_row("kv-int8", 17.1, 0.5, 0.2, None, matrices=0))
    assert not any("bit for bit" in n for n in interpret([ref, kv]))


def test_ranking_names_the_bits_when_a_row_is_not_4_bit():
    ref = make_row("reference", 17.0, 0.0, 0.0, None, matrices=0)
    a, b = make_row("nf4", 21.5, 26.0, 2.0, 14), make_row("int4-g128", 27.7, 62.0, 4.0, 14)
    assert "4-bit rows from best to worst perplexity: nf4 (21.50) < int4-g128 (27.70)." in interpret([ref, b, a])
    mixed = dataclasses.replace(make_row("q4_k_m", 18.08, 6.0, 0.9, 14), bits_per_weight=5.534)
    notes = interpret([ref, b, a, mixed])
    assert not any(n.startswith("4-bit rows") for n in notes)
    assert ("rows below 6 bits per weight from best to worst perplexity (bits/w): q4_k_m (18.08, 5.53) < "
            "nf4 (21.50, 4.50) < int4-g128 (27.70, 4.50).") in notes


def test_a_calibrated_row_is_compared_with_its_rtn_row_per_token():
    """``compare_methods``: the paired KL and perplexity differences of SCHEME+METHOD against SCHEME on the same
    positions (hand-computed), and the note says whether the gain is beyond two paired SE."""
    import torch

    from qkit.evaluation.pairing import compare_methods
    from qkit.evaluation.token_scores import TokenScores
    from qkit.evaluation.specs import RowSpec

    kl_rtn = torch.tensor([0.10, 0.20, 0.30, 0.40], dtype=torch.float64)
    kl_im = kl_rtn - torch.tensor([0.05, 0.06, 0.05, 0.04], dtype=torch.float64)
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    top = torch.ones(4, dtype=torch.bool)
    scores = {"q4_k_m": TokenScores(nll, kl_rtn, top), "q4_k_m+imatrix": TokenScores(nll - 0.01, kl_im, top)}
    specs = [RowSpec("q4_k_m"), RowSpec("q4_k_m", "imatrix")]
    rows = [make_row("reference", 17.0, 0.0, 0.0, None, matrices=0), make_row("q4_k_m", 18.0, 5.0, 1.0, 14),
            make_row("q4_k_m+imatrix", 17.9, 4.0, 1.0, 14)]
    compare_methods(rows[1:], specs, scores)
    v = rows[2].versus
    d = torch.tensor([-0.05, -0.06, -0.05, -0.04], dtype=torch.float64)
    assert v["against"] == "q4_k_m" and abs(v["kld_change"] + 0.05) < 1e-12
    assert abs(v["kld_change_se"] - float(d.std() / 2)) < 1e-12  # sd / sqrt(4)
    assert abs(v["perplexity_change_pct"] - 100 * (math.exp(-0.01) - 1)) < 1e-9
    assert rows[1].versus == {}
    note = [n for n in interpret(rows) if n.startswith("q4_k_m+imatrix against q4_k_m")]
    assert len(note) == 1 and note[0].endswith("a real gain.")
    rows[2].versus = {**v, "kld_change_se": 0.5}
    assert any("not distinguishable" in n for n in interpret(rows))


def test_a_row_reproducing_some_tensors_is_qualified():
    """q5_1 with an importance matrix lands on the default model's Q4_1 grid: a row that reproduces some of its
    tensors bit for bit says so, and its gain over rtn is qualified."""
    ref = make_row("reference", 17.0, 0.0, 0.0, None, matrices=0)
    part = make_row("q5_k_s+imatrix", 17.1, 0.3, 0.1, 32, matrices=210)
    part.versus = {"against": "q5_k_s", "kld_change": -0.1, "kld_change_se": 0.002,
                   "perplexity_change_pct": -12.0, "perplexity_change_se_pct": 1.0}
    notes = interpret([ref, part])
    assert any(n.startswith("q5_k_s+imatrix reproduces 178 of its 210 quantized tensors bit for bit") for n in notes)
    assert any("a real gain, but 178 of its tensors reproduce" in n for n in notes)
    whole = make_row("q4_k_m", 18.0, 5.0, 1.0, 210, matrices=210)
    assert not any("reproduces" in n for n in interpret([ref, whole]))


def test_the_compressed_tensors_frontier_pairs_each_type_with_its_plan():
    from qkit.evaluation import EvalOptions
    from qkit.evaluation.specs import row_plan
    from qkit.plan.candidates import CT_TYPES

    rows = resolve_rows(("frontier-ct",))
    names = [r.name for r in rows]
    assert names[0::2] == ["int4-row", "int4-g128", "mxfp4", "int4-g64", "nvfp4", "int4-g32", "int8-row"]
    assert set(names[0::2]) == set(CT_TYPES)  # every type the format offers, none missing
    assert names[1::2] == [f"plan:ct@{n}" for n in names[0::2]]
    opts = EvalOptions(schemes=("frontier-ct",)).rows  # how a row is written: RowSettings
    assert [row_plan(r, opts).target_scheme for r in rows[1::2]] == names[0::2]
    assert {row_plan(r, opts).format for r in rows[1::2]} == {"compressed-tensors"}
