"""Running an engine's worker: a standalone script in a subprocess, files in a scratch directory.

Layer 6 (``evaluation.engines``). Every engine (vLLM, llama.cpp) measures a row in a worker process, so
the engine's process model, threads, memory and logging stay out of qkit's. A worker is a plain script
that imports only the standard library, numpy, ``_worker_io.py`` (beside it) and its engine, never qkit:
it runs in any interpreter that has the engine (``EngineOptions.python``, ``$QKIT_ENGINE_PYTHON``).

The exchange, in a scratch directory ``D`` (``run_worker`` makes and removes it)::

    D/request.json      the job (JSON: anything small: paths, token-id lists, settings)
    D/in/NAME.npy       input arrays (e.g. the corpus windows, int64)
    D/result.json       written by the worker last: {"status": "ok", ...} | {"status": "refused", "reason": ...}
                        | {"status": "input_error", "reason": ...}
    D/out/NAME.npy      output arrays (large ones written through a memory map: np.lib.format.open_memmap)
    D/log.txt           the worker's stdout and stderr together (never piped: a chatty engine cannot block)

``python WORKER D`` is started in a session and process group of its own (``qkit.processes.group``) with
``D`` as its working directory; when it exits, on a timeout, an exception, Ctrl-C or SIGTERM the whole
group is killed (an engine's own child processes too), so nothing is left running. The interpreter's probe
(``check_importable``) runs the same way, within ``$QKIT_ENGINE_PROBE_TIMEOUT`` seconds (default 60).
What comes back:

* ``status: ok``: ``(result, arrays)``, the arrays memory-mapped copy-on-write from ``D/out`` (writable
  in memory, never written back, so ``torch.from_numpy`` takes them without a copy; they stay valid
  after ``D`` is removed: the mapping holds the file);
* ``status: refused`` -> ``EngineRefused(reason)``: the engine cannot run this row (no kernel for it);
  the runner turns it into a row that says so;
* ``status: input_error`` -> ``InputError(reason)``: the job itself is wrong (a bad option);
* no ``result.json`` (the engine crashed, a segfault, out of memory) -> ``EngineRefused`` naming the exit
  status and the last line the worker printed: a crash in the engine is the engine not running the row;
* past ``timeout`` seconds -> ``EngineRefused`` saying so.

``_worker_io.py`` is the worker's side of this (``serve(handler)``); a worker loads it by file path, since
the script's own directory must not stay on ``sys.path``: it holds qkit's ``llama_cpp.py`` and ``vllm.py``,
which would shadow the engines' packages of the same names.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qkit import processes
from qkit.errors import InputError
from qkit.evaluation.engines.base import EngineRefused
from qkit.staging import temporary_directory

HERE = Path(__file__).resolve().parent
WORKER_IO = HERE / "_worker_io.py"  # the worker's side of the exchange (stdlib + numpy)
TMP_PREFIX = "qkit-engine-"  # $TMPDIR/qkit-engine-PID-RANDOM when no directory is given
ENGINE_PYTHON = "QKIT_ENGINE_PYTHON"  # the interpreter with the engine installed, when not qkit's own
LOG_TAIL_LINES = 40  # of the worker's log, kept for a refusal's reason and for ``WorkerResult.log``


def engine_python(python: str | None) -> str:
    """The interpreter a worker runs in: ``python``, else ``$QKIT_ENGINE_PYTHON``, else qkit's own."""
    return python or os.environ.get(ENGINE_PYTHON) or sys.executable


_PROBE_MARK = "qkit-engine-probe"
# What the interpreter prints: the mark, 6 * 7 computed (so a program that echoes its arguments, such as
# /bin/echo, never passes for Python), and whether the module is found. Nothing is imported but importlib.
_PROBE = "import importlib.util; print({mark!r}, 6 * 7, int(importlib.util.find_spec({module!r}) is not None))"
PROBE_SECONDS = 60.0  # an interpreter that has not answered the probe by then hangs (a wrapper waiting on something)
PROBE_TIMEOUT = "QKIT_ENGINE_PROBE_TIMEOUT"  # seconds, overriding PROBE_SECONDS (a test need not wait a minute)
_PROBE_MAX = 3600.0


