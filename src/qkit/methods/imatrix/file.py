"""llama.cpp's importance-matrix files: the GGUF format ``llama-imatrix`` writes, and the legacy ``.dat``.

**GGUF** (``tools/imatrix/imatrix.cpp::save_imatrix`` at the pinned commit): ``general.type =
"imatrix"``, ``imatrix.datasets`` (array of strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size``
(u32); per weight ``NAME`` (llama.cpp's tensor name, ``blk.3.attn_q.weight``) two F32 tensors in sorted
name order: ``NAME.in_sum2`` ggml ``[ne0, n_mat]`` (numpy ``[n_mat, ne0]``), the sum over the collected
tokens of ``x[j]**2`` for each input column ``j`` (one row per expert of a stacked ``_exps`` tensor:
``n_mat`` experts; 1 for any other), and ``NAME.counts`` ``[1, n_mat]``, the number of tokens each row
summed. A dense entry's two tensors are stored 1-D (``[ne0]``, ``[1]``): gguf drops a trailing 1.

**Legacy** (``save_imatrix_legacy``): int32 ``n_entries``; per entry int32 ``len``, the name, int32
``ncall``, int32 ``nval``, ``nval`` float32 ``(sum / count) * ncall``; then optionally int32 ``chunk_count``
and int32 ``len`` + the dataset name.

What ``llama-quantize --imatrix`` passes to the quantizer (``tools/quantize/quantize.cpp::load_imatrix``),
:meth:`ImatrixEntry.quant_weights`: GGUF ``in_sum2 / (float) count`` per row (fp32 division; 1 for a row
whose count is 0), legacy ``value / ncall`` (the value itself when ``ncall`` is 0).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qkit import jsontext, reading
from qkit.errors import InputError

GENERAL_TYPE = "imatrix"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUMS, COUNTS = ".in_sum2", ".counts"
KEY_QKIT = "qkit.imatrix"  # qkit's record (JSON: version, calibration provenance); llama.cpp ignores unknown keys


@dataclass
class ImatrixEntry:
    """One weight's statistics: ``sums`` fp32 ``[n_mat, ne0]`` and ``counts`` ``[n_mat]`` (tokens; for a
    legacy file the single ``ncall``, with ``sums`` holding ``(sum / count) * ncall``)."""

    sums: np.ndarray
    counts: np.ndarray

    @property
    def width(self) -> int:
        return int(self.sums.shape[-1])

    def quant_weights(self, legacy: bool) -> np.ndarray:
        """fp32 ``[n_mat * ne0]``: what llama-quantize hands ``ggml_quantize_chunk`` (module docstring)."""
        sums = self.sums.astype(np.float32, copy=False)
        if legacy:
            ncall = np.float32(self.counts[0]) if self.counts.size else np.float32(0)
            return (sums / ncall).reshape(-1) if ncall > 0 else sums.reshape(-1).copy()
        counts = np.rint(self.counts.astype(np.float64)).astype(np.float32).reshape(-1, 1)  # std::lround, then (float)
        out = np.where(counts > 0, sums / np.where(counts > 0, counts, np.float32(1)), np.float32(1))
        return out.astype(np.float32).reshape(-1)


@dataclass
class Imatrix:
    """An importance matrix: ``entries`` by llama.cpp tensor name, and what it was collected from."""

    entries: dict[str, ImatrixEntry]
    chunk_count: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)
    legacy: bool = False
    source: str = ""  # the file it was read from
    record: dict | None = None  # qkit's record (KEY_QKIT) when qkit wrote the file
    sha256: str = ""  # of the file it was read from

    def to_record(self, weighted: int) -> dict:
        """What a checkpoint's manifest says of the matrix it was quantized with."""
        return {"file": self.source, "sha256": self.sha256, "format": "dat" if self.legacy else "gguf",
                "entries": len(self.entries), "chunk_count": self.chunk_count, "chunk_size": self.chunk_size,
                "datasets": list(self.datasets), "weighted_tensors": weighted,
                **({"collected_by": self.record} if self.record else {})}

    def quant_weights(self, gguf_name: str) -> np.ndarray | None:
        e = self.entries.get(gguf_name)
        return None if e is None else e.quant_weights(self.legacy)


