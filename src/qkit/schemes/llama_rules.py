"""llama-quantize's choice of each tensor's type, for every architecture: ``src/llama-quant.cpp`` (commit
``LLAMA_CPP_COMMIT``) as a pure function of GGUF tensor names, shapes and the model's facts.

The port, function for function (C names in brackets):

* :func:`category` (``tensor_get_category``): ``output``, ``token_embd`` (and ``per_layer_token_embd``),
  then by substring ``attn_qkv``, ``attn_kv_b``, ``attn_v``, ``attn_k``, ``attn_q``, ``attn_output``
  (each ``.weight``), ``ffn_up``, ``ffn_gate``, ``ffn_down`` (any suffix: ``ffn_down_exps``,
  ``ffn_up_shexp``), else ``other``. ``attn_qkv`` and ``attn_kv_b`` follow the attn_v rules
  (``category_is_attn_v``).
* :func:`allows_quantization` (``tensor_allows_quantization``): 2-D and 3-D (expert) tensors whose name
  ends in ``weight``, except norms, ``ffn_gate_inp`` (the router), position embeddings and token types,
  and the small tensors the source lists (conv1d, RWKV's, altup, ...).
* :func:`type_impl` (``llama_tensor_get_type_impl``): the mixture's rules by category, ftype, layer and
  the model's facts (``n_gqa``, ``n_expert`` (== 8, >= 4, > 1), the 70B type, falcon), with the counters.
* :func:`tensor_type` (``llama_tensor_get_type``): ``--token-embedding-type`` / ``--output-tensor-type``
  first, then ``--tensor-type`` patterns, the rules unless ``--pure``, and :func:`tensor_type_fallback`
  for a row width (ggml ``ne[0]``) that is not whole blocks.
* :func:`tensor_types` (``llama_model_quantize_impl``'s preliminary loop, with
  ``init_quantize_state_counters``): every tensor of a file, in llama.cpp's order (:func:`llama_order`,
  the loader's ``weights_map``: by ``blk.N.`` number, then by name).

**Counters.** ``n_attention_wv`` counts the file's attn_v-like tensors by name (quantized or not);
``n_ffn_down = n_ffn_gate = n_ffn_up = n_layer_all`` (``block_count``). ``i_attention_wv`` steps each time
the rules see an attn_v-like tensor, ``i_ffn_*`` each time they see that category; for a model with more
than one expert the ffn rules read the layer from the name instead (the experts are not consecutive in
Mixtral). So a dense model's ``i`` is its layer index only where each layer holds exactly one such tensor.

**Model facts** (:class:`ModelFacts`) come from the GGUF's metadata: ``general.architecture``,
``{arch}.block_count``, ``{arch}.expert_count``, ``{arch}.attention.head_count`` / ``head_count_kv``
(layer 0 of a per-layer array), ``{arch}.nextn_predict_layers``; llama.cpp's 70B type is read as each
architecture's ``load_arch_hparams`` sets it (llama: 80 layers, not 8 experts, ``n_head != n_head_kv``;
qwen2, olmo, deci: 80 layers; jais2: 68).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import gguf

from qkit.errors import SchemeError

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

# llama_ftype_get_default_type (Q2_0's ftype and type are newer than the gguf package's enums)
DEFAULT_TYPE: dict[F, T] = {
    F.MOSTLY_Q4_0: T.Q4_0, F.MOSTLY_Q4_1: T.Q4_1, F.MOSTLY_Q5_0: T.Q5_0, F.MOSTLY_Q5_1: T.Q5_1, F.MOSTLY_Q8_0: T.Q8_0,
    F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16, F.ALL_F32: T.F32, F.MOSTLY_Q1_0: T.Q1_0, F.MOSTLY_MXFP4_MOE: T.MXFP4,
    F.MOSTLY_Q2_K_S: T.Q2_K, F.MOSTLY_Q2_K: T.Q2_K, F.MOSTLY_IQ3_XS: T.IQ3_S, F.MOSTLY_Q3_K_S: T.Q3_K,
    F.MOSTLY_Q3_K_M: T.Q3_K, F.MOSTLY_Q3_K_L: T.Q3_K, F.MOSTLY_Q4_K_S: T.Q4_K, F.MOSTLY_Q4_K_M: T.Q4_K,
    F.MOSTLY_Q5_K_S: T.Q5_K, F.MOSTLY_Q5_K_M: T.Q5_K, F.MOSTLY_Q6_K: T.Q6_K, F.MOSTLY_TQ1_0: T.TQ1_0,
    F.MOSTLY_TQ2_0: T.TQ2_0, F.MOSTLY_IQ2_XXS: T.IQ2_XXS, F.MOSTLY_IQ2_XS: T.IQ2_XS, F.MOSTLY_IQ2_S: T.IQ2_XS,
    F.MOSTLY_IQ2_M: T.IQ2_S, F.MOSTLY_IQ3_XXS: T.IQ3_XXS, F.MOSTLY_IQ1_S: T.IQ1_S, F.MOSTLY_IQ1_M: T.IQ1_M,
    F.MOSTLY_IQ4_NL: T.IQ4_NL, F.MOSTLY_IQ4_XS: T.IQ4_XS, F.MOSTLY_IQ3_S: T.IQ3_S, F.MOSTLY_IQ3_M: T.IQ3_S,
}
_FLOATS = (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64)
# tensor_type_fallback's table: 256-blocks on the left, the 32-block type on the right
_FALLBACK = {T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL,
             T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0,
             T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_IQ2_FTYPES = (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M)
_S_OR_M = (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
# attn_output of an 8-expert model: the ftypes that give it Q5_K
_MOE8_ATTN_OUTPUT = (F.MOSTLY_Q2_K, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_IQ4_NL,
                     F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M, F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M, F.MOSTLY_IQ4_XS)
# the 70B type: llama.cpp's architecture name -> the layer count (models/{qwen2,olmo,deci,jais2,llama}.cpp)
_70B_LAYERS = {"qwen2": 80, "olmo": 80, "deci": 80, "jais2": 68, "llama": 80}
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")


def is_quantized(t: T) -> bool:
    """``ggml_is_quantized``: a block type (not a float or integer type)."""
    return t not in _FLOATS


def block(t: T) -> int:
    """``ggml_blck_size``: values per block."""
    return gguf.GGML_QUANT_SIZES[t][0]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's ``use_more_bits`` (C integer division): the first and last eighth of the layers
    and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type_fallback(t: T, cols: int) -> T:
    """``tensor_type_fallback``: the type written for a row width ``cols`` (F16 where no block type fits)."""
    if cols % block(t) == 0:
        return t
    if t in _FALLBACK:
        out = _FALLBACK[t]
    elif block(t) <= 32:
        out = t  # a 32-block type has no smaller block: F16 below
    else:
        raise SchemeError(f"llama.cpp defines no width fallback for {t.name}")
    return out if cols % block(out) == 0 else T.F16


def category(name: str) -> str:
    """``tensor_get_category`` over a GGUF name (module docstring)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat in ("attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q", "attn_output"):
        if cat + ".weight" in name:
            return cat
    return next((cat for cat in ("ffn_up", "ffn_gate", "ffn_down") if cat in name), "other")


