"""Adversarial round 3 (issue 48), classes 7 and 11 and the remote-code message: processes and the cache.

* **7. Processes left behind.** Every probe and worker qkit starts runs in a session of its own, and the
  whole group ends when qkit is done with it: on a timeout, on Ctrl-C, on SIGTERM and on a normal exit.
  An engine interpreter (``$QKIT_ENGINE_PYTHON``) that hangs, or that answers but leaves a child running
  (holding the pipe qkit reads), is refused in one line within the probe's limit
  (``$QKIT_ENGINE_PROBE_TIMEOUT``, so these tests need not wait the default 60 s), and no process it
  started survives. SIGTERM (what ``timeout``, systemd and ``docker stop`` send) is Ctrl-C's twin: one
  line, exit 143, staged outputs and scratch directories removed, the engine worker's group killed.
* **11. Duplicated work.** Two processes converting the same ``.gguf`` MODEL into a fresh cache convert
  it once: the second waits (one status line naming the first's PID) and reuses the result; a holder
  that dies is taken over. The pinned downloads take the same lock.
* **Minor.** The remote-code refusal names every command that takes ``--trust-remote-code``.

Every process is real: a wrapper script whose children hang, ``python -m qkit`` sent real signals; a
survivor is looked for by PID and by a token in ``/proc/*/environ``, a zombie counting as gone (this
container's PID 1 may not reap orphans).
"""

from __future__ import annotations

import ast
import hashlib
import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import typer

from adversarial import Unchanged, assert_refused, invoke, listing, make_untrusted, tripwire

TERMINATED = "error: terminated (SIGTERM); nothing was written"
PROBE_ENV = "QKIT_ENGINE_PROBE_TIMEOUT"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    """A GGUF file of the tiny model, a MODEL that qkit converts into its cache on first use."""
    from qkit.api import quantize_model

    out = tmp_path_factory.mktemp("r3p-gguf") / "tiny.gguf"
    quantize_model(tiny_model_dir, output=out, scheme="q8_0", format="gguf")
    return out


# --------------------------------------------------------------------------- finding survivors


