"""Load a resolved model as a transformers causal LM (a qkit checkpoint dequantized) plus its tokenizer,
on one device or spread over several (``device_map``).

Layer 4 (``models``): above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below
methods, export, simulate, serving (5), evaluation (6), inspect, api and cli (7).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkit.checkpoint import iter_quantized, read_manifest
from qkit.errors import InputError, ModelLoadError
from qkit.models.completeness import check_complete
from qkit.models.files import LoadedModel, ModelRef, _cause, check_remote_code, quiet_progress
from qkit.models.resolving import resolve
from qkit.schemes import QuantizedTensor


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
            lm = _from_state_dict(config, dequantized_state_dict(ref.directory, dtype), dtype, trust_remote_code,
                                  ref.directory)
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

def _from_state_dict(config, state: dict[str, torch.Tensor], dtype: torch.dtype, trust_remote_code: bool,
                     directory: Path):
    """The causal LM of ``config`` holding ``state`` (the checkpoint's names and tensors), loaded the way
    ``from_pretrained`` loads the source's files: through transformers' own conversion of stored names to the
    model's (transformers 5 stacks a mixture-of-experts layer's per-expert matrices into its fused 3-D
    parameters, ``mlp.experts.gate_up_proj``, and renames mixtral's ``block_sparse_moe``), so every tensor
    lands bit for bit where loading the unquantized model puts it. A name it does not place, or a weight the
    checkpoint lacks (a tied or absent ``lm_head`` aside), is a ``ModelLoadError``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # from_config only to learn the class it builds (remote code included): no memory
        cls = type(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
    lm, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype, output_loading_info=True,
                                   trust_remote_code=trust_remote_code)
    tied = set(getattr(lm, "_tied_weights_keys", None) or [])
    missing = [k for k in info["missing_keys"] if k not in tied and not k.endswith("lm_head.weight")]
    unexpected = sorted(info["unexpected_keys"]) + [k for k, *_ in info["mismatched_keys"]]
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint {directory} does not match its config (missing {sorted(missing)[:3]}, "
                             f"unexpected {unexpected[:3]}); re-create it")
    return lm

def checked(model: str | Path | ModelRef | None = None, *, allow_pickle: bool = False,
            trust_remote_code: bool = False) -> ModelRef:
    """``resolve`` then ``check_complete``: for a command that prints a status line before it loads, so a
    bad MODEL is still refused in one line. Pass the ref on as MODEL (``load`` does not build it again)."""
    ref = resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    check_complete(ref, trust_remote_code=trust_remote_code)
    return ref

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
