"""The only module that imports rich: tables, progress bars, text histograms, one-line errors.

Library code never prints; the CLI hands plain data (headers, rows of strings, notes) to these helpers.

Every string printed here goes through ``printable`` first, whatever it is: a tensor name from a file,
an importance matrix's dataset, a config's ``model_type``, an error message quoting any of them. A
control character (C0 and C1, DEL, the bidirectional overrides and isolates, line and paragraph
separators) is shown escaped (``\\x1b``, ``\\u202e``), never emitted: a name from a hostile file cannot
recolour, retitle or rewrite the terminal. Text is handed to rich as ``Text``, never as markup, so a
name holding ``[link=...]`` or ``[red]`` is printed as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from qkit import jsontext, staging

# Where the output is not a terminal (a pipe, a file, CI), nothing is wrapped at an assumed width:
# tables print at their natural width, titles and notes on one line, captions wrapped at the wider of
# the table and MIN_FILE_WIDTH columns.
MIN_FILE_WIDTH = 120
_UNBOUNDED = 4096


def _console(stderr: bool) -> Console:
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, highlight=False, width=None if probe.is_terminal else _UNBOUNDED)


_out = _console(stderr=False)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

# What a terminal acts on instead of showing: C0 (tab and newline only where ``keep`` allows), DEL, C1, the
# bidirectional marks, embeddings, overrides and isolates (a name can look like another: CVE-2021-42574),
# and the Unicode line and paragraph separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: object, keep: str = "") -> str:
    """``str(text)`` with every control character shown escaped, as Python writes it in a string literal:
    ``"\\x1b]0;title\\x07"`` for ESC ] 0 ; title BEL, ``\\u202e`` for a right-to-left override. ``keep``:
    the characters of ``"\\t\\n"`` left as they are (a multi-line note); a one-line message keeps none.
    Text without control characters comes back unchanged (a backslash is not escaped)."""
    def escape(m: re.Match) -> str:
        c = m.group()
        return c if c in keep else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _UNSAFE.sub(escape, str(text))


def _text(text: object, style: str | None = None, keep: str = "\t\n") -> Text:
    """``text`` made printable, as rich ``Text`` (never parsed as markup)."""
    return Text(printable(text, keep), style=style or "")


def use_stderr_for_tables(flag: bool) -> None:
    """With ``--json -`` the JSON owns stdout; tables and notes move to stderr."""
    global _out
    _out = _console(stderr=flag)


def error(message: str) -> None:
    """``error: MESSAGE`` on stderr, on one line: the message's control characters, newlines too, escaped."""
    _err.print(Text("error: ", style="bold red") + _text(message, keep=""))


def warn(message: str) -> None:
    _err.print(Text("warning: ", style="bold yellow") + _text(message, keep=""))


def note(message: str, style: str | None = None) -> None:
    _out.print(_text(message, style), soft_wrap=True)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    caption: str | None = None,
    right: Sequence[int] | None = None,
    styles: Sequence[str | None] | None = None,
    show_header: bool = True,
) -> None:
    """Print a table. ``right``: column indices to right-align (default: all but the first).

    ``styles``: an optional rich style per row (e.g. ``"red"`` for a collapsed row).
    """
    t = Table(show_header=show_header)
    right_cols = set(range(1, len(headers)) if right is None else right)
    for i, h in enumerate(headers):
        t.add_column(_text(h), justify="right" if i in right_cols else "left", no_wrap=i != 0)
    for i, row in enumerate(rows):
        t.add_row(*[_text(c) for c in row], style=(styles[i] if styles else None))
    # Title and caption are printed around the table, not inside it: rich would wrap them at the table's
    # width (a title longer than a narrow table broke over two lines) and pad them with spaces.
    if title:
        _out.print(_text(title, "table.title"), soft_wrap=True)
    _out.print(t)
    if caption:
        width = _out.width if _out.is_terminal else max(MIN_FILE_WIDTH, _out.measure(t).maximum)
        lines = _text(caption, "table.caption").wrap(_out, width)
        for line in lines:
            line.rstrip()  # the space a line was broken at
        _out.print(Text("\n").join(lines), soft_wrap=True)