# tensor_allows_quantization's names: substrings that keep a tensor as it is, and the glm5-next ones
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
         "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
         *(f"time_mix_{s}.weight" for s in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2",
                                             "decay_w1", "decay_w2", "lerp_fused")),
         "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
         ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_KEPT_GLM5_NEXT = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
                   "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
                   "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")
_NPOS = 2**64 - 1


def n_dims(ne: Sequence[int]) -> int:
    """``ggml_n_dims``: the dimensions up to the last one above 1 (at least 1); ``ne`` fastest first."""
    big = [i for i, n in enumerate(ne) if n > 1]
    return big[-1] + 1 if big else 1


def allows_quantization(name: str, ne: Sequence[int], arch: str, *, quantize_output_tensor: bool = True,
                        only_copy: bool = False) -> bool:
    """``tensor_allows_quantization``: whether llama-quantize may change this tensor's type (``ne`` fastest
    dimension first, as ggml; a 1-D tensor, a norm, the router, ... keep theirs)."""
    if only_copy or n_dims(ne) < 2:
        return False
    # name.rfind("weight") == name.size() - 6 in size_t arithmetic: also true for a 5-character name without it
    pos = name.rfind("weight")
    if (pos if pos >= 0 else _NPOS) != (len(name) - 6) % 2**64:
        return False
    if not quantize_output_tensor and name == "output.weight":
        return False
    if name in ("position_embd.weight", "token_types.weight") or any(s in name for s in _KEPT):
        return False
    return not (arch == "glm5-next" and any(s in name for s in _KEPT_GLM5_NEXT))


