"""GGUF export: llama.cpp's names, layouts, types and metadata; read back bit-identically by the ``gguf``
package and by transformers; one-line refusals that write nothing; ``qkit verify FILE.gguf``.

The llama.cpp block schemes (``qkit.schemes.ggml`` / ``kquants``) register themselves on ``import qkit.schemes``.
Where they are not (yet) present, a test-only stand-in encoding with ``gguf.quants.quantize`` (llama.cpp's
reference for the 32-blocks) takes their names, so the writer is tested against the scheme contract either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

import qkit.schemes
from conftest import importance_for

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import ExportError, OutputExistsError, QkitError
from qkit.export import gguf as gg
from qkit.verify import verify_checkpoint
from qkit.schemes import Recipe, get_scheme, quantize_tensor, register, scheme_names

T = gguf.GGMLQuantizationType
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


@dataclass(frozen=True)
class _StandIn:
    """The ggml scheme contract (``kind == "ggml"``, ``ggml_type``, ``qweight`` = llama.cpp's block bytes per
    row, empty ``scales``), encoded by the ``gguf`` package. Used only where qkit's own scheme is absent."""

    name: str
    ggml_type: Any
    kind = "ggml"
    bits = 8
    scale_dtype = torch.float16
    fixed_scale_dtype = True
    parts = ("qweight", "scales")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        a = w.detach().float().cpu()
        rows = a.reshape(a.shape[0], -1).numpy()
        return {"qweight": torch.from_numpy(gguf.quants.quantize(rows, self.ggml_type)),
                "scales": torch.empty(0, dtype=torch.uint8)}

    def decode(self, parts, shape, dtype):
        out = gguf.quants.dequantize(parts["qweight"].numpy(), self.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(out)).reshape(shape).to(dtype)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": "ggml", "ggml_type": self.ggml_type.name}


