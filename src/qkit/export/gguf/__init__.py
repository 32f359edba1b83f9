"""GGUF: one ``.gguf`` file llama.cpp (and everything built on it) runs, written the way llama.cpp writes it.

``qkit quantize --format gguf -o OUT`` streams through the same transform as every other format; this
package turns each tensor into llama.cpp's name, layout and type and writes one GGUF v3 file. Matched
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

The package, one module per job: ``types`` (scheme <-> ggml type, the ftype), ``names`` (Hugging Face ->
llama.cpp names, the q/k permutation), ``metadata`` (the converter's keys, the bulk header reader, copying
a source GGUF, qkit's record), ``tokenizer`` (a Hugging Face BPE tokenizer converted), ``writer`` (the
``Format``: checks, the one-file container, the streaming writer). Their public names are re-exported here.
``converter`` (with ``rowmap`` and ``_converter_worker``) is llama.cpp's own converter, pinned and run in a
subprocess, for every architecture it knows: import it as ``qkit.export.gguf.converter`` (docs/gguf-converter.md).
"""

from __future__ import annotations

from qkit.export.gguf.metadata import (
    FILE,
    NAME,
    RECORD_KEY,
    SOURCE_FILE,
    add_architecture_metadata,
    copy_fields,
    is_qkit_gguf,
    llama3_rope_factors,
    read_kv_fields,
    read_record,
    source_gguf,
)
from qkit.llama_names import ARCHITECTURES, inverse_permutation, permutation_heads, row_permutation, tensor_names
from qkit.export.gguf.tokenizer import hf_tokenizer
from qkit.export.gguf.types import block_bytes, file_type, ggml_blocks, ggml_scheme_names, is_ggml, scheme_for_type
from qkit.export.gguf.writer import (
    FORMAT,
    GGUFExport,
    GGUFFileWriter,
    GGUFFormat,
    TensorOut,
    atomic_output,
    check_gguf_output,
    gguf_path,
    is_gguf_name,
    prepare,
)

__all__ = [
    "ARCHITECTURES", "FILE", "FORMAT", "NAME", "RECORD_KEY", "SOURCE_FILE", "GGUFExport", "GGUFFileWriter",
    "GGUFFormat", "TensorOut", "add_architecture_metadata", "atomic_output", "block_bytes", "check_gguf_output",
    "copy_fields", "file_type", "ggml_blocks", "ggml_scheme_names", "gguf_path", "hf_tokenizer",
    "inverse_permutation", "is_ggml", "is_gguf_name", "is_qkit_gguf", "llama3_rope_factors", "permutation_heads", "prepare",
    "read_kv_fields", "read_record", "row_permutation", "scheme_for_type", "source_gguf", "tensor_names",
]
