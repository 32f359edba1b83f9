"""llama.cpp's names: Hugging Face tensor names -> llama.cpp's, and llama.cpp's q/k row permutation.

Layer 3, data below what uses it: the GGUF writer (``qkit.export.gguf``), importance matrices (whose
entries carry llama.cpp's names, ``qkit.methods.imatrix``) and ``--tensor-type`` (patterns over them).

Names come from ``gguf.get_tensor_name_map`` (``token_embd.weight``, ``blk.N.attn_q.weight``, ...,
``output_norm.weight``, ``output.weight`` unless tied). The permutation (llama only): llama.cpp's rotary
kernel pairs dimensions ``(2i, 2i+1)`` of each head where Hugging Face pairs ``(i, i + d/2)``, so the
converter reorders the rows of ``q_proj`` and ``k_proj`` (``LlamaModel.permute``).
"""

from __future__ import annotations

import re

import gguf
import torch

from qkit.errors import ExportError

# Hugging Face model_type -> llama.cpp architecture (gguf.MODEL_ARCH member name)
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}
# Mixture-of-experts architectures whose tensors qkit names as llama.cpp does (importance matrices,
# ``--tensor-type``) but whose GGUF it does not write here. llama.cpp converts mixtral as a llama model. gpt_oss's
# checkpoint stores its experts fused; its expert matrices carry the per-expert names the converter splits
# them into (``mlp.experts.3.gate_proj.weight``: ``blk.N.ffn_gate_exps`` row 3; ``methods.experts.GPT_OSS``).
NAMED_MOE = {"qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "mixtral": "LLAMA", "gpt_oss": "GPT_OSS"}
# A per-expert matrix as a checkpoint stores it (``mlp.experts.3.gate_proj.weight``, ``block_sparse_moe.
# experts.3.w1.weight``): llama.cpp's converter stacks the experts into one tensor (``blk.N.ffn_gate_exps``),
# the expert index becoming its outermost dimension.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# Architectures whose q/k rows llama.cpp reorders (``LlamaModel.undo_permute``); Qwen2Model does not.
_PERMUTED = {"llama"}
_SKIPPED = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")  # the converter drops these


def arch_name(arch: str) -> str:
    """llama.cpp's name of a Hugging Face ``model_type`` (``general.architecture``: ``llama``, ``qwen2``)."""
    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch])]


def expert_index(name: str) -> int | None:
    """The expert a per-expert matrix belongs to (``model.layers.0.mlp.experts.3.up_proj.weight``: 3), else None."""
    found = _EXPERT.search(name)
    return None if found is None else int(found.group(1))


def tensor_names(arch: str, n_blocks: int, names: list[str], tied: bool) -> dict[str, str | None]:
    """Hugging Face tensor name -> llama.cpp's (None: not written); every expert of a mixture-of-experts layer
    names the one stacked tensor (``blk.N.ffn_up_exps.weight``; ``expert_index`` gives its row of experts).
    Raises ``ExportError`` for a name llama.cpp has no slot for."""
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, {**ARCHITECTURES, **NAMED_MOE}[arch]), n_blocks)
    out: dict[str, str | None] = {}
    for name in names:
        if name.endswith(_SKIPPED) or (tied and name == "lm_head.weight"):
            out[name] = None  # the converter drops these; a tied head is the embedding (transformers re-ties it)
            continue
        new = name_map.get_name(_EXPERT.sub(".experts.", name), try_suffixes=(".weight", ".bias"))
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
    """Row order of llama.cpp's ``LlamaModel.permute``: ``permuted = w[perm]``, int64 ``[rows]``.

    ``permute(w) = w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)``;
    applied to ``arange(rows)`` it yields which source row lands in each position.
    """
    if rows % (2 * n_head):
        raise ExportError(f"cannot apply llama.cpp's q/k permutation: {rows} rows are not 2 x {n_head} heads")
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)


def inverse_permutation(rows: int, n_head: int) -> torch.Tensor:
    """``w == permuted[inverse]``: how a reader undoes :func:`row_permutation` (transformers does the same)."""
    return torch.argsort(row_permutation(rows, n_head))


__all__ = ["ARCHITECTURES", "NAMED_MOE", "arch_name", "expert_index", "inverse_permutation", "permutation_heads", "row_permutation", "tensor_names"]