def probe_seconds() -> float:
    """How long an engine interpreter's probe may take: ``$QKIT_ENGINE_PROBE_TIMEOUT`` seconds when set, else
    ``PROBE_SECONDS``. A value that is not a number of seconds in (0, 3600] is refused in one line
    (``InputError``) naming the variable."""
    raw = os.environ.get(PROBE_TIMEOUT)
    if raw is None:
        return PROBE_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= _PROBE_MAX:  # NaN fails too
        raise InputError(f"${PROBE_TIMEOUT}={raw!r} is not a number of seconds in (0, {_PROBE_MAX:g}]; set it to "
                         f"how long an engine interpreter may take to answer qkit's probe (default {PROBE_SECONDS:g}), "
                         "or unset it")
    return seconds


def _named(python: str | None) -> str:
    """Where the interpreter came from, for the line that refuses it."""
    return "EngineOptions.python" if python else f"${ENGINE_PYTHON}"


def check_importable(module: str, python: str | None, *, runtime: str, extra: str, package: str) -> str:
    """Raise ``InputError`` in one line when ``module`` cannot be imported by the worker's interpreter;
    return that interpreter. In qkit's own interpreter this is ``importlib.util.find_spec`` (no import:
    milliseconds); in another one, a ``python -c`` asking the same (tens of milliseconds), whose answer must
    be Python's: a path that is missing, a directory, not executable, or a program that is not Python
    (``/bin/false``, ``/bin/echo``, a script printing something else) is refused naming the variable."""
    exe = engine_python(python)
    # abspath, not resolve: a virtual environment's python is a symlink to the same binary as qkit's, yet
    # another environment with other packages.
    own = os.path.abspath(exe) == os.path.abspath(sys.executable)
    install = f"pip install 'qkit[{extra}]'"
    if own:
        if importlib.util.find_spec(module) is None:
            raise InputError(f"--runtime {runtime} needs {package}, which this Python lacks: {install} "
                             f"(or point ${ENGINE_PYTHON} at an interpreter that has it)")
        return exe
    where, fix = _named(python), f"point {_named(python)} at a Python that has {package}"
    if Path(exe).is_dir():
        raise InputError(f"the engine interpreter {exe} (--runtime {runtime}, from {where}) is a directory, not a Python; {fix}")
    if shutil.which(exe) is None:
        why = "is not executable" if Path(exe).is_file() else "does not exist"
        raise InputError(f"the engine interpreter {exe} (--runtime {runtime}, from {where}) {why}; {fix}")
    seconds = probe_seconds()
    try:
        # cwd "/": ``python -c`` puts the working directory on sys.path, which must not shadow the module. In a
        # group of its own, ended with everything it started when it answers, fails or times out.
        done = processes.run([exe, "-c", _PROBE.format(mark=_PROBE_MARK, module=module)], timeout=seconds, cwd="/")
    except subprocess.TimeoutExpired:
        raise InputError(f"the engine interpreter {exe} (--runtime {runtime}, from {where}) did not answer within "
                         f"{seconds:g} s (stopped, with what it started); {fix}") from None
    except OSError as e:
        raise InputError(f"the engine interpreter {exe} (--runtime {runtime}, from {where}) cannot run "
                         f"({e.strerror or e}); {fix}") from None
    answers = [ln.split() for ln in done.stdout.splitlines()]
    found = next((a[2] for a in answers if len(a) == 3 and a[0] == _PROBE_MARK and a[1] == "42"), None)
    if done.returncode != 0 or found not in ("0", "1"):
        said = (done.stdout or done.stderr).strip().splitlines()
        shown = f", printing {said[0][:80]!r}" if said else ""
        raise InputError(f"the engine interpreter {exe} (--runtime {runtime}, from {where}) is not a Python that "
                         f"runs (exit {done.returncode}{shown}); {fix}")
    if found == "0":
        raise InputError(f"--runtime {runtime} needs {package}, which {exe} (from {where}) lacks: {install} in that "
                         f"environment, or point {where} at one that has it")
    return exe


