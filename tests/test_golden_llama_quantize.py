"""Whole GGUF files against llama-quantize's, without llama.cpp: its output recorded once, per tensor.

The claim (docs/gguf-measurements.md, "Bit-exact with llama.cpp"): from the same F32 GGUF, ``llama-quantize
[--imatrix FILE] [--pure] --token-embedding-type f32 F32.gguf OUT FTYPE`` and ``qkit quantize -s SCHEME
--format gguf [--imatrix FILE]`` write every block projection with the same type and the same bytes, for
the ten recipes of the ladder, ``q6_k``, ``q8_0`` and the ten uniform types, without and with an
importance matrix; and a ``--tensor-type-file`` of patterns over a Q8_0 base (``qkit quantize
--tensor-type``: docs/gguf.md, "Per-tensor types in llama.cpp's terms"). The per-type golden files
(``ggml_imatrix.json``, ``kquants.json``) pin the block encoders; this one pins what only the whole file
shows: the recipe's type for each tensor (layer rules, width fallbacks, pattern overrides), the
importance-matrix entry each tensor is quantized with, and the tensor layout.

The model and the importance matrix are made here from seeded numpy draws (no download, no torch RNG):
a qwen2 of 4 layers, 256 wide (the k-quants keep their super-blocks), intermediate 544 (ffn_down is
544 wide, so every k-quant falls back there as llama.cpp does), q/k/v biases, tied embeddings; the
matrix has an entry for each of the 28 block projections. ``tests/golden/llama_quantize.json`` holds,
for each of the 46 files, every block projection's ggml type and the sha256 of its bytes as
llama-quantize wrote them, with the llama.cpp commit, the commands and the sha256 of the inputs
(a changed numpy stream is reported as that, not as a wrong byte).

Recorded with llama.cpp's tools built (``python benchmarks/build_llama_ref.py --tools``):

    QKIT_RECORD_LLAMA_QUANTIZE=1 python -m pytest tests/test_golden_llama_quantize.py

which writes the F32 GGUF (qkit's metadata, every tensor F32: qwen2 has no q/k permutation), runs
llama-quantize for every file and rewrites the golden file; the same run then checks qkit against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module, f32_gguf, make_tokenizer

from qkit.api import QuantizeOptions, quantize_model
from qkit.methods.imatrix import Imatrix, ImatrixEntry, write_gguf

GOLDEN_PATH = Path(__file__).parent / "golden" / "llama_quantize.json"
RECORD = os.environ.get("QKIT_RECORD_LLAMA_QUANTIZE") == "1"
RECORD_COMMAND = "QKIT_RECORD_LLAMA_QUANTIZE=1 python -m pytest tests/test_golden_llama_quantize.py"

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 4, 256, 544, 4, 2, 304
BLOCK = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
# (qkit scheme, llama-quantize ftype, --pure): the ladder as docs/gguf.md and benchmarks/bench_imatrix.py list it
FILES = [("q2_k-llama", "Q2_K", False), ("q3_k_s", "Q3_K_S", False), ("q3_k_m", "Q3_K_M", False),
         ("q3_k_l", "Q3_K_L", False), ("iq4_nl-llama", "IQ4_NL", False), ("iq4_xs-llama", "IQ4_XS", False),
         ("q4_k_s", "Q4_K_S", False), ("q4_k_m", "Q4_K_M", False), ("q5_k_s", "Q5_K_S", False),
         ("q5_k_m", "Q5_K_M", False), ("q6_k", "Q6_K", False), ("q8_0", "Q8_0", False),
         ("q2_k", "Q2_K", True), ("q3_k", "Q3_K_M", True), ("q4_k", "Q4_K_M", True), ("q5_k", "Q5_K_M", True),
         ("iq4_nl", "IQ4_NL", True), ("iq4_xs", "IQ4_XS", True), ("q4_0", "Q4_0", True), ("q4_1", "Q4_1", True),
         ("q5_0", "Q5_0", True), ("q5_1", "Q5_1", True)]
# llama-quantize --tensor-type-file (qkit: --tensor-type) over a Q8_0 base: case-folded patterns searched anywhere in
# the name, the first match wins, a k-quant on the 544-wide ffn_down falls back (Q6_K -> Q8_0, Q4_K -> Q5_0)
TENSOR_TYPES = [r"blk\.0\.attn_v=Q6_K", r"blk\.3\.FFN_DOWN=q6_k", "ffn_down=Q5_1", r"blk\.[12]\.ffn=Q4_K", "ffn=IQ4_XS",
                "attn_output=Q3_K", "attn_q=Q2_K", r"blk\.2\.attn_k=IQ4_NL", "attn_k=Q5_K"]
TT = "q8_0+tensor-types"
CASES = [(scheme, ftype, pure, weighted) for scheme, ftype, pure in FILES for weighted in (False, True)]
CASES += [(TT, "Q8_0", False, weighted) for weighted in (False, True)]


def _key(scheme: str, weighted: bool) -> str:
    return scheme + ("+imatrix" if weighted else "")


# --------------------------------------------------------------------------- the inputs


def _weights() -> dict[str, np.ndarray]:
    """Every tensor of the model, by Hugging Face name, in a fixed order from one seeded generator."""
    rng = np.random.default_rng(20240)
    kv = KV_HEADS * HIDDEN // HEADS
    out = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)) * 0.05}
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN), "self_attn.v_proj": (kv, HIDDEN),
              "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            # heavier tails than a normal draw, and a few rows 10x larger: weight-like, with outliers
            w = rng.standard_normal(shape) * 0.02 * np.exp(0.5 * rng.standard_normal(shape))
            w[rng.integers(0, shape[0], 2)] *= 10.0
            out[p + name + ".weight"] = w
        for name, n in (("q_proj", HIDDEN), ("k_proj", kv), ("v_proj", kv)):
            out[p + f"self_attn.{name}.bias"] = rng.standard_normal(n) * 0.1
        out[p + "input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(HIDDEN)
    out["model.norm.weight"] = 1.0 + 0.1 * rng.standard_normal(HIDDEN)
    return {n: np.ascontiguousarray(w, dtype=np.float32) for n, w in out.items()}


def _imatrix() -> Imatrix:
    """One entry per block projection (llama.cpp names), ``sums`` of squares over 1,000 tokens: random
    magnitudes over six decades, with zero columns (weight 0 in llama.cpp's searches)."""
    rng = np.random.default_rng(20241)
    kv = KV_HEADS * HIDDEN // HEADS
    widths = {"attn_q": HIDDEN, "attn_k": HIDDEN, "attn_v": HIDDEN, "attn_output": HIDDEN, "ffn_gate": HIDDEN,
              "ffn_up": HIDDEN, "ffn_down": INTER}
    assert kv  # k/v are [kv, HIDDEN]: their importance is over the HIDDEN input columns
    entries = {}
    for i in range(LAYERS):
        for role, w in widths.items():
            sums = rng.random(w) * 10.0 ** rng.uniform(-3, 3, w) * 1000.0
            sums[rng.random(w) < 0.05] = 0.0
            entries[f"blk.{i}.{role}.weight"] = ImatrixEntry(sums.astype(np.float32).reshape(1, w),
                                                              np.array([1000.0], np.float32))
    return Imatrix(entries, chunk_count=4, chunk_size=250, datasets=["seeded numpy draws"])


def _inputs_sha256(weights: dict[str, np.ndarray], im: Imatrix) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode() + b"\0" + weights[name].tobytes())
    for name in sorted(im.entries):
        e = im.entries[name]
        h.update(name.encode() + b"\0" + e.sums.tobytes() + e.counts.tobytes())
    return h.hexdigest()


