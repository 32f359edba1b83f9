"""The weight-transform layer: which tensors are quantized (rules), with what scheme, and the manifest.

Every command is a view of this layer: ``quantize`` writes what ``quantize_state_dict`` yields,
``inspect`` measures what it throws away, ``eval`` loads what it keeps into a model.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from qkit.errors import CheckpointError, InputError, SchemeError
from qkit.lists import check_words, empty, shown
from qkit.schemes import GGMLScheme, QuantizedTensor, Recipe, Scheme, get_scheme, quantize_tensor, scheme_names
from qkit.schemes.registry import scheme_from_dict
from qkit.version import __version__

MANIFEST_FORMAT = "qkit"
MANIFEST_VERSION = 1

# A projection inside a transformer block: 2-D, ``.weight``, under ``layers.N`` / ``h.N`` / ``blocks.N``
# (llama, qwen, mistral, gpt-2, ...), and not a norm or an embedding.
_BLOCK = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")
_NOT_PROJ = re.compile(r"norm|embed|(^|\.)ln_")
# A mixture-of-experts router: one row per expert, whose outputs pick the experts (a rounding flips a token's
# choice, a discrete change no error metric of the matrix shows). llama.cpp keeps it in F32
# (``ffn_gate_inp``, never quantized), and so does qkit: qwen-moe/deepseek ``mlp.gate``, mixtral
# ``block_sparse_moe.gate``, gpt-oss ``mlp.router``, qwen2-moe's ``shared_expert_gate``.
_ROUTER = re.compile(r"\.(mlp\.gate|block_sparse_moe\.gate|mlp\.router|shared_expert_gate)\.weight$")


def is_router(name: str) -> bool:
    """True for a mixture-of-experts router's weight (kept unquantized, as llama.cpp keeps ``ffn_gate_inp``)."""
    return bool(_ROUTER.search(name))


def is_block_projection(name: str, shape: tuple[int, ...]) -> bool:
    """True for the default targets: the 2-D linear weights inside the transformer blocks, a
    mixture-of-experts router's excepted (``is_router``)."""
    return (len(shape) == 2 and name.endswith(".weight") and bool(_BLOCK.search(name)) and not _NOT_PROJ.search(name)
            and not is_router(name))


# vLLM's ``packed_modules_mapping`` for llama-style models (llama, mistral, qwen2/3, their MoE experts and
# shared experts): the fused module it serves and the checkpoint shards it loads into it. phi3 stores
# ``qkv_proj`` / ``gate_up_proj`` fused already: one tensor, no group.
FUSED_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_key(name: str, modules: dict[str, tuple[str, ...]] = FUSED_MODULES) -> str | None:
    """The fused module ``name`` (a ``....SHARD.weight``) is loaded into, ``PREFIX.FUSED`` (one per layer, per
    expert), or None for a tensor no fused module holds. ``modules``: fused name -> shard names
    (``FUSED_MODULES``, plus mixtral's ``w13: (w1, w3)`` per expert: ``methods.experts.fused_modules``)."""
    if not name.endswith(".weight"):
        return None
    stem = name.removesuffix(".weight")
    prefix, _, last = stem.rpartition(".")
    fused = next((f for f, shards in modules.items() if last in shards), None)
    return None if fused is None else f"{prefix}.{fused}" if prefix else fused


