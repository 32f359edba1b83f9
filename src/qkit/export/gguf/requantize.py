"""llama-quantize in qkit: a float GGUF (llama.cpp's converter's F32, F16 or BF16 output, any architecture)
quantized into the file ``llama-quantize [--imatrix F] [--pure] [--token-embedding-type T]
[--output-tensor-type T] IN OUT FTYPE`` writes, byte for byte (``src/llama-quant.cpp``,
``llama_model_quantize_impl``, and ``tools/quantize/quantize.cpp``):

* **Types**: ``qkit.schemes.llama_rules.tensor_types`` (every architecture's rules, the counters in the
  loader's order); a tensor llama.cpp may not quantize (norms, 1-D, the router, ...) is copied as it is.
* **Bytes**: each tensor with qkit's block encoders (``recipes.scheme_for_type``: llama.cpp's block types,
  and ``mxfp4`` for MXFP4, whose parts are converted to the blocks), on the float32 values llama.cpp
  quantizes (F16/BF16 widened exactly). One divergence, by design: an MXFP4 block whose largest magnitude
  is below 2**-125 gets exponent 0, where llama.cpp's ``(uint8_t)`` cast of a negative exponent wraps
  (``qkit.schemes.fp4``). A 3-D expert tensor ``[n_expert, rows, cols]`` is
  quantized one expert at a time with that expert's row of the importance matrix: llama-imatrix stores
  an ``_exps`` entry as ``[n_expert, cols]`` (one ``counts`` per expert), llama-quantize hands
  ``ggml_quantize_chunk`` ``imatrix + expert * cols`` for each expert's rows. F16 and BF16 targets round
  as ``ggml_compute_fp32_to_fp16`` / ``_bf16`` do.
* **Metadata**: every KV field of the source in its order (strings cut at a NUL, as llama.cpp's
  ``gguf_set_kv`` copies them through ``c_str()``), then ``general.quantization_version`` (2) and
  ``general.file_type`` (the ftype) removed and appended (``gguf_set_val_u32``), the ``split.*`` keys
  removed, then with an importance matrix ``quantize.imatrix.file`` (the path as given, 127 bytes at
  most), ``quantize.imatrix.dataset`` (its first dataset), ``quantize.imatrix.entries_count`` and
  ``quantize.imatrix.chunks_count`` (u32: llama-quantize's integer overrides are written as u32), and
  last qkit's ``qkit.export`` record (``record=False`` leaves it out: then the whole file is
  llama-quantize's).
* **Layout**: tensors in the loader's order (by ``blk.N.``, then by name), ``ggml_n_dims`` dimensions
  (trailing 1s dropped), 32-byte alignment, every tensor padded with zeros.

Streaming: the header is written first (every type and size is known from the rules), then one tensor at
a time is read from a memory map, converted and written. Everything is refused in one line before that:
an ftype or type qkit has no encoder for, a tensor to requantize that is not F32/F16/BF16 (llama-quantize
without ``--allow-requantize``), a GGUF of another alignment, an importance matrix naming tensors the file
lacks, of another width or expert count, or that cannot weight a search (``importance_problem``), and a
tensor whose type reads a matrix but has no entry (llama-quantize quantizes it unweighted; qkit refuses,
except ``token_embd`` and ``output``, which llama-imatrix does not collect). A matrix row that counted no
token is weighted by 1s, as llama-quantize does, and the report names it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
import torch

from qkit import jsontext
from qkit.errors import InputError, SchemeError
from qkit.assets import sha256_file
from qkit.checkpoint import write_json
from qkit.export.common import EXPORT_MANIFEST, EXPORT_VERSION
from qkit.export.gguf.metadata import FILE, KV_DTYPES, RECORD_KEY, Field, copy_fields
from qkit.export.gguf.reader import DEFAULT_ALIGNMENT, Header, TensorInfo, read_header
from qkit.export.gguf.types import decode_blocks, file_type
from qkit.export.gguf.writer import atomic_output
from qkit.schemes import GGMLCodable, Recipe, Scheme, quantize_tensor
from qkit.schemes.ggml import importance_problem, is_llama_type, uses_importance
from qkit.schemes.kquants import LLAMA_CPP_COMMIT
from qkit.schemes.fidelity import check_written
from qkit.schemes.llama_rules import ModelFacts, Params, category, is_quantized, n_dims, tensor_types
from qkit.schemes.recipes import scheme_for_type
from qkit.version import __version__

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType
V = gguf.GGUFValueType
FLOATS = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}  # what llama-quantize converts from
def ftype_name(f: F) -> str:
    """llama-quantize's name of an ftype: ``Q4_K_M``, ``F32``."""
    return f.name.removeprefix("MOSTLY_").removeprefix("ALL_")


