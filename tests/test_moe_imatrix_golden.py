"""``qkit imatrix`` on a mixture-of-experts model against llama-imatrix's file, without llama.cpp: its output
recorded once.

The claim (docs/moe.md): on the same model and the same chunks of text, qkit's importance matrix has
llama-imatrix's entries in llama-imatrix's layout (the same tensors, names, shapes and order: one row per
expert in each stacked ``_exps`` entry, the router's input as ``ffn_gate_inp``), the same token count for
every expert (qkit routes each token to the experts llama.cpp routes it to), and the same sums of squares to
float tolerance (torch's activations against ggml's).

The models: ``helpers_archs.make_arch_model(..., "qwen3_moe")`` (seeded: 2 layers, 4 experts, 2 per token,
256 wide, the default model's tokenizer) with ``norm_topk_prob`` true: llama.cpp's qwen3moe graph always
renormalises the top-k weights, whatever the config says (with it false, layer 1's routing differs); and
``make_arch_model(..., "gpt_oss")`` (the same sizes; experts stored fused ``[E, in, out]``, gate and up
interleaved, biases, the clamped SwiGLU, attention sinks) with its routers' weights x10, so that layer 1
sends 590 of its 1,024 tokens to expert 0 and 434 to expert 1 beside expert 2 (layer 0 sends every token to
experts 0 and 2; qkit's sums of its experts' inputs, the clamped SwiGLU's for ``ffn_down_exps``, lie within
3e-5 of the largest, 2.4e-4 for every entry). The text: the first ``TEXT_CHARS`` characters of qkit's pinned
calibration text (KJV), ``CHUNKS`` chunks of ``CHUNK`` tokens. ``tests/golden/moe_imatrix.json`` (and
``moe_imatrix_gpt_oss.json``) holds llama-imatrix's tensors (name, shape, type in file order), its counts and
sums, with the sha256 of the model file and of the text, so that a changed input is reported as that.

Recorded with llama.cpp's tools built (``python benchmarks/build_llama_ref.py --tools``) and its converter's
source beside them:

    QKIT_RECORD_MOE_IMATRIX=1 python -m pytest tests/test_moe_imatrix_golden.py [-k gpt_oss]
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers_archs import make_arch_model

from qkit.api import imatrix_model
from qkit.methods.imatrix import ImatrixOptions, read

GOLDEN = Path(__file__).parent / "golden" / "moe_imatrix.json"
RECORD = os.environ.get("QKIT_RECORD_MOE_IMATRIX") == "1"
TEXT_CHARS, CHUNKS, CHUNK = 60_000, 4, 256
LLAMA = Path.home() / ".cache/qkit/llama_ref/llama-cpp-python-0.3.36"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def inputs(request, tmp_path_factory, default_model_dir) -> tuple[Path, Path, Path]:
    """The model directory, the text file and the golden file of each architecture."""
    from qkit.texts import load_calibration_text

    arch = request.param
    d = tmp_path_factory.mktemp("moe-golden")
    model = make_arch_model(d / arch, arch, default_model_dir)
    if arch == "qwen3_moe":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}, indent=2))
    else:  # gpt_oss: its routers x10, so that layer 1 splits the tokens (seeded as drawn, every token picks 0 and 2)
        from safetensors.torch import load_file, save_file

        weights = load_file(model / "model.safetensors")
        weights.update({k: v * 10 for k, v in weights.items() if k.endswith("mlp.router.weight")})
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    text = d / "text.txt"
    text.write_text(load_calibration_text(None).text[:TEXT_CHARS])
    return model, text, GOLDEN if arch == "qwen3_moe" else GOLDEN.with_name(f"moe_imatrix_{arch}.json")


def tensors(path: Path) -> list[list]:
    """``[name, shape (ggml ne), type]`` of every tensor, in file order."""
    return [[t.name, [int(x) for x in t.shape], t.tensor_type.name] for t in gguf.GGUFReader(str(path)).tensors]


def convert_f32(model: Path, out: Path) -> Path:
    """The F32 GGUF of ``model`` by llama.cpp's own converter (recording only; the bridge that runs it for qkit
    can take its place). Its gguf-py first on the path; a stub sentencepiece, which it imports before it knows
    whether the model has a tokenizer.model."""
    shim = out.parent / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    def __init__(self, *a, **k):\n"
                                           "        raise ImportError('sentencepiece is not installed')\n")
    src = LLAMA / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(shim)])}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", "f32",
                    "--outfile", str(out)], check=True, env=env, capture_output=True)
    return out


def record(model: Path, text: Path, tmp: Path, golden: Path) -> None:
    tool = LLAMA / "build-tools/bin/llama-imatrix"
    if not tool.is_file():
        pytest.skip("llama.cpp's tools are not built (python benchmarks/build_llama_ref.py --tools)")
    f32 = convert_f32(model, tmp / "f32.gguf")
    out = tmp / "llama.imatrix.gguf"
    command = [str(tool), "-m", str(f32), "-f", str(text), "-c", str(CHUNK), "--chunks", str(CHUNKS), "-o", str(out),
               "-t", "2"]
    subprocess.run(command, check=True, capture_output=True)
    m = read(out)
    from qkit.schemes.kquants import LLAMA_CPP_COMMIT

    head = {"llama_cpp_commit": LLAMA_CPP_COMMIT,
            "command": "llama-imatrix -m F32.gguf -f TEXT -c 256 --chunks 4 -o OUT -t 2",
            "model_sha256": sha256(model / "model.safetensors"), "text_sha256": sha256(text), "tensors": tensors(out)}
    # one line per entry; 7 digits: float32's, more than the 1e-3 compared
    entries = {k: {"counts": e.counts.tolist(), "sums": [[float(f"{x:.7g}") for x in row] for row in e.sums]}
               for k, e in sorted(m.entries.items())}
    lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in entries.items()]
    golden.write_text(json.dumps(head, indent=1)[:-2] + ',\n "entries": {\n' + ",\n".join(lines) + "\n }\n}\n")


def test_qkit_imatrix_of_a_moe_model_is_llama_imatrixs(inputs, tmp_path):
    model, text, path = inputs
    if RECORD:
        record(model, text, tmp_path, path)
    golden = json.loads(path.read_text())
    assert sha256(model / "model.safetensors") == golden["model_sha256"], "the seeded model changed: re-record"
    assert sha256(text) == golden["text_sha256"], "the text changed: re-record"
    out = tmp_path / "qkit.imatrix.gguf"
    imatrix_model(model, output=out, options=ImatrixOptions(source=str(text), chunks=CHUNKS, chunk_size=CHUNK))
    assert tensors(out) == golden["tensors"]  # names, shapes, types, order
    m = read(out)
    assert sorted(m.entries) == sorted(golden["entries"])
    for name, want in golden["entries"].items():
        e = m.entries[name]
        assert e.counts.tolist() == want["counts"], name  # every token routed as llama.cpp routes it
        sums = np.array(want["sums"], dtype=np.float32)
        assert np.abs(e.sums - sums).max() <= 1e-3 * np.abs(sums).max(), name
    assert any(len(e["counts"]) == 4 for e in golden["entries"].values())
