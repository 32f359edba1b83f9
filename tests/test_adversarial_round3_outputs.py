"""Adversarial outputs and inputs, round 3 (issue 48, classes 2 and 6 and three minor items).

* **One output replacing another** (class 2): every command checks all its outputs against each other
  (the same path by device and inode or by spelling, one inside the other) and against its inputs, before
  any work; every output is claimed for the run (``qkit.claims``: a ``.NAME.qkit-claim`` file beside it,
  locked by its writer), so a second run on the same output refuses in one line naming the first run's
  process, while a dead run's claim is removed. Two real ``qkit imatrix -o m.gguf`` processes, and a claim
  held by a live process on every command's every output.
* **Hangs** (class 6): a FIFO, a socket, a character device, a directory or a symbolic-link loop where a
  file is read (``--imatrix``, ``--plan``, ``--tensor-type-file``, ``plan:`` and ``file:`` rows, ``qkit
  report`` inputs, ``--calibration``, ``--corpus``, ``--config``, ``--from``, ``--lengths``, ``--bench``,
  the model's own files) or written (``-o``, ``--json``, ``--emit-tensor-types``, ``report -o``) is
  refused in one line without being opened (``qkit.reading``). Each such command runs in a thread with a
  guard that unblocks a FIFO it is stuck on, so a regression fails instead of hanging the suite.
* Minor: ``--emit-tensor-types X -o X`` names the right option; a symbolic-link loop is called one;
  ``-o x.GGUF --format gguf`` writes one file.

Every refusal: exit 2, one ``error:`` line, no traceback, nothing left behind, inputs unchanged
(``tests/adversarial.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from adversarial import Outcome, Unchanged, assert_refused, invoke, tripwire

PLAN_FAST = ["--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "1"]
IMATRIX_FAST = ["--chunks", "2", "--chunk-size", "32"]
CLAIM = ".qkit-claim"  # a claim file's mark: .NAME.qkit-claim beside the output


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the model is resolved: these refusals come before any work."""
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")


def _claims(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in Path(d).iterdir() if p.name.endswith(CLAIM))


# --------------------------------------------------------------------------- class 2: outputs against each other


def _same_cases(m: str, d: Path) -> dict[str, tuple[list, tuple[str, ...]]]:
    p, g = d / "p.json", d / "m.gguf"
    return {
        "plan -o X --emit-tensor-types X": (["plan", m, "--format", "gguf", "--target-bits", "6", *PLAN_FAST, "-o", p,
                                              "--emit-tensor-types", p], ("--emit-tensor-types", "-o")),
        "plan -o X --json X": (["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", p, "--json", p], ("--json", "-o")),
        "imatrix -o X --json X": (["imatrix", m, *IMATRIX_FAST, "-o", g, "--json", g], ("--json", "-o")),
        "quantize --emit-tensor-types X --json X": (["quantize", m, "-s", "q8_0", "--format", "gguf", "-o", d / "q.gguf",
                                                      "--emit-tensor-types", d / "t.txt", "--json", d / "t.txt"],
                                                     ("--json", "--emit-tensor-types")),
        "plan -o X --json ./sub/../X": (["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", p,
                                         "--json", f"{d}/sub/../p.json"], ("--json", "-o")),
        "plan -o LINK/X --json X": (["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", d / "link" / "p.json",
                                     "--json", p], ("--json", "-o")),
    }


@pytest.mark.parametrize("case", list(_same_cases("m", Path("/d"))))
def test_two_outputs_of_one_command_on_one_path_are_refused(tiny_model_dir, tmp_path, no_work, case):
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path)
    argv, needles = _same_cases(str(tiny_model_dir), tmp_path)[case]
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path, tmp_path / "sub"]):
        assert_refused(invoke(*argv), *needles, "same")


def test_two_outputs_that_are_one_file_by_a_hard_link_are_refused(tiny_model_dir, tmp_path, no_work):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}\n")
    os.link(a, b)
    with Unchanged(inputs=[tiny_model_dir, a], dirs=[tmp_path]):
        assert_refused(invoke("plan", tiny_model_dir, "--target-bits", "6", *PLAN_FAST, "-o", a, "--json", b, "--force"),
                       "--json", "-o", "same")


