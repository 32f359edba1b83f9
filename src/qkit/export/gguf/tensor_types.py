"""``llama-quantize``'s ``--tensor-type-file``: read one, and write the one that reproduces qkit's types.

The file (``tools/quantize/quantize.cpp::parse_tensor_type_file``) is ``PATTERN=TYPE`` words separated
by spaces or newlines (no comments: every word is parsed). qkit writes one word per quantized tensor,
``^blk\\.3\\.attn_v\\.weight$=Q6_K``: the pattern anchored, so it matches that tensor alone (llama.cpp
searches patterns anywhere in a name, and ``blk.1`` would also match ``blk.10``); given to
``llama-quantize --tensor-type-file``, every quantized tensor gets the type qkit gave it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from qkit import reading
from qkit.errors import InputError
from qkit.staging import write_text

MAX_TENSOR_TYPE_BYTES = 64 * 1024**2  # one PATTERN=TYPE line per tensor: a 70B model's take ~50 kB
# what --emit-tensor-types needs of a quantize, said before its work (writing.check_tensor_types) and at the write
NEEDS_LLAMA_TYPES = "--emit-tensor-types needs llama.cpp names: a llama or qwen2 model quantized with llama.cpp types"
_WORD = re.compile(r"\^[^\s=]+\$=[A-Za-z0-9_]+")
_LAYER = re.compile(r"(^|\.)(layers|h|blocks|blk)\.\d+\.")  # blk.N: llama.cpp's names (a converted file)


def read_tensor_type_file(path: str | None) -> list[str]:
    """The ``PATTERN=TYPE`` words of ``path`` (``[]`` for None); one line for an unreadable file."""
    if path is None:
        return []
    try:  # a FIFO or a device: refused before it is opened (qkit.reading)
        words = reading.read_text(path, f"--tensor-type-file {path}", limit=MAX_TENSOR_TYPE_BYTES).split()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--tensor-type-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not words:
        raise InputError(f"--tensor-type-file {path} holds no PATTERN=TYPE words")
    return words


def tensor_type_words(llama_types: Mapping[str, str]) -> list[str]:
    """``{llama.cpp tensor name: ggml type name}`` -> the anchored words, in name order."""
    return [f"^{re.escape(name)}$={t}" for name, t in sorted(llama_types.items())]


def write_tensor_type_file(path: str | Path, llama_types: Mapping[str, str]) -> None:
    """Write the words of ``llama_types`` (``QuantizeResult.llama_types``) to ``path`` (atomically)."""
    if not llama_types:
        raise InputError(NEEDS_LLAMA_TYPES)
    write_text(path, "\n".join(tensor_type_words(llama_types)) + "\n", what="--emit-tensor-types")


def is_tensor_type_file(path: Path) -> bool:
    """Whether ``path`` looks like a file :func:`write_tensor_type_file` wrote (what --force may replace)."""
    try:
        words = reading.read_text(path, str(path), limit=MAX_TENSOR_TYPE_BYTES).split()
    except (OSError, UnicodeDecodeError, InputError):  # not a regular file, too large, unreadable
        return False
    return bool(words) and all(_WORD.fullmatch(w) for w in words)


def types_by_kind(types: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """``{tensor name: type}`` -> ``{name without its layer index: {type: count}}`` (what the CLI shows)."""
    out: dict[str, dict[str, int]] = {}
    for name, t in sorted(types.items()):
        kind = _LAYER.sub(r"\1\2.N.", name).removesuffix(".weight")
        per = out.setdefault(kind, {})
        per[t] = per.get(t, 0) + 1
    return out


__all__ = ["is_tensor_type_file", "read_tensor_type_file", "tensor_type_words", "types_by_kind", "write_tensor_type_file"]
