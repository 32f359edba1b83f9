"""GGUF: one ``.gguf`` file llama.cpp (and everything built on it) runs, written the way llama.cpp writes it.

``qkit quantize --format gguf -o OUT`` streams through the same transform as every other format; this
module turns each tensor into llama.cpp's name, layout and type and writes one GGUF v3 file. Matched
against llama.cpp's converter (``convert_hf_to_gguf.py``, split into ``conversion/base.py`` and
``conversion/llama.py`` upstream) and the ``gguf`` package 0.19 (its constants, tensor name map and
``SpecialVocab``):

* **Architectures**: ``llama`` (``LlamaModel``) and ``qwen2`` (``Qwen2Model``); anything else is refused.
* **Metadata** (``TextModel.set_gguf_parameters`` and the architecture's additions): block count,
  context length, embedding and feed-forward lengths, head counts, RoPE base (and linear/yarn scaling),
  RMS-norm epsilon, key/value lengths when the config names ``head_dim``; llama also its vocabulary size
  and RoPE dimension count. ``general.type = model``, ``general.file_type`` (the llama.cpp ftype of the
  default scheme), ``general.quantization_version = 2``; descriptive ``general.*`` fields of a source
  GGUF are kept.
* **Tokenizer**: a model qkit converted from a GGUF gets every ``tokenizer.*`` field of that GGUF, byte
  for byte. Otherwise the Hugging Face tokenizer is converted as llama.cpp's ``_set_vocab_gpt2`` does
  (byte-level BPE only: token list padded with ``[PADi]``, token types, merges, special ids, chat
  template, and the pre-tokenizer named by llama.cpp's hash of its check text); others are refused.
* **Tensors**: llama.cpp's names (``token_embd.weight``, ``blk.N.attn_q.weight``, ...,
  ``output_norm.weight``, ``output.weight`` unless tied) from ``gguf.get_tensor_name_map``. GGUF lists a
  shape fastest dimension first (``ne0`` = columns); ``GGUFWriter.add_tensor_info`` reverses numpy's
  order and, for ``uint8`` block bytes with a ``raw_dtype``, turns ``[rows, bytes_per_row]`` into
  ``[rows, cols]`` itself. Quantized weights keep their ggml block type (the scheme's ``ggml_type``;
  ``qweight`` holds llama.cpp's block bytes row by row, or the scheme converts its parts to them with
  ``to_ggml_blocks``: ``mxfp4`` is written as llama.cpp's MXFP4, the same codes and E8M0 exponents). Others: norms and 1-D tensors always F32 (as
  llama.cpp), 2-D tensors in the source's float type (F32, F16 or BF16: exact, never rounded).
* **The q/k row permutation** (llama only): llama.cpp's rotary kernel pairs dimensions ``(2i, 2i+1)``
  of each head where Hugging Face pairs ``(i, i + d/2)``, so the converter reorders the rows of
  ``q_proj`` and ``k_proj`` (``LlamaModel.permute``). For a quantized weight the rows of the *block
  bytes* are reordered: every ggml block lies inside one row and is computed from that row alone, so
  quantizing the permuted matrix and permuting the rows of the quantized matrix give the same bytes
  (tested). qkit's codes, and the sha256 recorded for them, stay those of the unpermuted matrix.

The export record (``qkit-export.json``'s content: scheme, shape, dtype and sha256 of every quantized
tensor) is also stored inside the file under the key ``qkit.export``, so ``qkit verify FILE.gguf`` can
check a lone file; llama.cpp and transformers ignore keys they do not know.

Streaming: tensor data goes to a spool file next to the output as it arrives (peak memory: one tensor);
the header, which must list every tensor and the record, is written once all are known, then the spool is
copied after it. Writes are atomic: everything happens in a hidden sibling, renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkit import __version__, outputs
from qkit.checkpoint import atomic_directory, write_json
from qkit.errors import ExportError
from qkit.export.common import EXPORT_MANIFEST, EXPORT_VERSION, ExportPlan, PreparedExport, fingerprint, safetensors_dtypes
from qkit.outputs import Input
from qkit.schemes import QuantizedTensor, Scheme
from qkit.transform import manifest_entry

NAME = "gguf"
FILE = "model.gguf"  # the file inside an OUT directory
RECORD_KEY = "qkit.export"  # the export record, as JSON text, inside the file
SOURCE_FILE = "qkit-source.json"  # written by qkit.models next to a model it converted from a GGUF
# Hugging Face model_type -> llama.cpp architecture (gguf.MODEL_ARCH member name)
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}
# Architectures whose q/k rows llama.cpp reorders (``LlamaModel.undo_permute``); Qwen2Model does not.
_PERMUTED = {"llama"}
_SKIPPED = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")  # the converter drops these


def _gguf():
    import gguf

    return gguf


# --------------------------------------------------------------------------- schemes and types


def is_ggml(scheme: Scheme) -> bool:
    """A scheme GGUF stores as a ggml type: one whose ``qweight`` holds llama.cpp block bytes (``kind == "ggml"``
    and a ``ggml_type``), or one with a ``ggml_type`` that converts its parts to and from that type's blocks
    (``to_ggml_blocks(qt) -> uint8 [rows, bytes_per_row]`` and ``from_ggml_blocks(blocks, shape, dtype) ->
    QuantizedTensor``: ``mxfp4`` -> MXFP4)."""
    if getattr(scheme, "ggml_type", None) is None:
        return False
    if getattr(scheme, "kind", None) == "ggml":
        return True
    return callable(getattr(scheme, "to_ggml_blocks", None)) and callable(getattr(scheme, "from_ggml_blocks", None))


def ggml_blocks(qt: QuantizedTensor) -> torch.Tensor:
    """llama.cpp's block bytes of a quantized tensor, uint8 ``[rows, bytes_per_row]`` (a ggml-kind scheme's ``qweight``)."""
    convert = getattr(qt.scheme, "to_ggml_blocks", None)
    return convert(qt) if callable(convert) else qt.qweight


def ggml_scheme_names() -> list[str]:
    """The registered schemes GGUF can store (for messages): llama.cpp's own block schemes in registry order,
    then those that convert to a ggml type (``mxfp4``)."""
    from qkit.schemes import get_scheme, scheme_names

    names = [n for n in scheme_names() if is_ggml(get_scheme(n))]
    return sorted(names, key=lambda n: getattr(get_scheme(n), "kind", None) != "ggml")


def scheme_for_type(ggml_type) -> Scheme:
    """The registered ggml scheme of ``ggml_type`` (the one named like the type first): for files qkit did not write."""
    from qkit.schemes import get_scheme, scheme_names

    gguf = _gguf()
    t = gguf.GGMLQuantizationType(int(ggml_type))
    found = [get_scheme(n) for n in scheme_names()]
    found = [s for s in found if is_ggml(s) and int(s.ggml_type) == int(t)]
    found.sort(key=lambda s: s.name != t.name.lower())
    if not found:
        raise ExportError(f"qkit has no scheme for ggml type {t.name}; it reads {', '.join(ggml_scheme_names()) or 'none'}")
    return found[0]


def _resolved(scheme: Scheme, shape: tuple[int, ...], name: str) -> Scheme:
    """The scheme ``quantize_tensor`` will actually use for this tensor (a recipe or a width fallback)."""
    return scheme.resolve(shape, name) if hasattr(scheme, "resolve") else scheme


def block_bytes(ggml_type, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``ggml_type`` (``GGML_QUANT_SIZES``: elements and bytes per block)."""
    elems, size = _gguf().GGML_QUANT_SIZES[ggml_type]
    return cols // elems * size