def histogram(labels: Sequence[str], counts: Sequence[int], width: int = 40, title: str | None = None) -> None:
    """Text bars with counts, one line per bin."""
    if title:
        _out.print(_text(title))
    labels = [printable(x) for x in labels]
    top = max(counts) if counts else 0
    lw = max((len(x) for x in labels), default=0)
    for label, c in zip(labels, counts):
        n = 0 if top == 0 else max(1 if c else 0, round(width * c / top))
        _out.print(Text(f"  {label:>{lw}} | {'#' * n:<{width}} {printable(c)}"))


class ProgressHandle:
    def __init__(self, progress: Progress | None):
        self._p = progress
        self._task = None

    def start(self, description: str, total: int | None) -> None:
        if self._p is None:
            return
        if self._task is not None:
            self._p.remove_task(self._task)
        self._task = self._p.add_task(printable(description), total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None and self._task is not None:
            self._p.advance(self._task, n)

    def describe(self, description: str) -> None:
        if self._p is not None and self._task is not None:
            self._p.update(self._task, description=printable(description))

    def callback(self) -> Callable[..., None]:
        return lambda *_a, **_k: self.advance()


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[ProgressHandle]:
    """A transient progress bar on stderr (disabled when stderr is not a terminal or under CI)."""
    if not enabled or not _err.is_terminal or os.environ.get("CI"):
        yield ProgressHandle(None)
        return
    cols = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=_err, transient=True) as p:
        yield ProgressHandle(p)


def status(message: str) -> None:
    """A one-line status on stderr (what is running now), for non-interactive logs too.

    Everything printed to stdout so far is flushed first, so a log of both streams keeps their order.
    """
    _out.file.flush()
    _err.print(_text(message, "dim", keep=""))


class _StatusHandler(logging.Handler):
    """Library log records (logger ``qkit``, INFO and up) shown as status lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            status(self.format(record))
        except Exception:  # never let a status line break the command
            self.handleError(record)


def show_library_status() -> None:
    """Route the ``qkit`` logger's INFO records (downloads, GGUF conversion) to status lines, and make what
    other libraries log or warn printable (``printable_library_output``); idempotent."""
    log = logging.getLogger("qkit")
    if not any(isinstance(h, _StatusHandler) for h in log.handlers):
        log.addHandler(_StatusHandler())
    log.setLevel(logging.INFO)
    log.propagate = False
    printable_library_output()


def printable_library_output() -> None:
    """Every log record of any library (transformers, huggingface_hub, ...) and every Python warning, made
    printable before any handler writes it: those libraries write to stderr through handlers of their own,
    and their messages quote config fields (transformers logged a config's ``rope_type`` with its ESC
    sequence raw). Newlines and tabs are kept; the format is theirs. Idempotent; the command line calls it
    for every command, a script using the library is left as it is."""
    if getattr(logging.getLogRecordFactory(), "qkit_printable", False):
        return
    make_record = logging.getLogRecordFactory()

    def printable_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            record.msg, record.args = printable(record.getMessage(), keep="\t\n"), None
        except Exception:  # a malformed record is the logging module's to report, as it would be without us
            pass
        return record

    printable_record.qkit_printable = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(printable_record)
    format_warning = warnings.formatwarning

    def printable_warning(message: Any, category: Any, filename: str, lineno: int, line: str | None = None) -> str:
        return printable(format_warning(message, category, filename, lineno, line), keep="\t\n")

    warnings.formatwarning = printable_warning


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as sorted, strict JSON to ``path`` atomically, or to stdout for ``-``: a number that
    is not finite (not measured) is written ``null`` (``qkit.jsontext``), never ``NaN`` or ``Infinity``.

    The target was checked before any work (``qkit.outputs.check_output_path``, kind ``json``); a write that
    fails here (a disk filled meanwhile) is one ``OutputError`` and leaves no temporary file behind, and
    a killed run's hidden ``.NAME.qkit-tmp-PID-*`` file is removed by the next write into that directory.
    """
    text = jsontext.dumps(data, what=f"--json {path}", indent=2, nonfinite="null", default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    staging.write_text(path, text, what="--json", on_stale=_report_stale)


def _report_stale(removed: list[Path]) -> None:
    status(f"removed {len(removed)} temporary file{'s' if len(removed) > 1 else ''} of killed runs (their writer "
           f"process is gone): {', '.join(str(p) for p in removed)}")
