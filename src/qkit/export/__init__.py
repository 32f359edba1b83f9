"""Checkpoints other libraries load: compressed-tensors (vLLM, transformers) and bitsandbytes NF4.

``quantize_model(..., format=...)`` streams through the same transform as qkit's own format and hands
each ``QuantizedTensor`` to a format's ``encode``; ``qkit verify`` (``verify.verify_checkpoint``)
loads an export with the target library's own reader and compares it with qkit's dequantization.
"""

from __future__ import annotations

from pathlib import Path

from qkit.errors import InputError
from qkit.export.common import EXPORT_MANIFEST, ExportPlan, Format, PreparedExport, make_plan
from qkit.schemes import Scheme

QKIT = "qkit"
FORMATS = (QKIT, "compressed-tensors", "bitsandbytes")


def get_format(name: str) -> Format:
    """The export format called ``name`` (``compressed-tensors`` or ``bitsandbytes``)."""
    key = name.strip().lower().replace("_", "-")
    if key in ("compressed-tensors", "ct"):
        from qkit.export.compressed_tensors import FORMAT

        return FORMAT
    if key in ("bitsandbytes", "bnb"):
        from qkit.export.bitsandbytes import FORMAT

        return FORMAT
    raise InputError(f"unknown format {name!r}; use one of {', '.join(FORMATS)}")


def prepare_export(
    name: str, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], manifest: dict
) -> PreparedExport:
    """Check that format ``name`` can express every target (raises ``ExportError`` before any work)."""
    fmt = get_format(name)
    plan = make_plan(directory, targets, shapes)
    fmt.check(plan)
    return PreparedExport(fmt, plan, manifest)


__all__ = ["EXPORT_MANIFEST", "FORMATS", "QKIT", "ExportPlan", "Format", "PreparedExport", "get_format", "prepare_export"]
