"""Shared checks of the adversarial test matrix (``tests/test_adversarial_*.py``).

Every refusal a user can meet must be:

* exit code 2 (``REFUSED``);
* exactly one non-empty line on stderr + stdout together, starting with ``error: ``;
* no traceback;
* nothing left behind: no new file or directory in the places the command could write (hidden
  temporary siblings included);
* every input unchanged, byte for byte (sha256 of every file under it).

Two ways to run a command:

* ``invoke(*args)``: in-process through typer's ``CliRunner`` (fast; most cases);
* ``spawn(*args)``: ``python -m qkit`` in a subprocess (the real entry point: faults such as SIGKILL,
  SIGINT, a read-only or full file system, stdin prompts, environment variables).

And the models that ask for their own code (``make_untrusted``: an ``auto_map`` to a file that writes a
marker if it is ever imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REFUSED = 2


@dataclass
class Outcome:
    """What one command did: exit code, stdout, stderr (merged when run in-process) and the exception."""

    code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None

    @property
    def text(self) -> str:
        return (self.stdout or "") + (self.stderr or "")

    @property
    def lines(self) -> list[str]:
        return [line for line in self.text.strip().splitlines() if line.strip()]


def invoke(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Outcome:
    """Run ``qkit ARGS`` in this process (typer's CliRunner: each command's own error handling; usage errors
    and KeyboardInterrupt are formatted by ``qkit.cli.main``, which only ``spawn`` runs)."""
    from typer.testing import CliRunner

    from qkit.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return Outcome(result.exit_code, result.stdout or "", result.stderr or "", exc)


def spawn(
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
) -> Outcome:
    """Run ``python -m qkit ARGS`` in a subprocess; stdin is empty unless ``input`` is given."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "qkit", *[str(a) for a in args]],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def spawn_and_signal(
    *args: str,
    sig: int = signal.SIGKILL,
    when: str | None = None,
    after: float | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Outcome:
    """Start ``python -m qkit ARGS``, send ``sig`` once ``when`` appears in its stderr (or ``after`` seconds),
    and wait for it to end. Returns what it printed and its exit code (``-9`` for SIGKILL)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkit", *[str(a) for a in args]],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
    )
    # stdout drained by a thread from the start (a full pipe would block the child); stderr read here, line
    # by line until ``when``, then to its end through the same file object (its buffer holds what was read ahead)
    out: list[str] = []
    drain = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    drain.start()
    assert proc.stderr is not None
    err: list[str] = []
    deadline = time.monotonic() + timeout
    if when is not None:
        for line in proc.stderr:
            err.append(line)
            if when in line or time.monotonic() > deadline:
                break
    elif after is not None:
        time.sleep(after)
    if proc.poll() is None:
        proc.send_signal(sig)
    err.append(proc.stderr.read())
    proc.wait(timeout=timeout)
    drain.join(timeout=timeout)
    return Outcome(proc.returncode, "".join(out), "".join(err))


def assert_refused(outcome: Outcome, *needles: str, code: int = REFUSED) -> str:
    """Exit ``code`` (2), one line starting ``error: ``, no traceback, each needle (case-insensitive) in it.
    Returns the line."""
    text = outcome.text
    assert outcome.exception is None, f"uncaught {outcome.exception!r}\n{text}"
    assert "Traceback" not in text, text
    assert outcome.code == code, f"exit code {outcome.code}, expected {code}\n{text}"
    lines = outcome.lines
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{text}"
    line = lines[0]
    assert line.startswith("error: "), line
    for n in needles:
        assert n.lower() in line.lower(), f"{n!r} not in {line!r}"
    return line


def digest_tree(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (a file, or a directory walked recursively), by path; a
    directory's entry list is recorded too, so an added or removed file changes the digest."""
    out: dict[str, str] = {}
    for root in paths:
        root = Path(root)
        if root.is_file():
            out[str(root)] = _sha(root)
        elif root.is_dir():
            for p in sorted(root.rglob("*")):
                out[str(p)] = _sha(p) if p.is_file() else "<dir>"
        else:
            out[str(root)] = "<absent>"
    return out


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def listing(*dirs: Path) -> set[str]:
    """Every entry (hidden ones included) directly in ``dirs``: compare before and after a command."""
    out: set[str] = set()
    for d in dirs:
        d = Path(d)
        if d.is_dir():
            out |= {str(p) for p in d.iterdir()}
    return out


class Unchanged:
    """``with Unchanged(inputs=[...], dirs=[...]):`` asserts on exit that every file under ``inputs`` has the
    same bytes and that nothing was added to or removed from ``dirs`` (the places outputs could land)."""

    def __init__(self, inputs: Iterable[Path] = (), dirs: Iterable[Path] = ()):
        self.inputs = [Path(p) for p in inputs]
        self.dirs = [Path(p) for p in dirs]

    def __enter__(self) -> Unchanged:
        self.before = digest_tree(*self.inputs)
        self.listed = listing(*self.dirs)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        after = digest_tree(*self.inputs)
        changed = sorted(k for k in set(self.before) | set(after) if self.before.get(k) != after.get(k))
        assert not changed, f"inputs changed: {changed[:5]}"
        added = sorted(listing(*self.dirs) - self.listed)
        removed = sorted(self.listed - listing(*self.dirs))
        assert not added, f"left behind: {added[:5]}"
        assert not removed, f"removed: {removed[:5]}"


def tripwire(monkeypatch, target: str, what: str) -> None:
    """Replace the function at ``target`` ("module.attr") by one that fails the test: a refusal that must come
    before ``what`` (loading the model, resolving it) proves it did when the test passes."""

    def refuse(*_a, **_k):
        raise AssertionError(f"{what} before the refusal")

    monkeypatch.setattr(target, refuse)


# --------------------------------------------------------------------------- models that ask for their own code


def evil_module(marker: Path, cls: str) -> str:
    """A module that, if ever imported, writes ``marker`` (then defines what the auto_map names)."""
    return (f"open({str(marker)!r}, 'w').write('model code ran')\n"
            "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
            "class EvilConfig(LlamaConfig):\n    model_type = 'qkit-untrusted'\n"
            "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
            f"class {cls}(PreTrainedTokenizerFast):\n    pass\n")


def make_untrusted(src: Path, dst: Path, marker: Path) -> Path:
    """A copy of ``src`` whose config needs its own code: unknown model_type + auto_map to evil_code.py."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "qkit-untrusted"
    cfg["auto_map"] = {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "evil_code.py").write_text(evil_module(marker, "EvilTokenizer"))
    return dst
