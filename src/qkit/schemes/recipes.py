"""Recipes: llama.cpp's file types (ftypes), which pick a block type per tensor (the ``Recipe`` protocol).

:class:`LlamaRecipe` is ``llama_tensor_get_type`` of ``src/llama-quant.cpp`` (commit in
``LLAMA_CPP_COMMIT``; ported whole, for every architecture, in ``qkit.schemes.llama_rules``, which this
recipe calls) for a dense (not mixture-of-experts) llama or qwen2 model, with llama-quantize's
default options (``--token-embedding-type`` / ``--output-tensor-type`` are ``qkit.head_types``). A
recipe's file holds what llama-quantize's does: the block projections and ``token_embd`` / ``output``
(``quantizes``). Per tensor, by its category (``tensor_get_category``; Hugging Face or GGUF names), layer
``i`` of ``n``, ``n_gqa = n_head // n_head_kv`` and the file type's default type ``D``:

* ``output`` (``lm_head``), and ``token_embd`` when tied to it: Q8_0 if the width is not a multiple of
  ``D``'s block, else Q6_K (Q8_0 stays Q8_0); MXFP4_MOE: Q8_0. An untied ``token_embd``: ``D``; TQ1_0 /
  TQ2_0: Q4_K.
* MXFP4_MOE: MXFP4 for a 3-D tensor of more than one expert (a mixture-of-experts model's ``_exps``,
  written through llama.cpp's converter: ``qkit.converted``), Q8_0 for every other tensor, so a dense
  llama/qwen2 model is Q8_0 throughout; none of the rules below applies.
* ``attn_v``: Q2_K: Q4_K if ``n_gqa >= 4`` else Q3_K; Q3_K_M: Q5_K for ``i < 2``, else Q4_K; Q3_K_L:
  Q5_K; IQ4_NL / IQ4_XS: Q5_K if ``n_gqa >= 4``; Q4_K_M / Q5_K_M: Q6_K where ``use_more_bits(i, n)``;
  Q4_K_S: Q5_K for ``i < 4``. Then llama.cpp's 70B type (llama with 80 layers and ``n_head !=
  n_head_kv``; qwen2 with 80 layers) turns Q3_K / Q4_K into Q5_K.
* ``ffn_down``: Q2_K: Q3_K; Q3_K_M: Q5_K for ``i < n/16``, else Q4_K; Q3_K_L: Q5_K; Q4_K_M / Q5_K_M:
  Q6_K where ``use_more_bits(i, n)``; IQ4_NL / IQ4_XS without an importance matrix: Q5_K for ``i < n/8``;
  Q4_K_S: Q5_K for ``i < n/8``.
* ``attn_output``: Q2_K: Q3_K; Q3_K_M: Q4_K; Q3_K_L: Q5_K.
* everything else (attn_q, attn_k, ffn_gate, ffn_up): ``D``.

Then the width fallback (``tensor_type_fallback``) for a width (ggml ``ne[0]``, the last dimension) that
is not whole blocks: Q2_K, Q3_K, TQ1_0, TQ2_0 -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0; IQ4_XS -> IQ4_NL;
F16 where even that does not fit (a width not a multiple of 32), which qkit refuses (``SchemeError``).
``resolve(shape, name)`` returns the scheme of the type actually written. Divisions are C's integer ones.

**Counters.** llama.cpp reads ``i`` and ``n`` from counters: ``n_attention_wv`` counts the file's attn_v
tensors and ``n_ffn_down = n_layer``; ``i_attention_wv`` / ``i_ffn_down`` step once per such tensor in
the order it assigns types, which is ``llama_model_loader``'s ``weights_map`` order (by the ``blk.N.``
number, then by name; ``--keep-split`` would change it). A dense llama/qwen2 model has exactly one attn_v
and one ffn_down in each layer, so ``i`` is the layer index in the name and ``n`` the layer count, which
is what qkit uses; it also makes a tensor's type independent of which other tensors qkit quantizes.

**Model facts** come from ``bind(config)`` (``num_hidden_layers``, ``tie_word_embeddings``,
``model_type``, ``num_attention_heads``, ``num_key_value_heads``); models whose rules qkit does not
implement are refused there (other architectures, mixture-of-experts). A fact a rule needs and the
recipe was not given is refused when that tensor is resolved. Whether an importance matrix is used
(``qs.has_imatrix``, read by the IQ4 rule): :meth:`LlamaRecipe.with_imatrix`; without it, none.

**Names.** The ftypes whose name is no block type's are registered as such (``q3_k_s`` ... ``q5_k_m``,
``iq2_m``, ``iq3_xs``, ``iq3_m``); ``mxfp4_moe`` for MXFP4_MOE; the others as ``q2_k-llama``,
``iq1_s-llama``, ``iq1_m-llama``, ``iq2_xxs-llama``, ``iq2_xs-llama``, ``iq2_s-llama``, ``iq3_xxs-llama``, ``iq3_s-llama``, ``iq4_nl-llama``,
``iq4_xs-llama``, ``tq1_0-llama``, ``tq2_0-llama`` (``q2_k``, ``iq1_s``, ..., ``tq2_0`` are the uniform types;
llama.cpp's IQ2_S file type is mostly IQ2_XS and its IQ2_M mostly IQ2_S). The IQ1, IQ2 and IQ3_XXS file types'
own rules (Q5_K output, Q2_K / IQ3_S token_embd, attn_v, the first eighth of ffn_down, IQ2_S attn_q/k for
IQ3_XXS) are in the descriptions below; the bullet list above covers the others. Q6_K and Q8_0 are not registered: for every tensor of a dense llama/qwen2 model they
give what the uniform ``q6_k`` / ``q8_0`` give (the output rule yields the default type or its fallback,
and no other rule names them).

The block types are looked up in the registry when a tensor is resolved (by ggml type: ``q3_k`` for
Q3_K), so this module imports without them; a type not registered is refused then, and ``types``
lists the registered ones only.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gguf
import torch

from qkit.errors import SchemeError
from qkit.schemes.base import Layout, Scheme, as_2d
from qkit.schemes.kquants import LLAMA_CPP_COMMIT
from qkit.schemes.llama_rules import (
    ModelFacts,
    Params,
    block,
    counters_at,
    tensor_type_fallback,
    type_impl,
)
from qkit.schemes.registry import REGISTRY, register

T = gguf.GGMLQuantizationType


# llama-quant.cpp's tensor_get_category, for Hugging Face (llama/qwen2) and GGUF names. llama.cpp's
# category of a fused attn_qkv is attn_v-like (category_is_attn_v), and so is it here.
_CATEGORIES = (
    ("output", re.compile(r"^(lm_head|output)\.weight$")),
    ("token_embd", re.compile(r"^(model\.)?(embed_tokens|token_embd)\.weight$")),
    ("attn_v", re.compile(r"(^|\.)(self_attn\.(v_proj|qkv_proj)|attn_(v|qkv))\.weight$")),
    ("attn_k", re.compile(r"(^|\.)(self_attn\.k_proj|attn_k)\.weight$")),
    ("attn_q", re.compile(r"(^|\.)(self_attn\.q_proj|attn_q)\.weight$")),
    ("attn_output", re.compile(r"(^|\.)(self_attn\.o_proj|attn_output)\.weight$")),
    ("ffn_up", re.compile(r"(^|\.)(mlp\.up_proj|ffn_up)\.weight$")),
    ("ffn_gate", re.compile(r"(^|\.)(mlp\.gate_proj|ffn_gate)\.weight$")),
    ("ffn_down", re.compile(r"(^|\.)(mlp\.down_proj|ffn_down)\.weight$")),
)
_LAYER = re.compile(r"(^|\.)(layers|blk)\.(\d+)\.")


def tensor_category(name: str) -> str:
    """``output``, ``token_embd``, ``attn_q``/``_k``/``_v``/``_output``, ``ffn_gate``/``_up``/``_down``, or ``other``."""
    return next((cat for cat, pattern in _CATEGORIES if pattern.search(name)), "other")


# The ftypes implemented: llama_ftype_get_default_type.
DEFAULT_TYPES: dict[str, T] = {
    "Q2_K": T.Q2_K, "Q3_K_S": T.Q3_K, "Q3_K_M": T.Q3_K, "Q3_K_L": T.Q3_K, "IQ4_NL": T.IQ4_NL,
    "IQ4_XS": T.IQ4_XS, "Q4_K_S": T.Q4_K, "Q4_K_M": T.Q4_K, "Q5_K_S": T.Q5_K, "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K, "Q8_0": T.Q8_0, "TQ1_0": T.TQ1_0, "TQ2_0": T.TQ2_0, "MXFP4_MOE": T.MXFP4,
    # the i-quant ftypes; IQ2_S's default type is IQ2_XS and IQ2_M's IQ2_S (llama.cpp's names)
    "IQ1_S": T.IQ1_S, "IQ1_M": T.IQ1_M, "IQ2_XXS": T.IQ2_XXS, "IQ2_XS": T.IQ2_XS, "IQ2_S": T.IQ2_XS, "IQ2_M": T.IQ2_S, "IQ3_XXS": T.IQ3_XXS,
    "IQ3_XS": T.IQ3_S, "IQ3_S": T.IQ3_S, "IQ3_M": T.IQ3_S,
}
# The types each ftype writes for some tensor (category, layer, n_gqa, 70B or not, imatrix or not, tied or
# not, whole 256-blocks or only 32-blocks): the default first, then by ggml type number. The tests derive
# them again by running the rules over all of these.
WRITTEN = {
    "Q2_K": "Q2_K Q4_0 Q5_0 Q5_1 Q8_0 Q3_K Q4_K Q5_K Q6_K",
    "Q3_K_S": "Q3_K Q4_0 Q5_1 Q8_0 Q5_K Q6_K",
    "Q3_K_M": "Q3_K Q4_0 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K",
    "Q3_K_L": "Q3_K Q4_0 Q5_1 Q8_0 Q5_K Q6_K",
    "IQ4_NL": "IQ4_NL Q5_1 Q8_0 Q5_K Q6_K",
    "IQ4_XS": "IQ4_XS Q5_1 Q8_0 Q5_K Q6_K IQ4_NL",
    "Q4_K_S": "Q4_K Q5_0 Q5_1 Q8_0 Q5_K Q6_K",
    "Q4_K_M": "Q4_K Q5_0 Q5_1 Q8_0 Q5_K Q6_K",  # Q5_K, Q5_1: a 70B model's attn_v
    "Q5_K_S": "Q5_K Q5_1 Q8_0 Q6_K",
    "Q5_K_M": "Q5_K Q5_1 Q8_0 Q6_K",
    "Q6_K": "Q6_K Q8_0",
    "Q8_0": "Q8_0",
    "TQ1_0": "TQ1_0 Q4_0 Q5_0 Q8_0 Q4_K Q6_K",  # Q4_K: an untied token_embd
    "TQ2_0": "TQ2_0 Q4_0 Q5_0 Q8_0 Q4_K Q6_K",
    # MXFP4 only for a 3-D expert tensor (a mixture-of-experts model's, through llama.cpp's converter): a
    # dense llama/qwen2 model gets Q8_0 throughout
    "MXFP4_MOE": "MXFP4 Q8_0",
    "IQ1_S": "IQ1_S Q4_0 Q5_0 Q8_0 Q2_K Q4_K Q5_K IQ2_XXS IQ4_NL",
    "IQ1_M": "IQ1_M Q4_0 Q5_0 Q8_0 Q2_K Q4_K Q5_K IQ2_XXS IQ4_NL",
    "IQ2_XXS": "IQ2_XXS Q4_0 Q5_0 Q8_0 Q2_K Q4_K Q5_K IQ4_NL",
    "IQ2_XS": "IQ2_XS Q4_0 Q5_0 Q8_0 Q2_K Q4_K Q5_K IQ4_NL",
    "IQ2_S": "IQ2_XS Q5_0 Q8_0 Q4_K Q5_K IQ4_NL IQ3_S",
    "IQ2_M": "IQ2_S Q5_0 Q8_0 Q4_K Q5_K IQ4_NL IQ3_S",
    "IQ3_XXS": "IQ3_XXS Q4_0 Q5_0 Q5_1 Q8_0 Q3_K Q4_K Q5_K IQ4_NL IQ3_S IQ2_S",  # Q3_K, Q4_K: ffn_down without an imatrix
    "IQ3_XS": "IQ3_S Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K IQ3_XXS IQ4_NL",  # Q5_K, Q5_1: a 70B model's attn_v
    "IQ3_S": "IQ3_S Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K IQ4_NL",
    "IQ3_M": "IQ3_S Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K IQ4_NL",
}
_BITS = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8, T.IQ4_NL: 4, T.IQ4_XS: 4, T.TQ1_0: 2,
         T.TQ2_0: 2, T.MXFP4: 4, T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 2, T.IQ3_XXS: 3, T.IQ3_S: 3, T.IQ1_S: 1, T.IQ1_M: 1}
ARCHITECTURES = ("llama", "qwen2")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count(config: dict[str, Any]) -> int:
    """How many experts a model's ``config.json`` gives each mixture-of-experts layer (its largest count
    under transformers' names); 0 for a dense model. A malformed count raises ``ValueError``/``TypeError``."""
    return max(int(config.get(k) or 0) for k in _EXPERT_KEYS)


