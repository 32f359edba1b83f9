"""The worker's side of ``qkit.evaluation.engines.worker``: standard library and numpy only, never qkit.

A worker script loads this file by path (its own directory must not be on ``sys.path``: see
``worker.py``), then hands ``serve`` its handler::

    io = load_io()                       # in the worker: see _worker_llama_cpp.py
    def handle(request, arrays, out):    # out: Outputs, where output arrays go
        ...
        return {"version": "1.2.3"}      # JSON-able; "status": "ok" is added
    io.serve(handle)

``serve`` reads ``D/request.json`` and ``D/in/*.npy`` (``D`` is ``sys.argv[1]``), calls the handler, and
writes ``D/result.json`` last. A handler raises ``Refused(reason)`` when the engine cannot run the row,
``BadInput(reason)`` when the job is wrong; any other exception is reported as a refusal naming its type
and message (the traceback goes to the log, ``D/log.txt``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np


class Refused(Exception):
    """The engine cannot run this row (its reason, one line)."""


class BadInput(Exception):
    """The job asks for something the engine will not do (one line saying what to change)."""


class Outputs:
    """Where a handler writes its output arrays: ``D/out/NAME.npy``."""

    def __init__(self, directory: str):
        self.directory = directory

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.npy")

    def save(self, name: str, value) -> None:
        np.save(self.path(name), np.ascontiguousarray(value), allow_pickle=False)

    def memmap(self, name: str, dtype, shape: tuple[int, ...]):
        """A writable ``.npy`` memory map: large arrays are filled in place, never held twice."""
        return np.lib.format.open_memmap(self.path(name), mode="w+", dtype=dtype, shape=shape)


def _write(directory: str, result: dict) -> None:
    tmp = os.path.join(directory, "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, sort_keys=True)
    os.replace(tmp, os.path.join(directory, "result.json"))  # the runner never reads half a result


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return " ".join(lines)[:500] if lines else ""


def serve(handler) -> None:
    """Run ``handler(request, arrays, outputs)`` on the exchange directory ``sys.argv[1]``."""
    directory = sys.argv[1]
    with open(os.path.join(directory, "request.json")) as f:
        request = json.load(f)
    inputs = os.path.join(directory, "in")
    arrays = {name[:-4]: np.load(os.path.join(inputs, name), allow_pickle=False)
              for name in sorted(os.listdir(inputs)) if name.endswith(".npy")}
    try:
        result = handler(request, arrays, Outputs(os.path.join(directory, "out")))
    except Refused as e:
        _write(directory, {"status": "refused", "reason": _one_line(e)})
        return
    except BadInput as e:
        _write(directory, {"status": "input_error", "reason": _one_line(e)})
        return
    except Exception as e:  # noqa: BLE001 - the engine's own failure: a refusal that names it
        traceback.print_exc()
        _write(directory, {"status": "refused", "reason": f"{type(e).__name__}: {_one_line(e)}"})
        return
    _write(directory, {"status": "ok", **(result or {})})
