"""``--executor ray``: eval rows and plan costs as Ray tasks give the serial run's numbers; refusals; a dead worker.

One local Ray cluster for the module (``ray start --head`` on 127.0.0.1, 2 CPUs: two workers), reached
with ``--ray-address``; stopped in the fixture's finalizer, after which no raylet may be left.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY_TEXT, make_tiny_llama

from qkit.cli import app
from qkit.errors import ExecutorError, InputError
from qkit.executors import SERIAL_EXECUTOR, ExecutorOptions, RayExecutor

ray = pytest.importorskip("ray", reason="needs Ray (pip install 'qkit[ray]')")

runner = CliRunner()
RAY = str(Path(sys.executable).with_name("ray"))
TIMING = {"seconds", "build_seconds", "seconds_total"}  # wall-clock fields: the only ones allowed to differ
EVAL_FAST = ["--tokens", "128", "--device", "cpu", "--schemes", "int8-row,int4-g32,nf4,int4-tensor,int8-tensor,q8_0"]
PLAN_FAST = ["--format", "gguf", "--target-bits", "4.6", "--calibration-samples", "2", "--calibration-seqlen", "32",
             "--check-windows", "2", "--device", "cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raylets() -> list[str]:
    r = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True)
    return r.stdout.split()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``HOST:PORT`` of a 2-CPU head node on the loopback address, started for this module, and stopped
    (``ray stop --force``) after it: then no raylet is left."""
    if _raylets():
        pytest.skip("a Ray cluster is already running on this machine")
    port = _free_port()
    # Ray 2.60 turns token authentication on for `ray start` when ~/.ray/auth_token exists (any earlier local
    # ray.init writes one) but not for a driver connecting by address: off on both sides for this test cluster.
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "disabled")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # workers import this qkit
    temp = tmp_path_factory.mktemp("ray")
    subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                    "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp)],
                   check=True, capture_output=True, env=env, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        patch.undo()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        deadline = time.time() + 20
        while _raylets() and time.time() < deadline:
            time.sleep(0.5)
        assert not _raylets(), "raylet still running after ray stop"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_llama(d)
    corpus = d.parent / "text.txt"
    corpus.write_text(TINY_TEXT * 3)
    return d, str(corpus)


def _numbers(doc, path=""):
    """Every leaf of a JSON document but the wall-clock fields, by path."""
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() if key not in TIMING for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, val in enumerate(doc) for k, v in _numbers(val, f"{path}[{i}]").items()}
    return {path: doc}


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_eval_rows_on_ray_are_the_serial_rows(tiny, cluster, tmp_path):
    model, corpus = tiny
    out = {}
    for name, extra in (("serial", []), ("ray", ["--executor", "ray", "--ray-address", cluster])):
        out[name] = tmp_path / f"{name}.json"
        r = runner.invoke(app, ["eval", str(model), "--corpus", corpus, *EVAL_FAST, *extra, "--json", str(out[name])])
        assert r.exit_code == 0, r.output
    serial, fanned = (json.loads(out[k].read_text()) for k in ("serial", "ray"))
    assert [r["scheme"] for r in fanned["rows"]] == ["reference", "int8-row", "int4-g32", "nf4", "int4-tensor", "int8-tensor", "q8_0"]
    a, b = _numbers(serial), _numbers(fanned)
    assert a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}
    assert not differ
    # the rows measured something (not every row equal to the reference)
    assert fanned["rows"][4]["kld"] > fanned["rows"][1]["kld"] > 0


def test_plan_costs_on_ray_are_the_serial_costs(wide_model, cluster, tmp_path):
    plans = {}
    for name, extra in (("serial", []), ("ray", ["--executor", "ray", "--ray-address", cluster])):
        out = tmp_path / f"{name}.json"
        r = runner.invoke(app, ["plan", str(wide_model), "-o", str(out), *PLAN_FAST, *extra])
        assert r.exit_code == 0, r.output
        plans[name] = json.loads(out.read_text())
    serial, fanned = (plans[k]["tensors"] for k in ("serial", "ray"))
    assert len(serial) == 14 and serial.keys() == fanned.keys()
    for name in serial:  # every candidate's bytes and predicted KL (==), and the type chosen
        assert fanned[name]["candidates"] == serial[name]["candidates"], name
        assert fanned[name] == serial[name], name
    assert sum(t["predicted_kl"] for t in serial.values()) > 0  # real costs, not all zero
    assert len({t["type"] for t in serial.values()}) > 1  # a mix: the costs decided something


