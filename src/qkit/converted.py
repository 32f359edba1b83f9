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
``--imatrix`` (llama-imatrix's names, or ``qkit imatrix``'s), ``--token-embedding-type``,
``--output-tensor-type``, and ``--method gptq``: GPTQ runs on the Hugging Face model, each block
projection at the type its GGUF tensor gets (an expert matrix calibrated on the tokens routed to it, with
its own row of the stacked importance entry; gpt-oss's fused ``[experts, in, out]`` tensors as one matrix per
expert, whose rows are the columns the converter transposes and splits), and its block rows are placed where
the converter's row map (``converter.row_map``) puts them. The rest (awq and smoothquant, which change
full-precision tensors too; gptq with ``--holdout`` on a mixture-of-experts model; ``--keep``, ``--include``,
``--exclude``, ``--tensor-type``, a plan) is refused in one line before any work.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from qkit.checkpoint import checkpoint_bytes
from qkit.choice import QuantizeOptions, Request
from qkit.errors import InputError
from qkit.export import get_format
from qkit.export.gguf import read_kv_fields, source_gguf
from qkit.export.gguf.converter import check_model, convert_f32, row_map
from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import head_type, llama_quantize_args, plan, quantize_gguf
from qkit.export.gguf.rowmap import RowMap
from qkit.export.gguf.types import ggml_blocks
from qkit.methods.gptq import GPTQMethod
from qkit.llama_names import expert_index
from qkit.methods.expert_storage import virtual_experts
from qkit.methods.experts import check_method
from qkit.methods.imatrix import Imatrix, gguf_names
from qkit.schemes.ggml import uses_importance
from qkit.schemes.recipes import scheme_for_type
from qkit.transform import is_block_projection
from qkit.methods import RTN
from qkit.methods.imatrix import read as read_imatrix
from qkit.models import ModelRef
from qkit.writing import QuantizeResult

T = gguf.GGMLQuantizationType
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
    if req.method is not None and not isinstance(req.method, GPTQMethod):
        raise InputError(f"--method {req.method.name} with --format gguf writes llama and qwen2 models (it changes "
                         f"full-precision tensors too); a {arch} model's GGUF takes --method rtn or gptq")
    if req.method is not None:  # a mixture-of-experts model gptq cannot route (--holdout): refused now
        check_method(config, req.method.name, req.method_options)
    for field_name, option in _REFUSED:
        if getattr(opts, field_name):
            raise InputError(f"{option} with --format gguf is for llama and qwen2 models; a {arch} model's GGUF takes "
                             "a recipe or block type, --imatrix, --token-embedding-type and --output-tensor-type")


_HEADS = ("--token-embedding-type", "--output-tensor-type")


def _method_blocks(req: Request, ref: ModelRef, config: dict, rows: RowMap, planned: list, matrix: Imatrix | None,
                   device: torch.device) -> tuple[Callable[[str, T], np.ndarray | None], dict]:
    """Run the calibrated method on the Hugging Face model for every block projection whose rows the converter
    moves whole into quantized GGUF tensors of one type, each with that type (and its importance row); the
    ``blocks`` hook that places its codes' rows where the converter puts them, and the method's record.
    gpt_oss's fused experts ``[E, in, out]``, whose columns the converter transposes into GGUF rows and splits
    (gate: even columns, up: odd), are run as one matrix per expert (``virtual_experts``), whose code rows are
    those columns. A projection the converter changes otherwise is left to ``quantize_gguf``'s RTN, and counted."""
    types = {p.info.name: p.ggml_type for p in planned if p.converted}
    targets, sources, weights, by_rtn = {}, {}, {}, []
    virtual = virtual_experts(rows.hf, config)  # gpt_oss: each expert matrix of a fused [E, in, out] tensor
    in_fused: dict[str, list[str]] = {}
    for name, v in virtual.items():
        in_fused.setdefault(v.fused, []).append(name)
    to_gguf = gguf_names(config, list(virtual)) if virtual else {}

    def weigh(name: str, gguf_name: str, width: int) -> None:  # its importance entry; an expert's row of it
        qw = matrix.quant_weights(gguf_name) if matrix is not None else None
        if qw is not None and (expert := expert_index(name)) is not None:
            qw = np.asarray(qw).reshape(-1, width)[expert]
        if qw is not None:
            weights[name] = torch.as_tensor(np.asarray(qw, dtype=np.float32))

    for hf, shape in rows.hf.items():
        if not is_block_projection(hf, shape) and hf not in in_fused:
            continue
        placed = rows.placements(hf)
        kinds = {(p.kind, types.get(p.gguf_name)) for p in placed}
        moved = "transposed" if hf in in_fused else "rows"  # a fused expert tensor's GGUF rows are its columns
        if not placed or len(kinds) != 1 or next(iter(kinds))[0] != moved or next(iter(kinds))[1] is None:
            by_rtn.append(hf)
            continue
        t = next(iter(kinds))[1]
        for p in placed:
            sources.setdefault(p.gguf_name, []).append(hf)
        for name in in_fused.get(hf, [hf]):
            targets[name] = scheme_for_type(t, name)
            if name in virtual:
                weigh(name, to_gguf[name], virtual[name].shape[1])
            else:
                for p in placed:
                    weigh(name, p.gguf_name, shape[-1])
    done = req.method.run(ref, targets, req.method_options, device=device,
                          **({"quant_weights": weights} if matrix is not None else {}))
    codes = {hf: ggml_blocks(qt).numpy() for hf, qt in done.quantized.items()}
    for hf, shape in rows.hf.items():  # a fused tensor's codes by its flat column, expert * columns + column
        parts = [codes.get(n) for n in in_fused.get(hf, [])]
        if parts and all(c is not None for c in parts):
            per_row = parts[0].shape[-1]
            whole = np.empty((shape[0] * shape[-1], per_row), dtype=np.uint8)
            for name, c in zip(in_fused[hf], parts):
                v = virtual[name]
                whole[v.expert * shape[-1] + np.arange(shape[-1])[v.columns]] = c.reshape(-1, per_row)
            codes[hf] = whole
    names = list(rows.hf)

    def blocks(name: str, t: T) -> np.ndarray | None:
        g = rows.gguf[name]
        if name not in sources or any(hf not in codes for hf in sources[name]) or t != types[name]:
            return None
        per_row = codes[sources[name][0]].shape[-1]
        out = np.empty((g.rows, per_row), dtype=np.uint8)
        for k in np.unique(g.src):
            (where,) = np.nonzero(g.src == k)
            out[where] = codes[names[int(k)]].reshape(-1, per_row)[g.flat[where]]
        return out

    # "matrices": the Hugging Face matrices the method ran on (the file's tensors stack and split them)
    record = {"name": req.method.name, **done.record, "written_by_rtn": sorted(by_rtn), "matrices": len(targets)}
    return blocks, record


