"""Integration on the real default model (SmolLM2-135M-Instruct): every scheme written, reloaded in a
fresh process and checked against the in-memory transform; and the quality gradient of ``qkit eval``."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from qkit.api import quantize_model
from qkit.catalog import DEFAULT_SUITE
from qkit.schemes import DEFAULT_SCHEMES

pytestmark = pytest.mark.slow

RELOAD = r"""
import hashlib, json, sys
from qkit.checkpoint import iter_quantized
from qkit.schemes import QuantizedTensor
out = {}
for name, value in iter_quantized(sys.argv[1]):
    if isinstance(value, QuantizedTensor):
        out[name] = [value.scheme.name, hashlib.sha256(value.dequantize().numpy().tobytes()).hexdigest()]
print(json.dumps(out))
"""


# Hand computation per layer of the default model: q, o [576, 576]; k, v [192, 576]; gate, up [1536, 576];
# down [576, 1536]: 3,538,944 weights. Per-row scales: 576+576+192+192+1536+1536+576 = 5,184. Groups of
# 128: 4,608 rows of width 576 hold 5 groups (4 full + one of 64) and 576 rows of width 1536 hold 12:
# 29,952 scales. Every scale is 16 bits.
_W = 3_538_944
EXPECTED_BITS = {
    "int8-tensor": 8 + 16 * 7 / _W,
    "int8-row": 8 + 16 * 5_184 / _W,  # 8.0234375
    "int4-tensor": 4 + 16 * 7 / _W,
    "int4-row": 4 + 16 * 5_184 / _W,
    "int4-g128": 4 + 16 * 29_952 / _W,  # 4.1354
    "nf4": 4 + 16 / 64,  # every matrix size is a multiple of 64
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("scheme", DEFAULT_SCHEMES)
def test_every_scheme_reloads_bit_exact_in_a_fresh_process(default_model_dir, tmp_path, scheme):
    out = tmp_path / scheme
    result = quantize_model(default_model_dir, output=out, scheme=scheme, collect=True)
    assert result.matrices == 210
    assert result.bits_per_weight == pytest.approx(EXPECTED_BITS[scheme], rel=1e-12)
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(out)], capture_output=True, text=True, check=True)
    reloaded = json.loads(proc.stdout)
    assert len(reloaded) == 210
    for name, qt in result.quantized.items():
        assert reloaded[name] == [scheme, digest(qt.dequantize())], name


def test_int4_g128_file_size_tracks_the_bits(default_model_dir, tmp_path):
    fp = quantize_model(default_model_dir, output=tmp_path / "a", scheme="int8-row")
    g = quantize_model(default_model_dir, output=tmp_path / "b", scheme="int4-g128")
    # The unquantized tensors (embeddings, norms) are the same in both; the difference is the matrices:
    # 106,168,320 weights at (8 + 16/in) vs (4 + 16*groups/in) bits.
    saved = (fp.bytes_after - g.bytes_after) * 8 / g.parameters
    assert saved == pytest.approx(fp.bits_per_weight - g.bits_per_weight, abs=0.01)
    assert g.bits_per_weight == pytest.approx(EXPECTED_BITS["int4-g128"], rel=1e-12)


@pytest.fixture(scope="module")
def gradient_report():
    from qkit.evaluation import EvalOptions, evaluate

    opts = EvalOptions(schemes=("int8-row", "int4-tensor", "int4-row", "nf4"), tokens=1024, battery_tokens=12, agree_tokens=3)
    return {r.scheme: r for r in evaluate(None, options=opts).rows}


def test_quality_gradient_on_the_default_model(gradient_report):
    rows = gradient_report
    ref = rows["reference"].perplexity
    assert abs(rows["int8-row"].perplexity / ref - 1) < 0.02
    assert rows["int4-tensor"].perplexity > 10 * ref
    assert rows["nf4"].perplexity < rows["int4-row"].perplexity
    assert rows["int8-row"].kld < rows["nf4"].kld < rows["int4-row"].kld < rows["int4-tensor"].kld
    assert rows["reference"].agreement == rows["reference"].agreement_total == 48
    # the default eval scores the held-out suite, each domain on its own (docs/eval.md, held-out domains)
    assert [d["name"] for d in rows["nf4"].domains] == list(DEFAULT_SUITE.domains)
    assert all(d["scored_tokens"] == 255 for d in rows["nf4"].domains)  # 1024 tokens: 256 per domain
    assert all(a["kld"] < b["kld"] < c["kld"] for a, b, c in zip(*(rows[s].domains for s in ("int8-row", "nf4", "int4-row"))))
