"""What a model directory holds and what qkit refuses in it: the config, its sizes, pickled weights, custom code.

Layer 4 (``models``): above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below
methods, export, simulate, serving (5), evaluation (6), inspect, api and cli (7).

Security: never ``trust_remote_code`` unless asked; never unpickle ``.bin``/``.pt`` weights unless asked.
Every transformers call passes ``trust_remote_code`` explicitly: left unset, transformers *asks* on stdin
("Do you wish to run the custom code? [y/N]") and a piped "y" runs the repository's Python.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkit import pinned_models, reading
from qkit.checkpoint import weight_files
from qkit.errors import ModelLoadError
from qkit.jsonfields import BOOL, INT, NULL, NUMBER, STRING, Kind, check, list_of, obj
from qkit.jsontext import first_nonfinite

if TYPE_CHECKING:  # annotations only: transformers is imported where a model is loaded (``loading``)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = pinned_models.DEFAULT.title  # "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
_PICKLED = ("*.bin", "*.pt", "*.pth")
# Files copied next to the weights: tokenizer, generation config, chat template.
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class ModelRef:
    """A resolved MODEL argument. ``directory`` is local and holds config.json and weights."""

    kind: str  # "default" | "pinned" | "directory" | "qkit" | "gguf" | "hub"
    spec: str  # what the user gave (or the default's name)
    directory: Path
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)
    # The user allowed the model's own code (--trust-remote-code): every later load of this ref may run it.
    trust_remote_code: bool = field(default=False, compare=False)

    @property
    def is_quantized(self) -> bool:
        return self.kind == "qkit"

@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    ref: ModelRef
    manifest: dict | None = None


def _denied(path: Path | str, exc: OSError) -> ModelLoadError:
    """One line for a file qkit may not read (root is never refused, so this is a plain user's problem)."""
    return ModelLoadError(f"permission denied reading {exc.filename or path}; make it readable "
                          "(chmod/chown) or run as a user who may read it")

_CONFIG_FIX = "pass the model directory or its config.json"


def read_config(directory: Path) -> dict[str, Any]:
    """The parsed config.json of a model directory (or the config file itself, if given one).

    Also ``check_architecture``: sizes transformers would crash on are refused here, for every reader.
    """
    path = Path(directory)
    try:  # a FIFO, a device or a link loop, as the config or in its place: refused before it is opened
        if not path.is_dir():
            reading.check_existing(path, str(path), _CONFIG_FIX)
        path = path if path.is_file() else path / "config.json"
        reading.check_existing(path, str(path), _CONFIG_FIX)
        if not path.is_file():
            raise ModelLoadError(f"{directory} has no config.json; pass a Hugging Face model directory, a .gguf file or a hub id")
        text = reading.read_bytes(path, str(path), _CONFIG_FIX, limit=reading.MAX_JSON_BYTES)
    except PermissionError as exc:
        raise _denied(path, exc) from exc
    except IsADirectoryError as exc:
        raise ModelLoadError(f"{path} is a directory, not a config file; pass the model directory or its config.json") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc}); check the model files") from exc
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"malformed {path} ({exc}); fix the JSON or re-download the model") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"malformed {path}: no 'model_type' key; fix it or re-download the model")
    nonfinite = first_nonfinite(config)  # NaN or Infinity: copied into what quantize writes, which is strict JSON
    if nonfinite is not None:
        raise ModelLoadError(f"{path}: {nonfinite[0]} is {nonfinite[1]!r}, not a finite number; fix the config")
    check_config(config, str(path))
    check_architecture(config, str(path))
    return config

def check_config(config: Any, where: str = "config.json") -> dict[str, Any]:
    """``config`` (a parsed config.json) when every field qkit reads has its JSON type (``CONFIG``); else one
    ``ModelLoadError`` line naming ``where`` and the field (``qkit.jsonfields.check``)."""
    return check(config, CONFIG, where, fix="fix the config")

