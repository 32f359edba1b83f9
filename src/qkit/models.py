"""Resolve a MODEL argument to a local model directory, and load it.

``MODEL`` may be:

1. a local Hugging Face model directory with safetensors weights;
2. a hub id such as ``Qwen/Qwen2.5-0.5B`` (fetched where the hub is reachable; offline, one clear error);
3. a ``.gguf`` file, dequantized through transformers' GGUF support and converted once into a cached
   fp32 safetensors directory (keyed by the file's sha256);
4. a qkit quantized checkpoint directory (dequantized on load);
5. nothing: the pinned default model, SmolLM2-135M-Instruct, whose weights were *published* in Q4_1
   GGUF; qkit dequantizes them to fp32, so its "reference" means "the published weights, dequantized".

Security: never ``trust_remote_code`` unless asked; never unpickle ``.bin``/``.pt`` weights unless asked.
Every transformers call passes ``trust_remote_code`` explicitly: left unset, transformers *asks* on stdin
("Do you wish to run the custom code? [y/N]") and a piped "y" runs the repository's Python. A model that
needs such code is refused by ``resolve`` in one line, before any work, unless the user allowed it; the
decision travels with the ``ModelRef`` (``ModelRef.trust_remote_code``) to every later load.

Completeness: transformers initialises at random any weight the config implies but the files lack, and
ignores stored tensors the config does not describe. ``check_complete`` compares the two (headers only)
before any work; ``check_architecture`` refuses sizes transformers would crash on.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit import assets
from qkit.checkpoint import (
    ShardWriter,
    atomic_directory,
    iter_quantized,
    read_manifest,
    tensor_shapes,
    weight_files,
    write_json,
)
from qkit.errors import InputError, ModelLoadError
from qkit.schemes import QuantizedTensor

_log = logging.getLogger("qkit")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
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

    kind: str  # "default" | "directory" | "qkit" | "gguf" | "hub"
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
    model: Any  # transformers PreTrainedModel
    tokenizer: Any | None
    ref: ModelRef
    manifest: dict | None = None


# --------------------------------------------------------------------------- resolving


def _denied(path: Path | str, exc: OSError) -> ModelLoadError:
    """One line for a file qkit may not read (root is never refused, so this is a plain user's problem)."""
    return ModelLoadError(f"permission denied reading {exc.filename or path}; make it readable "
                          "(chmod/chown) or run as a user who may read it")


def read_config(directory: Path) -> dict[str, Any]:
    """The parsed config.json of a model directory (or the config file itself, if given one).

    Also ``check_architecture``: sizes transformers would crash on are refused here, for every reader.
    """
    path = Path(directory)
    try:
        path = path if path.is_file() else path / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory} has no config.json; pass a Hugging Face model directory, a .gguf file or a hub id")
        text = path.read_text()
    except PermissionError as exc:
        raise _denied(path, exc) from exc
    except IsADirectoryError as exc:
        raise ModelLoadError(f"{path} is a directory, not a config file; pass the model directory or its config.json") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc}); check the model files") from exc
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"malformed {path} ({exc}); fix the JSON or re-download the model") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"malformed {path}: no 'model_type' key; fix it or re-download the model")
    check_architecture(config, str(path))
    return config


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


# --------------------------------------------------------------------------- custom (remote) code


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
    tok_path = directory / "tokenizer_config.json"
    try:
        tok = json.loads(tok_path.read_text()) if tok_path.is_file() else {}
    except PermissionError as exc:
        raise _denied(tok_path, exc) from exc
    except (OSError, ValueError, UnicodeDecodeError):
        tok = {}  # malformed: transformers fails on it before any code runs (load_tokenizer says why)
    auto_map = tok.get("auto_map") if isinstance(tok, dict) else None
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


def check_remote_code(directory: Path, spec: str, trust_remote_code: bool, config: Mapping[str, Any] | None = None) -> None:
    """Refuse, in one line and before any work, a model that needs its own code unless the user trusts it."""
    if trust_remote_code:
        return
    found = custom_code(directory, config)
    if found:
        raise ModelLoadError(
            f"{spec} needs custom code from its repository ({'; '.join(found)}); qkit never runs it unless asked: "
            "pass --trust-remote-code (qkit quantize, qkit eval, qkit verify) if you trust it"
        )


# --------------------------------------------------------------------------- resolving


