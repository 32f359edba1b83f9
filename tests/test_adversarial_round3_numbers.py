"""Issue 48, round 3: inputs that pass every check and still destroy the output (classes 1, 3 and 5).

- Class 1: a written tensor that decodes to garbage (all zeros, a constant, NaN, a relative error of 1 or
  more) refuses the run before anything is renamed into place, whatever made it: an importance matrix of
  zeros, of 3e38s or of denormals, fractional token counts, weights below what a scale resolves. The model's
  activations overflowing fp16 refuse imatrix, gptq, plan and eval instead of writing NaN statistics. A
  mixture-of-experts model is refused by the calibrated methods that do not route tokens to its experts, never
  written by RTN under their name, and a GPTQ fallback is counted on screen and in the record.
- Class 3: the calibration window's default is fitted to the model's context and checked like a given one.
- Class 5: a budget above the largest mix of the allowed candidates is planned, not refused with a false reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from adversarial import Unchanged, assert_refused, invoke
from conftest import make_tiny_llama, make_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from qkit.checkpoint import tensor_shapes
from qkit.errors import DegenerateOutputError, QkitError
from qkit.methods.imatrix.file import Imatrix, ImatrixEntry, write_gguf
from qkit.methods.imatrix.names import gguf_names
from qkit.models import read_config
from qkit.schemes import Recipe, get_scheme, quantize_tensor, scheme_names
from qkit.schemes.fidelity import check_written

CAL_WORDS = ("river stone lantern orchard copper meadow whistle harbor velvet signal pocket thunder ladder "
             "garden marble falcon winter candle bridge feather").split()


def calibration_text(path: Path, words: int = 6000) -> Path:
    """A text of common words in a fixed pseudo-random order: long enough for a few windows of 256 tokens,
    sharing no 12-word run with the eval text (KJV Ruth)."""
    rng = np.random.default_rng(5)
    path.write_text(" ".join(CAL_WORDS[i] for i in rng.integers(0, len(CAL_WORDS), words)) + ".\n")
    return path


@pytest.fixture(scope="module")
def cal(tmp_path_factory) -> Path:
    return calibration_text(tmp_path_factory.mktemp("cal") / "cal.txt")


# --------------------------------------------------------------------------- class 1: hostile importance matrices


def write_matrix(model: Path, path: Path, kind: str) -> Path:
    """An importance matrix with the right names and widths for ``model``'s projections, whose values are
    ``kind``: a plausible one (``sane``) or one that passes every check of the file itself."""
    shapes = dict(tensor_shapes(model))
    names = gguf_names(read_config(model), [n for n in shapes if n.endswith("proj.weight")])
    rng = np.random.default_rng(0)
    entries = {}
    for hf, g in names.items():
        cols = shapes[hf][-1]
        sums = (rng.random((1, cols)) * 64 + 1).astype(np.float32)  # mean squares about 1 over 64 tokens
        counts = np.array([64.0], dtype=np.float32)
        if kind == "zero":
            sums[:] = 0
        elif kind == "huge":
            sums[:] = 3e38
        elif kind == "alternate":
            sums[:, ::2] = 3e38
        elif kind == "denormal":
            sums[:] = 1e-45
        elif kind == "fraction":
            counts[:] = 0.4
        entries[g] = ImatrixEntry(sums, counts)
    write_gguf(Imatrix(entries, chunk_count=1, chunk_size=64, datasets=["synthetic"]), path)
    return path


@pytest.mark.parametrize("kind,needle", [("zero", "all zero"), ("huge", "outside"), ("alternate", "outside"),
                                         ("denormal", "all zero"), ("fraction", "not a whole number")])
def test_a_hostile_importance_matrix_is_refused_before_anything_is_written(wide_model, tmp_path, kind, needle):
    """Every one of these wrote a q4_k_m file whose block tensors all decode to 0 (fractional counts: weighted
    as if absent), with exit 0 and "14 tensors weighted" on screen."""
    bad = write_matrix(wide_model, tmp_path / f"{kind}.gguf", kind)
    with Unchanged(inputs=[wide_model, bad], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", wide_model, "-s", "q4_k_m", "--format", "gguf", "--imatrix", bad,
                                     "-o", tmp_path / "out.gguf"), needle)
    assert "blk." in line or "whole number" in line


@pytest.mark.parametrize("scheme", ["q4_0", "iq4_xs", "q2_k", "q3_k_m", "q6_k"])
def test_a_matrix_of_zeros_is_refused_for_every_weighted_type(wide_model, tmp_path, scheme):
    bad = write_matrix(wide_model, tmp_path / "zero.gguf", "zero")
    with Unchanged(inputs=[wide_model, bad], dirs=[tmp_path]):
        assert_refused(invoke("quantize", wide_model, "-s", scheme, "--format", "gguf", "--imatrix", bad,
                              "-o", tmp_path / "out.gguf"), "all zero")


def test_a_matrix_of_zeros_is_refused_with_gptq_before_calibrating(wide_model, tmp_path, cal):
    bad = write_matrix(wide_model, tmp_path / "zero.gguf", "zero")
    with Unchanged(inputs=[wide_model, bad], dirs=[tmp_path]):
        assert_refused(invoke("quantize", wide_model, "-s", "q4_k_m", "--format", "gguf", "--imatrix", bad,
                              "--method", "gptq", "--calibration", cal, "-o", tmp_path / "out.gguf"), "all zero")


def test_a_sane_matrix_of_the_same_shape_writes_a_file_whose_tensors_all_carry_their_weights(wide_model, tmp_path):
    """The control: the same names and widths with plausible values write, and no tensor decodes to zeros."""
    import gguf
    from gguf.quants import dequantize

    good = write_matrix(wide_model, tmp_path / "sane.gguf", "sane")
    out = tmp_path / "out.gguf"
    r = invoke("quantize", wide_model, "-s", "q4_k_m", "--format", "gguf", "--imatrix", good, "-o", out)
    assert r.code == 0, r.text
    blocks = [t for t in gguf.GGUFReader(str(out)).tensors if t.name.startswith("blk.") and t.name.endswith(".weight")
              and "norm" not in t.name]
    assert len(blocks) == 14
    assert all(np.abs(dequantize(t.data, t.tensor_type)).max() > 0 for t in blocks)


# --------------------------------------------------------------------------- class 1: written tensors checked


@pytest.fixture(scope="module")
def tiny_weights_model(tmp_path_factory) -> Path:
    """``make_llama``'s shape with one projection scaled to 1e-30: finite, non-zero, below what the schemes
    resolve (q4_0's fp16 block scale, int4's fp16 group scale, nf4's normalised codes), so they write it as zeros."""
    d = tmp_path_factory.mktemp("tiny-weights") / "m"
    make_tiny_llama(d, hidden=128, intermediate=256)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"] = sd["model.layers.1.mlp.down_proj.weight"] * 1e-30
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("fmt,scheme,out", [("qkit", "q4_0", "q"), ("gguf", "q4_0", "q.gguf"), ("qkit", "int4-g64", "q"),
                                            ("compressed-tensors", "int4-g64", "ct"), ("bitsandbytes", "nf4", "bnb")])
def test_a_tensor_that_decodes_to_zeros_refuses_the_run_and_writes_nothing(tiny_weights_model, tmp_path, fmt, scheme, out):
    with Unchanged(inputs=[tiny_weights_model], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", tiny_weights_model, "-s", scheme, "--format", fmt, "-o", tmp_path / out),
                              "model.layers.1.mlp.down_proj.weight", "decode to all zeros", "nothing was written")
    assert "max |w| = 8e-32" in line  # the likely cause names the weights' size


HOSTILE = ["zeros", "normal", "tiny", "denormal", "huge_column", "fp16_overflow", "constant", "one_nonzero", "sparse"]


def hostile_matrix(kind: str, scale_exp: int, seed: int, rows: int = 4, cols: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if kind == "zeros":
        return torch.zeros(rows, cols)
    if kind == "normal":
        return x * 10.0 ** scale_exp
    if kind == "tiny":
        return x * 1e-30
    if kind == "denormal":
        return torch.full((rows, cols), 1e-45) * torch.sign(x)
    if kind == "huge_column":
        x[:, 7] = 1e30
        return x
    if kind == "fp16_overflow":
        return x * 7e4
    if kind == "constant":
        return torch.full((rows, cols), 0.37)
    if kind == "one_nonzero":
        out = torch.zeros(rows, cols)
        out[1, 3] = 2.5
        return out
    return torch.where(torch.rand(rows, cols, generator=g) < 0.9, 0.0, x)


PLAIN = [n for n in scheme_names() if not isinstance(get_scheme(n), Recipe)]


def check_one(scheme: str, kind: str, scale_exp: int, seed: int) -> None:
    """A quantized tensor the check accepts has, computed here independently in float64 from its decoded
    values, a relative error below 1 and no NaN; one it refuses is degenerate by the same computation
    (zeros, constant, non-finite, or a relative error of 1 or more)."""
    w = hostile_matrix(kind, scale_exp, seed)
    try:
        qt = quantize_tensor(w, get_scheme(scheme), name="w")
    except QkitError:  # refused by the quantizer itself (a scale that overflows its dtype): nothing written
        return
    d = qt.dequantize(torch.float32).double()
    ref = w.double()
    den = float(ref.square().sum())
    finite = bool(torch.isfinite(d).all())
    rel = math.sqrt(float((d - ref).square().sum()) / den) if den > 0 and finite else (0.0 if den == 0 else math.inf)
    zeros = finite and den > 0 and float(d.abs().max()) == 0.0
    constant = finite and float(d.max()) == float(d.min()) and float(ref.max()) != float(ref.min())
    degenerate = (not finite) or zeros or constant or rel >= 1 or (den == 0 and float(d.abs().max()) > 0)
    try:
        got = check_written("w", w, qt)
    except DegenerateOutputError:
        assert degenerate, (scheme, kind, scale_exp, rel)
        return
    assert not degenerate, (scheme, kind, scale_exp, rel)
    assert got < 1 and abs(got - rel) <= 1e-9 + 1e-5 * rel, (scheme, kind, scale_exp, got, rel)


@pytest.mark.parametrize("scheme", PLAIN)
def test_every_scheme_on_every_hostile_matrix_writes_relative_error_below_1_or_refuses(scheme):
    """Every registered scheme x every hostile kind x three scales (the check's own arithmetic in float32
    pieces must agree with float64 from 1e-45 to 3e38)."""
    for kind in HOSTILE:
        for scale_exp in (-30, 0, 30):
            check_one(scheme, kind, scale_exp, seed=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(scheme=st.sampled_from(PLAIN), kind=st.sampled_from(HOSTILE), scale_exp=st.integers(-38, 38),
       seed=st.integers(0, 2**16))
def test_every_scheme_on_hostile_matrices_writes_relative_error_below_1_or_refuses(scheme, kind, scale_exp, seed):
    check_one(scheme, kind, scale_exp, seed)


def test_rtn_of_the_default_model_stays_far_below_the_limit_for_every_scheme(default_model_dir):
    """No real model's ordinary quantization is refused: on every 21st projection of the default model (10,
    layer 28's down_proj among them, the worst of every 7th for int4-tensor) each scheme's relative error
    stays below 1 (int4-tensor, the coarsest, at 0.93)."""
    from qkit.checkpoint import iter_tensors

    weights = [(n, t) for n, t in iter_tensors(default_model_dir) if n.endswith("proj.weight")][::21]
    assert "model.layers.28.mlp.down_proj.weight" in dict(weights)
    def rtn(n, t, s):  # iq2_xxs, iq2_xs, iq1_s: llama.cpp asserts an importance vector; a flat one here
        flat = torch.ones(t.shape[-1]) if getattr(get_scheme(s), "requires_importance", False) else None
        return quantize_tensor(t, get_scheme(s), name=n, quant_weights=flat)

    worst = {s: max(check_written(n, t, rtn(n, t, s)) for n, t in weights) for s in PLAIN}
    assert max(worst.values()) < 0.95, worst
    assert worst["int4-tensor"] > 0.9 and worst["q4_k"] < 0.03  # the coarsest and a fine scheme, as documented


# --------------------------------------------------------------------------- class 1: activations that overflow fp16


@pytest.fixture(scope="module")
def overflow_model(tmp_path_factory) -> Path:
    """A tiny llama whose MLP outputs reach about 1e5 in its residual stream: finite in fp32 and bf16 (their
    exponent range), infinite in fp16 (largest finite value 65504). Checked here, so the tests below test
    what they say."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("overflow") / "m"
    make_tiny_llama(d, hidden=128, intermediate=256)
    sd = load_file(d / "model.safetensors")
    for k in sd:
        if k.endswith(("up_proj.weight", "down_proj.weight")):
            sd[k] = sd[k] * 2500.0
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    ids = torch.arange(1, 33)[None]
    for dtype, finite in ((torch.float32, True), (torch.bfloat16, True), (torch.float16, False)):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
        with torch.no_grad():
            hidden = m(ids, output_hidden_states=True).hidden_states[1]
        assert bool(torch.isfinite(hidden).all()) == finite, (dtype, hidden.abs().max())
    return d


def test_imatrix_in_fp16_of_an_overflowing_model_is_refused_and_bf16_is_written(overflow_model, tmp_path, cal):
    """It wrote a matrix with NaN in most entries, exit 0."""
    args = ("imatrix", overflow_model, "--calibration", cal, "--chunks", "2", "-c", "64")
    with Unchanged(inputs=[overflow_model], dirs=[tmp_path]):
        assert_refused(invoke(*args, "--dtype", "fp16", "-o", tmp_path / "m.gguf"), "overflow fp16", "--dtype bf16")
    assert invoke(*args, "--dtype", "bf16", "-o", tmp_path / "m.gguf").code == 0


def test_gptq_in_fp16_of_an_overflowing_model_is_refused(overflow_model, tmp_path, cal):
    """It fell back to RTN on most matrices while the summary said gptq, and the record said nothing."""
    with Unchanged(inputs=[overflow_model], dirs=[tmp_path]):
        assert_refused(invoke("quantize", overflow_model, "-s", "int4-g64", "--method", "gptq", "--dtype", "fp16",
                              "--calibration", cal, "--calibration-samples", "2", "--calibration-seqlen", "64",
                              "-o", tmp_path / "q"), "overflow fp16")


def test_plan_in_fp16_of_an_overflowing_model_is_refused_not_a_traceback(overflow_model, tmp_path, cal):
    """It ended in torch.multinomial's traceback on NaN probabilities."""
    with Unchanged(inputs=[overflow_model], dirs=[tmp_path]):
        assert_refused(invoke("plan", overflow_model, "--target-bits", "4.5", "--dtype", "fp16", "--calibration", cal,
                              "--calibration-samples", "2", "--calibration-seqlen", "64", "-o", tmp_path / "p.json"),
                       "log-probabilities", "overflow fp16")


def test_eval_in_fp16_against_a_non_finite_reference_is_refused_never_100_percent(overflow_model, tmp_path, cal):
    """It printed top-1 100% and agreement 144/144 against a reference whose perplexity was not finite."""
    r = invoke("eval", overflow_model, "--dtype", "fp16", "--schemes", "int8-row", "--corpus", cal, "--tokens", "128",
               "--window", "64", "--no-battery", "--json", tmp_path / "e.json")
    assert r.code == 2 and "Traceback" not in r.text, r.text
    assert r.lines[-1].startswith("error: the reference's log-probabilities") and "overflow fp16" in r.lines[-1]
    assert not (tmp_path / "e.json").exists()


def test_a_row_with_nan_log_probabilities_has_no_top1():
    from qkit.evaluation.token_scores import TokenScores

    nll = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    scores = TokenScores(nll, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool), measurable=False)
    assert math.isnan(scores.top1_match)
    assert TokenScores(nll, torch.zeros(3), torch.tensor([True, False, True])).top1_match == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- class 1: MoE, fallbacks


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    d = tmp_path_factory.mktemp("moe") / "m"
    cfg = Qwen3MoeConfig(vocab_size=304, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    make_tokenizer(d)
    return d


def test_a_mixture_of_experts_model_is_refused_by_the_methods_that_do_not_route(moe_model, tmp_path, cal):
    """gptq exited 0 with the experts written by RTN under its name, and nothing said so. It now calibrates each
    expert on the tokens routed to it (tests/test_moe_calibration.py), as awq does (tests/test_moe_awq.py);
    smoothquant, which does not, is refused."""
    with Unchanged(inputs=[moe_model], dirs=[tmp_path]):
        assert_refused(invoke("quantize", moe_model, "-s", "int8-row", "--method", "smoothquant", "--calibration", cal,
                              "-o", tmp_path / "q"), "mixture-of-experts", "4 experts", "--method gptq")


def test_rtn_quantizes_every_expert(moe_model, tmp_path):
    out = tmp_path / "q"
    r = invoke("quantize", moe_model, "-s", "int4-g16", "-o", out, "--json", tmp_path / "r.json")
    assert r.code == 0, r.text
    types = json.loads((tmp_path / "r.json").read_text())["types"]
    assert sum(".experts." in n for n in types) == 2 * 4 * 3


def test_a_gptq_fallback_is_counted_on_screen_and_in_the_record(wide_model, tmp_path, cal, monkeypatch):
    """A layer whose Hessian never became positive definite is written by RTN: the summary counts it and the
    record's rtn_fallback names it (it was empty)."""
    import dataclasses

    import qkit.methods.gptq.method as gm

    real, calls = gm.gptq_solve, []

    def first_falls_back(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        return dataclasses.replace(out, fallback=True) if len(calls) == 1 else out

    monkeypatch.setattr(gm, "gptq_solve", first_falls_back)
    r = invoke("quantize", wide_model, "-s", "int4-g64", "--method", "gptq", "--calibration", cal,
               "--calibration-samples", "2", "--calibration-seqlen", "64", "-o", tmp_path / "q", "--json", tmp_path / "r.json")
    assert r.code == 0, r.text
    assert "written by rtn instead" in r.text and "1 of 14 matrices (rtn (H not positive definite): 1)" in r.text
    record = json.loads((tmp_path / "r.json").read_text())["method_record"]
    assert record["rtn_fallback"] == ["model.layers.0.self_attn.q_proj.weight"]
    assert record["rtn_fallback_reasons"] == {"model.layers.0.self_attn.q_proj.weight": "rtn (H not positive definite)"}


# --------------------------------------------------------------------------- class 3: a default is checked


def test_the_default_calibration_window_fits_a_short_context(tiny_model_dir, tmp_path, cal):
    """On a 256-token model the default 512 ran past the context (511 was refused, 512 was not checked)."""
    r = invoke("quantize", tiny_model_dir, "-s", "int4-g32", "--method", "gptq", "--calibration", cal,
               "--calibration-samples", "2", "-o", tmp_path / "q", "--json", tmp_path / "r.json")
    assert r.code == 0, r.text
    assert json.loads((tmp_path / "r.json").read_text())["method_record"]["calibration"]["seqlen"] == 256
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        assert_refused(invoke("quantize", tiny_model_dir, "-s", "int4-g32", "--method", "gptq", "--calibration", cal,
                              "--calibration-seqlen", "512", "-o", tmp_path / "q2"), "exceeds the model's maximum context 256")


def test_the_plans_default_window_and_check_windows_fit_the_model_and_the_samples(tiny_model_dir, tmp_path, cal):
    """plan's default 512 ran past a 256 context; --calibration-samples 2 was refused by the default
    --check-windows 4."""
    r = invoke("plan", tiny_model_dir, "--target-bits", "5", "--calibration", cal, "--calibration-samples", "2",
               "-o", tmp_path / "p.json")
    assert r.code == 0, r.text
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["sensitivity"]["calibration"]["seqlen"] == 256
    assert plan["check"]["windows"] == 2 if "windows" in plan.get("check", {}) else True


# --------------------------------------------------------------------------- class 5: a true statement, or a plan


def test_a_budget_above_the_largest_allowed_mix_is_planned(wide_model, tmp_path, cal):
    """--target-bits 7 with q4_k,q6_k was refused as "above the unquantized size", naming the all-q6_k bytes."""
    r = invoke("plan", wide_model, "--target-bits", "7", "--candidates", "q4_k,q6_k", "--calibration", cal,
               "--calibration-samples", "2", "--calibration-seqlen", "64", "-o", tmp_path / "p.json")
    assert r.code == 0, r.text
    plan = json.loads((tmp_path / "p.json").read_text())
    types = {t["type"] for t in plan["tensors"].values()}
    assert types <= {"q4_k", "q6_k"}
    largest = sum(max(b for b, _ in t["candidates"].values()) for t in plan["tensors"].values())
    assert plan["target"]["budget_bytes"] == largest


def test_a_budget_above_the_unquantized_size_is_refused_truthfully(wide_model, tmp_path, cal):
    with Unchanged(inputs=[wide_model], dirs=[tmp_path]):
        assert_refused(invoke("plan", wide_model, "--target-bits", "40", "--candidates", "q4_k,none", "--calibration", cal,
                              "--calibration-samples", "2", "--calibration-seqlen", "64", "-o", tmp_path / "p.json"),
                       "above the unquantized size")


# --------------------------------------------------------------------------- minor items


def test_an_importance_matrix_of_another_model_is_noted(wide_model, tmp_path):
    """A matrix whose own record names another model was taken without a word."""
    m = write_matrix(wide_model, tmp_path / "m.gguf", "sane")
    from qkit.methods.imatrix.file import read

    matrix = read(m)
    matrix.record = {"model": "some/other-model", "model_fingerprint": "0" * 64}
    write_gguf(matrix, tmp_path / "other.gguf")
    r = invoke("quantize", wide_model, "-s", "q4_k", "--format", "gguf", "--imatrix", tmp_path / "other.gguf",
               "-o", tmp_path / "q.gguf")
    assert r.code == 0, r.text
    assert "warning: the importance matrix" in r.text and "some/other-model" in r.text


def test_an_importance_matrix_given_as_a_file_row_is_named_for_what_it_is(wide_model, tmp_path, cal):
    """It was called "a GGUF of a None model"."""
    m = write_matrix(wide_model, tmp_path / "m.gguf", "sane")
    r = invoke("eval", wide_model, "--schemes", f"file:{m}", "--corpus", cal, "--tokens", "64", "--window", "32",
               "--no-battery")
    line = assert_refused(r, "general.type 'imatrix'", "--imatrix")
    assert "None" not in line