def fused_groups(names: Iterable[str], modules: dict[str, tuple[str, ...]] = FUSED_MODULES) -> dict[str, list[str]]:
    """``PREFIX.FUSED`` -> the names (in the order given) of its shards among ``names``, for every fused module
    with at least two of them (``fused_key``)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        if (key := fused_key(n, modules)) is not None:
            groups.setdefault(key, []).append(n)
    return {k: v for k, v in groups.items() if len(v) > 1}


KEEP_ORIGINAL = "none"  # the scheme word in ``--keep none:GLOB`` that leaves a tensor unquantized
_KEEP_ALIASES = {"int8": "int8-row", "int4": "int4-g128"}


@dataclass(frozen=True)
class Rules:
    """Which tensors get which scheme.

    A tensor is a candidate when it is a block projection (``is_block_projection``), a tensor the default
    scheme's file quantizes beyond them (a recipe's ``token_embd`` and ``output``: ``Recipe.quantizes``,
    llama-quantize's whole file), or matches an ``include`` glob, and is not matched by an ``exclude`` glob. A candidate gets the scheme of the
    first ``overrides`` glob it matches (``--keep SCHEME:GLOB``; scheme ``none`` keeps it unquantized),
    else the default scheme. Globs are ``fnmatch`` patterns over full tensor names (``*`` crosses dots).
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    overrides: tuple[tuple[str, Scheme | None], ...] = field(default=())

    def scheme_for(self, name: str, shape: tuple[int, ...], default: Scheme) -> Scheme | None:
        candidate = (is_block_projection(name, shape) or (isinstance(default, Recipe) and default.quantizes(name, shape))
                     or any(fnmatch.fnmatchcase(name, g) for g in self.include))
        if not candidate or any(fnmatch.fnmatchcase(name, g) for g in self.exclude):
            return None
        for glob, scheme in self.overrides:
            if fnmatch.fnmatchcase(name, glob):
                return scheme
        return default

    @classmethod
    def parse(
        cls,
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
        keep: Iterable[str] = (),
        scale_dtype: str | torch.dtype | None = None,
    ) -> Rules:
        """Build rules from CLI words; ``keep`` items are ``SCHEME:GLOB`` (``int8:*.down_proj.*``). An empty
        value of any of them is refused (``qkit.lists.check_words``)."""
        include = check_words(include, "--include", what="glob", where="e.g. '*.mlp.*'")
        exclude = check_words(exclude, "--exclude", what="glob", where="e.g. '*.layers.0.*'")
        overrides: list[tuple[str, Scheme | None]] = []
        for item in check_words(keep, "--keep", what="SCHEME:GLOB", where="e.g. int8:'*.mlp.down_proj.weight'"):
            word, sep, glob = item.partition(":")
            if not sep or not glob or not word:
                raise InputError(f"--keep {shown(item)} must be SCHEME:GLOB, e.g. int8:'*.mlp.down_proj.weight'")
            word = word.strip().lower()
            scheme = None if word == KEEP_ORIGINAL else get_scheme(_KEEP_ALIASES.get(word, word), scale_dtype)
            overrides.append((glob, scheme))
        return cls(tuple(include), tuple(exclude), tuple(overrides))

    def check_matches(self, names: Iterable[str], model: str = "the model") -> None:
        """Refuse a glob that matches no tensor name of the model (``names``: every tensor's): a typo would
        otherwise change nothing in silence. ``--tensor-type`` refuses a pattern that matches nothing the same way."""
        names = list(names)
        for option, globs in (("--include", self.include), ("--exclude", self.exclude),
                              ("--keep", tuple(g for g, _ in self.overrides))):
            for glob in globs:
                if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                    example = next((n for n in names if is_block_projection(n, (2, 2))), names[0] if names else "")
                    raise InputError(f"{option} {shown(glob)} matches no tensor of {model} (globs match whole names, "
                                     f"e.g. {example}); check the glob, or drop it")


