"""Every package under src/qkit is listed in pyproject.toml's ``packages`` (an explicit list: a package left
out installs in an editable checkout and is missing from a wheel), and every listed one exists."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed_and_every_listed_package_exists():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapped = {name: ROOT / path for name, path in config.get("package-dir", {}).items() if name}
    found = {".".join(init.parent.relative_to(ROOT / "src").parts) for init in (ROOT / "src" / "qkit").rglob("__init__.py")}
    found |= set(mapped)
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    stale = {n for n in listed - found if not (ROOT / "src" / Path(*n.split("."))).is_dir()}
    assert stale == set(), f"pyproject.toml lists packages that do not exist: {sorted(stale)}"