# llama-quantize's QUANT_OPTIONS: each ftype by its name, and its aliases (COPY is not offered here)
FTYPES: dict[str, F] = {
    **{ftype_name(m): m for m in F if m not in (F.GUESSED, F.MOSTLY_NVFP4)},
    "Q3_K": F.MOSTLY_Q3_K_M, "Q4_K": F.MOSTLY_Q4_K_M, "Q5_K": F.MOSTLY_Q5_K_M,
}
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


class ImportanceMatrix(Protocol):
    """What is read of an importance matrix (``qkit.methods.imatrix.Imatrix``): entries by llama.cpp name,
    each with ``sums`` ``[n_mat, cols]``; ``quant_weights(name)``, fp32 ``[n_mat * cols]``, what
    llama-quantize hands the quantizer (``sums / count`` per row, 1s for a row of count 0)."""

    entries: Mapping[str, Any]
    datasets: Sequence[str]
    chunk_count: int
    source: str

    def quant_weights(self, gguf_name: str) -> np.ndarray | None: ...


@dataclass(frozen=True)
class Planned:
    """One tensor of the output: its source info, the type it is written in, and its importance rows."""

    info: TensorInfo
    ggml_type: T
    weights: np.ndarray | None = None  # fp32 [groups, cols], one row per expert (None: unweighted)

    @property
    def converted(self) -> bool:
        return int(self.ggml_type) != self.info.ggml_type

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.ggml_type, self.info.ne)


def tensor_bytes(ggml_type: T | int, ne: Sequence[int]) -> int:
    """``ggml_nbytes`` of a tensor of ``ne`` (fastest first) in ``ggml_type``: whole blocks per row."""
    elems, size = gguf.GGML_QUANT_SIZES[T(int(ggml_type))]
    return ne[0] // elems * size * int(np.prod(ne[1:], dtype=np.int64))


@dataclass(frozen=True)
class Requantized:
    """What ``quantize_gguf`` wrote: the file, the ftype and options, each tensor (in file order) as
    ``(type, offset from data_offset, bytes)``, the bytes read and written, and the importance-matrix rows
    weighted by 1s (``"NAME[expert]"``)."""

    path: Path
    ftype: str
    pure: bool
    data_offset: int
    tensors: dict[str, tuple[str, int, int]]
    source_bytes: int
    nbytes: int
    imatrix: str | None = None
    unit_weighted: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "ftype": self.ftype, "pure": self.pure,
                "types": {n: t for n, (t, _, _) in self.tensors.items()}, "source_bytes": self.source_bytes,
                "bytes": self.nbytes, "imatrix": self.imatrix, "unit_weighted": list(self.unit_weighted)}


def llama_quantize_args(ftype_or_scheme: str | Scheme) -> tuple[F, bool]:
    """``(ftype, pure)``: a llama-quantize ftype name (any case: ``Q4_K_M``, ``q4_k``, the alias of Q4_K_M;
    ``F16``), or a qkit scheme: a llama.cpp recipe (``q4_k_m``, ``q2_k-llama``) is its ftype with the
    rules, a block type (``q4_k``) the ftype qkit's GGUF writer records for it (``MOSTLY_Q4_K_S``) with
    ``--pure``: every quantized tensor that type (and its width fallback)."""
    if isinstance(ftype_or_scheme, str):
        f = FTYPES.get(ftype_or_scheme.strip().upper())
        if f is None:
            raise InputError(f"{ftype_or_scheme!r} is not a file type of llama-quantize; use one of {', '.join(FTYPES)}")
        return f, False
    scheme = ftype_or_scheme
    if not isinstance(scheme, Recipe) and not is_llama_type(scheme):
        raise InputError(f"{scheme.name} is not one of llama.cpp's types or recipes; llama-quantize cannot write it")
    return F(int(file_type(scheme.to_dict(), []))), not isinstance(scheme, Recipe)


