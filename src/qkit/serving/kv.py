"""KV cache size: the formula, the attention variants, and a measurement of what a model allocates.

For every layer a decoder keeps one key and one value vector per kv head and per resident token::

    kv_bytes_per_token = 2 x layers x kv_heads x head_dim x bytes_per_element
    kv_bytes           = kv_bytes_per_token x tokens x users

(Qwen2.5-0.5B: 24 layers, 2 kv heads, head dim 64, fp16 -> 2*24*2*64*2 = 12,288 bytes per token.)
Grouped-query attention (GQA) shares each kv head between ``heads / kv_heads`` query heads; full
multi-head attention (MHA) has ``kv_heads = heads`` and multi-query attention (MQA) ``kv_heads = 1``,
so the same model's cache under MHA and MQA bounds the GQA saving from both sides.

The formula assumes every layer keeps every token (full attention); a sliding-window layer keeps at
most its window, which ``measure_kv`` would show as a mismatch.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qkit import reading
from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError, ModelLoadError
from qkit.models import load, parse_device, read_config, resolve
from qkit.threads import available_memory

# Dtype names accepted for the cache; bytes per element come from torch itself, not from a table.
KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}
DEFAULT_KV_DTYPE = "fp16"
DEFAULT_TOKENS = 2048
DEFAULT_USERS = 1
# Three ways to hold the same 65,536 resident tokens: the cache only depends on their total.
EQUIVALENT_SPLITS: tuple[tuple[int, int], ...] = ((32, 2048), (64, 1024), (128, 512))
MEASURE_SEED = 0
# The serving analyses build per-layer tables (budget's tensor list, bench's random model): a config with
# more layers than this is refused. Published decoders have at most a few hundred.
MAX_LAYERS = 10_000
# Keys naming the longest sequence a model takes (llama/qwen/mistral; gpt-2 style), first found wins.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


# Integer caches (what ``qkit eval``'s kv-int8 / kv-int4-token rows simulate): per token and kv head,
# ``head_dim`` codes of ``bits`` bits plus one fp16 scale, for the key and for the value. (KIVI's per-channel
# keys, the kv-int4 row, keep one fp16 scale per channel per group of G tokens instead: ``2 * head_dim / G``
# bytes per token and head, 4 B for head_dim 64 and G = 32, against 2 B here.)
INT_KV_BITS: dict[str, int] = {"int8": 8, "int4": 4}
KV_SCALE_BYTES = 2  # one fp16 scale per token per kv head


def check_kv_dtype(name: str) -> str:
    """The canonical cache dtype name (``float16`` -> ``fp16``; ``int8``, ``int4``), or one line naming the valid ones."""
    key = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(name, name)
    if key not in KV_DTYPES and key not in INT_KV_BITS:
        raise InputError(f"unknown cache dtype {name!r}; use one of {', '.join([*KV_DTYPES, *INT_KV_BITS])}")
    return key


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of a floating-point cache dtype name (integer caches have none: they are simulated)."""
    key = check_kv_dtype(name)
    if key in INT_KV_BITS:
        raise InputError(f"an {key} cache has no torch dtype to run a model in; measure with fp16, bf16 or fp32 "
                         f"(qkit eval's kv-{key} rows simulate it)")
    return KV_DTYPES[key]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a floating-point cache dtype name (``fp16`` -> 2), from ``torch.dtype.itemsize``."""
    return kv_dtype(name).itemsize


def head_bytes_per_token(name: str, head_dim: int) -> int:
    """Bytes one token costs one kv head for one of key/value: ``head_dim x bytes`` for a float dtype;
    ``ceil(head_dim x bits / 8) + 2`` (codes plus an fp16 scale) for int8 / int4."""
    key = check_kv_dtype(name)
    if key in INT_KV_BITS:
        return -(-head_dim * INT_KV_BITS[key] // 8) + KV_SCALE_BYTES
    return head_dim * dtype_bytes(key)


def kv_formula(layers: int, kv_heads: int, head_dim: int, name: str) -> str:
    """The bytes-per-token formula in words, e.g. ``2 x 30 x 3 x 64 x 2 (fp16)`` or ``2 x 30 x 3 x (64 x 4/8 + 2) (int4)``."""
    key = check_kv_dtype(name)
    if key in INT_KV_BITS:
        return f"2 x {layers} x {kv_heads} x ({head_dim} x {INT_KV_BITS[key]}/8 + {KV_SCALE_BYTES}) ({key} codes + fp16 scale per token and head)"
    return f"2 x {layers} x {kv_heads} x {head_dim} x {dtype_bytes(key)} ({key})"


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """``2 x layers x kv_heads x head_dim x bytes_per_element`` (the 2: one key and one value)."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


