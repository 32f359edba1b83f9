"""GGUF metadata: the ``{arch}.*`` keys llama.cpp's converter writes, a bulk reader of a file's KV header,
copying a source GGUF's fields byte for byte, and qkit's own ``qkit.export`` record inside the file.

The record (``qkit-export.json``'s content: scheme, shape, dtype and sha256 of every quantized tensor)
is stored under ``RECORD_KEY`` so ``qkit verify FILE.gguf`` can check a lone file; llama.cpp and
transformers ignore keys they do not know.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from qkit.errors import ExportError
from qkit.jsonfields import NULL, STRING, field
from qkit.pinned_models import with_sha256
from qkit.export.common import EXPORT_MANIFEST

NAME = "gguf"
FILE = "model.gguf"  # the file inside an OUT directory
RECORD_KEY = "qkit.export"  # the export record, as JSON text, inside the file
SOURCE_FILE = "qkit-source.json"  # written by qkit.models next to a model it converted from a GGUF
# A KV field as read_kv_fields gives it: (key, GGUFValueType, value, array item type or None)
Field = tuple[str, int, Any, int | None]

def rope_parameters(config: dict) -> dict:
    """The RoPE settings of a config, whichever key holds them (``rope_parameters``, ``rope_scaling``, top level)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params.get("full_attention", params)
    out = dict(params)
    if "rope_theta" not in out and config.get("rope_theta") is not None:
        out["rope_theta"] = config["rope_theta"]
    if "rope_type" not in out and out.get("type") is not None:
        out["rope_type"] = out["type"]
    return out


def llama3_rope_factors(config: dict) -> torch.Tensor:
    """``rope_freqs.weight`` for a llama-3 RoPE (``LlamaModel.generate_extra_tensors``), float32 ``[head_dim / 2]``."""
    rope = rope_parameters(config)
    base = rope.get("rope_theta", 10000.0)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = config.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def add_architecture_metadata(w, arch: str, config: dict, ftype) -> None:
    """The ``{arch}.*`` keys llama.cpp's converter writes for this config, and ``general.file_type``."""
    w.add_block_count(config["num_hidden_layers"])
    if config.get("max_position_embeddings") is not None:
        w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None:
        w.add_head_count_kv(config["num_key_value_heads"])
    rope = rope_parameters(config)
    kind = (rope.get("rope_type") or "default").lower()
    if kind == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if config.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


GENERAL_KEPT = ("architecture", "type", "file_type", "quantization_version", "alignment")


