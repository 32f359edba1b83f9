"""Helpers of the golden test of ``quantize_gguf`` against llama-quantize (tests/test_golden_requantize.py).

``convert_f32`` is the one place an architecture's F32 GGUF is made, by qkit's bridge to llama.cpp's pinned
converter. ``f32_model`` caches the converter's output under the
qkit cache, keyed by everything it depends on (the seeded model's builder, the tokenizer, the converter's
commit), so a test run converts each architecture once. ``seeded_imatrix`` is an importance matrix in
llama-imatrix's layout (one row per expert for ``_exps`` tensors) drawn from a seeded generator, and
``file_digest`` the sha256 of a GGUF's header and of each tensor's bytes.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import gguf
import numpy as np

from qkit.assets import cache_dir, cache_lock, sha256_file
from qkit.export.gguf import converter
from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import tensor_bytes
from qkit.methods.imatrix import Imatrix, ImatrixEntry
from qkit.schemes.llama_rules import allows_quantization, category, llama_order

# the architectures whose models get ``helpers_archs.spm_tokenizer``'s tokenizer.model (the rest: the default
# model's BPE tokenizer): the pinned converter refuses them with the default model's (see helpers_archs)
SPM_ARCHS = ("qwen2", "gemma2", "phi3")


def convert_f32(model: Path, out: Path) -> Path:
    """The converter's F32 GGUF of ``model`` at ``out``: qkit's bridge to llama.cpp's pinned converter
    (``qkit.export.gguf.converter.convert_f32``, the bytes of ``convert_hf_to_gguf.py --outtype f32``)."""
    return converter.convert_f32(model, out)


def f32_model(arch: str, tokenizer_dir: Path, work: Path) -> Path:
    """The converter's F32 GGUF of the tiny seeded ``arch`` model (``helpers_archs``), made once and cached."""
    import helpers_archs

    h = hashlib.sha256(Path(helpers_archs.__file__).read_bytes())
    for name in helpers_archs.TOKENIZER_FILES + ("config.json",):
        if (tokenizer_dir / name).is_file():
            h.update(name.encode() + (tokenizer_dir / name).read_bytes())
    h.update(f"{converter.CONVERTER.name} {converter.CONVERTER.version}".encode())
    target = cache_dir() / "test-f32" / h.hexdigest()[:16] / f"{arch}.gguf"
    with cache_lock(f"test-f32-{arch}", f"the F32 GGUF of a tiny {arch}"):
        if not target.is_file():
            model = helpers_archs.make_arch_model(work / arch, arch, tokenizer_dir)
            tmp = convert_f32(model, work / f"{arch}.gguf")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(tmp), target)
            shutil.rmtree(model)
    return target


def seeded_imatrix(path: Path, seed: int) -> Imatrix:
    """An importance matrix for every weight llama-imatrix collects in the GGUF ``path`` (each matrix a
    tensor multiplies, the router included; not token_embd, not output): ``sums`` of squares over 1,000
    tokens, random magnitudes over six decades with zero columns, one row per expert of a 3-D tensor; the
    last expert of the last layer's ffn_down_exps counted no token (llama-quantize weights it by 1s)."""
    rng = np.random.default_rng(seed)
    header = read_header(path)
    arch = str(header.fields["general.architecture"])
    entries = {}
    infos = {t.name: t for t in header.tensors}
    for name in llama_order(infos):
        t = infos[name]
        routed = "ffn_gate_inp.weight" in name and len(t.ne) == 2
        if not (allows_quantization(name, t.ne, arch) or routed) or category(name) in ("token_embd", "output"):
            continue
        groups = t.ne[2] if len(t.ne) > 2 else 1
        sums = rng.random((groups, t.ne[0])) * 10.0 ** rng.uniform(-3, 3, (groups, t.ne[0])) * 1000.0
        sums[rng.random(sums.shape) < 0.05] = 0.0
        counts = np.full(groups, 1000.0, np.float32)
        entries[name] = ImatrixEntry(sums.astype(np.float32), counts)
    last = [n for n in entries if "ffn_down_exps" in n]
    if last:
        entries[last[-1]].counts[-1] = 0.0
    return Imatrix(entries, chunk_count=4, chunk_size=250, datasets=["seeded numpy draws"])


def file_digest(path: Path, layout: tuple[int, dict[str, tuple[str, int, int]]] | None = None) -> dict:
    """``{"file": sha256 of the whole file, "header": of the bytes before the data (KV fields and tensor
    infos), "tensors": {name: [ggml type, sha256 of its bytes]}}`` of a GGUF. ``layout``: ``(data_offset,
    {name: (type, offset, bytes)})`` as ``quantize_gguf`` reports it; None: read from the file's header."""
    if layout is None:
        header = read_header(path)
        layout = (header.data_offset, {t.name: (gguf.GGMLQuantizationType(t.ggml_type).name, t.offset,
                                                tensor_bytes(t.ggml_type, t.ne)) for t in header.tensors})
    start, tensors = layout
    data = path.read_bytes()
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    return {"file": sha(data), "header": sha(data[:start]),
            "tensors": {n: [t, sha(data[start + o:start + o + size])] for n, (t, o, size) in tensors.items()}}


__all__ = ["SPM_ARCHS", "convert_f32", "f32_model", "file_digest", "seeded_imatrix"]
