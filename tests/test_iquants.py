"""llama.cpp's iq4_nl and iq4_xs, with and without an importance matrix.

Oracles: the built llama.cpp reference library (``ggml_quantize_chunk``; the tests that need it skip
when ``python benchmarks/build_llama_ref.py`` has not built it), ``gguf.quants.dequantize`` for the
decoders, a line-by-line transcription of the C ``best_index_int8``, and the torch encoder as the
compiled kernel's oracle (and the other way round: every reference test runs both paths).
"""

from __future__ import annotations

import contextlib
import math

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module
from helpers_iquants import IMATRICES, KINDS, TYPES, imatrix, matrix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import (  # iquants: registers iq4_nl, iq4_xs
    get_scheme,
    iquants,
    kernels,
    quantize_tensor,
)
from qkit.schemes.base import ImportanceWeighted

T = gguf.GGMLQuantizationType
PROPS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def path(compiled: bool):
    old = kernels.set_enabled(compiled)
    try:
        yield
    finally:
        kernels.set_enabled(old)


_REF: list = []


def maybe_reference():
    """The built llama.cpp reference, or ``None``."""
    if not _REF:
        _REF.append(benchmark_module("build_llama_ref").load())
    return _REF[0]


def reference():
    ref = maybe_reference()
    if ref is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    return ref


def encode(name: str, x: np.ndarray, qw: np.ndarray | None, compiled: bool) -> np.ndarray:
    with path(compiled):
        qwt = None if qw is None else torch.from_numpy(qw)
        qt = quantize_tensor(torch.from_numpy(x), get_scheme(name), quant_weights=qwt)
    return qt.qweight.numpy()


