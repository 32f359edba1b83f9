"""What every export format shares: the model's linear layers, the checks, the streaming writer.

An export format (``compressed_tensors.py``, ``bitsandbytes.py``) is a ``Format``: it refuses what it
cannot express before any work (``check``), turns one qkit ``QuantizedTensor`` into the tensors its
target library stores (``encode``), reads them back into the very same ``QuantizedTensor`` (``decode``,
what ``qkit verify`` uses) and writes the ``quantization_config`` its library reads.

Besides the weights and ``config.json``, an export directory holds ``qkit-export.json``: the format,
the scheme of every quantized tensor (as in qkit's own manifest) and the rules, so ``qkit verify`` can
rebuild qkit's side of the comparison from the exported bytes alone. The target libraries ignore it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from qkit import __version__
from qkit.checkpoint import DEFAULT_MAX_SHARD_BYTES, ShardWriter, open_safetensors, weight_files, write_json
from qkit.errors import ExportError, QkitError
from qkit.models import linear_modules as _model_linears
from qkit.schemes import QuantizedTensor, Scheme
from qkit.transform import entry_to_spec, manifest_entry

EXPORT_MANIFEST = "qkit-export.json"
EXPORT_VERSION = 1

# safetensors header dtype names -> torch dtypes (only the floating ones can be quantization sources).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class ExportPlan:
    """Everything a format needs to know about the model before the first tensor is read.

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
    name: str

    def check(self, plan: ExportPlan) -> None:
        """Raise ``ExportError`` (one line, naming what would work) for anything the format cannot express."""

    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The tensors stored for quantized weight ``name`` (``....weight``)."""

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype) -> QuantizedTensor:
        """Inverse of ``encode``: one module's stored tensors (keys without the module prefix)."""

    def infer_scheme(self, quantization_config: dict, module: str, tensors: dict[str, torch.Tensor]) -> Scheme:
        """The scheme of a module of a checkpoint without ``qkit-export.json`` (not written by qkit)."""

    def quantization_config(self, plan: ExportPlan) -> dict:
        """The ``config.json`` ``quantization_config`` the target library reads."""


def safetensors_dtypes(directory: Path) -> dict[str, torch.dtype | None]:
    """The dtype of every stored tensor, read from the shard headers only (no data)."""
    out: dict[str, torch.dtype | None] = {}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                out[key] = _ST_DTYPES.get(f.get_slice(key).get_dtype())
    return out


def linear_modules(directory: Path, *, trust_remote_code: bool = False) -> list[str]:
    """Names of every ``nn.Linear`` of the model in ``directory`` (instantiated on the meta device: no memory).

    Tied linears (``lm_head`` tied to the embedding) are included: they exist as modules, so a target
    library must be told to leave them alone even though the checkpoint does not store them. The build is
    ``qkit.models``' (shared with ``check_complete``, so done once); it passes ``trust_remote_code``
    explicitly: left unset, transformers asks on stdin to run the directory's code.
    """
    return _model_linears(directory, trust_remote_code=trust_remote_code)


def make_plan(directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], *,
              trust_remote_code: bool = False) -> ExportPlan:
    dtypes = safetensors_dtypes(directory)
    config = json.loads((Path(directory) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    model_dtype = getattr(torch, str(name), None) if name else None
    if not isinstance(model_dtype, torch.dtype):
        first = next((dtypes[n] for n in targets if dtypes.get(n) is not None), torch.float32)
        model_dtype = first
    return ExportPlan(dict(targets), dict(shapes), {k: v for k, v in dtypes.items() if v is not None},
                      tuple(linear_modules(directory, trust_remote_code=trust_remote_code)), model_dtype)


def check_linear_targets(plan: ExportPlan, fmt: str) -> None:
    """Every quantized tensor must be the ``.weight`` of an ``nn.Linear``: target libraries quantize only those."""
    linears = set(plan.linears)
    bad = sorted(n for n in plan.targets if not n.endswith(".weight") or n.removesuffix(".weight") not in linears)
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


# A scale dtype the weight dtype holds exactly (every fp16 and bf16 value is an fp32 value).
EXACT_IN = {
    torch.float32: {torch.float32, torch.float16, torch.bfloat16},
    torch.float16: {torch.float16},
    torch.bfloat16: {torch.bfloat16},
}


def check_scale_in_weight_dtype(plan: ExportPlan, tensor: str, scale_dtype: torch.dtype) -> None:
    """compressed-tensors stores ``weight_scale`` in the weights' dtype: refuse scales it cannot hold exactly."""
    wdtype = plan.dtypes.get(tensor, plan.model_dtype)
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
    """A checked export: the writer to stream into and the ``quantization_config`` to put in config.json."""

    format: Format
    plan: ExportPlan
    manifest: dict = field(default_factory=dict)

    def writer(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ExportWriter:
        return ExportWriter(directory, self.format, self.manifest, max_shard_bytes)

    def quantization_config(self) -> dict:
        return self.format.quantization_config(self.plan)