def head_type(word: str | None, option: str) -> T | None:
    """``--token-embedding-type`` / ``--output-tensor-type``: a ggml type name, any case (``q8_0``, ``f16``)."""
    if word is None:
        return None
    t = T.__members__.get(str(word).strip().upper())
    if t is None:
        raise InputError(f"{option} {word!r} is not a ggml type; use one like q8_0, q6_k, f16 or f32")
    return t


# --------------------------------------------------------------------------- planning (before any work)


def _requires_imatrix(name: str, t: T, ftype: F) -> bool:
    """``tensor_requires_imatrix``."""
    if category(name) in ("token_embd", "output") and name != "per_layer_token_embd.weight":
        return False
    return t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S) or (t == T.Q2_K and ftype == F.MOSTLY_Q2_K_S)


def _encoder(t: T, name: str) -> GGMLCodable | None:
    """The scheme that writes ``t``'s blocks (None for a float target): llama.cpp's block types, and ``mxfp4``
    for MXFP4 (``GGMLCodable``: its parts converted to the blocks); ``SchemeError`` in one line for a type
    qkit has none for."""
    if t in FLOATS:
        return None
    try:
        s = scheme_for_type(t, name)
    except SchemeError:
        s = None
    if not isinstance(s, GGMLCodable):
        raise SchemeError(f"tensor {name}: llama-quantize writes it as {t.name}, which qkit has no llama.cpp encoder for; "
                          "choose another file type")
    return s


def _weights(im: ImportanceMatrix, info: TensorInfo, t: T, unit: list[str]) -> np.ndarray | None:
    """The importance rows ``[groups, cols]`` llama-quantize uses for this tensor (None: unweighted)."""
    where = f"--imatrix {im.source or 'the importance matrix'}"
    qw = im.quant_weights(info.name)
    cols, groups = info.ne[0], info.ne[2] if len(info.ne) > 2 else 1
    if qw is None:
        if uses_importance(t) and category(info.name) not in ("token_embd", "output"):
            raise InputError(f"{where}: no entry for {info.name}, which {t.name} quantizes with one; llama-quantize would "
                             "quantize it without weights, qkit refuses: collect a matrix that covers it")
        return None
    qw = np.asarray(qw, dtype=np.float32).reshape(-1)
    if qw.size != cols * groups:
        if category(info.name) == "token_embd":
            return None  # llama-quantize logs the mismatch and quantizes token_embd unweighted
        raise InputError(f"{where}: entry {info.name} holds {qw.size} values, the tensor needs {cols} x {groups} "
                         f"(columns x experts); it was collected from another model")
    if len(info.ne) > 3 and int(np.prod(info.ne[3:])) > 1:
        raise InputError(f"{where}: {info.name} is {len(info.ne)}-D; llama-quantize weights 2-D and 3-D tensors only")
    rows = qw.reshape(groups, cols)
    counts = np.asarray(im.entries[info.name].counts, dtype=np.float64).reshape(-1)
    unit.extend(f"{info.name}[{e}]" for e in np.flatnonzero(np.rint(counts) <= 0))
    if uses_importance(t):
        for e in range(groups):
            problem = importance_problem(torch.from_numpy(rows[e].copy()))
            if problem is not None:
                raise InputError(f"{where}: entry {info.name} (expert {e}) cannot weight a search: {problem}")
    return rows


