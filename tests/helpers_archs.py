"""Tiny random models of the architectures llama.cpp's converter handles, for the GGUF-for-every-
architecture tests (issue: every architecture llama.cpp converts, and mixture-of-experts).

Each is built from its transformers config class with seeded weights, saved as safetensors, with the
default model's tokenizer (a byte-level BPE whose pre-tokenizer llama.cpp's converter recognizes; a BPE
tokenizer trained here would not be: the converter knows one by the hash of its tokens for a check text).
Hidden 256 and intermediate 512 keep every k-quant's 256 super-blocks whole; the MoE models have 4
experts, 2 per token.

``make_arch_model(directory, arch, tokenizer_dir)`` writes one and returns ``directory``; ``ARCHS`` lists
the twelve architectures the issue names. ``tokenizer_dir`` is the default model's directory, or one
``spm_tokenizer`` wrote: a SentencePiece tokenizer of ``SPM_VOCAB`` pieces trained here in milliseconds
(the vocabulary, and so the embeddings, 100x smaller), which the converter reads with the
``sentencepiece`` package for the architectures whose class tries it first.

With the default model's tokenizer, as llama.cpp's converter (llama-cpp-python 0.3.36) sees them:

* gemma2 cannot convert: its class reads only ``tokenizer.model`` (use ``spm_tokenizer``);
* qwen2 cannot convert: transformers 5 loads every ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``
  (its ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``), whose pre-tokenizer regex replaces the one in
  ``tokenizer.json``, so the check text's tokens hash to no tokenizer llama.cpp knows ("BPE pre-tokenizer
  was not recognized"): no tokenizer file changes that (use ``spm_tokenizer``, which its class tries first);
* phi3 gets ``"tokenizer_class": "GPT2Tokenizer"`` in its ``tokenizer_config.json``, as Phi-4 ships: the
  converter's Phi-3 class then reads the BPE tokenizer instead of requiring ``tokenizer.model``.
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model")
# model_type -> the tokenizer class its tokenizer_config.json names with a BPE tokenizer (see the docstring)
_TOKENIZER_CLASS = {"phi3": "GPT2Tokenizer"}
SPM_VOCAB = 512
_SPM_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # <s>, </s>, <unk>: SentencePiece's


def _spm_text() -> list[str]:
    """2,000 seeded sentences of made-up words (``random.Random(0)``: the same on every Python)."""
    import random

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ven", "dor", "al", "is", "em", "quo", "ba", "ti",
                 "er", "on", "ul", "sa"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize()
            + rng.choice([".", "?", "!", ", 42.", " (3.14)."]) for _ in range(2000)]


def spm_tokenizer(directory: Path) -> Path:
    """Train a SentencePiece BPE tokenizer (``SPM_VOCAB`` pieces, byte fallback, one thread: the same bytes
    every run) on ``_spm_text`` and write it as ``directory/tokenizer.model``; return ``directory``. Needs
    the ``sentencepiece`` package (the ``test`` extra); about 0.03 s."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_spm_text()), model_writer=model, vocab_size=SPM_VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
                                   minloglevel=2)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return directory


def arch_config(arch: str, vocab: int, *, tie: bool = False, **ids: int) -> Any:
    """The transformers config of a tiny ``arch`` model over ``vocab`` tokens (``tie``: one embedding for
    input and output; ``ids``: special token ids)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        arch, vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        tie_word_embeddings=tie, **_EXTRA[arch], **ids,
    )


def tokenizer_vocab(tokenizer_dir: Path) -> tuple[int, dict[str, int]]:
    """The vocabulary size a model with ``tokenizer_dir``'s tokenizer needs, and the special token ids its
    config gets (none for the default model's: the config's own)."""
    import json

    if (tokenizer_dir / "config.json").is_file():
        return json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"], {}
    return SPM_VOCAB, _SPM_IDS


def make_arch_model(directory: Path, arch: str, tokenizer_dir: Path, *, seed: int = 0, tie: bool = False) -> Path:
    """Write a tiny random ``arch`` model (config, ``model.safetensors``, the tokenizer of ``tokenizer_dir``)
    to ``directory``; return it. Seeded: the same call writes the same weights. ``tie``: the output shares
    the token embedding (half the bytes with the default model's 49,152-token vocabulary)."""
    from transformers import AutoModelForCausalLM

    vocab, ids = tokenizer_vocab(tokenizer_dir)
    config = arch_config(arch, vocab, tie=tie, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers zeroes some biases and sets norms to one: give every tensor values
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    copy_tokenizer(arch, tokenizer_dir, directory)
    return directory


def copy_tokenizer(arch: str, tokenizer_dir: Path, directory: Path) -> None:
    """The tokenizer files of ``tokenizer_dir`` into ``directory`` (phi3's BPE class named as Phi-4's)."""
    import json

    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    if arch in _TOKENIZER_CLASS and (tokenizer_dir / "config.json").is_file():
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": _TOKENIZER_CLASS[arch]}, indent=2))
