"""Numeric ranges: the one check that a number a user gives is finite and inside its range.

Layer 1 (beside ``lists.py``): every options dataclass's ``check``/``validate`` and every library entry
point call ``whole`` (an integer count) or ``real`` (a float), so a script calling the library gets the
same one-line refusal as the command line. A number outside its range is refused naming the option and
the range::

    --calibration-seqlen must be a whole number from 2 to 2,147,483,647, got 1111...1111 (309 digits)
    --target-bits must be a number above 0 and at most 64, got inf

Why every option has an upper bound, not only a lower one: Python's integers are unbounded and typer
reads ``--tokens 1111...1`` (309 digits) as one; the first ``float()`` of it (a memory estimate, a
budget) raises ``OverflowError``, and a float option reads ``nan``, ``inf`` and ``1e303``, each of which
either overflows later or turns every comparison false. The bounds are wide (``MAX_COUNT`` is int32's
largest, far above any token count, window or sample count a machine can hold) and each is named in
the refusal.
"""

from __future__ import annotations

import math
from typing import Any

from qkit.errors import InputError

MAX_COUNT = 2**31 - 1  # the largest int32: token counts, windows, samples, chunks, rows (torch indexes them so)
MAX_BYTES = 2**60  # 1 EiB: the largest size (--max-memory, --target-size, --max-shard-size) qkit takes
_DIGITS = 15  # an integer longer than this is shown by its ends and its length


def is_int(v: Any) -> bool:
    """An integer, not a bool (JSON's ``true`` is not the integer 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def show_number(v: Any) -> str:
    """``v`` as a refusal shows it: a 309-digit integer as ``1111...1111 (309 digits)``, a float by ``repr``
    (``nan``, ``inf``, ``1e+303``), anything else by a cut ``repr``."""
    if is_int(v):
        text = str(v)
        digits = len(text.lstrip("-"))
        return text if digits <= _DIGITS else f"{text[:5]}...{text[-4:]} ({digits} digits)"
    if isinstance(v, float):
        return repr(v)
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _bound(x: float | int) -> str:
    """A bound in words: ``2,147,483,647``, ``0.001``, ``65,504``."""
    if is_int(x) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"
    return f"{x:g}"


def span(lo: float | int, hi: float | int, *, integer: bool = False, above: bool = False) -> str:
    """The range in words: ``a whole number from 1 to 2,147,483,647``, ``a number above 0 and at most 64``."""
    noun = "a whole number" if integer else "a number"
    if above:
        return f"{noun} above {_bound(lo)} and at most {_bound(hi)}"
    return f"{noun} from {_bound(lo)} to {_bound(hi)}"


def whole(value: Any, option: str, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """``value`` when it is an integer with ``lo <= value <= hi``; else ``InputError`` naming ``option`` and the
    range (a bool, a float, NaN and a 309-digit integer included)."""
    if not (is_int(value) and lo <= value <= hi):
        raise InputError(f"{option} must be {span(lo, hi, integer=True)}, got {show_number(value)}")
    return value


def real(value: Any, option: str, lo: float, hi: float, *, above: bool = False) -> float:
    """``value`` as a float when it is a finite number with ``lo <= value <= hi`` (``above``: ``lo < value``);
    else ``InputError`` naming ``option`` and the range. NaN, infinities and integers too large for a float
    are refused; ``-0.0`` comes back as ``0.0`` (it would print as ``-0``)."""
    ok = (is_int(value) or isinstance(value, float)) and abs(value) <= 1e300 and math.isfinite(value)
    if ok:
        ok = (lo < value if above else lo <= value) and value <= hi
    if not ok:
        raise InputError(f"{option} must be {span(lo, hi, above=above)}, got {show_number(value)}")
    return float(value) + 0.0


__all__ = ["MAX_BYTES", "MAX_COUNT", "is_int", "real", "show_number", "span", "whole"]