def file_type(default: dict, resolved: list[Scheme]):
    """``general.file_type``: the llama.cpp ftype ``llama-quantize`` would record for this export.

    ``default``: the default scheme's manifest entry. By its name for llama.cpp's mixtures (``q4_k_m`` ->
    ``MOSTLY_Q4_K_M``), else by its ggml type (``q4_k`` -> ``MOSTLY_Q4_K_S``, llama.cpp's "mostly Q4_K",
    even where the width fallback gave most tensors q5_0), else by the type most tensors got. Embeddings
    kept in F32 do not change it.
    """
    default_name = default.get("name", "")
    gguf = _gguf()
    F, T = gguf.LlamaFileType, gguf.GGMLQuantizationType
    by_name = {"q4_k_m": F.MOSTLY_Q4_K_M, "q4_k_s": F.MOSTLY_Q4_K_S, "q5_k_m": F.MOSTLY_Q5_K_M,
               "q5_k_s": F.MOSTLY_Q5_K_S, "q3_k_m": F.MOSTLY_Q3_K_M, "q2_k": F.MOSTLY_Q2_K}
    if default_name in by_name:
        return by_name[default_name]
    by_type = {T.Q4_0: F.MOSTLY_Q4_0, T.Q4_1: F.MOSTLY_Q4_1, T.Q5_0: F.MOSTLY_Q5_0, T.Q5_1: F.MOSTLY_Q5_1,
               T.Q8_0: F.MOSTLY_Q8_0, T.Q4_K: F.MOSTLY_Q4_K_S, T.Q5_K: F.MOSTLY_Q5_K_S, T.Q6_K: F.MOSTLY_Q6_K,
               T.Q2_K: F.MOSTLY_Q2_K, T.F16: F.MOSTLY_F16, T.BF16: F.MOSTLY_BF16,
               # llama.cpp has one ftype for MXFP4, MOSTLY_MXFP4_MOE (38: llama-quantize's "MXFP4_MOE", made for
               # gpt-oss, where it quantizes the expert tensors); it is the only ftype that names MXFP4, and
               # llama.cpp reads the ftype as a label only (every tensor carries its own type).
               T.MXFP4: F.MOSTLY_MXFP4_MOE}
    if default.get("ggml_type") in T.__members__ and T[default["ggml_type"]] in by_type:
        return by_type[T[default["ggml_type"]]]
    if default_name == "mxfp4":  # its manifest entry names no ggml_type
        return F.MOSTLY_MXFP4_MOE
    counts = Counter(T(int(s.ggml_type)) for s in resolved)
    for t, _ in counts.most_common():
        if t in by_type:
            return by_type[t]
    return F.ALL_F32


