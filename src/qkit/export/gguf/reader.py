"""A GGUF file read back as a reference model's tensors: what ``qkit eval --schemes file:PATH.gguf`` scores.

Any GGUF of a llama or qwen2 model can be such a row (llama.cpp's ``llama-quantize`` files, auto-round's,
qkit's own): ``read_weights`` reads its header alone (``read_header``: the KV fields in bulk and the tensor
infos, milliseconds where ``gguf.GGUFReader`` parses a vocabulary item by item), and refuses, in one line
naming the file, a file that is not GGUF, one of another architecture, one whose tensors are not the
reference's (a name llama.cpp's map gives none of the reference's tensors, a reference tensor it lacks, a
shape that differs), a truncated file, and a stored type the ``gguf`` package cannot dequantize.

``GGUFWeights.tensors()`` then yields each stored tensor under the reference's (Hugging Face) name as
float32, exactly ``gguf.quants.dequantize`` of its bytes, reshaped to the Hugging Face shape, with llama's
q/k row permutation undone (``qkit.llama_names``): what transformers' GGUF loader computes too. One tensor
is in memory at a time; the bytes are read through a memory map of the file.

What the table counts (``GGUFWeights.bits_per_weight``, ``size_bytes``): the tensors stored in a
quantized ggml type (a block of more than one weight), ``8 * sum(bytes) / sum(weights)`` over them, as
a GGUF row of qkit's own counts its quantized matrices' block bytes; and the file's bytes on disk
(header, metadata and every tensor), as a GGUF row measured in llama.cpp counts the file it wrote.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from qkit.checkpoint import tensor_shapes
from qkit.errors import ExportError, InputError
from qkit.export.gguf.metadata import Field, parse_kv
from qkit.llama_names import (
    ARCHITECTURES,
    arch_name,
    inverse_permutation,
    permutation_heads,
    tensor_names,
)

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT: the data section's alignment without general.alignment
# llama.cpp's tables computed from the config (llama3's RoPE factors), not weights of the model
RUNTIME_TABLES = frozenset({"rope_freqs.weight"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor info of a GGUF header: its name, ``ne`` (fastest dimension first), ggml type number and
    offset from the start of the data section."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class Header:
    """A GGUF file's header: its KV fields (``{key: value}``, and ``kv``: every ``metadata.Field`` with its
    type, in the file's order), tensor infos and where the data begins."""

    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    kv: tuple[Field, ...] = ()