@pytest.mark.parametrize("args, message", [
    (["--executor", "dask"], "unknown executor 'dask'"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address is for --executor ray"),
    (["--executor", "ray", "--ray-address", "nonsense"], "must be HOST:PORT"),
])
def test_bad_executor_options_are_refused_in_one_line(tiny, tmp_path, args, message):
    model, corpus = tiny
    for command in (["eval", str(model), "--corpus", corpus, "--json", str(tmp_path / "x.json")],
                    ["plan", str(model), "-o", str(tmp_path / "p.json"), "--target-bits", "4"]):
        r = runner.invoke(app, [*command, *args])
        assert r.exit_code == 2, r.output
        assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert list(tmp_path.iterdir()) == []


def test_unreachable_address_is_refused_before_the_model_loads(tiny, tmp_path):
    model, corpus = tiny
    port = _free_port()  # nothing listens there
    t0 = time.perf_counter()
    r = runner.invoke(app, ["eval", str(model), "--corpus", corpus, "--executor", "ray", "--ray-address",
                            f"127.0.0.1:{port}", "--json", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "no Ray cluster answers there" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "loading" not in r.output
    assert time.perf_counter() - t0 < 10 and list(tmp_path.iterdir()) == []


def test_without_ray_the_executor_is_refused(tiny, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(InputError, match=r"--executor ray needs Ray: pip install 'qkit\[ray\]'"):
        ExecutorOptions("ray").validate()
    model, corpus = tiny
    r = runner.invoke(app, ["eval", str(model), "--corpus", corpus, "--executor", "ray", "--json", str(tmp_path / "x.json")])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == "error: --executor ray needs Ray: pip install 'qkit[ray]'"
    assert list(tmp_path.iterdir()) == []


def _die_on(_shared, item):
    """A task that kills its own worker process on item 2 (SIGKILL: as the OOM killer does)."""
    if item == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return item * item


def test_the_executors_map_in_order(cluster):
    assert list(SERIAL_EXECUTOR.map(lambda s, x: s + x, [3, 1, 2], 10)) == [13, 11, 12]
    with ExecutorOptions("ray", cluster).open(1) as ex:
        assert isinstance(ex, RayExecutor)
        assert list(ex.map(_square_plus, [5, 0, 7, 1], 1)) == [26, 1, 50, 2]
        with pytest.raises(InputError, match="raised in a task"):
            list(ex.map(_raises, [1]))
        with pytest.raises(ExecutorError, match="a Ray worker died while running task 3 of 4"):
            list(ex.map(_die_on, [0, 1, 2, 3]))
    assert not ray.is_initialized()  # disconnected after the block


def _square_plus(shared, x):
    return x * x + shared


def _raises(_shared, _x):
    raise InputError("raised in a task")


def test_a_worker_killed_mid_eval_gives_one_line_and_no_json(tiny, cluster, tmp_path, monkeypatch):
    """The row task's process is killed (SIGKILL) while it measures: one line, exit 2, no --json file, no
    row directory left by the driver."""
    from qkit.evaluation import runner as eval_runner

    monkeypatch.setattr(eval_runner, "measure_elsewhere", _killed_row)
    model, corpus = tiny
    out = tmp_path / "out.json"
    r = runner.invoke(app, ["eval", str(model), "--corpus", corpus, *EVAL_FAST, "--schemes", "int8-row,nf4",
                            "--executor", "ray", "--ray-address", cluster, "--json", str(out)])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a Ray worker died while running task" in errors[0], r.output
    assert "Traceback" not in r.output and "(raylet)" not in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # the driver's row directory (the reference's shared log-probabilities) is gone too
    assert not list(Path(tempfile.gettempdir()).glob(f"qkit-eval-{os.getpid()}-*"))


def _killed_row(job, target):
    if target.name == "nf4":
        os.kill(os.getpid(), signal.SIGKILL)
    from qkit.evaluation.engine_rows import measure_elsewhere

    return measure_elsewhere(job, target)


def test_a_local_cluster_qkit_starts_is_stopped_after(cluster):
    """Without --ray-address qkit starts a local cluster for the run and shuts it down after: the module's
    cluster's raylet is the only one left."""
    before = _raylets()
    with ExecutorOptions("ray").open(1) as ex:
        assert len(_raylets()) == len(before) + 1  # its own raylet
        assert list(ex.map(max, [2, 5], 3)) == [3, 5]  # a builtin: these workers lack tests/ on their path
    assert not ray.is_initialized()
    deadline = time.time() + 20
    while _raylets() != before and time.time() < deadline:
        time.sleep(0.5)
    assert _raylets() == before
