"""An importance matrix against a model: llama.cpp's tensor names, and the checks before any work.

An importance matrix names weights as llama.cpp does (``blk.3.ffn_down.weight``); qkit's tensors carry
Hugging Face names (``model.layers.3.mlp.down_proj.weight``). The map is the GGUF writer's
(``qkit.llama_names``). The q/k row permutation of llama models reorders rows only; the matrix
weights columns, so it applies unchanged.

:func:`quant_weights_for` refuses, in one line and before any work:

* an entry that names no tensor of the model, or whose width differs from the tensor's: a matrix from
  another model (llama-quantize aborts on a width mismatch too);
* an entry that cannot weight a search (``qkit.schemes.ggml.importance_problem``: all zeros, a largest value
  outside the range where llama.cpp's fp32 searches stay exact, NaN, inf or negative values): llama-quantize
  writes such a tensor as zeros;
* an entry with another number of rows than the model's tensor has experts (one for a dense tensor; one
  per expert for a mixture-of-experts layer's stacked ``_exps`` tensor, whose row ``e`` weights expert
  ``e``'s matrix): a matrix from another model, or a legacy ``.dat`` that runs the experts together;
* a quantized tensor with no entry, or whose entry counts no token (llama-quantize weights it by 1s).
  llama-quantize instead logs "did not find weights for ..." and
  quantizes that tensor without weights, so one file silently mixes weighted and unweighted tensors;
  qkit refuses, and ``--exclude`` (or a matrix that covers the tensor) is the way through. Except
  ``token_embd`` and ``output`` (a recipe's whole file): llama-imatrix never collects the first and the second
  only with ``--process-output``, so every llama.cpp file of a recipe quantizes them without weights where the
  matrix has no entry; qkit writes the same bytes (the manifest's ``imatrix.unweighted`` names them).
  And an expert's row that counts no token: the experts a calibration text never reaches are a mixture-of-
  experts model's normal case (llama-imatrix writes such "partial data"); llama-quantize and qkit weight
  that expert by 1s (the manifest's ``imatrix.unreached_experts`` names them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from qkit.errors import InputError
from qkit.llama_names import ARCHITECTURES, NAMED_MOE, expert_index, tensor_names
from qkit.methods.expert_storage import virtual_experts
from qkit.methods.experts import layout_for
from qkit.methods.imatrix.file import Imatrix
from qkit.schemes.ggml import GGMLScheme, importance_problem, uses_importance
from qkit.schemes.recipes import expert_count, tensor_category

def refuse_unsupported(config: Mapping) -> None:
    """One line for a model whose importance matrix qkit does not collect: an architecture without llama.cpp
    names here, a mixture-of-experts one whose experts qkit does not route calibration to
    (``qkit.methods.experts.layout_for``)."""
    arch = config.get("model_type")
    named = {**ARCHITECTURES, **NAMED_MOE}
    if arch not in named:
        raise InputError(f"importance matrices name tensors as llama.cpp does; model_type {arch!r} is not one qkit "
                         f"maps ({', '.join(sorted(named))})")
    layout_for(config)


def gguf_names(config: Mapping, names: list[str]) -> dict[str, str]:
    """Hugging Face weight name -> llama.cpp's, for ``names`` (every one must have a llama.cpp slot)."""
    refuse_unsupported(config)
    mapped = tensor_names(str(config["model_type"]), int(config["num_hidden_layers"]), list(names),
                          bool(config.get("tie_word_embeddings", False)))
    return {n: g for n, g in mapped.items() if g is not None}