def _gone(pid: int) -> bool:
    """No such process, or a zombie (exited, waiting for a parent that may never reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _carrying(token: str) -> list[int]:
    """Live processes whose environment holds ``QKIT_TEST_TOKEN=token`` (what the wrappers export)."""
    needle = f"QKIT_TEST_TOKEN={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and not _gone(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _survivors(pidfile: Path, token: str, wait: float = 5.0) -> list[int]:
    """The recorded PIDs and token carriers still running after ``wait`` seconds (SIGKILL is asynchronous)."""
    deadline = time.monotonic() + wait
    while True:
        pids = [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []
        alive = sorted({p for p in pids if not _gone(p)} | set(_carrying(token)))
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in alive:  # never leave them to the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return alive


@pytest.fixture
def token():
    """A token the test's wrappers export to what they start; any carrier still running at the end is killed,
    whatever the test found (a failing run must not leave sleeps behind)."""
    value = uuid.uuid4().hex
    yield value
    for pid in _carrying(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _script(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- 7. an engine Python that hangs


def _hanging_python(d: Path, token: str) -> tuple[Path, Path]:
    """(wrapper, pid file): a 'python' whose shell starts a background sleep and a Python that sleeps."""
    d.mkdir(exist_ok=True)
    pids = d / "pids"
    wrapper = _script(d / "python", f"""
        #!/bin/sh
        export QKIT_TEST_TOKEN={token}
        echo $$ >> {pids}
        sleep 1000 &
        echo $! >> {pids}
        {sys.executable} -S -c "import os, time; open('{pids}', 'a').write(str(os.getpid()) + chr(10)); time.sleep(1000)"
    """)
    return wrapper, pids


def _answering_python(d: Path, token: str) -> tuple[Path, Path]:
    """(wrapper, pid file): a real Python (no site-packages: no engine) that leaves a sleep running in the
    background, holding the stdout it inherited."""
    d.mkdir(exist_ok=True)
    pids = d / "pids"
    wrapper = _script(d / "python", f"""
        #!/bin/sh
        export QKIT_TEST_TOKEN={token}
        sleep 1000 &
        echo $! >> {pids}
        exec {sys.executable} -S "$@"
    """)
    return wrapper, pids


@pytest.mark.parametrize("runtime", ["llama.cpp", "vllm"])
def test_a_hanging_engine_python_is_refused_at_the_probe_limit_and_its_whole_group_ends(tiny_model_dir, tmp_path,
                                                                                       monkeypatch, runtime, token):
    wrapper, pids = _hanging_python(tmp_path / "py", token)
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "the model was resolved")
    t0 = time.monotonic()
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        line = assert_refused(invoke("eval", tiny_model_dir, "--schemes", "q8_0", "--runtime", runtime, "--tokens", "64",
                                     "--agree-tokens", "1", env={"QKIT_ENGINE_PYTHON": str(wrapper), PROBE_ENV: "2"}),
                              "did not answer within 2 s", "QKIT_ENGINE_PYTHON")
    assert time.monotonic() - t0 < 30, line
    assert _survivors(pids, token) == []


@pytest.mark.parametrize("runtime", ["llama.cpp", "vllm"])
def test_an_engine_python_that_answers_but_leaves_a_child_is_not_waited_for_and_the_child_ends(tiny_model_dir, tmp_path,
                                                                                             monkeypatch, runtime, token):
    # the background sleep holds the probe's stdout open: reading it to its end would wait for the sleep
    wrapper, pids = _answering_python(tmp_path / "py", token)
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "the model was resolved")
    t0 = time.monotonic()
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny_model_dir, "--schemes", "q8_0", "--runtime", runtime, "--tokens", "64",
                              "--agree-tokens", "1", env={"QKIT_ENGINE_PYTHON": str(wrapper), PROBE_ENV: "20"}),
                       "lacks")
    assert time.monotonic() - t0 < 15
    assert _survivors(pids, token) == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e400", "ten", ""])
def test_a_bad_probe_limit_is_one_line_naming_the_variable(tiny_model_dir, tmp_path, monkeypatch, value, token):
    wrapper, _ = _hanging_python(tmp_path / "py", token)
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "the model was resolved")
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny_model_dir, "--schemes", "q8_0", "--runtime", "llama.cpp", "--tokens", "64",
                              "--agree-tokens", "1", env={"QKIT_ENGINE_PYTHON": str(wrapper), PROBE_ENV: value}),
                       PROBE_ENV)


# --------------------------------------------------------------------------- 7. SIGTERM, and signals during a worker

_HOOK = '''
import os, time
from pathlib import Path
mode = os.environ.get("QKIT_TEST_HOOK")
if mode:
    mark = Path(os.environ["QKIT_TEST_MARK"])
    if mode == "work":  # every step of the work (an imatrix chunk) slowed down; the first marks it
        from qkit import console
        real_advance = console.ProgressHandle.advance
        def advance(self, *a, **k):
            mark.touch()
            time.sleep(0.5)
            return real_advance(self, *a, **k)
        console.ProgressHandle.advance = advance
    if mode == "hold":  # each conversion of a .gguf counted; it marks, then holds until the go file appears
        from qkit.models import gguf
        real_convert = gguf._convert_gguf
        def convert(*a, **k):
            with open(os.environ["QKIT_TEST_COUNT"], "a") as f:
                f.write(f"{os.getpid()}\\n")
            mark.touch()
            go = Path(os.environ["QKIT_TEST_GO"])
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return real_convert(*a, **k)
        gguf._convert_gguf = convert
'''


def _start(args: list, tmp: Path, mode: str, **env: str) -> subprocess.Popen:
    """``python -m qkit ARGS`` with the hook in ``mode`` (TMPDIR in ``tmp``), stdout and stderr piped."""
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    scratch = tmp / "tmpdir"
    scratch.mkdir(exist_ok=True)
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1", "QKIT_TEST_HOOK": mode, "QKIT_TEST_MARK": str(tmp / "mark"),
            "TMPDIR": str(scratch), **env}
    return subprocess.Popen([sys.executable, "-m", "qkit", *map(str, args)], env=full, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _signal_at_mark(proc: subprocess.Popen, mark: Path, sig: int) -> tuple[int, str]:
    deadline = time.monotonic() + 240
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"ended before the signal: {proc.communicate()}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out + err


def _qkit_leftovers(*dirs: Path) -> list[str]:
    """qkit's staging siblings and scratch directories in ``dirs``."""
    return sorted(p for p in listing(*dirs) if ".qkit-tmp-" in p or Path(p).name.startswith("qkit-"))


