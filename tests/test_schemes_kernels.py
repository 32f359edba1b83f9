"""The compiled kernels (``qkit.schemes.kernels``, numba) write the same bytes as the torch encoders
(llama.cpp's block formats here; the FP4 oracle tests in ``test_schemes_fp4.py`` run both paths too).

The torch encoders are the oracles here: they are tested bit for bit against the gguf package and
llama.cpp's own recorded bytes (``test_schemes_ggml.py``, ``test_schemes_kquants.py``), and these tests run
those same oracle comparisons with the kernels switched off, so both paths stay checked against the C
code; then they compare the two paths on edge cases (ties, zeros of both signs, subnormal and huge
weights, the first-element rules) and on random matrices, and across thread splits.
"""

from __future__ import annotations

import base64

import gguf
import numpy as np
import pytest
import torch
from helpers_ggml import CASES, GOLDEN, NAME_OF, TYPES, edge_matrix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, kernels, quantize_tensor

ALL = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "mxfp4", "nvfp4")
PROPS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def encode(name: str, x: torch.Tensor, *, compiled: bool) -> torch.Tensor:
    old = kernels.set_enabled(compiled)
    try:
        return quantize_tensor(x, get_scheme(name)).qweight
    finally:
        kernels.set_enabled(old)


def test_the_kernels_are_on_for_cpu_tensors():
    """numba is a dependency: if it failed to import, every test below would compare torch with itself."""
    assert kernels.available(torch.zeros(1))
    old = kernels.set_enabled(False)
    try:
        assert not kernels.available(torch.zeros(1))
    finally:
        kernels.set_enabled(old)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_still_equals_the_gguf_reference(name, case):
    x = torch.from_numpy(CASES[case])
    want = gguf.quants.quantize(CASES[case], TYPES[name])
    assert np.array_equal(encode(name, x, compiled=False).numpy(), want)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_torch_on_the_gguf_cases(name, case):
    x = torch.from_numpy(CASES[case])
    assert torch.equal(encode(name, x, compiled=True), encode(name, x, compiled=False))


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_both_paths_equal_llama_cpp_recorded(case):
    x = np.frombuffer(base64.b64decode(case["input_f32_le"]), dtype="<f4").reshape(case["shape"]).copy()
    for type_name, b64 in case["expected"].items():
        expected = np.frombuffer(base64.b64decode(b64), dtype=np.uint8)
        for compiled in (True, False):
            got = encode(NAME_OF[type_name], torch.from_numpy(x), compiled=compiled).numpy().reshape(-1)
            assert np.array_equal(got, expected), (type_name, compiled)


@pytest.mark.parametrize("name", ALL)
@PROPS
@given(
    seed=st.integers(0, 2**31),
    scale_exp=st.sampled_from([-149, -140, -130, -126, -60, -7, 0, 5, 12]),
    zeros=st.sampled_from([0.0, 0.3, 0.97, 1.0]),
    kind=st.integers(0, 3),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 3),
)
def test_kernel_equals_torch_property(name, seed, scale_exp, zeros, kind, rows, blocks):
    w = edge_matrix(seed, scale_exp, zeros, kind, rows, blocks)
    try:
        want = encode(name, w, compiled=False)
    except SchemeError as exc:  # a scale beyond fp16: the kernel path refuses the same way
        with pytest.raises(type(exc), match="overflows fp16"):
            encode(name, w, compiled=True)
        return
    assert torch.equal(encode(name, w, compiled=True), want)


@pytest.mark.parametrize("name", ALL)
def test_kernel_equals_torch_on_the_default_models_shapes_and_thread_splits(name):
    """Sizes that are not whole tiles of 64 lanes, split over 1 and 2 threads (large enough that every
    kernel splits: 2.1 M weights, above each kernel's minimum work per thread)."""
    w = torch.randn(2753, 768, generator=torch.Generator().manual_seed(11)) * 0.02
    w[3, :300] = 0.0
    want = encode(name, w, compiled=False)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(encode(name, w, compiled=True), want), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_on_the_kernel_path(name, bad):
    w = torch.randn(4, 512)
    w[2, 77] = bad
    with pytest.raises(NonFiniteWeightError):
        encode(name, w, compiled=True)


def test_q4_1_keeps_the_sign_of_the_first_zero_minimum_on_the_kernel_path():
    """``if (v < min) min = v`` from x[0]: a block of +0/-0 and positives stores m = the first zero."""
    x = torch.ones(2, 32)
    x[0, 3], x[0, 9] = -0.0, 0.0
    x[1, 3], x[1, 9] = 0.0, -0.0
    b = encode("q4_1", x, compiled=True)
    assert b[0, 2:4].tolist() == [0x00, 0x80] and b[1, 2:4].tolist() == [0x00, 0x00]