def _write_model(directory: Path, weights: dict[str, np.ndarray]) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    params = dict(model.named_parameters())
    assert set(params) == set(weights), set(params) ^ set(weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(weights[name]))
    model.save_pretrained(str(directory), safe_serialization=True)
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(model directory, importance-matrix file, inputs sha256)."""
    d = tmp_path_factory.mktemp("llama-quantize-golden")
    weights, im = _weights(), _imatrix()
    model = _write_model(d / "model", weights)
    write_gguf(im, d / "imatrix.gguf")
    return model, d / "imatrix.gguf", _inputs_sha256(weights, im)


# --------------------------------------------------------------------------- reading a file


def block_tensors(path: Path) -> dict[str, list[str]]:
    """``{llama.cpp name: [ggml type, sha256 of its bytes]}`` for every block projection of a GGUF file."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if BLOCK.match(t.name):
            data = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8)
            out[t.name] = [t.tensor_type.name, hashlib.sha256(data.tobytes()).hexdigest()]
    return dict(sorted(out.items()))


def _qkit_file(model: Path, im: Path, scheme: str, weighted: bool, out: Path) -> Path:
    tensor_types = TENSOR_TYPES if scheme == TT else ()
    opts = QuantizeOptions(scheme="q8_0" if scheme == TT else scheme, format="gguf", imatrix=str(im) if weighted else None,
                           tensor_types=tensor_types)
    quantize_model(model, output=out, options=opts)
    return out


# --------------------------------------------------------------------------- recording (llama.cpp's tools)


def _f32_gguf(model: Path, work: Path) -> Path:
    """An F32 GGUF of ``model`` for llama-quantize (``conftest.f32_gguf``), with qkit's GGUF metadata."""
    meta = _qkit_file(model, work / "none", "q8_0", False, work / "meta.gguf")
    return f32_gguf(meta, model, work / "f32.gguf", LAYERS)


