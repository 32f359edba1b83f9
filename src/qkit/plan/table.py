"""The docs' table of formats and what a plan can mix in each, generated from the formats themselves.

``docs/plan.md`` holds it between ``<!-- formats:begin -->`` and ``<!-- formats:end -->``; rewrite it with
``python -m qkit.plan.table --write docs/plan.md`` (``tests/test_format_protocol.py`` checks it is current).
Every row asks the registered ``Format`` (``plan_types``, ``help``, ``ties_fused``) and each scheme its
``row_block``, so a format registered with one line appears here with no other edit.
"""

from __future__ import annotations

import sys

from qkit.export import REGISTRY
from qkit.plan.candidates import KEEP, ladder
from qkit.schemes import get_scheme
from qkit.schemes.table import table_command, table_in

MARKERS = ("<!-- formats:begin -->", "<!-- formats:end -->")


def _candidate(name: str) -> str:
    if name == KEEP:
        return f"`{KEEP}` (the source dtype)"
    block = get_scheme(name).row_block
    return f"`{name}`" + (f" ÷{block}" if block > 1 else "")


def markdown() -> str:
    """One row per format: what it stores and what loads it, and the plan's candidates, smallest first, each
    with the width it needs a multiple of (``÷N``: a tensor is offered the type only when its rows are whole
    blocks or groups of it, with no width fallback)."""
    lines = ["| `--format` | stores, loaded by | plan candidates, smallest first (÷N: width a multiple of N) |",
             "|---|---|---|"]
    for name, fmt in REGISTRY.items():
        if fmt.plan_types():
            cands = ", ".join(_candidate(n) for n in ladder(name))
            if fmt.ties_fused:
                cands += "; vLLM's fused layers (q/k/v, gate/up) share one type"
        else:
            cands = "none: one type, no mixes"
        lines.append(f"| `{name}` | {fmt.help} | {cands} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    return table_command(argv, markdown, MARKERS, "python -m qkit.plan.table [--write docs/plan.md]")


def current(text: str) -> str:
    """The table ``text`` (a docs page) holds between the markers."""
    return table_in(text, MARKERS)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