def _exists(path: Path) -> str | None:
    """``"file"``, ``"dir"``, another kind, or None; a path qkit may not look at is a permission error."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        return "other" if path.exists() else None
    except PermissionError as exc:
        raise _denied(path, exc) from exc


def _local_lookalike(spec: str) -> Path | None:
    """For a hub-id-shaped spec (``models/x``): the local directory its first part names, if one exists.

    A ``models/x`` whose ``models/`` exists here is a local path that is missing, not a hub id."""
    first = Path(spec.split("/", 1)[0])
    return first if _exists(first) == "dir" else None


def resolve(model: str | Path | ModelRef | None = None, *, allow_pickle: bool = False,
            trust_remote_code: bool = False) -> ModelRef:
    """Turn a MODEL argument into a local directory (fetching or converting once, then cached).

    A model that needs its own Python (``custom_code``) is refused unless ``trust_remote_code``; the
    returned ref carries that permission to ``load``. A ``ModelRef`` is returned as it is: a command
    may resolve first (to refuse a bad MODEL before its status line) and pass the ref on as MODEL.
    """
    if isinstance(model, ModelRef):
        return model
    if model is None or str(model) == "":
        gguf = assets.fetch(assets.DEFAULT_MODEL)
        directory = _gguf_directory(gguf, assets.DEFAULT_MODEL.member_sha256)
        prov = {"name": DEFAULT_MODEL_NAME, "package": f"{assets.DEFAULT_MODEL.package}=={assets.DEFAULT_MODEL.version}",
                "member": assets.DEFAULT_MODEL.member, "sha256": assets.DEFAULT_MODEL.member_sha256}
        return ModelRef("default", DEFAULT_MODEL_NAME, directory, prov)
    spec = str(model)
    path = Path(spec).expanduser()
    kind = _exists(path)
    if kind == "file" and path.suffix == ".gguf":
        try:
            sha = assets.sha256_file(path)
        except PermissionError as exc:
            raise _denied(path, exc) from exc
        return ModelRef("gguf", spec, _gguf_directory(path, sha), {"gguf": str(path), "sha256": sha})
    if kind == "dir":
        config = read_config(path)
        check_remote_code(path, spec, trust_remote_code, config)
        try:
            _check_weights(path, allow_pickle)
            # safetensors reports an unreadable shard as corrupt: name the real cause first (cheap: no open)
            unreadable = [p for p in weight_files(path) if not os.access(p, os.R_OK)]
        except PermissionError as exc:
            raise _denied(path, exc) from exc
        if unreadable:
            raise _denied(path, PermissionError(errno.EACCES, "Permission denied", str(unreadable[0])))
        kind = "qkit" if (config.get("quantization_config") or {}).get("quant_method") == "qkit" else "directory"
        return ModelRef(kind, spec, path, {"path": str(path.resolve())}, trust_remote_code)
    if kind is not None:
        raise InputError(f"{spec} is neither a model directory nor a .gguf file; pass one of those")
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        local = _local_lookalike(spec)
        if local is not None:
            raise InputError(f"no such file or directory: {spec} ({local}/ exists here but holds no "
                             f"{spec.split('/', 1)[1]}, so it is not fetched from the hub); pass an existing model directory")
        return _from_hub(spec, allow_pickle, trust_remote_code)
    raise InputError(f"no such file or directory: {spec}; pass a model directory, a .gguf file or a hub id")


def _from_hub(repo_id: str, allow_pickle: bool, trust_remote_code: bool = False) -> ModelRef:
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    if allow_pickle:
        patterns += list(_PICKLED)
    quiet_progress()
    try:
        with assets.quiet_hub():
            local = snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as exc:  # huggingface_hub raises many types (network, auth, not found)
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"cannot fetch {repo_id}: HF_HUB_OFFLINE is set and the local hub cache does not hold it; "
                "pass a local model directory or .gguf file, or unset HF_HUB_OFFLINE to download it"
            ) from exc
        text = " ".join(str(exc).split())
        first = (text.split(". ")[0] if text else type(exc).__name__)[:160]
        raise ModelLoadError(
            f"cannot fetch {repo_id} from the Hugging Face hub ({first}); "
            "pass a local model directory or .gguf file instead"
        ) from exc
    check_remote_code(Path(local), repo_id, trust_remote_code)  # named by its hub id, not the snapshot path
    ref = resolve(local, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    return ModelRef("hub" if ref.kind == "directory" else ref.kind, repo_id, ref.directory,
                    {"hub_id": repo_id, "snapshot": local}, ref.trust_remote_code)


# --------------------------------------------------------------------------- GGUF -> cached safetensors


def _gguf_directory(gguf: Path, sha256: str) -> Path:
    """Convert a GGUF file once into an fp32 safetensors model directory in the cache."""
    out = assets.cache_dir() / "models" / f"gguf-{sha256[:16]}"
    if (out / "config.json").is_file() and weight_files(out):
        return out
    _log.info("converting %s to fp32 safetensors (once; cached in %s)", gguf.name, out)
    with _no_gguf_bar():
        return _convert_gguf(gguf, sha256, out)


def quiet_progress() -> None:
    """Turn off the progress bars transformers and huggingface_hub draw ("Loading weights", downloads):
    qkit reports its own steps. Also silences transformers' warnings below errors."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()