@dataclass(frozen=True)
class ModelFacts:
    """What llama-quant.cpp reads of the model (``hparams``, ``arch``, ``type``)."""

    arch: str  # general.architecture: llama.cpp's name ("llama", "qwen3moe", "gemma3", "falcon")
    n_layer: int  # n_layer_all: {arch}.block_count (graniteswitch: its regular layers + 1)
    n_expert: int = 0
    n_head: int = 0  # of layer 0
    n_head_kv: int | None = None  # of layer 0; None: n_head
    n_layer_nextn: int = 0

    @property
    def n_gqa(self) -> int:
        """``hparams.n_gqa()`` (layer 0; 0 where there are no KV heads)."""
        kv = self.n_head if self.n_head_kv is None else self.n_head_kv
        return self.n_head // kv if kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's ``LLM_TYPE_70B`` (module docstring)."""
        layers = self.n_layer - self.n_layer_nextn  # hparams.n_layer()
        if self.arch == "llama":
            kv = self.n_head if self.n_head_kv is None else self.n_head_kv
            return self.n_expert != 8 and layers == 80 and self.n_head != kv
        return _70B_LAYERS.get(self.arch) == layers

    @classmethod
    def from_metadata(cls, fields: Mapping[str, object]) -> ModelFacts:
        """From a GGUF's KV fields (``{key: value}``; strings as ``str`` or ``bytes``, arrays as lists)."""
        arch = fields.get("general.architecture")
        arch = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else arch
        if not isinstance(arch, str) or not arch:
            raise SchemeError("the GGUF has no general.architecture; llama-quantize cannot load it")

        def first(key: str, default: int | None = 0) -> int | None:
            v = fields.get(f"{arch}.{key}", default)
            v = v[0] if isinstance(v, (list, tuple)) and v else v
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise SchemeError(f"the GGUF's {arch}.{key} is {v!r}, not an integer")
            return v

        layers = first("block_count", None)
        if layers is None or layers < 1:
            raise SchemeError(f"the GGUF has no positive {arch}.block_count; llama-quantize cannot load it")
        heads = first("attention.head_count")
        kv = first("attention.head_count_kv", None)
        nextn = first("nextn_predict_layers") or 0
        if arch == "graniteswitch":  # models/granite-switch.cpp: the router's extra layer at the end
            layers, nextn = layers - nextn + 1, 1
        return cls(arch, layers, first("expert_count") or 0, heads or 0, kv, nextn)


@dataclass(frozen=True)
class Params:
    """llama-quantize's options that the rules read (``llama_model_quantize_params``)."""

    ftype: F
    pure: bool = False
    imatrix: bool = False  # qs.has_imatrix: --imatrix with at least one entry
    token_embedding_type: T | None = None
    output_tensor_type: T | None = None
    quantize_output_tensor: bool = True  # --leave-output-tensor: False
    only_copy: bool = False  # COPY
    tensor_types: tuple[tuple[str, T], ...] = ()  # --tensor-type PATTERN=TYPE, in order (searched anywhere in the name)

    @property
    def default_type(self) -> T:
        t = DEFAULT_TYPE.get(self.ftype)
        if t is None:
            raise SchemeError(f"llama.cpp has no default tensor type for file type {self.ftype.name}")
        return t