for _name, _type in (("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("q5_0", T.Q5_0), ("q5_1", T.Q5_1)):
    if _name not in scheme_names():
        register(_StandIn(_name, _type))
GGML = [n for n in scheme_names() if gg.is_ggml(get_scheme(n))]
REAL = not isinstance(get_scheme("q8_0"), _StandIn)
assert qkit.schemes  # imported for its registrations


def _fields(path: Path) -> dict[str, Any]:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}


def _tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _source(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _qkit_model(directory: Path, quantized: dict[str, torch.Tensor]):
    """The source model with qkit's dequantized weights in place of the quantized ones (fp32)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in quantized.items():
            lm.get_parameter(name).copy_(w)
    return lm


def _transformers_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _prompt(directory: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))(PROMPT, return_tensors="pt")["input_ids"]


def _no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".qkit-tmp-" in p.name or ".qkit-old-" in p.name]


# --------------------------------------------------------------------------- the permutation


def _llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """``LlamaModel.permute`` from llama.cpp's conversion/llama.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize("rows,heads", [(64, 4), (32, 2), (576, 9), (192, 3)])
def test_row_permutation_is_llama_cpps_and_transformers_undoes_it(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(rows, 8)
    perm = gg.row_permutation(rows, heads)
    assert torch.equal(w[perm], _llama_cpp_permute(w, heads, heads))
    assert torch.equal(w[perm][gg.inverse_permutation(rows, heads)], w)
    undone = LlamaTensorProcessor()._reverse_permute_weights(w[perm].numpy(), heads, heads)
    assert np.array_equal(undone, w.numpy())


@pytest.mark.parametrize("scheme", GGML)
def test_permuting_block_rows_equals_quantizing_the_permuted_matrix(scheme):
    """Each ggml block lies inside one row: permuting the rows of the block bytes is quantizing llama.cpp's
    permuted matrix, byte for byte (what lets the writer permute q/k after quantization)."""
    torch.manual_seed(0)
    s = get_scheme(scheme)
    for rows, cols, heads in ((64, 256, 4), (192, 512, 3)):
        w = torch.randn(rows, cols) * torch.rand(rows, 1)
        perm = gg.row_permutation(rows, heads)
        a = quantize_tensor(w[perm], s, **importance_for(s, cols)).qweight
        b = quantize_tensor(w, s, **importance_for(s, cols)).qweight[perm]
        assert a.dtype == torch.uint8 and torch.equal(a, b), scheme


# --------------------------------------------------------------------------- round trip on the tiny llama


class _Exports(dict):
    """``.gguf`` files of the tiny llama (hidden 64, intermediate 160), one per ggml scheme, made on first use."""

    def __init__(self, model: Path, root: Path):
        super().__init__()
        self.model, self.root = model, root

    def __missing__(self, scheme: str) -> Path:
        out = quantize_model(self.model, output=self.root / f"{scheme}.gguf", scheme=scheme, format="gguf").output
        self[scheme] = out
        return out


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return _Exports(tiny_model_dir, tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("scheme", GGML)
def test_gguf_package_dequantizes_bit_identically(tiny_model_dir, exports, scheme):
    """Every tensor read back by the gguf package (llama.cpp's reference dequantizer) is qkit's, bit for bit."""
    stored = _tensors(exports[scheme])
    src = _source(tiny_model_dir)
    names = gg.tensor_names("llama", 2, list(src), tied=True)
    assert set(stored) == {v for v in names.values() if v}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    quantized = 0
    whole = isinstance(get_scheme(scheme), Recipe)  # a recipe's file quantizes the (tied) embedding too, as llama.cpp's
    for name, w in src.items():
        t = stored[names[name]]
        assert [int(d) for d in t.shape] == list(reversed(w.shape))  # GGUF lists ne0 (columns) first
        back = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(w.shape)
        heads = gg.permutation_heads("llama", config, name)
        if heads:
            back = back[gg.inverse_permutation(w.shape[0], heads)]
        if (name.endswith(".weight") and ".layers." in name and "norm" not in name) or (whole and "embed" in name):
            qt = quantize_tensor(w, get_scheme(scheme).bind(config), name=name)  # a recipe needs the layer count
            assert t.tensor_type == T(int(qt.scheme.ggml_type)), name
            assert torch.equal(back, qt.dequantize(torch.float32)), name
            quantized += 1
        else:
            assert t.tensor_type == T.F32 and torch.equal(back, w), name  # other embeddings and norms stay F32
    assert quantized == 14 + whole


@pytest.mark.parametrize("scheme", GGML)
def test_transformers_loads_gguf_with_qkits_weights_and_logits(tiny_model_dir, exports, scheme):
    """transformers dequantizes the file itself (gguf_file=); its weights equal qkit's and so do its logits."""
    path = exports[scheme]
    src = _source(tiny_model_dir)
    s = get_scheme(scheme).bind(json.loads((tiny_model_dir / "config.json").read_text()))
    whole = isinstance(s, Recipe)  # a recipe's file quantizes the (tied) embedding too
    quantized = {n: quantize_tensor(w, s, name=n).dequantize(torch.float32)
                 for n, w in src.items() if (".layers." in n and n.endswith("proj.weight")) or (whole and "embed" in n)}
    ours = _qkit_model(tiny_model_dir, quantized)
    theirs = _transformers_gguf(path)
    for n, w in quantized.items():
        assert torch.equal(theirs.get_parameter(n), w), n
    ids = _prompt(tiny_model_dir)
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    # The only difference: rms_norm_eps 1e-6 stored as float32 (9.99999997e-07); measured: exactly equal.
    assert float((a - b).abs().max()) <= 1e-6 * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("scheme,expected", [
    ("q4_k", {256: T.Q4_K, 544: T.Q5_0}), ("q6_k", {256: T.Q6_K, 544: T.Q8_0}), ("q2_k", {256: T.Q2_K, 544: T.Q4_0}),
    ("q3_k", {256: T.Q3_K, 544: T.Q4_0}), ("q5_k", {256: T.Q5_K, 544: T.Q5_1}), ("iq4_xs", {256: T.IQ4_XS, 544: T.IQ4_NL}),
])
def test_k_quant_blocks_round_trip(tmp_path, scheme, expected):
    """A llama 256 wide, so the k-quants write their own super-blocks (the tiny llama's widths all fall back):
    gguf and transformers read qkit's bytes back bit-identically; ffn_down (544 wide) takes llama.cpp's fallback."""
    from conftest import make_tiny_llama

    d = tmp_path / "w256"
    make_tiny_llama(d, hidden=256, layers=1)
    out = quantize_model(d, output=tmp_path / "k.gguf", scheme=scheme, format="gguf").output
    t, src = _tensors(out), _source(d)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"):
        assert t[name].tensor_type == expected[int(t[name].shape[0])], name
    F = gguf.LlamaFileType
    assert _fields(out)["general.file_type"] == {"q4_k": F.MOSTLY_Q4_K_S, "q6_k": F.MOSTLY_Q6_K, "q2_k": F.MOSTLY_Q2_K,
                                                 "q3_k": F.MOSTLY_Q3_K_M, "q5_k": F.MOSTLY_Q5_K_S,
                                                 "iq4_xs": F.MOSTLY_IQ4_XS}[scheme]
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.logits_max_abs_diff == 0.0 and all(c.identical and c.matches_export for c in r.tensors)
    w = src["model.layers.0.self_attn.k_proj.weight"]
    qt = quantize_tensor(w, get_scheme(scheme), name="model.layers.0.self_attn.k_proj.weight")
    back = gguf.quants.dequantize(t["blk.0.attn_k.weight"].data, t["blk.0.attn_k.weight"].tensor_type)
    assert torch.equal(torch.from_numpy(back)[gg.inverse_permutation(128, 2)], qt.dequantize(torch.float32))


def test_imatrix_gguf_verifies_and_records_llama_quantizes_keys(tmp_path):
    """A 256-wide llama quantized through the importance matrix (q3_k_m: q3_k, q4_k, q5_k and fallbacks):
    verify passes bit-identically, and the file carries the keys llama-quantize --imatrix writes."""
    from conftest import make_tiny_llama

    d = tmp_path / "w256"
    make_tiny_llama(d, hidden=256, layers=2)
    im = tmp_path / "im.gguf"
    from qkit.api import imatrix_model
    from qkit.methods.imatrix import ImatrixOptions

    imatrix_model(d, output=im, options=ImatrixOptions(chunks=2, chunk_size=64))
    opts = QuantizeOptions(scheme="q3_k_m", format="gguf", imatrix=str(im))
    out = quantize_model(d, output=tmp_path / "q.gguf", options=opts).output
    f = _fields(out)
    assert f["quantize.imatrix.entries_count"] == 14 and f["quantize.imatrix.chunks_count"] == 2
    assert f["quantize.imatrix.file"] == str(im) and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q3_K_M
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.logits_max_abs_diff == 0.0 and all(c.identical and c.matches_export for c in r.tensors)
    plain = quantize_model(d, output=tmp_path / "p.gguf", scheme="q3_k_m", format="gguf").output
    a, b = _tensors(out), _tensors(plain)
    assert any(not np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)) for n in a if n.startswith("blk."))


def test_metadata_is_llama_cpps(tiny_model_dir, exports):
    f = _fields(exports["q8_0"])
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert f["general.architecture"] == "llama" and f["general.type"] == "model"
    assert f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0 and f["general.quantization_version"] == 2
    expected = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 160,
                "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 10000.0,
                "rope.dimension_count": 16, "attention.key_length": 16, "attention.value_length": 16,
                "vocab_size": 304}
    for key, value in expected.items():
        assert f[f"llama.{key}"] == value, key
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-7)
    # the tokenizer, as llama.cpp's _set_vocab_gpt2 converts it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    vocab = {i: t for t, i in tok.get_vocab().items()}
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.tokens"] == [vocab.get(i, f"[PAD{i}]") for i in range(304)]
    assert f["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1] and f["tokenizer.ggml.token_type"][-1] == 5
    merges = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert f["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.padding_token_id"]) == (1, 2, 0)
    assert f["tokenizer.chat_template"] == tok.chat_template
    record = json.loads(f["qkit.export"])
    assert record["format"] == "gguf" and len(record["tensors"]) == 14 and record["tokenizer"] == "converted from tokenizer.json"
    assert config["tie_word_embeddings"] and "output.weight" not in _tensors(exports["q8_0"])


