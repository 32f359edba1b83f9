"""A ``.gguf`` MODEL, dequantized through transformers' GGUF support and converted once into a cached
fp32 safetensors directory (keyed by the file's sha256).

Layer 4 (``models``): above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below
methods, export, simulate, serving (5), evaluation (6), inspect, api and cli (7).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from qkit import assets
from qkit.checkpoint import ShardWriter, atomic_directory, weight_files, write_json
from qkit.errors import ModelLoadError
from qkit.models.files import quiet_progress

_log = logging.getLogger("qkit")


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and bool(weight_files(out))


def _gguf_directory(gguf: Path, sha256: str) -> Path:
    """Convert a GGUF file once into an fp32 safetensors model directory in the cache. Once also across
    processes: the conversion holds the cache's lock for it (``assets.cache_lock``), so a second process
    waits (one status line naming the first's PID) and then reuses the first's directory; a holder that
    died is taken over (its half-written sibling is removed by the write)."""
    out = assets.cache_dir() / "models" / f"gguf-{sha256[:16]}"
    if _converted(out):
        return out
    with assets.cache_lock(out.name, f"converting {gguf.name} into the cache"):
        if _converted(out):  # converted by the process this one waited for
            return out
        _log.info("converting %s to fp32 safetensors (once; cached in %s)", gguf.name, out)
        with _no_gguf_bar():
            return _convert_gguf(gguf, sha256, out)

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
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):  # no cache path
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