# --------------------------------------------------------------------------- names and the permutation


def tensor_names(arch: str, n_blocks: int, names: list[str], tied: bool) -> dict[str, str | None]:
    """Hugging Face tensor name -> llama.cpp's (None: not written). Raises ``ExportError`` for a name llama.cpp has no slot for."""
    gguf = _gguf()
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), n_blocks)
    out: dict[str, str | None] = {}
    for name in names:
        if name.endswith(_SKIPPED) or (tied and name == "lm_head.weight"):
            out[name] = None  # the converter drops these; a tied head is the embedding (transformers re-ties it)
            continue
        new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ExportError(
                f"--format gguf: llama.cpp's {arch} architecture has no tensor for {name}; "
                "this model is not a plain llama/qwen2 checkpoint, use --format qkit"
            )
        out[name] = new
    return out


def permutation_heads(arch: str, config: dict, name: str) -> int | None:
    """The head count ``LlamaModel.permute`` groups the rows of ``name`` by (None: not permuted).

    ``q_proj`` (weight and bias) by ``num_attention_heads``, ``k_proj`` by ``num_key_value_heads``.
    """
    if arch not in _PERMUTED:
        return None
    n_head = config["num_attention_heads"]
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return n_head
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.get("num_key_value_heads") or n_head
    return None