def test_transformers_reads_the_tokenizer_back(tiny_model_dir, exports):
    from transformers import AutoTokenizer

    path = exports["q8_0"]
    ours = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert theirs(PROMPT)["input_ids"] == ours(PROMPT)["input_ids"]


def test_verify_gguf_passes_and_catches_a_missing_permutation(tiny_model_dir, tmp_path, monkeypatch):
    out = quantize_model(tiny_model_dir, output=tmp_path / "ok.gguf", scheme="q8_0", format="gguf").output
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.format == "gguf" and r.logits_max_abs_diff == 0.0
    assert r.by_scheme()["q8_0"] == {"tensors": 14, "identical": 14, "within_tolerance": 14, "max_abs_diff": 0.0,
                                     "match_export": 14}
    # A writer that forgets llama.cpp's q/k permutation writes a file every reader agrees on (qkit, gguf and
    # transformers all undo the permutation the same way, so the logits match) but that is not the model:
    # only the codes recorded at export catch it.
    monkeypatch.setattr(gg.writer, "row_permutation", lambda rows, heads: torch.arange(rows))
    bad = quantize_model(tiny_model_dir, output=tmp_path / "bad.gguf", scheme="q8_0", format="gguf").output
    monkeypatch.undo()
    r = verify_checkpoint(bad, device="cpu")
    assert not r.passed and not r.weights_ok and r.logits_ok
    wrong = {t.name for t in r.tensors if t.matches_export is False}
    assert wrong == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qk"}
    ids = _prompt(tiny_model_dir)
    with torch.no_grad():
        good, broken = _transformers_gguf(out)(ids).logits, _transformers_gguf(bad)(ids).logits
    assert float((good - broken).abs().max()) > 1e-3  # what a user of the broken file would get