def load_worker_io():
    """``_worker_io`` as a module, for tests and for a worker run in-process (never needed by ``run_worker``)."""
    spec = importlib.util.spec_from_file_location("_qkit_worker_io", WORKER_IO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_worker(
    script: Path,
    request: dict,
    arrays: dict[str, np.ndarray] | None = None,
    *,
    python: str | None = None,
    timeout: float | None = None,
    workdir: Path | None = None,
    name: str = "engine",
    env: dict[str, str] | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run ``python script D`` on ``request`` and ``arrays``; return the worker's result and output arrays.

    ``script``: a worker (see the module docstring); ``request``: JSON-able; ``arrays``: name -> array
    (names are file stems: letters, digits, ``.``, ``_``, ``-``); ``python``: the interpreter
    (``engine_python``); ``timeout``: seconds before the process group is killed (None: no limit);
    ``workdir``: the parent of the scratch directory (default ``$TMPDIR/qkit-engine-PID-RANDOM``, removed
    after); ``name``: the engine's name in messages; ``env``: extra environment variables.

    Returns ``(result, outputs)``: ``result`` the worker's ``result.json`` without ``status``, ``outputs``
    name -> array memory-mapped copy-on-write. Raises ``EngineRefused`` or ``InputError`` as the module
    docstring says; ``result["seconds"]`` is added: the worker's wall time, start to exit."""
    if workdir is not None:
        return _run_in(Path(workdir), script, request, arrays or {}, python, timeout, name, env)
    with temporary_directory(TMP_PREFIX) as tmp:
        return _run_in(Path(tmp), script, request, arrays or {}, python, timeout, name, env)


def _run_in(parent: Path, script: Path, request: dict, arrays: dict[str, np.ndarray], python: str | None,
            timeout: float | None, name: str, env: dict[str, str] | None) -> tuple[dict, dict[str, np.ndarray]]:
    d = parent / "exchange"
    shutil.rmtree(d, ignore_errors=True)
    (d / "in").mkdir(parents=True)
    (d / "out").mkdir()
    for key, value in arrays.items():
        _check_name(key)
        np.save(d / "in" / f"{key}.npy", np.ascontiguousarray(value), allow_pickle=False)
    (d / "request.json").write_text(json.dumps(request, sort_keys=True))
    cmd = [engine_python(python), str(Path(script).resolve()), str(d)]
    environment = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # The group is killed when the block ends: the worker exited (an engine child it left behind must not
    # outlive it), timed out, or an exception, Ctrl-C or SIGTERM came: nothing of the engine is left running.
    with open(d / "log.txt", "wb") as log, processes.group(cmd, cwd=d, stdout=log, stderr=subprocess.STDOUT,
                                                           stdin=subprocess.DEVNULL, env=environment) as proc:
        try:
            processes.wait(proc, timeout)
        except subprocess.TimeoutExpired:
            raise EngineRefused(f"{name} did not finish within {timeout:g} s (stopped)") from None
    rc = proc.returncode
    seconds = time.perf_counter() - t0
    tail = _log_tail(d / "log.txt")
    result_file = d / "result.json"
    if not result_file.exists():
        last = next((ln for ln in reversed(tail) if ln.strip()), "no output")
        raise EngineRefused(f"{name} exited with status {rc} before answering: {last.strip()[:300]}")
    result = json.loads(result_file.read_text())
    status = result.pop("status", None)
    if status == "refused":
        raise EngineRefused(str(result.get("reason", "no reason given")))
    if status == "input_error":
        raise InputError(str(result.get("reason", "the engine refused its input")))
    if status != "ok":
        raise EngineRefused(f"{name} answered status {status!r}: {result.get('reason', '')}".strip())
    outputs = {p.stem: _load(p) for p in sorted((d / "out").glob("*.npy"))}
    result["seconds"] = seconds
    result["log"] = tail
    return result, outputs


def _load(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="c", allow_pickle=False)
    except ValueError:  # an empty array cannot be memory-mapped
        return np.load(path, allow_pickle=False)


def _check_name(key: str) -> None:
    if not key or not all(c.isalnum() or c in "._-" for c in key) or key.startswith("."):
        raise ValueError(f"array name {key!r}: use letters, digits, '.', '_' and '-'")


def _log_tail(path: Path) -> list[str]:
    try:
        lines = path.read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return lines[-LOG_TAIL_LINES:]


__all__ = ["ENGINE_PYTHON", "PROBE_TIMEOUT", "TMP_PREFIX", "WORKER_IO", "check_importable", "engine_python",
           "load_worker_io", "probe_seconds", "run_worker"]
