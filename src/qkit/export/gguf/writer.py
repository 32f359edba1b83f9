"""GGUF's container and writer: the ``Format`` of ``--format gguf``, its checks before any work, the one
output file (``OUT.gguf``, or ``OUT/model.gguf``) published atomically, and the streaming tensor writer.

Quantized weights keep their ggml block type (``types``); norms and 1-D tensors are always F32 (as
llama.cpp), other 2-D tensors the source's float type (F32, F16 or BF16: exact, never rounded). For a
permuted (llama q/k) quantized weight the rows of the *block bytes* are reordered (``names``).

Streaming: tensor data goes to a spool file next to the output as it arrives (peak memory: one tensor);
the header, which must list every tensor and the record, is written once all are known, then the spool is
copied after it. Writes are atomic: everything happens in a hidden sibling, renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from qkit import jsontext, outputs, staging
from qkit.checkpoint import atomic_directory, tensor_dtypes, write_json
from qkit.errors import ExportError
from qkit.export.common import (
    EXPORT_MANIFEST,
    EXPORT_VERSION,
    ModelLayout,
    Format,
    PreparedExport,
    fingerprint,
)
from qkit.export.gguf.metadata import (
    FILE,
    GENERAL_KEPT,
    NAME,
    RECORD_KEY,
    add_architecture_metadata,
    copy_fields,
    is_qkit_gguf,
    llama3_rope_factors,
    read_kv_fields,
    rope_parameters,
    source_gguf,
)
from qkit.llama_names import (
    ARCHITECTURES,
    arch_name,
    permutation_heads,
    row_permutation,
    tensor_names,
)
from qkit.export.gguf.tokenizer import add_tokenizer, hf_tokenizer
from qkit.export.gguf.types import (
    PLAN_TYPES,
    block_bytes,
    check_block_width,
    decode_blocks,
    file_type,
    float_array,
    float_type,
    ggml_blocks,
    ggml_scheme_names,
    is_ggml,
    resolve_scheme,
    tensor_nbytes,
)
from qkit.models import ModelRef, read_config
from qkit.outputs import Input
from qkit.schemes import QuantizedTensor, Scheme
from qkit.schemes.base import stores_natively
from qkit.schemes.ggml import is_llama_type
from qkit.transform import manifest_entry
from qkit.version import __version__


@dataclass(frozen=True)
class TensorOut:
    """How one stored tensor is written: its GGUF name, ggml type and row permutation heads."""

    gguf_name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    permute_heads: int | None
    float_as_given: bool = False  # a kept 2-D tensor: stored in the float type it is handed in (f16: --token-embedding-type)


class GGUFFormat:
    """The ``Format`` of ``--format gguf``: one file, checked and gathered by ``prepare`` (see the module docstring)."""

    name = NAME
    container = "gguf"
    library = "gguf"
    help = "q8_0, q4_0, q4_1, q5_0, q5_1, q2_k ... q6_k, iq4_nl, iq4_xs, q4_k_m, mxfp4: llama.cpp; -o FILE.gguf, or a directory for model.gguf"
    ties_fused = False  # llama.cpp keeps every tensor separate
    stores_llama_types = True
    torch_loads = True  # reader.GGUFWeights dequantizes its tensors into the reference model (qkit eval file:PATH)
    holds_shard = False  # GGUFFileWriter spools each tensor to disk
    unquantized_is_source = False  # one file of llama.cpp's names and layout, written even with nothing quantized
    native_architectures = ARCHITECTURES  # qkit's names and permutation; others: qkit.converted
    written_as = " as gguf"

    # ---- what it holds
    def refusal(self, scheme: Scheme, tensor: str | None = None) -> str | None:
        if is_ggml(scheme):
            return None
        works = ggml_scheme_names()
        where = f" ({tensor})" if tensor else ""
        return (f"--format gguf stores llama.cpp's block types, and {scheme.name}{where} is not one of them; "
                f"use {', '.join(works) if works else 'a ggml scheme (q8_0, q4_0, q4_k, ...)'} "
                f"(or --format qkit for {scheme.name})")

    def plan_types(self) -> tuple[str, ...]:
        return PLAN_TYPES

    def supports(self, scheme: Scheme, shape: tuple[int, int]) -> bool:
        return self.refusal(scheme) is None and stores_natively(scheme, shape)

    def stored_nbytes(self, scheme: Scheme | None, shape: tuple[int, int], dtype: torch.dtype) -> int:
        """``tensor_nbytes`` of the scheme's ggml type, or of the source's float type for a kept tensor (F32 for a
        1-D one, as every norm and bias)."""
        if scheme is None and len(shape) < 2:
            return 4 * int(shape[0]) if shape else 4
        return tensor_nbytes(float_type(dtype) if scheme is None else scheme.ggml_type, shape)  # type: ignore[attr-defined]

    def check_candidates(self, schemes: Sequence[Scheme], dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        return None

    def takes_plan(self, planned: Format) -> bool:
        return planned is self

    # ---- before any work
    def check(self, layout: ModelLayout) -> None:
        # GGUF needs more than the plan (the config, the source file); see ``prepare``.
        return None

    def prepare(self, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]],
                manifest: dict, *, ref: ModelRef | None = None) -> GGUFExport:
        return prepare(directory, targets, shapes, manifest, ref=ref)

    def for_activations(self, activations: str) -> None:
        return None  # llama.cpp chooses its own activation types at run time

    # ---- the container: one file
    def check_container_output(self, out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
        check_gguf_output(out, force, inputs)

    def atomic_output(self, out: Path, force: bool = False,
                      inputs: Iterable[Input] = ()) -> contextlib.AbstractContextManager[Path]:
        return atomic_output(out, force, inputs)

    def output_bytes(self, out: Path) -> int:
        p = gguf_path(out)
        return p.stat().st_size if p.is_file() else 0

    def recognises(self, path: Path) -> bool:
        """A ``.gguf`` file, or a directory holding ``model.gguf`` (may raise ``PermissionError``)."""
        path = Path(path)
        return (path.is_file() and is_gguf_name(path)) or (path.is_dir() and (path / FILE).is_file())

    # ---- the tensors
    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """``{"qweight": llama.cpp's block bytes, uint8 [rows, bytes_per_row]}`` (before any row permutation)."""
        return {"qweight": ggml_blocks(qt)}

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """``tensors``: ``{"qweight": uint8 [rows, bytes_per_row]}`` (llama.cpp's blocks) with the q/k permutation
        already undone; a scheme with ``from_ggml_blocks`` turns them into its own parts."""
        return decode_blocks(tensors["qweight"], scheme, dtype)


FORMAT = GGUFFormat()


@dataclass
class GGUFExport(PreparedExport):
    """A checked GGUF export: the metadata and tokenizer (gathered before any work) and the per-tensor layout."""

    arch: str = ""
    config: dict = field(default_factory=dict)
    outputs: dict[str, TensorOut | None] = field(default_factory=dict)
    source: Path | None = None
    tokenizer: dict | None = None  # from Hugging Face (None: copied from ``source``)
    ftype: Any = None
    model_name: str = "model"  # general.name without a source GGUF (llama.cpp falls back to the directory name)

    def writer(self, directory: Path, max_shard_bytes: int = 0) -> GGUFFileWriter:
        return GGUFFileWriter(Path(directory), self)

    def kept_nbytes(self, name: str, tensor: torch.Tensor) -> int:
        """Bytes the file stores for ``name`` kept unquantized as ``tensor`` (0: the file does not hold it, a tied head)."""
        out = self.outputs.get(name)
        if out is None:
            return 0
        return tensor.numel() * gguf.GGML_QUANT_SIZES[float_type(tensor.dtype) if out.float_as_given else out.ggml_type][1]

    def quantization_config(self) -> dict:
        return {"quant_method": NAME}

    def metadata_writer(self):
        """A ``GGUFWriter`` holding every KV field, in the order llama.cpp's converter writes them."""
        w = gguf.GGUFWriter(None, arch_name(self.arch))
        w.add_type(gguf.GGUFType.MODEL)
        fields = read_kv_fields(self.source) if self.source is not None else None
        if fields is not None:
            copy_fields(w, fields, "general.", skip=GENERAL_KEPT)
        else:
            w.add_name(self.model_name)
        add_architecture_metadata(w, self.arch, self.config, self.ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if fields is not None:
            copy_fields(w, fields, "tokenizer.")
        else:
            add_tokenizer(w, self.tokenizer, self.arch, self.config)
        return w


def check_gguf_output(out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
    """Refuse an OUT qkit must not or cannot write (``qkit.outputs.check_output_path``): a ``.gguf`` OUT is one
    file, replaced (with ``force``) only if it is a GGUF qkit wrote; another OUT is a directory holding
    ``model.gguf``, replaced only if it is a qkit export. Either is refused, whatever ``force``, if it is,
    contains or lies inside one of ``inputs`` (the source GGUF among them)."""
    out = Path(out)
    if is_gguf_name(out):
        outputs.check_output_path(out, kind="file", force=force, inputs=inputs, owned=is_qkit_gguf,
                             describe="a GGUF file with qkit's qkit.export record")
    else:
        outputs.check_output_path(out, kind="dir", force=force, inputs=inputs)


@contextlib.contextmanager
def atomic_output(out: Path, force: bool = False, inputs: Iterable[Input] = ()) -> Iterator[Path]:
    """Yield a hidden staging directory; on success publish the GGUF, else remove everything.

    ``OUT.gguf``: the staging directory's ``model.gguf`` is renamed to OUT (one ``rename`` on the same file
    system: atomic). A directory OUT: it holds ``model.gguf`` and ``qkit-export.json`` only (``quantize_model``
    also writes config.json and tokenizer files into every export directory; a GGUF file carries both
    itself) and replaces OUT by rename, as ``checkpoint.atomic_directory`` does. A failed write (full disk)
    leaves nothing behind and is one ``OutputError`` line.
    """
    out = Path(out)
    check_gguf_output(out, force, inputs)
    if not is_gguf_name(out):
        with atomic_directory(out, force, inputs=inputs) as tmp:
            yield tmp
            for p in list(tmp.iterdir()):
                if p.name not in (FILE, EXPORT_MANIFEST):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    # the same hidden-sibling staging as checkpoint.atomic_directory, so a killed run's leftovers are found
    with staging.staged(out) as tmp:
        yield tmp
        check_gguf_output(out, force)  # it may have appeared while we worked
        os.replace(tmp / FILE, out)


def prepare(directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], manifest: dict,
            ref: ModelRef | None = None) -> GGUFExport:
    """Check everything GGUF needs before any work (raises ``ExportError``, one line) and gather the metadata."""
    directory = Path(directory)
    config = read_config(directory)
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ExportError(
            f"--format gguf writes {' and '.join(ARCHITECTURES)} models; {directory} is {arch!r}, "
            "which this writer does not know; use --format qkit"
        )
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        if config.get(key) is None:
            raise ExportError(f"{directory}/config.json has no {key}; GGUF metadata needs it, fix the config")
    kind = (rope_parameters(config).get("rope_type") or "default").lower()
    if kind not in ("default", "linear", "yarn", "llama3") or (kind == "llama3" and arch != "llama"):
        raise ExportError(f"--format gguf: the {kind!r} RoPE of {directory} is not one this writer stores; use --format qkit")
    bad = sorted(n for n, s in targets.items() if not is_ggml(s))
    if bad:
        raise ExportError(FORMAT.refusal(targets[bad[0]]) or "")
    tied = bool(config.get("tie_word_embeddings", False))
    names = tensor_names(arch, config["num_hidden_layers"], list(shapes), tied)
    dtypes = tensor_dtypes(directory, floating_only=True)
    planned: dict[str, TensorOut | None] = {}
    resolved: list[Scheme] = []
    T = gguf.GGMLQuantizationType
    for name, shape in shapes.items():
        new = names[name]
        if new is None:
            planned[name] = None
            if name in targets and not (tied and name == "lm_head.weight"):
                raise ExportError(f"--format gguf does not store {name}; drop it from --include")
            continue
        heads = permutation_heads(arch, config, name)
        s = targets.get(name)
        if s is None:
            # "Most of the codebase that takes in 1D tensors or norms only handles F32 tensors"; any other one is
            # stored in the float type it is handed in: the source's, or the dtype --token-embedding-type gave it
            forced = len(shape) <= 1 or new.endswith("_norm.weight")
            planned[name] = TensorOut(new, T.F32 if forced else float_type(dtypes.get(name) or torch.float32), heads,
                                      float_as_given=not forced)
            continue
        if len(shape) != 2 or new.endswith("_norm.weight"):
            raise ExportError(
                f"--format gguf keeps norms and 1-D tensors in F32 (llama.cpp reads them only so); "
                f"{name} cannot be quantized, drop it from --include"
            )
        if not is_llama_type(s):
            # A converting scheme (mxfp4) has no fallback type for a width it cannot take: refuse here, in GGUF's
            # words, before its own refusal suggests schemes that GGUF cannot store.
            check_block_width(name, shape, s)
        r = resolve_scheme(s, shape, name)
        if not is_ggml(r):
            raise ExportError(f"--format gguf: {s.name} resolves {name} to {r.name}, which is not a ggml type; use another scheme")
        check_block_width(name, shape, r)
        resolved.append(r)
        planned[name] = TensorOut(new, T(int(r.ggml_type)), heads)
    if arch == "llama" and kind == "llama3":
        planned["<rope_freqs>"] = TensorOut("rope_freqs.weight", T.F32, None)
    source = source_gguf(directory, ref)
    tokenizer = None if source is not None else hf_tokenizer(
        directory, config, arch, trust_remote_code=ref is not None and ref.trust_remote_code)
    layout = ModelLayout(dict(targets), dict(shapes), {k: v for k, v in dtypes.items() if v is not None}, (),
                      dtypes.get(next(iter(targets)), torch.float32) if targets else torch.float32)
    ftype = file_type(manifest.get("scheme", {}), resolved)
    manifest = {**manifest, "architecture": arch,
                "tokenizer": f"copied from {source.name}" if source is not None else "converted from tokenizer.json"}
    name = Path(str(config.get("_name_or_path") or "")).name or directory.resolve().name or "model"
    return GGUFExport(FORMAT, layout, manifest, arch=arch, config=config, outputs=planned, source=source,
                      tokenizer=tokenizer, ftype=ftype, model_name=name)


class GGUFFileWriter:
    """Receives the stream of ``quantize_model`` (``add(name, tensor or QuantizedTensor)``, then ``close``).

    Writes ``model.gguf`` and ``qkit-export.json`` into ``directory``. Tensor data is spooled to
    ``model.gguf.data`` as it comes (each tensor padded to the file's alignment, so the spool *is* the data
    section); ``close`` writes header, metadata and tensor table, then copies the spool after them.
    """

    def __init__(self, directory: Path, export: GGUFExport):
        self.directory = directory
        self.export = export
        self.gw = export.metadata_writer()
        self.spool_path = directory / (FILE + ".data")
        self.spool = open(self.spool_path, "wb")
        self.record = {**export.manifest, "format": NAME, "format_version": EXPORT_VERSION,
                       "qkit_version": __version__, "tensors": {}}
        self.written: set[str] = set()
        self.expected = {n for n, o in export.outputs.items() if o is not None and not n.startswith("<")}
        if "<rope_freqs>" in export.outputs:
            self._write("rope_freqs.weight", llama3_rope_factors(export.config).numpy(), gguf.GGMLQuantizationType.F32)

    def _write(self, gguf_name: str, array: np.ndarray, ggml_type, raw_shape=None) -> None:
        self.gw.add_tensor_info(gguf_name, raw_shape if raw_shape is not None else array.shape, array.dtype,
                                array.nbytes, raw_dtype=ggml_type)
        array.tofile(self.spool)
        self.gw.write_padding(self.spool, array.nbytes)

    def add(self, name: str, value: QuantizedTensor | torch.Tensor) -> None:
        out = self.export.outputs.get(name, "missing")
        if out == "missing":
            raise ExportError(f"{name} was not in the export's layout; re-run the export")
        if out is None:
            return
        self.written.add(name)
        if isinstance(value, QuantizedTensor):
            if not is_ggml(value.scheme) or int(value.scheme.ggml_type) != int(out.ggml_type):
                raise ExportError(f"{name} was planned as {out.ggml_type.name} but quantized as {value.scheme.name}; re-run")
            q = ggml_blocks(value).detach().to("cpu")
            rows, cols = value.shape
            if q.dtype != torch.uint8 or tuple(q.shape) != (rows, block_bytes(out.ggml_type, cols)):
                raise ExportError(
                    f"{value.scheme.name} gave {name} a qweight of {q.dtype} {list(q.shape)}, not llama.cpp's "
                    f"uint8 [{rows}, {block_bytes(out.ggml_type, cols)}] block rows; the scheme breaks its contract"
                )
            if out.permute_heads:
                # Every ggml block lies inside one row and depends on that row only, so permuting the rows of
                # the block bytes equals quantizing llama.cpp's permuted matrix (tests check this).
                q = q[row_permutation(rows, out.permute_heads)]
            self._write(out.gguf_name, q.contiguous().numpy(), out.ggml_type)
            self.record["tensors"][name] = {**manifest_entry(value), "sha256": fingerprint(value),
                                            "gguf_name": out.gguf_name, "ggml_type": out.ggml_type.name,
                                            "permuted_heads": out.permute_heads}
            return
        t = value.detach().to("cpu")
        if out.permute_heads:
            t = t[row_permutation(t.shape[0], out.permute_heads)]
        ggml_type = float_type(t.dtype) if out.float_as_given else out.ggml_type
        arr = float_array(t, ggml_type)
        self._write(out.gguf_name, arr, ggml_type, raw_shape=tuple(t.shape))

    def close(self) -> list[Path]:
        missing = sorted(self.expected - self.written)
        if missing:
            raise ExportError(f"the export stream lacked {', '.join(missing[:3])}; re-run the export")
        self.spool.close()
        imatrix = self.record.get("imatrix")
        if imatrix:  # the keys llama-quantize --imatrix writes (tools/quantize/quantize.cpp, LLM_KV_QUANTIZE_IMATRIX_*)
            self.gw.add_string("quantize.imatrix.file", str(imatrix.get("file", ""))[:127])
            if imatrix.get("datasets"):
                self.gw.add_string("quantize.imatrix.dataset", str(imatrix["datasets"][0])[:127])
            self.gw.add_int32("quantize.imatrix.entries_count", int(imatrix.get("entries", 0)))
            if int(imatrix.get("chunk_count") or 0) > 0:
                self.gw.add_int32("quantize.imatrix.chunks_count", int(imatrix["chunk_count"]))
        self.gw.add_string(RECORD_KEY, jsontext.dumps(self.record, what="the GGUF's qkit.export record"))
        path = self.directory / FILE
        self.gw.write_header_to_file(path)
        self.gw.write_kv_data_to_file()
        self.gw.write_ti_data_to_file()
        fout = self.gw.fout[0]
        self.gw.write_padding(fout, fout.tell())
        with open(self.spool_path, "rb") as spool:
            shutil.copyfileobj(spool, fout, 1 << 22)
        self.gw.close()
        self.spool_path.unlink()
        write_json(self.directory / EXPORT_MANIFEST, self.record)
        return [path]


def is_gguf_name(out: str | Path) -> bool:
    """Whether OUT names one GGUF file (``.gguf``, in any case: ``x.GGUF`` too), not a directory for ``model.gguf``."""
    return Path(out).suffix.lower() == ".gguf"


def gguf_path(out: Path) -> Path:
    """The ``.gguf`` file of an export: OUT itself, or ``OUT/model.gguf``."""
    out = Path(out)
    return out if is_gguf_name(out) and not out.is_dir() else out / FILE


__all__ = ["FORMAT", "GGUFExport", "GGUFFileWriter", "GGUFFormat", "TensorOut", "atomic_output", "check_gguf_output",
           "gguf_path", "is_gguf_name", "prepare"]