def test_directory_output_holds_the_file_and_the_record(tiny_model_dir, tmp_path):
    out = tmp_path / "export"
    r = quantize_model(tiny_model_dir, output=out, scheme="q4_0", format="gguf")
    assert sorted(p.name for p in out.iterdir()) == ["model.gguf", "qkit-export.json"]
    assert r.format == "gguf" and r.bytes_after == (out / "model.gguf").stat().st_size and r.matrices == 14
    record = json.loads((out / "qkit-export.json").read_text())
    assert record == json.loads(_fields(out / "model.gguf")["qkit.export"])
    src = _source(tiny_model_dir)
    name = "model.layers.1.self_attn.k_proj.weight"
    from qkit.export.common import fingerprint

    assert record["tensors"][name]["sha256"] == fingerprint(quantize_tensor(src[name], get_scheme("q4_0")))
    assert record["tensors"][name]["gguf_name"] == "blk.1.attn_k.weight" and record["tensors"][name]["permuted_heads"] == 2
    assert verify_checkpoint(out, device="cpu").passed
    with pytest.raises(OutputExistsError):
        quantize_model(tiny_model_dir, output=out, scheme="q4_0", format="gguf")
    quantize_model(tiny_model_dir, output=out, scheme="q8_0", format="gguf", options=QuantizeOptions(force=True))
    assert _fields(out / "model.gguf")["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert _no_leftovers(tmp_path)


def test_file_output_is_atomic_and_refuses_without_force(tiny_model_dir, tmp_path):
    out = tmp_path / "m.gguf"
    quantize_model(tiny_model_dir, output=out, scheme="q4_0", format="gguf")
    before = out.read_bytes()
    with pytest.raises(OutputExistsError, match="--force"):
        quantize_model(tiny_model_dir, output=out, scheme="q8_0", format="gguf")
    assert out.read_bytes() == before
    quantize_model(tiny_model_dir, output=out, scheme="q8_0", format="gguf", options=QuantizeOptions(force=True))
    assert _fields(out)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_quantized_embedding_and_kept_projection(tiny_model_dir, tmp_path):
    """--include the embedding: token_embd gets the block type; an excluded q_proj stays F32 and is still permuted."""
    out = quantize_model(tiny_model_dir, output=tmp_path / "e.gguf", scheme="q8_0", format="gguf",
                         options=QuantizeOptions(include=["model.embed_tokens.weight"], exclude=["*.layers.0.self_attn.q_proj.weight"])).output
    t = _tensors(out)
    assert t["token_embd.weight"].tensor_type == T.Q8_0 and t["blk.0.attn_q.weight"].tensor_type == T.F32
    w = _source(tiny_model_dir)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(torch.from_numpy(np.array(t["blk.0.attn_q.weight"].data)), w[gg.row_permutation(64, 4)])
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and len(r.tensors) == 14


# --------------------------------------------------------------------------- other sources


def _tiny_qwen2(directory: Path, dtype=torch.float32) -> Path:
    from conftest import make_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qkit.checkpoint import ShardWriter

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).to(dtype)
    with torch.no_grad():  # biases are zero at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    directory.mkdir(parents=True)
    config.dtype = dtype
    config.save_pretrained(str(directory))
    writer = ShardWriter(directory)
    for n, t in model.state_dict().items():
        writer.add(n, t)
    writer.close()
    make_tokenizer(directory)
    return directory


