"""What every export format shares: the ``Format`` protocol, the model's linear layers, the checks, the
export record and the streaming writer.

Every ``--format`` (``qkit_format.py``, qkit's own; ``compressed_tensors.py``, ``bitsandbytes.py``, ``gguf/``) is a
``Format``: it answers what the rest of qkit asks of it instead of its name (``stores_llama_types``,
``torch_loads``, ``takes_plan``, ...), refuses
what it cannot express before any work (``check``, ``prepare``), owns its container (``check_container_output``,
``atomic_output``, ``output_bytes``, ``recognises``: a safetensors directory, or GGUF's one file), turns
one qkit ``QuantizedTensor`` into the tensors its target library stores (``encode``), reads them back into
the very same ``QuantizedTensor`` (``decode``, what ``qkit verify`` uses) and writes the
``quantization_config`` its library reads. ``SafetensorsFormat`` gives a directory format its container
and what ``qkit verify`` asks of it (stored parts, the library's weight and dtype, an activation rule).

Besides the weights and ``config.json``, an export directory holds ``qkit-export.json``: the format,
the scheme of every quantized tensor (as in qkit's own manifest) and the rules, so ``qkit verify`` can
rebuild qkit's side of the comparison from the exported bytes alone. The target libraries ignore it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from qkit.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    atomic_directory,
    checkpoint_bytes,
    tensor_dtypes,
    write_json,
)
from qkit.checkpoint import check_directory_output
from qkit.errors import ExportError, QkitError
from qkit.models import ModelRef, read_config
from qkit.models import linear_modules as _model_linears
from qkit.outputs import Input
from qkit.schemes import QuantizedTensor, Scheme
from qkit.schemes.base import layout_nbytes, stores_natively
from qkit.transform import entry_to_spec, manifest_entry
from qkit.version import __version__

EXPORT_MANIFEST = "qkit-export.json"
EXPORT_VERSION = 1

@dataclass(frozen=True)
class ModelLayout:
    """The model's layout as a format sees it: everything it needs to know before the first tensor is read.

    ``targets``: quantized tensor name -> scheme; ``shapes`` and ``dtypes``: of every stored tensor;
    ``linears``: the module names of every ``nn.Linear`` of the model (tied ones included), sorted.
    """

    targets: dict[str, Scheme]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    linears: tuple[str, ...]
    model_dtype: torch.dtype

    @property
    def quantized_modules(self) -> dict[str, Scheme]:
        return {name.removesuffix(".weight"): s for name, s in self.targets.items()}

    @property
    def kept_linears(self) -> list[str]:
        """Linear modules left unquantized (the target library must be told to skip them)."""
        quantized = self.quantized_modules
        return [m for m in self.linears if m not in quantized]


class Format(Protocol):
    """An export format: its checks, its container and the tensors it stores (see the module docstring).

    ``container``: ``"safetensors"`` (a directory of shards, ``config.json`` and ``qkit-export.json``:
    :class:`SafetensorsFormat` gives it) or ``"gguf"`` (one file, ``qkit.export.gguf``); ``qkit verify``
    has one reader per container. ``library``: the package a user loads the export with.
    """

    name: str
    container: str
    library: str
    help: str  # what it stores and what loads it, for ``--format`` help: "nf4: transformers"
    ties_fused: bool  # whether vLLM's fused layers (q/k/v, gate/up) must share one type (``plan.fused_groups``)
    # What the rest of qkit asks of a format instead of its name (docs/architecture.md, "What a format holds"):
    stores_llama_types: bool  # llama.cpp's block types: --tensor-type, a recipe's whole file (token_embd, output)
    torch_loads: bool  # qkit reads a file of it tensor by tensor: the torch engine measures such a file as it is
    holds_shard: bool  # its writer holds one safetensors shard in memory (``methods.memory.stream_parts``)
    unquantized_is_source: bool  # nothing quantized, it stores the source's tensors as they are: the source is it
    # the model_types its own writer names (None: any); a GGUF of another is written from llama.cpp's converter
    native_architectures: tuple[str, ...] | None
    written_as: str  # what a status line adds for a file written in it (" as gguf"; "" for qkit's own, the default)

    # ---- what it holds (the planner, the engines and the checks ask the format, never compare its name)
    def refusal(self, scheme: Scheme, tensor: str | None = None) -> str | None:
        """Why the format cannot store weights of ``scheme`` at all (one line naming ``tensor`` when given, and
        what would work), or None."""

    def plan_types(self) -> tuple[str, ...]:
        """The scheme names a plan may mix in this format (any order); empty for a format of one type."""

    def supports(self, scheme: Scheme, shape: tuple[int, int]) -> bool:
        """Whether a ``[out, in]`` weight is stored as ``scheme`` itself (no refusal, no width fallback, whole
        groups and blocks: ``schemes.base.stores_natively``)."""

    def stored_nbytes(self, scheme: Scheme | None, shape: tuple[int, int], dtype: torch.dtype) -> int:
        """Exact bytes the writer stores for a ``shape`` weight of source ``dtype`` as ``scheme`` (None: kept)."""

    def check_candidates(self, schemes: Sequence[Scheme], dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        """Refuse (``InputError``, one line) plan candidates the format could not store for a ``dtype`` model."""

    def takes_plan(self, planned: Format) -> bool:
        """Whether a plan made for ``planned`` is written in this format as it is (its own plans; qkit's own
        format takes any, as it stores every type)."""

    # ---- before any work
    def check(self, layout: ModelLayout) -> None:
        """Raise ``ExportError`` (one line, naming what would work) for anything the format cannot express."""

    def prepare(self, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]],
                manifest: dict, *, ref: ModelRef | None = None) -> PreparedExport:
        """Everything checked before the first tensor is read (``check``, and what else the format needs)."""

    def for_activations(self, activations: str) -> Format | None:
        """The variant of this format that declares quantized ``activations`` (``int8-token``), or None."""

    # ---- the container
    def check_container_output(self, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
        """Refuse an output qkit must not or cannot write (``qkit.outputs.check_output_path``), before any work."""

    def atomic_output(self, out: Path, force: bool = False,
                      inputs: Iterable[Input] = ()) -> contextlib.AbstractContextManager[Path]:
        """The staging directory an export is written into, published atomically as ``out`` on success."""

    def output_bytes(self, out: Path) -> int:
        """Bytes of the weights written to ``out``."""

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this format (never raises for a path that is something else)."""

    # ---- the tensors
    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The tensors stored for quantized weight ``name`` (``....weight``)."""

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """Inverse of ``encode``: one module's stored tensors (keys without the module prefix). ``shape``: the
        weight's, for a format whose stored tensors do not hold it (qkit's own: its manifest records it); the
        library formats store it, and read it from there."""


def linear_modules(directory: Path, *, trust_remote_code: bool = False) -> list[str]:
    """Names of every ``nn.Linear`` of the model in ``directory`` (instantiated on the meta device: no memory).

    Tied linears (``lm_head`` tied to the embedding) are included: they exist as modules, so a target
    library must be told to leave them alone even though the checkpoint does not store them. The build is
    ``qkit.models``' (shared with ``check_complete``, so done once); it passes ``trust_remote_code``
    explicitly: left unset, transformers asks on stdin to run the directory's code.
    """
    return _model_linears(directory, trust_remote_code=trust_remote_code)


def read_layout(directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], *,
                trust_remote_code: bool = False) -> ModelLayout:
    """The ``ModelLayout`` of the model in ``directory`` with ``targets`` quantized: the tensors' dtypes and the
    model's (config.json's, else the first target's), and its linear modules (``linear_modules``)."""
    dtypes = tensor_dtypes(directory, floating_only=True)  # only the floating ones can be sources
    config = read_config(Path(directory))  # every field it reads type-checked (qkit.models.files.CONFIG)
    name = config.get("dtype") or config.get("torch_dtype")
    model_dtype = getattr(torch, str(name), None) if name else None
    if not isinstance(model_dtype, torch.dtype):
        first = next((dtypes[n] for n in targets if dtypes.get(n) is not None), torch.float32)
        model_dtype = first
    return ModelLayout(dict(targets), dict(shapes), {k: v for k, v in dtypes.items() if v is not None},
                      tuple(linear_modules(directory, trust_remote_code=trust_remote_code)), model_dtype)


