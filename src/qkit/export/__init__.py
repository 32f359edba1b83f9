"""Checkpoints other libraries load: compressed-tensors (vLLM, transformers), bitsandbytes NF4 and GGUF (llama.cpp).

Layer 5 (beside ``methods``, ``simulate``, ``serving``): it imports ``checkpoint``, ``transform``,
``models`` and ``schemes`` below it, never ``evaluation`` or the CLI above it.

``quantize_model(..., format=...)`` streams through the same transform as qkit's own format and hands
each ``QuantizedTensor`` to a format's ``encode``; ``qkit verify`` (``qkit.verify.verify_checkpoint``)
loads an export with the target library's own reader and compares it with qkit's dequantization.

Every ``--format`` is a ``common.Format`` registered in ``REGISTRY`` (``qkit.registry.Registry``), qkit's own
safetensors directory first (``qkit_format``): it checks a plan, prepares its output, knows its container (a safetensors directory, or GGUF's one file: staging,
atomic publication, recognising a checkpoint of its own, the bytes written), its stored tensors, and what the
rest of qkit asks of it instead of its name (``stores_llama_types``, ``torch_loads``, ``takes_plan``, ...). The
functions below ask the format; none of them knows a format by name, and an unknown name is refused in the
registry's one wording (``get_format``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from qkit.errors import InputError, OutputError
from qkit.export import bitsandbytes, compressed_tensors, compressed_tensors_w8a8, gguf, qkit_format
from qkit.export.common import EXPORT_MANIFEST, ModelLayout, Format, PreparedExport
from qkit.export.qkit_format import QkitFormat
from qkit.models import ModelRef
from qkit.outputs import Input
from qkit.registry import Registry
from qkit.schemes import Scheme

QKIT = qkit_format.NAME  # the default --format: qkit's own checkpoint (``checkpoint.ShardWriter``)
QKIT_PLAN_GROUPS = qkit_format.PLAN_GROUPS

# Every --format, in the order help texts and the docs' table list them; one line per format.
REGISTRY: Registry[Format] = Registry("format", error=InputError)
REGISTRY.register(qkit_format.NAME, qkit_format.FORMAT)
REGISTRY.register(compressed_tensors.NAME, compressed_tensors.FORMAT, aliases=("ct",))
REGISTRY.register(bitsandbytes.NAME, bitsandbytes.FORMAT, aliases=("bnb",))
REGISTRY.register(gguf.NAME, gguf.FORMAT)


def format_names() -> tuple[str, ...]:
    """Every format ``--format`` takes, in registration order (qkit's own first), any registered later included."""
    return tuple(REGISTRY.names())


def get_format(name: str) -> Format:
    """The format called ``name`` (an alias such as ``ct`` too); ``InputError`` in the registry's words ("unknown
    format 'x'; did you mean ...? use one of: ...") for any other name."""
    return REGISTRY.get(name)


def formats_that(has: Callable[[Format], bool]) -> tuple[str, ...]:
    """The names of the formats ``has`` answers true for (``lambda f: f.stores_llama_types``): what a refusal
    lists as the formats that would take an option."""
    return tuple(n for n, fmt in REGISTRY.items() if has(fmt))


def format_help() -> str:
    """The ``--format`` help: each format with what it stores and what loads it (``Format.help``)."""
    return "; ".join(f"{n} ({fmt.help})" if fmt.help else n for n, fmt in REGISTRY.items()) + "."


def recognise(path: Path) -> Format | None:
    """The registered format whose checkpoint ``path`` is (``Format.recognises``), or None."""
    return next((fmt for _, fmt in REGISTRY.items() if fmt.recognises(Path(path))), None)


def activation_format(name: str, activations: str) -> Format:
    """The variant of format ``name`` that declares quantized ``activations`` (``int8-token``:
    compressed-tensors' W8A8, ``Format.for_activations``); ``InputError`` (one line) for an unknown word or a
    format that stores weights only."""
    key = compressed_tensors_w8a8.check_activations(activations)
    fmt = get_format(name)
    variant = fmt.for_activations(key)
    if variant is None:
        raise InputError(f"--activations declares run-time activation quantization, which only compressed-tensors "
                         f"W8A8 (int-quantized) stores; --format {fmt.name} stores weights only: use --format "
                         "compressed-tensors (or simulate it: qkit eval --schemes smoothquant-w8a8)")
    return variant


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
    prepared = activation_format(name, activations).prepare(directory, targets, shapes, manifest, ref=ref)
    manifest["activations"] = compressed_tensors_w8a8.check_activations(activations)
    return prepared


def check_format_output(name: str, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
    """Refuse an output of format ``name`` qkit must not or cannot write, before any work: an unknown format,
    an output that is, contains or lies inside one of ``inputs`` (whatever ``force``), an existing one without
    ``force`` or not written by qkit, an unwritable place (``qkit.outputs.check_output_path``, through the format's
    container)."""
    fmt = get_format(name)
    if out is None or str(out) == "":  # before Path(), which reads "" as ".": the current directory
        raise OutputError("-o is empty; give the directory (or FILE.gguf with --format gguf) to write to")
    fmt.check_container_output(Path(out), force, inputs)


@contextlib.contextmanager
def atomic_output(export: PreparedExport, out: Path, force: bool = False,
                  inputs: Iterable[Input] = ()) -> Iterator[Path]:
    """The staging directory ``export`` is written into, published atomically on success (the format's
    container: ``checkpoint.atomic_directory`` for the safetensors formats, qkit's own included; for GGUF a
    staging directory whose ``model.gguf`` becomes OUT.gguf or OUT/model.gguf). A failed write (full disk)
    leaves nothing and is one ``OutputError`` line.
    """
    with export.format.atomic_output(Path(out), force, inputs) as tmp:
        yield tmp


__all__ = ["EXPORT_MANIFEST", "QKIT", "QKIT_PLAN_GROUPS", "REGISTRY", "ModelLayout", "Format", "PreparedExport",
           "QkitFormat", "activation_format", "atomic_output", "check_format_output",
           "format_help", "format_names", "formats_that", "get_format", "prepare_export", "recognise"]
