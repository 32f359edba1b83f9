"""q5_k (both paths) and the importance-matrix paths of q4_k, q5_k and q6_k.

Oracles: llama.cpp's C (``ggml_quantize_chunk``; with an importance matrix it runs
``quantize_row_q{4,5,6}_K_impl`` row by row) where the reference library is built in the qkit cache
(``python benchmarks/build_llama_ref.py``; the tests that need it skip otherwise), ``gguf.quants.dequantize``
for the decoder, and the torch code for the compiled kernels (and the other way round).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module
from helpers_ggml import edge_matrix
from helpers_kquants_weighted import IMATRICES, K_TYPES, KINDS, importance, matrix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, kernels, quantize_tensor
from qkit.schemes.ggml import uses_importance

T = gguf.GGMLQuantizationType
SIZES = {n: gguf.GGML_QUANT_SIZES[t][1] for n, t in K_TYPES.items()}
PROPS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _load_reference():
    return benchmark_module("build_llama_ref").load()


REF = _load_reference()
needs_ref = pytest.mark.skipif(REF is None, reason="llama.cpp reference not built: python benchmarks/build_llama_ref.py")


def encode(name: str, x: np.ndarray | torch.Tensor, qw: np.ndarray | None, *, compiled: bool) -> np.ndarray:
    old = kernels.set_enabled(compiled)
    try:
        w = torch.as_tensor(x)
        q = None if qw is None else torch.as_tensor(qw)
        return quantize_tensor(w, get_scheme(name), quant_weights=q).qweight.numpy()
    finally:
        kernels.set_enabled(old)


def assert_blocks_equal(got: np.ndarray, want: np.ndarray, size: int, what: object) -> None:
    assert got.shape == want.shape, what
    bad = np.nonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, f"{what}: {bad.size} of {got.size // size} blocks differ, first {bad[:4].tolist()}"


# --------------------------------------------------------------------------- inputs


def default_model_rows(width: int) -> np.ndarray:
    from qkit.checkpoint import iter_tensors
    from qkit.models import resolve

    want = "model.layers.7.mlp.down_proj.weight" if width == 1536 else "model.layers.7.self_attn.q_proj.weight"
    for n, t in iter_tensors(resolve(None).directory):
        if n == want:
            return t.float().numpy()[:48].copy()
    raise AssertionError(want)


# --------------------------------------------------------------------------- against llama.cpp


@needs_ref
@pytest.mark.parametrize("name", list(K_TYPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("imatrix", IMATRICES)
def test_both_paths_equal_llama_cpp(name, kind, imatrix):
    x = matrix(kind)
    qw = importance(imatrix, x.shape[1])
    want = REF.quantize(x, K_TYPES[name], imatrix=qw)
    for compiled in (True, False):
        assert_blocks_equal(encode(name, x, qw, compiled=compiled), want, SIZES[name], (name, kind, imatrix, compiled))


@needs_ref
@pytest.mark.parametrize("name", list(K_TYPES))
@pytest.mark.parametrize("scale", [1e-30, 1e-7, 1e3, 2e4])
def test_extreme_scales_equal_llama_cpp(name, scale):
    """Tiny weights (fp16 d and dmin subnormal or 0, x*x below fp32's range) and large ones (d near
    fp16's top), with an importance matrix and without."""
    x = (matrix("random", rows=4) * np.float32(scale / 0.05)).astype(np.float32)
    for imatrix in (None, "random", "zeros"):
        qw = importance(imatrix, x.shape[1])
        try:
            want = REF.quantize(x, K_TYPES[name], imatrix=qw)
            got = encode(name, x, qw, compiled=True)
        except SchemeError:  # fp16 overflow: qkit refuses (llama.cpp writes inf); the torch path too
            with pytest.raises(SchemeError, match="overflows fp16"):
                encode(name, x, qw, compiled=False)
            continue
        assert_blocks_equal(got, want, SIZES[name], (name, scale, imatrix))
        assert_blocks_equal(encode(name, x, qw, compiled=False), want, SIZES[name], (name, scale, imatrix, "torch"))


@needs_ref
@pytest.mark.slow
@pytest.mark.parametrize("name", list(K_TYPES))
def test_default_model_rows_equal_llama_cpp(name):
    x = default_model_rows(1536)
    for imatrix in IMATRICES:
        qw = importance(imatrix, x.shape[1], seed=7)
        want = REF.quantize(x, K_TYPES[name], imatrix=qw)
        for compiled in (True, False):
            assert_blocks_equal(encode(name, x, qw, compiled=compiled), want, SIZES[name], (name, imatrix, compiled))


@needs_ref
@pytest.mark.slow
@pytest.mark.parametrize("imatrix", [None, "random"])
def test_q5_k_falls_back_to_q5_1_on_a_576_wide_matrix(imatrix):
    """llama.cpp's tensor_type_fallback: Q5_K -> Q5_1 where the width is not a multiple of 256."""
    x = default_model_rows(576)
    scheme = get_scheme("q5_k")
    assert scheme.resolve(x.shape, "t").name == "q5_1"
    assert scheme.resolve((8, 1536), "t") is scheme
    qw = importance(imatrix, 576)
    assert uses_importance(T.Q5_1)
    qt = quantize_tensor(torch.from_numpy(x), scheme, quant_weights=None if qw is None else torch.from_numpy(qw))
    assert qt.scheme.name == "q5_1"
    assert np.array_equal(qt.qweight.numpy(), REF.quantize(x, T.Q5_1, imatrix=qw))
    assert scheme.nbytes_for(x.shape) == qt.qweight.numel()
    with pytest.raises(SchemeError, match="multiple of 32"):
        scheme.resolve((4, 600), "odd")


# --------------------------------------------------------------------------- kernel == torch


@pytest.mark.parametrize("name", list(K_TYPES))
@PROPS
@given(
    seed=st.integers(0, 2**31),
    scale_exp=st.sampled_from([-149, -140, -126, -60, -7, 0, 5, 12]),
    zeros=st.sampled_from([0.0, 0.3, 0.97, 1.0]),
    kind=st.integers(0, 3),
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    qw_kind=st.sampled_from([None, "random", "zeros", "heavy"]),
)
def test_kernel_equals_torch_and_llama_cpp_property(name, seed, scale_exp, zeros, kind, rows, blocks, qw_kind):
    w = edge_matrix(seed, scale_exp, zeros, kind, rows, blocks)
    qw = importance(qw_kind, w.shape[1], seed=seed % 1000)
    if qw is not None and qw_kind == "zeros":
        qw[: min(256, w.shape[1])] = 0.0
    try:
        want = encode(name, w, qw, compiled=False)
    except SchemeError as exc:  # a scale beyond fp16: the kernel path refuses the same way
        with pytest.raises(type(exc), match="overflows fp16"):
            encode(name, w, qw, compiled=True)
        return
    assert np.array_equal(encode(name, w, qw, compiled=True), want)
    if REF is not None:
        assert np.array_equal(REF.quantize(w.numpy(), K_TYPES[name], imatrix=qw), want)


@pytest.mark.parametrize("name", list(K_TYPES))
def test_kernel_equals_torch_over_thread_splits(name):
    """Sizes that are not whole tiles, split over 1 and 2 threads; chunk boundaries inside a row."""
    w = torch.randn(517, 768, generator=torch.Generator().manual_seed(11)) * 0.02
    w[3, :300] = 0.0
    qw = importance("zeros", 768)
    want = encode(name, w, qw, compiled=False)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert np.array_equal(encode(name, w, qw, compiled=True), want), threads
    finally:
        torch.set_num_threads(before)


def test_chunks_start_mid_row(monkeypatch):
    """The importance row of a super-block follows its place in the matrix row, across chunk boundaries."""
    from qkit.schemes import kquants

    w = torch.randn(3, 768, generator=torch.Generator().manual_seed(2)) * 0.1
    qw = importance("heavy", 768)
    whole = {(n, c): encode(n, w, qw, compiled=c) for n in K_TYPES for c in (True, False)}
    monkeypatch.setattr(kquants, "CHUNK", 4)
    monkeypatch.setattr(kquants, "KERNEL_CHUNK", 4)
    for (n, c), want in whole.items():
        assert np.array_equal(encode(n, w, qw, compiled=c), want), (n, c)


def test_the_importance_changes_the_bytes():
    """The weighted path is taken (not silently the plain one)."""
    x = matrix("random")
    for name, t in K_TYPES.items():
        assert not np.array_equal(encode(name, x, None, compiled=True), encode(name, x, importance("heavy", 1024), compiled=True))
        assert uses_importance(t)


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("scale", [1.0, 0.02, 1e-3, 1e3])
def test_q5_k_decode_equals_gguf_dequantize(scale):
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(3)) * scale
    x[2, :300] = 0.0
    for qw in (None, importance("random", 512)):
        qt = quantize_tensor(x, get_scheme("q5_k"), quant_weights=None if qw is None else torch.from_numpy(qw))
        ours = qt.dequantize(torch.float32).numpy()
        want = gguf.quants.dequantize(qt.qweight.numpy(), T.Q5_K)
        assert ours.view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_q5_k_decode_of_arbitrary_blocks_equals_gguf():
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (16, 2 * 176), dtype=np.uint8)
    blocks = raw.reshape(-1, 176)
    blocks[:, 0:4] = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    ours = get_scheme("q5_k").decode({"qweight": torch.from_numpy(raw)}, (16, 512), torch.float32).numpy()
    assert np.array_equal(ours.view(np.uint32), gguf.quants.dequantize(raw, T.Q5_K).view(np.uint32))


