"""A metric of ``qkit eval`` as a registered measure: what it reads, what it writes, how it is shown.

Layer 6 (``evaluation``), below ``domains``, ``measuring`` and the table's layout (``columns``). Every engine
returns the same raw values for a row (``measuring.Measured``: per scored position the row's NLL, its KL to
the reference and whether its argmax is the reference's, ``TokenScores``; the battery's decoded answers;
the greedy-agreement matrix). A measure computes its numbers from those, handed to it as ``Evidence``, so a
new metric needs no engine, worker, ``Row`` or renderer edit: one class satisfying ``Measure`` and one
``MEASURES.register`` line (``measures/builtin.py``, or a module imported from ``measures/__init__.py``).

What each surface does with a measure, in registration order:

- ``measuring.assemble_row`` calls ``compute`` on the whole row (the JSON keys ``keys``; a ``Row`` field
  where one of that name exists, else ``Row.measures``, written into the row's JSON beside the fields), and
  ``domains.domain_rows`` calls it again on each domain of an eval suite when ``per_domain``;
- ``qkit eval``'s table (``columns.table_headers``/``table_cells``) shows ``header`` with ``cell`` over one
  text, and over an eval suite ``suite_header`` with the worst domain's ``cell`` (``worst``), named;
- ``qkit report``'s quality table (``columns.page_headers``/``page_cells``) shows ``page_header`` with
  ``page_cell``, from the row's JSON (``null`` where the number could not be computed); ``fields`` are the
  JSON types ``qkit report`` checks before it draws anything (``report.inputs``);
- over an eval suite, ``qkit eval``'s per-domain table (``columns.domain_title``/``domain_cell``) joins, in
  each domain's cell, every per-domain measure's ``domain_cell`` (its ``domain_header`` in the title, its
  ``domain_caption`` under the table);
- ``qkit report``'s frontier (``columns.frontier_panels``) draws bits/w against each measure with a
  ``frontier`` panel (``FrontierPanel``: its ``keys[0]``, with ± 2 ``keys[1]`` bars).

The per-domain table and the frontier put their measures in ``place`` order (then registration order). An
empty header, or no panel, leaves the measure out of that surface; its numbers are in the JSON either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qkit.errors import InputError
from qkit.evaluation.battery import Question
from qkit.evaluation.token_scores import TokenScores
from qkit.jsonfields import Kind
from qkit.registry import Registry


@dataclass(frozen=True)
class Evidence:
    """What a measure reads for one row (or one domain of it).

    ``scores``: the row's per-position values on the scored positions, ``nll`` float64 ``[n]`` (-log q of
    each scored token), ``kl`` float64 ``[n]`` (KL(reference || row) at each position, NaN where the
    engine gave only the top-k log-probabilities), ``top1`` bool ``[n]`` (argmax row == argmax reference);
    ``reference``: the reference's own scores on the same positions (its ``nll`` is -log p), None when the
    row is the reference itself; ``outputs``: the row's decoded battery answers, ``questions`` the battery
    (empty with ``--no-battery``); ``reference_answers``: the reference's right/wrong per question (None for
    the reference itself); ``agree``: bool ``[B, n]``, the row's teacher-forced argmax equals the
    reference's greedy token after each battery prompt. A domain's ``Evidence`` holds only ``scores`` and
    ``reference`` cut to its positions (a ``per_domain`` measure reads nothing else)."""

    scores: TokenScores
    reference: TokenScores | None
    outputs: Sequence[str] = ()
    questions: Sequence[Question] = ()
    reference_answers: Sequence[bool] | None = None
    agree: torch.Tensor | None = None


@dataclass(frozen=True)
class FrontierPanel:
    """A measure's panel of ``qkit report``'s frontier: bits/w against its value, ± 2 SE bars. ``name``: what the
    page calls it; ``label``: the y axis; ``title``; ``scale``: ``"log"`` (where every value is at least
    ``figures.LOG_MIN``) or ``"symlog"`` (linear within ±1); ``column``, ``digits`` and ``sign``: its column of
    the points' table (``sign``: a ``+`` before a positive value)."""

    name: str
    label: str
    title: str
    scale: str
    column: str
    digits: int
    sign: bool = False


class Measure(Protocol):
    """One metric of ``qkit eval`` (see the module docstring)."""

    keys: tuple[str, ...]  # the JSON keys ``compute`` writes, on a row and on each domain's entry
    fields: Mapping[str, Kind]  # the JSON type of each key qkit report reads (checked before the page is drawn)
    per_domain: bool  # computed from ``scores``/``reference`` alone, so also on each domain of an eval suite
    header: str  # qkit eval's column over one text ("": not in the table)
    suite_header: str  # qkit eval's column over an eval suite ("": not in the table)
    worst: Callable[..., Any] | None  # per_domain: ``max`` or ``min``, the suite column's domain (by worst_key)
    worst_key: str
    page_header: str  # qkit report's quality-table column ("": not on the page)
    domain_header: str  # its part of the per-domain table's title ("": none)
    domain_caption: str  # what the per-domain table's caption says of it ("": nothing)
    frontier: FrontierPanel | None  # its panel of qkit report's frontier (None: not drawn)
    place: int  # the per-domain table's and the frontier's order (smallest first)

    def compute(self, evidence: Evidence) -> dict[str, Any]:
        """``{key: value}`` for every key of ``keys``; NaN for a number that cannot be computed."""
        ...

    def blank(self) -> dict[str, Any]:
        """The values of a row an engine could not run: no numbers (NaN, ``null`` in JSON)."""
        ...

    def cell(self, values: Mapping[str, Any], scored: int, reference: bool) -> str:
        """qkit eval's text for a row's (or a domain's) ``values``; ``scored``: its scored positions;
        ``reference``: the row is the reference."""
        ...

    def page_cell(self, values: Mapping[str, Any], reference: bool) -> str:
        """qkit report's text for a row's JSON ``values`` (a number that could not be computed is ``null``)."""
        ...

    def domain_cell(self, values: Mapping[str, Any], scored: int, reference: bool) -> str:
        """Its text in the per-domain table for one domain's ``values`` of a row ("": none in that row)."""
        ...


