"""The only module that imports rich: tables, progress bars, text histograms, one-line errors.

Library code never prints; the CLI hands plain data (headers, rows of strings, notes) to these helpers.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def _console(stderr: bool) -> Console:
    # Wide tables stay whole when the output is a file or a pipe (logs, CI, the README's examples).
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, highlight=False, width=None if probe.is_terminal else 200)


_out = _console(stderr=False)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def use_stderr_for_tables(flag: bool) -> None:
    """With ``--json -`` the JSON owns stdout; tables and notes move to stderr."""
    global _out
    _out = _console(stderr=flag)


def error(message: str) -> None:
    _err.print(Text("error: ", style="bold red") + Text(message))


def warn(message: str) -> None:
    _err.print(Text("warning: ", style="bold yellow") + Text(message))


def note(message: str, style: str | None = None) -> None:
    _out.print(Text(message, style=style) if style else message, soft_wrap=True)


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
    t = Table(title=title, caption=caption, caption_justify="left", title_justify="left", show_header=show_header)
    right_cols = set(range(1, len(headers)) if right is None else right)
    for i, h in enumerate(headers):
        t.add_column(h, justify="right" if i in right_cols else "left", no_wrap=i != 0)
    for i, row in enumerate(rows):
        t.add_row(*[str(c) for c in row], style=(styles[i] if styles else None))
    _out.print(t)


def histogram(labels: Sequence[str], counts: Sequence[int], width: int = 40, title: str | None = None) -> None:
    """Text bars with counts, one line per bin."""
    if title:
        _out.print(title)
    top = max(counts) if counts else 0
    lw = max((len(x) for x in labels), default=0)
    for label, c in zip(labels, counts):
        n = 0 if top == 0 else max(1 if c else 0, round(width * c / top))
        _out.print(f"  {label:>{lw}} | {'#' * n:<{width}} {c}")


class ProgressHandle:
    def __init__(self, progress: Progress | None):
        self._p = progress
        self._task = None

    def start(self, description: str, total: int | None) -> None:
        if self._p is None:
            return
        if self._task is not None:
            self._p.remove_task(self._task)
        self._task = self._p.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None and self._task is not None:
            self._p.advance(self._task, n)

    def describe(self, description: str) -> None:
        if self._p is not None and self._task is not None:
            self._p.update(self._task, description=description)

    def callback(self) -> Callable[..., None]:
        return lambda *_a, **_k: self.advance()


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[ProgressHandle]:
    """A transient progress bar on stderr (disabled when stderr is not a terminal or under CI)."""
    if not enabled or not _err.is_terminal or os.environ.get("CI"):
        yield ProgressHandle(None)
        return
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=_err, transient=True) as p:
        yield ProgressHandle(p)


def status(message: str) -> None:
    """A one-line status on stderr (what is running now), for non-interactive logs too."""
    _err.print(Text(message, style="dim"))


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as sorted JSON to ``path`` atomically, or to stdout for ``-``."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)