def test_qwen2_has_biases_an_output_and_no_permutation(tmp_path):
    src_dir = _tiny_qwen2(tmp_path / "qwen2")
    out = quantize_model(src_dir, output=tmp_path / "q.gguf", scheme="q8_0", format="gguf").output
    f, t = _fields(out), _tensors(out)
    assert f["general.architecture"] == "qwen2" and "qwen2.rope.dimension_count" not in f
    assert f["general.name"] == "qwen2"  # the model directory's name, as llama.cpp's converter falls back to
    assert t["blk.0.attn_q.bias"].tensor_type == T.F32 and t["output.weight"].tensor_type == T.F32
    src = _source(src_dir)
    assert np.array_equal(np.array(t["blk.1.attn_k.bias"].data), src["model.layers.1.self_attn.k_proj.bias"].numpy())
    q = quantize_tensor(src["model.layers.0.self_attn.q_proj.weight"], get_scheme("q8_0"))
    assert np.array_equal(np.array(t["blk.0.attn_q.weight"].data), q.qweight.numpy())  # rows in Hugging Face order
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and r.logits_max_abs_diff <= r.logits_tolerance and all(c.identical for c in r.tensors)


def test_bf16_source_keeps_bf16_tensors_exactly(tiny_model_dir, tmp_path):
    from conftest import make_tiny_llama

    d = tmp_path / "bf16"
    make_tiny_llama(d, dtype=torch.bfloat16)
    out = quantize_model(d, output=tmp_path / "b.gguf", scheme="q8_0", format="gguf").output
    t = _tensors(out)
    assert t["token_embd.weight"].tensor_type == T.BF16 and t["output_norm.weight"].tensor_type == T.F32
    src = _source(d)
    back = torch.from_numpy(gguf.quants.dequantize(t["token_embd.weight"].data, T.BF16))
    assert torch.equal(back, src["model.embed_tokens.weight"].float())
    assert _fields(out)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0


def test_llama3_rope_writes_llama_cpps_rope_freqs():
    config = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    f = gg.llama3_rope_factors(config)
    # dim 16: wavelengths 2*pi*500000**(2i/16); above 8192 -> factor 8, below 2048 -> 1, smooth between
    assert f.shape == (8,) and f[0] == 1.0 and f[-1] == 8.0 and bool(((f >= 1) & (f <= 8)).all())


# --------------------------------------------------------------------------- mxfp4 -> llama.cpp's MXFP4


def test_mxfp4_parts_convert_to_and_from_llama_cpps_blocks():
    """qkit's mxfp4 (codes two per byte, E8M0 bytes apart) is gguf's MXFP4 quantizer in another byte order:
    converted, the bytes are ``gguf.quants.quantize``'s; converted back, qkit's own parts."""
    from qkit.schemes.fp4 import from_gguf_mxfp4_blocks

    torch.manual_seed(0)
    s = get_scheme("mxfp4")
    assert gg.is_ggml(s) and s.ggml_type == T.MXFP4 and gg.scheme_for_type(T.MXFP4) is s
    w = torch.randn(48, 256) * torch.rand(48, 1) * 4
    qt = quantize_tensor(w, s)
    blocks = gg.ggml_blocks(qt)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (48, gg.block_bytes(T.MXFP4, 256))
    assert np.array_equal(blocks.numpy(), gguf.quants.quantize(w.numpy(), T.MXFP4))
    qweight, exps = from_gguf_mxfp4_blocks(blocks)
    assert torch.equal(qweight, qt.qweight) and torch.equal(exps, qt.scales)
    back = gg.FORMAT.decode({"qweight": blocks}, s, torch.float32)
    assert back.scheme is s and back.shape == (48, 256)
    assert torch.equal(back.dequantize(torch.float32), qt.dequantize(torch.float32))