def check_linear_targets(layout: ModelLayout, fmt: str, also: Iterable[str] = ()) -> None:
    """Every quantized tensor must be the ``.weight`` of an ``nn.Linear``: target libraries quantize only those.
    ``also``: modules the format stores as linears though transformers builds none for them (a mixture-of-experts
    checkpoint's per-expert matrices, ``compressed_tensors_moe``)."""
    linears = {*layout.linears, *also}
    bad = sorted(n for n in layout.targets if not n.endswith(".weight") or n.removesuffix(".weight") not in linears)
    if bad:
        raise ExportError(
            f"--format {fmt} quantizes only linear layers, but {bad[0]} is not the weight of one"
            f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; drop it from --include, or use --format qkit"
        )


@dataclass(frozen=True)
class ExportEntry:
    """One quantized tensor of an export record: the scheme qkit wrote it with, its original shape and
    dtype, and the sha256 of its codes and scales (``fingerprint``; None if not recorded)."""

    scheme: Scheme
    shape: tuple[int, ...]
    dtype: torch.dtype
    sha256: str | None


def check_export_record(record: object, where: str, fmt: str) -> dict[str, ExportEntry]:
    """The tensors of an export record (``qkit-export.json``, or a GGUF's ``qkit.export`` field), checked.

    ``fmt``: the format the checkpoint itself declares (its ``quantization_config``, or ``gguf``). Raises
    ``ExportError`` (one line naming ``where``) for anything but an object whose ``format`` is ``fmt``,
    whose ``format_version`` this qkit reads, and whose ``tensors`` maps names to manifest entries
    (``transform.entry_to_spec``) with a hex ``sha256``: a hand-edited record is refused, never used.
    """
    fix = "re-export the checkpoint with qkit quantize --format"
    if not isinstance(record, dict):
        raise ExportError(f"{where} is a JSON {type(record).__name__}, not an object; {fix}")
    got = record.get("format")
    if got != fmt:
        raise ExportError(f"{where} declares format {got!r}, but the checkpoint is {fmt}; {fix}")
    version = record.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= EXPORT_VERSION:
        raise ExportError(f"{where} has format_version {version!r}; this qkit reads versions 1 to {EXPORT_VERSION}: {fix}")
    tensors = record.get("tensors")
    if not isinstance(tensors, dict):
        raise ExportError(f"{where} has 'tensors' of type {type(tensors).__name__}, not an object of tensor entries; {fix}")
    out = {}
    for name, entry in tensors.items():
        try:
            scheme, shape, dtype = entry_to_spec(entry, name)
        except QkitError as exc:
            raise ExportError(f"{where}: {exc}") from None
        sha = entry.get("sha256")
        if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ExportError(f"{where}: the sha256 of {name} is {sha!r}, not 64 hex digits; {fix}")
        out[name] = ExportEntry(scheme, shape, dtype, sha)
    return out


