"""GGUF tokenizer: a Hugging Face byte-level BPE tokenizer converted as llama.cpp's ``_set_vocab_gpt2`` does.

Token list padded with ``[PADi]``, token types, merges, special ids, chat template, and the
pre-tokenizer named by llama.cpp's hash of its check text; other tokenizers are refused. (A model qkit
converted from a GGUF gets that file's ``tokenizer.*`` fields instead: ``metadata.copy_fields``.)
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import gguf

from qkit.errors import ExportError, ModelLoadError
from qkit.jsonfields import BOOL, NULL, STRING, check, obj
from qkit.models import read_tokenizer_config

# What qkit reads of tokenizer.json (the tokenizers library's serialization), with its JSON types.
_TOKENIZER_JSON = obj({"model": obj({"type": STRING, "byte_fallback": BOOL | NULL}) | NULL,
                       "pre_tokenizer": obj({"type": STRING, "use_regex": BOOL}) | NULL})

# llama.cpp's ``get_vocab_base_pre``: the pre-tokenizer is named by the sha256 of the token ids of this
# text (``convert_hf_to_gguf_update.py`` generates the table). The families qkit exports; a byte-level
# tokenizer whose only pre-tokenizer is GPT-2's regex is "gpt-2" whatever its hash (same split rule).
_CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
)
_PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3-70B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B (Qwen2 family)
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
}


def _looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def _is_gpt2_pretokenizer(tokenizer_json: dict) -> bool:
    pre, norm = tokenizer_json.get("pre_tokenizer") or {}, tokenizer_json.get("normalizer")
    return norm is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def hf_tokenizer(directory: Path, config: dict, arch: str, *, trust_remote_code: bool = False) -> dict:
    """llama.cpp's ``_set_vocab_gpt2`` for the byte-level BPE tokenizer in ``directory``.

    Returns ``{"pre", "tokens", "types", "special" (gguf.SpecialVocab), "add_space_prefix"}``; raises
    ``ExportError`` (one line) for a tokenizer llama.cpp would not convert this way.
    """
    directory = Path(directory)
    tj_path = directory / "tokenizer.json"
    if (directory / "tokenizer.model").is_file() or not tj_path.is_file():
        raise ExportError(
            f"--format gguf converts byte-level BPE tokenizers (tokenizer.json); {directory} has "
            f"{'a SentencePiece tokenizer.model' if (directory / 'tokenizer.model').is_file() else 'no tokenizer.json'}; "
            "export a model converted from a GGUF, or use --format qkit"
        )
    fix = "fix or re-download the tokenizer"
    try:
        tj = json.loads(tj_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"cannot read {tj_path} as JSON ({' '.join(str(exc).split())[:120]}); {fix}") from exc
    check(tj, _TOKENIZER_JSON, str(tj_path), fix=fix)
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            f"--format gguf converts byte-level BPE tokenizers; {directory}'s is "
            f"{model.get('type')}{' with byte fallback (SentencePiece-style)' if model.get('byte_fallback') else ''}; "
            "use --format qkit"
        )
    from transformers import AutoTokenizer  # heavy: only a tokenizer conversion needs it

    # Explicit: left unset, a tokenizer_config.json auto_map makes transformers ask on stdin to run its code.
    tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    vocab = tok.get_vocab()
    vocab_size = config.get("vocab_size") or len(vocab)
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"the tokenizer of {directory} has ids beyond the model's vocab_size {vocab_size}; fix the config")
    chkhsh = sha256(str(tok.encode(_CHKTXT)).encode()).hexdigest()
    pre = _PRE_BY_HASH.get(chkhsh) or ("gpt-2" if _is_gpt2_pretokenizer(tj) else None)
    if pre is None:
        raise ExportError(
            f"the BPE pre-tokenizer of {directory} is not one llama.cpp's converter recognizes (chkhsh {chkhsh[:16]}...); "
            "export a GGUF of this model from llama.cpp's convert_hf_to_gguf.py, or use --format qkit"
        )
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            # llama.cpp assumes CONTROL and USER_DEFINED tokens pre-normalized (get_vocab_base)
            if not decoder[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    add_space_prefix = read_tokenizer_config(directory).get("add_prefix_space") if arch == "llama" else None
    return {"pre": pre, "tokens": tokens, "types": types, "add_space_prefix": add_space_prefix,
            "special": gguf.SpecialVocab(directory, load_merges=True)}


def add_tokenizer(w, tokenizer: dict, arch: str, config: dict) -> None:
    """Write a converted tokenizer (``hf_tokenizer``'s result) into ``GGUFWriter`` ``w``, as the converter does."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    tokenizer["special"].add_to_gguf(w, quiet=True)
    if tokenizer["add_space_prefix"] is not None:
        w.add_add_space_prefix(tokenizer["add_space_prefix"])
    if arch == "llama" and config.get("vocab_size") == 49152:
        # LlamaModel.set_vocab: "Apply to granite small models only" (and SmolLM, same vocab size)
        w.add_add_bos_token(False)


__all__ = ["add_tokenizer", "hf_tokenizer"]