@dataclass
class Counters:
    """``quantize_state_impl``'s counters (module docstring)."""

    n_attention_wv: int = 0
    n_ffn_down: int = 0
    n_ffn_gate: int = 0
    n_ffn_up: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    n_fallback: int = 0
    has_tied_embeddings: bool = True

    @classmethod
    def for_file(cls, names: Iterable[str], n_layer: int) -> Counters:
        """``init_quantize_state_counters`` over every tensor name of the file."""
        names = list(names)
        return cls(n_attention_wv=sum(category(n) in ATTN_V_LIKE for n in names), n_ffn_down=n_layer,
                   n_ffn_gate=n_layer, n_ffn_up=n_layer, has_tied_embeddings="output.weight" not in names)


def _layer(c: Counters, counter: str, name: str, facts: ModelFacts) -> tuple[int, int]:
    """``layer_info``: (i, n) from the counter, or from the name where the model has experts."""
    i, n = getattr(c, "i_" + counter), getattr(c, "n_" + counter)
    if max(1, facts.n_expert) > 1:
        m = re.match(r"blk\.([+-]?\d+)\.", name)
        if m is None:
            raise SchemeError(f"Failed to determine layer for tensor {name}")
        i = int(m.group(1))
        if not 0 <= i < n:
            raise SchemeError(f"Bad layer {i} for tensor {name}. Must be in [0, {n})")
    return i, n


