"""``qkit quantize --format gguf`` for the architectures qkit's own GGUF writer does not name: llama.cpp's
converter writes the F32 GGUF, and qkit quantizes that file as llama-quantize does.

qkit's writer (``qkit.export.gguf``) knows llama and qwen2 (its names, the q/k permutation), streams from
the Hugging Face tensors and takes every method and option. Any other architecture llama.cpp converts
(qwen3, mistral, gemma3, olmo2, granite, mixtral, qwen3-moe, gpt-oss, ...) goes this way:

1. ``export.gguf.converter.convert_f32``: the pinned converter's F32 GGUF (its names, row permutations,
   stacked experts, hyperparameters), cached by the model's files. A model qkit converted from a GGUF (the
   pinned Gemma 3, ``MODEL.gguf``) is converted without its tokenizer, and the source GGUF's own
   ``tokenizer.*`` fields are written instead: the converter would read the ``tokenizer.json`` qkit rebuilt
   from them, and its hash of a BPE tokenizer can name another model's pre-tokenizer.
2. ``export.gguf.requantize.quantize_gguf``: every tensor at the type ``llama_tensor_get_type`` gives it
   for that architecture, with qkit's encoders and the importance matrix, llama-quantize's file byte for
   byte (qkit's record aside).

What this route takes: a llama.cpp recipe (``q4_k_m``, ...) or block type (``q4_k``: ``--pure``),
``--imatrix`` (llama-imatrix's names, or ``qkit imatrix``'s), ``--token-embedding-type`` and
``--output-tensor-type``. Everything else (a calibrated method, ``--keep``, ``--include``, ``--exclude``,
``--tensor-type``, a plan) is refused in one line before any work: those need the Hugging Face tensors
mapped through the converter's row moves (``converter.row_map``), which this route does not write yet.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path

from qkit.checkpoint import checkpoint_bytes
from qkit.choice import QuantizeOptions, Request
from qkit.errors import InputError
from qkit.export import get_format
from qkit.export.gguf import read_kv_fields, source_gguf
from qkit.export.gguf.converter import check_model, convert_f32
from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import quantize_gguf
from qkit.methods import RTN
from qkit.methods.imatrix import read as read_imatrix
from qkit.models import ModelRef
from qkit.writing import QuantizeResult

_FLOAT_TYPES = ("F32", "F16", "BF16")
# the options this route cannot honour yet, as the command line names them
_REFUSED = (("include", "--include"), ("exclude", "--exclude"), ("keep", "--keep"), ("tensor_types", "--tensor-type"),
            ("plan", "--plan / --target-bits / --target-size"), ("emit_tensor_types", "--emit-tensor-types"),
            ("activations", "--activations"))


def takes(fmt: str, config: dict) -> bool:
    """Whether ``--format fmt`` of a model with this config goes through llama.cpp's converter: a format whose
    own writer names some architectures only (GGUF: llama, qwen2), and a ``model_type`` it does not name."""
    native = get_format(fmt).native_architectures
    return native is not None and config.get("model_type") not in native


def check(req: Request, opts: QuantizeOptions, ref: ModelRef, config: dict) -> None:
    """Every refusal of this route, in one line, before any work: the converter's (architecture, projector,
    sentencepiece), then the options it does not take."""
    arch = config.get("model_type")
    check_model(ref.directory, tokenizer=source_gguf(ref.directory, ref) is None)
    if req.method is not None:
        raise InputError(f"--method {req.method.name} with --format gguf writes llama and qwen2 models; a {arch} "
                         "model's GGUF is written as llama-quantize writes it (--method rtn, with --imatrix)")
    for field_name, option in _REFUSED:
        if getattr(opts, field_name):
            raise InputError(f"{option} with --format gguf is for llama and qwen2 models; a {arch} model's GGUF takes "
                             "a recipe or block type, --imatrix, --token-embedding-type and --output-tensor-type")


def quantize(req: Request, opts: QuantizeOptions, ref: ModelRef, out: Path, t0: float) -> QuantizeResult:
    """Convert (cached), then quantize the F32 file into ``out`` (module docstring)."""
    source = source_gguf(ref.directory, ref)
    matrix = read_imatrix(opts.imatrix) if opts.imatrix else None
    f32 = convert_f32(ref.directory, vocab=source is None)
    tokenizer = None if source is None else [f for f in read_kv_fields(source) if f[0].startswith("tokenizer.")]
    done = quantize_gguf(f32, out, req.default, matrix, token_embedding_type=opts.token_embedding_type,
                         output_tensor_type=opts.output_tensor_type, force=opts.force, tokenizer=tokenizer)
    sizes = {t.name: math.prod(t.ne) for t in read_header(done.path).tensors}
    quantized = {n: t for n, (t, _, _) in done.tensors.items() if t not in _FLOAT_TYPES}
    parameters = sum(sizes[n] for n in quantized)
    qbytes = sum(done.tensors[n][2] for n in quantized)
    result = QuantizeResult(out, ref.spec, req.default.name, len(quantized), parameters,
                            8 * qbytes / parameters if parameters else 0.0, checkpoint_bytes(ref.directory),
                            done.nbytes, 0.0, format="gguf", method=RTN,
                            schemes_used=dict(Counter(t.lower() for t in quantized.values()).most_common()),
                            types={n: t.lower() for n, t in quantized.items()},
                            kept={n: b for n, (t, _, b) in done.tensors.items() if t in _FLOAT_TYPES})
    if matrix is not None:
        result.imatrix = {"file": str(opts.imatrix), "entries": len(matrix.entries), "unit_weighted": list(done.unit_weighted)}
    arch = read_header(f32).fields.get("general.architecture")
    arch = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else arch
    result.notes.append(f"{arch} model: written from llama.cpp's converter's F32 GGUF as llama-quantize writes it"
                        + (", with the tokenizer fields of the GGUF it came from" if source is not None else ""))
    result.seconds = time.perf_counter() - t0
    return result


__all__ = ["check", "quantize", "takes"]