def plan(header: Header, ftype: F, pure: bool, imatrix: ImportanceMatrix | None, token_embedding_type: T | None,
         output_tensor_type: T | None, what: str) -> tuple[list[Planned], list[str]]:
    """Every tensor of the output in llama.cpp's order with its type and importance rows, and the matrix
    rows weighted by 1s; every refusal of the module docstring, in one line."""
    names = [t.name for t in header.tensors]
    if len(set(names)) != len(names):
        raise InputError(f"{what} names a tensor twice; llama.cpp refuses such a file")
    alignment = header.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment != DEFAULT_ALIGNMENT:
        raise InputError(f"{what} is aligned to {alignment} bytes; llama-quantize writes {DEFAULT_ALIGNMENT}-byte files "
                         "whose header would then be wrong: re-convert it with llama.cpp's converter")
    facts = ModelFacts.from_metadata(header.fields)
    used = imatrix is not None and bool(imatrix.entries)
    params = Params(ftype, pure=pure, imatrix=used, token_embedding_type=token_embedding_type,
                    output_tensor_type=output_tensor_type)
    _ = params.default_type  # an ftype without a default type is refused here
    if imatrix is not None:
        unknown = sorted(set(imatrix.entries) - set(names))
        if unknown:
            raise InputError(f"--imatrix {imatrix.source or 'the importance matrix'}: {len(unknown)} entries name no tensor "
                             f"of {what} ({', '.join(unknown[:3])}); it was collected from another model")
    by_name = {t.name: t for t in header.tensors}
    types = tensor_types(((t.name, t.ne, T(t.ggml_type)) for t in header.tensors), facts, params)
    out, unit = [], []
    for name, t in types.items():
        info = by_name[name]
        p = Planned(info, t)
        if not p.converted:
            out.append(p)
            continue
        if T(info.ggml_type) not in FLOATS:
            raise InputError(f"{what}: {name} is {T(info.ggml_type).name}; requantizing from it is disabled in llama-quantize, "
                             "give the converter's F32, F16 or BF16 file")
        _encoder(t, name)
        if imatrix is None and _requires_imatrix(name, t, ftype):
            raise InputError(f"{ftype.name} writes {name} as {t.name}, which requires an importance matrix; pass one")
        weights = _weights(imatrix, info, t, unit) if used else None
        out.append(Planned(info, t, weights))
    return out, unit


# --------------------------------------------------------------------------- metadata


def _c_string(value: Any) -> Any:
    """A string as llama.cpp copies it (``c_str()``: cut at the first NUL)."""
    return value.split(b"\0", 1)[0] if isinstance(value, bytes) else value


def output_fields(header: Header, ftype: F, imatrix: ImportanceMatrix | None,
                  tokenizer: Sequence[Field] | None = None) -> list[Field]:
    """The KV fields llama-quantize writes, in its order (module docstring). ``tokenizer``: ``tokenizer.*``
    fields that replace the source's (a model converted from a GGUF: that GGUF's own), after its other fields."""
    fields: list[Field] = []

    def put(key: str, vtype: int, value: Any, sub: int | None = None) -> None:  # gguf_set_val_*: remove, append
        fields[:] = [f for f in fields if f[0] != key]
        fields.append((key, vtype, value, sub))

    for key, vtype, value, sub in header.kv:
        if vtype == V.ARRAY and not value:
            raise InputError(f"the GGUF's {key} is an empty array, which qkit's GGUF writer cannot copy")
        if vtype == V.ARRAY and sub == V.STRING and b"\0" in b"".join(value):
            value = [_c_string(v) for v in value]
        put(key, vtype, value if vtype == V.ARRAY else _c_string(value), sub)
    if tokenizer is not None:
        fields = [f for f in fields if not f[0].startswith("tokenizer.")]
        for key, vtype, value, sub in tokenizer:
            put(key, vtype, value, sub)
    put("general.quantization_version", V.UINT32, QUANTIZATION_VERSION)
    put("general.file_type", V.UINT32, int(ftype))
    fields = [f for f in fields if f[0] not in SPLIT_KEYS]
    if imatrix is not None and imatrix.entries:
        put("quantize.imatrix.file", V.STRING, _c_string(str(imatrix.source).encode("utf-8")[:127]))
        if imatrix.datasets:
            put("quantize.imatrix.dataset", V.STRING, _c_string(str(imatrix.datasets[0]).encode("utf-8")[:127]))
        put("quantize.imatrix.entries_count", V.UINT32, len(imatrix.entries))
        if int(imatrix.chunk_count) > 0:
            put("quantize.imatrix.chunks_count", V.UINT32, int(imatrix.chunk_count))
    return fields