def test_an_output_inside_another_output_is_refused(tiny_model_dir, tmp_path, no_work):
    k = tmp_path / "k.json"
    k.write_text("{}\n")
    # the report's page inside the --png directory: the directory would be published over it
    with Unchanged(inputs=[tiny_model_dir, k], dirs=[tmp_path]):
        assert_refused(invoke("report", k, "-o", tmp_path / "pngs" / "r.html", "--png", tmp_path / "pngs", "--run", "none"),
                       "--png", "-o", "contains")


def test_emit_tensor_types_equal_to_o_names_emit_tensor_types(tiny_model_dir, tmp_path, no_work):
    q = tmp_path / "q.gguf"
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", tiny_model_dir, "-s", "q8_0", "--format", "gguf", "-o", q,
                                     "--emit-tensor-types", q), "--emit-tensor-types", "-o")
    assert "--json" not in line


def test_json_inside_an_empty_output_directory_is_claimed_without_blocking_it(tiny_model_dir, tmp_path):
    """``--json D/r.json`` is claimed inside an existing empty ``-o D``: the claim is not content of D."""
    d = tmp_path / "d"
    d.mkdir()
    r = invoke("quantize", tiny_model_dir, "-s", "int8-row", "-o", d, "--json", d / "r.json", "--force")
    assert r.code == 0, r.text
    assert json.loads((d / "r.json").read_text())["output"] == str(d) and _claims(tmp_path, d) == []


def test_a_plan_row_file_is_an_input_of_eval(tiny_model_dir, tmp_path, no_work):
    plan = tmp_path / "p.json"
    plan.write_text('{"format": "qkit-plan"}\n')  # JSON: --force would replace it as a --json target
    with Unchanged(inputs=[tiny_model_dir, plan], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny_model_dir, "--schemes", f"plan:{plan}", "--tokens", "64",
                              "--json", plan, "--force"), "never writes over what it reads")


# --------------------------------------------------------------------------- class 2: claims across processes

HOLD = """
import sys
from qkit import claims
for target in sys.argv[1:]:
    claims.claim(target, "-o")
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _held(*targets: Path):
    """A live process (not qkit's CLI) holding claims on ``targets`` until the block ends; yields its PID."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *map(str, targets)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "held", proc.stderr.read()
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _claimed_cases(m: str, d: Path, k: Path) -> dict[str, tuple[list, Path]]:
    q, p, g, j = d / "q", d / "p.json", d / "m.gguf", d / "r.json"
    return {
        "quantize -o": (["quantize", m, "-s", "int8-row", "-o", q], q),
        "quantize --json": (["quantize", m, "-s", "int8-row", "-o", q, "--json", j], j),
        "quantize --emit-tensor-types": (["quantize", m, "-s", "q8_0", "--format", "gguf", "-o", d / "q.gguf",
                                          "--emit-tensor-types", d / "t.txt"], d / "t.txt"),
        "imatrix -o": (["imatrix", m, *IMATRIX_FAST, "-o", g], g),
        "imatrix --json": (["imatrix", m, *IMATRIX_FAST, "-o", g, "--json", j], j),
        "plan -o": (["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", p], p),
        "plan --json": (["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", p, "--json", j], j),
        "plan --emit-tensor-types": (["plan", m, "--format", "gguf", "--target-bits", "6", *PLAN_FAST, "-o", p,
                                      "--emit-tensor-types", d / "t.txt"], d / "t.txt"),
        "eval --json": (["eval", m, "--schemes", "int8-row", "--tokens", "64", "--json", j], j),
        "inspect errors --json": (["inspect", "errors", m, "--json", j], j),
        "kv --json": (["kv", m, "--json", j], j),
        "report -o": (["report", k, "--run", "none", "-o", d / "r.html"], d / "r.html"),
        "report --png": (["report", k, "--run", "none", "-o", d / "r.html", "--png", d / "pngs"], d / "pngs"),
    }


@pytest.mark.parametrize("case", list(_claimed_cases("m", Path("/d"), Path("/k"))))
def test_an_output_claimed_by_a_live_process_is_refused(tiny_model_dir, tmp_path, no_work, case):
    k = tmp_path / "k.json"
    k.write_text(json.dumps({"qkit_version": "0", "model": "m"}))
    out = tmp_path / "out"
    out.mkdir()
    argv, target = _claimed_cases(str(tiny_model_dir), out, k)[case]
    with _held(target) as pid:
        with Unchanged(inputs=[tiny_model_dir, k], dirs=[tmp_path, out]):
            assert_refused(invoke(*argv), "another qkit process", str(pid), str(target))
    assert _claims(out) == []  # the holder released its claim when it ended


def test_a_claim_made_before_its_parent_existed_is_seen(tiny_model_dir, tmp_path, no_work):
    """A run that claimed ``new/p.json`` before ``new/`` was made (its claim is ``.new%2Fp.json.qkit-claim`` in the
    parent) still holds it once ``new/`` exists: a second run, claiming inside ``new/``, sees it and refuses."""
    p = tmp_path / "new" / "p.json"
    with _held(p) as pid:
        assert [c.name for c in _claims(tmp_path)] == [".new%2Fp.json" + CLAIM]
        (tmp_path / "new").mkdir()
        with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path, tmp_path / "new"]):
            assert_refused(invoke("plan", tiny_model_dir, "--target-bits", "6", *PLAN_FAST, "-o", p),
                           "another qkit process", str(pid))


