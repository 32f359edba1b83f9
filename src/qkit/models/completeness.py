"""Completeness: the tensors a config implies against the tensors the files store (headers only).

Layer 4 (``models``): above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below
methods, export, simulate, serving (5), evaluation (6), inspect, api and cli (7).

transformers initialises at random any weight the config implies but the files lack, and ignores stored
tensors the config does not describe. ``check_complete`` compares the two (headers only) before any work.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.errors import ModelLoadError
from qkit.models.files import ModelRef, _cause, _denied, quiet_progress


@dataclass(frozen=True)
class _Expected:
    """The state dict a config implies: ``shapes`` of the tensors a checkpoint must store, ``aliases``
    (a tied name -> the stored name it shares, e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``),
    and the names transformers itself ignores when missing or unexpected."""

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]
    ignore_missing: tuple[str, ...]
    ignore_unexpected: tuple[str, ...]
    buffers: frozenset[str]  # last name part of non-persistent buffers (rotary inv_freq): never stored
    linears: tuple[str, ...]  # every nn.Linear module (tied ones included), sorted: what export formats target
    # transformers renames or fuses this architecture's stored tensors on load (MoE experts: per-expert
    # w1/w3 -> gate_up_proj): stored names are not state-dict names, so they cannot be compared here.
    converted: bool = False

def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: the meta device makes initialisation free anyway
        return contextlib.nullcontext()
    return no_init_weights()

@functools.lru_cache(maxsize=16)
def _expected_cached(directory: str, stamp: tuple, trust_remote_code: bool) -> _Expected:
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_progress()
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        if hasattr(config, "quantization_config"):  # a qkit checkpoint: the plain model's state dict
            del config.quantization_config
        with torch.device("meta"), _no_init():  # no memory, no initialisation: ~15 ms once imported
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise ModelLoadError(f"cannot build the model {directory}/config.json describes ({_cause(exc)}); "
                             "fix the config or pass a model of an architecture transformers knows") from exc
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    if not tied and getattr(config, "tie_word_embeddings", False):  # transformers < 5
        emb, out = model.get_input_embeddings(), model.get_output_embeddings()
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        if emb is not None and out is not None:
            tied = {names.get(id(out.weight), "lm_head.weight"): names.get(id(emb.weight), "model.embed_tokens.weight")}
    state = model.state_dict()  # persistent parameters and buffers only, as save_pretrained stores them
    persistent = set(state)
    buffers = frozenset(n.rpartition(".")[2] for n, _ in model.named_buffers() if n not in persistent)
    return _Expected(
        {k: tuple(v.shape) for k, v in state.items() if k not in tied},
        {k: v for k, v in tied.items() if v in state},
        tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        buffers,
        tuple(sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear)),
        _converted(model),
    )

def _converted(model) -> bool:
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:  # transformers < 5 loads stored names as they are
        return False
    return bool(extract_weight_conversions_for_model(model))

def _expected(directory: Path, trust_remote_code: bool) -> _Expected:
    config = Path(directory) / "config.json"
    try:
        st = config.stat()
    except PermissionError as exc:
        raise _denied(config, exc) from exc
    except OSError as exc:
        raise ModelLoadError(f"{directory} has no config.json; pass a Hugging Face model directory") from exc
    # Keyed by the config's identity: quantize checks, then its method loads the same ref: built once.
    return _expected_cached(str(Path(directory).resolve()), (st.st_mtime_ns, st.st_size), bool(trust_remote_code))

def expected_tensors(directory: Path, *, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors the config in ``directory`` implies a checkpoint stores.

    Built on the meta device from config.json (no weights read): the model's persistent state dict, less
    tied weights (``lm_head.weight`` under ``tie_word_embeddings``, stored once as the embedding) and
    non-persistent buffers (rotary ``inv_freq``). Raises ``ModelLoadError`` for a config transformers
    cannot build.
    """
    return dict(_expected(Path(directory), trust_remote_code).shapes)

def linear_modules(directory: Path, *, trust_remote_code: bool = False) -> list[str]:
    """Names of every ``nn.Linear`` module of the model in ``directory`` (tied ones included), from the same
    meta-device build as ``expected_tensors`` (built once per config)."""
    return list(_expected(Path(directory), trust_remote_code).linears)