def read_export_manifest(directory: Path, fmt: str) -> dict[str, ExportEntry] | None:
    """The checked tensors of ``directory/qkit-export.json`` (``check_export_record``); None without one
    (a checkpoint qkit did not write: schemes are then inferred from the files)."""
    path = Path(directory) / EXPORT_MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except PermissionError as exc:
        raise ExportError(f"permission denied reading {path}; make it readable") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ExportError(f"{path} is not valid JSON ({exc}); re-export the checkpoint with qkit quantize --format") from exc
    return check_export_record(record, str(path), fmt)


def fingerprint(qt: QuantizedTensor) -> str:
    """sha256 of a ``QuantizedTensor``'s codes and scales (their bytes, in that order).

    Written per tensor into ``qkit-export.json``; ``qkit verify`` checks that decoding the exported
    tensors gives back exactly these bytes, so an encoding error cannot hide behind a matching decoder.
    """
    h = hashlib.sha256()
    for t in (qt.qweight, qt.scales):
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a safetensors directory (qkit's own ``ShardWriter``, an export's ``ExportWriter``) stores for a
    tensor left unquantized: ``prod(shape) * itemsize(dtype)``; both store it as read, in the source dtype."""
    return math.prod(int(d) for d in shape) * dtype.itemsize


# A scale dtype the weight dtype holds exactly (every fp16 and bf16 value is an fp32 value).
EXACT_IN = {
    torch.float32: {torch.float32, torch.float16, torch.bfloat16},
    torch.float16: {torch.float16},
    torch.bfloat16: {torch.bfloat16},
}


def check_scale_in_weight_dtype(layout: ModelLayout, tensor: str, scale_dtype: torch.dtype) -> None:
    """compressed-tensors stores ``weight_scale`` in the weights' dtype: refuse scales it cannot hold exactly."""
    wdtype = layout.dtypes.get(tensor, layout.model_dtype)
    if scale_dtype not in EXACT_IN.get(wdtype, set()):
        raise ExportError(
            f"compressed-tensors stores weight_scale in the weights' dtype ({dtype_name(wdtype)}), which "
            f"cannot hold {dtype_name(scale_dtype)} scales exactly; quantize with --scale-dtype "
            f"{ {torch.bfloat16: 'bf16', torch.float16: 'fp16'}.get(wdtype, 'fp32') }"
        )


