"""Tiny random models of the architectures llama.cpp's converter handles, for the GGUF-for-every-
architecture tests (issue: every architecture llama.cpp converts, and mixture-of-experts).

Each is built from its transformers config class with seeded weights, saved as safetensors, with the
default model's tokenizer (a byte-level BPE whose pre-tokenizer llama.cpp's converter recognizes; a
tokenizer trained here would not be). Hidden 256 and intermediate 512 keep every k-quant's 256
super-blocks whole; the MoE models have 4 experts, 2 per token.

``make_arch_model(directory, arch, tokenizer_dir)`` writes one and returns ``directory``; ``ARCHS`` lists
the twelve architectures the issue names.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 256, 512, 2, 4, 2, 64, 4

# model_type -> the config fields beyond the shared ones
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": HEAD_DIM},
    "qwen3_moe": {"head_dim": HEAD_DIM, "num_experts": EXPERTS, "num_experts_per_tok": 2,
                  "moe_intermediate_size": INTER // 2, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_local_experts": EXPERTS, "num_experts_per_tok": 2, "sliding_window": None},
    "gemma2": {"head_dim": HEAD_DIM},
    "gemma3_text": {"head_dim": HEAD_DIM},
    "phi3": {},
    "olmo2": {},
    "granite": {},
    "gpt_oss": {"head_dim": HEAD_DIM, "num_local_experts": EXPERTS, "num_experts_per_tok": 2},
}
ARCHS = tuple(_EXTRA)
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def arch_config(arch: str, vocab: int) -> Any:
    """The transformers config of a tiny ``arch`` model over ``vocab`` tokens."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        arch, vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        tie_word_embeddings=False, **_EXTRA[arch],
    )


def make_arch_model(directory: Path, arch: str, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random ``arch`` model (config, ``model.safetensors``, the tokenizer of ``tokenizer_dir``)
    to ``directory``; return it. Seeded: the same call writes the same weights."""
    import json

    from transformers import AutoModelForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = arch_config(arch, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers zeroes some biases and sets norms to one: give every tensor values
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