def test_a_claim_left_by_a_killed_run_is_removed_and_the_run_goes_on(tiny_model_dir, tmp_path):
    g = tmp_path / "m.gguf"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(g)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    assert len(_claims(tmp_path)) == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    r = invoke("imatrix", tiny_model_dir, *IMATRIX_FAST, "-o", g)
    assert r.code == 0, r.text
    assert g.is_file() and _claims(tmp_path) == []


def test_claims_of_one_process_are_released_when_its_command_ends(tiny_model_dir, tmp_path):
    r = invoke("kv", tiny_model_dir, "--json", tmp_path / "k.json")
    assert r.code == 0, r.text
    assert _claims(tmp_path) == []
    r = invoke("kv", tiny_model_dir, "--json", tmp_path / "k.json")  # a refusal releases them too
    assert r.code == 2 and _claims(tmp_path) == []


def test_the_library_claims_its_outputs(tiny_model_dir, tmp_path):
    from qkit.api import imatrix_model, quantize_model
    from qkit.errors import OutputError
    from qkit.methods.imatrix import ImatrixOptions

    g, q = tmp_path / "m.gguf", tmp_path / "q"
    with _held(g, q) as pid:
        with pytest.raises(OutputError, match=f"another qkit process.*{pid}"):
            imatrix_model(str(tiny_model_dir), output=g, options=ImatrixOptions(chunks=2, chunk_size=32))
        with pytest.raises(OutputError, match=f"another qkit process.*{pid}"):
            quantize_model(str(tiny_model_dir), output=q, scheme="int8-row")
    assert not g.exists() and not q.exists() and _claims(tmp_path) == []


