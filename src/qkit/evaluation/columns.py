"""The measures' columns of ``qkit eval``'s tables and of ``qkit report``'s quality table and frontier, from the
registry.

Layer 6 (``evaluation``), above ``measures`` and ``domains``: the renderers (``cli/eval.py``,
``report/data.py``, ``report/page.py``) add the row's name, bits, size and the like, and take every measure's
part from here, so a registered measure appears in the tables and the frontier with no edit to any of them. Over one text a column shows a row's own
value (``Measure.cell``); over an eval suite a per-domain measure shows the worst domain's value, named
(``domains.worst`` by the measure's ``worst`` and ``worst_key``), blank for the reference, and a measure
that is not per domain its row's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkit.evaluation.domains import worst
from qkit.evaluation.measures import FrontierPanel, Measure, measures, placed


def _shown(suite: bool) -> list[tuple[Measure, str]]:
    """The measures in qkit eval's table and each one's header, in registration order."""
    return [(m, m.suite_header if suite else m.header) for m in measures() if (m.suite_header if suite else m.header)]


def table_headers(suite: bool) -> list[str]:
    """The measure columns of qkit eval's table, over one text or over an eval suite (``suite``)."""
    return [header for _, header in _shown(suite)]


def table_cells(values: Mapping[str, Any], reference: bool, scored: int, suite: bool) -> list[str]:
    """One row's measure cells in qkit eval's table. ``values``: ``Row.values()``; ``reference``: the row is the
    reference; ``scored``: the positions scored (over one text); ``suite``: an eval suite's row, whose
    per-domain measures show their worst domain."""
    cells = []
    for m, _ in _shown(suite):
        if not (suite and m.per_domain):
            cells.append(m.cell(values, scored, reference))
            continue
        w = None if reference else worst(values.get("domains") or [], m.worst_key, m.worst)
        cells.append("" if w is None else f"{m.cell(w, w['scored_tokens'], False)} {w['name']}")
    return cells


def page_headers() -> list[str]:
    """The measure columns of qkit report's quality table."""
    return [m.page_header for m in measures() if m.page_header]


def page_cells(row: Mapping[str, Any], reference: bool) -> list[str]:
    """One row's measure cells in qkit report's quality table, from the row's JSON (``null``: not computed)."""
    return [m.page_cell(row, reference) for m in measures() if m.page_header]


def _in_domains() -> list[Measure]:
    """The per-domain measures in the per-domain table's order (``place``)."""
    return placed(measures(per_domain=True))


def domain_title() -> str:
    """The per-domain table's title after "per domain: ": the measures' ``domain_header``s, joined by " · "."""
    return " · ".join(m.domain_header for m in _in_domains() if m.domain_header)


def domain_cell(domain: Mapping[str, Any], reference: bool) -> str:
    """One domain's cell of a row in the per-domain table: every measure's ``domain_cell`` that says something,
    joined by " · ". ``domain``: one entry of ``Row.domains`` (its measures' values and ``scored_tokens``)."""
    cells = (m.domain_cell(domain, domain["scored_tokens"], reference) for m in _in_domains())
    return " · ".join(c for c in cells if c)


def domain_captions() -> list[str]:
    """What the per-domain table's caption says of its measures (``domain_caption``), in order."""
    return [m.domain_caption for m in _in_domains() if m.domain_caption]


def frontier_panels() -> list[tuple[str, str | None, FrontierPanel]]:
    """The frontier's panels, left to right (``place``): each measure's value key (``keys[0]``), its SE key
    (``keys[1]``, None for a measure of one key: no bars) and its ``FrontierPanel``."""
    return [(m.keys[0], m.keys[1] if len(m.keys) > 1 else None, m.frontier) for m in placed(measures()) if m.frontier]


__all__ = ["domain_captions", "domain_cell", "domain_title", "frontier_panels", "page_cells", "page_headers",
           "table_cells", "table_headers"]