def test_q5_k_scheme():
    s = get_scheme("q5_k")
    assert (s.block_size, s.type_size, s.bits, s.bits_per_weight) == (256, 176, 5, 5.5)
    assert s.fallback.name == "q5_1"
    assert s.description
    assert s.nbytes_for((3, 512)) == 3 * 2 * 176


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", list(K_TYPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_importance_is_refused(name, bad):
    qw = importance("random", 512)
    qw[100] = bad
    for compiled in (True, False):
        with pytest.raises(SchemeError, match="importance"):
            encode(name, matrix("random", cols=512), qw, compiled=compiled)


@pytest.mark.parametrize("name", list(K_TYPES))
def test_non_finite_weights_are_refused_with_an_importance(name):
    x = matrix("random", cols=512)
    x[1, 7] = np.nan
    for compiled in (True, False):
        with pytest.raises(NonFiniteWeightError):
            encode(name, x, importance("random", 512), compiled=compiled)


@pytest.mark.parametrize("name", list(K_TYPES))
def test_fp16_overflow_is_refused_on_both_paths(name):
    x = matrix("random", cols=512) * np.float32(1e11)
    for compiled in (True, False):
        with pytest.raises(SchemeError, match="overflows fp16"):
            encode(name, x, importance("random", 512), compiled=compiled)