def test_sigterm_while_working_is_one_line_exit_143_and_writes_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = ["imatrix", tiny_model_dir, "-o", out / "i.gguf", "--json", out / "i.run.json", "--chunk-size", "32", "--chunks", "4"]
    with Unchanged(inputs=[tiny_model_dir]):
        code, text = _signal_at_mark(_start(args, tmp_path, "work"), tmp_path / "mark", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, text
    assert [ln for ln in text.splitlines() if ln.strip()] == [TERMINATED], text
    assert list(out.iterdir()) == []  # neither -o nor --json, nor a staging sibling
    assert _qkit_leftovers(tmp_path / "tmpdir") == []


def _stub_engine(d: Path, token: str) -> Path:
    """An engine Python: qkit's own, with a ``llama_cpp`` package first on its path whose import starts a
    sleeping child, marks, and hangs (the probe only looks the package up, so it passes)."""
    (d / "stub" / "llama_cpp").mkdir(parents=True)
    (d / "stub" / "llama_cpp" / "__init__.py").write_text(textwrap.dedent(f"""
        import os, subprocess, time
        from pathlib import Path
        child = subprocess.Popen(["sleep", "1000"])
        Path({str(d / 'pids')!r}).open("a").write(f"{{os.getpid()}}\\n{{child.pid}}\\n")
        Path({str(d / 'mark')!r}).touch()
        time.sleep(1000)
    """))
    return _script(d / "python", f"""
        #!/bin/sh
        export QKIT_TEST_TOKEN={token}
        PYTHONPATH={d / 'stub'} exec {sys.executable} "$@"
    """)


def test_sigterm_while_the_engine_worker_runs_ends_its_whole_group(tiny_model_dir, tmp_path, token):
    # Ctrl-C takes the same path (the worker's group is ended as the KeyboardInterrupt unwinds); SIGTERM alone
    # is run here, to keep this file fast
    engine = _stub_engine(tmp_path, token)
    proc = _start(["eval", tiny_model_dir, "--schemes", "q8_0", "--runtime", "llama.cpp", "--tokens", "64", "--agree-tokens",
                   "1"], tmp_path, "", QKIT_ENGINE_PYTHON=str(engine))
    code, text = _signal_at_mark(proc, tmp_path / "mark", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, text
    assert [ln for ln in text.splitlines() if ln.startswith("error:")] == [TERMINATED], text
    assert _survivors(tmp_path / "pids", token) == []
    assert _qkit_leftovers(tmp_path / "tmpdir") == []  # the worker's scratch directory too


# --------------------------------------------------------------------------- 11. one conversion into a fresh cache


class _Records(logging.Handler):
    """The ``qkit`` logger's messages (where the library's status lines come from)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    log = logging.getLogger("qkit")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def _resolve_beside(holder: subprocess.Popen, gguf: Path, records: _Records, monkeypatch, then) -> tuple[list, list]:
    """Resolve ``gguf`` here, in a thread, while ``holder`` converts it; once this process says it waits,
    call ``then()``. Returns (this process's conversions, what resolve returned or raised)."""
    from qkit.models import gguf as gguf_module
    from qkit.models import resolve

    mine: list[int] = []
    real = gguf_module._convert_gguf
    monkeypatch.setattr(gguf_module, "_convert_gguf", lambda *a, **k: (mine.append(1), real(*a, **k))[1])
    got: list = []

    def run() -> None:
        try:
            got.append(resolve(str(gguf)))
        except BaseException as exc:  # handed to the test
            got.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not any("waiting for process" in m for m in records.messages) and worker.is_alive() \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    then()
    worker.join(timeout=120)
    return mine, got


def _holding_a_conversion(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path, subprocess.Popen]:
    """A fresh cache (this process's too), and a real ``qkit kv GGUF`` that holds the conversion's lock until
    ``go`` exists: ``(cache, count, go, holder)``, ``count`` listing the PIDs that converted."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("QKIT_CACHE", str(cache))
    count, go = tmp_path / "count", tmp_path / "go"
    holder = _start(["kv", tiny_gguf], tmp_path, "hold", QKIT_CACHE=str(cache), QKIT_TEST_COUNT=str(count),
                    QKIT_TEST_GO=str(go))
    while not (tmp_path / "mark").exists() and holder.poll() is None:
        time.sleep(0.02)
    return cache, count, go, holder


def test_two_processes_converting_one_gguf_into_a_fresh_cache_convert_it_once(tiny_gguf, tmp_path, monkeypatch,
                                                                              records):
    cache, count, go, holder = _holding_a_conversion(tiny_gguf, tmp_path, monkeypatch)
    mine, got = _resolve_beside(holder, tiny_gguf, records, monkeypatch, go.touch)
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, out + err
    waits = [m for m in records.messages if "waiting for process" in m]
    assert waits and all(f"process {holder.pid}" in m for m in waits), records.messages
    assert len(waits) == 1, waits
    assert count.read_text().split() == [str(holder.pid)] and mine == []  # converted once, by the first
    (ref,) = got
    assert not isinstance(ref, BaseException), ref
    assert (ref.directory / "config.json").is_file() and ref.directory.parent == cache / "models"
    assert sorted(p.name for p in (cache / "models").iterdir()) == [ref.directory.name]  # no staging sibling


def test_a_holder_killed_while_converting_is_taken_over(tiny_gguf, tmp_path, monkeypatch, records):
    cache, _count, _go, holder = _holding_a_conversion(tiny_gguf, tmp_path, monkeypatch)

    def kill() -> None:
        holder.kill()
        holder.communicate(timeout=60)

    mine, got = _resolve_beside(holder, tiny_gguf, records, monkeypatch, kill)
    assert [m for m in records.messages if "waiting for process" in m], records.messages
    assert mine == [1]  # taken over: converted here, once
    (ref,) = got
    assert not isinstance(ref, BaseException), ref
    assert sorted(p.name for p in (cache / "models").iterdir()) == [ref.directory.name]


def test_two_fetches_of_one_pinned_asset_download_it_once(tmp_path, monkeypatch, records):
    from qkit import assets

    member = b"pinned bytes"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("pkg/data.bin", member)
    wheel = buf.getvalue()
    asset = assets.PinnedAsset(name="test-asset", package="pkg", version="1.0", archive="pkg-1.0-py3-none-any.whl",
                               archive_sha256=hashlib.sha256(wheel).hexdigest(), member="pkg/data.bin",
                               member_sha256=hashlib.sha256(member).hexdigest())
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cache"))
    downloads: list[int] = []
    started = threading.Event()

    def download(_asset, dest: Path) -> Path:
        downloads.append(1)
        started.set()
        time.sleep(1.0)  # long enough for the second fetch to find the first at work
        (dest / asset.archive).write_bytes(wheel)
        return dest / asset.archive

    monkeypatch.setattr(assets, "_pip_download", download)
    got: list = []
    first = threading.Thread(target=lambda: got.append(assets.fetch(asset)))
    first.start()
    started.wait(10)
    second = threading.Thread(target=lambda: got.append(assets.fetch(asset)))
    second.start()
    first.join(30)
    second.join(30)
    assert len(got) == 2 and got[0] == got[1] and got[0].read_bytes() == member
    assert downloads == [1]
    assert any("waiting for" in m for m in records.messages), records.messages


# --------------------------------------------------------------------------- minor: the remote-code message


def _commands_with(option: str) -> set[str]:
    """The commands (``qkit NAME``, ``qkit GROUP NAME``) that take ``option``."""
    from qkit.cli import app

    found: set[str] = set()

    def walk(command, path: str) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())
        if any(option in p.opts for p in getattr(command, "params", [])):
            found.add(path)

    walk(typer.main.get_command(app), "")
    return found


def test_the_remote_code_refusal_names_every_command_that_takes_the_flag(tiny_model_dir, tmp_path):
    evil = make_untrusted(tiny_model_dir, tmp_path / "evil", tmp_path / "marker")
    line = assert_refused(invoke("quantize", evil, "-o", tmp_path / "out"), "--trust-remote-code")
    listed = line.split("--trust-remote-code (", 1)[1].split(")", 1)[0]
    named = {name.strip().removeprefix("qkit ") for name in listed.split(",")}
    assert named == _commands_with("--trust-remote-code"), line
    assert {"imatrix", "plan"} <= named
    assert not (tmp_path / "marker").exists()


# --------------------------------------------------------------------------- 7. one way to start a process


def test_every_subprocess_qkit_starts_goes_through_qkit_processes():
    """``subprocess.run/Popen/call/check_*``, ``os.system``, ``os.popen``, ``os.fork``, ``os.spawn*``,
    ``os.exec*``: only ``qkit/processes.py`` starts a process (in a group of its own, ended after)."""
    src = Path(__file__).resolve().parents[1] / "src" / "qkit"
    starters = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output", "getoutput",
                                            "getstatusoutput")}
    starters |= {("os", n) for n in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp")}
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "processes.py" or path.name.startswith("_worker"):  # workers run in the engine's Python
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                pair = (node.value.id, node.attr)
                if pair in starters or pair[0] == "os" and node.attr.startswith(("spawn", "exec")):
                    found.append(f"{path.relative_to(src)}:{node.lineno} {pair[0]}.{pair[1]}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "multiprocessing"):
                found.append(f"{path.relative_to(src)}:{node.lineno} from {node.module} import ...")
    assert found == [], found
