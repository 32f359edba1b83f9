"""llama-quantize's log read back: the type it wrote for each tensor (``llama_quantize_types``), which the
tests and benchmarks compare qkit's recipes with.

Layer 2 (``schemes/``): text in, types out; no I/O.
"""

from __future__ import annotations

import re

import gguf

from qkit.errors import SchemeError

T = gguf.GGMLQuantizationType

# llama_model_quantize_impl's line per tensor: "[  12/ 272]  blk.1.attn_v.weight  - [  576,   192,     1,     1],
# type =    f32, " then "converting to q6_K .. size = ... MiB ->  ... MiB" (quantized), "size = ... MiB" (copied,
# type unchanged), or with --dry-run "size = ... MiB -> ... MiB (q6_K)". Other messages may come in between.
_LOG_ENTRY = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+-\s+\[[^\]]*\],\s+type\s*=\s*(\w+),")
_CONVERTING = re.compile(r"converting to (\w+) \.\.")
_DRY_RUN = re.compile(r"size =\s*[\d.]+ MiB ->\s*[\d.]+ MiB \((\w+)\)")


def llama_quantize_types(log_text: str) -> dict[str, T]:
    """``{gguf tensor name: type written}`` from llama-quantize's log (its per-tensor lines; a tensor
    copied unchanged keeps its source type). Type names are ``ggml_type_name``'s (``q4_K``, ``iq4_nl``)."""
    out: dict[str, T] = {}
    entries = list(_LOG_ENTRY.finditer(log_text))
    for k, m in enumerate(entries):
        rest = log_text[m.end(): entries[k + 1].start() if k + 1 < len(entries) else len(log_text)]
        found = _CONVERTING.search(rest) or _DRY_RUN.search(rest)
        type_name = found.group(1) if found else m.group(2)
        if type_name.upper() not in T.__members__:
            raise SchemeError(f"llama-quantize log: tensor {m.group(1)} has type {type_name}, which gguf does not know")
        out[m.group(1)] = T[type_name.upper()]
    return out


__all__ = ["llama_quantize_types"]