class TokenMeasure:
    """Defaults for a measure: computed per domain too, shown on every row, a refused row's keys NaN, the
    page's text and the per-domain table's the table's. A subclass sets ``keys``, the headers it wants (a
    ``frontier`` panel) and ``compute`` / ``cell``."""

    keys: tuple[str, ...] = ()
    fields: Mapping[str, Kind] = {}
    per_domain = True
    header = ""
    suite_header = ""
    worst: Callable[..., Any] | None = max
    worst_key = ""
    page_header = ""
    domain_header = ""
    domain_caption = ""
    frontier: FrontierPanel | None = None
    place = 10

    def compute(self, evidence: Evidence) -> dict[str, Any]:
        raise NotImplementedError

    def blank(self) -> dict[str, Any]:
        return {k: math.nan for k in self.keys}

    def cell(self, values: Mapping[str, Any], scored: int, reference: bool) -> str:
        return fmt_number(num(values.get(self.keys[0])), ".4f")

    def page_cell(self, values: Mapping[str, Any], reference: bool) -> str:
        return self.cell(values, 0, reference)

    def domain_cell(self, values: Mapping[str, Any], scored: int, reference: bool) -> str:
        return self.cell(values, scored, reference) if self.domain_header else ""


MEASURES: Registry[Measure] = Registry("measure", error=InputError)


def measures(per_domain: bool = False) -> list[Measure]:
    """The registered measures in order (``per_domain``: only those computed on each domain too)."""
    return [m for _, m in MEASURES.items() if m.per_domain or not per_domain]


def placed(chosen: list[Measure]) -> list[Measure]:
    """``chosen`` in ``place`` order (the per-domain table's and the frontier's), ties in registration order."""
    return sorted(chosen, key=lambda m: m.place)


def measure_values(evidence: Evidence, per_domain: bool = False) -> dict[str, Any]:
    """Every measure's values for ``evidence``, in registration order (``per_domain``: a domain's)."""
    out: dict[str, Any] = {}
    for m in measures(per_domain):
        out.update(m.compute(evidence))
    return out


def blank_values() -> dict[str, Any]:
    """Every measure's values for a row that was not run."""
    out: dict[str, Any] = {}
    for m in measures():
        out.update(m.blank())
    return out


def json_fields() -> dict[str, Kind]:
    """The JSON type of every key the registered measures write (what ``qkit report`` checks)."""
    return {k: kind for m in measures() for k, kind in m.fields.items()}


# --------------------------------------------------------------------------- text of a number


def num(x: Any) -> float:
    """``x`` as a float; NaN for what is not a finite number (JSON ``null``, a missing key, a string)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    return float(x)


def fmt_number(value: float, spec: str) -> str:
    """``value`` formatted with ``spec``; "-" where it is not finite."""
    return format(value, spec) if math.isfinite(value) else "-"


def fmt_change(pct: float, se: float) -> str:
    """A perplexity change: "+6.5% ± 1.0" (paired SE), or "x56,925" once it is a multiple, not a percentage;
    "not finite" / "+6.5% (no SE)" where a number could not be computed (never a bare "± nan")."""
    if not math.isfinite(pct):
        return "not finite"
    if pct >= 900:
        return f"x{1 + pct / 100:,.0f}"
    return f"{pct:+,.1f}% ± {se:,.1f}" if math.isfinite(se) else f"{pct:+,.1f}% (no SE)"


def fmt_estimate(value: float, se: float, scored: int, digits: int = 2) -> str:
    """"12.34 ± 0.56"; without a standard error, says so and on how many tokens (never "± nan")."""
    if not math.isfinite(value):
        return "not finite"
    if not math.isfinite(se):
        return f"{value:,.{digits}f} (no standard error on {scored:,} token{'s' if scored != 1 else ''})"
    return f"{value:,.{digits}f} ± {se:,.{digits}f}"


def fixed(v: float, digits: int, sign: bool = False) -> str:
    """``v`` with ``digits`` decimals and thousands separators (``sign``: a ``+`` before a positive number);
    from 1e9 up in 4 significant digits (``1.5e+12``): a checked input is at most 1e30, and even that is never
    printed as 31 digits."""
    plus = "+" if sign else ""
    return f"{v:{plus},.{digits}f}" if abs(v) < 1e9 else f"{v:{plus}.4g}"


def estimate(value: Any, se: Any, digits: int, unit: str = "") -> str:
    """The page's "0.0012 ± 0.0001": "-" without a value, the value alone without an SE; an SE below the
    value's last digit keeps one significant digit (never a bare "± 0.0000")."""
    v, s = num(value), num(se)
    if not math.isfinite(v):
        return "-"
    if not math.isfinite(s):
        return f"{fixed(v, digits)}{unit}"
    text = fixed(s, digits) if s == 0 or s >= 10**-digits else f"{s:.1g}"
    return f"{fixed(v, digits)}{unit} ± {text}"


__all__ = ["MEASURES", "Evidence", "FrontierPanel", "Measure", "TokenMeasure", "blank_values", "estimate", "fixed", "fmt_change",
           "fmt_estimate", "fmt_number", "json_fields", "measure_values", "measures", "num", "placed"]