def row_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row order of llama.cpp's ``LlamaModel.permute``: ``permuted = w[perm]``.

    ``permute(w) = w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)``;
    applied to ``arange(rows)`` it yields which source row lands in each position.
    """
    if rows % (2 * n_head):
        raise ExportError(f"cannot apply llama.cpp's q/k permutation: {rows} rows are not 2 x {n_head} heads")
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)


def inverse_permutation(rows: int, n_head: int) -> torch.Tensor:
    """``w == permuted[inverse]``: how a reader undoes :func:`row_permutation` (transformers does the same)."""
    return torch.argsort(row_permutation(rows, n_head))


# --------------------------------------------------------------------------- metadata


def _rope(config: dict) -> dict:
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
    rope = _rope(config)
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
    gguf = _gguf()
    w.add_block_count(config["num_hidden_layers"])
    if config.get("max_position_embeddings") is not None:
        w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None:
        w.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope(config)
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


_GENERAL_KEPT = ("architecture", "type", "file_type", "quantization_version", "alignment")


# numpy dtypes of GGUF's scalar value types (GGUFValueType: UINT8 0 ... FLOAT64 12; 8 STRING, 9 ARRAY)
_KV_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_kv_fields(path: Path) -> list[tuple[str, int, Any, int | None]]:
    """The KV fields of a little-endian GGUF file (v2 or v3) as ``(key, type, value, array item type)``:
    strings as ``bytes``, arrays as lists (of ``bytes`` or Python numbers), scalars as Python values.

    Reads the header only, in bulk: ``gguf.GGUFReader`` parses every item of every array into its own
    numpy view and takes about 4 s on the default model's 49,152-token vocabulary; this takes a fraction of
    a second. Anything it does not recognise is an ``ExportError`` (a file to read with the gguf package).
    """
    import struct

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
                return _parse_kv(memoryview(buf), n_kv)
            except (struct.error, IndexError, ValueError):
                if len(buf) < size:
                    raise ExportError(f"{path}: truncated GGUF metadata") from None
                size *= 4


def _parse_kv(buf: memoryview, n_kv: int) -> list[tuple[str, int, Any, int | None]]:
    import struct

    out: list[tuple[str, int, Any, int | None]] = []
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
            if sub == 8:
                out.append((key, vtype, [string() for _ in range(count)], sub))
            elif sub in _KV_DTYPES:
                dt = np.dtype(_KV_DTYPES[sub])
                end = pos + dt.itemsize * count
                if end > len(buf):
                    raise IndexError("array past the buffer")
                out.append((key, vtype, np.frombuffer(buf[pos:end], dtype=dt).tolist(), sub))
                pos = end
            else:
                raise ExportError(f"GGUF field {key}: arrays of type {sub} are not copied by qkit")
        elif vtype in _KV_DTYPES:
            dt = np.dtype(_KV_DTYPES[vtype])
            out.append((key, vtype, np.frombuffer(buf[pos : pos + dt.itemsize], dtype=dt).tolist()[0], None))
            pos += dt.itemsize
        else:
            raise ExportError(f"GGUF field {key}: value type {vtype} is not one qkit copies")
    return out


def _copy_fields(w, fields: list[tuple[str, int, Any, int | None]], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every KV field (``read_kv_fields``) under ``prefix`` into writer ``w`` with its exact bytes and types."""
    V = _gguf().GGUFValueType
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


# --------------------------------------------------------------------------- tokenizer from Hugging Face

# llama.cpp's ``get_vocab_base_pre``: the pre-tokenizer is named by the sha256 of the token ids of this
# text (``convert_hf_to_gguf_update.py`` generates the table). The families qkit exports; a byte-level
# tokenizer whose only pre-tokenizer is GPT-2's regex is "gpt-2" whatever its hash (same split rule).
_CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
)
_PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3-70B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B (Qwen2 family)
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
}