def type_impl(c: Counters, new_type: T, name: str, ne: Sequence[int], facts: ModelFacts, params: Params, cat: str) -> T:
    """``llama_tensor_get_type_impl``: the mixture's type for one tensor (``new_type`` the default type),
    stepping the counters as llama.cpp does. Branches in the source's order."""
    f, arch, n_expert = params.ftype, facts.arch, facts.n_expert
    if arch == "glm5-next" and any(s in name for s in ("attn_q_a", "attn_q_b", "nextn.eh_proj")) \
            and new_type not in (T.F32, T.BF16, T.F16):
        return T.Q8_0
    if cat == "output" or (c.has_tied_embeddings and cat == "token_embd"):
        if params.output_tensor_type is not None:
            return params.output_tensor_type
        if f == F.MOSTLY_MXFP4_MOE or arch == "falcon" or ne[0] % block(new_type):
            return T.Q8_0
        if f in _IQ2_FTYPES or f == F.MOSTLY_IQ3_XXS:
            return T.Q5_K
        return T.Q6_K if new_type != T.Q8_0 else new_type
    if f == F.MOSTLY_MXFP4_MOE:
        # MoE tensors -> MXFP4, others -> Q8_0 (bailingmoe3's 3-D MLA projections are not experts)
        expert_role = arch != "bailingmoe3" or cat in ("ffn_up", "ffn_gate", "ffn_down")
        return T.MXFP4 if len(ne) > 2 and ne[2] > 1 and expert_role else T.Q8_0
    if cat == "token_embd":
        if params.token_embedding_type is not None:
            return params.token_embedding_type
        if f in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
            return T.Q2_K
        if f in _S_OR_M or f == F.MOSTLY_IQ3_XXS:
            return T.IQ3_S
        if f in (F.MOSTLY_TQ1_0, F.MOSTLY_TQ2_0):  # and Q2_0, which the gguf package does not know yet
            return T.Q4_K
        return new_type
    if f in _IQ2_FTYPES:
        if cat in ATTN_V_LIKE:
            new_type = T.Q4_K if facts.n_gqa >= 4 or n_expert >= 4 else (T.IQ3_S if f in _S_OR_M else T.Q2_K)
            c.i_attention_wv += 1
        elif n_expert == 8 and cat == "attn_k":
            new_type = T.Q4_K
        elif cat == "ffn_down":
            if c.i_ffn_down < c.n_ffn_down // 8:
                new_type = T.IQ3_S if f in _S_OR_M else T.Q2_K
            c.i_ffn_down += 1
        elif cat == "attn_output":
            if n_expert == 8:
                new_type = T.Q5_K
            elif f in (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
                new_type = T.IQ2_XXS
            elif f in _S_OR_M:
                new_type = T.IQ3_S
        return new_type
    if cat in ATTN_V_LIKE:
        gqa4 = facts.n_gqa >= 4
        i = c.i_attention_wv
        if f == F.MOSTLY_Q2_K:
            new_type = T.Q4_K if gqa4 else T.Q3_K
        elif f == F.MOSTLY_Q2_K_S and gqa4:
            new_type = T.Q4_K
        elif f == F.MOSTLY_IQ3_XXS:
            new_type = T.Q4_K if gqa4 else (T.IQ3_S if not params.imatrix else T.IQ3_XXS)
        elif f in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and gqa4:
            new_type = T.Q4_K
        elif f == F.MOSTLY_IQ3_M:
            new_type = T.Q4_K
        elif f == F.MOSTLY_Q3_K_M:
            new_type = T.Q5_K if i < 2 else T.Q4_K
        elif f == F.MOSTLY_Q3_K_L:
            new_type = T.Q5_K
        elif f in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and gqa4:
            new_type = T.Q5_K
        elif f in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, c.n_attention_wv):
            new_type = T.Q6_K
        elif f == F.MOSTLY_Q4_K_S and i < 4:
            new_type = T.Q5_K
        # 70B: 8 heads share attn_v, 8x smaller than attn_q, so more bits cost little
        if facts.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if n_expert == 8:  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
            new_type = T.Q8_0
        c.i_attention_wv += 1
        return new_type
    if cat == "attn_k":
        if n_expert == 8:
            return T.Q8_0
        if f == F.MOSTLY_IQ3_XS:
            return T.IQ3_XXS
        return T.IQ2_S if f == F.MOSTLY_IQ3_XXS else new_type
    if cat == "attn_q":
        if f == F.MOSTLY_IQ3_XS:
            return T.IQ3_XXS
        return T.IQ2_S if f == F.MOSTLY_IQ3_XXS else new_type
    if cat == "ffn_down":
        i, n = _layer(c, "ffn_down", name, facts)
        falcon = arch == "falcon"
        if f == F.MOSTLY_Q2_K:
            new_type = T.Q3_K
        elif f == F.MOSTLY_Q2_K_S:
            if i < n // 8:
                new_type = T.Q4_K
        elif f == F.MOSTLY_IQ3_XXS and not params.imatrix:
            new_type = T.Q4_K if i < n // 8 else T.Q3_K
        elif f == F.MOSTLY_Q3_K_M:
            new_type = T.Q5_K if i < n // 16 else (T.Q4_K if not falcon or use_more_bits(i, n) else T.Q3_K)
        elif f == F.MOSTLY_IQ3_M and (i < n // 8 or (n_expert == 8 and use_more_bits(i, n))):
            new_type = T.Q4_K
        elif f == F.MOSTLY_Q3_K_L:
            new_type = T.Q4_K if falcon else T.Q5_K
        elif f == F.MOSTLY_Q4_K_M:
            if falcon:
                new_type = T.Q6_K if i < n // 16 else (T.Q5_K if use_more_bits(i, n) else T.Q4_K)
            elif use_more_bits(i, n):
                new_type = T.Q6_K
        elif i < n // 8 and f in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and not params.imatrix:
            new_type = T.Q5_K
        elif f == F.MOSTLY_Q5_K_M and use_more_bits(i, n):
            new_type = T.Q6_K
        elif f == F.MOSTLY_Q4_K_S and not falcon and i < n // 8:
            new_type = T.Q5_K
        elif f in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and params.imatrix and i < n // 8:
            # "guard against craziness in the first few ffn_down layers", with an imatrix only
            new_type = T.Q4_1 if f == F.MOSTLY_Q4_0 else T.Q5_1
        c.i_ffn_down += 1
        return new_type
    if cat == "attn_output":
        if arch != "falcon":
            if n_expert == 8:
                return T.Q5_K if f in _MOE8_ATTN_OUTPUT else new_type
            return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_IQ3_XXS: T.IQ3_S, F.MOSTLY_Q3_K_M: T.Q4_K, F.MOSTLY_Q3_K_L: T.Q5_K,
                    F.MOSTLY_IQ3_M: T.Q4_K}.get(f, new_type)
        return T.Q4_K if f == F.MOSTLY_Q3_K_L else new_type
    # (llama.cpp's ATTENTION_QKV branch here is never reached: attn_qkv took the attn_v branch above)
    if cat in ("ffn_gate", "ffn_up"):
        i, n = _layer(c, cat, name, facts)
        if f == F.MOSTLY_IQ3_XS and n // 8 <= i < 7 * n // 8:
            new_type = T.IQ3_XXS
        setattr(c, "i_" + cat, getattr(c, "i_" + cat) + 1)
    return new_type


