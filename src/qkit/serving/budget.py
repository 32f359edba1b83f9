"""How many resident tokens fit on a card: weights in each format, KV cache per token, what is left.

For one card, model and weight format::

    free_for_kv = gpu_bytes - weight_bytes - reserve_bytes
    max_tokens  = floor(free_for_kv / kv_bytes_per_token)        (0 when free_for_kv < one token)

A row *does not fit* when the weights and the reserve alone exceed the card, has *no room* when not
one token of cache is left, and is *misleading* when it fits but ``max_tokens`` is below one
conversation (``conversation`` tokens, 4,096 by default): the model loads, then cannot hold a chat.

Weight bytes are what qkit would store (``stored_bytes``, the same arithmetic as ``QuantizedTensor``
storage): the tensors ``qkit quantize`` quantizes (the block projections, ``qkit.transform.is_block_projection``:
attention q/k/v/o and MLP matrices inside the layers; for a llama.cpp recipe such as q4_k_m also the token
embedding and the head, at llama.cpp's types, as its whole file) in the format's scheme, everything else
(norms, biases, and for the other formats the embeddings and an untied lm head) kept at fp16. With a model directory the tensor shapes come from its safetensors
headers (exact); with a config.json or a preset from a llama-style layout (gated MLP) of that config.

``chapter=True`` (``qkit budget --chapter``) applies the chapter's simpler assumptions instead, under
which its figures come out exactly: nominal parameter counts (7e9, 13e9, 70e9), *every* weight at the
format's nominal bits (``CHAPTER_BITS``: int8 = 8, int4 = 4.125; no fp16 embeddings, no scales beyond
those), a 1.5 GiB reserve; cards in GiB and the KV bytes per token of the preset layouts, as always.
For example 13B int4 on 8 GiB: ``floor((8 GiB - 13e9 * 4.125 / 8 - 1.5 GiB) / 819,200) = 337`` tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError, SchemeError
from qkit.lists import numbers
from qkit.models import check_complete, pinned_of, read_config, resolve
from qkit.schemes import Scheme, get_scheme
from qkit.serving.kv import (
    DEFAULT_KV_DTYPE,
    Architecture,
    architecture_from_config,
    check_kv_dtype,
    read_config_file,
)
from qkit.transform import Rules, is_block_projection

_RULES = Rules()  # the targets quantize chooses with no --include/--exclude

GIB = 2**30
FP16_BYTES = torch.float16.itemsize
DEFAULT_GPUS_GIB: tuple[float, ...] = (8.0, 16.0, 24.0)
DEFAULT_RESERVE_GIB = 1.0  # CUDA context, activations, allocator slack
DEFAULT_CONVERSATION = 4096
# The budget's formats: label -> qkit scheme name (None: the fp16 baseline, nothing quantized). The
# llama.cpp and FP4 formats are priced by the scheme's own layout (``nbytes_for``), per tensor after the
# scheme's ``resolve`` (q4_k_m: Q6_K / Q4_K by layer and role, width fallbacks to Q5_0 / Q8_0).
FORMATS: dict[str, str | None] = {
    "fp16": None, "int8": "int8-row", "int4-g128": "int4-g128", "nf4": "nf4",
    "int4-g64": "int4-g64", "q8_0": "q8_0", "q4_k_m": "q4_k_m", "mxfp4": "mxfp4", "nvfp4": "nvfp4",
}
DEFAULT_FORMATS: tuple[str, ...] = ("fp16", "int8", "int4-g128", "nf4")

# Common shapes, each the layout of a published model (so the parameter counts are real ones).
PRESETS: dict[str, dict[str, Any]] = {
    "7b": {  # Mistral-7B-v0.1: 7.24B parameters
        "model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
    },
    "13b": {  # Llama-2-13B: 13.0B parameters, full multi-head attention
        "model_type": "llama", "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
        "head_dim": 128, "hidden_size": 5120, "intermediate_size": 13824, "vocab_size": 32000, "tie_word_embeddings": False,
    },
    "70b": {  # Llama-2-70B: 69.0B parameters
        "model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 32000, "tie_word_embeddings": False,
    },
}
DEFAULT_MODEL_WORD = "default"  # ``qkit budget default``: the pinned default model

# The chapter's assumptions (``chapter=True``): nominal sizes, every weight at the format's bits.
CHAPTER_PARAMETERS: dict[str, int] = {"7b": 7 * 10**9, "13b": 13 * 10**9, "70b": 70 * 10**9}
# int4 = 4 bits + one fp16 scale per 128 weights; nf4 = 4 bits + one fp16 absmax per 64 (qkit's nf4).
# The other fixed-rate formats at their nominal bits: int4-g64 and mxfp4 4.25, nvfp4 4.5 (its one fp32
# tensor scale is nothing at this size), q8_0 8.5. q4_k_m mixes types by layer, so it has no one rate.
CHAPTER_BITS: dict[str, Fraction] = {
    "fp16": Fraction(16), "int8": Fraction(8), "int4-g128": Fraction(33, 8), "nf4": Fraction(17, 4),
    "int4-g64": Fraction(17, 4), "q8_0": Fraction(17, 2), "mxfp4": Fraction(17, 4), "nvfp4": Fraction(9, 2),
}
CHAPTER_RESERVE_GIB = 1.5
PRESET_SOURCES = {"7b": "Mistral-7B layout", "13b": "Llama-2-13B layout", "70b": "Llama-2-70B layout"}


# --------------------------------------------------------------------------- weight bytes


def stored_bytes(scheme: Scheme, shape: tuple[int, ...]) -> int:
    """Bytes ``quantize_tensor(w, scheme).nbytes`` would report for a weight of ``shape``, without a tensor:
    the scheme's own exact ``nbytes_for(shape)`` (codes, scales and every other stored part; for example
    absmax 4-bit ``ceil(n/2) + prod(scale_shape) * scale_bytes``, nf4 ``ceil(n/2) + ceil(n/64) * scale_bytes``)."""
    return int(scheme.nbytes_for(tuple(shape)))


@dataclass(frozen=True)
class WeightBytes:
    """Weights of one model in one format."""

    format: str
    scheme: str | None
    total_bytes: int
    parameters: int
    quantized_parameters: int  # parameters in block projections (stored in the scheme)
    quantized_bytes: int  # their bytes in the scheme
    fp16_parameters: int  # everything else, at fp16

    @property
    def projection_bits_per_weight(self) -> float:
        if self.scheme is None or not self.quantized_parameters:
            return 8.0 * FP16_BYTES
        return 8 * self.quantized_bytes / self.quantized_parameters

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.parameters


def check_format(fmt: str) -> str:
    """``fmt`` if it is a budget format (``FORMATS``) or any registered scheme (every llama.cpp type and
    recipe, ``q3_k_m``, ``iq4_xs-llama``, ...), priced by its own layout."""
    if fmt not in FORMATS:
        try:
            get_scheme(fmt)
        except (InputError, SchemeError):
            raise InputError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)} or any scheme "
                             "(qkit quantize --help lists them)") from None
    return fmt


def format_scheme(fmt: str) -> str | None:
    """The scheme a budget format is priced in (None: fp16)."""
    return FORMATS[fmt] if fmt in FORMATS else get_scheme(check_format(fmt)).name


def recipe_config(shapes: list[tuple[str, tuple[int, ...]]], config: dict | None) -> dict:
    """What a recipe binds to: the model's config (its head counts and tied embeddings matter to llama.cpp's
    rules), with the layer count found in the names; a Mistral layout is llama.cpp's llama architecture."""
    cfg = dict(config or {})
    cfg["num_hidden_layers"] = layer_count(shapes)
    # a head stored apart is untied; none stored (a checkpoint keeps a tied one once): tied
    cfg.setdefault("tie_word_embeddings", not any(n in ("lm_head.weight", "output.weight") for n, _ in shapes))
    if cfg.get("model_type") == "mistral":
        cfg["model_type"] = "llama"
    return cfg