# --------------------------------------------------------------------------- writing


def write_gguf(imatrix: Imatrix, path: Path) -> None:
    """Write ``imatrix`` as llama-imatrix's GGUF (sorted names; F32 tensors) to ``path``."""
    import gguf  # the gguf package writes the container (a dependency; imported with the writer)

    w = gguf.GGUFWriter(str(path), arch=None)  # type: ignore[arg-type]
    w.add_string("general.type", GENERAL_TYPE)
    w.add_array(KEY_DATASETS, list(imatrix.datasets))
    w.add_uint32(KEY_CHUNK_COUNT, int(imatrix.chunk_count))
    w.add_uint32(KEY_CHUNK_SIZE, int(imatrix.chunk_size))
    if imatrix.record is not None:
        w.add_string(KEY_QKIT, jsontext.dumps(imatrix.record, what=f"{path}: its {KEY_QKIT} record"))
    for name in sorted(imatrix.entries):
        e = imatrix.entries[name]
        # ggml ne [ne0, n_mat] and [1, n_mat], as llama-imatrix makes them; gguf_add_tensor stores ggml_n_dims
        # dimensions, so a dense entry's (n_mat 1) are 1-D: [ne0] and [1]
        sums = np.ascontiguousarray(e.sums, dtype=np.float32).reshape(-1, e.width)
        counts = np.asarray(e.counts, dtype=np.float32).reshape(-1, 1)
        dense = sums.shape[0] == 1
        w.add_tensor(name + SUMS, sums.reshape(-1) if dense else sums)
        w.add_tensor(name + COUNTS, counts.reshape(-1) if dense else counts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------- reading


def read(path: str | Path) -> Imatrix:
    """Read a GGUF or legacy ``.dat`` importance matrix (by its magic), refusing a malformed one in one line."""
    p = Path(path)
    try:  # a FIFO, a device, a directory or a link loop: refused before it is opened (qkit.reading)
        with reading.open_file(p, f"--imatrix {path}", "give a file written by llama-imatrix or qkit imatrix") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise InputError(f"--imatrix {path}: cannot read it ({exc.strerror or exc})") from None
    if not magic:
        raise _bad(p, "the file is empty")
    matrix = _read_gguf(p) if magic == b"GGUF" else _read_legacy(p)
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    matrix.sha256 = h.hexdigest()
    return matrix


def _bad(path: Path, what: str) -> InputError:
    return InputError(f"--imatrix {path}: {what}; give a file written by llama-imatrix or qkit imatrix")


def _read_gguf(path: Path) -> Imatrix:
    import gguf  # see write_gguf

    try:
        r = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure of a damaged file is the same one-line refusal
        raise _bad(path, f"not a readable GGUF ({type(exc).__name__}: {exc})") from None
    fields = r.fields

    def scalar(key: str) -> int | None:
        f = fields.get(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    def text(key: str) -> str | None:
        f = fields.get(key)
        return None if f is None else bytes(f.parts[f.data[0]]).decode("utf-8", "replace")

    kind = text("general.type")
    if kind is not None and kind != GENERAL_TYPE:
        raise _bad(path, f"a GGUF of general.type {kind!r}, not an importance matrix")
    datasets: list[str] = []
    if KEY_DATASETS in fields:
        f = fields[KEY_DATASETS]
        datasets = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        for suffix in (SUMS, COUNTS):
            if t.name.endswith(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise _bad(path, f"tensor {t.name} is {t.tensor_type.name}, not F32")
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = np.array(t.data, dtype=np.float32)
    if not pairs:
        raise _bad(path, "no .in_sum2/.counts tensors")
    entries = {}
    for name, pc in sorted(pairs.items()):
        if SUMS not in pc or COUNTS not in pc:
            raise _bad(path, f"mismatched sums and counts for {name}")
        counts = pc[COUNTS].reshape(-1)
        sums = pc[SUMS].reshape(counts.size, -1) if pc[SUMS].size % max(counts.size, 1) == 0 else None
        if sums is None or counts.size == 0:
            raise _bad(path, f"entry {name} has {pc[SUMS].size} sums for {counts.size} counts")
        _check_values(path, name, sums, counts)
        entries[name] = ImatrixEntry(sums, counts)
    record = None
    if text(KEY_QKIT) is not None:
        try:
            record = json.loads(text(KEY_QKIT) or "")
        except ValueError:
            raise _bad(path, f"its {KEY_QKIT} record is not JSON") from None
        if jsontext.first_nonfinite(record) is not None:  # it is copied into the manifest qkit writes, strict JSON
            raise _bad(path, f"its {KEY_QKIT} record holds a number that is not finite")
    return Imatrix(entries, scalar(KEY_CHUNK_COUNT) or 0, scalar(KEY_CHUNK_SIZE) or 0, datasets, False, str(path), record)


def is_qkit_imatrix(path: Path) -> bool:
    """Whether ``path`` is an importance matrix qkit wrote (its GGUF carries ``qkit.imatrix``): what --force may replace."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                return False
        return read(path).record is not None
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def _check_values(path: Path, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
    """Sums of squares are finite and never negative; token counts too, and whole numbers. A count of 0 is read (llama.cpp
    writes it for a row no token reached, and llama-quantize weights that row by 1s); ``quant_weights_for``
    refuses it for a tensor it would weight."""
    if not np.isfinite(sums).all() or not np.isfinite(counts).all():
        raise _bad(path, f"entry {name} holds non-finite values (NaN or inf)")
    if (sums < 0).any():
        raise _bad(path, f"entry {name} holds negative sums of squares")
    if (counts < 0).any():
        raise _bad(path, f"entry {name} counts {float(counts.min()):g} tokens, a negative count")
    frac = counts[counts != np.rint(counts)]
    if frac.size:  # llama-imatrix counts whole tokens; 0.4 would round to 0 and be weighted as if absent
        raise _bad(path, f"entry {name} counts {float(frac[0]):g} tokens, not a whole number")


def _read_legacy(path: Path) -> Imatrix:
    # memory-mapped, never read whole: every length is checked against the file's size before it is used
    try:
        with open(path, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise InputError(f"--imatrix {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return _parse_legacy(path, data)
    finally:
        data.close()


def _parse_legacy(path: Path, data: mmap.mmap) -> Imatrix:
    pos = 0
    size = len(data)

    def take(fmt: str) -> tuple:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise _bad(path, "truncated (neither a GGUF nor a complete legacy .dat importance matrix)")
        out = struct.unpack_from(fmt, data, pos)
        pos += n
        return out

    (n,) = take("<i")
    # each entry takes at least 4 + 1 + 8 + 4 bytes: a count the file cannot hold is refused before the loop
    if n < 1 or n > 1_000_000 or 4 + 17 * n > size:
        raise _bad(path, f"not an importance matrix (legacy header says {n} entries in {size:,} bytes)")
    entries = {}
    for _ in range(n):
        (length,) = take("<i")
        if not 0 < length < 4096 or pos + length > size:
            raise _bad(path, f"an entry name of length {length}")
        name = bytes(data[pos : pos + length]).decode("utf-8", "replace")
        pos += length
        ncall, nval = take("<ii")
        if nval < 1 or pos + 4 * nval > size:
            raise _bad(path, f"entry {name} declares {nval} values, which the file does not hold")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        _check_values(path, name, values, np.array([ncall], dtype=np.float64))
        if name in entries:
            raise _bad(path, f"entry {name} appears twice")
        entries[name] = ImatrixEntry(values.reshape(1, -1), np.array([ncall], dtype=np.float32))
    chunk_count, datasets = 0, []
    if pos + 4 <= size:
        (chunk_count,) = take("<i")
        if pos + 4 <= size:
            (length,) = take("<i")
            if 0 < length <= size - pos:
                datasets.append(bytes(data[pos : pos + length]).decode("utf-8", "replace"))
    return Imatrix(entries, chunk_count, 0, datasets, True, str(path))


__all__ = ["Imatrix", "ImatrixEntry", "is_qkit_imatrix", "read", "write_gguf"]
