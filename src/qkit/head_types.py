"""``--token-embedding-type`` and ``--output-tensor-type``: llama-quantize's two options over a recipe's file.

Layer 3, beside ``transform``. A llama.cpp recipe (``q4_k_m``) writes the whole file llama-quantize writes:
the block projections and ``token_embd`` / ``output`` (``Recipe.quantizes``), the latter at llama.cpp's
types (``schemes.recipes``: ``output`` and a tied ``token_embd`` Q8_0 where the width is not whole blocks of
the default type, else Q6_K; an untied ``token_embd`` the default type, with the width fallbacks). These
two options set them instead, as ``llama_tensor_get_type`` in ``src/llama-quant.cpp`` reads them:

* ``--token-embedding-type TYPE`` sets ``token_embd``, tied to the head or not;
* ``--output-tensor-type TYPE`` sets ``output``, and a tied ``token_embd`` where ``--token-embedding-type`` is
  not given (llama.cpp quantizes a tied embedding "with the quantization of the output tensor");
* ``TYPE`` is a ggml type qkit writes (``q8_0``, ``q6_k``, ...), written as given, with no width fallback:
  llama-quantize aborts on a width that is not whole blocks of it, qkit refuses it; or ``f32`` / ``f16`` /
  ``bf16``: the tensor kept unquantized, stored in that float type (``Heads.apply``'s ``kept``);
* they come before ``--tensor-type`` patterns for these tensors (llama.cpp returns them first).

Every refusal is one line, before any work: a word that is no such type, a scheme that is not a recipe (its
file keeps the embedding as it is), a plan (it sets every type), and, with the model's headers, a type whose
blocks do not fit the tensor's width, a tensor ``--exclude``/``--keep none`` keeps, and ``--output-tensor-type`` on
a model with no head at all. On a tied model with both options, ``--output-tensor-type`` sets nothing, as in
llama-quantize (so ``--token-embedding-type f32 --output-tensor-type f32`` keeps both wider on any model); a
note says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import gguf
import torch

from qkit.errors import InputError
from qkit.lists import shown
from qkit.schemes import Recipe, Scheme
from qkit.schemes.ggml import GGMLScheme, uses_importance
from qkit.schemes.recipes import tensor_category
from qkit.transform import ggml_scheme, ggml_type_names

# llama.cpp's ggml_type_name of the float types llama-quantize takes for these options
FLOAT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOKEN_EMBEDDING = "--token-embedding-type"
OUTPUT = "--output-tensor-type"
WHOLE_FILE = ("token_embd", "output")  # the categories a recipe quantizes beyond the block projections


def parse_type(word: str, option: str) -> Scheme | torch.dtype:
    """A ``TYPE`` word: the float dtype of ``f32``/``f16``/``bf16``, or the ``GGMLScheme`` of a ggml type (any
    case: ``q6_K``); ``InputError`` naming ``option`` for anything else."""
    key = str(word).strip().lower()
    if key in FLOAT_TYPES:
        return FLOAT_TYPES[key]
    try:
        return ggml_scheme(key, f"{option} {shown(word)}")
    except InputError:
        raise InputError(f"{option} {shown(word)}: not a type qkit writes for it (f32, f16, bf16, or a ggml type: "
                         f"{', '.join(ggml_type_names())})") from None


@dataclass(frozen=True)
class Heads:
    """The two options' words as given (lowercased), None where not given."""

    token_embedding: str | None = None
    output: str | None = None

    def __bool__(self) -> bool:
        return self.token_embedding is not None or self.output is not None

    @classmethod
    def parse(cls, token_embedding_type: str | None, output_tensor_type: str | None) -> Heads:
        """Each word checked (``parse_type``); an empty one refused."""
        words = {}
        for option, word in ((TOKEN_EMBEDDING, token_embedding_type), (OUTPUT, output_tensor_type)):
            if word is not None:
                if not str(word).strip():
                    raise InputError(f"{option} is empty; give a type, e.g. q8_0 or f16")
                parse_type(word, option)
                words[option] = str(word).strip().lower()
        return cls(words.get(TOKEN_EMBEDDING), words.get(OUTPUT))

    def check_scheme(self, default: Scheme) -> None:
        """Refuse the options beside a scheme that is not a llama.cpp recipe: its file quantizes the block
        projections only and keeps the embedding and head as they are."""
        if self and not isinstance(default, Recipe):
            option = TOKEN_EMBEDDING if self.token_embedding is not None else OUTPUT
            raise InputError(f"{option} sets a tensor's type in a llama.cpp recipe's whole file (q4_k_m, q3_k_m, ...); "
                             f"-s {default.name} quantizes the block projections only and keeps the embedding and head "
                             "as they are: drop it, or quantize them with --include/--keep")

    def record(self) -> dict[str, str]:
        """What the manifest's ``rules`` record of them (only those given)."""
        return {k: v for k, v in (("token_embedding_type", self.token_embedding), ("output_tensor_type", self.output))
                if v is not None}

    def apply(self, targets: Mapping[str, Scheme], shapes: Mapping[str, tuple[int, ...]],
              config: Mapping) -> tuple[dict[str, Scheme], dict[str, torch.dtype], list[str]]:
        """``(targets, kept, notes)``: ``targets`` with ``token_embd`` / ``output`` set by the options (module
        docstring), the tensors they keep unquantized, each with the float dtype it is stored in, and what the
        user should know (an option that sets nothing)."""
        out, kept, notes = dict(targets), {}, []
        tied = bool(config.get("tie_word_embeddings", False))
        if tied and self.token_embedding is not None and self.output is not None:
            notes.append(f"{OUTPUT} {self.output} sets no tensor: this model ties its output head to token_embd, whose "
                         f"type {TOKEN_EMBEDDING} {self.token_embedding} sets (as in llama-quantize)")
        for name, shape in shapes.items():
            cat = tensor_category(name)
            if len(shape) < 2 or cat not in WHOLE_FILE or (cat == "output" and tied):
                continue
            option, word = (TOKEN_EMBEDDING, self.token_embedding) if cat == "token_embd" else (OUTPUT, self.output)
            if cat == "token_embd" and word is None and tied:
                option, word = OUTPUT, self.output
            if word is None:
                continue
            if name not in targets:
                raise InputError(f"{option} {word} sets {name}, which --exclude/--keep none keeps as it is: drop one of them")
            chosen = parse_type(word, option)
            if isinstance(chosen, torch.dtype):
                out.pop(name)
                kept[name] = chosen
                continue
            block = gguf.GGML_QUANT_SIZES[chosen.ggml_type][0]  # type: ignore[attr-defined]
            if shape[-1] % block:
                raise InputError(f"{option} {word}: {name} is {shape[-1]} wide, not whole blocks of {block} (llama-quantize "
                                 "aborts on it); give a type of 32-blocks (q8_0, q5_0, q4_0) or f16")
            out[name] = chosen
        if self.output is not None and not tied and not any(tensor_category(n) == "output" for n in shapes):
            raise InputError(f"{OUTPUT} {self.output}: the model stores no output head to set")
        return out, kept, notes


def unweighted(targets: Mapping[str, Scheme], shapes: Mapping[str, tuple[int, ...]],
               weights: Mapping[str, torch.Tensor]) -> list[str]:
    """The targets outside the blocks (``token_embd``, ``output``) whose type reads an importance matrix but
    that the matrix has no entry for: quantized without weights, as llama-quantize quantizes them
    (llama-imatrix never collects ``token_embd``, and ``output`` only with ``--process-output``)."""
    out = []
    for name, scheme in targets.items():
        if name in weights or tensor_category(name) not in WHOLE_FILE:
            continue
        stored = scheme.resolve(tuple(shapes[name]), name)
        if isinstance(stored, GGMLScheme) and uses_importance(stored.ggml_type):
            out.append(name)
    return sorted(out)


__all__ = ["FLOAT_TYPES", "OUTPUT", "TOKEN_EMBEDDING", "WHOLE_FILE", "Heads", "parse_type", "unweighted"]
