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
import os
import re
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from qkit.errors import CheckpointError, OutputExistsError
from qkit.schemes import QuantizedTensor
from qkit.transform import entry_to_spec, manifest_entry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_KEY = "qkit"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_UMASK = os.umask(0)
os.umask(_UMASK)


# --------------------------------------------------------------------------- atomic output


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing ``out`` unless ``force``; call before any expensive work."""
    if out.exists() and not force:
        raise OutputExistsError(f"output {out} already exists; pass --force to replace it or choose another -o")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output {out} exists and is not a directory; remove it or choose another -o")


TMP_MARK = ".qkit-tmp-"  # hidden sibling being written: .NAME.qkit-tmp-PID-RANDOM
OLD_MARK = ".qkit-old-"  # the replaced output, removed once the new one is in place: .NAME.qkit-old-PID-RANDOM
_SIBLING = re.compile(r"^\.(?P<name>.+)(?:\.qkit-tmp-|\.qkit-old-)(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)`` sends nothing; it only checks)."""
    if pid <= 0:
        return True  # not a writer's pid: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's process) or cannot tell: keep its directory
    return True


def stale_siblings(out: Path) -> list[Path]:
    """Hidden temporary siblings (``.NAME.qkit-tmp-PID-*``, ``.NAME.qkit-old-PID-*``) in ``out``'s parent
    whose writer process is gone: what a run killed with SIGKILL (or a power cut) leaves behind.

    Any NAME counts: every such directory in the parent was written by qkit and is garbage once its
    writer has exited. The name holds the writer's PID only (no host name); on a file system shared
    between machines, a writer on another host whose PID does not exist here would count as gone.
    """
    parent = Path(out).parent
    try:
        entries = list(parent.iterdir())
    except OSError:  # no parent yet: nothing to clean
        return []
    found = []
    for p in entries:
        m = _SIBLING.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group("pid"))):
            found.append(p)
    return sorted(found)


def remove_stale_siblings(out: Path) -> list[Path]:
    """Remove ``stale_siblings(out)``; return the paths removed (to report them)."""
    removed = []
    for p in stale_siblings(out):
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_directory(
    out: Path, force: bool = False, on_stale: Callable[[list[Path]], None] | None = None
) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``out`` by rename, else it is removed.

    An interrupted or failed write never leaves a partial ``out`` and never touches an existing one. The
    sibling is ``.NAME.qkit-tmp-PID-RANDOM``: a run killed before it could clean up (SIGKILL) leaves only
    that, and the next write into the same parent removes it (``remove_stale_siblings``), reporting the
    removed paths to ``on_stale``.
    """
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_siblings(out)
    if removed and on_stale:
        on_stale(removed)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}{TMP_MARK}{tag}"
    tmp.mkdir()
    try:
        yield tmp
        old = out.parent / f".{out.name}{OLD_MARK}{tag}"
        if out.exists():
            check_output(out, force)  # it may have appeared while we worked
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- writing


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
        if isinstance(value, QuantizedTensor):
            tensors = value.tensors(name)
            self._pending_entries[name] = manifest_entry(value)
        else:
            tensors = {name: value}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        for key, t in tensors.items():
            if key in self._pending or any(key in names for _, names in self._shards):
                raise CheckpointError(f"tensor {key} would be written twice; rename or drop the duplicate")
            self._pending[key] = t.detach().to("cpu").contiguous()
        self._pending_bytes += size

    def _shard_metadata(self, entries: dict[str, dict]) -> dict[str, str]:
        meta = {"format": "pt"}
        if self.manifest is not None:
            meta[MANIFEST_KEY] = json.dumps({**self.manifest, "tensors": entries}, sort_keys=True)
        return meta

    def _flush(self) -> None:
        path = self.directory / f"model-{len(self._shards) + 1:05d}.safetensors.part"
        save_file(self._pending, str(path), metadata=self._shard_metadata(self._pending_entries))
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


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc}); re-create it") from exc
        files = list(dict.fromkeys(weight_map.values()))
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


def read_manifest(directory: Path) -> dict | None:
    """The merged qkit manifest of a checkpoint directory, or ``None`` for a plain model directory."""
    merged: dict | None = None
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            raw = (f.metadata() or {}).get(MANIFEST_KEY)
        if raw is None:
            continue
        try:
            shard = json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{path}: the qkit manifest is not valid JSON ({exc}); re-create the checkpoint") from exc
        if merged is None:
            merged = {**shard, "tensors": {}}
        merged["tensors"].update(shard.get("tensors", {}))
    return merged


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


def _read_header(path: Path, fh) -> tuple[dict, int]:
    """A safetensors file's header (8-byte little-endian length, then JSON) and where its data starts."""
    try:
        size = os.fstat(fh.fileno()).st_size
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ValueError("the header is longer than the file")
        header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        if any(8 + n + int(v["data_offsets"][1]) > size for v in header.values()):
            raise ValueError("a tensor ends past the end of the file")
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
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
                dtype = _ST_DTYPES.get(info.get("dtype"))
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


def iter_quantized(directory: Path, device: str = "cpu") -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
    """Stream a checkpoint as ``(weight name, QuantizedTensor)`` for quantized weights, else ``(name, tensor)``."""
    manifest = read_manifest(directory) or {"tensors": {}}
    entries = manifest["tensors"]
    held: dict[str, dict[str, torch.Tensor]] = {}
    schemes: dict[str, tuple] = {}
    for key, t in iter_tensors(directory, device):
        base, dot, part = key.rpartition(".")
        if dot and base in entries:
            if base not in schemes:
                schemes[base] = entry_to_spec(entries[base])
            scheme, shape, dtype = schemes[base]
            if part not in scheme.parts:
                raise CheckpointError(f"checkpoint {directory}: unexpected tensor {key} for scheme {scheme.name}; re-create it")
            parts = held.setdefault(base, {})
            parts[part] = t
            if len(parts) == len(scheme.parts):
                yield base, QuantizedTensor.from_parts(scheme, parts, shape, dtype)
                del held[base], schemes[base]
        else:
            yield key, t
    if held:
        raise CheckpointError(
            f"checkpoint {directory} lacks stored parts (qweight, scales, ...) of {', '.join(sorted(held))}; re-create it"
        )


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the weight files of a model directory (what the quality table reports as size)."""
    return sum(os.path.getsize(p) for p in weight_files(directory))