def quantize(req: Request, opts: QuantizeOptions, ref: ModelRef, config: dict, out: Path, t0: float,
             device: torch.device | None = None) -> QuantizeResult:
    """Convert (cached), then quantize the F32 file into ``out`` (module docstring); ``config``: the model's."""
    device = device or torch.device("cpu")
    source = source_gguf(ref.directory, ref)
    matrix = read_imatrix(opts.imatrix) if opts.imatrix else None
    f32 = convert_f32(ref.directory, vocab=source is None)
    tokenizer = None if source is None else [f for f in read_kv_fields(source) if f[0].startswith("tokenizer.")]
    heads = opts.token_embedding_type, opts.output_tensor_type
    blocks, method = None, None
    if req.method is not None:
        ftype, pure = llama_quantize_args(req.default)
        planned, _ = plan(read_header(f32), ftype, pure, matrix, *(head_type(w, o) for w, o in zip(heads, _HEADS)), str(f32))
        blocks, method = _method_blocks(req, ref, config, row_map(ref.directory), planned, matrix, device)
    done = quantize_gguf(f32, out, req.default, matrix, token_embedding_type=heads[0], output_tensor_type=heads[1],
                         force=opts.force, tokenizer=tokenizer, blocks=blocks)
    sizes = {t.name: math.prod(t.ne) for t in read_header(done.path).tensors}
    quantized = {n: t for n, (t, _, _) in done.tensors.items() if t not in _FLOAT_TYPES}
    parameters = sum(sizes[n] for n in quantized)
    qbytes = sum(done.tensors[n][2] for n in quantized)
    result = QuantizeResult(out, ref.spec, req.default.name, len(quantized), parameters,
                            8 * qbytes / parameters if parameters else 0.0, checkpoint_bytes(ref.directory),
                            done.nbytes, 0.0, format="gguf", method=RTN if method is None else req.method.name,
                            method_record=method or {},
                            schemes_used=dict(Counter(t.lower() for t in quantized.values()).most_common()),
                            types={n: t.lower() for n, t in quantized.items()},
                            kept={n: b for n, (t, _, b) in done.tensors.items() if t in _FLOAT_TYPES})
    if matrix is not None:
        weighted = sum(1 for n, t in quantized.items() if n in matrix.entries and uses_importance(T[t]))
        result.imatrix = {**matrix.to_record(weighted), "unit_weighted": list(done.unit_weighted)}
    arch = read_header(f32).fields.get("general.architecture")
    arch = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else arch
    result.notes.append(f"{arch} model: written from llama.cpp's converter's F32 GGUF as llama-quantize writes it"
                        + (", with the tokenizer fields of the GGUF it came from" if source is not None else ""))
    result.seconds = time.perf_counter() - t0
    return result


__all__ = ["check", "quantize", "takes"]