def test_mxfp4_exports_as_mxfp4_and_verifies(tiny_model_dir, exports):
    """Every quantized tensor is stored as MXFP4 (the bytes of qkit's codes and exponents, q/k rows permuted),
    ``general.file_type`` is llama.cpp's MXFP4 ftype, and ``qkit verify`` finds qkit, gguf and transformers
    bit-identical with the codes recorded at export."""
    path = exports["mxfp4"]
    assert _fields(path)["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    stored, src = _tensors(path), _source(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    names = gg.tensor_names("llama", 2, list(src), tied=True)
    quantized = 0
    for name, w in src.items():
        t = stored[names[name]]
        if t.tensor_type != T.MXFP4:
            assert t.tensor_type == T.F32, name
            continue
        qt = quantize_tensor(w, get_scheme("mxfp4"), name=name)
        blocks = gg.ggml_blocks(qt)
        heads = gg.permutation_heads("llama", config, name)
        if heads:
            blocks = blocks[gg.row_permutation(w.shape[0], heads)]
        assert np.array_equal(np.array(t.data), blocks.numpy()), name
        quantized += 1
    assert quantized == 14
    r = verify_checkpoint(path, device="cpu")
    assert r.passed and r.logits_max_abs_diff == 0.0
    assert r.by_scheme() == {"mxfp4": {"tensors": 14, "identical": 14, "within_tolerance": 14, "max_abs_diff": 0.0,
                                       "match_export": 14}}


def test_refuses_a_width_mxfp4_cannot_take_and_nvfp4(tiny_model_dir, tmp_path):
    from conftest import make_tiny_llama

    d = tmp_path / "w48"
    make_tiny_llama(d, hidden=48)
    msg = _refused(tmp_path, d, "not a multiple of mxfp4's block of 32", scheme="mxfp4")
    assert "48" in msg and "--exclude" in msg and "nvfp4" not in msg  # GGUF's words: nvfp4 is no GGUF type
    msg = _refused(tmp_path, tiny_model_dir, "and nvfp4 is not one of them", scheme="nvfp4")
    assert "mxfp4" in msg


# --------------------------------------------------------------------------- refusals


def _refused(tmp_path: Path, model: Path, needle: str, **kw) -> str:
    out = tmp_path / "refused.gguf"
    with pytest.raises(QkitError) as exc:
        quantize_model(model, output=out, format="gguf", options=QuantizeOptions(**kw))
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg
    assert not out.exists() and _no_leftovers(tmp_path)
    return msg


def test_refuses_a_scheme_that_is_not_a_ggml_type(tiny_model_dir, tmp_path):
    for scheme in ("int4-g128", "nf4"):
        msg = _refused(tmp_path, tiny_model_dir, f"and {scheme} is not one of them", scheme=scheme)
        assert "q4_0" in msg and "q8_0" in msg and "--format qkit" in msg


def test_refuses_an_architecture_it_does_not_know(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=300)).save_pretrained(str(d))
    # gpt2 is llama.cpp's converter's (qkit.converted), which takes no --include
    _refused(tmp_path, d, "--include with --format gguf is for llama and qwen2 models", scheme="q8_0",
             include=["*.c_attn.weight"])
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    _refused(tmp_path, d, "does not convert architecture 'NoSuchForCausalLM'", scheme="q8_0")


def test_refuses_a_width_the_block_type_cannot_take(tmp_path):
    from conftest import make_tiny_llama

    d = tmp_path / "w48"
    make_tiny_llama(d, hidden=48)
    for scheme in ("q8_0", "q4_k"):  # qkit's schemes refuse the width themselves, before any work too
        msg = _refused(tmp_path, d, "not a multiple of", scheme=scheme)
        assert "48" in msg and "32" in msg and "--exclude" in msg


def test_refuses_quantizing_a_norm(tiny_model_dir, tmp_path):
    _refused(tmp_path, tiny_model_dir, "keeps norms and 1-D tensors in F32", scheme="q8_0", include=["*norm.weight"])


def test_refuses_a_tokenizer_llama_cpp_would_not_recognize(tiny_model_dir, tmp_path):
    import shutil

    d = tmp_path / "nfc"
    shutil.copytree(tiny_model_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "NFKC"}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    _refused(tmp_path, d, "is not one llama.cpp's converter recognizes", scheme="q8_0")


