"""q2_k and q3_k (``qkit.schemes.kquants_low``): llama.cpp's bytes, with and without an importance matrix.

Oracles: the built llama.cpp reference (``benchmarks/build_llama_ref.py``: ``ggml_quantize_chunk``, which
takes ``quantize_row_q{2,3}_K_ref`` without an importance matrix and ``quantize_row_q{2,3}_K_impl`` with
one); the tests that need it skip with a reason where it is not built. ``gguf.quants.dequantize`` decodes.
Both encoder paths are compared with the C code and with each other: the compiled kernel
(``qkit.schemes._kernels_low``) and the torch code (``kernels.set_enabled(False)``).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module
from helpers_ggml import edge_matrix
from helpers_kquants_low import IMATRIX, KINDS, TYPES, importance, matrix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, kernels, quantize_tensor, scheme_names
from qkit.schemes.ggml import uses_importance
from qkit.schemes.registry import scheme_from_dict

T = gguf.GGMLQuantizationType
PATHS = {"kernel": True, "torch": False}
PROPS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _load_reference():
    return benchmark_module("build_llama_ref").load()


@pytest.fixture(scope="module")
def ref():
    r = _load_reference()
    if r is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    return r


def encode(name: str, x: torch.Tensor, qw: torch.Tensor | None = None, *, compiled: bool) -> np.ndarray:
    old = kernels.set_enabled(compiled)
    try:
        return quantize_tensor(x, get_scheme(name), quant_weights=qw).qweight.numpy()
    finally:
        kernels.set_enabled(old)


# --------------------------------------------------------------------------- bit for bit with llama.cpp


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("imat", IMATRIX)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(TYPES))
def test_bytes_equal_llama_cpp(ref, name, kind, imat, path):
    x, qw = matrix(kind), importance(imat, 512)
    got = encode(name, torch.from_numpy(x), None if qw is None else torch.from_numpy(qw), compiled=PATHS[path])
    want = ref.quantize(x, TYPES[name][0], qw)
    size = TYPES[name][1]
    bad = np.nonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {want.size // size} super-blocks differ, first {bad[:4].tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TYPES))
def test_default_model_rows_equal_llama_cpp(ref, name, default_model_dir):
    """The 1536-wide down_proj of three layers, whole on the kernel path and 48 rows on the torch path,
    without and with importance vectors (random positive; with zeros)."""
    from qkit.checkpoint import iter_tensors

    want = {f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 14, 29)}
    mats = {n: t.float().contiguous() for n, t in iter_tensors(default_model_dir) if n in want}
    assert set(mats) == want
    for w in mats.values():
        for imat in IMATRIX:
            qw = importance(imat, w.shape[1], seed=7)
            qwt = None if qw is None else torch.from_numpy(qw)
            c = ref.quantize(w.numpy(), TYPES[name][0], qw)
            assert np.array_equal(encode(name, w, qwt, compiled=True), c), imat
            assert np.array_equal(encode(name, w[:48], qwt, compiled=False), c[:48]), imat


@pytest.mark.slow
@PROPS
@given(
    seed=st.integers(0, 2**31),
    scale_exp=st.sampled_from([-149, -140, -126, -60, -7, 0, 5, 10]),
    zeros=st.sampled_from([0.0, 0.3, 0.97, 1.0]),
    kind=st.integers(0, 3),
    rows=st.integers(1, 3),
    blocks=st.integers(1, 2),
    imat=st.sampled_from(["none", "random", "zeros", "tiny", "huge"]),
)
def test_both_paths_equal_each_other_and_llama_cpp_on_edge_matrices(seed, scale_exp, zeros, kind, rows, blocks, imat):
    """Subnormal to large weights, zeros of both signs, ties, both extremes; importance vectors with zeros,
    tiny (1e-30) or large (1e6) values. A refusal (a scale beyond fp16) must be the same on both paths."""
    w = edge_matrix(seed, scale_exp, zeros, kind, rows, blocks)
    cols = w.shape[1]
    qw = None if imat == "none" else importance("zeros" if imat == "zeros" else "random", cols, seed)
    if imat in ("tiny", "huge"):
        qw = (qw * (1e-30 if imat == "tiny" else 1e6)).astype(np.float32)
    qwt = None if qw is None else torch.from_numpy(qw)
    r = _load_reference()
    for name, (t, _) in TYPES.items():
        try:
            want = encode(name, w, qwt, compiled=False)
        except SchemeError as exc:
            with pytest.raises(SchemeError, match="overflows fp16"):
                encode(name, w, qwt, compiled=True)
            assert "overflows fp16" in str(exc)
            continue
        assert np.array_equal(encode(name, w, qwt, compiled=True), want), name
        if r is not None:
            assert np.array_equal(want, r.quantize(w.numpy(), t, qw)), name


def test_kernel_equals_torch_across_thread_splits_and_partial_tiles():
    """515 rows of 768: 1545 super-blocks, not a whole number of the kernel's 64-super-block tiles, over 1
    and 2 threads (enough work that every kind splits), with and without an importance vector."""
    w = torch.randn(515, 768, generator=torch.Generator().manual_seed(11)) * 0.02
    w[3, :300] = 0.0
    qw = torch.from_numpy(importance("zeros", 768))
    before = torch.get_num_threads()
    try:
        for name in TYPES:
            for q in (None, qw):
                want = encode(name, w, q, compiled=False)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    assert np.array_equal(encode(name, w, q, compiled=True), want), (name, q is None, threads)
                torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)


def test_the_kernels_fp16_rounding_is_torchs():
    """``GGML_FP32_TO_FP16`` ported into the kernels (round to nearest even, subnormals, overflow to inf) and
    back, on every fp16 value, the midpoints between neighbours (ties), and random fp32 values."""
    from qkit.schemes import _kernels_fp16 as jit

    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(np.float32)
    rnd = np.random.default_rng(0).standard_normal(200000).astype(np.float32) * np.float32(2.0) ** np.random.default_rng(1).integers(-30, 18, 200000)
    f = np.concatenate([h, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)), rnd, [65504, 65519.99, 65520, 1e30]]).astype(np.float32)
    f = np.concatenate([f, -f])
    bits, back = np.empty(f.size, np.int64), np.empty(f.size, np.float32)
    jit.fp16_round_trip(f, bits, back)
    want = torch.from_numpy(f).to(torch.float16)
    assert np.array_equal(bits.astype(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
    finite = torch.isfinite(want).numpy()
    assert np.array_equal(back[finite].view(np.uint32), want.float().numpy()[finite].view(np.uint32))


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3])
def test_decode_equals_gguf_dequantize(name, scale):
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(3)) * scale
    x[2, :300] = 0.0
    for qw in (None, torch.from_numpy(importance("zeros", 512))):
        qt = quantize_tensor(x, get_scheme(name), quant_weights=qw)
        assert qt.scheme.name == name
        ours = qt.dequantize(torch.float32).numpy()
        assert np.array_equal(ours.view(np.uint32), gguf.quants.dequantize(qt.qweight.numpy(), TYPES[name][0]).view(np.uint32))


@pytest.mark.parametrize("name", list(TYPES))
def test_decode_of_arbitrary_blocks_equals_gguf(name):
    """Random block bytes (finite fp16 d / dmin), not only ones qkit wrote: every scale and code pattern."""
    t, size = TYPES[name]
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (16, 2 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    halfs = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if name == "q2_k":
        blocks[:, 80:84] = halfs
    else:
        blocks[:, 108:110] = halfs[:, :2]
    ours = get_scheme(name).decode({"qweight": torch.from_numpy(raw)}, (16, 512), torch.float32).numpy()
    assert np.array_equal(ours.view(np.uint32), gguf.quants.dequantize(raw, t).view(np.uint32))


# --------------------------------------------------------------------------- widths: llama.cpp's q4_0 fallback


@pytest.mark.parametrize("name", list(TYPES))
def test_a_576_wide_matrix_falls_back_to_q4_0(name):
    """tensor_type_fallback: Q2_K and Q3_K become Q4_0 when ncols % 256 != 0 (the default model's 576)."""
    s = get_scheme(name)
    assert s.resolve((576, 576), "w").name == "q4_0"
    assert s.resolve((576, 1536), "w") is s
    w = torch.randn(576, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    qt = quantize_tensor(w, s, name="model.layers.0.self_attn.q_proj.weight")
    assert qt.scheme.name == "q4_0"
    assert np.array_equal(qt.qweight.numpy(), gguf.quants.quantize(w.numpy(), T.Q4_0))
    assert s.nbytes_for((576, 576)) == qt.nbytes == 576 * 18 * 18
    r = _load_reference()
    if r is not None:
        assert np.array_equal(qt.qweight.numpy(), r.quantize(w.numpy(), T.Q4_0))
        qw = importance("random", 576)
        if uses_importance(T.Q4_0):  # the fallback takes the importance vector as llama.cpp's q4_0 does
            got = quantize_tensor(w, s, quant_weights=torch.from_numpy(qw)).qweight.numpy()
            assert np.array_equal(got, r.quantize(w.numpy(), T.Q4_0, qw))


@pytest.mark.parametrize("name", list(TYPES))
def test_width_100_is_refused_in_one_line(name):
    with pytest.raises(SchemeError) as exc:
        quantize_tensor(torch.randn(4, 100), get_scheme(name), name="model.layers.0.mlp.up_proj.weight")
    msg = str(exc.value)
    assert "\n" not in msg and "width 100" in msg and "multiple of 32" in msg


# --------------------------------------------------------------------------- registry, sizes, refusals


@pytest.mark.parametrize(("name", "bits", "bpw"), [("q2_k", 2, 2.625), ("q3_k", 3, 3.4375)])
def test_registered_with_exact_bits_per_weight(name, bits, bpw):
    s = get_scheme(name)
    t, size = TYPES[name]
    assert name in scheme_names()
    assert (s.kind, s.ggml_type, s.bits, s.block_size, s.type_size, s.bits_per_weight) == ("ggml", t, bits, 256, size, bpw)
    assert s.description and "\n" not in s.description and s.fallback.name == "q4_0"
    assert uses_importance(t)
    qt = quantize_tensor(torch.randn(4, 512), s)
    assert qt.bits_per_weight == bpw and tuple(qt.qweight.shape) == (4, 2 * size) and qt.scales.numel() == 0
    assert scheme_from_dict(s.to_dict()) is s


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(name, bad, path):
    w = torch.randn(2, 256)
    w[1, 200] = bad
    for qw in (None, torch.rand(256)):
        old = kernels.set_enabled(PATHS[path])
        try:
            with pytest.raises(NonFiniteWeightError, match="NaN or infinite"):
                quantize_tensor(w, get_scheme(name), name="w", quant_weights=qw)
        finally:
            kernels.set_enabled(old)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(TYPES))
def test_a_super_block_scale_overflowing_fp16_is_refused(name, path):
    w = torch.randn(2, 256)
    w[0, 9] = 1e9
    for qw in (None, torch.rand(256) + 0.5):
        with pytest.raises(SchemeError, match="overflows fp16"):
            encode(name, w, qw, compiled=PATHS[path])


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_bad_importance_vector_is_refused_in_one_line(name, bad):
    qw = torch.rand(512)
    qw[300] = bad
    with pytest.raises(SchemeError) as exc:
        quantize_tensor(torch.randn(4, 512), get_scheme(name), quant_weights=qw)
    assert "\n" not in str(exc.value) and "importance" in str(exc.value)
    with pytest.raises(SchemeError, match="importance vector of 256 values"):
        quantize_tensor(torch.randn(4, 512), get_scheme(name), quant_weights=torch.rand(256))


@pytest.mark.parametrize("name", list(TYPES))
def test_zeros_stay_zeros_and_the_importance_changes_the_bytes(name):
    """An all-zero matrix is all-zero bytes on both paths (with or without importance); on a random matrix
    the importance path writes other bytes than the plain one, and decodes close to the weights."""
    z = torch.zeros(3, 512)
    for compiled in (True, False):
        assert not encode(name, z, compiled=compiled).any()
        assert not encode(name, z, torch.rand(512), compiled=compiled).any()
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    qw = torch.rand(512) + 0.1
    plain = quantize_tensor(w, get_scheme(name))
    weighted = quantize_tensor(w, get_scheme(name), quant_weights=qw)
    assert not torch.equal(plain.qweight, weighted.qweight)
    for qt in (plain, weighted):
        rel = ((qt.dequantize(torch.float32) - w).norm() / w.norm()).item()
        assert rel < (0.45 if name == "q2_k" else 0.25), rel
