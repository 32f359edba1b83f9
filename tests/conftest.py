"""Shared fixtures: tiny llama models built from a config (never downloaded), the real default model, a
perturbed pair of the tiny model (the eval's oracles), a dead process's PID; and the builders the test
modules import (``make_tiny_llama``, ``make_llama``, ``benchmark_module``, ...). Plain shared helpers that
are not fixtures live in ``tests/helpers_*.py``: no test module imports another (``tests/test_house.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Water boils at one hundred degrees. The sun rises in the east and sets in the west. "
) * 4


def make_tokenizer(directory: Path):
    """A small byte-level BPE tokenizer trained here, with a ChatML-style chat template."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TINY_TEXT], vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(str(directory))
    return tok


def fused_amax(weights: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The largest max |w| of ``key``'s fused vLLM layer (its layer's q/k/v, or gate/up; ``transform.fused_groups``),
    whose nvfp4 global scale the group shares; None for a tensor no fused layer holds (o, down)."""
    from qkit.transform import fused_groups

    group = next((g for g in fused_groups(sorted(weights)).values() if key in g), None)
    return None if group is None else torch.stack([weights[n].abs().amax() for n in group]).max()


def make_tiny_llama(
    directory: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int | None = None,
    vocab: int = 304,
    tie: bool = True,
    dtype: torch.dtype = torch.float32,
):
    """Write a tiny random llama (config + model.safetensors + tokenizer) to ``directory``; return the model.

    ``intermediate`` defaults to ``2 * hidden + 32``: not a multiple of 64, so it exercises short groups.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from qkit.checkpoint import ShardWriter

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden + 32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(str(directory))
    writer = ShardWriter(directory)
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        writer.add(name, t)
    writer.close()
    make_tokenizer(directory)
    return model


