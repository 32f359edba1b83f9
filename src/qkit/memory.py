"""Memory sizes: the one parser of a size a user writes (``--max-memory 20GiB``, ``--max-shard-size 500MB``,
``--target-size 1GiB``), the memory this process may still take, and sizes printed back.

Layer 1 (beside ``threads.py``, whose ``available_memory`` it uses): no torch, no model, no printing.

Units, case-insensitive: ``B``; ``KB``/``MB``/``GB``/``TB`` are powers of 1000; ``KiB``/``MiB``/``GiB``/``TiB``
powers of 1024; a bare ``K``/``M``/``G``/``T`` is a power of 1024, as ``docker --memory``, ``ulimit``
and Slurm's ``--mem`` read it (memory is sold in binary units). A plain number is bytes.
"""

from __future__ import annotations

import os
import re
from fractions import Fraction

from qkit.bounds import MAX_BYTES, whole
from qkit.errors import InputError
from qkit.lists import shown
from qkit.threads import available_memory

GIB = 1 << 30

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str, what: str = "--max-memory") -> int:
    """Bytes of a size written ``8GiB``, ``512MiB``, ``20G``, ``1.5GB``, ``100MB`` or ``1048576`` (see the
    module's units), from 1 byte to ``MAX_BYTES`` (1 EiB); ``InputError`` naming ``what`` for anything else
    (a negative, zero, a fraction of a byte, an unknown unit, an empty string, a 309-digit number).

    The number is read exactly (``Fraction``), never through a float: ``float("1" * 309)`` is finite but
    ``float("1" * 310)`` is infinite, and ``int`` of it raised ``OverflowError``."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise InputError(f"{what} {shown(text)} is not a size; write e.g. 8GiB, 512MiB, 20G or 1500MB")
    if len(m.group(1)) > 40:  # more digits than any size up to 1 EiB needs: refused before any arithmetic
        n = MAX_BYTES + 1
    else:
        n = int(Fraction(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise InputError(f"{what} {shown(text)} is less than one byte; write e.g. 8GiB, 512MiB, 20G or 1500MB")
    if n > MAX_BYTES:
        raise InputError(f"{what} {shown(text)} is more than 1 EiB (2**60 bytes), the largest size qkit takes; "
                         "write e.g. 8GiB, 512MiB, 20G or 1500MB")
    return n


def check_bytes(n: object, what: str) -> int:
    """``n`` when it is a whole number of bytes from 1 to ``MAX_BYTES``, as a script passes a size to the
    library (``max_memory=``, ``target_size=``, ``max_shard_bytes=``); else one ``InputError`` naming ``what``."""
    return whole(n, what, 1, MAX_BYTES)


def gib(n: float) -> str:
    """``n`` bytes as ``12.34 GiB`` (what every memory message prints)."""
    return f"{n / GIB:.2f} GiB"


def process_rss() -> int | None:
    """This process's resident memory now (``VmRSS``), or None where it cannot be told."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # optional: macOS and other systems without /proc
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def available_ram() -> int | None:
    """Bytes of RAM this process can still take: psutil's ``available`` when psutil is installed, else
    ``MemAvailable`` (``/proc/meminfo``); either capped by a cgroup v2 limit (``threads.available_memory``).
    None where nothing can tell."""
    found = []
    try:  # optional: where /proc is missing it is the only source
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except ImportError:
        pass
    proc = available_memory()
    if proc is not None:
        found.append(proc)
    return min(found) if found else None


__all__ = ["GIB", "available_ram", "check_bytes", "gib", "parse_size", "process_rss"]