def _looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def _is_gpt2_pretokenizer(tokenizer_json: dict) -> bool:
    pre, norm = tokenizer_json.get("pre_tokenizer") or {}, tokenizer_json.get("normalizer")
    return norm is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def hf_tokenizer(directory: Path, config: dict, arch: str, *, trust_remote_code: bool = False) -> dict:
    """llama.cpp's ``_set_vocab_gpt2`` for the byte-level BPE tokenizer in ``directory``.

    Returns ``{"pre", "tokens", "types", "special" (gguf.SpecialVocab), "add_space_prefix"}``; raises
    ``ExportError`` (one line) for a tokenizer llama.cpp would not convert this way.
    """
    gguf = _gguf()
    directory = Path(directory)
    tj_path = directory / "tokenizer.json"
    if (directory / "tokenizer.model").is_file() or not tj_path.is_file():
        raise ExportError(
            f"--format gguf converts byte-level BPE tokenizers (tokenizer.json); {directory} has "
            f"{'a SentencePiece tokenizer.model' if (directory / 'tokenizer.model').is_file() else 'no tokenizer.json'}; "
            "export a model converted from a GGUF, or use --format qkit"
        )
    tj = json.loads(tj_path.read_text())
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            f"--format gguf converts byte-level BPE tokenizers; {directory}'s is "
            f"{model.get('type')}{' with byte fallback (SentencePiece-style)' if model.get('byte_fallback') else ''}; "
            "use --format qkit"
        )
    from transformers import AutoTokenizer

    # Explicit: left unset, a tokenizer_config.json auto_map makes transformers ask on stdin to run its code.
    tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    vocab = tok.get_vocab()
    vocab_size = config.get("vocab_size") or len(vocab)
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"the tokenizer of {directory} has ids beyond the model's vocab_size {vocab_size}; fix the config")
    chkhsh = sha256(str(tok.encode(_CHKTXT)).encode()).hexdigest()
    pre = _PRE_BY_HASH.get(chkhsh) or ("gpt-2" if _is_gpt2_pretokenizer(tj) else None)
    if pre is None:
        raise ExportError(
            f"the BPE pre-tokenizer of {directory} is not one llama.cpp's converter recognizes (chkhsh {chkhsh[:16]}...); "
            "export a GGUF of this model from llama.cpp's convert_hf_to_gguf.py, or use --format qkit"
        )
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            # llama.cpp assumes CONTROL and USER_DEFINED tokens pre-normalized (get_vocab_base)
            if not decoder[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    tc_path = directory / "tokenizer_config.json"
    add_space_prefix = None
    if arch == "llama" and tc_path.is_file():
        add_space_prefix = json.loads(tc_path.read_text()).get("add_prefix_space")
    return {"pre": pre, "tokens": tokens, "types": types, "add_space_prefix": add_space_prefix,
            "special": gguf.SpecialVocab(directory, load_merges=True)}


# --------------------------------------------------------------------------- the source GGUF


def source_gguf(directory: Path, ref=None) -> Path | None:
    """The GGUF file a model directory was converted from, when it is still where qkit found it.

    From the resolved model (``qkit.models.ModelRef``: a ``.gguf`` argument, or the pinned default model),
    else from ``qkit-source.json`` in the cached directory when it names the pinned default model.
    """
    from qkit import assets

    if ref is not None and ref.kind == "gguf" and ref.provenance.get("gguf"):
        path = Path(ref.provenance["gguf"])
        return path if path.is_file() else None
    record = Path(directory) / SOURCE_FILE
    sha = None
    if ref is not None and ref.kind == "default":
        sha = assets.DEFAULT_MODEL.member_sha256
    elif record.is_file():
        sha = json.loads(record.read_text()).get("sha256")
    if sha == assets.DEFAULT_MODEL.member_sha256 and assets.DEFAULT_MODEL.path.is_file():
        return assets.DEFAULT_MODEL.path
    return None


# --------------------------------------------------------------------------- the format


@dataclass(frozen=True)
class TensorOut:
    """How one stored tensor is written: its GGUF name, ggml type and row permutation heads."""

    gguf_name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    permute_heads: int | None


class GGUFFormat:
    """The ``Format`` of ``--format gguf`` (see the module docstring)."""

    name = NAME

    def check(self, plan: ExportPlan) -> None:
        # GGUF needs more than the plan (the config, the source file); see ``prepare``.
        return None

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype) -> QuantizedTensor:
        """``tensors``: ``{"qweight": uint8 [rows, bytes_per_row]}`` (llama.cpp's blocks) with the q/k permutation
        already undone; a scheme with ``from_ggml_blocks`` turns them into its own parts."""
        q = tensors["qweight"]
        rows = q.shape[0]
        cols = q.shape[1] // _gguf().GGML_QUANT_SIZES[scheme.ggml_type][1] * _gguf().GGML_QUANT_SIZES[scheme.ggml_type][0]
        convert = getattr(scheme, "from_ggml_blocks", None)
        if callable(convert):  # a scheme with its own layout (mxfp4): rebuild its parts from the blocks
            return convert(q.contiguous(), (rows, cols), dtype)
        return QuantizedTensor(scheme, q.contiguous(), torch.empty(0, dtype=scheme.scale_dtype), (rows, cols), dtype)

    def quantization_config(self, plan: ExportPlan) -> dict:
        return {"quant_method": NAME}


