"""GPTQ's held-out windows (``GPTQOptions.holdout``): windows kept out of the Hessian, on which each tensor's
GPTQ codes and RTN's are compared by output error; the better is written, and a tensor written by RTN is
named in the record and counted on screen."""

from __future__ import annotations

import json

import pytest
import torch
from adversarial import assert_refused, invoke

from qkit.errors import InputError
from qkit.methods.gptq.method import GPTQOptions, HessianInputs


def test_the_held_out_windows_are_spread_over_the_text():
    assert GPTQOptions(calibration_samples=32, holdout=4).held_out().nonzero().flatten().tolist() == [4, 12, 20, 28]
    assert GPTQOptions(calibration_samples=8, holdout=1).held_out().nonzero().flatten().tolist() == [4]
    assert GPTQOptions(calibration_samples=5, holdout=4).held_out().sum() == 4


@pytest.mark.parametrize("holdout", [-1, 8, 9, 1.5, True])
def test_a_holdout_that_leaves_no_window_for_the_hessian_is_refused(holdout):
    with pytest.raises(InputError, match="--holdout"):
        GPTQOptions(calibration_samples=8, holdout=holdout)


@pytest.mark.parametrize("batches", [[6], [2, 2, 2], [1, 4, 1]])
def test_the_hessian_holds_only_the_fitted_windows_and_the_held_gram_only_the_held_ones(batches):
    """Against the float64 Gram of exactly the windows of each kind, whatever the batches."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 12, generator=g)
    mask = torch.tensor([False, True, False, False, True, False])
    acc = HessianInputs("b.", mask)
    start = 0
    for b in batches:
        acc.add("q", x[start : start + b].clone())  # a new tensor per batch, as a forward pass gives
        start += b
    fit = x[~mask].reshape(-1, 12).double()
    held = x[mask].reshape(-1, 12).double()
    torch.testing.assert_close(acc.gram("q").double(), fit.T @ fit, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(acc.held("q").double(), held.T @ held, rtol=1e-5, atol=1e-4)
    assert acc.tokens["q"] == 4 * 5


def test_without_holdout_nothing_is_held():
    acc = HessianInputs("b.")
    acc.add("q", torch.randn(3, 4, 8))
    assert acc.held("q") is None and acc.tokens["q"] == 12


def test_gptq_writes_rtn_codes_where_they_win_on_the_held_out_windows(wide_model, tmp_path, monkeypatch):
    """One tensor whose held-out comparison RTN wins (forced here) is written with RTN's codes, bit for bit
    ``quantize_tensor``'s; the record names it with both errors, the summary counts it."""
    from conftest import TINY_TEXT

    import qkit.methods.gptq.method as gm
    from qkit.checkpoint import iter_quantized, iter_tensors
    from qkit.schemes import get_scheme, quantize_tensor

    cal = tmp_path / "cal.txt"
    cal.write_text(TINY_TEXT * 40)
    real, calls = gm.output_errors, []

    def rtn_wins_once(W, W_hats, XtX):
        out = real(W, W_hats, XtX)
        calls.append(1)
        return [out[1] * 2, out[1]] if len(calls) == 1 else out  # the first call compares on the held-out Gram

    monkeypatch.setattr(gm, "output_errors", rtn_wins_once)
    out = tmp_path / "q"
    r = invoke("quantize", wide_model, "-s", "q4_k", "--method", "gptq", "--calibration", cal, "--calibration-samples",
               "6", "--calibration-seqlen", "64", "--holdout", "2", "-o", out, "--json", tmp_path / "r.json")
    assert r.code == 0, r.text
    assert "written by rtn instead" in r.text and "rtn (lower output error on the held-out windows): 1" in r.text
    record = json.loads((tmp_path / "r.json").read_text())["method_record"]
    first = "model.layers.0.self_attn.q_proj.weight"
    assert record["rtn_fallback"] == [first]
    layer = record["layers"][first]
    assert layer["rtn_error_held_out"] < layer["gptq_error_held_out"]
    assert record["options"]["holdout"] == 2
    source = dict(iter_tensors(wide_model))[first]
    written = dict(iter_quantized(out))[first]
    assert torch.equal(written.qweight, quantize_tensor(source.float(), get_scheme("q4_k")).qweight)


def test_holdout_is_a_gptq_option_only(tiny_model_dir, tmp_path):
    assert_refused(invoke("quantize", tiny_model_dir, "-s", "int4-g32", "--method", "awq", "--holdout", "2",
                          "-o", tmp_path / "q"), "holdout")
    assert_refused(invoke("quantize", tiny_model_dir, "-s", "int4-g32", "--holdout", "2", "-o", tmp_path / "q"),
                   "holdout", "calibrated --method")