@dataclass(frozen=True)
class TensorTypes:
    """Per-tensor types in ``llama-quantize --tensor-type`` terms: ``PATTERN=TYPE`` words.

    As ``llama_tensor_get_type`` applies them (``src/llama-quant.cpp`` at the pinned commit): ``PATTERN``
    is lowercased and searched (``std::regex_search``: anywhere in the name, ECMAScript syntax, which
    Python's ``re`` reads the same for these patterns) in each quantized tensor's **llama.cpp name**
    (``blk.3.attn_v.weight``); the first pattern that matches sets the tensor's type, replacing the
    recipe's choice for it; the type's width fallback still applies (``resolve``). ``TYPE`` is a ggml type
    name, any case (``q6_K``, ``Q8_0``, ``iq4_xs``), that qkit writes. Where llama-quantize quietly ignores a
    pattern that matches nothing, qkit refuses it (a typo would otherwise pass unnoticed).
    """

    words: tuple[str, ...] = ()
    patterns: tuple[tuple[re.Pattern, Scheme], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.words)

    @classmethod
    def parse(cls, words: Iterable[str]) -> TensorTypes:
        """``PATTERN=TYPE`` words -> the overrides. Refused in one line, naming the word and its bad piece:
        an empty word, a control character or a word over ``MAX_TENSOR_TYPE`` characters, no ``=``, no
        PATTERN or no TYPE, a PATTERN that is not a regular expression, a TYPE qkit does not write, and a
        PATTERN given twice (the first match wins: the second could never apply)."""
        words = tuple(words)
        patterns = []
        seen: dict[str, str] = {}
        for word in words:
            where = f"--tensor-type {shown(word)}"
            if not word.strip():
                raise empty("--tensor-type", "PATTERN=TYPE", "e.g. 'attn_v=q8_0'", one=True)
            if any(ord(c) < 32 or ord(c) == 127 for c in word):
                raise InputError(f"{where} holds a control character; write PATTERN=TYPE in printable characters")
            if len(word) > MAX_TENSOR_TYPE:
                raise InputError(f"{where} is {len(word):,} characters long; a pattern over llama.cpp's tensor names "
                                 f"(blk.3.attn_v.weight) needs far fewer (at most {MAX_TENSOR_TYPE:,})")
            pattern, sep, type_name = word.partition("=")
            missing = [w for w, v in (("no PATTERN before the '='", pattern), ("no TYPE after it", type_name)) if not v.strip()]
            if not sep or missing:
                why = f"has {' and '.join(missing)}" if sep else "has no '='"
                raise InputError(f"{where} {why}: write PATTERN=TYPE, e.g. 'attn_v=q8_0' or 'blk\\.1[0-9]\\.ffn_down=q6_K'")
            try:
                rx = re.compile(pattern.lower())
            except re.error as exc:
                raise InputError(f"{where}: {shown(pattern)} is not a regular expression ({exc})") from None
            scheme = ggml_scheme(type_name, where)
            key = pattern.lower()
            if key in seen:
                first = seen[key]
                same = first.partition("=")[2].strip().lower() == type_name.strip().lower()
                raise InputError(f"{where}: the pattern {shown(pattern)} is already given as {shown(first)}"
                                 + ("" if same else " with another type") + "; the first match wins, so give each pattern once")
            seen[key] = word
            patterns.append((rx, scheme))
        return cls(words, tuple(patterns))

    def check_format(self, format: str, stores_llama_types: bool, takes: Sequence[str]) -> None:
        """Refuse overrides a format cannot store: ``format`` (its registered name) stores llama.cpp's block
        types or not (``export.Format.stores_llama_types``); ``takes``: the formats that do, for the message."""
        if self and not stores_llama_types:
            (_, scheme), word = self.patterns[0], self.words[0]
            raise InputError(f"--tensor-type {shown(word)}: --format {format} cannot store {scheme.name} (a llama.cpp "
                             f"block type); --tensor-type goes with --format {' or '.join(takes)}")

    def apply(self, targets: dict[str, Scheme], llama_names: dict[str, str]) -> dict[str, Scheme]:
        """``targets`` with the overridden tensors' schemes replaced (``llama_names``: Hugging Face name ->
        llama.cpp name of every tensor)."""
        out = dict(targets)
        used = [False] * len(self.patterns)
        for name in targets:
            g = llama_names.get(name)
            if g is None:
                continue
            for i, (rx, scheme) in enumerate(self.patterns):
                if rx.search(g):
                    out[name], used[i] = scheme, True
                    break
        for i, (word, u) in enumerate(zip(self.words, used)):
            if u:
                continue
            names = [llama_names[n] for n in targets if n in llama_names]
            rx = self.patterns[i][0]
            taken = next((self.words[j] for j in range(i) if any(rx.search(g) and self.patterns[j][0].search(g)
                                                                  for g in names)), None)
            if taken is not None:
                raise InputError(f"--tensor-type {shown(word)}: every tensor it matches is taken by the earlier "
                                 f"{shown(taken)} (the first match wins); give it first, or narrow the earlier pattern")
            raise InputError(f"--tensor-type {shown(word)} matches no tensor that is quantized (llama.cpp names, "
                             "e.g. blk.0.attn_v.weight); check the pattern, or --include the tensor")
        return out


MAX_TENSOR_TYPE = 1000  # characters of one PATTERN=TYPE word: llama.cpp's names are some 30


def ggml_scheme(type_name: str, what: str) -> Scheme:
    """The qkit scheme of a ggml type name (``q6_K`` -> ``q6_k``), refusing one qkit does not write."""
    word = type_name.strip().lower()
    if word in ("f16", "f32", "bf16"):
        raise InputError(f"{what}: qkit keeps a tensor unquantized with --keep none:GLOB (in the source dtype), not as {type_name}")
    try:
        scheme = get_scheme(word)
    except SchemeError:
        scheme = None
    if not isinstance(scheme, GGMLScheme):  # None, another family, or a recipe (a mix, not one type)
        raise InputError(f"{what}: {type_name!r} is not a ggml block type qkit writes ({', '.join(ggml_type_names())})")
    return scheme