@dataclass(frozen=True)
class Architecture:
    """The shape numbers of a decoder that the serving analyses need (read from a config.json)."""

    name: str
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool
    attention_bias: bool = False

    @property
    def attention(self) -> str:
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else f"GQA ({self.heads // self.kv_heads} query heads per kv head)"

    def kv_bytes_per_token(self, dtype: str = DEFAULT_KV_DTYPE, kv_heads: int | None = None) -> int:
        """``2 x layers x kv_heads x head_bytes_per_token(dtype, head_dim)`` (int8/int4 include their scales)."""
        return 2 * self.layers * (self.kv_heads if kv_heads is None else kv_heads) * head_bytes_per_token(dtype, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(config: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def architecture_from_config(config: dict[str, Any], name: str = "config") -> Architecture:
    """Read an ``Architecture`` from a Hugging Face config dict (llama/qwen/mistral names, gpt-2 fallbacks).

    Multimodal configs with a ``text_config`` use the text model. Raises ``ModelLoadError`` naming the
    missing key when the config does not describe a decoder.
    """
    if isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", config.get("model_type"))}
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads), ("hidden_size", hidden)) if v is None]
    if missing:
        raise ModelLoadError(f"config {name} has no {', '.join(missing)}; pass the config.json of a decoder-only language model")
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if config.get("multi_query") else heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = _first(config, "intermediate_size", "n_inner") or 4 * hidden
    model_type = str(config.get("model_type", "unknown"))
    try:
        arch = Architecture(
            name=name,
            model_type=model_type,
            layers=int(layers),
            heads=int(heads),
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            hidden=int(hidden),
            intermediate=int(intermediate),
            vocab=int(config.get("vocab_size") or 0),
            # transformers' own default is to tie; llama-family configs always say which.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config {name} has a non-integer shape field ({exc}); fix the config.json") from exc
    if min(arch.layers, arch.heads, arch.kv_heads, arch.head_dim) < 1 or arch.heads % arch.kv_heads:
        raise ModelLoadError(
            f"config {name}: {arch.heads} heads and {arch.kv_heads} kv heads do not make a valid attention layout; fix the config.json"
        )
    if config.get("head_dim") is None and arch.hidden % arch.heads:
        raise ModelLoadError(
            f"config {name}: hidden size {arch.hidden} is not a multiple of {arch.heads} heads (and no head_dim is given); fix the config.json"
        )
    if min(arch.hidden, arch.intermediate) < 1 or arch.vocab < 0:
        raise ModelLoadError(f"config {name}: hidden, intermediate and vocab sizes must be positive; fix the config.json")
    if arch.layers > MAX_LAYERS:
        raise ModelLoadError(f"config {name}: {arch.layers:,} layers is more than qkit's limit of {MAX_LAYERS:,}; fix the config.json")
    return arch


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence ``config``'s model takes (``max_position_embeddings``, or a gpt-2 style
    ``n_positions`` ...; a multimodal config's ``text_config``); ``None`` when it does not say."""
    if isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    value = _first(config, *CONTEXT_KEYS)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parameter_estimate(arch: Architecture) -> int:
    """Parameters of a llama-style decoder with ``arch``'s sizes (projections, norms, embeddings; an untied
    lm head counted once more): what a model built from the config holds."""
    h, q, kv, ff = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.intermediate
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * ff + 2 * h
    return arch.layers * per_layer + h + arch.vocab * h * (1 if arch.tie_word_embeddings else 2)


def check_measure_size(*, model: Any = None, config: str | Path | None = None, tokens: int = DEFAULT_TOKENS,
                       dtype: str = DEFAULT_KV_DTYPE, device: str | None = None) -> None:
    """``kv --measure``'s forward pass against the model's context and the memory free (``check_forward_fits``),
    from the config alone: a command calls it before its status line (``kv_report`` checks again)."""
    arch, raw = resolve_architecture(model, config)
    check_forward_fits(arch, raw, tokens, kv_dtype(dtype), check_measure(dtype, device), random_weights=config is not None)
    if config is not None:
        hf_config(raw)  # transformers' own checks of a config it will build


def check_forward_fits(arch: Architecture, config: dict[str, Any], tokens: int, dtype: torch.dtype, device: torch.device,
                       *, random_weights: bool, what: str = "--tokens") -> None:
    """Refuse, before anything is loaded, a forward pass over ``tokens`` tokens that the model or the machine
    cannot take: more than the model's context (``context_length``), or more memory than ``device`` has free
    (``qkit.threads.available_memory``) for the cache (``2 x layers x kv_heads x head_dim`` elements per token),
    the activations (about ``4 x hidden + 2 x intermediate`` elements per token) and, for a model built from a
    config, its random weights (``parameter_estimate``)."""

    context = context_length(config)
    if context is not None and tokens > context:
        raise InputError(
            f"{what} {tokens:,} is more than the {context:,}-token context of {arch.name} (max_position_embeddings); "
            f"pass {what} {context:,} or fewer"
        )
    free = available_memory(str(device))
    if free is None:
        return
    size = dtype.itemsize
    per_token = (2 * arch.layers * arch.kv_heads * arch.head_dim + 4 * arch.hidden + 2 * arch.intermediate) * size
    weights = parameter_estimate(arch) * size if random_weights else 0
    need = weights + tokens * per_token
    if weights + per_token > free:
        raise InputError(
            f"the random {dtype.itemsize * 8}-bit weights of {arch.name} ({parameter_estimate(arch):,} parameters) need about "
            f"{human_bytes(weights)}, more than the {human_bytes(free)} free on {device}; pass a smaller config"
        )
    if need > free:
        fit = max(0, (free - weights) // per_token)
        raise InputError(
            f"{what} {tokens:,} needs about {human_bytes(need)} on {device} ({'random weights, ' if weights else ''}cache and "
            f"activations), more than the {human_bytes(free)} free; pass {what} {fit:,} or fewer"
        )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config.json given with ``--config`` (a file, or a directory holding one)."""

    p = Path(path).expanduser()
    if not p.exists() and not reading.is_link_loop(p):  # a loop is refused as one by read_config
        raise InputError(f"no such config file: {path}; pass the path of a model's config.json")
    return read_config(p)


def resolve_architecture(model: str | None = None, config: str | Path | None = None) -> tuple[Architecture, dict[str, Any]]:
    """``(Architecture, raw config dict)`` from a MODEL argument or a ``--config`` path (never both)."""
    if model is not None and config is not None:
        raise InputError("give either MODEL or --config, not both")
    if config is not None:
        raw = read_config_file(config)
        return architecture_from_config(raw, str(config)), raw

    ref = resolve(model)
    raw = read_config(ref.directory)
    return architecture_from_config(raw, ref.spec), raw


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class KVReport:
    architecture: Architecture
    dtype: str
    tokens: int
    users: int
    bytes_per_token: int
    total_bytes: int
    variants: list[dict[str, Any]]  # GQA/MHA/MQA: kv_heads, bytes_per_token, total_bytes, ratio vs model
    equivalent_splits: list[dict[str, Any]]  # users x tokens that hold the same total
    measured: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "architecture": self.architecture.to_dict()}


def check_options(
    *,
    model: str | None = None,
    config: str | Path | None = None,
    tokens: int = DEFAULT_TOKENS,
    users: int = DEFAULT_USERS,
    dtype: str = DEFAULT_KV_DTYPE,
    measure: bool = False,
    device: str | None = None,
) -> None:
    """Every check of ``kv_report``'s options; none needs the model."""
    if tokens < 1 or users < 1:
        raise InputError(f"--tokens and --users must be at least 1 (got {tokens} and {users})")
    whole(tokens, "--tokens", 1, MAX_COUNT)
    whole(users, "--users", 1, MAX_COUNT)
    check_kv_dtype(dtype)
    if model is not None and config is not None:
        raise InputError("give either MODEL or --config, not both")
    if measure:
        check_measure(dtype, device)


def kv_report(
    *,
    model: str | None = None,
    config: str | Path | None = None,
    tokens: int = DEFAULT_TOKENS,
    users: int = DEFAULT_USERS,
    dtype: str = DEFAULT_KV_DTYPE,
    measure: bool = False,
    device: str | None = None,
) -> KVReport:
    """The KV cache of MODEL (or a config.json) for ``tokens`` per user and ``users`` users.

    With ``measure`` the model (random weights from a ``--config``) runs once on a ``tokens``-token
    prompt with the cache on, and the bytes of the key/value tensors it allocated are summed.
    """
    check_options(model=model, config=config, tokens=tokens, users=users, dtype=dtype, measure=measure, device=device)
    arch, raw = resolve_architecture(model, config)
    if measure:  # before the model is built or loaded
        check_forward_fits(arch, raw, tokens, kv_dtype(dtype), check_measure(dtype, device), random_weights=config is not None)
    per_token = arch.kv_bytes_per_token(dtype)
    variants = []
    for label, kv in (("this model", arch.kv_heads), ("MHA (kv heads = heads)", arch.heads), ("MQA (1 kv head)", 1)):
        pt = arch.kv_bytes_per_token(dtype, kv_heads=kv)
        variants.append(
            {"attention": label, "kv_heads": kv, "bytes_per_token": pt, "total_bytes": pt * tokens * users,
             "relative_to_model": pt / per_token}
        )
    splits = [{"users": u, "tokens": t, "resident_tokens": u * t, "total_bytes": per_token * u * t} for u, t in EQUIVALENT_SPLITS]
    measured = None
    if measure:
        measured = measure_kv(model=model, config_dict=raw if config is not None else None, tokens=tokens, dtype=dtype, device=device)
        measured["formula_bytes"] = per_token * tokens
        measured["matches_formula"] = measured["bytes"] == per_token * tokens
    return KVReport(arch, dtype, tokens, users, per_token, per_token * tokens * users, variants, splits, measured)


# --------------------------------------------------------------------------- measurement


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The key and value tensors held by a transformers cache (``DynamicCache.layers``, or legacy tuples)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for layer in layers:
            out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
        return out
    if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) format
        return [t for pair in cache for t in pair if isinstance(t, torch.Tensor)]
    raise ModelLoadError(f"unrecognised cache object {type(cache).__name__}; qkit kv --measure needs a transformers DynamicCache")


def allocated_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what was allocated, not what a view shows)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name a model's ``forward`` takes its cache under (``cache`` in transformers 5, else ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def hf_config(config_dict: dict[str, Any]) -> Any:
    """The transformers config of a config dict, validated as transformers validates it (heads that do not
    divide the hidden size, ...): one ``ModelLoadError`` line, and cheap (no weights), so a command calls it
    before its status line."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = dict(config_dict)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ModelLoadError("the config has no 'model_type'; pass a Hugging Face config.json")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # transformers' config validation raises its own types (StrictDataclass...Error)
        cause = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelLoadError(f"cannot build a {model_type} model from the config ({cause}); fix the config.json") from exc


def model_from_config(config_dict: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = MEASURE_SEED):
    """A causal LM with seeded random weights built from a config dict (no weights are read)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(config_dict)
    try:
        torch.manual_seed(seed)
        # explicit: a --config never runs code (an auto_map would make transformers ask on stdin)
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a config it cannot build
        cause = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelLoadError(f"cannot build a {config.model_type} model from the config ({cause}); fix the config.json") from exc
    return lm.eval().to(device)