# --------------------------------------------------------------------------- what qkit reads, typed
# Every field of a model's JSON files that qkit (or a reader it hands the dict to) reads, with its JSON
# type: ``read_config`` checks them all once (``qkit.jsonfields.check``), so no reader meets a string
# where it reads an object. Sizes (hidden_size, ...) are checked by ``check_architecture``. A key not
# named here is not read by qkit and is left to transformers.

# A class reference map: {"AutoConfig": "module.Class", "AutoTokenizer": ["module.Slow", "module.Fast"]},
# or the legacy list form of a tokenizer's.
_CLASS_REFS = list_of(STRING | NULL)
AUTO_MAP: Kind = (obj(values=STRING | _CLASS_REFS | NULL) | _CLASS_REFS).named(
    "an object of class names or a list of them")

# compressed-tensors' QuantizationArgs and config groups, as qkit's readers (export/, the vLLM engine) read them
_QUANT_ARGS = obj({"type": STRING, "num_bits": INT, "strategy": STRING | NULL, "group_size": INT | NULL,
                   "symmetric": BOOL, "dynamic": BOOL | STRING})
_CONFIG_GROUP = obj({"targets": list_of(STRING), "weights": _QUANT_ARGS | NULL,
                     "input_activations": _QUANT_ARGS | NULL, "format": STRING | NULL})
QUANTIZATION_CONFIG = obj({
    "quant_method": STRING,
    "format": STRING | NULL,
    "config_groups": obj(values=_CONFIG_GROUP) | NULL,
    "ignore": list_of(STRING) | NULL,
    "load_in_4bit": BOOL, "load_in_8bit": BOOL, "bnb_4bit_quant_type": STRING | NULL,  # bitsandbytes'
})

_ROPE_FIELDS = {"rope_type": STRING, "type": STRING, "factor": NUMBER | NULL, "rope_theta": NUMBER | NULL,
                "original_max_position_embeddings": INT | NULL, "low_freq_factor": NUMBER,
                "high_freq_factor": NUMBER}
_ROPE = obj({**_ROPE_FIELDS, "full_attention": obj(_ROPE_FIELDS) | NULL})  # rope_parameters per layer type

_MODEL_FIELDS: dict[str, Kind] = {
    "model_type": STRING,
    "architectures": list_of(STRING) | NULL,
    "dtype": STRING | NULL,
    "torch_dtype": STRING | NULL,
    "tie_word_embeddings": BOOL,
    "rope_scaling": _ROPE | NULL,
    "rope_parameters": _ROPE | NULL,
    "rope_theta": NUMBER | NULL,
    "rms_norm_eps": NUMBER | NULL,
    "partial_rotary_factor": NUMBER | NULL,
    "original_max_position_embeddings": INT | NULL,
    "num_local_experts": INT | NULL, "num_experts": INT | NULL, "n_routed_experts": INT | NULL,
    "multi_query": BOOL,
    "attention_bias": BOOL,
    "_name_or_path": STRING,
}
CONFIG: Kind = obj({
    **_MODEL_FIELDS,
    "quantization_config": QUANTIZATION_CONFIG | NULL,
    "auto_map": AUTO_MAP,
    "text_config": obj(_MODEL_FIELDS) | NULL,  # a multimodal config's language model
})
TOKENIZER_CONFIG: Kind = obj({"auto_map": AUTO_MAP, "tokenizer_class": STRING | NULL, "add_prefix_space": BOOL | NULL})


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """``directory/tokenizer_config.json`` with the fields qkit reads checked (``TOKENIZER_CONFIG``); ``{}``
    when there is none, or it is not JSON (transformers then fails on it before any code runs, and
    ``load_tokenizer`` says why). A field of the wrong type is one ``ModelLoadError`` line naming it."""
    path = Path(directory) / "tokenizer_config.json"
    try:
        tok = json.loads(path.read_text()) if path.is_file() else {}
    except PermissionError as exc:
        raise _denied(path, exc) from exc
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return check(tok, TOKENIZER_CONFIG, str(path), fix="fix the tokenizer config")

