"""The only disk access for weights: streaming safetensors reads, atomic sharded writes, the manifest.

Layout of a qkit checkpoint directory (a normal model directory plus quantized tensors):

* ``config.json`` with ``quantization_config = {"quant_method": "qkit", "format_version", "scheme", ...}``;
* ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` once the tensors pass ``max_shard_bytes``;
* per quantized weight ``W``: ``W.qweight`` and ``W.scales`` (see ``qkit.schemes.quantized``);
  every other tensor unchanged;
* each shard's safetensors metadata holds ``{"format": "pt", "qkit": <JSON manifest>}``; the manifest
  (``qkit.transform.new_manifest``) lists the quantized tensors of that shard with their scheme,
  original shape and dtype. The index's ``metadata.qkit`` holds the merged manifest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from qkit import jsontext, outputs, staging
from qkit.errors import CheckpointError, SchemeError
from qkit.jsonfields import OBJECT, STRING, check, obj
from qkit.outputs import Input
from qkit.schemes import QuantizedTensor
from qkit.schemes.quantized import check_parts
from qkit.transform import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    entry_to_spec,
    manifest_entry,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_KEY = "qkit"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_UMASK = os.umask(0)
os.umask(_UMASK)


# --------------------------------------------------------------------------- atomic output
# Where qkit may write, and the hidden staging siblings, live in qkit.outputs (layer 1: --json writes use
# them too); a checkpoint directory is one such output.


def check_directory_output(out: Path, force: bool = False, inputs: Iterable[Input] = ()) -> None:
    """Refuse a directory output qkit must not or cannot write (``qkit.outputs.check_output_path``): one that is,
    contains or lies inside an input (whatever ``force``), an existing one without ``force`` or not written
    by qkit, an unwritable place. Call before any expensive work."""
    outputs.check_output_path(out, kind="dir", force=force, inputs=inputs)


@contextlib.contextmanager
def atomic_directory(
    out: Path, force: bool = False, on_stale: Callable[[list[Path]], None] | None = None,
    inputs: Iterable[Input] = (),
) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``out`` by rename, else it is removed.

    An interrupted or failed write never leaves a partial ``out`` and never touches an existing one; a
    full disk or another failed write is one ``OutputError`` line, with the sibling (and any parent
    directory created for ``out``) removed. The sibling is ``.NAME.qkit-tmp-PID-RANDOM``: a run killed
    before it could clean up (SIGKILL) leaves only that, and the next write into the same parent removes
    it (``remove_stale_siblings``), reporting the removed paths to ``on_stale``.
    """
    out = Path(out)
    check_directory_output(out, force, inputs)
    with staging.staged(out, on_stale=on_stale) as tmp:
        yield tmp
        staging.publish_directory(tmp, out, recheck=lambda: check_directory_output(out, force))


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as strict, sorted JSON at ``path`` (``qkit.jsontext.dumps``: a non-finite number is refused)."""
    path.write_text(jsontext.dumps(obj, what=path.name, indent=2) + "\n")


# --------------------------------------------------------------------------- writing


def sort_header_metadata(path: Path) -> None:
    """Rewrite a safetensors file's header in place with its ``__metadata__`` keys sorted: the same bytes
    for the same tensors and metadata, whatever process wrote them.

    safetensors keeps ``__metadata__`` in a Rust ``HashMap``, whose order is seeded per map at random: two
    runs writing ``{"format": "pt", "qkit": ...}`` put the keys in either order (issue 48). The tensors'
    entries are already in a fixed order (by dtype alignment, then name) and keep it, with their fields.
    The rewritten header has the same content, so the same length; safetensors' compact JSON is written
    again compactly, and the header stays padded with spaces to its recorded length (which keeps every
    tensor's offset)."""
    with open(path, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        raw = fh.read(n)
        header = json.loads(raw)  # a dict keeps the file's order of the tensor entries
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        ordered = {"__metadata__": dict(sorted(meta.items())), **{k: v for k, v in header.items() if k != "__metadata__"}}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:  # cannot happen for the same content; never write a header longer than its slot
            raise CheckpointError(f"{path}: its rewritten header is {len(text)} bytes, more than the {n} it has; "
                                  "this is a bug, please report it")
        fh.seek(8)
        fh.write(text + b" " * (n - len(text)))


class ShardWriter:
    """Write tensors into safetensors shards as they arrive; a shard is flushed once it fills.

    Peak memory: one shard's worth of output tensors (``max_shard_bytes``) plus what the caller holds.
    """

    def __init__(self, directory: Path, manifest: dict | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory = Path(directory)
        self.manifest = manifest
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_entries: dict[str, dict] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.entries: dict[str, dict] = {}

    def add(self, name: str, value: QuantizedTensor | torch.Tensor) -> None:
        tensors = value.tensors(name) if isinstance(value, QuantizedTensor) else {name: value}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        if isinstance(value, QuantizedTensor):  # after the flush: the entry goes with the shard holding its parts
            self._pending_entries[name] = manifest_entry(value)
        for key, t in tensors.items():
            if key in self._pending or any(key in names for _, names in self._shards):
                raise CheckpointError(f"tensor {key} would be written twice; rename or drop the duplicate")
            self._pending[key] = t.detach().to("cpu").contiguous()
        self._pending_bytes += size

    def _shard_metadata(self, entries: dict[str, dict]) -> dict[str, str]:
        meta = {"format": "pt"}
        if self.manifest is not None:
            meta[MANIFEST_KEY] = jsontext.dumps({**self.manifest, "tensors": entries}, what="the checkpoint's manifest")
        return meta

    def _flush(self) -> None:
        path = self.directory / f"model-{len(self._shards) + 1:05d}.safetensors.part"
        save_file(self._pending, str(path), metadata=self._shard_metadata(self._pending_entries))
        sort_header_metadata(path)
        path.chmod(0o666 & ~_UMASK)  # safetensors creates files 0600; give them the usual permissions
        self._shards.append((path, sorted(self._pending)))
        self.entries.update(self._pending_entries)
        self.total_bytes += self._pending_bytes
        self._pending, self._pending_entries, self._pending_bytes = {}, {}, 0

    def close(self) -> list[Path]:
        """Flush the last shard, name the shards, write the index when there is more than one."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = self.directory / SINGLE_FILE
            self._shards[0][0].rename(final)
            return [final]
        weight_map: dict[str, str] = {}
        paths = []
        for i, (part, names) in enumerate(self._shards, start=1):
            final = self.directory / f"model-{i:05d}-of-{n:05d}.safetensors"
            part.rename(final)
            paths.append(final)
            weight_map.update({k: final.name for k in names})
        meta: dict[str, Any] = {"total_size": self.total_bytes}
        if self.manifest is not None:
            meta[MANIFEST_KEY] = {**self.manifest, "tensors": self.entries}
        write_json(self.directory / INDEX_FILE, {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))})
        return paths


# --------------------------------------------------------------------------- reading


def _read_index(index: Path) -> dict[str, Any]:
    """A ``model.safetensors.index.json``: an object whose ``weight_map`` maps tensor names to the plain file
    names of shards in the same directory (a name with a path separator could point outside it), and whose
    ``metadata``, if any, is an object. Anything else is one ``CheckpointError`` line naming the index."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not valid JSON ({exc}); re-download or re-create the checkpoint") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {index} ({exc.strerror or exc}); check its permissions") from exc
    fix = "re-download or re-create the checkpoint"
    check(data, _INDEX, str(index), error=CheckpointError, fix=fix)  # types: weight_map of strings, metadata
    weight_map = data.get("weight_map")
    if not weight_map:
        raise CheckpointError(f"{index} has no weight_map object naming the shards; {fix}")
    bad = [v for v in weight_map.values() if v in ("", ".", "..") or Path(v).name != v or "\\" in v]
    if bad:
        raise CheckpointError(f"{index}: weight_map names {bad[0]!r}, not a shard file name in the checkpoint directory; {fix}")
    return data


# What ``_read_index`` reads of an index: tensor name -> shard file name, and an optional metadata object.
_INDEX = obj({"weight_map": obj(values=STRING), "metadata": OBJECT})


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order (see ``_read_index`` for what an index
    must hold; every shard it names must exist)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        files = list(dict.fromkeys(_read_index(index)["weight_map"].values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s) {', '.join(missing)}; re-download or re-create the checkpoint")
        return [directory / f for f in files]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    return sorted(directory.glob("*.safetensors"))


@contextlib.contextmanager
def open_safetensors(path: Path, device: str = "cpu"):
    """``safe_open`` with corrupt or truncated files turned into one clear ``CheckpointError``."""
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            yield f
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt: {str(exc).splitlines()[0]}); "
            "re-download or re-create it"
        ) from exc


def tensor_shards(directory: Path, names: Iterable[str]) -> dict[str, Path]:
    """``{name: the safetensors shard holding it}`` for those of ``names`` the model's files hold."""
    wanted, where = set(names), {}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            where.update((k, path) for k in wanted.intersection(f.keys()))
    return where


def tensor_reader(directory: Path, names: Iterable[str], device: str = "cpu") -> Callable[[str], torch.Tensor]:
    """``read(name)``: one of ``names`` read by itself from its shard, in its stored dtype (the source weights
    a method quantizes, whatever dtype the model runs in); the shards' headers are read once, here."""
    where = tensor_shards(directory, names)

    def read(name: str) -> torch.Tensor:
        with open_safetensors(where[name]) as f:
            w = f.get_tensor(name)
        return w if device == "cpu" else w.to(device)
    return read


def read_manifest(directory: Path) -> dict | None:
    """The merged qkit manifest of a checkpoint directory, or ``None`` for a plain model directory.

    Checked whole before any tensor is read (``_manifest``): a tampered or truncated manifest is one
    ``CheckpointError`` line naming the file and, for a bad entry, the tensor.
    """
    return _manifest(directory)[0]


Spec = tuple[Any, tuple[int, ...], torch.dtype]  # (scheme, original shape, original dtype) of one quantized weight


def _manifest(directory: Path) -> tuple[dict | None, dict[str, Spec]]:
    """``(merged manifest or None, {weight name: spec})``.

    Every shard's manifest must be a JSON object of this format and version with a ``tensors`` object,
    the same in every shard but for ``tensors``; every entry must rebuild (``entry_to_spec``); a tensor
    listed by two shards must have one entry; an index's ``metadata.qkit``, if any, must be the merged
    manifest (no reader uses it, so a tampered copy would otherwise pass unnoticed).
    """
    merged: dict | None = None
    specs: dict[str, Spec] = {}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            raw = (f.metadata() or {}).get(MANIFEST_KEY)
        if raw is None:
            continue
        try:
            shard = json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{path}: the qkit manifest is not valid JSON ({exc}); re-create the checkpoint") from exc
        if not isinstance(shard, dict) or not isinstance(shard.get("tensors"), dict):
            raise CheckpointError(f"{path}: the qkit manifest is not an object with a tensors object; re-create the checkpoint")
        if shard.get("format") != MANIFEST_FORMAT or shard.get("format_version") != MANIFEST_VERSION:
            raise CheckpointError(
                f"{path}: the qkit manifest is format {shard.get('format')!r} version {shard.get('format_version')!r}; "
                f"this qkit reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}: re-create the checkpoint with it"
            )
        if merged is None:
            merged = {**shard, "tensors": {}}
        elif {k: v for k, v in shard.items() if k != "tensors"} != {k: v for k, v in merged.items() if k != "tensors"}:
            raise CheckpointError(f"{path}: the qkit manifest differs from the first shard's; re-create the checkpoint")
        for name, entry in shard["tensors"].items():
            if name in merged["tensors"]:
                if merged["tensors"][name] != entry:
                    raise CheckpointError(f"{path}: tensor {name} has two different manifest entries; re-create the checkpoint")
                continue
            try:
                specs[name] = entry_to_spec(entry, name)
            except CheckpointError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
            merged["tensors"][name] = entry
    index = Path(directory) / INDEX_FILE
    if index.is_file():
        recorded = _read_index(index).get("metadata", {}).get(MANIFEST_KEY)
        if recorded is not None and recorded != merged:
            raise CheckpointError(
                f"{index}: its qkit manifest (metadata.qkit) differs from the one in the shards; re-create the checkpoint"
            )
    return merged, specs


# The one table of safetensors header dtype names -> torch dtypes (the names the format's spec defines
# that torch can hold); readers, the exporters and GPTQ all look dtypes up here.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
# The floating ones that can be a quantization source (fp8 is a stored format, not a source).
_SOURCE_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def tensor_dtypes(directory: Path, *, floating_only: bool = False) -> dict[str, torch.dtype | None]:
    """The dtype of every stored tensor, ``{name: dtype}``, read from the shard headers only (no data).

    A header dtype that torch cannot hold maps to ``None``; so does every non-source dtype (anything but
    F64/F32/F16/BF16) when ``floating_only`` (what a quantization plan needs: only those can be sources).
    """
    out: dict[str, torch.dtype | None] = {}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                dtype = SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                out[key] = None if floating_only and dtype not in _SOURCE_DTYPES else dtype
    return out


def _check_header_entry(key: str, v: Any, data_bytes: int) -> None:
    """One header entry: ``{"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}`` with
    ``0 <= begin <= end <= data_bytes`` and, for a known dtype, ``end - begin`` the bytes of that shape."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str):
        raise ValueError(f"tensor {key} has no dtype")
    shape, offsets = v.get("shape"), v.get("data_offsets")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise ValueError(f"tensor {key} has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(x) for x in offsets) or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {key} has data offsets {offsets!r}")
    if offsets[1] > data_bytes:
        raise ValueError(f"tensor {key} ends past the end of the file")
    dtype = SAFETENSORS_DTYPES.get(v["dtype"])
    if dtype is not None and math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {key}: {offsets[1] - offsets[0]} bytes do not hold a {v['dtype']} {shape}")


def _read_header(path: Path, fh) -> tuple[dict, int]:
    """A safetensors file's header (8-byte little-endian length, then JSON) and where its data starts;
    every entry checked (``_check_header_entry``), so a corrupt header is one line, not a reshape error."""
    try:
        size = os.fstat(fh.fileno()).st_size
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ValueError("the header is longer than the file")
        header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        for key, v in header.items():
            _check_header_entry(key, v, size - 8 - n)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt: {str(exc).splitlines()[0]}); "
            "re-download or re-create it"
        ) from exc
    return header, 8 + n


def iter_tensors(directory: Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream every stored tensor ``(name, tensor)``, one at a time, in each shard's sorted key order.

    Each tensor is read with plain file reads into its own buffer, not through a memory map: a mapped
    shard keeps every page it has touched resident until it is closed (the whole shard, counted in the
    process's RSS), while a read leaves only the page cache behind. Peak memory: the tensor being read.
    """
    for path in weight_files(directory):
        with open(path, "rb") as fh:
            header, start = _read_header(path, fh)
            for key in sorted(header):
                info = header[key]
                dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
                if dtype is None:
                    raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info.get('dtype')}; convert it")
                begin, end = (int(x) for x in info["data_offsets"])
                buf = torch.empty(end - begin, dtype=torch.uint8)
                fh.seek(start + begin)
                if fh.readinto(buf.numpy()) != end - begin:
                    raise CheckpointError(f"{path}: cannot read tensor {key} (file truncated); re-download or re-create it")
                t = buf.view(dtype).reshape(info["shape"]) if end > begin else torch.empty(info["shape"], dtype=dtype)
                yield key, (t if str(device) == "cpu" else t.to(device))