class _Writer(gguf.GGUFWriter):
    """``gguf.GGUFWriter`` packing a metadata array in bulk (its own packs item by item: 0.4 s for a
    50k-token vocabulary); the same bytes (little-endian)."""

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                  sub_type: gguf.GGUFValueType | None = None) -> bytes:
        if vtype != V.ARRAY or sub_type is None or not val or sub_type == V.ARRAY:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<IIQ" if add_vtype else "<IQ", *((vtype,) if add_vtype else ()), sub_type, len(val))
        if sub_type == V.STRING:
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            lengths = np.array([len(v) for v in items], dtype="<u8")
            return head + b"".join(a + b for a, b in zip((x.tobytes() for x in lengths), items))
        values = np.asarray(val, dtype=KV_DTYPES[int(sub_type)])
        return head + (values.astype("<u1") if sub_type == V.BOOL else values).tobytes()


# --------------------------------------------------------------------------- the values


def tensor_floats(path: Path, header: Header, info: TensorInfo) -> np.ndarray:
    """The tensor as float32 ``[rows, cols]`` (F16 and BF16 widened exactly), from a memory map."""
    rows = int(np.prod(info.ne[1:], dtype=np.int64))
    src = np.memmap(path, dtype=FLOATS[T(info.ggml_type)], mode="c", offset=header.data_offset + info.offset,
                    shape=(rows, info.ne[0]))
    if info.ggml_type == T.BF16:
        return (src.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(src, dtype=np.float32)


def to_f16(x: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp32_to_fp16``: round to nearest even, NaN as 0x7E00 with its sign."""
    with np.errstate(over="ignore"):  # beyond 65504: inf, as ggml's
        h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        h = np.where(nan, (x.view(np.uint32) >> 16).astype(np.uint16) & 0x8000 | 0x7E00, h).astype(np.uint16)
    return h


def to_bf16(x: np.ndarray) -> np.ndarray:
    """``ggml_compute_fp32_to_bf16``: round to nearest even; a NaN keeps its top bits, made quiet."""
    u = x.view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 64, rounded).astype(np.uint16)


def encode(x: np.ndarray, p: Planned) -> np.ndarray:
    """Tensor values float32 ``[rows, cols]`` -> the bytes of ``p.ggml_type`` (experts one by one with their rows)."""
    if p.ggml_type == T.F32:
        return x
    if p.ggml_type == T.F16:
        return to_f16(x)
    if p.ggml_type == T.BF16:
        return to_bf16(x)
    scheme = _encoder(p.ggml_type, p.info.name)

    def blocks(rows: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        qt = quantize_tensor(torch.from_numpy(rows), scheme, name=p.info.name,
                             quant_weights=None if qw is None else torch.from_numpy(qw.copy()))
        return scheme.to_ggml_blocks(qt).numpy()

    if p.weights is None or not uses_importance(p.ggml_type):  # q8_0, tq*_0, mxfp4: llama.cpp ignores the matrix
        return blocks(x, None)
    per = x.shape[0] // p.weights.shape[0]
    return np.concatenate([blocks(x[e * per:(e + 1) * per], p.weights[e]) for e in range(p.weights.shape[0])])


# --------------------------------------------------------------------------- the file


def quantize_gguf(source_f32: str | Path, out: str | Path, ftype_or_scheme: str | Scheme,
                  imatrix: ImportanceMatrix | None = None, pure: bool = False, token_embedding_type: str | None = None,
                  output_tensor_type: str | None = None, *, force: bool = False, record: bool = True,
                  tokenizer: Sequence[Field] | None = None,
                  blocks: Callable[[str, T], np.ndarray | None] | None = None) -> Requantized:
    """Write ``out`` (``.gguf``, or a directory for ``model.gguf``) as ``llama-quantize [--imatrix]
    [--pure] [--token-embedding-type T] [--output-tensor-type T] source_f32 out FTYPE`` would
    (module docstring). ``imatrix``: ``qkit.methods.imatrix.read(path)``, whose ``source`` (the path as
    given) becomes ``quantize.imatrix.file``. ``record``: add qkit's ``qkit.export`` record (without it the
    file is llama-quantize's, whole). ``tokenizer``: ``tokenizer.*`` fields written instead of the source's
    (``output_fields``). ``blocks(name, type)``: a tensor's block bytes chosen elsewhere (a calibrated
    method's), or None for qkit's encoder. Refusals are ``QkitError`` lines, before anything is written."""
    source = Path(source_f32)
    what = str(source_f32)
    ftype, scheme_pure = llama_quantize_args(ftype_or_scheme)
    pure = pure or scheme_pure
    heads = head_type(token_embedding_type, "--token-embedding-type"), head_type(output_tensor_type, "--output-tensor-type")
    header = read_header(source, what)
    planned, unit = plan(header, ftype, pure, imatrix, *heads, what)
    end = header.data_offset + max((p.info.offset + tensor_bytes(p.info.ggml_type, p.info.ne) for p in planned), default=0)
    if source.stat().st_size < end:
        raise InputError(f"{what} is truncated: its tensors end at byte {end}, the file has {source.stat().st_size}")
    fields = output_fields(header, ftype, imatrix, tokenizer)
    if record:
        doc = {"format": "gguf", "format_version": EXPORT_VERSION, "qkit_version": __version__,
               "llama_cpp_commit": LLAMA_CPP_COMMIT, "source": {"file": source.name, "sha256": sha256_file(source)},
               "llama_quantize": {"ftype": ftype_name(ftype), "pure": pure,
                                  "token_embedding_type": token_embedding_type, "output_tensor_type": output_tensor_type,
                                  "imatrix": None if imatrix is None else str(imatrix.source)},
               "imatrix_unit_weighted": unit,
               # qkit's writer keys per-tensor entries by Hugging Face name; these tensors carry llama.cpp's
               # names and their types in the header, so none (qkit verify then reads the types from it)
               "tensors": {}}
        fields.append((RECORD_KEY, V.STRING, jsontext.dumps(doc, what="the GGUF's qkit.export record"), None))
    with atomic_output(Path(out), force, inputs=[("the source GGUF", source)]) as tmp:
        path = tmp / FILE
        w = _Writer(None, "")
        w.kv_data[0].clear()  # the writer starts with general.architecture; the source's order replaces it
        copy_fields(w, fields, "")
        for p in planned:
            ne = p.info.ne[:n_dims(p.info.ne)]
            w.add_tensor_info(p.info.name, tuple(reversed(ne)), np.dtype(np.float32), p.nbytes, raw_dtype=p.ggml_type)
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        data_offset = fout.tell()
        layout, at = {}, 0
        with open(source, "rb") as src:
            for p in planned:
                given = blocks(p.info.name, p.ggml_type) if blocks is not None and p.converted else None
                if given is not None and given.nbytes != p.nbytes:
                    raise SchemeError(f"{p.info.name}: {given.nbytes} bytes given for {p.ggml_type.name}, "
                                      f"which stores {p.nbytes}")
                if p.converted:  # a method's codes (qkit.converted, placed by the row map), else qkit's encoder
                    x = tensor_floats(source, header, p.info)
                    data = given if given is not None else encode(x, p)
                    if is_quantized(p.ggml_type):  # checked against its source before the file is in place
                        rows = torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).reshape(x.shape[0], -1)
                        check_written(p.info.name, torch.from_numpy(x),
                                      decode_blocks(rows, _encoder(p.ggml_type, p.info.name), torch.float32))
                    fout.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                else:
                    src.seek(header.data_offset + p.info.offset)
                    fout.write(src.read(p.nbytes))
                w.write_padding(fout, p.nbytes)
                layout[p.info.name] = (p.ggml_type.name, at, p.nbytes)
                at += p.nbytes + (-p.nbytes) % DEFAULT_ALIGNMENT
        w.close()
        if record:  # a directory OUT holds it beside model.gguf (what marks it as qkit's to replace); a .gguf OUT drops it
            write_json(tmp / EXPORT_MANIFEST, doc)
    target = Path(out) if Path(out).suffix.lower() == ".gguf" else Path(out) / FILE
    return Requantized(target, ftype_name(ftype), pure, data_offset, layout, source.stat().st_size, target.stat().st_size,
                       None if imatrix is None else str(imatrix.source), tuple(unit))


__all__ = ["FTYPES", "ImportanceMatrix", "Planned", "Requantized", "encode", "head_type", "llama_quantize_args",
           "ftype_name", "output_fields", "plan", "quantize_gguf", "tensor_bytes", "tensor_floats", "to_bf16", "to_f16"]
