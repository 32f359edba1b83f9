"""For every registered method, ``qkit quantize`` + ``qkit eval CHECKPOINT --reference MODEL`` gives exactly the row
``qkit eval MODEL --schemes S --methods M`` computes in memory (issue 18: AWQ and SmoothQuant fold scales into
norms, which the checkpoint row used to take from the reference instead of the checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adversarial import invoke
from conftest import TINY_TEXT
from qkit.evaluation import EvalOptions, evaluate
from qkit.methods import RTN, method_names

SCHEME = "int4-g32"  # an absmax scheme: every method but the importance matrix (smoothquant included) serves it
SCHEMES = {"imatrix": "q4_0"}  # the importance matrix weights llama.cpp's block types only
CALIBRATION = (("calibration_samples", 4), ("calibration_seqlen", 32))
FAST = dict(tokens=96, battery_tokens=6, agree_tokens=2)
EXACT = ("bits_per_weight", "perplexity", "perplexity_se", "perplexity_change_pct", "perplexity_change_se_pct",
         "kld", "kld_se", "top1_match", "battery_correct", "battery_answers", "battery_outputs", "mcnemar_only_reference",
         "mcnemar_only_row", "mcnemar_p", "agreement", "agreement_total", "matrices")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> tuple[Path, Path]:
    """(eval corpus, calibration text): disjoint (no common run of 12 words), both short."""
    d = tmp_path_factory.mktemp("texts")
    corpus, cal = d / "corpus.txt", d / "cal.txt"
    corpus.write_text(TINY_TEXT * 3)
    cal.write_text(" ".join(f"Seven green frogs sang song {i} beside a quiet river while owls watched the moon." for i in range(60)))
    return corpus, cal


@pytest.mark.parametrize("method", method_names())
def test_a_saved_checkpoint_evaluates_to_exactly_its_in_memory_row(method, tiny_model_dir, texts, tmp_path):
    corpus, cal = texts
    scheme = SCHEMES.get(method, SCHEME)
    calibrated = method != RTN
    method_options = ((("calibration", str(cal)),) + CALIBRATION) if calibrated else ()
    in_memory = evaluate(tiny_model_dir, options=EvalOptions(
        schemes=(scheme,), methods=(method,), method_options=method_options, corpus=str(corpus), **FAST)).rows[1]

    ckpt = tmp_path / "ckpt"
    cli = ["quantize", tiny_model_dir, "-s", scheme, "--method", method, "-o", ckpt, "--device", "cpu"]
    if calibrated:
        cli += ["--calibration", cal, "--calibration-samples", "4", "--calibration-seqlen", "32"]
    r = invoke(*cli)
    assert r.code == 0, r.text
    saved = evaluate(ckpt, options=EvalOptions(reference=str(tiny_model_dir), corpus=str(corpus), **FAST)).rows[1]

    assert saved.scheme == f"checkpoint ({scheme})"
    for key in EXACT:
        assert getattr(saved, key) == getattr(in_memory, key), key
    if not calibrated:  # a calibrated method's manifest records its timings: a few bytes may differ
        assert saved.size_bytes == in_memory.size_bytes
    # both rows used the same calibration tokens (the row records them: text sha256 and the chosen ids)
    assert saved.method_record.get("name") == in_memory.method_record.get("name") == (method if calibrated else None)
    assert saved.method_record.get("calibration") == in_memory.method_record.get("calibration")
    if calibrated:
        assert saved.method_record["calibration"]["source"] == str(cal.resolve())
        assert saved.method_record["calibration"]["ids_sha256"]