class ExportWriter(ShardWriter):
    """A ``ShardWriter`` that stores each ``QuantizedTensor`` in a format's layout and, on ``close``,
    writes ``qkit-export.json``. Streaming and peak memory are the ``ShardWriter``'s."""

    def __init__(self, directory: Path, fmt: Format, manifest: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        super().__init__(directory, None, max_shard_bytes)
        self.format = fmt
        self.export_manifest = {**manifest, "format": fmt.name, "format_version": EXPORT_VERSION,
                                "qkit_version": __version__, "tensors": {}}

    def add(self, name: str, value: QuantizedTensor | torch.Tensor) -> None:
        if not isinstance(value, QuantizedTensor):
            super().add(name, value)
            return
        for key, t in self.format.encode(name, value).items():
            super().add(key, t)
        self.export_manifest["tensors"][name] = {**manifest_entry(value), "sha256": fingerprint(value)}

    def close(self) -> list[Path]:
        paths = super().close()
        write_json(self.directory / EXPORT_MANIFEST, self.export_manifest)
        return paths


@dataclass
class PreparedExport:
    """A checked output: the writer to stream into and the ``quantization_config`` to put in config.json.

    This one is a safetensors export format's (``ExportWriter``, the format's ``quantization_config(layout)``);
    qkit's own format and GGUF prepare their own (``qkit_format.PreparedCheckpoint``, ``gguf.GGUFExport``)."""

    format: Format
    layout: ModelLayout | None  # None: a format that needs none (qkit's own stores every tensor as it is given)
    manifest: dict = field(default_factory=dict)

    def writer(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ShardWriter:
        return ExportWriter(directory, self.format, self.manifest, max_shard_bytes)

    def quantization_config(self) -> dict:
        return self.format.quantization_config(self.layout)  # type: ignore[attr-defined]  # SafetensorsFormat's

    def kept_nbytes(self, name: str, tensor: torch.Tensor) -> int:
        """Bytes the checkpoint stores for ``name`` kept unquantized as ``tensor`` (a safetensors file: as given)."""
        return tensor.numel() * tensor.element_size()


class SafetensorsFormat:
    """The members every safetensors-directory format shares: the container (``checkpoint.atomic_directory``),
    ``prepare`` as ``read_layout`` + ``check``, and what ``qkit verify`` asks of a directory format.

    A format class lists this as its base and gives ``name``, ``library``, ``check``, ``encode``,
    ``decode``, ``quantization_config(layout)`` (the ``config.json`` entry its library reads, which
    ``PreparedExport`` writes), ``reader`` and ``stored_parts``; it overrides what differs.
    """

    container = "safetensors"
    name: str
    library: str  # the pip package transformers loads the directory with ("compressed-tensors")
    help: str
    ties_fused = False
    stores_llama_types = False
    torch_loads = False  # a library's layout: qkit verify reads it, the torch engine does not load it
    holds_shard = True  # ShardWriter
    unquantized_is_source = True  # with nothing quantized, every tensor is stored as read
    native_architectures = None  # every architecture transformers loads

    @property
    def written_as(self) -> str:
        return f" as {self.name}"
    # Compare the library's weights before its first forward (bitsandbytes: a forward may repack them).
    compares_before_forward = False

    # ---- what it holds
    def refusal(self, scheme: Scheme, tensor: str | None = None) -> str | None:
        return None

    def plan_types(self) -> tuple[str, ...]:
        return ()

    def supports(self, scheme: Scheme, shape: tuple[int, int]) -> bool:
        return self.refusal(scheme) is None and stores_natively(scheme, shape)

    def stored_nbytes(self, scheme: Scheme | None, shape: tuple[int, int], dtype: torch.dtype) -> int:
        """Kept: ``dense_nbytes``; quantized: the bytes of ``scheme.part_layout(shape)`` (what ``ShardWriter``
        stores, the sum of ``qt.tensors(name)``)."""
        return dense_nbytes(shape, dtype) if scheme is None else layout_nbytes(scheme.part_layout(shape))

    def check_candidates(self, schemes: Sequence[Scheme], dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        return None

    def takes_plan(self, planned: Format) -> bool:
        return planned is self

    # ---- before any work
    def check(self, layout: ModelLayout) -> None:
        raise NotImplementedError

    def prepare(self, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]],
                manifest: dict, *, ref: ModelRef | None = None) -> PreparedExport:
        layout = read_layout(directory, targets, shapes, trust_remote_code=ref is not None and ref.trust_remote_code)
        self.check(layout)
        return PreparedExport(self, layout, manifest)

    def for_activations(self, activations: str) -> Format | None:
        return None

    # ---- the container: a directory
    def check_container_output(self, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
        check_directory_output(Path(out), force, inputs)

    @contextlib.contextmanager
    def atomic_output(self, out: Path, force: bool = False, inputs: Iterable[Input] = ()) -> Iterator[Path]:
        with atomic_directory(Path(out), force, inputs=inputs) as tmp:
            yield tmp

    def output_bytes(self, out: Path) -> int:
        return checkpoint_bytes(Path(out))

    def recognises(self, path: Path) -> bool:
        """A directory whose ``config.json`` declares a ``quantization_config`` this format reads (``reader``)."""
        try:
            if not Path(path).is_dir():
                return False
            qc = read_config(Path(path)).get("quantization_config") or {}
        except (QkitError, OSError, ValueError):  # no, or an unreadable, config.json: not a checkpoint of ours
            return False
        return isinstance(qc, dict) and self.reader(qc) is not None

    # ---- reading a checkpoint back (``qkit verify``)
    def reader(self, quantization_config: dict) -> SafetensorsFormat | None:
        """The format that reads a checkpoint with this ``quantization_config``: this one, a variant of it
        (compressed-tensors' W8A8), or None."""
        raise NotImplementedError

    def stored_parts(self, keys: list[str]) -> dict[str, str]:
        """Stored key -> its module, for the keys of a checkpoint that belong to quantized modules."""
        raise NotImplementedError

    def parts_per_module(self, parts_of: dict[str, str]) -> Mapping[str, int]:
        """How many stored tensors each quantized module has (``stored_parts``' result): a module is decoded
        once all have been read. By default, as many as the checkpoint holds (they differ by scheme)."""
        return Counter(parts_of.values())

    def infer_scheme(self, quantization_config: dict, module: str, tensors: dict[str, torch.Tensor]) -> Scheme:
        """The scheme of a module of a checkpoint without ``qkit-export.json`` (not written by qkit)."""
        raise NotImplementedError

    def stored_dtype(self, tensors: dict[str, torch.Tensor]) -> torch.dtype:
        """The weight dtype one module's stored tensors imply, without ``qkit-export.json``: by default the
        dtype of ``weight_scale`` (compressed-tensors stores it in the weights' dtype)."""
        return tensors["weight_scale"].dtype

    def runtime_dtype(self, quantization_config: dict, dtype: torch.dtype) -> tuple[torch.dtype, str | None]:
        """The dtype ``qkit verify`` loads this checkpoint in, and a one-line reason when it is not ``dtype``."""
        return dtype, None

    def library_setup(self, model: torch.nn.Module, fast_cpu_kernel: bool) -> torch.dtype | None:
        """Prepare the library's loaded ``model`` for the comparison; the dtype whose logits tolerance then
        applies when the library computes in another dtype than the model's, else None."""
        return None

    def library_weight(self, model: torch.nn.Module, module: str) -> torch.Tensor:
        """The dense weight the target library computes for ``module`` (after its first forward)."""
        w = getattr(model.get_submodule(module), "weight", None)
        if w is None or not w.is_floating_point():
            raise ExportError(f"{self.name} left {module} compressed after a forward pass; cannot compare it")
        return w.detach()

    def activations_of(self, quantization_config: dict) -> str | None:
        """The activation quantization the checkpoint declares (``int8-token``), or None (weight-only)."""
        return None

    def library_rule(self, model: torch.nn.Module, modules: list[str]) -> contextlib.AbstractContextManager[None]:
        """``model`` with the library's own activation rule on ``modules`` for the block (weight-only: none)."""
        return contextlib.nullcontext()
