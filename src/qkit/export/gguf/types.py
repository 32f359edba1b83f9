"""GGUF types: which qkit schemes GGUF stores as which ggml block type, and the file's llama.cpp ftype.

A scheme is stored as a ggml type when it is ``qkit.schemes.base.GGMLCodable``: its parts convert to and
from one type's block bytes (for llama.cpp's own ``q8_0`` ... ``q6_k`` the ``qweight`` is those bytes;
``mxfp4`` -> MXFP4), or a ``Recipe`` (``q4_k_m``) whose every type is. ``general.file_type`` is the label
``llama-quantize`` would record.
"""

from __future__ import annotations

from collections import Counter

import gguf
import torch

from qkit.errors import ExportError
from qkit.schemes import QuantizedTensor, Scheme, get_scheme, is_llama_type, scheme_names
from qkit.schemes.base import GGMLCodable, Recipe


# What a plan mixes: llama-quantize's types that qkit writes, the 256-blocks (k-quants, iq4_xs), then the
# 32-blocks. Not mxfp4 (qkit writes it; llama-quantize offers it only as the MoE-expert ftype MXFP4_MOE).
PLAN_TYPES = ("q2_k", "q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k", "q4_0", "iq4_nl", "q4_1", "q5_0", "q5_1", "q8_0")


def is_ggml(scheme: Scheme) -> bool:
    """A scheme GGUF stores as ggml types: a ``GGMLCodable`` (``to_ggml_blocks(qt) -> uint8 [rows,
    bytes_per_row]`` and ``from_ggml_blocks(blocks, shape, dtype) -> QuantizedTensor``), or a ``Recipe``
    whose every type is one."""
    if isinstance(scheme, Recipe):
        return all(isinstance(t, GGMLCodable) for t in scheme.types)
    return isinstance(scheme, GGMLCodable)


def ggml_blocks(qt: QuantizedTensor) -> torch.Tensor:
    """llama.cpp's block bytes of a quantized tensor of a ``GGMLCodable`` scheme, uint8 ``[rows, bytes_per_row]``."""
    return qt.scheme.to_ggml_blocks(qt)


def decode_blocks(blocks: torch.Tensor, scheme: GGMLCodable, dtype: torch.dtype) -> QuantizedTensor:
    """Inverse of :func:`ggml_blocks`: uint8 ``[rows, bytes_per_row]`` -> the ``QuantizedTensor`` of ``scheme``,
    of shape ``[rows, bytes_per_row / block bytes * block elements]`` (``GGML_QUANT_SIZES``)."""
    rows = blocks.shape[0]
    elems, size = gguf.GGML_QUANT_SIZES[scheme.ggml_type]
    cols = blocks.shape[1] // size * elems
    return scheme.from_ggml_blocks(blocks.contiguous(), (rows, cols), dtype)


def ggml_scheme_names() -> list[str]:
    """The registered schemes GGUF can store (for messages): llama.cpp's own block schemes in registry order,
    then those that convert to a ggml type (``mxfp4``)."""
    names = [n for n in scheme_names() if is_ggml(get_scheme(n))]
    return sorted(names, key=lambda n: not is_llama_type(get_scheme(n)))


def scheme_for_type(ggml_type) -> Scheme:
    """The registered ggml scheme of ``ggml_type`` (the one named like the type first): for files qkit did not write."""
    t = gguf.GGMLQuantizationType(int(ggml_type))
    found = [get_scheme(n) for n in scheme_names()]
    found = [s for s in found if is_ggml(s) and int(s.ggml_type) == int(t)]
    found.sort(key=lambda s: s.name != t.name.lower())
    if not found:
        raise ExportError(f"qkit has no scheme for ggml type {t.name}; it reads {', '.join(ggml_scheme_names()) or 'none'}")
    return found[0]


def resolve_scheme(scheme: Scheme, shape: tuple[int, ...], name: str) -> Scheme:
    """The scheme ``quantize_tensor`` will actually use for this tensor (a recipe or a width fallback)."""
    return scheme.resolve(shape, name)


