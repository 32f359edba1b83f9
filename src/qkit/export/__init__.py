"""Checkpoints other libraries load: compressed-tensors (vLLM, transformers), bitsandbytes NF4 and GGUF (llama.cpp).

``quantize_model(..., format=...)`` streams through the same transform as qkit's own format and hands
each ``QuantizedTensor`` to a format's ``encode``; ``qkit verify`` (``verify.verify_checkpoint``)
loads an export with the target library's own reader and compares it with qkit's dequantization.
GGUF writes one file rather than a safetensors directory: ``check_output``, ``atomic_output`` and
``output_bytes`` give ``quantize_model`` the right container for any format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from qkit.checkpoint import atomic_directory, checkpoint_bytes
from qkit.checkpoint import check_output as _check_directory
from qkit.errors import ExportError, InputError, OutputError
from qkit.export.common import EXPORT_MANIFEST, ExportPlan, Format, PreparedExport, make_plan
from qkit.outputs import Input
from qkit.schemes import Scheme

QKIT = "qkit"
FORMATS = (QKIT, "compressed-tensors", "bitsandbytes", "gguf")


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def is_gguf(name: str) -> bool:
    return _key(name) == "gguf"


def get_format(name: str) -> Format:
    """The export format called ``name`` (``compressed-tensors``, ``bitsandbytes`` or ``gguf``)."""
    key = _key(name)
    if key in ("compressed-tensors", "ct"):
        from qkit.export.compressed_tensors import FORMAT

        return FORMAT
    if key in ("bitsandbytes", "bnb"):
        from qkit.export.bitsandbytes import FORMAT

        return FORMAT
    if key == "gguf":
        from qkit.export.gguf import FORMAT

        return FORMAT
    raise InputError(f"unknown format {name!r}; use one of {', '.join(FORMATS)}")


def _trusted(ref) -> bool:
    """Whether the user allowed the model's own code when ``ref`` was resolved (``ModelRef.trust_remote_code``)."""
    return bool(getattr(ref, "trust_remote_code", False))


def prepare_export(
    name: str, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], manifest: dict,
    *, ref=None, activations: str | None = None,
) -> PreparedExport:
    """Check that format ``name`` can express every target (raises ``ExportError`` before any work).

    ``ref``: the resolved model (``qkit.models.ModelRef``); GGUF copies the tokenizer of the GGUF it came from.
    ``activations``: ``int8-token`` makes a compressed-tensors export W8A8 (``compressed_tensors_w8a8``); the
    choice is recorded in the export manifest (``qkit-export.json``) under ``activations``.
    """
    if activations is not None:
        from qkit.export import compressed_tensors_w8a8 as w8a8

        key = w8a8.check_activations(activations)
        if name.strip().lower().replace("_", "-") not in ("compressed-tensors", "ct"):
            raise ExportError(f"--activations {key} is exported only as compressed-tensors W8A8 (int-quantized), not "
                              f"--format {name}; use --format compressed-tensors")
        fmt = w8a8.W8A8Format(key)
        plan = make_plan(directory, targets, shapes, trust_remote_code=_trusted(ref))
        fmt.check(plan)
        manifest["activations"] = key
        return PreparedExport(fmt, plan, manifest)
    if is_gguf(name):
        from qkit.export import gguf

        return gguf.prepare(directory, targets, shapes, manifest, ref=ref)
    fmt = get_format(name)
    plan = make_plan(directory, targets, shapes, trust_remote_code=_trusted(ref))
    fmt.check(plan)
    return PreparedExport(fmt, plan, manifest)


def check_output(name: str, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
    """Refuse an output of format ``name`` qkit must not or cannot write, before any work: one that is,
    contains or lies inside one of ``inputs`` (whatever ``force``), an existing one without ``force`` or
    not written by qkit, an unwritable place (``qkit.outputs.check_output``)."""
    if out is None or str(out) == "":  # before Path(), which reads "" as ".": the current directory
        raise OutputError("-o is empty; give the directory (or FILE.gguf with --format gguf) to write to")
    if is_gguf(name):
        from qkit.export import gguf

        gguf.check_output(Path(out), force, inputs)
        return
    _check_directory(Path(out), force, inputs)


@contextlib.contextmanager
def atomic_output(export: PreparedExport | None, out: Path, force: bool = False,
                  inputs: Iterable[Input] = ()) -> Iterator[Path]:
    """The staging directory an export is written into, published atomically on success.

    A directory (``checkpoint.atomic_directory``) for qkit and the safetensors formats; for GGUF, a
    staging directory whose ``model.gguf`` becomes OUT (``OUT.gguf``) or ``OUT/model.gguf``. A failed
    write (full disk) leaves nothing and is one ``OutputError`` line.
    """
    if export is not None and export.format.name == "gguf":
        from qkit.export import gguf

        with gguf.atomic_output(Path(out), force, inputs) as tmp:
            yield tmp
        return
    with atomic_directory(Path(out), force, inputs=inputs) as tmp:
        yield tmp


def output_bytes(out: Path) -> int:
    """Bytes of the weights written to ``out`` (safetensors shards, or the GGUF file)."""
    out = Path(out)
    if out.suffix == ".gguf" and out.is_file() or (out / "model.gguf").is_file():
        from qkit.export.gguf import output_bytes as gguf_bytes

        return gguf_bytes(out)
    return checkpoint_bytes(out)


__all__ = ["EXPORT_MANIFEST", "FORMATS", "QKIT", "ExportPlan", "Format", "PreparedExport", "atomic_output",
           "check_output", "get_format", "is_gguf", "output_bytes", "prepare_export"]