def tensor_shapes(directory: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of every stored tensor, without reading any data."""
    out = []
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            out += [(k, tuple(f.get_slice(k).get_shape())) for k in f.keys()]
    return out


@dataclass(frozen=True)
class _Stored:
    """A stored tensor as its header describes it (what ``check_parts`` compares, before any data is read)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str


def _check_stored_parts(directory: Path, specs: dict[str, Spec], listed: bool) -> None:
    """Every manifest entry's stored parts, from the headers alone: exactly the parts its scheme stores,
    each of the shape and dtype the scheme implies for the original shape (``check_parts``). Refuses
    before any data is read: missing, extra, truncated, re-typed or re-shaped parts, a weight stored
    both whole and as parts, and (``listed``: the checkpoint has a qkit manifest) the codes of a weight the
    manifest does not list (``NAME.qweight``: every scheme stores one), which would otherwise load as a
    tensor of raw codes. One ``CheckpointError`` naming the tensor."""
    parts: dict[str, dict[str, _Stored]] = {name: {} for name in specs}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                if key in specs:
                    raise CheckpointError(f"checkpoint {directory}: tensor {key} is stored whole and listed as quantized; re-create it")
                base, dot, part = key.rpartition(".")
                if listed and part == "qweight" and base not in parts:
                    raise CheckpointError(f"checkpoint {directory}: {key} holds the codes of tensor {base}, which the qkit "
                                          "manifest does not list; re-create it")
                if dot and base in parts:
                    info = f.get_slice(key)
                    parts[base][part] = _Stored(tuple(info.get_shape()), SAFETENSORS_DTYPES.get(info.get_dtype(), info.get_dtype()))
    for name, (scheme, shape, _) in specs.items():
        try:
            check_parts(scheme, parts[name], shape, name)
        except SchemeError as exc:
            raise CheckpointError(f"checkpoint {directory}: {exc}; re-create it") from None


def iter_quantized(directory: Path, device: str = "cpu") -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
    """Stream a checkpoint as ``(weight name, QuantizedTensor)`` for quantized weights, else ``(name, tensor)``.

    The manifest and every quantized weight's stored parts are checked before the first tensor is read
    (``_manifest``, ``_check_stored_parts``): a tampered checkpoint is refused in one line, never
    decoded into other weights. Parts are held until the last of a weight's parts arrives (a writer may
    split them across shards).
    """
    manifest, specs = _manifest(directory)
    _check_stored_parts(directory, specs, listed=manifest is not None)
    held: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in iter_tensors(directory, device):
        base, dot, part = key.rpartition(".")
        if dot and base in specs:
            scheme, shape, dtype = specs[base]
            parts = held.setdefault(base, {})
            parts[part] = t
            if len(parts) == len(scheme.parts):
                del held[base]
                try:  # checked above from the headers; from_parts checks the tensors themselves
                    yield base, QuantizedTensor.from_parts(scheme, parts, shape, dtype, name=base)
                except SchemeError as exc:
                    raise CheckpointError(f"checkpoint {directory}: {exc}; re-create it") from None
        else:
            yield key, t


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the weight files of a model directory (what the quality table reports as size)."""
    return sum(os.path.getsize(p) for p in weight_files(directory))
