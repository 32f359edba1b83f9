"""A step's peak resident memory, measured in a child process of its own (``tests/test_memory_bounds.py``,
``tests/test_max_memory.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

# ``python -c PEAK MODULE ARGS...``: the module run as ``python -m`` would, then its own peak resident memory
# (VmHWM) printed last. Not wait4's ru_maxrss: Linux carries the parent's peak (the pytest process's) into
# a child across fork and exec.
PEAK = """
import atexit, runpy, sys
def hwm():
    with open("/proc/self/status") as fh:
        print("VmHWM", [int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM:")][0], flush=True)
atexit.register(hwm)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def peak_rss(module_args: list[str]) -> int:
    """Peak RSS of ``python -m MODULE ARGS`` in a child of its own, on one thread; it must exit 0."""
    r = subprocess.run([sys.executable, "-c", PEAK, *module_args], capture_output=True, text=True, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    return int(r.stdout.split("VmHWM")[-1].split()[0])
