"""How many CPU threads torch runs with: the cores this process may actually use, or ``--threads``.

torch's own default is the machine's physical core count, which ignores the process's CPU affinity
(``taskset``, cgroup cpusets, Slurm and container CPU limits). Where two threads share cores with
other busy processes, torch's thread barriers wait on preempted threads and a run can take many times
longer than with one thread (docs/models-devices-threads.md, "Threads", has the measurement); ``--threads`` sets
the number explicitly.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from qkit.bounds import show_number
from qkit.errors import InputError

_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def _cgroup_quota_cores() -> int | None:
    """Cores a cgroup v2 CPU quota allows (``ceil(quota / period)``), ``None`` without a quota."""
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask, capped by a cgroup CPU quota.

    Falls back to ``os.cpu_count()`` where affinity is unknown (macOS, Windows).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota_cores()
    return max(1, min(cores, quota) if quota else cores)


def check_threads(threads: int | None) -> None:
    """Refuse a thread count below 1, or above the cores this process may use (call before any work):
    more threads than cores only adds barrier waits on preempted threads (``--threads 10000`` measured
    3x slower than 1 thread on a 2-core machine)."""
    if threads is None:
        return
    if threads < 1:
        raise InputError(f"--threads must be at least 1 (got {threads})")
    cores = available_cores()
    if threads > cores:
        raise InputError(
            f"--threads {show_number(threads)} is more than the {cores} CPU core{'s' if cores != 1 else ''} this process may use "
            f"(its CPU affinity and cgroup quota); pass --threads {cores} or fewer"
        )


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op CPU threads to ``threads`` (default: ``available_cores()``); return the number."""
    import torch

    check_threads(threads)
    n = threads or available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def one_torch_thread():
    """torch's intra-op pool at one thread for the block, then the count restored. For many small
    operations (GPTQ's column loop, the k-quant searches): with a pool every operation pays a barrier,
    which costs more than the operation when the cores are shared (measured: a 576x1536 GPTQ solve 1.3 s
    on one thread, 7.9 s on two, on a busy 2-core machine). Process-wide: not for concurrent callers."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield n
    finally:
        torch.set_num_threads(n)



# --------------------------------------------------------------------------- memory

_MEMINFO = Path("/proc/meminfo")
_CGROUP_MEMORY = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"))  # cgroup v2


def available_memory(device: str | None = None) -> int | None:
    """Bytes this process can still allocate: on a CUDA device the free memory the driver reports; on the
    CPU ``MemAvailable`` (``/proc/meminfo``), capped by a cgroup v2 limit (``memory.max - memory.current``).
    ``None`` where it cannot be told (no ``/proc``): callers then skip their memory check."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    found = None
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit, current = (p.read_text().strip() for p in _CGROUP_MEMORY)
        if limit != "max":
            left = max(0, int(limit) - int(current))
            found = left if found is None else min(found, left)
    except (OSError, ValueError):
        pass
    return found
