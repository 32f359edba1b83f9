"""``qkit eval`` end to end on a tiny model: one code path, self-agreement, checkpoint equivalence."""

from __future__ import annotations

import json

import pytest
import torch

from qkit.api import quantize_model
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.agreement import agreement, reference_continuation
from qkit.evaluation.battery import build_prompts, load_battery
from qkit.models import load

FAST = dict(tokens=128, battery_tokens=8)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from conftest import TINY_TEXT

    f = tmp_path_factory.mktemp("corpus") / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return str(f)


def test_reference_agrees_with_itself_on_all_144_positions(tiny_model_dir):
    loaded = load(tiny_model_dir, device="cpu")
    prompts = build_prompts(loaded.tokenizer, [q.question for q in load_battery()])
    cont = reference_continuation(loaded.model, loaded.tokenizer, prompts, 9)
    agree = agreement(loaded.model, cont)
    assert agree.shape == (16, 9)
    assert int(agree.sum()) == 144


def test_eval_rows_reference_first_and_identity_properties(tiny_model_dir, corpus_file):
    report = evaluate(tiny_model_dir, options=EvalOptions(schemes=("int8-row", "int4-tensor"), corpus=corpus_file, **FAST))
    names = [r.scheme for r in report.rows]
    assert names == ["reference", "int8-row", "int4-tensor"]
    ref, int8, int4 = report.rows
    assert ref.kld == 0.0 and ref.top1_match == 1.0 and ref.agreement == ref.agreement_total == 144
    assert ref.bits_per_weight == 32.0
    # a real quantization moves the distribution: KL strictly positive, larger for int4 per-tensor
    assert 0 < int8.kld < int4.kld
    assert int8.bits_per_weight == pytest.approx(8 + 16 / 64, abs=0.2)  # widths 64 and 160 in the tiny model
    assert int4.size_bytes < int8.size_bytes < ref.size_bytes
    d = report.to_dict()
    for key in ("scheme", "bits_per_weight", "size_bytes", "perplexity", "perplexity_se", "kld", "top1_match",
                "battery_correct", "battery_total", "agreement", "agreement_total"):
        assert key in d["rows"][0]
    assert d["provenance"]["corpus"]["sha256"] and d["provenance"]["torch_version"] == torch.__version__
    json.dumps(d)  # serialisable


def test_saved_checkpoint_evaluates_identically_to_the_in_memory_row(tiny_model_dir, corpus_file, tmp_path):
    opts = EvalOptions(schemes=("int4-g128",), corpus=corpus_file, **FAST)
    in_memory = evaluate(tiny_model_dir, options=opts).rows[1]
    ckpt = tmp_path / "ckpt"
    quantize_model(tiny_model_dir, output=ckpt, scheme="int4-g128")
    saved_report = evaluate(ckpt, options=EvalOptions(reference=str(tiny_model_dir), corpus=corpus_file, **FAST))
    saved = saved_report.rows[1]
    assert saved.scheme == "checkpoint (int4-g128)"
    for key in ("bits_per_weight", "size_bytes", "perplexity", "perplexity_se", "kld", "top1_match",
                "battery_answers", "battery_outputs", "agreement"):
        assert getattr(saved, key) == getattr(in_memory, key), key


def test_eval_restores_the_reference_weights(tiny_model_dir, corpus_file):
    # Two evaluations in a row give the same reference row: the swaps were undone.
    a = evaluate(tiny_model_dir, options=EvalOptions(schemes=("int4-tensor",), corpus=corpus_file, **FAST))
    b = evaluate(tiny_model_dir, options=EvalOptions(schemes=(), corpus=corpus_file, **FAST))
    assert a.rows[0].perplexity == b.rows[0].perplexity


def test_device_map_auto_gives_the_same_rows(tiny_model_dir, corpus_file):
    """--device-map auto (accelerate's dispatch) is the same computation: on a CPU-only machine every
    module lands on the CPU and the rows are identical to the plain path's."""
    opts = EvalOptions(schemes=("nf4",), corpus=corpus_file, **FAST)
    plain = evaluate(tiny_model_dir, options=opts).rows
    import dataclasses

    mapped = evaluate(tiny_model_dir, options=dataclasses.replace(opts, device_map="auto")).rows
    for a, b in zip(plain, mapped):
        assert (a.perplexity, a.kld, a.agreement, a.battery_answers) == (b.perplexity, b.kld, b.agreement, b.battery_answers)


def test_outliers_accept_a_device_map(tiny_model_dir):
    from qkit.inspect.outliers import residual_outliers

    a = residual_outliers(tiny_model_dir, prompt="The quick brown fox")
    b = residual_outliers(tiny_model_dir, prompt="The quick brown fox", device_map="auto")
    assert a.per_layer == b.per_layer


def test_no_battery_skips_the_answers_and_keeps_everything_else(tiny_model_dir, corpus_file, tmp_path):
    """--no-battery: no battery answers in any row (shown "-", the caption says so), the same perplexity,
    KL and agreement as with the battery, and no battery prompts in an engine's job."""
    from typer.testing import CliRunner

    from qkit.cli import app
    from qkit.evaluation.engines.scoring import build_job

    full = evaluate(tiny_model_dir, options=EvalOptions(schemes=("int8-row",), corpus=corpus_file, **FAST))
    lean = evaluate(tiny_model_dir, options=EvalOptions(schemes=("int8-row",), corpus=corpus_file, battery=False, **FAST))
    assert full.rows[1].battery_total == 16 and all(r.battery_total == 0 and r.battery_outputs == [] for r in lean.rows)
    for a, b in zip(full.rows, lean.rows):
        assert (a.perplexity, a.kld, a.agreement) == (b.perplexity, b.kld, b.agreement) and b.agreement_total == 144
    assert lean.provenance["battery"]["questions"] == 0
    out = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["eval", str(tiny_model_dir), "--no-battery", "--schemes", "int8-row", "--corpus", corpus_file,
                                 "--tokens", "128", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "battery: not run (--no-battery)" in " ".join(r.output.split())
    assert [json.loads(out.read_text())["rows"][i]["battery_total"] for i in (0, 1)] == [0, 0]

    loaded = load(tiny_model_dir, device="cpu")

    class Side:  # what build_job reads of the Reference
        tokenizer = loaded.tokenizer
        prompts = build_prompts(tokenizer, [q.question for q in load_battery()])
        corpus = type("C", (), {"windows": []})()
        continuation = reference_continuation(loaded.model, tokenizer, prompts, 2)
        repetition_penalty, battery_tokens = 1.0, 8

    Side.battery = []
    assert build_job(Side).battery_prompts == [] and len(build_job(Side).agreement_inputs) == 16
    Side.battery = load_battery()
    assert len(build_job(Side).battery_prompts) == 16