def record(model: Path, im: Path, inputs_sha256: str, work: Path) -> dict:
    blr = benchmark_module("build_llama_ref")
    tool = blr.tool_path("llama-quantize")
    if not tool.exists():
        pytest.fail("recording needs llama.cpp's tools: python benchmarks/build_llama_ref.py --tools")
    f32 = _f32_gguf(model, work)
    tt = work / "tensor-types.txt"
    tt.write_text("\n".join(TENSOR_TYPES) + "\n")
    files, commands = {}, {}
    for scheme, ftype, pure, weighted in CASES:
        key = _key(scheme, weighted)
        out = work / f"llama-{key}.gguf"
        cmd = [str(tool), *(["--imatrix", str(im)] if weighted else []), *(["--pure"] if pure else []),
               *(["--tensor-type-file", str(tt)] if scheme == TT else []),
               "--token-embedding-type", "f32", str(f32), str(out), ftype, "2"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        assert p.returncode == 0, (key, p.stderr[-2000:])
        if weighted:
            assert f"loaded {LAYERS * 7} importance matrix entries" in p.stdout + p.stderr, (key, p.stderr[-2000:])
        files[key] = block_tensors(out)
        assert len(files[key]) == LAYERS * 7, key
        commands[key] = " ".join(["llama-quantize", *cmd[1:-6], "--token-embedding-type", "f32", "F32.gguf", "OUT.gguf",
                                  ftype, "2"]).replace(str(im), "imatrix.gguf").replace(str(tt), "tensor-types.txt")
    doc = {
        "description": "llama-quantize's output on a seeded qwen2 (4 layers, hidden 256, intermediate 544, tied): "
                       "per file, every block projection's ggml type and the sha256 of its bytes",
        "command": RECORD_COMMAND,
        "llama_cpp_commit": blr.commit(),
        "llama_cpp_python_sdist": blr.LLAMA_CPP_PYTHON,
        "tools_build": "python benchmarks/build_llama_ref.py --tools",
        "inputs_sha256": inputs_sha256,
        "tensor_types": TENSOR_TYPES,
        "llama_quantize": commands,
        "files": files,
    }
    GOLDEN_PATH.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


@pytest.fixture(scope="module")
def golden(inputs, tmp_path_factory):
    if RECORD:
        return record(*inputs, tmp_path_factory.mktemp("llama-quantize-record"))
    return json.loads(GOLDEN_PATH.read_text())


# --------------------------------------------------------------------------- the tests


def test_golden_file_says_where_it_came_from_and_covers_the_ladder(golden):
    assert golden["command"] == RECORD_COMMAND
    assert golden["llama_cpp_commit"] == benchmark_module("build_llama_ref").LLAMA_CPP_COMMIT
    assert set(golden["files"]) == {_key(s, w) for s, _, _, w in CASES}
    assert golden["tensor_types"] == TENSOR_TYPES
    assert all(len(f) == LAYERS * 7 for f in golden["files"].values())


def test_the_inputs_are_the_recorded_ones(inputs, golden):
    """The seeded draws still give the recorded model and matrix (else numpy's stream moved, not qkit)."""
    assert inputs[2] == golden["inputs_sha256"]


def test_llama_quantize_used_the_matrix_wherever_the_type_takes_one(golden):
    """In the recording, every tensor of a type with an importance path (all but Q8_0) changed with the matrix."""
    for scheme, _, _, weighted in CASES:
        if weighted:
            plain, imat = golden["files"][scheme], golden["files"][_key(scheme, True)]
            same = [n for n in plain if plain[n][0] != "Q8_0" and plain[n][1] == imat[n][1]]
            assert not same and all(plain[n][0] == imat[n][0] for n in plain), (scheme, same)


@pytest.mark.parametrize(("scheme", "ftype", "pure", "weighted"), CASES,
                         ids=[_key(s, w) for s, _, _, w in CASES])
def test_every_block_projection_equals_llama_quantize(inputs, golden, tmp_path, scheme, ftype, pure, weighted):
    model, im, sha = inputs
    if sha != golden["inputs_sha256"]:
        pytest.fail("the seeded inputs differ from the recorded ones (see test_the_inputs_are_the_recorded_ones)")
    want = golden["files"][_key(scheme, weighted)]
    got = block_tensors(_qkit_file(model, im, scheme, weighted, tmp_path / "q.gguf"))
    assert list(got) == list(want)
    types = {n: (got[n][0], want[n][0]) for n in want if got[n][0] != want[n][0]}
    assert not types, f"{ftype}: qkit/llama-quantize types differ: {types}"
    differ = [n for n in want if got[n][1] != want[n][1]]
    assert not differ, f"{ftype}: bytes differ from llama-quantize's in {differ}"