def tensor_type(c: Counters, name: str, ne: Sequence[int], cur_type: T, facts: ModelFacts, params: Params) -> T:
    """``llama_tensor_get_type``: the type llama-quantize writes one tensor in (``ne`` fastest first;
    ``cur_type`` its type in the source file, kept where it may not be quantized)."""
    if not allows_quantization(name, ne, facts.arch, quantize_output_tensor=params.quantize_output_tensor,
                               only_copy=params.only_copy):
        return cur_type
    cat = category(name)
    if params.token_embedding_type is not None and cat == "token_embd":
        # per_layer_token_embd follows it unless a --tensor-type pattern names it
        if name != "per_layer_token_embd.weight" or not any(re.search(p, name) for p, _ in params.tensor_types):
            return params.token_embedding_type
    if params.output_tensor_type is not None and cat == "output":
        return params.output_tensor_type
    new_type = params.default_type
    if is_quantized(new_type):
        manual = next((t for p, t in params.tensor_types if re.search(p, name)), None)
        if manual is not None:
            new_type = manual
        elif not params.pure:
            new_type = type_impl(c, new_type, name, ne, facts, params, cat)
        out = tensor_type_fallback(new_type, int(ne[0]))
        c.n_fallback += out != new_type
        new_type = out
    return new_type


def _layer_key(name: str) -> tuple[int, str]:
    m = re.match(r"blk\.\s*([+-]?\d+)", name)  # sscanf(name, "blk.%d.", &layer), -1 where it reads nothing
    return (int(m.group(1)) if m else -1, name)


def llama_order(names: Iterable[str]) -> list[str]:
    """The loader's ``weights_map`` order (``weight_name_comparer``): by ``blk.N.`` number (-1 for the
    rest), then by name; llama-quantize writes and counts tensors in it."""
    return sorted(names, key=_layer_key)


def tensor_types(tensors: Iterable[tuple[str, Sequence[int], T]], facts: ModelFacts, params: Params) -> dict[str, T]:
    """``{name: type}`` for every tensor of a file, each ``(name, ne fastest first, type in the source)``,
    in llama.cpp's order (:func:`llama_order`): what llama-quantize writes each one as."""
    items = {name: (tuple(int(n) for n in ne), T(int(t))) for name, ne, t in tensors}
    order = llama_order(items)
    c = Counters.for_file(order, facts.n_layer)
    return {name: tensor_type(c, name, items[name][0], items[name][1], facts, params) for name in order}


def counters_at(i_layer: int, n_layer: int) -> Counters:
    """Counters standing at layer ``i_layer`` of ``n_layer`` for every rule: what they are when each layer
    holds exactly one attn_v and one of each ffn tensor (a dense model)."""
    return Counters(n_layer, n_layer, n_layer, n_layer, i_layer, i_layer, i_layer, i_layer)


__all__ = ["ATTN_V_LIKE", "DEFAULT_TYPE", "Counters", "ModelFacts", "Params", "allows_quantization", "block", "category",
           "counters_at", "is_quantized", "llama_order", "n_dims", "tensor_type", "tensor_type_fallback", "tensor_types", "type_impl",
           "use_more_bits"]