def test_refuses_a_directory_where_a_file_goes(tiny_model_dir, tmp_path):
    (tmp_path / "x.gguf").mkdir()
    with pytest.raises(OutputExistsError, match="is a directory"):
        quantize_model(tiny_model_dir, output=tmp_path / "x.gguf", scheme="q8_0", format="gguf",
                       options=QuantizeOptions(force=True))


def test_export_error_is_a_qkit_error():
    assert issubclass(ExportError, QkitError)


# --------------------------------------------------------------------------- the default model (slow)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["q4_0"])  # q8_0's blocks are checked against the gguf package elsewhere
def test_default_model_round_trip(default_model_dir, tmp_path, scheme):
    """The real model: the published GGUF's tokenizer and metadata survive, transformers' logits equal qkit's."""
    from qkit import pinned_models

    source = pinned_models.DEFAULT.asset.path
    out = quantize_model(None, output=tmp_path / f"smol-{scheme}.gguf", scheme=scheme, format="gguf").output
    ours_f, src_f = _fields(out), _fields(source)
    for key, value in src_f.items():
        if key.startswith("tokenizer."):
            assert ours_f[key] == value, key  # copied field by field
        elif key.startswith(("llama.", "general.")) and key not in ("general.file_type",):
            assert ours_f[key] == value, key
    assert ours_f["general.file_type"] == {"q8_0": 7, "q4_0": 2}[scheme]
    t_ours, t_src = _tensors(out), _tensors(source)
    assert set(t_ours) == set(t_src)
    assert {n for n, t in t_ours.items() if t.tensor_type != T.F32} == {
        n for n in t_src if ".attn_" in n and "norm" not in n or ".ffn_" in n and "norm" not in n}
    r = verify_checkpoint(out, device="cpu")
    assert r.passed and len(r.tensors) == 210 and all(c.identical and c.matches_export for c in r.tensors)
    assert r.logits_max_abs_diff == 0.0 and r.prompt_tokens > 10


@pytest.mark.slow
def test_hf_tokenizer_conversion_reproduces_the_published_one(default_model_dir):
    """The default model's tokenizer, as transformers converted it from the GGUF, converted back the way llama.cpp
    converts a Hugging Face tokenizer: the published file's tokens, merges, types and ids."""
    from qkit import pinned_models

    config = json.loads((default_model_dir / "config.json").read_text())
    got = gg.hf_tokenizer(default_model_dir, config, "llama")
    src = _fields(pinned_models.DEFAULT.asset.path)
    assert got["pre"] == src["tokenizer.ggml.pre"] == "smollm"
    assert got["tokens"] == src["tokenizer.ggml.tokens"]
    assert [int(t) for t in got["types"]] == src["tokenizer.ggml.token_type"]
    assert got["special"].merges == src["tokenizer.ggml.merges"]