def _logical_shapes(ref: ModelRef, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A qkit checkpoint's stored parts (``W.qweight``, ``W.scales``, ...) mapped back to ``W`` with the
    original shape its manifest records; other tensors as stored."""
    manifest = read_manifest(ref.directory) or {}
    entries = manifest.get("tensors")
    if not isinstance(entries, dict):
        raise ModelLoadError(f"checkpoint {ref.directory}: its qkit manifest has no 'tensors' table; re-create it")
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in stored.items():
        base, dot, _ = key.rpartition(".")
        if dot and base in entries:
            entry = entries[base]
            orig = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(orig, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in orig):
                raise ModelLoadError(f"checkpoint {ref.directory}: the manifest entry of {base} has no valid shape; "
                                     "re-create the checkpoint")
            out[base] = tuple(orig)
        else:
            out[key] = tuple(shape)
    return out

def _names(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")

def check_complete(ref: ModelRef, *, trust_remote_code: bool = False) -> None:
    """Refuse (``ModelLoadError``, one line) a model whose stored tensors are not what its config implies.

    Compares ``expected_tensors`` with the safetensors headers (``tensor_shapes``; no data read), a qkit
    checkpoint's quantized parts mapped back to their weights. Missing tensors would be initialised at
    random by transformers; a wrong shape makes it fail with "look at the above report" and nothing
    above; unexpected tensors (``model.layers.2.*`` of a 2-layer config, a renamed tensor) would be
    silently ignored by transformers yet quantized and counted by qkit, so they are refused too. Tensors
    transformers declares ignorable and stored non-persistent buffers (old checkpoints' ``inv_freq``) pass.
    Not checked: architectures whose stored tensors transformers renames or fuses on load (MoE experts in
    transformers 5), whose names only its converters can map.
    """
    exp = _expected(ref.directory, trust_remote_code or ref.trust_remote_code)
    if exp.converted:  # names differ by design (see _Expected.converted): transformers' own report applies
        return
    try:
        stored = dict(tensor_shapes(ref.directory))
    except PermissionError as exc:
        raise _denied(ref.directory, exc) from exc
    if ref.is_quantized:
        stored = _logical_shapes(ref, stored)
    present: dict[str, tuple[int, ...]] = {}
    for name, shape in stored.items():
        present.setdefault(exp.aliases.get(name, name), tuple(shape))
    missing = [n for n in exp.shapes if n not in present and not any(re.search(p, n) for p in exp.ignore_missing)]
    wrong = [n for n in exp.shapes if n in present and present[n] != exp.shapes[n]]
    unexpected = sorted(
        n for n in present if n not in exp.shapes and n not in exp.aliases
        and n.rpartition(".")[2] not in exp.buffers and not any(re.search(p, n) for p in exp.ignore_unexpected))
    if not (missing or wrong or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"missing {_names(missing)}{_whole_layers(missing, exp.shapes)}")
    if wrong:
        n = wrong[0]
        parts.append(f"{n} is stored as {list(present[n])} but the config implies {list(exp.shapes[n])}"
                     + (f" (and {len(wrong) - 1} more shapes differ)" if len(wrong) > 1 else ""))
    if unexpected:
        parts.append(f"unexpected {_names(unexpected)}, which the config does not describe")
    raise ModelLoadError(
        f"{ref.spec} does not hold the tensors its config.json implies: {'; '.join(parts)} "
        f"({len(missing)} missing, {len(wrong)} of the wrong shape, {len(unexpected)} unexpected); "
        "re-download or re-create the model, or fix config.json"
    )

_LAYER = re.compile(r"\.layers\.(\d+)\.")

def _whole_layers(missing: list[str], shapes: dict[str, tuple[int, ...]]) -> str:
    """`` (layers 2, 3 entirely)`` when whole layers are missing (a config declaring more layers than stored)."""
    def layer(n: str) -> int | None:
        m = _LAYER.search(n)
        return int(m.group(1)) if m else None

    by_layer: dict[int, set[str]] = {}
    for n in shapes:
        if (i := layer(n)) is not None:
            by_layer.setdefault(i, set()).add(n)
    gone = set(missing)
    whole = sorted(i for i, names in by_layer.items() if names <= gone)
    if not whole:
        return ""
    return f" (layer{'s' if len(whole) > 1 else ''} {_names([str(i) for i in whole], 4)} entirely)"