def block_bytes(ggml_type, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``ggml_type`` (``GGML_QUANT_SIZES``: elements and bytes per block)."""
    elems, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return cols // elems * size


def float_type(dtype: torch.dtype):
    """The GGUF type the writer stores an unquantized 2-D tensor of source ``dtype`` in: the source's own float
    type (F16, BF16; F32 for anything else), never converted (``writer.prepare``). Norms and 1-D tensors are
    F32 whatever their dtype."""
    T = gguf.GGMLQuantizationType
    return {torch.float16: T.F16, torch.bfloat16: T.BF16}.get(dtype, T.F32)


def tensor_nbytes(ggml_type, shape: tuple[int, int]) -> int:
    """Bytes GGUF stores for a ``[rows, cols]`` tensor of ``ggml_type`` (the tensor's ``n_bytes``, alignment padding
    not counted): ``rows * cols / block * type_size`` (``GGML_QUANT_SIZES``; F32 is ``(1, 4)``, F16/BF16
    ``(1, 2)``), e.g. Q4_K ``[576, 1536]``: 576 * 6 * 144 = 497,664. ``ExportError`` for a width that is not
    whole blocks."""
    rows, cols = (int(d) for d in shape)
    elems = gguf.GGML_QUANT_SIZES[ggml_type][0]
    if cols % elems:
        raise ExportError(f"GGUF stores {gguf.GGMLQuantizationType(int(ggml_type)).name} in whole blocks of {elems} "
                          f"per row; a [{rows}, {cols}] tensor is not")
    return rows * block_bytes(ggml_type, cols)


def check_block_width(name: str, shape: tuple[int, ...], scheme: Scheme) -> None:
    """Refuse (one line) a row width that is not whole blocks of ``scheme``'s ggml type."""
    elems = gguf.GGML_QUANT_SIZES[scheme.ggml_type][0]
    if shape[1] % elems:
        raise ExportError(
            f"--format gguf: {name} is {shape[1]} wide, not a multiple of {scheme.name}'s block of {elems} "
            f"(llama.cpp stores whole blocks in each row); keep it in F32 with --exclude '{name}'"
        )


def file_type(default: dict, resolved: list[Scheme]):
    """``general.file_type``: the llama.cpp ftype ``llama-quantize`` would record for this export.

    ``default``: the default scheme's manifest entry. A recipe's by the ftype it records (``q4_k_m`` ->
    ``MOSTLY_Q4_K_M``, ``q2_k-llama`` -> ``MOSTLY_Q2_K``, ``mxfp4_moe`` -> ``MOSTLY_MXFP4_MOE``), mxfp4 by its
    name, else by its ggml type (``q4_k`` -> ``MOSTLY_Q4_K_S``, ``q3_k`` -> ``MOSTLY_Q3_K_M``: llama-quantize's
    ``Q3_K`` is an alias of it; llama.cpp's "mostly Q4_K", even where the width fallback gave most tensors
    q5_0), else by the type most tensors got. Embeddings
    kept in F32 do not change it.
    """
    default_name = default.get("name", "")
    F, T = gguf.LlamaFileType, gguf.GGMLQuantizationType
    recipe = str(default.get("recipe", "")).removeprefix("LLAMA_FTYPE_")  # a recipe's: LLAMA_FTYPE_MOSTLY_Q4_K_M
    if recipe in F.__members__:
        return F[recipe]
    # llama.cpp has one ftype for MXFP4, MOSTLY_MXFP4_MOE (38: llama-quantize's "MXFP4_MOE", made for gpt-oss,
    # where it quantizes the expert tensors); it is the only ftype that names MXFP4, and llama.cpp reads the
    # ftype as a label only (every tensor carries its own type). mxfp4's manifest entry names no ggml_type, so
    # it is found here by its name.
    by_name = {"mxfp4": F.MOSTLY_MXFP4_MOE}
    if default_name in by_name:
        return by_name[default_name]
    by_type = {T.Q4_0: F.MOSTLY_Q4_0, T.Q4_1: F.MOSTLY_Q4_1, T.Q5_0: F.MOSTLY_Q5_0, T.Q5_1: F.MOSTLY_Q5_1,
               T.Q8_0: F.MOSTLY_Q8_0, T.Q4_K: F.MOSTLY_Q4_K_S, T.Q5_K: F.MOSTLY_Q5_K_S, T.Q6_K: F.MOSTLY_Q6_K,
               T.Q2_K: F.MOSTLY_Q2_K, T.Q3_K: F.MOSTLY_Q3_K_M, T.IQ4_NL: F.MOSTLY_IQ4_NL, T.IQ4_XS: F.MOSTLY_IQ4_XS,
               T.F16: F.MOSTLY_F16, T.BF16: F.MOSTLY_BF16, T.MXFP4: F.MOSTLY_MXFP4_MOE,
               T.TQ1_0: F.MOSTLY_TQ1_0, T.TQ2_0: F.MOSTLY_TQ2_0, T.IQ3_XXS: F.MOSTLY_IQ3_XXS, T.IQ3_S: F.MOSTLY_IQ3_S,
               # the ftypes whose default type these are (llama_ftype_get_default_type: IQ2_S's is IQ2_XS, IQ2_M's IQ2_S)
               T.IQ2_XXS: F.MOSTLY_IQ2_XXS, T.IQ2_XS: F.MOSTLY_IQ2_XS, T.IQ2_S: F.MOSTLY_IQ2_M,
               T.IQ1_S: F.MOSTLY_IQ1_S, T.IQ1_M: F.MOSTLY_IQ1_M}
    if default.get("ggml_type") in T.__members__ and T[default["ggml_type"]] in by_type:
        return by_type[T[default["ggml_type"]]]
    counts = Counter(T(int(s.ggml_type)) for s in resolved)
    for t, _ in counts.most_common():
        if t in by_type:
            return by_type[t]
    return F.ALL_F32


def float_array(t: torch.Tensor, ggml_type):
    """A float tensor as the numpy array of the GGUF type chosen for it; BF16 as its raw 16-bit words (numpy
    has no bfloat16)."""
    T = gguf.GGMLQuantizationType
    if ggml_type == T.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    if ggml_type == T.F16:
        return t.to(torch.float16).contiguous().numpy()
    return t.to(torch.float32).contiguous().numpy()


__all__ = ["PLAN_TYPES", "block_bytes", "check_block_width", "file_type", "float_array", "float_type", "decode_blocks", "ggml_blocks",
           "ggml_scheme_names", "is_ggml", "resolve_scheme", "scheme_for_type", "tensor_nbytes"]