def make_llama(directory: Path, *, hidden: int = 128, intermediate: int = 256, layers: int = 2,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A tiny llama at ``directory`` whose input widths (128, 256) every group size up to 128 divides; returns
    ``directory`` (the exporters' tests: compressed-tensors, bitsandbytes, verify)."""
    make_tiny_llama(directory, seed=seed, layers=layers, hidden=hidden, intermediate=intermediate, dtype=dtype)
    return directory


def prompt_ids(directory: Path) -> torch.Tensor:
    """The token ids of one short prompt, by the tokenizer at ``directory`` (the exporters' logits checks)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))("Paris is the capital of France.", return_tensors="pt")["input_ids"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny llama model directory (2 layers, hidden 64, 14 projection matrices). Do not modify it."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_llama(d)
    return d


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> Path:
    """Widths 256 and 512 (2 layers, 14 projections): every ggml type, k-quants too, applies natively.
    Do not modify it."""
    d = tmp_path_factory.mktemp("wide") / "model"
    make_tiny_llama(d, hidden=256, intermediate=512, layers=2)
    make_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_ct_export(tiny_model_dir, tmp_path_factory) -> Path:
    """A compressed-tensors export (int4-g32) of ``tiny_model_dir``: what ``qkit verify`` reads. Do not modify it."""
    from typer.testing import CliRunner

    from qkit.cli import app

    out = tmp_path_factory.mktemp("tiny-ct") / "ct"
    r = CliRunner().invoke(app, ["quantize", str(tiny_model_dir), "-s", "int4-g32", "--format", "compressed-tensors",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="session")
def memory_model(tmp_path_factory) -> Path:
    """Weights large enough to be seen over the process in a measured peak: 4 layers of 1024 x 2816, 0.18 GiB
    in fp32 (``tests/test_memory_bounds.py``, ``tests/test_max_memory.py``)."""
    d = tmp_path_factory.mktemp("memory_model")
    make_tiny_llama(d, hidden=1024, intermediate=2816, layers=4)
    return d


@pytest.fixture(scope="session")
def llama128(tmp_path_factory) -> Path:
    """A :func:`make_llama` model directory (fp32, 2 layers, hidden 128, intermediate 256). Do not modify it."""
    return make_llama(tmp_path_factory.mktemp("llama128") / "llama128")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """An eval corpus for the tiny model: its own text, three times."""
    f = tmp_path_factory.mktemp("corpus") / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return f


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir):
    """``(ref_model, row, tokenizer)``: ``tiny_model_dir`` loaded twice, every matrix times 8 (the tiny random
    model's next-token distributions are nearly uniform otherwise, its greedy tokens all alike): the
    reference, and a copy with every matrix perturbed too (a 'row'), and the tokenizer. One per module."""
    from qkit.models import load

    ref = load(tiny_model_dir, device="cpu")
    row = load(tiny_model_dir, device="cpu").model
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for model in (ref.model, row):
            for p in model.parameters():
                if p.ndim == 2:
                    p.mul_(8)
        for p in row.parameters():
            if p.ndim == 2:
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return ref.model, row, ref.tokenizer


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped): what a killed writer leaves in its names."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(proc.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), fetched and converted once into the qkit cache."""
    from qkit.models import resolve

    return resolve(None).directory


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_BENCHMARKS: dict[str, ModuleType] = {}


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported by its path, once per process (the benchmarks are scripts, not a
    package): ``build_llama_ref`` (llama.cpp's reference quantizer and tools), ``bench_llama_cpp``."""
    if name not in _BENCHMARKS:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _BENCHMARKS[name] = mod
    return _BENCHMARKS[name]


def f32_gguf(meta: Path, model: Path, out: Path, layers: int) -> Path:
    """An F32 GGUF of the qwen2 ``model`` at ``out`` for llama-quantize: the metadata (architecture, tokenizer)
    of the qkit GGUF ``meta``, every tensor F32 under llama.cpp's name (what convert_hf_to_gguf.py --outtype
    f32 writes for qwen2, whose tensors need no permutation)."""
    import gguf

    from qkit.checkpoint import iter_tensors
    from qkit.export.gguf.metadata import copy_fields, read_kv_fields
    from qkit.llama_names import tensor_names

    fields = read_kv_fields(meta)
    w = gguf.GGUFWriter(str(out), "qwen2")
    for prefix in ("general.", "qwen2.", "tokenizer."):
        copy_fields(w, fields, prefix, skip=("architecture", "file_type") if prefix == "general." else ())
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tensors = dict(iter_tensors(model))
    names = tensor_names("qwen2", layers, list(tensors), tied=True)
    for t in gguf.GGUFReader(str(meta)).tensors:
        hf = next(n for n, g in names.items() if g == t.name)
        w.add_tensor(t.name, tensors[hf].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def near_max_importance(seed: int = 21):
    """``(x, qw)``: a 2500 x 256 float32 matrix and its importance, where per block of 32 one or two columns
    carry all the importance and the rows' values there sit just below the block maximum (the case where a
    weighted search's rounding is most fragile)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows, cols = 2500, 256
    qw = np.zeros(cols, np.float32)
    hot = [b * 32 + rng.choice(32, int(rng.integers(1, 3)), replace=False) for b in range(cols // 32)]
    for idx in hot:
        qw[idx] = rng.random(len(idx)) * 10.0 ** rng.integers(-6, 6)
    x = -np.abs(rng.standard_normal((rows, cols))).astype(np.float32)
    for b, idx in enumerate(hot):
        top = x[:, b * 32 : b * 32 + 32].max(axis=1, keepdims=True)
        x[:, idx] = top - rng.random((rows, len(idx))) * 10.0 ** rng.integers(-8, 0, (rows, 1))
    return x, qw


def importance_for(scheme, cols: int) -> dict:
    """``quant_weights=`` ones for a scheme llama.cpp encodes only with an importance matrix (iq2_xxs, iq2_xs:
    ``needs_importance``; a recipe with such a type, iq2_xxs-llama), else nothing: what the registry-wide tests
    pass to ``encode`` / ``quantize_tensor``."""
    from qkit.schemes import Recipe
    from qkit.schemes.ggml import needs_importance

    types = scheme.types if isinstance(scheme, Recipe) else (scheme,)
    return {"quant_weights": torch.ones(cols)} if any(needs_importance(t) for t in types) else {}
