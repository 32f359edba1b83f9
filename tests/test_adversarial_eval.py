"""Adversarial ``qkit eval``: refusals before the reference row, no statistic without its error, no leftovers.

Each refusal: exit 2, one ``error:`` line, no traceback, nothing left behind, inputs unchanged, and the
reference model never loaded (``qkit.evaluation.runner.load`` is replaced by a function that fails the test).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adversarial import Unchanged, assert_refused, invoke, spawn_and_signal, tripwire
from conftest import TINY_TEXT, make_tiny_llama

FAST = ["--tokens", "64", "--agree-tokens", "1"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    """A calibration text sharing no run of 12 words with the corpus (nor with the pinned Ruth)."""
    f = tmp_path_factory.mktemp("calibration") / "cal.txt"
    f.write_text(" ".join(f"Seven green frogs sang song {i} beside a quiet river while owls watched the moon." for i in range(200)))
    return f


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the reference model is loaded (every refusal here must come before it)."""
    tripwire(monkeypatch, "qkit.evaluation.runner.load", "the reference model was loaded")


@pytest.fixture(scope="module")
def rtn_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    from qkit.api import quantize_model

    out = tmp_path_factory.mktemp("ckpt") / "int8"
    quantize_model(tiny_model_dir, output=out, scheme="int8-row")
    return out


def _refused(args, needles, inputs, dirs=()):
    with Unchanged(inputs=inputs, dirs=dirs):
        return assert_refused(invoke("eval", *map(str, args)), *needles)


# --------------------------------------------------------------------------- a standard error or a refusal


@pytest.mark.parametrize("extra, needles", [
    (["--tokens", "2"], ["--tokens must be at least 3", "got 2", "standard error"]),
    (["--tokens", "3", "--window", "2"], ["--tokens must be at least 4 with --window 2", "scores 1 position"]),
    (["--tokens", "1"], ["--tokens must be at least 3"]),
])
def test_too_few_tokens_for_a_standard_error_are_refused(tiny_model_dir, corpus, no_load, extra, needles):
    _refused([tiny_model_dir, "--corpus", corpus, *extra], needles, [tiny_model_dir, corpus])


def test_the_window_that_is_just_enough_passes_the_check():
    from qkit.evaluation.windows import check_scored, scored_positions, split_windows

    import torch

    for tokens in range(1, 12):  # the formula is what split_windows really scores
        for window in range(2, 6):
            windows = split_windows(torch.arange(tokens), window)
            assert scored_positions(tokens, window) == sum(w.numel() - 1 for w in windows), (tokens, window)
    check_scored(3, 3)
    check_scored(4, 2)
    check_scored(3, None)


def test_a_corpus_too_short_for_a_standard_error_is_refused_before_loading(tiny_model_dir, tmp_path, no_load):
    short = tmp_path / "short.txt"
    short.write_text("The")  # one token of the tiny tokenizer
    _refused([tiny_model_dir, "--corpus", short], ["the corpus short.txt has only 1 token", "standard error", "--corpus"],
             [tiny_model_dir, short], [tmp_path])


def test_the_window_is_checked_against_the_context_before_loading(tiny_model_dir, corpus, no_load):
    _refused([tiny_model_dir, "--corpus", corpus, "--window", "100000"],
             ["--window 100000 exceeds the model's maximum context 256", "--window 256"], [tiny_model_dir, corpus])


def test_an_unreadable_corpus_names_the_cause(tiny_model_dir, tmp_path, no_load, monkeypatch):
    f = tmp_path / "secret.txt"
    f.write_text(TINY_TEXT)
    f.chmod(0)
    if os.geteuid() == 0:  # root reads a mode-0 file: give the read the error the kernel gives everyone else
        import errno

        from qkit import reading  # every read of a user's file goes through it

        real = reading.read_text

        def read_text(path, *a, **k):
            if Path(path) == f:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(reading, "read_text", read_text)
    try:
        _refused([tiny_model_dir, "--corpus", f], ["cannot read corpus file", "permission denied"], [tiny_model_dir], [tmp_path])
    finally:
        f.chmod(0o644)


