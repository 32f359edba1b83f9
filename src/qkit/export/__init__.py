"""Checkpoints other libraries load: compressed-tensors (vLLM, transformers), bitsandbytes NF4 and GGUF (llama.cpp).

Layer 5 (beside ``methods``, ``simulate``, ``serving``): it imports ``checkpoint``, ``transform``,
``models`` and ``schemes`` below it, never ``evaluation`` or the CLI above it.

``quantize_model(..., format=...)`` streams through the same transform as qkit's own format and hands
each ``QuantizedTensor`` to a format's ``encode``; ``qkit verify`` (``qkit.verify.verify_checkpoint``)
loads an export with the target library's own reader and compares it with qkit's dequantization.

Every format is a ``common.Format`` registered in ``FORMATS`` (``qkit.registry.Registry``): it checks a
plan, prepares its output, knows its container (a safetensors directory, or GGUF's one file: staging,
atomic publication, recognising a checkpoint of its own, the bytes written) and its stored tensors. The
functions below ask the format; none of them knows a format by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from qkit.errors import ExportError, InputError, OutputError
from qkit.export import bitsandbytes, compressed_tensors, compressed_tensors_w8a8, gguf
from qkit.export.common import EXPORT_MANIFEST, ExportPlan, Format, PreparedExport, SafetensorsFormat
from qkit.models import ModelRef
from qkit.outputs import Input
from qkit.registry import Registry
from qkit.schemes import Scheme, get_scheme, scheme_names
from qkit.schemes.base import Recipe

QKIT = "qkit"  # qkit's own checkpoint (``checkpoint.ShardWriter``): a safetensors directory, no export Format
# Group sizes qkit's own format offers a plan beside the registered schemes (int4-g128 is one of those).
QKIT_PLAN_GROUPS = ("int4-g32", "int4-g64", "int8-g32", "int8-g64", "int8-g128")

REGISTRY: Registry[Format] = Registry("format", error=InputError)
REGISTRY.register(compressed_tensors.NAME, compressed_tensors.FORMAT, aliases=("ct",))
REGISTRY.register(bitsandbytes.NAME, bitsandbytes.FORMAT, aliases=("bnb",))
REGISTRY.register(gguf.NAME, gguf.FORMAT)
FORMATS = (QKIT, *REGISTRY.names())  # the built-in ones; ``format_names()`` also lists any registered later


class QkitFormat(SafetensorsFormat):
    """qkit's own format: the container of ``checkpoint.ShardWriter`` (and of any name that is not an export
    format), and what it holds: every scheme, stored as its parts (``part_layout``)."""

    name = QKIT
    library = "qkit"
    help = "every scheme, as qkit's own safetensors directory"

    def plan_types(self) -> tuple[str, ...]:
        return (*(n for n in scheme_names() if not isinstance(get_scheme(n), Recipe)), *QKIT_PLAN_GROUPS)


_DIRECTORY = QkitFormat()


def format_names() -> tuple[str, ...]:
    """Every format ``--format`` takes: qkit's own first, then the registered export formats in order."""
    return (QKIT, *REGISTRY.names())


def find_format(name: str) -> Format | None:
    """The format called ``name`` (an alias such as ``ct`` too), qkit's own included; None for no format."""
    key = str(name).strip().lower()
    return _DIRECTORY if key == QKIT else REGISTRY.find(key)


def format_help() -> str:
    """The ``--format`` help: each format with what it stores and what loads it (``Format.help``)."""
    return "; ".join(f"{n} ({fmt.help})" if (fmt := find_format(n)) is not None and fmt.help else n
                     for n in format_names()) + "."


def get_format(name: str) -> Format:
    """The export format called ``name`` (``compressed-tensors``/``ct``, ``bitsandbytes``/``bnb`` or ``gguf``);
    ``InputError`` with "did you mean" for any other name."""
    fmt = REGISTRY.find(name)
    if fmt is None:
        # the registry's words, with qkit's own format (a --format value that is no export Format) listed first
        raise InputError(REGISTRY.unknown(name).replace("use one of: ", f"use one of {QKIT}, ", 1))
    return fmt


def recognise(path: Path) -> Format | None:
    """The registered format whose checkpoint ``path`` is (``Format.recognises``), or None."""
    return next((fmt for _, fmt in REGISTRY.items() if fmt.recognises(Path(path))), None)


def _container(name: str) -> Format:
    return REGISTRY.find(name) or _DIRECTORY


def prepare_export(
    name: str, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], manifest: dict,
    *, ref: ModelRef | None = None, activations: str | None = None,
) -> PreparedExport:
    """Check that format ``name`` can express every target (raises ``ExportError`` before any work).

    ``ref``: the resolved model (``qkit.models.ModelRef``); GGUF copies the tokenizer of the GGUF it came from.
    ``activations``: ``int8-token`` makes a compressed-tensors export W8A8 (``compressed_tensors_w8a8``); the
    choice is recorded in the export manifest (``qkit-export.json``) under ``activations``.
    """
    if activations is None:
        return get_format(name).prepare(directory, targets, shapes, manifest, ref=ref)
    key = compressed_tensors_w8a8.check_activations(activations)
    base = REGISTRY.find(name)
    fmt = base.for_activations(key) if base is not None else None
    if fmt is None:
        raise ExportError(f"--activations {key} is exported only as compressed-tensors W8A8 (int-quantized), not "
                          f"--format {name}; use --format compressed-tensors")
    prepared = fmt.prepare(directory, targets, shapes, manifest, ref=ref)
    manifest["activations"] = key
    return prepared


def check_output(name: str, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
    """Refuse an output of format ``name`` qkit must not or cannot write, before any work: one that is,
    contains or lies inside one of ``inputs`` (whatever ``force``), an existing one without ``force`` or
    not written by qkit, an unwritable place (``qkit.outputs.check_output``, through the format's container)."""
    if out is None or str(out) == "":  # before Path(), which reads "" as ".": the current directory
        raise OutputError("-o is empty; give the directory (or FILE.gguf with --format gguf) to write to")
    _container(name).check_output(Path(out), force, inputs)


@contextlib.contextmanager
def atomic_output(export: PreparedExport | None, out: Path, force: bool = False,
                  inputs: Iterable[Input] = ()) -> Iterator[Path]:
    """The staging directory an export is written into, published atomically on success (the format's
    container: ``checkpoint.atomic_directory`` for qkit and the safetensors formats; for GGUF a staging
    directory whose ``model.gguf`` becomes OUT.gguf or OUT/model.gguf). A failed write (full disk) leaves
    nothing and is one ``OutputError`` line.
    """
    container = export.format if export is not None else _DIRECTORY
    with container.atomic_output(Path(out), force, inputs) as tmp:
        yield tmp


def output_bytes(out: Path) -> int:
    """Bytes of the weights written to ``out`` (safetensors shards, or the GGUF file)."""
    return (recognise(out) or _DIRECTORY).output_bytes(Path(out))


__all__ = ["EXPORT_MANIFEST", "FORMATS", "QKIT", "QKIT_PLAN_GROUPS", "REGISTRY", "ExportPlan", "Format", "PreparedExport",
           "QkitFormat", "atomic_output", "check_output", "find_format", "format_help", "format_names", "get_format", "output_bytes", "prepare_export", "recognise"]