@contextlib.contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """transformers' GGUF reader draws a raw tqdm bar ("Converting and de-quantizing GGUF tensors") that
    ignores transformers' switch, and ``TQDM_DISABLE`` is read only when tqdm is first imported: while
    converting, that module's ``tqdm`` is a pass-through."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - a transformers without GGUF support fails later, clearly
        yield
        return
    saved = gguf_utils.__dict__.get("tqdm")
    gguf_utils.tqdm = lambda iterable=None, *_a, **_k: iterable
    try:
        yield
    finally:
        if saved is None:
            del gguf_utils.tqdm
        else:
            gguf_utils.tqdm = saved


def _convert_gguf(gguf: Path, sha256: str, out: Path) -> Path:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        quiet_progress()
        # A GGUF names a built-in architecture; the explicit False keeps a stray tokenizer_config.json with an
        # auto_map beside the file from making transformers ask to run its code.
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for unsupported GGUF files
        raise ModelLoadError(f"cannot read {gguf} as a GGUF model ({str(exc).splitlines()[0][:160]}); "
                             "pass a GGUF of an architecture transformers supports") from exc
    # transformers refuses save_pretrained on a GGUF-loaded model: write config, weights and
    # tokenizer ourselves (tied weights once, like save_pretrained).
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    with atomic_directory(out, force=True) as tmp:
        write_json(tmp / "config.json", config)
        writer = ShardWriter(tmp)
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen:  # a tied weight (lm_head = embed_tokens)
                continue
            seen.add(tensor.data_ptr())
            writer.add(name, tensor)
        writer.close()
        tokenizer.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        write_json(tmp / "qkit-source.json", {"gguf": gguf.name, "sha256": sha256})
    return out


# --------------------------------------------------------------------------- loading


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device} requested but CUDA is not available here; use --device cpu")
    return dev


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: Path, trust_remote_code: bool = False):
    """The tokenizer of ``directory``, or None when it has no tokenizer files (quantize does not need one;
    eval says so itself). Files that are there but fail to load are a ``ModelLoadError`` naming the cause,
    never a silent None (an invalid config would otherwise read as "no tokenizer")."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types
        if not any((Path(directory) / f).is_file() for f in _TOKENIZER_FILES):
            return None
        raise ModelLoadError(f"cannot load the tokenizer of {directory} ({_cause(exc)}); "
                             "fix or re-download its tokenizer files and config.json") from exc


