"""Benchmarks refuse a malformed command line in one line before any model is written or loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("bench_scale.py", ["--steps", "plan,foo", "--dir", "{tmp}"],
         "--steps: unknown foo (of plan, quantize, rtn, imatrix, rtn-imatrix, ct, gptq, awq)"),
        ("bench_scale.py", ["--steps", "rtn-imatrix,imatrix", "--dir", "{tmp}"], "--steps: rtn-imatrix needs the imatrix step before it"),
        ("bench_gptq_spread.py", ["--seeds", "0,x"], "--seeds: integers separated by commas, got '0,x'"),
        ("bench_gptq_spread.py", ["--seeds", " , "], "--seeds: none given"),
        ("bench_gptq_spread.py", ["--versus", "/nonexistent/a.gguf"], "--versus: no such file: /nonexistent/a.gguf"),
    ],
)
def test_a_bad_command_line_is_refused_in_one_line(tmp_path, script, args, message):
    argv = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1  # sys.exit(message)
    assert r.stderr.strip() == message
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no model written under --dir
