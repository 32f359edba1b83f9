"""``--dtype`` for the commands that run the model to calibrate: ``qkit quantize --method gptq|imatrix`` and
``qkit imatrix``. The model runs in the dtype; the weights GPTQ solves are read from the file in its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adversarial import assert_refused, invoke

import qkit.methods.gptq.method as gm
from qkit.api import ImatrixOptions, QuantizeOptions, imatrix_model, quantize_model
from qkit.checkpoint import iter_tensors
from qkit.methods.imatrix.file import read

FAST = {"calibration_samples": 2, "calibration_seqlen": 32}


def _gptq(model, out, dtype, monkeypatch):
    """Quantize ``model`` with GPTQ (int4-g32) in ``dtype``; returns (the W each solve got, the load dtype, the record)."""
    seen, loads = {}, []
    real_solve, real_load = gm.gptq_solve, gm.load

    def solve(W, H, scheme, **kw):
        seen[len(seen)] = W.clone()
        return real_solve(W, H, scheme, **kw)

    def load(*a, **kw):
        loads.append(kw.get("dtype"))
        return real_load(*a, **kw)

    monkeypatch.setattr(gm, "gptq_solve", solve)
    monkeypatch.setattr(gm, "load", load)
    r = quantize_model(str(model), output=out, scheme="int4-g32", method="gptq", method_options={**FAST, "dtype": dtype})
    monkeypatch.undo()
    return list(seen.values()), loads, r.method_record


def test_gptq_in_bf16_runs_the_model_in_bf16_and_solves_the_files_fp32_weights(tiny_model_dir, tmp_path, monkeypatch):
    ws, loads, record = _gptq(tiny_model_dir, tmp_path / "bf16", "bf16", monkeypatch)
    assert loads == [torch.bfloat16] and record["options"]["dtype"] == "bf16"
    source = [w for n, w in iter_tensors(tiny_model_dir) if n.endswith("_proj.weight")]
    # every solve was given a file tensor exactly (fp32, not its bf16 rounding: the test can tell them apart)
    assert len(ws) == len(source) == 14
    for w in ws:
        match = [s for s in source if s.shape == w.shape and torch.equal(s, w)]
        assert match and not torch.equal(w, w.bfloat16().float())
    # and the solve is as good as fp32's: per layer, GPTQ's output error within 10% of the fp32 run's (each
    # measured on its own run's Hessian; bf16/fp32 measured 0.96-1.06 here), and below RTN's
    _, loads32, record32 = _gptq(tiny_model_dir, tmp_path / "fp32", "fp32", monkeypatch)
    assert loads32 == [torch.float32]
    for name, layer in record32["layers"].items():
        got = record["layers"][name]
        assert got["gptq_error"] == pytest.approx(layer["gptq_error"], rel=0.1), name
        assert got["gptq_error"] < got["rtn_error"], name


def test_imatrix_in_bf16_is_the_fp32_matrix_to_bf16_precision(tiny_model_dir, tmp_path):
    files = {}
    for dtype in ("fp32", "bf16"):
        files[dtype] = tmp_path / f"{dtype}.gguf"
        imatrix_model(str(tiny_model_dir), output=files[dtype], options=ImatrixOptions(chunks=2, chunk_size=32, dtype=dtype))
    a, b = read(files["fp32"]), read(files["bf16"])
    assert b.record["dtype"] == "bf16" and a.record["dtype"] == "fp32"
    assert a.entries.keys() == b.entries.keys() and len(a.entries) == 14
    for name in a.entries:
        x, y = a.entries[name].sums, b.entries[name].sums
        assert np.array_equal(a.entries[name].counts, b.entries[name].counts)
        assert not np.array_equal(x, y)  # the model did run in bf16
        np.testing.assert_allclose(y, x, rtol=0.05, atol=1e-3 * float(x.max()))


@pytest.mark.parametrize("args, needles", [
    (["quantize", "-s", "int4-g32", "--dtype", "bf16"], ["rtn streams the weights", "drop --dtype"]),
    (["quantize", "-s", "int4-g32", "--method", "awq", "--dtype", "bf16"], ["awq runs the model in fp32 only"]),
    (["quantize", "-s", "int4-g32", "--method", "smoothquant", "--dtype", "bf16"], ["smoothquant runs the model in fp32"]),
    (["quantize", "-s", "int4-g32", "--method", "gptq", "--dtype", "int8"], ["--dtype 'int8'", "fp32, bf16, fp16"]),
    (["imatrix", "--dtype", "fp8"], ["--dtype 'fp8'", "fp32, bf16, fp16"]),
])
def test_a_dtype_the_step_cannot_run_is_refused_in_one_line_before_work(tiny_model_dir, tmp_path, args, needles):
    out = tmp_path / ("m.gguf" if args[0] == "imatrix" else "q")
    assert_refused(invoke(args[0], str(tiny_model_dir), *args[1:], "-o", str(out)), *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_quantize_dtype_reaches_the_method_and_the_manifest(tiny_model_dir, tmp_path):
    out = tmp_path / "m.gguf"
    r = invoke("quantize", str(tiny_model_dir), "-s", "q8_0", "--format", "gguf", "--method", "imatrix", "--dtype", "BF16",
               "--calibration-samples", "2", "--calibration-seqlen", "32", "-o", str(out))
    assert r.code == 0, r.text
    assert "(2 x 32 tokens, sha256" in r.text  # imatrix's chunks shown as gptq's windows are (was "None x None")
    import json

    import gguf

    record = json.loads(gguf.GGUFReader(str(out)).fields["qkit.export"].contents())
    assert record["method"]["name"] == "imatrix" and record["method"]["dtype"] == "bf16", record.get("method")
    done = quantize_model(str(tiny_model_dir), output=tmp_path / "n.gguf", scheme="q8_0", format="gguf", method="imatrix",
                          method_options={**FAST, "dtype": "fp32"}, options=QuantizeOptions())
    assert done.method_record["dtype"] == "fp32"


def test_quantize_target_bits_plans_in_the_dtype_with_few_windows(tmp_path):
    """--target-bits --dtype bf16 plans in bf16; --calibration-samples 2 (fewer than the default 4 check
    windows) checks on those 2."""
    from conftest import make_tiny_llama, make_tokenizer

    make_tiny_llama(tmp_path / "wide", hidden=256, intermediate=512, layers=2)
    make_tokenizer(tmp_path / "wide")
    out, js = tmp_path / "m.gguf", tmp_path / "r.json"
    r = invoke("quantize", str(tmp_path / "wide"), "--format", "gguf", "--target-bits", "4.6", "--dtype", "bf16",
               "--calibration-samples", "2", "--calibration-seqlen", "32", "-o", str(out), "--json", str(js))
    assert r.code == 0, r.text
    import json

    plan = json.loads(js.read_text())["plan"]
    assert plan["dtype"] == "bf16" and plan["bytes"] <= plan["target"]["budget_bytes"] and plan["measured_kl"] > 0