# Sizes every causal LM config names (llama-style and GPT-2-style keys): each must be a positive integer.
_SIZE_KEYS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_head", "n_layer", "n_positions",
)

def check_architecture(config: Mapping[str, Any], name: str = "config.json") -> None:
    """Refuse (``ModelLoadError``, one line) a config whose sizes transformers or qkit would crash on.

    Positive integer sizes; ``num_attention_heads`` divides ``hidden_size`` unless ``head_dim`` is given;
    ``num_key_value_heads`` divides ``num_attention_heads``; with rotary embeddings, an even rotary
    dimension (``head_dim * partial_rotary_factor``; RoPE rotates pairs). A multimodal config's
    ``text_config`` is checked the same way. ``name`` is what the message calls the config.
    """
    configs = [(name, config)]
    if isinstance(config.get("text_config"), Mapping):
        configs.append((f"{name} text_config", config["text_config"]))
    for where, cfg in configs:
        for key in _SIZE_KEYS:
            value = cfg.get(key)
            if value is None:  # absent, or null (head_dim: null means hidden_size // heads)
                continue
            # A per-layer list (gemma3n's intermediate_size) is fine when every entry is a size.
            if not all(_positive_int(v) for v in (value if isinstance(value, list) and value else [value])):
                raise ModelLoadError(f"{where}: {key} is {value!r}, not a positive integer; fix the config")

        def size(key: str, alt: str | None = None) -> int | None:
            value = cfg.get(key, cfg.get(alt) if alt else None)
            return value if _positive_int(value) else None  # lists: no arithmetic rule applies

        hidden, heads, head_dim = size("hidden_size", "n_embd"), size("num_attention_heads", "n_head"), size("head_dim")
        if hidden and heads and head_dim is None:
            if hidden % heads:
                raise ModelLoadError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                     "(and no head_dim is given); fix the config")
            head_dim = hidden // heads
        kv = size("num_key_value_heads")
        if heads and kv and heads % kv:
            raise ModelLoadError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                                 "fix the config")
        factor = cfg.get("partial_rotary_factor", 1.0)
        rotary = any(k in cfg for k in ("rope_theta", "rope_scaling", "rope_parameters"))
        if rotary and head_dim and isinstance(factor, (int, float)) and int(head_dim * factor) % 2:
            raise ModelLoadError(f"{where}: the rotary dimension {int(head_dim * factor)} (head_dim {head_dim}) is odd; "
                                 "RoPE rotates pairs of dimensions, fix the config")

def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0  # bool is an int in Python

def _check_weights(directory: Path, allow_pickle: bool) -> None:
    if weight_files(directory):
        return
    pickled = [p.name for g in _PICKLED for p in directory.glob(g)]
    if pickled and not allow_pickle:
        raise ModelLoadError(
            f"{directory} holds only pickled weights ({', '.join(sorted(pickled)[:3])}), which can run code when "
            "loaded; convert them to safetensors, or pass --allow-pickle if you trust the source"
        )
    if not pickled:
        raise ModelLoadError(f"{directory} has no *.safetensors weights; pass a complete model directory")


def _auto_map_keys(auto_map: Any) -> list[str]:
    if isinstance(auto_map, Mapping):
        return [str(k) for k in auto_map]
    return ["AutoTokenizer"] if auto_map else []  # the legacy list form names a tokenizer

