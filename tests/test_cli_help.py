"""The help text of every command and sub-command equals the recorded golden file.

The golden file (tests/golden/cli_help.json) was recorded from the single-module CLI before it became
the ``qkit.cli`` package; any change to an option, its help or its default shows up here as a diff.
After an intended change, re-record with ``QKIT_UPDATE_GOLDEN=1 python -m pytest tests/test_cli_help.py``
and review the diff of the JSON file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qkit.cli import app

GOLDEN = Path(__file__).parent / "golden" / "cli_help.json"
WIDTH = 200
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def command_paths() -> list[tuple[str, ...]]:
    """Every command path, root first: (), ("quantize",), ("inspect",), ("inspect", "errors"), ..."""
    root = typer.main.get_command(app)
    out: list[tuple[str, ...]] = []

    def walk(cmd, path):
        out.append(path)
        for name in sorted(getattr(cmd, "commands", {}) or {}):
            walk(cmd.commands[name], (*path, name))

    walk(root, ())
    return out


def help_texts(monkeypatch) -> dict[str, list[str]]:
    # A fixed width and no colour, whatever the terminal or CI environment says.
    import typer.rich_utils as ru

    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.setenv("TERMINAL_WIDTH", str(WIDTH))
    for var in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "LINES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ru, "MAX_WIDTH", WIDTH, raising=False)
    monkeypatch.setattr(ru, "FORCE_TERMINAL", False, raising=False)
    runner = CliRunner()
    texts = {}
    for path in command_paths():
        result = runner.invoke(app, [*path, "--help"], prog_name="qkit", color=False)
        assert result.exit_code == 0, (path, result.output)
        text = _ANSI.sub("", result.output)
        texts[" ".join(("qkit", *path))] = [line.rstrip() for line in text.splitlines()]
    return texts


def test_every_command_is_covered():
    names = {" ".join(p) for p in command_paths()}
    # The sixteen commands (inspect's and simulate's sub-commands counted) and the two sub-apps.
    assert {"quantize", "imatrix", "plan", "eval", "report", "verify", "kv", "budget", "speculate", "bench", "simulate batching",
            "inspect errors", "inspect matrix", "inspect outliers", "inspect sensitivity",
            "inspect next-token"} <= names
    assert len(names) == 19  # root + 16 commands + 2 sub-apps


def test_help_text_is_unchanged(monkeypatch):
    texts = help_texts(monkeypatch)
    if os.environ.get("QKIT_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(texts, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        pytest.skip(f"re-recorded {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())  # {"qkit eval": [lines of its --help], ...}
    assert sorted(texts) == sorted(golden)
    for name in golden:
        assert texts[name] == golden[name], f"help of '{name}' changed"
