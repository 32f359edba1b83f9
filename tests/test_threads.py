"""torch's thread count: the cores this process may use, or --threads, on every command that computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from qkit import threads
from qkit.cli import app
from qkit.errors import InputError


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_default_follows_the_affinity_mask():
    # A process pinned to one core gets one torch thread, whatever the machine has.
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); import torch; from qkit.threads import available_cores, set_threads; "
            "print(available_cores(), set_threads(), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1", "1"]


@pytest.mark.parametrize("text, cores", [("50000 100000\n", 1), ("250000 100000\n", 3), ("max 100000\n", None), ("garbage", None)])
def test_cgroup_quota(tmp_path, monkeypatch, text, cores):
    f = tmp_path / "cpu.max"
    f.write_text(text)
    monkeypatch.setattr(threads, "_CGROUP_CPU_MAX", f)
    assert threads._cgroup_quota_cores() == cores
    if cores is not None:
        assert threads.available_cores() == min(cores, len(os.sched_getaffinity(0)))


def test_bad_thread_count():
    with pytest.raises(InputError, match="--threads must be at least 1"):
        threads.set_threads(0)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", [
    ["quantize", "MODEL", "-o", "OUT", "--scheme", "int8-row"],
    ["inspect", "errors", "MODEL", "-s", "int8-row"],
    ["inspect", "matrix", "MODEL", "--top", "2"],
    ["inspect", "next-token", "MODEL", "The quick brown"],
    ["kv", "--config", "MODEL/config.json", "--measure", "--tokens", "8"],
])
def test_threads_option_sets_torch_threads(command, tiny_model_dir, tmp_path, restore_threads):
    target = 2 if torch.get_num_threads() == 1 else 1  # a value different from the current one
    args = [a.replace("MODEL", str(tiny_model_dir)).replace("OUT", str(tmp_path / "o")) for a in command]
    result = CliRunner().invoke(app, [*args, "--threads", str(target)])
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == target