FORMAT = GGUFFormat()


@dataclass
class GGUFExport(PreparedExport):
    """A checked GGUF export: the metadata and tokenizer (gathered before any work) and the per-tensor plan."""

    arch: str = ""
    config: dict = field(default_factory=dict)
    outputs: dict[str, TensorOut | None] = field(default_factory=dict)
    source: Path | None = None
    tokenizer: dict | None = None  # from Hugging Face (None: copied from ``source``)
    ftype: Any = None
    model_name: str = "model"  # general.name without a source GGUF (llama.cpp falls back to the directory name)

    def writer(self, directory: Path, max_shard_bytes: int = 0) -> GGUFFileWriter:
        return GGUFFileWriter(Path(directory), self)

    def quantization_config(self) -> dict:
        return {"quant_method": NAME}

    def metadata_writer(self):
        """A ``GGUFWriter`` holding every KV field, in the order llama.cpp's converter writes them."""
        gguf = _gguf()
        w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, ARCHITECTURES[self.arch])])
        w.add_type(gguf.GGUFType.MODEL)
        fields = read_kv_fields(self.source) if self.source is not None else None
        if fields is not None:
            _copy_fields(w, fields, "general.", skip=_GENERAL_KEPT)
        else:
            w.add_name(self.model_name)
        add_architecture_metadata(w, self.arch, self.config, self.ftype)
        w.add_quantization_version(_gguf().GGML_QUANT_VERSION)
        if fields is not None:
            _copy_fields(w, fields, "tokenizer.")
        else:
            t = self.tokenizer
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(t["pre"])
            w.add_token_list(t["tokens"])
            w.add_token_types(t["types"])
            t["special"].add_to_gguf(w, quiet=True)
            if t["add_space_prefix"] is not None:
                w.add_add_space_prefix(t["add_space_prefix"])
            if self.arch == "llama" and self.config.get("vocab_size") == 49152:
                # LlamaModel.set_vocab: "Apply to granite small models only" (and SmolLM, same vocab size)
                w.add_add_bos_token(False)
        return w