def layer_count(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """Transformer blocks in a list of tensor names (``...layers.N.`` / ``...h.N.``): the largest N + 1."""
    found = [int(m.group(1)) for name, _ in shapes if (m := re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", name))]
    return max(found) + 1 if found else 0


def weight_bytes(shapes: Iterable[tuple[str, tuple[int, ...]]], fmt: str, config: dict | None = None) -> WeightBytes:
    """Sum the stored bytes of every tensor: the tensors ``qkit quantize -s SCHEME`` quantizes (``Rules``:
    the block projections, and a recipe's ``token_embd`` and ``output`` too, as llama-quantize writes its
    whole file) in ``fmt``'s scheme, the rest in fp16.

    Every tensor is priced in the scheme ``resolve`` gives it (q4_k_m's recipe picks a type per tensor,
    k-quants fall back for some widths), with the scheme bound (``bind``) to the layer count found in the
    names, as ``qkit quantize`` binds it to the model's config."""
    shapes = list(shapes)
    scheme_name = format_scheme(fmt)
    scheme = get_scheme(scheme_name) if scheme_name else None
    if scheme is not None:
        scheme = scheme.bind(recipe_config(shapes, config))
    total = params = qparams = qbytes = 0
    for name, shape in shapes:
        n = math.prod(shape)
        params += n
        if scheme is not None and _RULES.scheme_for(name, tuple(shape), scheme) is not None:
            b = stored_bytes(scheme.resolve(tuple(shape), name), tuple(shape))
            qparams += n
            qbytes += b
            total += b
        else:
            total += n * FP16_BYTES
    return WeightBytes(fmt, scheme_name, total, params, qparams, qbytes, params - qparams)


def chapter_weight_bytes(parameters: int, fmt: str) -> WeightBytes:
    """The chapter's weights: ``ceil(parameters * CHAPTER_BITS[fmt] / 8)`` bytes, every weight in the format."""
    if check_format(fmt) not in CHAPTER_BITS:
        raise InputError(f"--chapter prices fixed-rate formats only ({', '.join(CHAPTER_BITS)}); {fmt} mixes "
                         "types by layer: drop --chapter to price it from the real tensor shapes")
    total = math.ceil(parameters * CHAPTER_BITS[fmt] / 8)
    quantized = parameters if FORMATS[fmt] else 0
    return WeightBytes(fmt, FORMATS[fmt], total, parameters, quantized, total if quantized else 0, parameters - quantized)


def chapter_assumptions(reserve_gib: float, formats: Sequence[str] = DEFAULT_FORMATS) -> str:
    """The sentence ``qkit budget --chapter`` prints: what it assumes, and what it leaves out."""
    sizes = ", ".join(f"{k} = {v / 1e9:g}e9" for k, v in CHAPTER_PARAMETERS.items())
    bits = ", ".join(f"{k} = {float(CHAPTER_BITS[k]):g}" for k in formats)
    return (f"the chapter's assumptions (--chapter): nominal parameters ({sizes}); every weight, embeddings included, "
            f"at the format's bits ({bits}); a {reserve_gib:g} GiB reserve; cards in GiB (2^30 bytes); KV bytes per "
            "token from the preset layouts. Without --chapter: real parameter counts, embeddings and norms at fp16.")


def llama_shapes(arch: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a llama-style decoder (gated MLP, RMSNorm) with ``arch``'s sizes.

    Tied embeddings are stored once (no ``lm_head.weight``), as a checkpoint stores them.
    """
    h, q, kv, ff = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.intermediate
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (arch.vocab, h))]
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (ff, h)),
            (p + "mlp.up_proj.weight", (ff, h)),
            (p + "mlp.down_proj.weight", (h, ff)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if arch.attention_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)), (p + "self_attn.v_proj.bias", (kv,))]
    out.append(("model.norm.weight", (h,)))
    if not arch.tie_word_embeddings:
        out.append(("lm_head.weight", (arch.vocab, h)))
    return out


def directory_shapes(directory: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Exact tensor shapes of a model directory from its safetensors headers (no data read).

    A qkit checkpoint's quantized weights are reported with their original shapes from the manifest.
    """
    manifest = read_manifest(directory)
    entries = (manifest or {}).get("tensors", {})
    out = []
    for name, shape in tensor_shapes(directory):
        base, _, part = name.rpartition(".")
        if base in entries:
            if part == "qweight":
                out.append((base, tuple(entries[base]["shape"])))
            continue
        out.append((name, shape))
    return out


# --------------------------------------------------------------------------- fitting


def max_tokens(gpu_bytes: int, weight_bytes: int, reserve_bytes: int, kv_bytes_per_token: int) -> int:
    """Resident tokens that fit: ``floor((gpu - weights - reserve) / kv_per_token)``, 0 when nothing is left."""
    free = gpu_bytes - weight_bytes - reserve_bytes
    return max(0, free // kv_bytes_per_token)


def fit_status(gpu_bytes: int, weight_bytes: int, reserve_bytes: int, tokens: int, conversation: int) -> str:
    """``does not fit`` | ``no room for cache`` | ``fits, < 1 conversation`` | ``fits``."""
    if weight_bytes + reserve_bytes > gpu_bytes:
        return "does not fit"
    if tokens == 0:
        return "no room for cache"
    if tokens < conversation:
        return "fits, < 1 conversation"
    return "fits"


@dataclass(frozen=True)
class ModelSpec:
    label: str
    source: str  # "preset (...)", "config.json", "safetensors headers"
    architecture: Architecture
    shapes: list[tuple[str, tuple[int, ...]]] = field(repr=False)
    config: dict = field(default_factory=dict, repr=False)  # what a llama.cpp recipe binds to


@dataclass(frozen=True)
class BudgetRow:
    gpu_gib: float
    model: str
    format: str
    scheme: str | None
    parameters: int
    projection_bits_per_weight: float
    bits_per_weight: float
    weight_bytes: int
    kv_bytes_per_token: int
    free_bytes: int
    max_tokens: int
    conversations: int
    status: str

    @property
    def misleading(self) -> bool:
        return self.status == "fits, < 1 conversation"


@dataclass(frozen=True)
class BudgetTable:
    gpu_gib: float
    rows: list[BudgetRow]
    misleading: list[BudgetRow]
    sentence: str


@dataclass(frozen=True)
class BudgetReport:
    tables: list[BudgetTable]
    models: list[dict[str, Any]]
    reserve_gib: float
    kv_dtype: str
    conversation: int
    formats: dict[str, str | None]
    assumptions: str | None = None  # with chapter=True: the chapter's assumptions, in words

    @property
    def chapter(self) -> bool:
        return self.assumptions is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for t, td in zip(self.tables, d["tables"]):
            for row, rd in zip(t.rows, td["rows"]):
                rd["misleading"] = row.misleading
            td.pop("misleading")
        if not self.chapter:
            d.pop("assumptions")
        return d


def model_specs(
    models: Sequence[str] = (), presets: Sequence[str] = (), configs: Sequence[str | Path] = ()
) -> list[ModelSpec]:
    """Presets, config.json files and model arguments (a ``.json`` path counts as a config; the word
    ``default`` is the pinned default model) as specs."""
    specs: list[ModelSpec] = []
    for p in presets:
        key = p.strip().lower()
        if key not in PRESETS:
            raise InputError(f"unknown preset {p!r}; use one of {', '.join(PRESETS)}")
        arch = architecture_from_config(PRESETS[key], key)
        specs.append(ModelSpec(key, f"preset ({PRESET_SOURCES[key]})", arch, llama_shapes(arch), PRESETS[key]))
    config_paths = list(configs) + [m for m in models if str(m).endswith(".json")]
    for c in config_paths:
        cfg = read_config_file(c)
        arch = architecture_from_config(cfg, str(c))
        specs.append(ModelSpec(Path(c).parent.name or str(c), "config.json (llama layout)", arch, llama_shapes(arch), cfg))
    for m in models:
        if str(m).endswith(".json"):
            continue
        ref = resolve(None if m == DEFAULT_MODEL_WORD else m)
        check_complete(ref)  # a missing tensor would be a silently smaller weight size (headers only)
        cfg = read_config(ref.directory)
        arch = architecture_from_config(cfg, ref.spec)
        pinned = pinned_of(ref)
        label = "default" if ref.kind == "default" else pinned.name if pinned else Path(ref.spec).name or ref.spec
        specs.append(ModelSpec(label, "safetensors headers", arch, directory_shapes(ref.directory), cfg))
    return specs


# Card sizes and reserves are GiB counts below this (a PiB: far beyond any card, and far from a float's
# overflow when turned into bytes).
MAX_GIB = 2.0**20


def budget(
    *,
    models: Sequence[str] = (),
    presets: Sequence[str] = (),
    configs: Sequence[str | Path] = (),
    gpus_gib: Sequence[float] = DEFAULT_GPUS_GIB,
    reserve_gib: float | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    kv_dtype: str = DEFAULT_KV_DTYPE,
    conversation: int = DEFAULT_CONVERSATION,
    chapter: bool = False,
) -> BudgetReport:
    """One table per card size: every model x format with weights, KV per token and tokens that fit.

    With no models, presets or configs, the three presets are used. ``reserve_gib`` defaults to
    ``DEFAULT_RESERVE_GIB`` (``CHAPTER_RESERVE_GIB`` with ``chapter``). ``chapter``: the chapter's
    assumptions (module doc), for the presets only.
    """
    if reserve_gib is None:
        reserve_gib = CHAPTER_RESERVE_GIB if chapter else DEFAULT_RESERVE_GIB
    if chapter and (models or configs):
        raise InputError(f"--chapter applies the chapter's nominal sizes to the presets ({', '.join(PRESETS)}) only; "
                         "drop the MODEL and --config arguments, or drop --chapter")
    if not formats:
        raise InputError(f"--formats needs at least one of {', '.join(FORMATS)}")
    for f in formats:
        if chapter:
            chapter_weight_bytes(1, f)  # refuses a format the chapter cannot price, before any work
        check_format(f)
    if not gpus_gib or not all(0 < g < MAX_GIB for g in gpus_gib):  # NaN and inf fail too
        raise InputError(f"--gpu needs positive card sizes in GiB below {MAX_GIB:,.0f}, e.g. 8,16,24 (got {list(gpus_gib)})")
    if not 0 <= reserve_gib < MAX_GIB:
        raise InputError(f"--reserve must be >= 0 GiB and below {MAX_GIB:,.0f} (got {reserve_gib})")
    reserve_gib = float(reserve_gib) + 0.0  # -0.0 would print as "-0 GiB reserve"
    if conversation < 1:
        raise InputError(f"--conversation must be at least 1 token (got {conversation})")
    whole(conversation, "--conversation", 1, MAX_COUNT)
    kv_dtype = check_kv_dtype(kv_dtype)  # fp16, ..., int8 / int4 (codes + an fp16 scale per token and kv head)
    if not (models or presets or configs):
        presets = tuple(PRESETS)
    specs = model_specs(models, presets, configs)
    if chapter:
        weights = {(i, f): chapter_weight_bytes(CHAPTER_PARAMETERS[s.label], f) for i, s in enumerate(specs) for f in formats}
    else:
        weights = {(i, f): weight_bytes(s.shapes, f, s.config) for i, s in enumerate(specs) for f in formats}
    reserve = round(reserve_gib * GIB)
    tables = []
    for g in gpus_gib:
        gpu = round(g * GIB)
        rows = []
        for i, s in enumerate(specs):
            per_token = s.architecture.kv_bytes_per_token(kv_dtype)
            for f in formats:
                w = weights[(i, f)]
                tokens = max_tokens(gpu, w.total_bytes, reserve, per_token)
                rows.append(
                    BudgetRow(
                        gpu_gib=g, model=s.label, format=f, scheme=w.scheme, parameters=w.parameters,
                        projection_bits_per_weight=w.projection_bits_per_weight, bits_per_weight=w.bits_per_weight,
                        weight_bytes=w.total_bytes, kv_bytes_per_token=per_token,
                        free_bytes=gpu - w.total_bytes - reserve, max_tokens=tokens,
                        conversations=tokens // conversation,
                        status=fit_status(gpu, w.total_bytes, reserve, tokens, conversation),
                    )
                )
        misleading = [r for r in rows if r.misleading]
        tables.append(BudgetTable(g, rows, misleading, misleading_sentence(g, misleading, conversation)))
    models_info = [
        {"label": s.label, "source": f"nominal; KV cache of the {PRESET_SOURCES[s.label]}" if chapter else s.source,
         "architecture": s.architecture.to_dict(), "parameters": weights[(i, formats[0])].parameters}
        for i, s in enumerate(specs)
    ]
    return BudgetReport(tables, models_info, reserve_gib, kv_dtype, conversation, {f: format_scheme(f) for f in formats},
                        chapter_assumptions(reserve_gib, formats) if chapter else None)


def misleading_sentence(gpu_gib: float, rows: Sequence[BudgetRow], conversation: int) -> str:
    if not rows:
        return f"On {gpu_gib:g} GiB every row that fits holds at least one {conversation:,}-token conversation."
    names = "; ".join(f"{r.model} {r.format} ({r.max_tokens:,} tokens)" for r in rows)
    return (
        f"On {gpu_gib:g} GiB, \"it fits\" is misleading for {names}: the weights load, but the cache left "
        f"holds less than one {conversation:,}-token conversation."
    )


def parse_floats(text: str, what: str) -> list[float]:
    """``"8,16,24"`` -> ``[8.0, 16.0, 24.0]`` (``qkit.lists.numbers``: an empty value or entry is refused)."""
    return numbers(text, what, float, "8,16,24")
