"""The schemes table of ``docs/schemes.md`` and the ``--scheme`` help text, generated from the registry.

Adding a scheme (its registration, with its one-line ``description``) changes the registry, the help
and the docs' table from one place, as llama.cpp's ``QUANT_OPTIONS`` drives its usage text. The docs'
table lies between ``<!-- schemes:begin -->`` and ``<!-- schemes:end -->``; ``python -m qkit.schemes.table``
prints it, ``python -m qkit.schemes.table --write docs/schemes.md`` replaces it, and
``tests/test_scheme_protocol.py`` checks that the file holds what this module generates.

Every number is computed from the scheme itself: bits per weight are ``8 * nbytes_for(shape) / n`` (fp16
scales where the scheme lets you choose), the stored parts are ``part_layout`` written with the
weight's sizes (``rows``, ``cols``, ``n = rows * cols``).
"""

from __future__ import annotations

from collections.abc import Callable

import math
import sys
from fractions import Fraction
from pathlib import Path

import torch

from qkit.schemes.base import Recipe, Scheme
from qkit.schemes.registry import FAMILIES, get_scheme, scheme_names

BEGIN, END = "<!-- schemes:begin -->", "<!-- schemes:end -->"
LARGE = (4096, 4096)  # a 7B-class projection
NARROW = (1536, 576)  # the default model's 576-wide rows: partial groups, k-quant width fallbacks
# A weight for the stored-parts column: rows != cols, and every size whole blocks of every scheme.
LAYOUT_SHAPE = (1024, 4096)


def bits_per_weight(scheme: Scheme, shape: tuple[int, int]) -> str:
    """``8 * nbytes_for(shape) / n``: exact as a short decimal where it is one, else ``≈`` four decimals."""
    value = Fraction(8 * scheme.nbytes_for(shape), math.prod(shape))
    for places in range(1, 5):
        if value * 10**places == round(value * 10**places):
            return f"{float(value):.{places}f}"
    return f"≈ {float(value):.4f}"


def _dim(d: int, rows: int, cols: int) -> str:
    """A size of a stored part in the weight's terms (``rows``, ``cols``, ``n``, a fraction of one of them)."""
    n = rows * cols
    for word, value in (("rows", rows), ("cols", cols), ("n", n)):
        if d == value:
            return word
    if d in (0, 1):
        return str(d)
    for word, value in (("cols", cols), ("n", n)):
        if value % d == 0:
            return f"{word}/{value // d}"
    per_col = Fraction(d, cols)  # bytes per weight of a row (llama.cpp's blocks)
    return f"cols × {per_col}" if per_col < 2 else str(d)


def stored_parts(scheme: Scheme) -> str:
    """``part_layout`` of a ``rows`` x ``cols`` weight: ``qweight`` uint8 ``[n/2]``, ``scales`` fp16 ``[rows, cols/128]``."""
    if isinstance(scheme, Recipe):
        return "per tensor, the parts of the type it gets (" + ", ".join(f"`{t.name}`" for t in scheme.types) + ")"
    rows, cols = LAYOUT_SHAPE
    words = []
    for part, (shape, dtype) in scheme.part_layout(LAYOUT_SHAPE).items():
        dims = ", ".join(_dim(d, rows, cols) for d in shape)
        words.append(f"`{part}` {_dtype(dtype)} `[{dims}]`")
    return ", ".join(words)


def _dtype(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


def _bits(scheme: Scheme, shape: tuple[int, int]) -> str:
    if isinstance(scheme, Recipe):  # the range of its types
        bits = sorted((bits_per_weight(t, shape) for t in scheme.types), key=float)
        return f"{bits[0]} to {bits[-1]}, by tensor"
    return bits_per_weight(scheme.resolve(shape), shape)  # a width fallback (q4_k -> q5_0) is what is stored


def rows() -> list[list[str]]:
    """One row per registered scheme, in registration order, then one per family (shown by its example)."""
    out = []
    for name in scheme_names():
        s = get_scheme(name)
        out.append([f"`{name}`", _bits(s, LARGE), _bits(s, NARROW), stored_parts(s), s.description])
    for f in FAMILIES:
        s = get_scheme(f.example)
        names = ", ".join(f"`{w}`" for w in f.names)
        out.append([f"{names} (family; `{f.example}` shown)", _bits(s, LARGE), _bits(s, NARROW), stored_parts(s), f.description])
    return out


def markdown() -> str:
    """The docs' table (without the markers)."""
    head = ["scheme", f"bits/weight, {LARGE[0]} × {LARGE[1]}", f"bits/weight, {NARROW[0]} × {NARROW[1]}",
            f"stored parts (`rows` × `cols` weight, `n` weights)", "description"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join(lines) + "\n"


def scheme_help() -> str:
    """The ``--scheme`` help: every registered name, then the families."""
    families = "".join(f"; or {f.spelling}" for f in FAMILIES)
    return f"{', '.join(scheme_names())}{families} (docs/schemes.md describes each)."


def replace_table(text: str, table: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
    """``text`` with what lies between the ``markers`` replaced by ``table``."""
    begin, end_marker = markers
    start, end = text.index(begin) + len(begin), text.index(end_marker)
    return text[:start] + "\n" + table + text[end:]


def table_in(text: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
    """What lies between the ``markers`` of ``text``."""
    begin, end = markers
    return text[text.index(begin) + len(begin) : text.index(end)].lstrip("\n")


def table_command(argv: list[str], make: Callable[[], str], markers: tuple[str, str], usage: str) -> int:
    """A docs-table module's command line: ``--write PAGE`` puts ``make()`` between the page's ``markers``;
    no argument prints it."""
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(replace_table(path.read_text(), make(), markers))
        return 0
    if argv:
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    sys.stdout.write(make())
    return 0


def main(argv: list[str]) -> int:
    return table_command(argv, markdown, (BEGIN, END), "python -m qkit.schemes.table [--write docs/schemes.md]")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