def dequantized_state_dict(directory: Path, dtype: torch.dtype | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A qkit checkpoint's tensors, quantized ones dequantized (to their original dtype or ``dtype``)."""
    out = {}
    for name, value in iter_quantized(directory, device):
        out[name] = value.dequantize(dtype) if isinstance(value, QuantizedTensor) else value
    return out


def load(
    model: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    ref: ModelRef | None = None,
    device_map: str | dict[str, Any] | None = None,
) -> LoadedModel:
    """Load MODEL as a transformers causal LM (quantized checkpoints dequantized) plus its tokenizer.

    ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or an explicit ``{module: device}``):
    spread the model over every visible GPU and CPU memory with accelerate's big-model loading instead
    of putting it whole on ``device``. What it costs: modules placed on the CPU run there (with a GPU
    present, accelerate copies their weights to the GPU on *every* forward pass, so each forward moves
    all CPU-placed weights over PCIe); activations cross devices at each split (small); the dispatch
    hooks add a little Python overhead per module. A qkit checkpoint is first dequantized in CPU
    memory, then dispatched. Without a GPU, ``"auto"`` keeps everything on the CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_progress()
    dev = parse_device(device)  # bad options fail before the model is resolved (fetched, converted)
    if device_map is not None:
        check_device_map(device_map)
    ref = ref or resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    # The permission given when the ref was resolved holds for its loads (quantize's methods load by ref).
    trust_remote_code = trust_remote_code or ref.trust_remote_code
    if not trust_remote_code:  # a ref built by hand has not been through resolve's check
        check_remote_code(ref.directory, ref.spec, False)
    check_complete(ref, trust_remote_code=trust_remote_code)  # before any weight is read
    manifest = None
    try:
        if ref.is_quantized:
            manifest = read_manifest(ref.directory)
            config = AutoConfig.from_pretrained(str(ref.directory), trust_remote_code=trust_remote_code)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            lm = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            state = dequantized_state_dict(ref.directory, dtype)
            result = lm.load_state_dict(state, strict=False)
            tied = set(getattr(lm, "_tied_weights_keys", None) or [])
            missing = [k for k in result.missing_keys if k not in tied and not k.endswith("lm_head.weight")]
            if missing or result.unexpected_keys:
                raise ModelLoadError(
                    f"checkpoint {ref.directory} does not match its config (missing {missing[:3]}, "
                    f"unexpected {result.unexpected_keys[:3]}); re-create it"
                )
            lm.tie_weights()
        else:
            lm = AutoModelForCausalLM.from_pretrained(
                str(ref.directory), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=not allow_pickle or None,
                **({"device_map": check_device_map(device_map)} if device_map is not None else {}),
            )
        if device_map is not None and ref.is_quantized:
            lm = _dispatch(lm, check_device_map(device_map), dtype)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(
                f"{ref.spec} needs custom code from its repository; pass --trust-remote-code if you trust it"
            ) from exc
        raise ModelLoadError(f"cannot load {ref.spec} ({str(exc).splitlines()[0][:200]})") from exc
    except (OSError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {ref.spec} ({str(exc).splitlines()[0][:200]}); check the model files") from exc
    lm.eval()
    if device_map is None:
        lm.to(dev)
    return LoadedModel(lm, load_tokenizer(ref.directory, trust_remote_code), ref, manifest)


# --------------------------------------------------------------------------- completeness


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


def _cause(exc: BaseException, limit: int = 200) -> str:
    """One line of an exception's message; transformers' config validation wraps the real ``ValueError``
    ("The hidden size (64) is not a multiple of ...") in a validator error: name the real one."""
    inner = exc.__cause__ if type(exc).__name__ == "StrictDataclassClassValidationError" and exc.__cause__ else exc
    return (" ".join(str(inner).split()) or type(inner).__name__)[:limit]


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


def checked(model: str | Path | ModelRef | None = None, *, allow_pickle: bool = False,
            trust_remote_code: bool = False) -> ModelRef:
    """``resolve`` then ``check_complete``: for a command that prints a status line before it loads, so a
    bad MODEL is still refused in one line. Pass the ref on as MODEL (``load`` does not build it again)."""
    ref = resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    check_complete(ref, trust_remote_code=trust_remote_code)
    return ref


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


_DEVICE_MAP_WORDS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map: str | dict[str, Any]) -> str | dict[str, Any]:
    """``device_map`` itself, or an ``InputError`` naming the accepted words."""
    if isinstance(device_map, dict) or device_map in _DEVICE_MAP_WORDS:
        return device_map
    raise InputError(f"unknown device map {device_map!r}; use one of {', '.join(_DEVICE_MAP_WORDS)}")


def _dispatch(lm, device_map: str | dict[str, Any], dtype: torch.dtype):
    """Spread an in-memory model over the devices (what ``from_pretrained(device_map=...)`` does on load)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):
        no_split = list(getattr(lm, "_no_split_modules", None) or [])
        max_memory = None
        if device_map != "sequential":
            max_memory = get_balanced_memory(lm, no_split_module_classes=no_split, dtype=dtype,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(lm, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    lm.hf_device_map = dict(device_map)
    if {str(d) for d in device_map.values()} <= {"cpu"}:
        return lm.to("cpu")  # nothing to spread: no hooks
    return dispatch_model(lm, device_map=device_map)


def copy_aux_files(src: Path, dst: Path) -> None:
    """Copy tokenizer and generation-config files (never weights) from one model directory to another."""
    for name in AUX_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
