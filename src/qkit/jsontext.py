"""JSON text: the one writer of every JSON qkit writes, and the check for a non-finite number in what it reads.

Layer 1 (beside ``jsonfields``, which checks what a document holds). Python's ``json`` writes ``NaN``,
``Infinity`` and ``-Infinity`` by default (``allow_nan=True``) and reads them back, but they are not JSON:
JavaScript's ``JSON.parse``, ``jq``, Go's and Rust's parsers refuse the file. Every file qkit writes (a
checkpoint's ``config.json`` and index, the manifest in each shard's metadata, an export's record, the
GGUF and importance-matrix records, a plan, every ``--json``) goes through ``dumps``: keys sorted,
``allow_nan=False``, and a non-finite number is never written as ``Infinity``:

* in a file qkit reads back or hands to other tools (``nonfinite="refuse"``, the default) it is a bug: one
  ``OutputError`` naming the field, before the file is written;
* in a ``--json`` report (``nonfinite="null"``) it is a number that was not measured: written ``null``, the
  same word the reports use for it everywhere (docs/guarantees.md, "no number is silently wrong").

``first_nonfinite`` finds a NaN or an infinity in a parsed document (Python's parser reads ``NaN``,
``Infinity`` and ``1e999``): the plan, report and config readers refuse such a file in one line naming the
field, before its numbers can reach a file qkit writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from qkit.errors import OutputError


def first_nonfinite(value: Any, path: str = "") -> tuple[str, float] | None:
    """``(field path, value)`` of the first NaN or infinity in a document of dicts, lists and tuples (keys in
    sorted order, so the answer does not depend on insertion order), or None when every number is finite."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "the document", value)
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            found = first_nonfinite(value[k], f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = first_nonfinite(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _nulled(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by None (dicts and lists copied, nothing else)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulled(v) for v in value]
    return value


def dumps(value: Any, *, what: str, indent: int | None = None, nonfinite: str = "refuse",
          default: Callable[[Any], Any] | None = None) -> str:
    """``value`` as strict JSON text, keys sorted (see the module docstring). ``what`` names the file in a
    refusal; ``nonfinite``: ``"refuse"`` (``OutputError``) or ``"null"``; ``default``: as ``json.dumps``'s.
    With ``indent=None`` the text is byte for byte ``json.dumps(value, sort_keys=True)``'s."""
    bad = first_nonfinite(value)
    if bad is not None:
        if nonfinite != "null":
            raise OutputError(f"{what}: {bad[0]} is {bad[1]!r}, which is not JSON; nothing was written (a number qkit "
                              "computed is not finite: this is a bug, please report it with the command)")
        value = _nulled(value)
    return json.dumps(value, indent=indent, sort_keys=True, allow_nan=False, default=default)


__all__ = ["dumps", "first_nonfinite"]