def custom_code(directory: Path, config: Mapping[str, Any] | None = None) -> list[str]:
    """What in ``directory`` transformers could only honour by running the repository's own Python.

    ``config.json``'s ``auto_map`` when its ``model_type`` has no built-in causal LM (with a built-in one,
    transformers uses its own code when ``trust_remote_code=False``); ``tokenizer_config.json``'s
    ``auto_map`` when its ``tokenizer_class`` is not one transformers has (a built-in fallback would be a
    different tokenizer than the repository's). Returns lines such as ``"config.json auto_map: AutoConfig"``.
    """
    directory = Path(directory)
    config = read_config(directory) if config is None else config
    found = []
    keys = _auto_map_keys(config.get("auto_map"))
    if keys:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            found.append(f"config.json auto_map: {', '.join(keys)}")
    tok = read_tokenizer_config(directory)
    auto_map = tok.get("auto_map")
    if isinstance(auto_map, Mapping):
        auto_map = auto_map.get("AutoTokenizer")
    if auto_map:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tok.get("tokenizer_class")
        known = isinstance(cls, str) and any(
            tokenizer_class_from_name(c) is not None for c in (cls, cls.removesuffix("Fast"), cls.removesuffix("Fast") + "Fast"))
        if not known:
            found.append(f"tokenizer_config.json auto_map: AutoTokenizer ({cls or 'no tokenizer_class'})")
    return found

# The commands that take --trust-remote-code, in `qkit --help`'s order, named by the refusal below. The CLI
# is layers above this module, so the list is written here and checked against the CLI's options by
# tests/test_adversarial_round3_processes.py.
TRUST_REMOTE_CODE_COMMANDS = ("quantize", "imatrix", "plan", "eval", "verify")


def check_remote_code(directory: Path, spec: str, trust_remote_code: bool, config: Mapping[str, Any] | None = None) -> None:
    """Refuse, in one line and before any work, a model that needs its own code unless the user trusts it."""
    if trust_remote_code:
        return
    found = custom_code(directory, config)
    if found:
        commands = ", ".join(f"qkit {c}" for c in TRUST_REMOTE_CODE_COMMANDS)
        raise ModelLoadError(
            f"{spec} needs custom code from its repository ({'; '.join(found)}); qkit never runs it unless asked: "
            f"pass --trust-remote-code ({commands}) if you trust it"
        )


def quiet_progress() -> None:
    """Turn off the progress bars transformers and huggingface_hub draw ("Loading weights", downloads):
    qkit reports its own steps. Also silences transformers' warnings below errors."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()

def _cause(exc: BaseException, limit: int = 200) -> str:
    """One line of an exception's message; transformers' config validation wraps the real ``ValueError``
    ("The hidden size (64) is not a multiple of ...") in a validator error: name the real one."""
    inner = exc.__cause__ if type(exc).__name__ == "StrictDataclassClassValidationError" and exc.__cause__ else exc
    return (" ".join(str(inner).split()) or type(inner).__name__)[:limit]

def _auto_map_refs(auto_map: Any) -> list[str]:
    """Every class reference in an ``auto_map`` (``"module.Class"``, ``"repo--module.Class"``; a value may
    be a list such as ``[slow, fast]``, ``None`` for an absent one)."""
    values = auto_map.values() if isinstance(auto_map, Mapping) else ([auto_map] if auto_map else [])
    out: list[str] = []
    for v in values:
        out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, str))
    return out


def code_files(directory: Path) -> list[str]:
    """The Python files of ``directory`` that its config's and tokenizer config's ``auto_map`` name
    (``module.Class`` -> ``module.py``; transformers splits a reference at its one dot): only plain file
    names that exist as regular files inside ``directory`` (a reference into another repository,
    ``repo--module.Class``, is not this directory's)."""
    directory = Path(directory)
    refs: list[str] = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((directory / name).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict):
            refs += _auto_map_refs(data.get("auto_map"))
    found = []
    for ref in refs:
        if "--" in ref or ref.count(".") != 1:
            continue
        module = ref.split(".")[0] + ".py"
        path = directory / module
        if os.sep in module or module.startswith(".") or not path.is_file() or path.is_symlink():
            continue
        found.append(module)
    return sorted(set(found))


def copy_aux_files(src: Path, dst: Path, *, trust_remote_code: bool = False) -> None:
    """Copy tokenizer and generation-config files (never weights) from one model directory to another;
    with ``trust_remote_code``, also the model's own Python files its ``auto_map`` names (``code_files``),
    without which the copy's config could not be loaded (``qkit verify --trust-remote-code``)."""
    names = [*AUX_FILES, *(code_files(src) if trust_remote_code else [])]
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
