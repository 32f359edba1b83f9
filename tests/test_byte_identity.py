"""Byte identity: what every registered scheme encodes, and what every export format writes, is pinned.

A refactor must not change one written byte. The digests in ``golden/byte_identity.json`` were recorded
from the code before such changes (``QKIT_RECORD_DIGESTS=1 python -m pytest tests/test_byte_identity.py``
rewrites them; do that only for a change that means to alter bytes, and say so in the commit).

* schemes: every name in the registry encodes one fixed matrix (seeded, heavy-tailed, a zero row, an
  exact tie); the digest covers every stored part, its name, dtype, shape and bytes;
* exports: a tiny llama of ``conftest.make_tiny_llama`` (seed 0, hidden 256, intermediate 512) written by ``quantize_model`` in each
  format; the digest covers every safetensors file: its header (the qkit manifest included) as canonical JSON,
  and its data bytes, and for GGUF
  every tensor's name, type, shape and bytes plus every metadata field except the tokenizer's (the tokenizer
  is trained by the ``tokenizers`` package, whose version is not qkit's to pin).
A new scheme or format has no digest yet: the test says so, and it must be recorded on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import importance_for, make_tiny_llama

GOLDEN = Path(__file__).parent / "golden" / "byte_identity.json"
RECORD = os.environ.get("QKIT_RECORD_DIGESTS") == "1"

# (label, format, scheme, extra quantize_model keywords)
EXPORTS = [
    ("qkit/nf4", "qkit", "nf4", {}),
    ("qkit/int4-g64", "qkit", "int4-g64", {}),
    ("qkit/q4_k_m", "qkit", "q4_k_m", {}),
    ("compressed-tensors/int4-g64", "compressed-tensors", "int4-g64", {}),
    ("compressed-tensors/int8-row", "compressed-tensors", "int8-row", {}),
    ("compressed-tensors/nvfp4", "compressed-tensors", "nvfp4", {}),
    ("compressed-tensors/mxfp4", "compressed-tensors", "mxfp4", {}),
    ("compressed-tensors-w8a8/int8-row", "compressed-tensors", "int8-row", {"activations": "int8-token"}),
    ("bitsandbytes/nf4", "bitsandbytes", "nf4", {}),
    ("gguf/q8_0", "gguf", "q8_0", {}),
    ("gguf/q4_k_m", "gguf", "q4_k_m", {}),
    ("gguf/mxfp4", "gguf", "mxfp4", {}),
]


def _golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {"schemes": {}, "exports": {}}


_recorded = _golden()


def _check(section: str, key: str, digest: str) -> None:
    if RECORD:
        _recorded.setdefault(section, {})[key] = digest
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(_recorded, indent=2, sort_keys=True) + "\n")
        return
    expected = _golden().get(section, {}).get(key)
    assert expected is not None, f"no recorded digest for {section}/{key}; record it on purpose (QKIT_RECORD_DIGESTS=1)"
    assert digest == expected, f"{section}/{key}: written bytes changed"


def _matrix() -> torch.Tensor:
    """96 x 512: whole q4_k/q6_k super-blocks, groups of 128, 32-blocks; heavy tails, a zero row, a tie."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(96, 512, generator=g) * 0.02
    tails = torch.randn(96, 512, generator=g)
    w = w + 0.05 * tails * (tails.abs() > 2.5)  # a few large weights per row
    w[7] = 0.0  # an all-zero row
    w[11, :32] = torch.tensor([0.5, -0.5] * 16)  # +a/-a tie in one block
    return w


def _digest_parts(parts: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(parts):
        t = parts[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _scheme_names() -> list[str]:
    from qkit.schemes import scheme_names

    return scheme_names()


@pytest.mark.parametrize("name", _scheme_names())
def test_scheme_bytes(name):
    from qkit.schemes import get_scheme, quantize_tensor

    # a recipe (q4_k_m) binds to a model's config and resolves the type by name: layer 0's down_proj of a
    # 30-layer model (Q6_K in the recipe); any other scheme is returned unchanged
    scheme = get_scheme(name).bind({"num_hidden_layers": 30, "tie_word_embeddings": True})
    qt = quantize_tensor(_matrix(), scheme, name="model.layers.0.mlp.down_proj.weight", **importance_for(scheme, 512))
    parts = qt.tensors("w")
    _check("schemes", name, _digest_parts(parts))


def _safetensors_sha(path: Path) -> str:
    """sha256 of the header as canonical JSON (sorted keys: the safetensors library writes its metadata
    keys in hash-map order, which differs between processes) and of the data bytes."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(data[8 + n :])
    return h.hexdigest()


def _gguf_digest(path: Path) -> str:
    import gguf

    reader = gguf.GGUFReader(str(path))
    h = hashlib.sha256()
    for field in sorted(reader.fields.values(), key=lambda f: f.name):
        if field.name.startswith("tokenizer.") or field.name.startswith("GGUF."):
            continue
        h.update(field.name.encode())
        for i in field.data:
            h.update(bytes(field.parts[i].tobytes()))
    for t in sorted(reader.tensors, key=lambda t: t.name):
        h.update(f"{t.name}|{int(t.tensor_type)}|{tuple(int(x) for x in t.shape)}|".encode())
        h.update(t.data.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bytes") / "model"
    make_tiny_llama(d, seed=0, hidden=256, intermediate=512)  # whole 256-wide k-quant super-blocks
    return d


@pytest.mark.parametrize("label, fmt, scheme, extra", EXPORTS, ids=[e[0] for e in EXPORTS])
def test_export_bytes(source, tmp_path, label, fmt, scheme, extra):
    from qkit.api import QuantizeOptions, quantize_model

    out = tmp_path / ("model.gguf" if fmt == "gguf" else "out")
    quantize_model(source, output=out, scheme=scheme, format=fmt, options=QuantizeOptions(**extra))
    if fmt == "gguf":
        digest = _gguf_digest(out)
    else:
        files = sorted(out.glob("*.safetensors"))
        assert files
        digest = hashlib.sha256("".join(f"{f.name}:{_safetensors_sha(f)};" for f in files).encode()).hexdigest()
    _check("exports", label, digest)