def scheme_for_type(t: T, name: str = "<tensor>") -> Scheme:
    """The registered scheme of llama.cpp type ``t`` (the one named like it: ``q5_0`` for Q5_0)."""
    s = REGISTRY.find(t.name.lower())
    if s is None or getattr(s, "ggml_type", None) != t:
        raise SchemeError(f"tensor {name}: llama.cpp writes it as {t.name}, which this qkit has no scheme for "
                          f"({t.name.lower()} is not registered)")
    return s


@dataclass(frozen=True)
class LlamaRecipe:
    """One llama.cpp file type: ``resolve(shape, name)`` is the scheme ``llama-quantize`` writes that
    tensor in (module docstring: the rules). Fields beyond ``name``, ``ftype`` and ``description`` are
    the model's facts, filled by ``bind(config)`` and ``with_imatrix(used)``."""

    name: str
    ftype: str  # llama.cpp's name, a key of DEFAULT_TYPES: "Q4_K_M"
    description: str = ""
    n_layers: int | None = None
    tied_embeddings: bool = False
    architecture: str | None = None  # Hugging Face model_type, one of ARCHITECTURES (None: not given)
    n_head: int | None = None
    n_head_kv: int | None = None
    imatrix: bool = False  # llama.cpp's qs.has_imatrix
    kind = "ggml"
    scale_dtype = torch.float16
    fixed_scale_dtype = True
    parts = ("qweight", "scales")

    @property
    def ggml_type(self) -> T:
        """The file type's default tensor type (``llama_ftype_get_default_type``)."""
        return DEFAULT_TYPES[self.ftype]

    @property
    def bits(self) -> int:
        return _BITS[self.ggml_type]

    @property
    def llama_ftype(self) -> gguf.LlamaFileType:
        """``general.file_type`` of the file llama-quantize writes."""
        return gguf.LlamaFileType[f"MOSTLY_{self.ftype}"]

    @property
    def ggml_types(self) -> tuple[T, ...]:
        """Every type this file type writes for some tensor of some dense llama/qwen2 model (``WRITTEN``)."""
        return tuple(T[n] for n in WRITTEN[self.ftype].split())

    @property
    def types(self) -> tuple[Scheme, ...]:
        """The registered schemes of ``ggml_types`` (``Recipe`` protocol); one not registered yet is left out."""
        return tuple(s for t in self.ggml_types if (s := REGISTRY.find(t.name.lower())) is not None)

    # ----------------------------------------------------------------- the facts a rule reads

    def _need(self, name: str, what: str, rule: str) -> SchemeError:
        return SchemeError(f"tensor {name}: {self.name} needs the model's {what} to choose this tensor's type "
                           f"(llama.cpp's {rule}); bind it to the model's config with scheme.bind(config)")

    def _layer(self, name: str) -> int:
        if self.n_layers is None:
            raise self._need(name, "layer count", "use_more_bits and layer rules")
        m = _LAYER.search(name)
        if m is None or not 0 <= int(m.group(3)) < self.n_layers:
            raise SchemeError(f"tensor {name}: no layer index below {self.n_layers} in its name; {self.name} cannot place it")
        return int(m.group(3))

    def _gqa(self, name: str) -> int:
        if self.n_head is None:
            raise self._need(name, "attention head counts (num_attention_heads, num_key_value_heads)", "n_gqa() >= 4 rule")
        kv = self.n_head if self.n_head_kv is None else self.n_head_kv
        return self.n_head // kv if kv else 0  # llama_hparams::n_gqa

    def _is_70b(self, name: str) -> bool:
        """llama.cpp's LLM_TYPE_70B (load_arch_hparams): llama with 80 layers and grouped-query attention, qwen2 with 80."""
        if self.n_layers != 80:
            return False
        if self.architecture is None or (self.architecture == "llama" and self.n_head is None):
            raise self._need(name, "model_type and head counts", "70B type of an 80-layer model")
        return self.architecture == "qwen2" or self.n_head != (self.n_head if self.n_head_kv is None else self.n_head_kv)

    # ----------------------------------------------------------------- the rules

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether this file type quantizes ``name`` beyond the block projections: llama-quantize's
        ``token_embd`` and ``output`` (2-D), which ``transform.Rules`` then targets too."""
        return len(shape) >= 2 and tensor_category(name) in ("token_embd", "output")

    def ggml_type_for(self, shape: tuple[int, ...], name: str) -> T:
        """The type ``llama_tensor_get_type_impl`` gives ``name``, before the width fallback: the rules of
        ``qkit.schemes.llama_rules`` with the counters standing at this tensor's layer (``counters_at``:
        one attn_v and one of each ffn tensor per layer in a dense llama/qwen2 model)."""
        cols = shape[-1] if shape else 1
        cat = tensor_category(name)
        by_layer = ("attn_v", "ffn_down") + (("ffn_gate", "ffn_up") if self.ftype == "IQ3_XS" else ())  # IQ3_XS's middle layers
        i = self._layer(name) if cat in by_layer else 0
        if cat == "attn_v" and self.ftype in ("Q2_K", "IQ4_NL", "IQ4_XS"):
            self._gqa(name)  # refuses a recipe not given the head counts these rules read
        if cat == "attn_v":
            self._is_70b(name)  # refuses an 80-layer model whose type is not known
        counters = counters_at(i, self.n_layers or 0)
        counters.has_tied_embeddings = self.tied_embeddings
        facts = ModelFacts(self.architecture or "", self.n_layers or 1, 0, self.n_head or 0, self.n_head_kv)
        return type_impl(counters, self.ggml_type, name, (cols,), facts, Params(self.llama_ftype, imatrix=self.imatrix), cat)

    def llama_type(self, shape: tuple[int, ...], name: str) -> T:
        """The type llama.cpp writes ``name`` in: :meth:`ggml_type_for`, then the width fallback (F16
        included). Refuses a 1-D tensor, which llama.cpp does not quantize."""
        shape = tuple(shape)
        if len(shape) < 2:
            raise SchemeError(f"tensor {name}: llama.cpp quantizes only tensors of 2 or more dimensions and keeps "
                              f"this {len(shape)}-D one as it is; exclude it from quantization")
        return tensor_type_fallback(self.ggml_type_for(shape, name), shape[-1])

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> Scheme:
        shape = tuple(shape)
        t = self.llama_type(shape, name)
        if t == T.F16:
            raise SchemeError(
                f"tensor {name}: width {shape[-1]} is not a multiple of 32, which every llama.cpp block type needs "
                f"({self.name} gives it {self.ggml_type_for(shape, name).name}; llama.cpp would keep this one as F16); "
                "exclude it from quantization (qkit quantize --exclude)"
            )
        return scheme_for_type(t, name).resolve(shape, name)

    # ----------------------------------------------------------------- the Scheme protocol

    def nbytes_for(self, shape: tuple[int, ...], name: str | None = None) -> int:
        """Bytes stored for ``name`` (its resolved type); without a name, those of a plain default-type tensor."""
        return self.resolve(tuple(shape), name or "<tensor>").nbytes_for(tuple(shape))

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A tensor without a name gets the default type (``quantize_tensor`` resolves by name first)."""
        return self.resolve(tuple(w.shape)).encode(w)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode by the bytes per row where exactly one of the recipe's types has that size; refused where
        several do (q4_k and q4_0 both store 0.5625 bytes per weight): decode with the tensor's own scheme,
        which its manifest entry names (``quantize_tensor``'s result holds it)."""
        rows, cols = as_2d(tuple(shape))
        per_row = parts["qweight"].reshape(rows, -1).shape[1]
        fits = [t for t in self.ggml_types if cols % block(t) == 0
                and per_row == cols // block(t) * gguf.GGML_QUANT_SIZES[t][1]]
        if len(fits) != 1:
            which = " or ".join(t.name for t in fits) or "none of its types"
            raise SchemeError(f"{self.name}: {per_row} bytes per row of width {cols} fit {which}; decode the tensor with "
                              "the scheme its entry names (each tensor's manifest entry names its type)")
        return scheme_for_type(fits[0]).decode(parts, shape, dtype)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """A recipe stores no parts of its own: each tensor's manifest entry names the type it got."""
        types = ", ".join(t.name.lower() for t in self.ggml_types)
        raise SchemeError(f"{self.name} is a recipe, not a stored type; a tensor's entry names the type it got ({types})")

    def bind(self, model_config: dict[str, Any]) -> LlamaRecipe:
        """This recipe with the model's facts from its ``config.json``. Refuses, in one line, a model whose
        rules qkit does not implement: a ``model_type`` other than llama / qwen2, mixture-of-experts, and
        an 80-layer model whose architecture or head counts are not given (llama.cpp's 70B type)."""
        plain = self.ggml_type.name.lower()
        try:
            n_layers = int(model_config["num_hidden_layers"])
            heads = model_config.get("num_attention_heads")
            heads = None if heads is None else int(heads)
            kv = model_config.get("num_key_value_heads")
            kv = heads if kv is None else int(kv)
            experts = expert_count(model_config)
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemeError(f"{self.name} needs num_hidden_layers (and integer head counts) in the model config ({exc})") from exc
        if n_layers < 1:
            raise SchemeError(f"{self.name}: num_hidden_layers is {n_layers}; a model has at least one layer")
        if experts > 1:
            raise SchemeError(f"{self.name}: mixture-of-experts models ({experts} experts) follow other llama.cpp rules; use {plain}")
        arch = model_config.get("model_type")
        if arch is not None and arch not in ARCHITECTURES:
            raise SchemeError(f"{self.name}: qkit implements llama.cpp's {self.ftype} rules for llama and qwen2 models, "
                              f"not model_type {arch!r}; use {plain}")
        if n_layers == 80 and (arch is None or (arch == "llama" and heads is None)):
            raise SchemeError(f"{self.name}: an 80-layer model may be llama.cpp's 70B type, whose attn_v gets more bits; "
                              "its config needs model_type and num_attention_heads to tell")
        return dataclasses.replace(self, n_layers=n_layers, tied_embeddings=bool(model_config.get("tie_word_embeddings", False)),
                                   architecture=arch, n_head=heads, n_head_kv=kv)

    def with_imatrix(self, used: bool) -> LlamaRecipe:
        """This recipe for a quantization with (``used``) or without an importance matrix (``qs.has_imatrix``)."""
        return dataclasses.replace(self, imatrix=bool(used))

    def to_dict(self) -> dict[str, Any]:
        """The registered recipe's fields (what ``scheme_from_dict`` checks), then, when bound, the facts
        its choices read (recorded, not checked: each tensor's entry holds the type it got, which is what
        decoding needs): ``n_layers``, ``tied_embeddings``; ``n_gqa`` for Q2_K / IQ4_*; ``imatrix`` for
        IQ4_*; ``llama_70b`` for an 80-layer model. (Only those, so a q4_k_m manifest of another model
        reads as it did before the other ftypes came.)"""
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ggml_type": self.ggml_type.name,
            "recipe": f"LLAMA_FTYPE_MOSTLY_{self.ftype}",
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
        }
        if self.n_layers is not None:
            d.update(n_layers=self.n_layers, tied_embeddings=self.tied_embeddings)
            if self.ftype in ("Q2_K", "IQ4_NL", "IQ4_XS") and self.n_head is not None:
                d["n_gqa"] = self._gqa(self.name)
            if self.ftype in ("IQ4_NL", "IQ4_XS"):
                d["imatrix"] = self.imatrix
            if self.n_layers == 80 and self.architecture is not None:
                d["llama_70b"] = self._is_70b(self.name)
        return d


def Q4KMRecipe(**facts: Any) -> LlamaRecipe:
    """The former ``Q4KMRecipe`` class: the ``q4_k_m`` recipe with ``facts`` (``n_layers=...``) filled in."""
    return dataclasses.replace(Q4_K_M, **facts)


def assignment(recipe: Scheme, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, Scheme]:
    """``{name: the scheme quantize_tensor writes it in}`` (``recipe.resolve``) for ``(name, shape)``
    pairs, in their order; ``SchemeError`` for a tensor the recipe refuses. Bind the recipe first."""
    return {name: recipe.resolve(tuple(shape), name) for name, shape in shapes}


def type_counts(assigned: dict[str, Scheme]) -> dict[str, int]:
    """How many tensors got each scheme name, most first (then by name)."""
    counts = Counter(s.name for s in assigned.values())
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def llama_types(recipe: LlamaRecipe, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, T]:
    """``{name: llama.cpp type}`` for the tensors of 2 or more dimensions (``llama_type``, F16 included);
    1-D tensors, which llama.cpp copies unchanged, are left out."""
    return {name: recipe.llama_type(tuple(shape), name) for name, shape in shapes if len(shape) >= 2}


_IQ2_COMMON = ("Q2_K for attn_v (Q4_K at 4+ query heads per KV head), the first eighth of ffn_down and an untied "
               "token_embd, Q5_K for the output; needs an imatrix; with the width fallbacks")
_IQ2_SM_COMMON = ("IQ3_S for attn_v (Q4_K at 4+ query heads per KV head), attn_output, the first eighth of ffn_down and "
                  "an untied token_embd, Q5_K for the output; needs an imatrix; with the width fallbacks")
_IQ1_COMMON = ("IQ2_XXS for attn_output, Q2_K for attn_v (Q4_K at 4+ query heads per KV head), the first eighth of "
               "ffn_down and an untied token_embd, Q5_K for the output; needs an imatrix; with the width fallbacks")
_RECIPES = (
    ("iq1_s-llama", "IQ1_S", "llama.cpp's IQ1_S file type: IQ1_S, with " + _IQ1_COMMON),
    ("iq1_m-llama", "IQ1_M", "llama.cpp's IQ1_M file type: IQ1_M, with " + _IQ1_COMMON),
    ("iq2_xxs-llama", "IQ2_XXS", "llama.cpp's IQ2_XXS file type: IQ2_XXS, with " + _IQ2_COMMON),
    ("iq2_xs-llama", "IQ2_XS", "llama.cpp's IQ2_XS file type: IQ2_XS, with " + _IQ2_COMMON),
    ("iq2_s-llama", "IQ2_S", "llama.cpp's IQ2_S file type: IQ2_XS, with " + _IQ2_SM_COMMON),
    ("iq2_m", "IQ2_M", "llama.cpp's IQ2_M file type: IQ2_S, with " + _IQ2_SM_COMMON),
    ("q2_k-llama", "Q2_K", (
        "llama.cpp's Q2_K file type: Q2_K, with Q3_K for attn_v (Q4_K at 4+ query heads per KV head), "
        "ffn_down and attn_output, Q6_K for the output; with the width fallbacks"
    )),
    ("iq3_xxs-llama", "IQ3_XXS", (
        "llama.cpp's IQ3_XXS file type: IQ3_XXS, with IQ2_S for attn_q and attn_k, IQ3_S for attn_output and an "
        "untied token_embd, attn_v Q4_K at 4+ query heads per KV head (else IQ3_XXS with an imatrix, IQ3_S without), "
        "ffn_down Q4_K/Q3_K without an imatrix, Q5_K for the output; needs an imatrix; with the width fallbacks"
    )),
    ("iq3_xs", "IQ3_XS", (
        "llama.cpp's IQ3_XS file type: IQ3_S, with IQ3_XXS for attn_q, attn_k and the middle three quarters of "
        "ffn_gate/ffn_up, Q4_K for attn_v at 4+ query heads per KV head, Q6_K for the output; with the width fallbacks"
    )),
    ("iq3_s-llama", "IQ3_S", (
        "llama.cpp's IQ3_S file type: IQ3_S, with Q4_K for attn_v at 4+ query heads per KV head, Q6_K for the "
        "output; with the width fallbacks"
    )),
    ("iq3_m", "IQ3_M", (
        "llama.cpp's IQ3_M file type: IQ3_S, with Q4_K for attn_v, attn_output and the first eighth of ffn_down, "
        "Q6_K for the output; with the width fallbacks"
    )),
    ("q3_k_s", "Q3_K_S", (
        "llama.cpp's Q3_K_S recipe: Q3_K, Q6_K for the output; with the width fallbacks"
    )),
    ("q3_k_m", "Q3_K_M", (
        "llama.cpp's Q3_K_M recipe: Q3_K, with Q5_K/Q4_K for attn_v and ffn_down by layer and Q4_K "
        "for attn_output; with the width fallbacks"
    )),
    ("q3_k_l", "Q3_K_L", (
        "llama.cpp's Q3_K_L recipe: Q3_K, with Q5_K for attn_v, ffn_down and attn_output; with the "
        "width fallbacks"
    )),
    ("iq4_nl-llama", "IQ4_NL", (
        "llama.cpp's IQ4_NL file type: IQ4_NL, with Q5_K for the first eighth of ffn_down "
        "(without an imatrix) and attn_v at 4+ query heads per KV head, Q6_K for the output"
    )),
    ("iq4_xs-llama", "IQ4_XS", (
        "llama.cpp's IQ4_XS file type: IQ4_XS, with Q5_K for the first eighth of ffn_down "
        "(without an imatrix) and attn_v at 4+ query heads per KV head, Q6_K for the output; with the width fallbacks"
    )),
    ("q4_k_s", "Q4_K_S", (
        "llama.cpp's Q4_K_S recipe: Q4_K, with Q5_K for the first four attn_v and the first eighth "
        "of ffn_down; with the width fallbacks"
    )),
    ("q4_k_m", "Q4_K_M", (
        "llama.cpp's Q4_K_M recipe: Q6_K for attn_v and ffn_down in some layers, Q4_K elsewhere, "
        "with the width fallbacks"
    )),
    ("q5_k_s", "Q5_K_S", (
        "llama.cpp's Q5_K_S recipe: Q5_K, Q6_K for the output; with the width fallbacks"
    )),
    ("q5_k_m", "Q5_K_M", (
        "llama.cpp's Q5_K_M recipe: Q6_K for attn_v and ffn_down in some layers, Q5_K elsewhere, "
        "with the width fallbacks"
    )),
    ("tq1_0-llama", "TQ1_0", (
        "llama.cpp's TQ1_0 file type: TQ1_0, with Q4_K for an untied token_embd and Q6_K for the output; "
        "with the width fallbacks"
    )),
    ("tq2_0-llama", "TQ2_0", (
        "llama.cpp's TQ2_0 file type: TQ2_0, with Q4_K for an untied token_embd and Q6_K for the output; "
        "with the width fallbacks"
    )),
    ("mxfp4_moe", "MXFP4_MOE", (
        "llama.cpp's MXFP4_MOE file type (made for gpt-oss): MXFP4 for the mixture-of-experts tensors, "
        "Q8_0 for every other one"
    )),
)
RECIPES: dict[str, LlamaRecipe] = {n: register(LlamaRecipe(n, f, d)) for n, f, d in _RECIPES}
Q4_K_M = RECIPES["q4_k_m"]

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_TYPES",
    "Q4_K_M",
    "RECIPES",
    "WRITTEN",
    "LlamaRecipe",
    "expert_count",
    "Q4KMRecipe",
    "assignment",
    "llama_types",
    "scheme_for_type",
    "tensor_category",
    "type_counts",
]