def test_a_corpus_that_fails_to_read_names_the_error(tiny_model_dir, no_load):
    # /proc/self/mem is a regular file whose read at offset 0 fails (EIO), even for root
    line = _refused([tiny_model_dir, "--corpus", "/proc/self/mem"], ["cannot read corpus file /proc/self/mem"], [tiny_model_dir])
    assert "does not exist" not in line


def test_a_directory_as_corpus_is_not_reported_missing(tiny_model_dir, tmp_path, no_load):
    line = _refused([tiny_model_dir, "--corpus", tmp_path], ["is not a file"], [tiny_model_dir], [tmp_path])
    assert "does not exist" not in line


# --------------------------------------------------------------------------- calibration refused before the reference row


def test_calibration_overlapping_the_eval_text_is_refused_before_loading(tiny_model_dir, corpus, no_load):
    # the eval's own corpus is the one compared (not only the pinned Ruth)
    _refused([tiny_model_dir, "--corpus", corpus, "--schemes", "int4-g32", "--methods", "gptq", "--calibration", corpus],
             ["overlaps the evaluation text text.txt"], [tiny_model_dir, corpus])


def test_a_missing_calibration_text_is_refused_before_loading(tiny_model_dir, corpus, tmp_path, no_load):
    _refused([tiny_model_dir, "--corpus", corpus, "--schemes", "int4-g32", "--methods", "awq",
              "--calibration", tmp_path / "nope.txt"], ["nope.txt", "does not exist"], [tiny_model_dir, corpus], [tmp_path])


def test_a_calibration_text_too_short_for_the_samples_is_refused_before_loading(tiny_model_dir, corpus, calibration, no_load):
    _refused([tiny_model_dir, "--corpus", corpus, "--schemes", "int4-g32", "--methods", "smoothquant",
              "--calibration", calibration, "--calibration-samples", "100000"], ["--calibration-samples"],
             [tiny_model_dir, corpus, calibration])


# --------------------------------------------------------------------------- a checkpoint against its reference


def _rewrite(checkpoint: Path, edit) -> None:
    """Rewrite the checkpoint's one weight file through ``edit(tensors)``, keeping its metadata (the manifest)."""
    path = checkpoint / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop("model.norm.weight"), ["missing model.norm.weight"]),
    (lambda t: t.update({"model.final_norm.weight": t.pop("model.norm.weight")}),
     ["missing model.norm.weight", "model.final_norm.weight"]),
    (lambda t: t.pop("model.layers.1.self_attn.q_proj.weight.scales"),
     ["lacks stored parts model.layers.1.self_attn.q_proj.weight.scales"]),
], ids=["deleted-norm", "renamed-norm", "deleted-part"])
def test_a_checkpoint_with_missing_or_renamed_tensors_is_refused_before_loading(
        tiny_model_dir, rtn_checkpoint, corpus, tmp_path, no_load, edit, needles):
    bad = _copy(rtn_checkpoint, tmp_path / "bad")
    _rewrite(bad, edit)
    _refused([bad, "--reference", tiny_model_dir, "--corpus", corpus], needles, [tiny_model_dir, bad, corpus], [tmp_path])


@pytest.mark.parametrize("other, needles", [
    (dict(hidden=32), ["shape of", "(reference ["]),
    (dict(layers=3), ["extra model.layers.2."]),
    (dict(layers=1), ["missing model.layers.1."]),
], ids=["narrower", "more-layers", "fewer-layers"])
def test_a_checkpoint_of_another_model_is_refused_from_the_headers(tiny_model_dir, corpus, tmp_path, no_load, other, needles):
    from qkit.api import quantize_model

    make_tiny_llama(tmp_path / "other", **other)
    ckpt = tmp_path / "ckpt"
    quantize_model(tmp_path / "other", output=ckpt, scheme="int8-row")
    line = _refused([ckpt, "--reference", tiny_model_dir, "--corpus", corpus], ["does not match the reference", *needles],
                    [tiny_model_dir, ckpt, corpus], [tmp_path])
    assert "--reference" in line


