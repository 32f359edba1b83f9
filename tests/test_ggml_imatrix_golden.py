"""Every type of the GGUF ladder, with and without an importance matrix, against llama.cpp's recorded bytes.

``tests/golden/ggml_imatrix.json`` holds ``ggml_quantize_chunk``'s output (llama.cpp commit, compiler,
flags and the recording command are in the file: ``python benchmarks/build_llama_ref.py --record-golden``)
for fixed inputs: random, weight-like, heavy-tailed, ties, signs, constant, sparse, one outlier, zeros,
tiny values and rows of the default model; each without an importance matrix and with three (random,
heavy-tailed, with zeros). Both of qkit's paths are checked: the compiled kernels and the torch code.
No compiler is needed.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qkit.schemes import get_scheme, kernels, quantize_tensor
from qkit.schemes.ggml import GGMLScheme

GOLDEN = json.loads((Path(__file__).parent / "golden" / "ggml_imatrix.json").read_text())
TYPE_SCHEMES = {
    "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q2_K": "q2_k", "Q3_K": "q3_k",
    "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs",
}


def _decode(b64: str | None, dtype: str = "<f4") -> np.ndarray | None:
    return None if b64 is None else np.frombuffer(base64.b64decode(b64), dtype=dtype).copy()


def test_golden_file_covers_the_ladder():
    assert GOLDEN["types"] == list(TYPE_SCHEMES)
    assert GOLDEN["command"] == "python benchmarks/build_llama_ref.py --record-golden"
    with_imatrix = sum(c["imatrix_f32_le"] is not None for c in GOLDEN["cases"])
    assert with_imatrix >= 3 * (len(GOLDEN["cases"]) - with_imatrix) - 3
    assert all(set(c["expected"]) == set(TYPE_SCHEMES) for c in GOLDEN["cases"])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("type_name", list(TYPE_SCHEMES))
def test_bytes_equal_llama_cpp_with_and_without_imatrix(type_name, kernel):
    scheme = get_scheme(TYPE_SCHEMES[type_name])
    assert isinstance(scheme, GGMLScheme) and scheme.ggml_type.name == type_name
    old = kernels.set_enabled(kernel)
    try:
        bad = []
        for case in GOLDEN["cases"]:
            x = _decode(case["input_f32_le"]).reshape(case["shape"])
            qw = _decode(case["imatrix_f32_le"])
            expected = _decode(case["expected"][type_name], np.uint8)
            qt = quantize_tensor(torch.from_numpy(x), scheme, quant_weights=None if qw is None else torch.from_numpy(qw))
            got = qt.qweight.numpy().reshape(-1)
            assert got.shape == expected.shape, case["name"]
            blocks = (got.reshape(-1, scheme.type_size) != expected.reshape(-1, scheme.type_size)).any(axis=1)
            if blocks.any():
                bad.append(f"{case['name']}: {int(blocks.sum())} of {blocks.size} blocks")
        assert not bad, f"{type_name} differs from llama.cpp: " + "; ".join(bad)
    finally:
        kernels.set_enabled(old)