def read_header(path: Path, what: str | None = None) -> Header:
    """The header of the little-endian GGUF v2/v3 file ``path``, read in bulk (never the tensor data).
    ``what``: how a refusal names the file (default: its path). ``InputError`` for anything else."""
    what = what or str(path)
    with open(path, "rb") as fh:
        head = fh.read(24)
        if len(head) < 24 or head[:4] != MAGIC:
            raise InputError(f"{what} is not a GGUF file (it does not begin with {MAGIC.decode()!r}); pass a .gguf file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise InputError(f"{what}: GGUF version {version} (big-endian or unknown); qkit reads v2 and v3 files")
        size = 1 << 22
        while True:  # the header's length is known only once parsed: read generously, grow if needed
            fh.seek(24)
            buf = fh.read(size)
            try:
                return _parse_header(memoryview(buf), n_kv, n_tensors)
            except (struct.error, IndexError, ValueError, UnicodeDecodeError, ExportError) as exc:
                if len(buf) < size or isinstance(exc, (ExportError, UnicodeDecodeError)):
                    raise InputError(f"{what} has a truncated or corrupt GGUF header "
                                     f"({' '.join(str(exc).split())[:120] or type(exc).__name__})") from None
                size *= 4


def _parse_header(buf: memoryview, n_kv: int, n_tensors: int) -> Header:
    fields, pos = parse_kv(buf, n_kv)
    infos = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise IndexError("tensor name past the buffer")
        name = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8")
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append(TensorInfo(name, tuple(int(d) for d in ne), int(ggml_type), int(offset)))
    kv = {key: value for key, _vtype, value, _sub in fields}
    alignment = int(kv.get("general.alignment", DEFAULT_ALIGNMENT))
    start = 24 + pos
    return Header(kv, tuple(infos), start + (-start) % alignment, tuple(fields))


def float32_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF whose tensors are all F32 (the converter's ``--outtype f32`` file), by its GGUF
    name, as a read-only float32 view of the file (numpy order: ``ne`` reversed). ``InputError`` for a
    tensor of another type."""
    header = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for t in header.tensors:
        if t.ggml_type != gguf.GGMLQuantizationType.F32:
            raise InputError(f"{path}: tensor {t.name} is {gguf.GGMLQuantizationType(t.ggml_type).name}, not F32")
        start = header.data_offset + t.offset
        out[t.name] = data[start:start + 4 * math.prod(t.ne)].view(np.float32).reshape(t.ne[::-1])
    return out


@functools.cache
def dequantizable(ggml_type: gguf.GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` has a dequantizer for the type (tried on one zero block)."""
    _block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the file under the reference's name: ``shape`` in Hugging Face's order (``ne``
    reversed), its ggml type, where its bytes are (``start``, ``nbytes``: from the file's start), and the
    head count llama's q/k permutation grouped its rows by (None: not permuted)."""

    gguf_name: str
    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    start: int
    nbytes: int
    permute_heads: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        """Stored in blocks of more than one weight (Q4_K, IQ4_XS, ...): not F32, F16 or BF16."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][0] > 1


@dataclass(frozen=True)
class GGUFWeights:
    """A GGUF file's tensors matched to a reference model (``read_weights``)."""

    path: Path
    tensors: tuple[StoredTensor, ...]

    @property
    def quantized(self) -> list[StoredTensor]:
        return [t for t in self.tensors if t.quantized]

    @property
    def bits_per_weight(self) -> float:
        """``8 * sum(bytes) / sum(weights)`` over the tensors stored in a quantized type (NaN: none is)."""
        q = self.quantized
        return 8 * sum(t.nbytes for t in q) / sum(t.numel for t in q) if q else math.nan

    @property
    def size_bytes(self) -> int:
        """The file's bytes on disk: header, metadata and every tensor."""
        return self.path.stat().st_size

    def dense(self, t: StoredTensor, data: np.ndarray) -> torch.Tensor:
        """``t`` as float32 in Hugging Face's shape: ``gguf.quants.dequantize`` of its bytes, q/k rows unpermuted."""
        raw = data[t.start:t.start + t.nbytes].reshape(-1, t.nbytes // max(1, t.numel // t.shape[-1]))
        values = gguf.quants.dequantize(raw, t.ggml_type)
        out = torch.from_numpy(values if values.flags.writeable else values.copy()).reshape(t.shape)
        if t.permute_heads is not None:
            out = out[inverse_permutation(t.shape[0], t.permute_heads)]
        return out

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stored weight as ``(Hugging Face name, float32 tensor)``, in the file's order, one at a time."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            for t in self.tensors:
                yield t.name, self.dense(t, data)
        finally:
            del data


def read_weights(path: str | Path, reference: Path, config: dict, *, what: str | None = None) -> GGUFWeights:
    """The GGUF file ``path`` matched to the reference model directory ``reference`` (its tensors' names and
    shapes from the safetensors headers) and its parsed ``config``. Refuses, in one ``InputError`` line
    naming the file as ``what``: see the module docstring."""
    path = Path(path)
    what = what or str(path)
    header = read_header(path, what)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise InputError(f"{what}: a GGUF row reads llama.cpp's {' and '.join(ARCHITECTURES)} files, and the "
                         f"reference is a {model_type!r} model")
    arch = header.fields.get("general.architecture")
    arch = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else arch
    kind = header.fields.get("general.type")
    kind = kind.decode("utf-8", "replace") if isinstance(kind, bytes) else kind
    if arch is None and kind is not None and kind != "model":  # an importance matrix, an adapter: not a model at all
        raise InputError(f"{what} is a GGUF of general.type {kind!r}, not a model (an importance matrix goes to "
                         "--imatrix); pass a GGUF model file of the reference")
    if arch is None:
        raise InputError(f"{what} is a GGUF without general.architecture, not a model file; pass a GGUF model "
                         "of the reference")
    if arch != arch_name(model_type):
        raise InputError(f"{what} is a GGUF of a {arch!r} model and the reference is {arch_name(model_type)!r}: "
                         "pass a GGUF of the reference model")
    shapes = dict(tensor_shapes(reference))
    tied = bool(config.get("tie_word_embeddings", False))
    try:
        names = tensor_names(model_type, int(config["num_hidden_layers"]), list(shapes), tied)
    except ExportError as exc:
        raise InputError(f"{what}: the reference's tensors have no GGUF names ({exc})") from None
    by_gguf = {g: hf for hf, g in names.items() if g is not None}
    stored = {t.name: t for t in header.tensors if t.name not in RUNTIME_TABLES}
    missing = sorted(set(by_gguf) - set(stored))
    extra = sorted(set(stored) - set(by_gguf))
    wrong = sorted(g for g in set(by_gguf) & set(stored) if tuple(reversed(stored[g].ne)) != tuple(shapes[by_gguf[g]]))
    if missing or extra or wrong:
        def some(items: list[str]) -> str:
            return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")

        parts = ([f"missing {some(missing)}"] if missing else []) + ([f"extra {some(extra)}"] if extra else []) + (
            [f"shape of {some([f'{g} {list(reversed(stored[g].ne))} (reference {list(shapes[by_gguf[g]])})' for g in wrong])}"]
            if wrong else [])
        raise InputError(f"{what} does not hold the reference's tensors ({'; '.join(parts)}): pass a GGUF of the "
                         "reference model")
    size = path.stat().st_size
    out = []
    for info in header.tensors:
        if info.name in RUNTIME_TABLES:
            continue
        try:
            qtype = gguf.GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise InputError(f"{what}: {info.name} has ggml type {info.ggml_type}, which the gguf package does not "
                             "know; upgrade gguf or pass another file") from None
        if not dequantizable(qtype):
            raise InputError(f"{what}: {info.name} is stored as {qtype.name}, which the gguf package cannot dequantize")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        numel = math.prod(info.ne)
        if info.ne[0] % block:
            raise InputError(f"{what}: {info.name}'s rows ({info.ne[0]}) are not whole {qtype.name} blocks of {block}")
        nbytes = numel // block * type_size
        start = header.data_offset + info.offset
        if start + nbytes > size:
            raise InputError(f"{what} is truncated: {info.name} ends at byte {start + nbytes}, the file has {size}")
        hf = by_gguf[info.name]
        out.append(StoredTensor(info.name, hf, tuple(shapes[hf]), qtype, start, nbytes,
                                permutation_heads(model_type, config, hf)))
    return GGUFWeights(path, tuple(out))


__all__ = [
    "RUNTIME_TABLES",
    "float32_tensors",
    "GGUFWeights",
    "Header",
    "StoredTensor",
    "TensorInfo",
    "dequantizable",
    "read_header",
    "read_weights",
]