# numpy dtypes of GGUF's scalar value types (GGUFValueType: UINT8 0 ... FLOAT64 12; 8 STRING, 9 ARRAY)
KV_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_kv_fields(path: Path) -> list[Field]:
    """The KV fields of a little-endian GGUF file (v2 or v3) as ``(key, type, value, array item type)``:
    strings as ``bytes``, arrays as lists (of ``bytes`` or Python numbers), scalars as Python values.

    Reads the header only, in bulk: ``gguf.GGUFReader`` parses every item of every array into its own
    numpy view and takes about 4 s on the default model's 49,152-token vocabulary; this takes a fraction of
    a second. Anything it does not recognise is an ``ExportError`` (a file to read with the gguf package).
    """

    with open(path, "rb") as fh:
        head = fh.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ExportError(f"{path} is not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ExportError(f"{path}: GGUF version {version} (big-endian or unknown); qkit copies metadata from v2/v3 files")
        # The KV section ends before the tensor infos; read generously and grow if needed.
        size = 1 << 22
        while True:
            fh.seek(24)
            buf = fh.read(size)
            try:
                return parse_kv(memoryview(buf), n_kv)[0]
            except (struct.error, IndexError, ValueError):
                if len(buf) < size:
                    raise ExportError(f"{path}: truncated GGUF metadata") from None
                size *= 4


def parse_kv(buf: memoryview, n_kv: int) -> tuple[list[Field], int]:
    """``n_kv`` KV fields parsed from ``buf`` (a GGUF header from just after its 24-byte preamble), and the
    offset in ``buf`` where they end (the tensor infos begin there). Raises ``struct.error``,
    ``IndexError`` or ``ValueError`` when ``buf`` ends before they do."""

    out: list[Field] = []
    pos = 0

    def string() -> bytes:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        start, pos = pos + 8, pos + 8 + n
        if pos > len(buf):
            raise IndexError("string past the buffer")
        return bytes(buf[start:pos])

    for _ in range(n_kv):
        raw = string()
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ExportError(f"a GGUF metadata key is not UTF-8 ({raw[:40]!r}); the file is corrupt") from None
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype == 8:
            out.append((key, vtype, string(), None))
        elif vtype == 9:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub == 8:  # a vocabulary: 100k strings, read in one tight loop
                items, unpack, size = [], struct.Struct("<Q").unpack_from, len(buf)
                for _ in range(count):
                    (n,) = unpack(buf, pos)
                    start, pos = pos + 8, pos + 8 + n
                    if pos > size:
                        raise IndexError("string past the buffer")
                    items.append(bytes(buf[start:pos]))
                out.append((key, vtype, items, sub))
            elif sub in KV_DTYPES:
                dt = np.dtype(KV_DTYPES[sub])
                end = pos + dt.itemsize * count
                if end > len(buf):
                    raise IndexError("array past the buffer")
                out.append((key, vtype, np.frombuffer(buf[pos:end], dtype=dt).tolist(), sub))
                pos = end
            else:
                raise ExportError(f"GGUF field {key}: arrays of type {sub} are not copied by qkit")
        elif vtype in KV_DTYPES:
            dt = np.dtype(KV_DTYPES[vtype])
            out.append((key, vtype, np.frombuffer(buf[pos : pos + dt.itemsize], dtype=dt).tolist()[0], None))
            pos += dt.itemsize
        else:
            raise ExportError(f"GGUF field {key}: value type {vtype} is not one qkit copies")
    return out, pos


def copy_fields(w, fields: list[Field], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every KV field (``read_kv_fields``) under ``prefix`` into writer ``w`` with its exact bytes and types."""
    V = gguf.GGUFValueType
    copied = []
    for key, vtype, value, sub in fields:
        if not key.startswith(prefix) or key.removeprefix(prefix) in skip:
            continue
        if vtype == V.ARRAY:
            if not value:
                continue
            w.add_key_value(key, value, V.ARRAY, sub_type=V(sub))
        else:
            w.add_key_value(key, value, V(vtype))
        copied.append(key)
    return copied


# --------------------------------------------------------------------------- qkit's record and the source GGUF


def is_qkit_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file qkit wrote: its header carries the ``qkit.export`` record (reads the
    metadata only, never the tensors)."""
    try:
        return any(key == RECORD_KEY for key, *_ in read_kv_fields(Path(path)))
    except (ExportError, OSError, ValueError):
        return False


def read_record(path: Path, reader=None) -> dict | None:
    """The export record of a GGUF file: its ``qkit.export`` field, else ``qkit-export.json`` beside it (an OUT directory).

    ``reader``: a ``gguf.GGUFReader`` of ``path`` already open (parsing a 50k-token vocabulary takes seconds).
    """
    reader = reader if reader is not None else gguf.GGUFReader(str(path))
    f = reader.fields.get(RECORD_KEY)
    if f is not None:
        return json.loads(bytes(f.parts[-1]).decode("utf-8"))
    sidecar = Path(path).parent / EXPORT_MANIFEST
    if Path(path).name == FILE and sidecar.is_file():
        return json.loads(sidecar.read_text())
    return None


def source_gguf(directory: Path, ref=None) -> Path | None:
    """The GGUF file a model directory was converted from, when it is still where qkit found it.

    From the resolved model (``qkit.models.ModelRef``: a ``.gguf`` argument, or a pinned model), else from
    ``qkit-source.json`` in the cached directory when it names a pinned model's GGUF.
    """
    if ref is not None and ref.kind == "gguf" and ref.provenance.get("gguf"):
        path = Path(ref.provenance["gguf"])
        return path if path.is_file() else None
    record = Path(directory) / SOURCE_FILE
    sha = None
    if ref is not None and ref.kind in ("default", "pinned"):
        sha = ref.provenance.get("sha256")
    elif record.is_file():
        fix = "delete the directory and convert the GGUF again"
        try:
            doc = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ExportError(f"cannot read {record} as JSON ({' '.join(str(exc).split())[:120]}); {fix}") from exc
        sha = field(doc, "sha256", STRING | NULL, str(record), error=ExportError, fix=fix)
    pinned = with_sha256(sha)
    return pinned.asset.path if pinned is not None and pinned.asset.path.is_file() else None


__all__ = ["FILE", "NAME", "RECORD_KEY", "SOURCE_FILE", "add_architecture_metadata", "copy_fields", "is_qkit_gguf",
           "llama3_rope_factors", "parse_kv", "read_kv_fields", "read_record", "rope_parameters", "source_gguf"]
