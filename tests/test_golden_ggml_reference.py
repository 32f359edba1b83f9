"""The inputs the reference tests give llama.cpp's C quantizer, with its answers recorded as digests.

``test_kquants_weighted``, ``test_kquants_low``, ``test_iquants``, ``test_iquants3``, ``test_iquants2``,
``test_schemes_kquants`` and
``test_ggml_weighted`` compare qkit with the built ``ggml_quantize_chunk`` (``benchmarks/build_llama_ref.py``)
on seeded matrices and importance vectors, and skip where it is not built. ``tests/golden/ggml_reference.json``
holds, for those same seeded inputs (drawn here by the same generators), the sha256 of llama.cpp's bytes,
and the sha256 of the inputs, so a changed numpy stream is told apart from a changed byte; this runs
them without the reference. Both of qkit's paths (the numba kernels and the torch code) must give those
bytes. Where the per-block files (``ggml_imatrix.json``, ``kquants.json``) keep the bytes themselves,
this keeps only digests: it covers more and larger inputs (the near-maximum blocks where C's
``nearest_int`` leaves its exact range take 2,500 rows).

Recorded with the reference built (``python benchmarks/build_llama_ref.py``, about 30 s):

    QKIT_RECORD_GGML_REFERENCE=1 python -m pytest tests/test_golden_ggml_reference.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import helpers_iquants as iq
import helpers_kquants_low as kl
import helpers_kquants_weighted as kw
import numpy as np
import pytest
import torch
from conftest import benchmark_module, near_max_importance

from qkit.schemes import get_scheme, kernels, quantize_tensor

T = gguf.GGMLQuantizationType
GOLDEN_PATH = Path(__file__).parent / "golden" / "ggml_reference.json"
RECORD_COMMAND = "QKIT_RECORD_GGML_REFERENCE=1 python -m pytest tests/test_golden_ggml_reference.py"
SCHEME = {T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0", T.Q5_1: "q5_1", T.Q2_K: "q2_k",
          T.Q3_K: "q3_k", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k", T.IQ4_NL: "iq4_nl", T.IQ4_XS: "iq4_xs",
          T.IQ3_XXS: "iq3_xxs", T.IQ3_S: "iq3_s", T.IQ2_XXS: "iq2_xxs", T.IQ2_XS: "iq2_xs", T.IQ2_S: "iq2_s",
          T.IQ1_S: "iq1_s", T.IQ1_M: "iq1_m"}
TORCHLESS = ("iquants3/", "iquants2/")  # encoded by a numba kernel only: no second path to run


def _random_matrix(kind: int) -> np.ndarray:
    """test_schemes_kquants.test_random_matrices_equal_the_built_llama_cpp's six 48 x 1024 matrices (one generator)."""
    rng = np.random.default_rng(5)
    for k in range(kind + 1):
        x = rng.standard_normal((48, 1024))
        x = [x, x / (rng.random(x.shape) + 0.01), rng.integers(-20, 21, x.shape) / 3, rng.laplace(size=x.shape),
             np.where(rng.random(x.shape) < 0.5, 0, x), x + rng.standard_normal((48, 1))][k]
        x = (x * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
    return x


def _near_max(seed: int = 21) -> tuple[np.ndarray, np.ndarray]:
    """test_ggml_weighted.test_near_max_blocks_equal_llama_cpp's input (``conftest.near_max_importance``)."""
    return near_max_importance(seed)


def cases():
    """``(id, ggml type, input fn)``: the input functions return ``(x, importance or None)``."""
    out = []
    for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K):
        for k in range(6):
            out.append((f"random_matrices/{SCHEME[t]}/{k}", t, lambda k=k: (_random_matrix(k), None)))
    for name in ("q4_1", "q5_1"):
        out.append((f"near_max_blocks/{name}", getattr(T, name.upper()), _near_max))
    for name, t in kw.K_TYPES.items():
        for kind in kw.KINDS:
            for imat in kw.IMATRICES:
                out.append((f"kquants_weighted/{name}/{kind}/{imat}", t,
                            lambda kind=kind, imat=imat: (kw.matrix(kind), kw.importance(imat, 1024))))
    for name, (t, _) in kl.TYPES.items():
        for kind in kl.KINDS:
            for imat in kl.IMATRIX:
                out.append((f"kquants_low/{name}/{kind}/{imat}", t,
                            lambda kind=kind, imat=imat: (kl.matrix(kind), kl.importance(imat, 512))))
    for name, t in iq.TYPES.items():
        for kind in iq.KINDS:
            for imat in iq.IMATRICES:
                out.append((f"iquants/{name}/{kind}/{imat}", t,
                            lambda kind=kind, imat=imat: (iq.matrix(kind, 12, 1024, seed=iq.KINDS.index(kind)),
                                                          iq.imatrix(imat, 1024, seed=3))))
    for name, t in (("iq3_xxs", T.IQ3_XXS), ("iq3_s", T.IQ3_S)):  # test_iquants3's inputs
        for kind in iq.KINDS:
            for imat in iq.IMATRICES:
                out.append((f"iquants3/{name}/{kind}/{imat}", t,
                            lambda kind=kind, imat=imat: (iq.matrix(kind, 12, 1024, seed=iq.KINDS.index(kind)),
                                                          iq.imatrix(imat, 1024, seed=3))))
    for name, t in (("iq2_xxs", T.IQ2_XXS), ("iq2_xs", T.IQ2_XS), ("iq2_s", T.IQ2_S), ("iq1_s", T.IQ1_S),
                    ("iq1_m", T.IQ1_M)):  # test_iquants2's inputs
        for kind in iq.KINDS:
            for imat in iq.IMATRICES if t in (T.IQ2_S, T.IQ1_M) else iq.IMATRICES[1:]:  # the others assert a matrix
                out.append((f"iquants2/{name}/{kind}/{imat}", t,
                            lambda kind=kind, imat=imat: (iq.matrix(kind, 12, 1024, seed=iq.KINDS.index(kind)),
                                                          iq.imatrix(imat, 1024, seed=3))))
    return out