def test_cli_quantize_gguf_and_verify_the_file(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from qkit.cli import app

    runner = CliRunner()
    out = tmp_path / "tiny-q8_0.gguf"
    res = runner.invoke(app, ["quantize", str(tiny_model_dir), "-s", "q8_0", "--format", "gguf", "-o", str(out),
                              "--device", "cpu", "--json", str(tmp_path / "q.json")])
    assert res.exit_code == 0, res.output
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["format"] == "gguf" and q["bytes_after"] == out.stat().st_size and q["schemes_used"] == {"q8_0": 14}
    res = runner.invoke(app, ["verify", str(out), "--device", "cpu", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert data["passed"] and data["format"] == "gguf" and data["by_scheme"]["q8_0"]["identical"] == 14
    res = runner.invoke(app, ["quantize", str(tiny_model_dir), "-s", "int4-g128", "--format", "gguf", "-o",
                              str(tmp_path / "no.gguf"), "--device", "cpu"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "no.gguf").exists()


@pytest.mark.slow
def test_requantizing_the_published_q4_1_reproduces_llama_cpps_file(default_model_dir, tmp_path):
    """The default model was published as Q4_1 by llama.cpp; its weights, dequantized and exported again with
    qkit's q4_1, give back the published file's blocks byte for byte in every one of the 210 matrices, q/k
    (permuted by the writer) included: llama.cpp's names, layouts and permutation, checked against llama.cpp."""
    from qkit import pinned_models

    out = quantize_model(None, output=tmp_path / "smol-q4_1.gguf", scheme="q4_1", format="gguf").output
    ours, src = _tensors(out), _tensors(pinned_models.DEFAULT.asset.path)
    checked = 0
    for name, t in src.items():
        if t.tensor_type == T.Q4_1:
            assert ours[name].tensor_type == T.Q4_1 and np.array_equal(np.array(ours[name].data), np.array(t.data)), name
            checked += 1
    assert checked == 210
    # qkit verify reads a file qkit did not write (no record): qkit, gguf and transformers agree on it too
    r = verify_checkpoint(pinned_models.DEFAULT.asset.path, device="cpu")
    assert r.passed and r.logits_max_abs_diff == 0.0 and all(c.matches_export is None for c in r.tensors)
    assert {s: v["tensors"] for s, v in r.by_scheme().items()} == {"q4_1": 210, "q8_0": 1}  # token_embd is Q8_0


def test_fast_kv_reader_equals_the_gguf_package(tmp_path):
    """``read_kv_fields`` (bulk header parse) gives every field's type and value exactly as gguf's reader."""
    import gguf as g

    from qkit.export.gguf import read_kv_fields

    V = g.GGUFValueType
    path = tmp_path / "kv.gguf"
    w = g.GGUFWriter(str(path), "llama")
    w.add_key_value("t.u8", 7, V.UINT8)
    w.add_key_value("t.i8", -7, V.INT8)
    w.add_key_value("t.u16", 65535, V.UINT16)
    w.add_key_value("t.i16", -300, V.INT16)
    w.add_key_value("t.u32", 2**32 - 1, V.UINT32)
    w.add_key_value("t.i32", -(2**31), V.INT32)
    w.add_key_value("t.u64", 2**64 - 1, V.UINT64)
    w.add_key_value("t.i64", -(2**63), V.INT64)
    w.add_key_value("t.f32", 0.1, V.FLOAT32)
    w.add_key_value("t.f64", 0.1, V.FLOAT64)
    w.add_key_value("t.bool", True, V.BOOL)
    w.add_key_value("t.str", "ünïcode", V.STRING)
    w.add_key_value("t.strs", ["a", "", "\u2581b", "<|im_end|>"], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("t.ints", [1, -2, 3], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("t.floats", [0.5, -1.25], V.ARRAY, sub_type=V.FLOAT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    reader = g.GGUFReader(str(path))
    fast = {k: (t, v, s) for k, t, v, s in read_kv_fields(path)}
    real = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader's own header pseudo-fields
    assert list(fast) == list(real)
    for key, f in real.items():
        t, v, s = fast[key]
        assert t == f.types[0], key
        if t == V.ARRAY:
            assert s == f.types[-1]
            ref = [bytes(f.parts[i]) for i in f.data] if s == V.STRING else [f.parts[i].tolist()[0] for i in f.data]
        else:
            ref = bytes(f.parts[-1]) if t == V.STRING else f.parts[-1].tolist()[0]
        assert v == ref and type(v) is type(ref), key
    assert fast["t.str"][1] == "ünïcode".encode() and fast["t.u64"][1] == 2**64 - 1 and fast["t.bool"][1] is True


def test_fast_kv_reader_refuses_bad_files_in_one_line(tmp_path):
    import gguf as g

    from qkit.export.gguf import read_kv_fields

    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ExportError, match="is not a GGUF file"):
        read_kv_fields(not_gguf)
    good = tmp_path / "kv.gguf"
    w = g.GGUFWriter(str(good), "llama")
    w.add_key_value("t.strs", ["token"] * 1000, g.GGUFValueType.ARRAY, sub_type=g.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="truncated GGUF metadata") as err:
        read_kv_fields(cut)
    assert "\n" not in str(err.value)
    bad_key = tmp_path / "badkey.gguf"
    i = data.index(b"general.architecture")
    bad_key.write_bytes(data[:i] + b"\xff" + data[i + 1 :])
    with pytest.raises(ExportError, match="not UTF-8"):
        read_kv_fields(bad_key)