def test_two_concurrent_imatrix_runs_on_one_output(tiny_model_dir, tmp_path):
    """Two real ``qkit imatrix -o m.gguf`` processes: the first is stopped once its claim is on disk, the second
    is refused in one line naming it, and the first then finishes and writes its own file."""
    g = tmp_path / "m.gguf"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, "-m", "qkit", "imatrix", str(tiny_model_dir), *IMATRIX_FAST, "-o", str(g),
                              "--json", str(tmp_path / "first.json")],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(_claims(tmp_path)) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_claims(tmp_path)) == 2, "the first run never claimed -o and --json"
        first.send_signal(signal.SIGSTOP)
        second = subprocess.run([sys.executable, "-m", "qkit", "imatrix", str(tiny_model_dir), *IMATRIX_FAST,
                                 "-o", str(g)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert_refused(Outcome(second.returncode, second.stdout, second.stderr), "another qkit process",
                       str(first.pid), "-o")
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert json.loads((tmp_path / "first.json").read_text())["output"] == str(g)
    assert g.is_file() and _claims(tmp_path) == []


# --------------------------------------------------------------------------- class 6: inputs that are not regular files


def _guarded(*args, fifos=(), timeout: float = float(os.environ.get("QKIT_TEST_FIFO_SECONDS", "20"))) -> Outcome:
    """``invoke(*args)`` in a thread; if it has not returned after ``timeout`` s (``$QKIT_TEST_FIFO_SECONDS``, 20:
    lower it to see the old code fail quickly) it is stuck on a FIFO: open the other end of each of ``fifos``
    until it returns, and fail."""
    box: list[Outcome] = []
    t = threading.Thread(target=lambda: box.append(invoke(*args)), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        end = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < end:
            for f in fifos:
                for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                    with contextlib.suppress(OSError):
                        os.close(os.open(f, flags))
            t.join(0.1)
        pytest.fail(f"qkit {' '.join(map(str, args))} blocked on a FIFO for {timeout:.0f} s")
    return box[0]


def _make(kind: str, path: Path) -> Path:
    """A FIFO, a socket, a directory or a symbolic-link loop at ``path``; a character device: /dev/zero."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "device":
        return Path("/dev/zero")
    return path


KIND_WORDS = {"fifo": "named pipe", "socket": "socket", "device": "character device", "directory": "directory",
              "loop": "symbolic link loop"}


def _input_cases(m: str, f: str, o: Path) -> dict[str, list]:
    return {
        "quantize --imatrix": ["quantize", m, "-s", "q4_0", "--format", "gguf", "--imatrix", f, "-o", o / "q.gguf"],
        "quantize --plan": ["quantize", m, "--plan", f, "-o", o / "q"],
        "quantize --tensor-type-file": ["quantize", m, "-s", "q8_0", "--format", "gguf", "--tensor-type-file", f,
                                        "-o", o / "q.gguf"],
        "quantize --calibration": ["quantize", m, "-s", "int4-g32", "--method", "gptq", "--calibration", f, "-o", o / "q"],
        "plan --imatrix": ["plan", m, "--format", "gguf", "--target-bits", "6", *PLAN_FAST, "--imatrix", f,
                           "-o", o / "p.json"],
        "plan --calibration": ["plan", m, "--target-bits", "6", *PLAN_FAST, "--calibration", f, "-o", o / "p.json"],
        "imatrix --calibration": ["imatrix", m, *IMATRIX_FAST, "--calibration", f, "-o", o / "m.gguf"],
        "eval plan: row": ["eval", m, "--schemes", f"plan:{f}", "--tokens", "64"],
        "eval file: row": ["eval", m, "--schemes", f"file:{f}", "--tokens", "64"],
        "eval --corpus": ["eval", m, "--schemes", "int8-row", "--corpus", f, "--tokens", "64"],
        "report": ["report", f, "--run", "none", "-o", o / "r.html"],
        "kv --config": ["kv", "--config", f],
        "budget --config": ["budget", "--config", f],
        "speculate --from": ["speculate", "--from", f],
        "simulate batching --lengths": ["simulate", "batching", "--lengths", f],
        "simulate batching --bench": ["simulate", "batching", "--bench", f],
        "verify": ["verify", f],
    }


def _input_name(case: str) -> str:
    """What the file is called: a plan row's file ends in .json, a file row's in .gguf."""
    return {"eval plan: row": "in.json", "eval file: row": "in.gguf"}.get(case, "in")


@pytest.mark.parametrize("case", list(_input_cases("m", "f", Path("/o"))))
def test_a_fifo_given_as_an_input_is_refused_without_blocking(tiny_model_dir, tmp_path, case):
    f = _make("fifo", tmp_path / _input_name(case))
    out = tmp_path / "out"
    out.mkdir()
    argv = _input_cases(str(tiny_model_dir), str(f), out)[case]
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path, out]):
        assert_refused(_guarded(*argv, fifos=[f]), "named pipe", str(f))


SOME_INPUTS = ["quantize --imatrix", "quantize --plan", "plan --calibration", "report", "kv --config",
               "quantize --tensor-type-file"]


@pytest.mark.parametrize("kind", ["socket", "device", "loop"])
@pytest.mark.parametrize("case", SOME_INPUTS)
def test_other_inputs_that_are_not_regular_files_are_refused(tiny_model_dir, tmp_path, case, kind):
    f = _make(kind, tmp_path / _input_name(case))
    out = tmp_path / "out"
    out.mkdir()
    argv = _input_cases(str(tiny_model_dir), str(f), out)[case]
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path, out]):
        assert_refused(_guarded(*argv), KIND_WORDS[kind])


@pytest.mark.parametrize("what", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_among_the_model_files_is_refused_without_blocking(tiny_model_dir, tmp_path, what):
    m = tmp_path / "m"
    m.mkdir()
    for p in tiny_model_dir.iterdir():
        if p.name != what:
            (m / p.name).symlink_to(p)
    f = _make("fifo", m / what)
    out = tmp_path / "out"
    out.mkdir()
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path, out, m]):
        assert_refused(_guarded("quantize", m, "-s", "q8_0", "--format", "gguf", "-o", out / "q.gguf", fifos=[f]),
                       "named pipe", what)


def test_a_fifo_named_as_a_gguf_model_is_refused_without_blocking(tmp_path):
    f = _make("fifo", tmp_path / "m.gguf")
    with Unchanged(dirs=[tmp_path]):
        assert_refused(_guarded("kv", f, fifos=[f]), "named pipe")


def test_a_symlink_loop_as_the_model_is_called_a_loop(tmp_path):
    loop = _make("loop", tmp_path / "m")
    with Unchanged(dirs=[tmp_path]):
        line = assert_refused(invoke("kv", loop), "symbolic link loop")
    assert "no such file" not in line


# --------------------------------------------------------------------------- class 6: outputs that are not regular files


def _output_cases(m: str, f: Path, d: Path, k: Path) -> dict[str, list]:
    return {
        "imatrix -o": ["imatrix", m, *IMATRIX_FAST, "-o", f],
        "imatrix -o --force": ["imatrix", m, *IMATRIX_FAST, "-o", f, "--force"],
        "plan -o": ["plan", m, "--target-bits", "6", *PLAN_FAST, "-o", f],
        "plan --emit-tensor-types": ["plan", m, "--format", "gguf", "--target-bits", "6", *PLAN_FAST, "-o", d / "p.json",
                                     "--emit-tensor-types", f, "--force"],
        "quantize --format gguf -o": ["quantize", m, "-s", "q8_0", "--format", "gguf", "-o", f, "--force"],
        "quantize --emit-tensor-types": ["quantize", m, "-s", "q8_0", "--format", "gguf", "-o", d / "q.gguf",
                                         "--emit-tensor-types", f, "--force"],
        "kv --json": ["kv", m, "--json", f],
        "kv --json --force": ["kv", m, "--json", f, "--force"],
        "report -o": ["report", k, "--run", "none", "-o", f, "--force"],
    }


@pytest.mark.parametrize("case", list(_output_cases("m", Path("/f"), Path("/d"), Path("/k"))))
def test_a_fifo_given_as_an_output_is_refused_without_blocking(tiny_model_dir, tmp_path, no_work, case):
    k = tmp_path / "k.json"
    k.write_text("{}")
    f = _make("fifo", tmp_path / ("out.gguf" if "gguf -o" in case else "out"))
    argv = _output_cases(str(tiny_model_dir), f, tmp_path, k)[case]
    with Unchanged(inputs=[tiny_model_dir, k], dirs=[tmp_path]):
        assert_refused(_guarded(*argv, fifos=[f]), "named pipe", str(f))


def test_a_device_given_as_a_json_output_is_refused(tiny_model_dir, no_work):
    assert_refused(invoke("kv", tiny_model_dir, "--json", "/dev/null", "--force"), "character device")


# --------------------------------------------------------------------------- the helper itself


def test_reading_refuses_without_opening(tmp_path, monkeypatch):
    """``qkit.reading``: a regular file is read (bounded); every other kind is refused before ``open``."""
    from qkit import reading
    from qkit.errors import InputError

    good = tmp_path / "good.txt"
    good.write_text("hello")
    assert reading.read_text(good, "--x good.txt", limit=10) == "hello"
    with pytest.raises(InputError, match="larger than"):
        reading.read_text(good, "--x good.txt", limit=4)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    for kind, word in KIND_WORDS.items():
        p = _make(kind, tmp_path / kind)
        with pytest.raises(InputError, match=word):
            reading.read_bytes(p, f"--x {p}", limit=10)
    assert [p for p in opened if "good" not in str(p)] == []


# --------------------------------------------------------------------------- minor: -o x.GGUF


@pytest.mark.parametrize("name", ["x.GGUF", "x.Gguf"])
def test_an_upper_case_gguf_extension_writes_one_file(tiny_model_dir, tmp_path, name):
    out = tmp_path / name
    r = invoke("quantize", tiny_model_dir, "-s", "q8_0", "--format", "gguf", "-o", out)
    assert r.code == 0, r.text
    assert out.is_file() and out.read_bytes()[:4] == b"GGUF"
