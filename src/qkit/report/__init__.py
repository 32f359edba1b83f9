"""``qkit report``: one self-contained HTML page of an eval, inspect, plan, kv and budget run.

The top layer with ``cli``: it reads what the commands' ``--json`` wrote (``inputs``), turns it into the
values each figure plots (``data``: pure functions, tested against the JSON), draws them with matplotlib
(``figures``, an optional extra imported on first use), lays out the page (``page``) and writes it
atomically (``build``). Nothing imports it but the CLI.

    from qkit.report import build_report, write_report
    r = build_report(["eval.json", "outliers.json"], run="none")
    write_report(r, "report.html", png_dir="figures")
"""

from qkit.report.build import (
    DEFAULT_STEPS,
    STEPS,
    Report,
    build_report,
    is_png_directory,
    is_report_file,
    parse_steps,
    write_report,
)
from qkit.report.inputs import KINDS, Inputs, detect_kind, read_inputs
from qkit.report.page import SECTION_IDS, render

__all__ = ["DEFAULT_STEPS", "KINDS", "SECTION_IDS", "STEPS", "Inputs", "Report", "build_report", "detect_kind",
           "is_png_directory", "is_report_file", "parse_steps", "read_inputs", "render", "write_report"]