def test_importance_of_the_wrong_length_is_refused():
    with pytest.raises(SchemeError, match="importance vector of 256"):
        encode("q5_k", matrix("random", cols=512), importance("random", 256), compiled=True)


def test_fp16_rounding_in_the_kernel_equals_numpy():
    """The kernels round d / dmin to fp16 themselves (round to nearest even): every fp16 value, the
    midpoints between neighbours and their neighbours, subnormals, the overflow edge (checked once over
    all 2**32 fp32 patterns when written)."""
    from qkit.schemes import _kernels_fp16 as kf

    h = np.arange(0, 0x7C01, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = (h[:-1].astype(np.float64) + h[1:]) / 2
    cand = np.concatenate([h, mids.astype(np.float32), np.array([65519.996, 65520.0, 1e30, 5.9e-8, 2.9e-8, 3e-8], np.float32)])
    bits = cand.view(np.uint32).astype(np.int64)
    bits = np.concatenate([bits - 1, bits, bits + 1])
    cand = bits[(bits >= 0) & (bits <= 0x7F800000)].astype(np.uint32).view(np.float32)
    cand = np.concatenate([cand, -cand])
    out = np.empty(cand.shape, np.int32)
    kf.fp16_round_trip(cand, out, np.empty(cand.shape, np.float32))
    with np.errstate(over="ignore"):  # numpy warns where the value rounds to inf
        want = cand.astype(np.float16)
    assert np.array_equal(out, want.view(np.uint16).astype(np.int32))
