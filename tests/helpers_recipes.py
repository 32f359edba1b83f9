"""What the llama.cpp recipe tests share (no tests here): a bound recipe and the types it gives, and
llama.cpp's own type-selection snapshots (``src/tests/snapshots/*.schema`` of the fetched source), the
models they describe and their reader, for ``tests/test_recipes_ladder.py`` and
``tests/test_golden_recipe_snapshots.py``."""

from __future__ import annotations

from pathlib import Path

from conftest import benchmark_module

from qkit.schemes.recipes import LlamaRecipe, llama_types

SNAPSHOTS = benchmark_module("build_llama_ref").ref_dir() / "src" / "tests" / "snapshots"  # llama.cpp's, when fetched


def recipe(ftype: str, config: dict, imatrix: bool = False) -> LlamaRecipe:
    """The llama.cpp recipe of ``ftype`` bound to ``config`` (with or without an importance matrix)."""
    return LlamaRecipe(f"test-{ftype}", ftype).bind(config).with_imatrix(imatrix)


def type_names(r: LlamaRecipe, shapes) -> dict[str, str]:
    """``{tensor name: ggml type name}`` the bound recipe ``r`` gives ``shapes`` (``[(name, shape)]``)."""
    return {n: t.name for n, t in llama_types(r, shapes).items()}


LLAMA70_CONFIG = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False}
# (snapshot, config as qkit binds it, ne[0] of q/k/v/gate/up, of attn_output, of ffn_down). Qwen3 is bound
# as qwen2 and Gemma-3 as llama: no rule of these ftypes depends on the architecture beyond Falcon and the
# 70B type (80 layers), and their tensors are the same seven projections per layer.
SNAPSHOT_MODELS = {
    "meta-llama-3.1-70b-instruct": (LLAMA70_CONFIG, 8192, 64 * 128, 28672),
    "qwen3-0.6b": ({"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                    "tie_word_embeddings": False}, 1024, 16 * 128, 3072),
    "qwen3-14b": ({"model_type": "qwen2", "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                   "tie_word_embeddings": False}, 5120, 40 * 128, 17408),
    "gemma-3-4b-it": ({"model_type": "llama", "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                       "tie_word_embeddings": True}, 2560, 8 * 256, 10240),
}
GGUF_PROJ = {"attn_q": 0, "attn_k": 0, "attn_v": 0, "attn_output": 1, "ffn_gate": 0, "ffn_up": 0, "ffn_down": 2}


def read_snapshot(path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """``{ftype: (default type, {gguf name: type where not the default})}`` (test-quant-type-selection's format)."""
    sections: dict[str, tuple[str, dict[str, str]]] = {}
    cur = None
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            ftype, default = line[1:].split("] ")
            cur = sections[ftype] = (default.upper(), {})
        else:
            name, t = line.rsplit(" ", 1)
            cur[1][name] = t.upper()
    return sections