def is_qkit_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file qkit wrote: its header carries the ``qkit.export`` record (reads the
    metadata only, never the tensors)."""
    try:
        return any(key == RECORD_KEY for key, *_ in read_kv_fields(Path(path)))
    except (ExportError, OSError, ValueError):
        return False


def check_output(out: Path, force: bool, inputs: Iterable[Input] = ()) -> None:
    """Refuse an OUT qkit must not or cannot write (``qkit.outputs.check_output``): a ``.gguf`` OUT is one
    file, replaced (with ``force``) only if it is a GGUF qkit wrote; another OUT is a directory holding
    ``model.gguf``, replaced only if it is a qkit export. Either is refused, whatever ``force``, if it is,
    contains or lies inside one of ``inputs`` (the source GGUF among them)."""
    out = Path(out)
    if out.suffix == ".gguf":
        outputs.check_output(out, kind="file", force=force, inputs=inputs, owned=is_qkit_gguf,
                             describe="a GGUF file with qkit's qkit.export record")
    else:
        outputs.check_output(out, kind="dir", force=force, inputs=inputs)


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
    check_output(out, force, inputs)
    if out.suffix != ".gguf":
        with atomic_directory(out, force, inputs=inputs) as tmp:
            yield tmp
            for p in list(tmp.iterdir()):
                if p.name not in (FILE, EXPORT_MANIFEST):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    # the same hidden-sibling staging as checkpoint.atomic_directory, so a killed run's leftovers are found
    with outputs.staged(out) as tmp:
        yield tmp
        check_output(out, force)  # it may have appeared while we worked
        os.replace(tmp / FILE, out)


def gguf_path(out: Path) -> Path:
    """The ``.gguf`` file of an export: OUT itself, or ``OUT/model.gguf``."""
    out = Path(out)
    return out if out.suffix == ".gguf" and not out.is_dir() else out / FILE


def prepare(directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]], manifest: dict,
            ref=None) -> GGUFExport:
    """Check everything GGUF needs before any work (raises ``ExportError``, one line) and gather the metadata."""
    from qkit.models import read_config

    gguf = _gguf()
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
    kind = (_rope(config).get("rope_type") or "default").lower()
    if kind not in ("default", "linear", "yarn", "llama3") or (kind == "llama3" and arch != "llama"):
        raise ExportError(f"--format gguf: the {kind!r} RoPE of {directory} is not one this writer stores; use --format qkit")
    bad = sorted(n for n, s in targets.items() if not is_ggml(s))
    if bad:
        s = targets[bad[0]]
        works = ggml_scheme_names()
        raise ExportError(
            f"--format gguf stores llama.cpp's block types, and {s.name} is not one of them; "
            f"use {', '.join(works) if works else 'a ggml scheme (q8_0, q4_0, q4_k, ...)'} "
            f"(or --format qkit for {s.name})"
        )
    tied = bool(config.get("tie_word_embeddings", False))
    names = tensor_names(arch, config["num_hidden_layers"], list(shapes), tied)
    dtypes = safetensors_dtypes(directory)
    outputs: dict[str, TensorOut | None] = {}
    resolved: list[Scheme] = []
    T = gguf.GGMLQuantizationType
    for name, shape in shapes.items():
        new = names[name]
        if new is None:
            outputs[name] = None
            if name in targets and not (tied and name == "lm_head.weight"):
                raise ExportError(f"--format gguf does not store {name}; drop it from --include")
            continue
        heads = permutation_heads(arch, config, name)
        s = targets.get(name)
        if s is None:
            if len(shape) <= 1 or new.endswith("_norm.weight"):
                t = T.F32  # "Most of the codebase that takes in 1D tensors or norms only handles F32 tensors"
            else:
                t = {torch.float16: T.F16, torch.bfloat16: T.BF16}.get(dtypes.get(name), T.F32)
            outputs[name] = TensorOut(new, t, heads)
            continue
        if len(shape) != 2 or new.endswith("_norm.weight"):
            raise ExportError(
                f"--format gguf keeps norms and 1-D tensors in F32 (llama.cpp reads them only so); "
                f"{name} cannot be quantized, drop it from --include"
            )
        if getattr(s, "kind", None) != "ggml":
            # A converting scheme (mxfp4) has no fallback type for a width it cannot take: refuse here, in GGUF's
            # words, before its own refusal suggests schemes that GGUF cannot store.
            _check_block_width(name, shape, s)
        r = _resolved(s, shape, name)
        if not is_ggml(r):
            raise ExportError(f"--format gguf: {s.name} resolves {name} to {r.name}, which is not a ggml type; use another scheme")
        _check_block_width(name, shape, r)
        resolved.append(r)
        outputs[name] = TensorOut(new, T(int(r.ggml_type)), heads)
    if arch == "llama" and kind == "llama3":
        outputs["<rope_freqs>"] = TensorOut("rope_freqs.weight", T.F32, None)
    source = source_gguf(directory, ref)
    tokenizer = None if source is not None else hf_tokenizer(
        directory, config, arch, trust_remote_code=bool(getattr(ref, "trust_remote_code", False)))
    plan = ExportPlan(dict(targets), dict(shapes), {k: v for k, v in dtypes.items() if v is not None}, (),
                      dtypes.get(next(iter(targets)), torch.float32) if targets else torch.float32)
    ftype = file_type(manifest.get("scheme", {}), resolved)
    manifest = {**manifest, "architecture": arch,
                "tokenizer": f"copied from {source.name}" if source is not None else "converted from tokenizer.json"}
    name = Path(str(config.get("_name_or_path") or "")).name or directory.resolve().name or "model"
    return GGUFExport(FORMAT, plan, manifest, arch=arch, config=config, outputs=outputs, source=source,
                      tokenizer=tokenizer, ftype=ftype, model_name=name)


def _check_block_width(name: str, shape: tuple[int, ...], scheme: Scheme) -> None:
    """Refuse (one line) a row width that is not whole blocks of ``scheme``'s ggml type."""
    elems = _gguf().GGML_QUANT_SIZES[scheme.ggml_type][0]
    if shape[1] % elems:
        raise ExportError(
            f"--format gguf: {name} is {shape[1]} wide, not a multiple of {scheme.name}'s block of {elems} "
            f"(llama.cpp stores whole blocks in each row); keep it in F32 with --exclude '{name}'"
        )