CASES = cases()


def _group(case_id: str) -> str:
    parts = case_id.split("/")
    return "/".join(parts[:2])


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def record() -> dict:
    blr = benchmark_module("build_llama_ref")
    ref = blr.load()
    if ref is None:
        pytest.fail("recording needs llama.cpp's reference: python benchmarks/build_llama_ref.py")
    entries = []
    for case_id, t, make in CASES:
        x, qw = make()
        want = ref.quantize(x, t, qw)
        entries.append({"name": case_id, "type": t.name, "shape": list(x.shape), "input_sha256": _sha(x, qw),
                        "expected_sha256": _sha(want), "bytes": int(want.size)})
    blr.write_golden(GOLDEN_PATH, entries, "sha256 of llama.cpp's ggml_quantize_chunk output for the seeded inputs of "
                     "the reference tests (test_kquants_weighted, test_kquants_low, test_iquants, test_iquants3, test_iquants2, "
                     "test_schemes_kquants, "
                     "test_ggml_weighted)", command=RECORD_COMMAND)
    return json.loads(GOLDEN_PATH.read_text())


GOLDEN = record() if os.environ.get("QKIT_RECORD_GGML_REFERENCE") == "1" else json.loads(GOLDEN_PATH.read_text())
BY_NAME = {c["name"]: c for c in GOLDEN["cases"]}


def test_golden_file_says_where_it_came_from_and_covers_the_cases():
    assert GOLDEN["command"] == RECORD_COMMAND
    assert GOLDEN["llama_cpp_commit"] == benchmark_module("build_llama_ref").LLAMA_CPP_COMMIT
    assert [c["name"] for c in GOLDEN["cases"]] == [c[0] for c in CASES]
    assert {c["type"] for c in GOLDEN["cases"]} == {t.name for t in SCHEME}


@pytest.mark.parametrize(("group", "compiled"), [  # the iq3 / iq2 types have the numba kernel only: no torch case
    pytest.param(g, c, id=f"{g}-{'kernel' if c else 'torch'}") for g in sorted({_group(c[0]) for c in CASES})
    for c in (True, False) if c or not g.startswith(TORCHLESS)])
def test_bytes_equal_llama_cpps_recorded_digest(group, compiled):
    moved, bad = [], []
    old = kernels.set_enabled(compiled)
    try:
        for case_id, t, make in CASES:
            if _group(case_id) != group:
                continue
            want = BY_NAME[case_id]
            x, qw = make()
            if _sha(x, qw) != want["input_sha256"]:
                moved.append(case_id)
                continue
            got = quantize_tensor(torch.from_numpy(x), get_scheme(SCHEME[t]),
                                  quant_weights=None if qw is None else torch.from_numpy(qw)).qweight.numpy()
            if got.size != want["bytes"] or _sha(got) != want["expected_sha256"]:
                bad.append(case_id)
    finally:
        kernels.set_enabled(old)
    assert not moved, f"the seeded inputs are not the recorded ones (numpy's stream changed?): {moved}"
    assert not bad, f"bytes differ from llama.cpp's recorded output: {bad}"