def check_measure(dtype: str, device: str | None) -> torch.device:
    """Refuse a cache dtype the model cannot run in, or a bad device, before anything is loaded."""

    if kv_dtype(dtype).itemsize < 2:
        raise InputError(f"--measure runs the model in the cache dtype, and {dtype} models do not run here; use fp16, bf16 or fp32")
    return parse_device(device)


def measure_kv(
    *,
    model: str | None = None,
    config_dict: dict[str, Any] | None = None,
    tokens: int = DEFAULT_TOKENS,
    dtype: str = DEFAULT_KV_DTYPE,
    device: str | None = None,
) -> dict[str, Any]:
    """Run the model in ``dtype`` on ``tokens`` seeded random token ids with the cache on; sum the cache.

    Returns ``{"bytes", "tensors", "layers", "tokens", "dtype", "shape"}``; ``bytes`` is the sum of the
    distinct storages of the cache's key and value tensors (shape ``[1, kv_heads, tokens, head_dim]``).
    """

    torch_dtype = kv_dtype(dtype)
    dev = check_measure(dtype, device)
    if config_dict is not None:
        lm = model_from_config(config_dict, torch_dtype, dev)
    else:
        lm = load(model, device=dev, dtype=torch_dtype).model
    vocab = int(lm.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(MEASURE_SEED)).to(dev)
    with torch.inference_mode():
        out = lm(input_ids=ids, use_cache=True, logits_to_keep=1)
    tensors = cache_tensors(output_cache(out))
    if not tensors:
        raise ModelLoadError("the model returned no KV cache; qkit kv --measure needs a decoder that supports use_cache")
    return {
        "bytes": allocated_bytes(tensors),
        "tensors": len(tensors),
        "layers": len(tensors) // 2,
        "tokens": tokens,
        "dtype": str(tensors[0].dtype).removeprefix("torch."),
        "shape": list(tensors[0].shape),
        "seed": MEASURE_SEED,
    }


def human_bytes(n: float) -> str:
    """Binary units (KiB, MiB, GiB), the units GPU memory is sold in."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"