def quant_weights_for(imatrix: Imatrix, config: Mapping, shapes: Mapping[str, tuple[int, ...]],
                      targets: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{hf name: fp32 [cols]}`` for every target whose scheme takes an importance matrix; refusals as in
    the module docstring. ``shapes``: every tensor of the model; ``targets``: ``{name: scheme}``."""
    src = imatrix.source or "the importance matrix"
    experts = expert_count(dict(config))
    # gpt_oss's expert matrices, stored fused: the entries of its _exps tensors name them (virtual_experts)
    shapes = {**shapes, **{n: v.shape for n, v in virtual_experts(shapes, config).items()}}
    to_gguf = gguf_names(config, [n for n in shapes if n.endswith(".weight")])
    by_gguf = {g: n for n, g in to_gguf.items()}
    unknown = sorted(e for e in imatrix.entries if e not in by_gguf)
    if unknown:
        raise InputError(f"--imatrix {src}: {len(unknown)} entries name no tensor of this model ({', '.join(unknown[:3])}); "
                         "it was collected from another model")
    for g, e in imatrix.entries.items():
        if imatrix.legacy and expert_index(by_gguf[g]) is not None:  # its experts' rows run together in one
            raise InputError(f"--imatrix {src}: a legacy .dat matrix keeps one row for {g}, whose experts it runs "
                             "together; give llama-imatrix's GGUF (one row per expert) or qkit imatrix's")
        shape = shapes.get(by_gguf[g])
        cols = shape[-1] if shape else None
        if shape is not None and e.width != cols:
            raise InputError(f"--imatrix {src}: entry {g} has {e.width} columns, the model's {by_gguf[g]} has {cols}; "
                             "it was collected from another model")
        rows = experts if expert_index(by_gguf[g]) is not None else 1
        if e.sums.shape[0] != rows:  # llama-imatrix keeps one row per expert of an ``_exps`` tensor, one otherwise
            theirs = f"has {rows} experts per layer" if rows > 1 else f"has no experts in {by_gguf[g]}"
            held = f"{e.sums.shape[0]} expert rows" if e.sums.shape[0] != 1 else "1 row, not one per expert"
            raise InputError(f"--imatrix {src}: entry {g} holds {held}, the model {theirs}; "
                             "it was collected from another model")
    out: dict[str, torch.Tensor] = {}
    missing = []
    for name, scheme in targets.items():
        stored = scheme.resolve(tuple(shapes[name]), name)  # a recipe's type for this tensor, a width fallback
        if not (isinstance(stored, GGMLScheme) and uses_importance(stored.ggml_type)):
            continue  # q8_0 and the non-llama.cpp schemes read no importance matrix
        g = to_gguf.get(name)
        qw = None if g is None else imatrix.quant_weights(g)
        if qw is None and tensor_category(name) in ("token_embd", "output"):
            continue  # llama-imatrix collects no token_embd (output only with --process-output): unweighted, as llama-quantize
        if qw is None:
            missing.append(g or name)
            continue
        expert = expert_index(name)
        if expert is not None:  # the expert's row of the stacked entry: 1s where no token reached it, as llama-quantize
            qw = qw.reshape(experts, -1)[expert]
        # llama-quantize rounds a count to whole tokens (std::lround) and weights a row of 0 by 1s
        elif (np.rint(imatrix.entries[g].counts.astype(np.float64)) <= 0).any():
            raise InputError(f"--imatrix {src}: entry {g} counts 0 tokens, so it holds no statistics and {name} would be "
                             "quantized without weights; collect a matrix whose calibration reaches it, or --exclude it")
        problem = importance_problem(torch.from_numpy(np.ascontiguousarray(qw, dtype=np.float32)))
        if problem is not None:  # all zeros, 3e38s, denormals: the searches would write the tensor as zeros
            raise InputError(f"--imatrix {src}: entry {g} cannot weight {name}: {problem}; collect the matrix again "
                             "(qkit imatrix, llama-imatrix) or --exclude the tensor")
        out[name] = torch.from_numpy(np.ascontiguousarray(qw, dtype=np.float32))
    if missing:
        raise InputError(
            f"--imatrix {src}: no entry for {len(missing)} tensor(s) to quantize ({', '.join(missing[:3])}); llama-quantize would "
            "quantize them without weights, qkit refuses; collect a matrix that covers them or --exclude them"
        )
    return out


def unreached_experts(imatrix: Imatrix, config: Mapping, names: list[str]) -> list[str]:
    """The expert matrices among ``names`` whose row of ``imatrix`` counts no token: llama-quantize (and qkit)
    weight them by 1s, as if the matrix had no entry for them (the manifest names them)."""
    to_gguf = gguf_names(config, names)
    out = []
    for name in names:
        e, expert = imatrix.entries.get(to_gguf.get(name, "")), expert_index(name)
        if e is not None and expert is not None and expert < e.counts.size and np.rint(float(e.counts[expert])) <= 0:
            out.append(name)
    return sorted(out)


__all__ = ["gguf_names", "quant_weights_for", "refuse_unsupported", "unreached_experts"]