def assert_same_blocks(got: np.ndarray, want: np.ndarray, size: int) -> None:
    assert got.shape == want.shape
    bad = np.nonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} of {got.size // size} blocks differ, first {bad[:4].tolist()}"


def c_best_index(x: np.float32) -> int:
    """``best_index_int8(16, kvalues_iq4nl, x)``, transcribed line by line (numpy fp32 scalars)."""
    val = np.array(iquants.KVALUES_IQ4NL, dtype=np.float32)
    if x <= val[0]:
        return 0
    if x >= val[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < val[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if np.float32(x - val[mu - 1]) < np.float32(val[mu] - x) else mu


# --------------------------------------------------------------------------- against the built llama.cpp


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("qw_kind", IMATRICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(TYPES))
def test_bytes_equal_the_built_llama_cpp(name, kind, qw_kind, compiled):
    ref = reference()
    x = matrix(kind, 12, 1024, seed=KINDS.index(kind))
    qw = imatrix(qw_kind, 1024, seed=3)
    want = ref.quantize(x, TYPES[name], qw)
    assert_same_blocks(encode(name, x, qw, compiled), want, gguf.GGML_QUANT_SIZES[TYPES[name]][1])


@pytest.mark.slow
def test_default_model_matrices_equal_the_built_llama_cpp(default_model_dir):
    """q_proj (576 wide: iq4_xs falls back to iq4_nl), up_proj, down_proj (1536 wide) of three layers, both
    types, without and with importance vectors (the kernel on whole matrices, torch on 48 rows)."""
    ref = reference()
    from qkit.checkpoint import iter_tensors

    want = {f"model.layers.{i}.{p}.weight" for i in (0, 29) for p in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")}
    mats = {n: t.float().numpy() for n, t in iter_tensors(default_model_dir) if n in want}
    assert set(mats) == want
    for n, x in sorted(mats.items()):
        cols = x.shape[1]
        for qw_kind in IMATRICES:
            qw = imatrix(qw_kind, cols, seed=len(n))
            if qw is not None:  # an importance like a real one: mean x**2 of the inputs, per column
                qw = qw * np.float32(0.01)
            for name, own in TYPES.items():
                t = own if cols % 256 == 0 or name == "iq4_nl" else T.IQ4_NL
                size = gguf.GGML_QUANT_SIZES[t][1]
                assert_same_blocks(encode(name, x, qw, True), ref.quantize(x, t, qw), size)
                assert_same_blocks(encode(name, x[:48], qw, False), ref.quantize(x[:48], t, qw), size)


def test_iq4_xs_falls_back_to_iq4_nl_on_a_576_wide_matrix():
    x = matrix("normal", 24, 576, seed=9) * np.float32(0.02)
    qw = imatrix("zeros", 576, seed=9)
    xs, nl = get_scheme("iq4_xs"), get_scheme("iq4_nl")
    assert xs.resolve((24, 576)) is nl and xs.resolve((24, 1536)) is xs
    for q in (None, qw):
        qt = quantize_tensor(torch.from_numpy(x), xs, quant_weights=None if q is None else torch.from_numpy(q))
        assert qt.scheme.name == "iq4_nl"
        assert qt.qweight.shape == (24, 576 // 32 * 18)
        assert np.array_equal(qt.qweight.numpy(), encode("iq4_nl", x, q, True))
        if maybe_reference() is not None:
            assert np.array_equal(qt.qweight.numpy(), maybe_reference().quantize(x, T.IQ4_NL, q))
    with pytest.raises(SchemeError, match="resolves it to iq4_nl"):
        xs.encode(torch.from_numpy(x))
    assert xs.nbytes_for((24, 576)) == 24 * 18 * 18 and xs.nbytes_for((4, 512)) == 4 * 2 * 136


# --------------------------------------------------------------------------- kernel and torch


@pytest.mark.parametrize("name", list(TYPES))
def test_kernel_equals_torch_on_edge_rows_and_thread_splits(name):
    rng = np.random.default_rng(11)
    x = np.concatenate([matrix(k, 4, 512, seed=i) for i, k in enumerate(KINDS)])
    x = np.concatenate([x, (rng.standard_normal((4, 512)) * 1e5).astype(np.float32), (x[:8] * np.float32(2.0**-120))])
    x = np.concatenate([x, x, x, x])  # 208 rows: 3328 blocks of 32, 416 of 256, enough for two threads' ranges
    qw = imatrix("zeros", 512, seed=1)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for q in (None, qw):
                assert np.array_equal(encode(name, x, q, True), encode(name, x, q, False)), (threads, q is None)
    finally:
        torch.set_num_threads(old)


def test_the_kernel_is_used_for_cpu_tensors(monkeypatch):
    calls = []
    jit = iquants._jit()
    real = jit._run_iq4
    monkeypatch.setattr(jit, "_run_iq4", lambda *a: calls.append(1) or real(*a))
    encode("iq4_xs", matrix("normal", 2, 256, 0), None, True)
    assert calls
    calls.clear()
    encode("iq4_xs", matrix("normal", 2, 256, 0), None, False)
    assert not calls


def midpoint_neighbours() -> np.ndarray:
    """Every midpoint and grid value with its 40 fp32 neighbours on each side, the range ends, zeros,
    subnormals, infinities, NaN."""
    v = np.array(iquants.KVALUES_IQ4NL, dtype=np.float64)
    centres = np.concatenate([(v[:-1] + v[1:]) / 2, v, [0.0, 128.0, -128.0, 300.0]]).astype(np.float32)
    out = [centres]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        c = centres.copy()
        for _ in range(40):
            c = np.nextafter(c, direction)
            out.append(c)
    out.append(np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45, -1e-45, 3e38, -3e38], dtype=np.float32))
    return np.concatenate(out)


def test_best_index_is_the_c_rule_near_every_midpoint_and_at_random():
    rng = np.random.default_rng(2)
    x = np.concatenate([midpoint_neighbours(), (rng.standard_normal(20000) * 60).astype(np.float32),
                        (rng.integers(-260, 261, 4000) / 2).astype(np.float32)])
    want = np.array([c_best_index(v) for v in x])
    assert np.array_equal(iquants.best_index_int8(torch.from_numpy(x)).numpy(), want)
    got = np.empty(x.size, np.int64)
    iquants._jit().best_index_many(x, got)
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", list(TYPES))
def test_decode_equals_gguf_dequantize(name):
    x = matrix("mixed_scales", 8, 512, seed=4)
    qt = quantize_tensor(torch.from_numpy(x), get_scheme(name))
    got = qt.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), gguf.quants.dequantize(qt.qweight.numpy(), TYPES[name]).view(np.uint32))


@pytest.mark.parametrize("name", list(TYPES))
def test_decode_of_arbitrary_blocks_equals_gguf(name):
    t = TYPES[name]
    size = gguf.GGML_QUANT_SIZES[t][1]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (16, 2 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    blocks[:, 0:2] = (rng.standard_normal((blocks.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    cols = 2 * gguf.GGML_QUANT_SIZES[t][0]
    got = get_scheme(name).decode({"qweight": torch.from_numpy(raw)}, (16, cols), torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), gguf.quants.dequantize(raw, t).view(np.uint32))


# --------------------------------------------------------------------------- schemes and refusals


@pytest.mark.parametrize(("name", "bpw", "size", "block"), [("iq4_nl", 4.5, 18, 32), ("iq4_xs", 4.25, 136, 256)])
def test_registered_with_exact_bits_per_weight(name, bpw, size, block):
    s = get_scheme(name)
    assert s.bits == 4 and s.bits_per_weight == bpw and s.type_size == size and s.block_size == block
    assert s.description.startswith(f"llama.cpp {name.upper()}:")
    assert isinstance(s, ImportanceWeighted)
    assert s.nbytes_for((3, 1024)) == 3 * 1024 // block * size


@pytest.mark.parametrize("name", list(TYPES))
def test_a_width_that_is_not_a_multiple_of_32_is_refused(name):
    with pytest.raises(SchemeError, match="not a multiple of 32"):
        quantize_tensor(torch.zeros(2, 100), get_scheme(name))


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(name, bad, compiled):
    x = torch.randn(2, 256)
    x[1, 7] = bad
    with path(compiled), pytest.raises(NonFiniteWeightError, match="NaN or infinite"):
        quantize_tensor(x, get_scheme(name))


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize(("name", "big"), [("iq4_nl", 1e7), ("iq4_xs", 1e9), ("iq4_xs", 1e18)])
def test_a_scale_beyond_fp16_is_refused(name, big, compiled):
    """1e18 in one sub-block: its fp32 scale is NaN (sums overflow); llama.cpp would drop it silently."""
    x = torch.randn(2, 256)
    x[0, 40] = big
    with path(compiled), pytest.raises(SchemeError, match="overflows fp16"):
        quantize_tensor(x, get_scheme(name))
    with path(compiled), pytest.raises(SchemeError, match="overflows fp16"):
        quantize_tensor(x, get_scheme(name), quant_weights=torch.ones(256))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_bad_importance_vector_is_refused_in_one_line(name, bad):
    qw = torch.ones(256)
    qw[3] = bad
    with pytest.raises(SchemeError, match="importance matrix") as exc:
        quantize_tensor(torch.randn(2, 256), get_scheme(name), quant_weights=qw)
    assert "\n" not in str(exc.value)
    with pytest.raises(SchemeError, match="importance vector of 255"):
        quantize_tensor(torch.randn(2, 256), get_scheme(name), quant_weights=torch.ones(255))


# --------------------------------------------------------------------------- properties


def outcome(name: str, x: np.ndarray, qw: np.ndarray | None, compiled: bool) -> np.ndarray | str:
    """The bytes, or the kind of refusal."""
    try:
        return encode(name, x, qw, compiled)
    except (NonFiniteWeightError, SchemeError) as e:
        return type(e).__name__


@pytest.mark.parametrize("name", list(TYPES))
@PROPS
@given(
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(KINDS),
    scale_exp=st.integers(-38, 6),
    qw_kind=st.sampled_from(IMATRICES),
    rows=st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_kernel_torch_and_llama_cpp_agree_on_edge_matrices(name, seed, kind, scale_exp, qw_kind, rows, dtype):
    """Both paths give the same bytes, or the same refusal, for any scale, row count and input dtype, and
    llama.cpp's bytes where it is built; the output is deterministic and decodes to finite values, all
    zero for an all-zero row (the grid has no 0: a zero weight elsewhere decodes to ``d``)."""
    x = matrix(kind, rows, 512, seed) * np.float32(10.0**scale_exp)
    x = torch.from_numpy(x).to(dtype).float().numpy()
    qw = imatrix(qw_kind, 512, seed)
    got = outcome(name, x, qw, True)
    assert np.array_equal(got, outcome(name, x, qw, False))
    if isinstance(got, str):
        assert got == "NonFiniteWeightError" if not np.isfinite(x).all() else got == "SchemeError"
        return
    assert got.shape == (rows, 512 // get_scheme(name).block_size * get_scheme(name).type_size)
    assert np.array_equal(got, encode(name, x, qw, True))
    ref = maybe_reference()
    if ref is not None and rows:
        assert np.array_equal(got, ref.quantize(x, TYPES[name], qw))
    y = get_scheme(name).decode({"qweight": torch.from_numpy(got)}, x.shape, torch.float32).numpy()
    assert np.isfinite(y).all()
    zero_rows = (x == 0).all(axis=1)
    assert (y[zero_rows] == 0).all()