def _float_array(t: torch.Tensor, ggml_type) -> np.ndarray:
    """A float tensor in the GGUF type chosen for it; BF16 as its raw 16-bit words (numpy has no bfloat16)."""
    T = _gguf().GGMLQuantizationType
    if ggml_type == T.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    if ggml_type == T.F16:
        return t.to(torch.float16).contiguous().numpy()
    return t.to(torch.float32).contiguous().numpy()


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
            self._write("rope_freqs.weight", llama3_rope_factors(export.config).numpy(), _gguf().GGMLQuantizationType.F32)

    def _write(self, gguf_name: str, array: np.ndarray, ggml_type, raw_shape=None) -> None:
        self.gw.add_tensor_info(gguf_name, raw_shape if raw_shape is not None else array.shape, array.dtype,
                                array.nbytes, raw_dtype=ggml_type)
        array.tofile(self.spool)
        self.gw.write_padding(self.spool, array.nbytes)

    def add(self, name: str, value: QuantizedTensor | torch.Tensor) -> None:
        out = self.export.outputs.get(name, "missing")
        if out == "missing":
            raise ExportError(f"{name} was not in the export plan; re-run the export")
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
        arr = _float_array(t, out.ggml_type)
        self._write(out.gguf_name, arr, out.ggml_type, raw_shape=tuple(t.shape))

    def close(self) -> list[Path]:
        missing = sorted(self.expected - self.written)
        if missing:
            raise ExportError(f"the export stream lacked {', '.join(missing[:3])}; re-run the export")
        self.spool.close()
        self.gw.add_string(RECORD_KEY, json.dumps(self.record, sort_keys=True))
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


def output_bytes(out: Path) -> int:
    p = gguf_path(out)
    return p.stat().st_size if p.is_file() else 0


def read_record(path: Path, reader=None) -> dict | None:
    """The export record of a GGUF file: its ``qkit.export`` field, else ``qkit-export.json`` beside it (an OUT directory).

    ``reader``: a ``gguf.GGUFReader`` of ``path`` already open (parsing a 50k-token vocabulary takes seconds).
    """
    reader = reader if reader is not None else _gguf().GGUFReader(str(path))
    f = reader.fields.get(RECORD_KEY)
    if f is not None:
        return json.loads(bytes(f.parts[-1]).decode("utf-8"))
    sidecar = Path(path).parent / EXPORT_MANIFEST
    if Path(path).name == FILE and sidecar.is_file():
        return json.loads(sidecar.read_text())
    return None


__all__ = ["FILE", "FORMAT", "NAME", "GGUFExport", "GGUFFileWriter", "atomic_output", "check_output", "gguf_path",
           "inverse_permutation", "is_qkit_gguf", "prepare", "read_record", "row_permutation"]
