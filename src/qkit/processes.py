"""The processes qkit starts: each in a session of its own, the whole group ended when qkit is done with it.

Layer 1 (imports nothing of qkit's). Every subprocess qkit runs (an engine interpreter's probe, an engine
worker, ``pip download`` of a pinned asset) is started here, by ``group`` or ``run``, never by
``subprocess`` directly (``tests/test_adversarial_round3_processes.py`` greps for it):

* it is started with ``start_new_session=True``: a session and a process group of its own, whose ID is
  its PID. A wrapper script's children, an engine's helper processes and anything they fork stay in that
  group (short of a process that calls ``setsid`` itself);
* when the ``with`` block ends, whichever way (the command exited, a timeout, an exception, Ctrl-C, or
  SIGTERM, which ``qkit.cli`` raises as Ctrl-C), the whole group is sent SIGKILL and the leader reaped;
* ``wait`` waits for the leader without reaping it, so its PID (the group's ID) cannot be reused by an
  unrelated process before the group is killed;
* ``run`` captures output in unnamed temporary files, not pipes: a background child that inherits
  stdout (``sleep 1000 &`` in a wrapper script) cannot make qkit wait for it to close the pipe.

``kill_all`` ends every group still running: what a second Ctrl-C or SIGTERM does before the process dies
of it (``qkit.cli``), so even a forced exit leaves none of qkit's children behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

_LIVE: dict[int, subprocess.Popen] = {}  # leader PID -> the group's leader, from start until ``end``
OUTPUT_LIMIT = 1 << 20  # bytes of each captured stream that ``run`` keeps (its end): a probe prints a line
_REAP_SECONDS = 10.0  # after SIGKILL, how long to wait for the leader's exit status (the kernel's business)


@contextlib.contextmanager
def group(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` (``subprocess.Popen(cmd, **popen)``) in a new session and yield it; when the block ends,
    whichever way, SIGKILL its whole process group and reap it (``end``). ``OSError`` (no such program, not
    executable) is raised by the start, before the block."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    _LIVE[proc.pid] = proc
    try:
        yield proc
    finally:
        end(proc)


def wait(proc: subprocess.Popen, timeout: float | None = None) -> None:
    """Wait until ``proc`` exits, at most ``timeout`` seconds (None: no limit), leaving it unreaped: its PID
    still names its group for ``end``. Raises ``subprocess.TimeoutExpired`` past the limit; a signal handler's
    exception (Ctrl-C) interrupts the wait."""
    if not hasattr(os, "waitid"):  # pragma: no cover - macOS: reaped, so the group's ID may in theory be reused
        proc.wait(timeout=timeout)
        return
    flags = os.WEXITED | os.WNOWAIT
    try:
        if timeout is None:
            os.waitid(os.P_PID, proc.pid, flags)
            return
        deadline, delay = time.monotonic() + timeout, 0.0005
        while os.waitid(os.P_PID, proc.pid, flags | os.WNOHANG) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            delay = min(delay * 2, left, 0.05)  # subprocess's own polling schedule
            time.sleep(delay)
    except ChildProcessError:  # already reaped (by ``end``): it has exited
        return


def end(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (the leader, if still running, and whatever it started), then reap
    the leader, so ``proc.returncode`` is set. Safe to call twice."""
    _kill_group(proc.pid)
    try:
        proc.wait(timeout=_REAP_SECONDS)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL is the kernel's
        pass
    _LIVE.pop(proc.pid, None)


def kill_all() -> None:
    """SIGKILL every group started here and not yet ended, without waiting (safe in a signal handler)."""
    for pid in list(_LIVE):
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty (or, never here, another user's)
        pass


@dataclass(frozen=True)
class Finished:
    """What ``run`` saw: the exit status (negative: the signal that ended it) and the end of each stream,
    decoded as UTF-8 with replacement."""

    returncode: int
    stdout: str
    stderr: str


def run(cmd: Sequence[str], *, timeout: float | None, cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None) -> Finished:
    """Run ``cmd`` to its end in a group of its own (``group``), stdin empty, and return its status and output
    (the last ``OUTPUT_LIMIT`` bytes of each stream). The group is killed once the command exits, past
    ``timeout`` seconds (then ``subprocess.TimeoutExpired`` is raised) and on any exception. ``OSError``:
    the command could not start."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with group(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=cwd, env=env) as proc:
            wait(proc, timeout)
        return Finished(proc.returncode, _tail(out), _tail(err))


def _tail(f: IO[bytes]) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - OUTPUT_LIMIT))
    return f.read().decode("utf-8", "replace")


__all__ = ["Finished", "OUTPUT_LIMIT", "end", "group", "kill_all", "run", "wait"]