def test_a_checkpoint_as_reference_is_refused(rtn_checkpoint, corpus, no_load):
    _refused([rtn_checkpoint, "--reference", rtn_checkpoint, "--corpus", corpus], ["itself a qkit checkpoint"],
             [rtn_checkpoint, corpus])


# --------------------------------------------------------------------------- nothing non-finite is significant


def _row(name: str, **kw):
    from qkit.evaluation import Row

    base = dict(scheme=name, bits_per_weight=4.5, size_bytes=1, perplexity=10.0, perplexity_se=0.1,
                perplexity_change_pct=0.0, perplexity_change_se_pct=0.0, kld=0.0, kld_se=0.0, top1_match=1.0,
                battery_correct=8, battery_total=16, battery_ci95=(0.3, 0.7), battery_answers=[True] * 8 + [False] * 8,
                battery_outputs=[""] * 16, mcnemar_only_reference=0, mcnemar_only_row=0, mcnemar_p=1.0, agreement=10,
                agreement_total=16, agreement_ci95=(0.4, 0.8), seconds=0.0, matrices=0)
    return Row(**{**base, **kw})


def test_a_change_without_a_standard_error_is_never_a_real_difference():
    from qkit.evaluation.notes import interpret

    nan = float("nan")
    notes = interpret([_row("reference"), _row("int4", perplexity=12.0, perplexity_se=nan, perplexity_change_pct=20.0,
                                               perplexity_change_se_pct=nan)], scored_tokens=1)
    text = " ".join(notes)
    assert "int4: perplexity change +20.00% has no standard error on 1 scored tokens" in text
    assert "real difference" not in text and "indistinguishable" not in text
    assert "nan" not in text.lower()


def test_a_non_finite_perplexity_is_a_collapse_not_a_difference():
    from qkit.evaluation.notes import interpret

    nan = float("nan")
    notes = interpret([_row("reference"), _row("int2", perplexity=nan, perplexity_change_pct=nan, perplexity_change_se_pct=nan,
                                               kld=nan, agreement_total=0, agreement=0)])
    text = " ".join(notes)
    assert "int2 collapsed" in text and "not finite" in text
    assert "real difference" not in text and "4-bit rows" not in text


def test_the_table_never_prints_plus_minus_nan():
    from qkit.evaluation.measures import fmt_change as _fmt_change
    from qkit.evaluation.measures import fmt_estimate as _fmt_estimate

    nan, inf = float("nan"), float("inf")
    assert _fmt_estimate(12.3456, nan, 1) == "12.35 (no standard error on 1 token)"
    assert _fmt_estimate(inf, nan, 5) == "not finite"
    assert _fmt_estimate(12.3456, 0.5, 5) == "12.35 ± 0.50"
    assert _fmt_change(nan, nan) == "not finite"
    assert _fmt_change(3.0, nan) == "+3.0% (no SE)"
    assert _fmt_change(3.0, 0.25) == "+3.0% ± 0.2"


def test_the_json_report_has_null_not_nan():
    import json

    from qkit.evaluation import EvalReport

    nan = float("nan")
    d = EvalReport([_row("reference", bits_per_weight=nan), _row("int2", perplexity=float("inf"), kld_se=nan)],
                   {"window": 3}).to_dict()
    json.dumps(d, allow_nan=False)  # valid JSON
    assert d["rows"][0]["bits_per_weight"] is None and d["rows"][1]["perplexity"] is None and d["rows"][1]["kld_se"] is None
    assert d["rows"][1]["kld"] == 0.0 and d["rows"][1]["battery_ci95"] == [0.3, 0.7]