def ggml_type_names() -> list[str]:
    """The llama.cpp block types qkit writes (``GGMLScheme``s), in registry order: what ``ggml_scheme`` takes."""
    return [n for n in scheme_names() if isinstance(get_scheme(n), GGMLScheme)]


def assign_schemes(
    shapes: Iterable[tuple[str, tuple[int, ...]]], scheme: Scheme, rules: Rules | None = None
) -> dict[str, Scheme | None]:
    """Which scheme each tensor gets under ``rules`` with default ``scheme``: ``{name: scheme or None}`` (None:
    kept as it is) for every tensor, in the given order."""
    rules = rules or Rules()
    return {name: rules.scheme_for(name, shape, scheme) for name, shape in shapes}


def quantize_state_dict(
    tensors: Iterable[tuple[str, torch.Tensor]],
    scheme: Scheme,
    rules: Rules | None = None,
    *,
    on_tensor: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor]]:
    """Stream ``(name, tensor)`` -> ``(name, QuantizedTensor)`` for targets, ``(name, tensor)`` otherwise.

    One tensor at a time: memory is bounded by the largest tensor, whatever the iterable holds.
    """
    rules = rules or Rules()
    for name, w in tensors:
        s = rules.scheme_for(name, tuple(w.shape), scheme)
        yield name, (quantize_tensor(w, s, name=name) if s is not None else w)
        if on_tensor is not None:
            on_tensor(name)


def manifest_entry(qt: QuantizedTensor) -> dict:
    return {"scheme": qt.scheme.to_dict(), "shape": list(qt.shape), "dtype": str(qt.dtype).removeprefix("torch.")}


def new_manifest(scheme: Scheme, rules: Rules | None = None) -> dict:
    """The checkpoint-level manifest; ``tensors`` is filled per quantized tensor by the writer."""
    rules = rules or Rules()
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "qkit_version": __version__,
        "scheme": scheme.to_dict(),
        "rules": {
            "include": list(rules.include),
            "exclude": list(rules.exclude),
            "keep": [[g, s.name if s else KEEP_ORIGINAL] for g, s in rules.overrides],
        },
        "tensors": {},
    }


# The original dtypes a quantized weight can have: quantize_tensor takes floating-point weights only.
_FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)}


def entry_to_spec(entry: dict, name: str = "<tensor>") -> tuple[Scheme, tuple[int, ...], torch.dtype]:
    """Read one manifest tensor entry back: ``(scheme, shape, original dtype)``.

    Raises ``CheckpointError`` naming ``name`` for an entry that is not ``{"scheme": {...}, "shape": [int
    >= 1, ...], "dtype": a floating-point dtype}`` or whose scheme the registry
    does not rebuild exactly (``scheme_from_dict``).
    """
    if not isinstance(entry, dict):
        raise CheckpointError(f"manifest entry of tensor {name} is {type(entry).__name__}, not an object; re-create the checkpoint")
    missing = [k for k in ("scheme", "shape", "dtype") if k not in entry]
    if missing:
        raise CheckpointError(f"manifest entry of tensor {name} has no {', '.join(missing)}; re-create the checkpoint")
    shape = entry["shape"]
    # bool is an int in Python and 64.0 is not a JSON integer: both are tampering, not shapes.
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise CheckpointError(
            f"manifest entry of tensor {name} has shape {shape!r}, not a list of positive integers; re-create the checkpoint"
        )
    dtype = _FLOAT_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"manifest entry of tensor {name} has dtype {entry['dtype']!r}, not one of {', '.join(_FLOAT_DTYPES)}; "
            "re-create the checkpoint"
        )
    try:
        scheme = scheme_from_dict(entry["scheme"])
    except SchemeError as exc:
        raise CheckpointError(f"tensor {name}: {exc}") from None
    return scheme, tuple(shape), dtype


def shapes_fingerprint(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """sha256 of every tensor's ``name:shape`` line, sorted by name: which model a plan or an importance
    matrix was made for, without its weights."""
    lines = "".join(f"{n}:{','.join(map(str, s))}\n" for n, s in sorted(shapes))
    return hashlib.sha256(lines.encode()).hexdigest()


