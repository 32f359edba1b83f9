"""A plan through every door out: the GGUF ``llama-quantize --tensor-type-file`` writes from the plan's emitted
types (byte for byte against qkit's), a mixed compressed-tensors checkpoint that transformers loads and
``qkit verify`` passes, ``quantize --target-bits`` against ``plan`` then ``quantize --plan``, and a plan
measured with an importance matrix, which its quantize must be given again.

The planned tensors' bytes are checked against the files themselves: GGUF ``n_bytes`` (gguf-py's reader),
and every ``M.weight*`` entry of the safetensors headers for compressed-tensors.
"""

from __future__ import annotations

import json
import struct
import subprocess
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import benchmark_module
from typer.testing import CliRunner

from qkit.cli import app
from qkit.export.gguf.converter import convert_f32
from qkit.llama_names import tensor_names

runner = CliRunner()
# Small calibration for the tiny model: two windows of 32 tokens, both checked.
FAST = ["--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "2"]
# The default model is dequantized from a Q4_1 GGUF: q4_1 (and q5_1, which holds q4_1's grid) would be
# lossless there and take every tensor; without them the plan mixes several types.
DEFAULT_CANDIDATES = "q2_k,q3_k,iq4_xs,iq4_nl,q4_0,q4_k,q5_0,q5_k,q6_k,q8_0"


def _ok(args: list[str]) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, (args, r.output)
    return r.output


def _refused(args: list[str], message: str) -> None:
    """Exit 2 with one error (one message, however rich wraps it), no traceback, ``message`` in it."""
    r = runner.invoke(app, [str(a) for a in args])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, (args, r.output)
    assert r.output.count("error:") == 1 and "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 3, r.output
    assert message in flat, r.output


def _plan(path: Path) -> dict:
    return json.loads(path.read_text())


def _gguf_tensors(path: Path) -> dict[str, tuple[str, int, bytes]]:
    """``{gguf name: (type, n_bytes, raw bytes)}`` of every tensor in the file."""
    return {t.name: (t.tensor_type.name, int(t.n_bytes), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def _llama_names(model: Path, plan: dict) -> dict[str, str]:
    cfg = json.loads((model / "config.json").read_text())
    return tensor_names("llama", cfg["num_hidden_layers"], list(plan["tensors"]), tied=cfg.get("tie_word_embeddings", True))


def _assert_plan_is_the_gguf(model: Path, plan: dict, written: Path) -> None:
    """Every planned tensor in the GGUF has the plan's type and exactly the plan's bytes."""
    names = _llama_names(model, plan)
    tensors = {t.name: t for t in gguf.GGUFReader(str(written)).tensors}
    for name, t in plan["tensors"].items():
        g = tensors[names[name]]
        assert g.tensor_type.name.lower() == t["type"] and int(g.n_bytes) == t["bytes"], (name, g.tensor_type.name, t)


def _safetensors_bytes(directory: Path) -> dict[str, int]:
    """``{tensor: stored bytes}`` from every shard's header (8-byte little-endian length, then JSON)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = v["data_offsets"][1] - v["data_offsets"][0]
    return out


# --------------------------------------------------------------------------- 1. llama-quantize


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_llama_quantize_writes_the_planned_gguf_from_the_emitted_tensor_types(default_model_dir, tmp_path):
    """The default model planned at 5.0 bits/w for GGUF; qkit's quantize --plan and llama-quantize
    --tensor-type-file (the plan's --emit-tensor-types) on llama.cpp's own F32 conversion write the same type
    and the same bytes in all 210 block projections, whatever llama-quantize's base ftype, and the plan's
    bytes are the file's."""
    blr = benchmark_module("build_llama_ref")
    if not blr.tool_path("llama-quantize").exists():
        pytest.skip("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
    plan, tt, q = tmp_path / "plan.json", tmp_path / "tt.txt", tmp_path / "q.gguf"
    _ok(["plan", "--format", "gguf", "--target-bits", "5.0", "-o", plan, "--emit-tensor-types", tt,
         "--calibration-samples", "2", "--calibration-seqlen", "64", "--check-windows", "1", "--candidates", DEFAULT_CANDIDATES])
    p = _plan(plan)
    types = Counter(t["type"] for t in p["tensors"].values())
    assert len(p["tensors"]) == 210 and len(types) >= 3, types  # a real mix, not one type
    assert p["totals"]["bytes"] <= p["target"]["budget_bytes"]
    words = tt.read_text().split()
    assert len(words) == 210 and all(w.startswith("^blk\\.") for w in words)
    _ok(["quantize", "--plan", plan, "--format", "gguf", "-o", q])
    _assert_plan_is_the_gguf(default_model_dir, p, q)

    b = benchmark_module("bench_llama_cpp")
    f32 = convert_f32(default_model_dir)  # llama.cpp's converter, pinned; cached by the model's files
    files = {}
    for base in ("Q8_0", "Q4_0"):  # every block tensor is named in the file: the base ftype must not matter
        lq = files[base] = tmp_path / f"lq-{base}.gguf"
        r = subprocess.run([blr.tool_path("llama-quantize"), "--tensor-type-file", tt, "--token-embedding-type", "f32",
                            f32, lq, base, "2"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        cmp = b.compare_files(lq, q)
        assert cmp["block_tensors"] == 210 and not cmp["missing_in_qkit"] and not cmp["type_mismatch"], cmp
        assert cmp["blocks_differing"] == 0 and cmp["identical"], cmp["tensors_differing"][:5]
    one, other = (_gguf_tensors(files[k]) for k in ("Q8_0", "Q4_0"))
    assert all(one[n] == other[n] for n in one if n.startswith("blk.")), "the base ftype changed a named tensor"


# --------------------------------------------------------------------------- 2. compressed-tensors


@pytest.mark.slow
def test_a_mixed_compressed_tensors_plan_loads_in_transformers_and_verifies(wide_model, tmp_path):
    """The tiny model planned at 5.0 bits/w over compressed-tensors' whole ladder mixes FP4 (nvfp4, mxfp4) and
    int types; transformers + compressed-tensors load the ``mixed-precision`` checkpoint, ``qkit verify``
    passes it, and every module's stored bytes (all its ``weight*`` entries) are the plan's."""
    plan, out = tmp_path / "plan.json", tmp_path / "ct"
    _ok(["plan", wide_model, "--format", "compressed-tensors", "--target-bits", "5.0", "-o", plan, *FAST])
    p = _plan(plan)
    types = Counter(t["type"] for t in p["tensors"].values())
    assert len(types) >= 2, types
    # the case that matters: FP4 groups beside int groups in one checkpoint
    assert types.keys() & {"nvfp4", "mxfp4"} and any(k.startswith("int") for k in types), types
    _ok(["quantize", wide_model, "--plan", plan, "--format", "compressed-tensors", "-o", out])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and qc["quant_method"] == "compressed-tensors"
    grouped = {t for g in qc["config_groups"].values() for t in g["targets"]}
    assert grouped == {n.removesuffix(".weight") for n in p["tensors"]}

    stored = _safetensors_bytes(out)
    for name, t in p["tensors"].items():
        parts = {k: v for k, v in stored.items() if k.startswith(name)}  # weight_packed, weight_scale, weight_shape, ...
        assert parts and sum(parts.values()) == t["bytes"], (name, t["type"], parts, t["bytes"])

    report = tmp_path / "verify.json"
    _ok(["verify", out, "--device", "cpu", "--json", report])
    v = json.loads(report.read_text())
    assert v["passed"] and v["weights_ok"] and v["logits_ok"] and v["format"] == "compressed-tensors"
    assert {k: s["tensors"] for k, s in v["by_scheme"].items()} == dict(types)
    assert all(s["match_export"] == s["tensors"] == s["within_tolerance"] for s in v["by_scheme"].values()), v["by_scheme"]


# --------------------------------------------------------------------------- 3. quantize --target-bits


@pytest.mark.slow
def test_quantize_target_bits_is_plan_then_quantize_plan(wide_model, tmp_path):
    """``quantize --target-bits 5`` (the planner's default calibration: it takes no plan options) and ``plan
    --target-bits 5`` + ``quantize --plan``, each measured from scratch: the same tensors, types and bytes."""
    plan, a, b = tmp_path / "plan.json", tmp_path / "a.gguf", tmp_path / "b.gguf"
    _ok(["plan", wide_model, "--format", "gguf", "--target-bits", "5", "-o", plan])
    _ok(["quantize", wide_model, "--plan", plan, "--format", "gguf", "-o", a])
    _ok(["quantize", wide_model, "--target-bits", "5", "--format", "gguf", "-o", b])
    p = _plan(plan)
    assert len(Counter(t["type"] for t in p["tensors"].values())) >= 2
    _assert_plan_is_the_gguf(wide_model, p, a)
    ta, tb = _gguf_tensors(a), _gguf_tensors(b)
    assert ta.keys() == tb.keys()
    assert [n for n in ta if ta[n] != tb[n]] == []


# --------------------------------------------------------------------------- 4. --imatrix


@pytest.mark.slow
def test_a_plan_measured_with_an_imatrix_is_quantized_with_it_and_only_it(wide_model, tmp_path):
    im, other, plan, tt = tmp_path / "im.gguf", tmp_path / "other.gguf", tmp_path / "plan.json", tmp_path / "tt.txt"
    _ok(["imatrix", wide_model, "-o", im, "--chunks", "2", "--chunk-size", "32"])
    _ok(["imatrix", wide_model, "-o", other, "--chunks", "3", "--chunk-size", "32"])
    _ok(["plan", wide_model, "--imatrix", im, "--format", "gguf", "--target-bits", "5", "-o", plan, "--emit-tensor-types", tt,
         *FAST])
    p = _plan(plan)
    from qkit.methods.imatrix import read

    assert p["imatrix"]["sha256"] == read(im).sha256 != read(other).sha256
    types = Counter(t["type"] for t in p["tensors"].values())
    assert len(types) >= 2 and types.keys() - {"q8_0", "none"}, types  # some type reads the matrix

    q = tmp_path / "q.gguf"
    _ok(["quantize", wide_model, "--plan", plan, "--imatrix", im, "--format", "gguf", "-o", q])
    _assert_plan_is_the_gguf(wide_model, p, q)
    # the same types given as llama-quantize's overrides, with the same matrix: the same bytes; without it: others
    same, unweighted = tmp_path / "same.gguf", tmp_path / "unweighted.gguf"
    _ok(["quantize", wide_model, "-s", "q8_0", "--tensor-type-file", tt, "--imatrix", im, "--format", "gguf", "-o", same])
    _ok(["quantize", wide_model, "-s", "q8_0", "--tensor-type-file", tt, "--format", "gguf", "-o", unweighted])
    tq, ts, tu = _gguf_tensors(q), _gguf_tensors(same), _gguf_tensors(unweighted)
    assert tq == ts
    assert [n for n in tq if tq[n][0] != tu[n][0]] == []
    assert any(tq[n][2] != tu[n][2] for n in tq), "the importance matrix changed no tensor"

    refused = tmp_path / "refused.gguf"
    _refused(["quantize", wide_model, "--plan", plan, "--format", "gguf", "-o", refused], "pass it with --imatrix")
    assert not refused.exists()
    _refused(["quantize", wide_model, "--plan", plan, "--imatrix", other, "--format", "gguf", "-o", refused],
             "not the matrix the plan was measured with")
    assert not [f.name for f in tmp_path.iterdir() if "refused" in f.name]  # nor a temporary beside it