def test_a_huge_mean_nll_is_an_infinite_perplexity_not_an_overflow():
    import torch

    from qkit.evaluation.token_scores import TokenScores

    s = TokenScores(torch.full((4,), 1e4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool))
    assert s.perplexity == math.inf


def test_the_cli_table_on_the_fewest_tokens_has_finite_errors(tiny_model_dir, corpus):
    r = invoke("eval", tiny_model_dir, "--corpus", corpus, "--schemes", "int4-tensor", "--tokens", "3", "--agree-tokens", "1")
    assert r.code == 0, r.text
    assert "nan" not in r.text.lower() and "no standard error" not in r.text and "±" in r.stdout


# --------------------------------------------------------------------------- leftovers of killed evals


def _row_dirs(parent: Path) -> list[Path]:
    return sorted(parent.glob("qkit-eval-*"))


def _slow_row(corpus: Path, calibration: Path) -> list[str]:
    """An eval whose row checkpoint exists for about two seconds after its "quantizing" line (GPTQ over 16
    calibration windows), so a signal sent on that line lands while the directory is there."""
    return ["--corpus", str(corpus), "--schemes", "int4-g32", "--methods", "gptq", "--calibration", str(calibration),
            "--calibration-samples", "16", "--calibration-seqlen", "128", *FAST]


def test_a_sigkilled_eval_leaves_a_row_dir_that_the_next_eval_removes(tiny_model_dir, corpus, calibration, tmp_path,
                                                                      monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    killed = spawn_and_signal("eval", tiny_model_dir, *_slow_row(corpus, calibration),
                              sig=signal.SIGKILL, when="quantizing", env={"TMPDIR": str(tmp)}, timeout=120)
    assert killed.code == -signal.SIGKILL, killed.text
    left = _row_dirs(tmp)
    assert len(left) == 1 and left[0].name.startswith("qkit-eval-"), left
    # a live eval's directory (this process's PID) is never touched
    mine = tmp / f"qkit-eval-{os.getpid()}-abcdefgh"
    mine.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    again = invoke("eval", tiny_model_dir, "--corpus", corpus, "--schemes", "int8-row", *FAST)
    assert again.code == 0, again.text
    assert f"removed 1 temporary row checkpoint(s) left by killed evals: {left[0]}" in again.text
    assert _row_dirs(tmp) == [mine]


def test_an_interrupted_eval_removes_its_row_dir(tiny_model_dir, corpus, calibration, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = spawn_and_signal("eval", tiny_model_dir, *_slow_row(corpus, calibration),
                           sig=signal.SIGINT, when="quantizing", env={"TMPDIR": str(tmp)}, timeout=120)
    assert out.code == 130, out.text  # interrupted during the row (it did not finish)
    assert "Traceback" not in out.text
    assert _row_dirs(tmp) == []


def test_an_eval_failing_in_a_row_removes_its_row_dir(tiny_model_dir, corpus, tmp_path, monkeypatch):
    from qkit.errors import InputError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def fail(**_k):
        assert len(_row_dirs(tmp_path)) == 1  # it exists while the row is written
        raise InputError("the row failed")

    monkeypatch.setattr("qkit.evaluation.row_files.quantize_model", fail)
    r = invoke("eval", tiny_model_dir, "--corpus", corpus, "--schemes", "int8-row", *FAST)
    assert r.code == 2 and r.lines[-1] == "error: the row failed" and "Traceback" not in r.text, r.text
    assert _row_dirs(tmp_path) == []


def test_only_dead_writers_row_dirs_are_removed(tmp_path):
    from qkit.evaluation.runner import remove_stale_row_dirs

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"qkit-eval-{int(child.stdout)}-zz99_abc"
    alive = tmp_path / f"qkit-eval-{os.getpid()}-abcdefgh"
    other = tmp_path / "qkit-eval-notapid"
    for d in (dead, alive, other):
        d.mkdir()
    (dead / "row").mkdir()
    assert remove_stale_row_dirs(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()
