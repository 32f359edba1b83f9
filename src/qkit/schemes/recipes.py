"""Recipes: llama.cpp's mixtures of block types, chosen per tensor (the ``Recipe`` protocol).

**q4_k_m** is llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` (``llama_tensor_get_type_impl``, then the width
fallback of ``qkit.schemes.kquants``), for a dense (not mixture-of-experts) llama/qwen2-family model; see :class:`Q4KMRecipe`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes.base import Layout, as_2d
from qkit.schemes.ggml import Q5_0, Q8_0, GGMLScheme, T
from qkit.schemes.kquants import LLAMA_CPP_COMMIT, Q4_K, Q6_K, QK_K
from qkit.schemes.registry import register


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's ``use_more_bits`` (C integer division): the first and last eighth of the layers
    and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# Tensor categories of llama-quant.cpp's ``tensor_get_category``, for Hugging Face and GGUF names.
_ATTN_V = re.compile(r"(^|\.)(self_attn\.(v_proj|qkv_proj|kv_b_proj)|attn_(v|qkv|kv_b))\.weight$")
_FFN_DOWN = re.compile(r"(^|\.)(mlp\.down_proj|ffn_down)\.weight$")
_OUTPUT = re.compile(r"^(lm_head|output)\.weight$")
_TOKEN_EMBD = re.compile(r"^(model\.)?(embed_tokens|token_embd)\.weight$")
_LAYER = re.compile(r"(^|\.)(layers|blk)\.(\d+)\.")


@dataclass(frozen=True)
class Q4KMRecipe:
    """llama.cpp's Q4_K_M mixture (``LLAMA_FTYPE_MOSTLY_Q4_K_M``), per tensor, in ``resolve(shape, name)``.

    From ``llama_tensor_get_type_impl`` (llama-quant.cpp, commit in ``LLAMA_CPP_COMMIT``), for a dense
    model (``n_expert <= 1``) that is not llama.cpp's 70B type, default type Q4_K:

    * ``attn_v`` (``self_attn.v_proj``; also a fused ``qkv_proj``) and ``ffn_down`` (``mlp.down_proj``) of
      layer ``i`` get **Q6_K** where ``use_more_bits(i, n_layers)``: ``i < n/8 or i >= 7n/8 or
      (i - n/8) % 3 == 2`` (integer division; for 30 layers: 0-2, 5, 8, 11, 14, 17, 20, 23, 26-29);
      llama.cpp counts these tensors in its load order, which is by layer, so ``i`` is the layer index;
    * ``output`` (``lm_head``), and the token embedding when it is tied to the output, gets **Q6_K**, or
      **Q8_0** when its width is not a multiple of 256;
    * every other tensor (q, k, o, gate, up; an untied token embedding) gets **Q4_K**;
    * then the width fallback: Q4_K -> Q5_0 and Q6_K -> Q8_0 where the width is not a multiple of 256.

    qkit quantizes only the block projections by default (``qkit.transform``): llama.cpp's Q4_K_M file
    also quantizes ``token_embd`` (Q4_K, or like ``output`` when tied) and ``output`` (Q6_K), which qkit's
    row keeps in the original dtype unless the user includes them (``--include``).

    ``n_layers`` (the model's ``num_hidden_layers``) is needed for attn_v / ffn_down; a recipe without it
    refuses those tensors. ``bind(config)`` fills it (and ``tied_embeddings``) from a model's config.
    ``to_dict`` records them when bound; ``scheme_from_dict`` gives back the unbound recipe (each tensor's
    manifest entry holds the type it actually got, which is what decoding needs).
    """

    name: str = "q4_k_m"
    n_layers: int | None = None
    tied_embeddings: bool = False
    kind = "ggml"
    ggml_type = T.Q4_K  # the file type's default tensor type
    bits = 4
    scale_dtype = torch.float16
    fixed_scale_dtype = True
    parts = ("qweight", "scales")
    description = ("llama.cpp's Q4_K_M recipe: Q6_K for attn_v and ffn_down in some layers, Q4_K elsewhere, "
                   "with the width fallbacks")
    types = (Q4_K, Q6_K, Q5_0, Q8_0)  # what ``resolve`` gives a tensor (``Recipe`` protocol)

    def ggml_type_for(self, shape: tuple[int, ...], name: str) -> Any:
        """The llama.cpp type this recipe gives ``name`` before the width fallback."""
        cols = shape[-1] if shape else 1
        if _OUTPUT.search(name) or (self.tied_embeddings and _TOKEN_EMBD.search(name)):
            return T.Q8_0 if cols % QK_K else T.Q6_K
        if _ATTN_V.search(name) or _FFN_DOWN.search(name):
            m = _LAYER.search(name)
            if self.n_layers is None:
                raise SchemeError(
                    f"tensor {name}: {self.name} needs the model's layer count to choose this tensor's type "
                    "(llama.cpp's use_more_bits); bind it to the model's config with scheme.bind(config)"
                )
            if m is None or not 0 <= int(m.group(3)) < self.n_layers:
                raise SchemeError(f"tensor {name}: no layer index below {self.n_layers} in its name; {self.name} cannot place it")
            return T.Q6_K if use_more_bits(int(m.group(3)), self.n_layers) else T.Q4_K
        return T.Q4_K

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> GGMLScheme:
        t = self.ggml_type_for(tuple(shape), name)
        return {T.Q4_K: Q4_K, T.Q6_K: Q6_K, T.Q8_0: Q8_0}[t].resolve(tuple(shape), name)

    def nbytes_for(self, shape: tuple[int, ...], name: str | None = None) -> int:
        """Bytes stored for ``name`` (its resolved type); without a name, those of a plain Q4_K tensor."""
        return self.resolve(tuple(shape), name or "<tensor>").nbytes_for(tuple(shape))

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A tensor without a name gets the default type (``quantize_tensor`` resolves by name first)."""
        return self.resolve(tuple(w.shape)).encode(w)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode by the bytes per row, which tell the four types this recipe writes apart."""
        rows, cols = as_2d(tuple(shape))
        per_row = parts["qweight"].reshape(rows, -1).shape[1]
        for s in self.types:
            if cols % s.block_size == 0 and per_row == cols // s.block_size * s.type_size:
                return s.decode(parts, shape, dtype)
        raise SchemeError(f"{self.name}: {per_row} bytes per row of width {cols} match none of its types")

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """A recipe stores no parts of its own: each tensor's manifest entry names the type it got."""
        types = ", ".join(t.name for t in self.types)
        raise SchemeError(f"{self.name} is a recipe, not a stored type; a tensor's entry names the type it got ({types})")

    def bind(self, model_config: dict[str, Any]) -> Q4KMRecipe:
        """This recipe with ``n_layers`` and ``tied_embeddings`` from the model's ``config.json``. Refuses
        models it does not cover here: mixture-of-experts (llama.cpp's rules differ) and llama.cpp's 70B
        type (llama with 80 layers and grouped-query attention, qwen2 with 80 layers), whose attn_v would
        need Q5_K."""
        try:
            n_layers = int(model_config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemeError(f"{self.name} needs num_hidden_layers in the model config ({exc})") from exc
        experts = max(int(model_config.get(k) or 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        if experts > 1:
            raise SchemeError(f"{self.name}: mixture-of-experts models ({experts} experts) follow other llama.cpp rules; use q4_k")
        arch = str(model_config.get("model_type", ""))
        heads = model_config.get("num_attention_heads")
        kv = model_config.get("num_key_value_heads", heads)
        if n_layers == 80 and (arch == "qwen2" or (arch == "llama" and heads != kv)):
            raise SchemeError(f"{self.name}: llama.cpp gives this 70B-type model's attn_v Q5_K, which qkit does not implement; use q4_k")
        return dataclasses.replace(self, n_layers=n_layers, tied_embeddings=bool(model_config.get("tie_word_embeddings", False)))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ggml_type": self.ggml_type.name,
            "recipe": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
        }
        if self.n_layers is not None:
            d["n_layers"] = self.n_layers
            d["tied_embeddings"] = self.tied_embeddings
        return d


Q4_K_M = register(Q4KMRecipe())
