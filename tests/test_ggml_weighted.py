"""The importance-matrix paths of llama.cpp's 32-block types (q4_0, q4_1, q5_0, q5_1) and the scale searches.

Oracles, bit for bit:
- the built llama.cpp reference (``ggml_quantize_chunk`` with ``quant_weights``: ``quantize_row_*_impl``;
  ``python benchmarks/build_llama_ref.py``), for the block bytes, on both qkit paths (kernels and torch);
- ggml-quants.c's own ``static`` search helpers (``nearest_int``, ``make_qx_quants``, ``make_q3_quants``,
  ``make_qkx2_quants``, ``make_qkx3_quants``, ``make_qp_quants``) cut out of the pinned source and compiled
  alone with the reference's flags (``cc -O3``, no ``-march``), for the scalar numba ports;
- the torch searches of ``qkit.schemes.kquant_search`` against the numba ones (scalar and across lanes);
- ``gguf.quants.dequantize`` for the decoder.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module, near_max_importance
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import _kernels_search as ks
from qkit.schemes import get_scheme, kernels
from qkit.schemes import kquant_search as kq
from qkit.schemes.ggml import uses_importance
from qkit.schemes.ggml_weighted import encode_weighted_torch

T = gguf.GGMLQuantizationType
TYPES = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1}
PROPS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
# (nmax, rmin, rdelta, nstep, use_mad) of the C callers: q4_k, q2_k, q5_k, q4_1/q5_1 (make_qkx3), and no steps
QKX_PARAMS = [(15, -1.0, 0.1, 20, False), (3, -0.5, 0.1, 15, True), (31, -0.5, 0.1, 15, False),
              (15, -0.9, 0.05, 36, False), (31, -0.9, 0.05, 36, False), (7, -0.5, 0.1, 0, False)]


def _build_ref():
    return benchmark_module("build_llama_ref")


@pytest.fixture(scope="module")
def ref():
    r = _build_ref().load()
    if r is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    return r


def bits(a) -> bytes:
    return np.asarray(a, np.float32).tobytes()


def encode(name: str, x: np.ndarray, qw: np.ndarray | None, *, compiled: bool) -> np.ndarray:
    old = kernels.set_enabled(compiled)
    try:
        qwt = None if qw is None else torch.from_numpy(qw)
        return get_scheme(name).encode(torch.from_numpy(x), qwt)["qweight"].numpy()
    finally:
        kernels.set_enabled(old)


def first_bad(got: np.ndarray, want: np.ndarray, size: int) -> str:
    bad = np.nonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))[0]
    return f"{bad.size} of {got.size // size} blocks differ, first {bad[:4].tolist()}"


# --------------------------------------------------------------------------- inputs


def matrices(rng: np.random.Generator, rows: int = 8, cols: int = 256) -> dict[str, np.ndarray]:
    x = rng.standard_normal((rows, cols))
    f = np.float32
    return {
        "normal": x.astype(f),
        "weight_like": (x * 0.02).astype(f),
        "heavy_tailed": (x / (rng.random(x.shape) + 0.01)).astype(f),
        "small_integers_ties": rng.integers(-8, 9, x.shape).astype(f),
        "halves_ties": (rng.integers(-40, 41, x.shape) / 2).astype(f),
        "positive": rng.random(x.shape).astype(f),
        "negative": (-rng.random(x.shape)).astype(f),
        "constant": np.full(x.shape, 3.0, f),
        "sparse": np.where(rng.random(x.shape) < 0.8, 0, x).astype(f),
        "one_outlier": np.where(np.arange(cols) == 77, 40.0, x * 0.1).astype(f),
        "large_1e3": (x * 1e3).astype(f),
        "below_group_max_eps": (x * 1e-16).astype(f),
        "all_zero": np.zeros(x.shape, f),
        "signed_zeros": np.where(np.arange(cols) % 3 == 0, -0.0, np.where(np.arange(cols) % 7 == 0, 1.0, 0.0))
        .repeat(rows).reshape(cols, rows).T.astype(f).copy(),
        "negative_zero_first": np.where(rng.random(x.shape) < 0.5, -0.0, 0.0).astype(f) + np.where(np.arange(cols) % 32 == 5, 0.5, 0).astype(f),
        "zero_blocks": np.where((np.arange(cols) // 32) % 2 == 0, 0.0, x).astype(f),
        "row_offset": (x + rng.standard_normal((rows, 1)) * 3).astype(f),
        "subnormal_2e-140": (x * 2.0**-140).astype(f),
        "near_fp32_min_normal": (x * 2.0**-122).astype(f),
    }


def importances(rng: np.random.Generator, cols: int = 256) -> dict[str, np.ndarray]:
    f = np.float32
    r = rng.random(cols) + 0.01
    return {
        "random": r.astype(f),
        "heavy": (r**6 * 1e3).astype(f),
        "with_zeros": np.where(rng.random(cols) < 0.4, 0, r).astype(f),
        "zero_block": np.where(np.arange(cols) // 32 == 2, 0, r).astype(f),
        "all_ones": np.ones(cols, f),
        "all_zero": np.zeros(cols, f),
    }


# --------------------------------------------------------------------------- the block bytes vs llama.cpp


@pytest.mark.parametrize("name", list(TYPES))
def test_weighted_bytes_equal_llama_cpp(ref, name):
    """Every input kind x every importance kind (and none), both qkit paths, equals ggml_quantize_chunk.
    The kinds are stacked into one matrix (the rows are independent: sigma2 is a per-row statistic)."""
    rng = np.random.default_rng(11)
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    kinds = matrices(rng)
    x = np.concatenate(list(kinds.values()))
    kind_of = np.repeat(list(kinds), [len(v) for v in kinds.values()])
    for iname, qw in {**importances(rng), "none": None}.items():
        want = ref.quantize(x, TYPES[name], qw)
        for compiled in (True, False):
            got = encode(name, x, qw, compiled=compiled)
            rows = np.nonzero((got != want).any(axis=1))[0]
            assert rows.size == 0, (iname, compiled, sorted(set(kind_of[rows])), first_bad(got, want, size))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("cols", [32, 96, 576])
def test_weighted_widths_equal_llama_cpp(ref, name, cols):
    """sigma2 is a whole-row statistic: rows of one block, odd block counts and the model's 576."""
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((5, cols)) * rng.random((5, 1)) * 3).astype(np.float32)
    qw = (rng.random(cols) ** 3).astype(np.float32)
    want = ref.quantize(x, TYPES[name], qw)
    assert np.array_equal(encode(name, x, qw, compiled=True), want)
    assert np.array_equal(encode(name, x, qw, compiled=False), want)


@pytest.mark.slow
def test_default_model_rows_equal_llama_cpp(ref, default_model_dir):
    """Real matrices of the default model (576 and 1536 wide) with an imatrix-like importance."""
    from qkit.checkpoint import iter_tensors

    want = {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight", "model.layers.29.mlp.gate_proj.weight"}
    mats = {n: t.float().numpy()[:96].copy() for n, t in iter_tensors(default_model_dir) if n in want}
    assert set(mats) == want
    rng = np.random.default_rng(7)
    for n, x in mats.items():
        cols = x.shape[1]
        qw = (rng.gamma(0.5, size=cols) * 1e-2).astype(np.float32)  # mean squares: positive, skewed
        qw[rng.random(cols) < 0.05] = 0
        for name, t in TYPES.items():
            expect = ref.quantize(x, t, qw)
            for compiled in (True, False):
                assert np.array_equal(encode(name, x, qw, compiled=compiled), expect), (n, name, compiled)


# --------------------------------------------------------------------------- paths, decoder, routing, refusals


@pytest.mark.parametrize("name", list(TYPES))
def test_kernel_equals_torch_on_a_larger_matrix(name):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 576)) * rng.gamma(1.0, size=(300, 1)) * 0.05).astype(np.float32)
    x[7, :64] = 0
    x[9] = np.round(x[9] * 40) / 4
    qw = (rng.random(576) ** 4).astype(np.float32)
    qw[100:140] = 0
    assert np.array_equal(encode(name, x, qw, compiled=True), encode(name, x, qw, compiled=False))


@pytest.mark.parametrize("name", list(TYPES))
def test_decoder_equals_gguf_on_weighted_blocks(name):
    rng = np.random.default_rng(4)
    x = rng.standard_t(3, (16, 256)).astype(np.float32)
    qw = rng.random(256).astype(np.float32)
    scheme = get_scheme(name)
    parts = scheme.encode(torch.from_numpy(x), torch.from_numpy(qw))
    ours = scheme.decode(parts, x.shape, torch.float32).numpy()
    assert ours.view(np.uint32).tobytes() == gguf.quants.dequantize(parts["qweight"].numpy(), TYPES[name]).view(np.uint32).tobytes()


def test_q8_0_ignores_the_importance_matrix():
    """quantize_q8_0 never reads quant_weights: no weighted encoder, the plain bytes."""
    assert not uses_importance(T.Q8_0)
    assert all(uses_importance(t) for t in TYPES.values())
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    s = get_scheme("q8_0")
    assert torch.equal(s.encode(x, torch.rand(128))["qweight"], s.encode(x)["qweight"])


def test_the_importance_changes_the_bytes():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    qw = torch.rand(256, generator=torch.Generator().manual_seed(2)) ** 4
    for name in TYPES:
        s = get_scheme(name)
        assert not torch.equal(s.encode(x, qw)["qweight"], s.encode(x)["qweight"]), name


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", list(TYPES))
def test_refusals(name, compiled):
    s = get_scheme(name)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    old = kernels.set_enabled(compiled)
    try:
        for bad in (float("nan"), float("inf"), -1.0):
            qw = torch.ones(64)
            qw[5] = bad
            with pytest.raises(SchemeError, match="importance value"):
                s.encode(x, qw)
        with pytest.raises(SchemeError, match="importance vector of 63"):
            s.encode(x, torch.ones(63))
        for v in (float("nan"), float("inf")):
            y = x.clone()
            y[1, 3] = v
            with pytest.raises(NonFiniteWeightError):
                s.encode(y, torch.ones(64))
        with pytest.raises(SchemeError, match="overflows fp16"):
            s.encode(x * 1e7, torch.ones(64))
    finally:
        kernels.set_enabled(old)


def test_empty_rows():
    for name, t in TYPES.items():
        out = get_scheme(name).encode(torch.zeros(0, 64), torch.ones(64))["qweight"]
        assert out.shape == (0, 2 * gguf.GGML_QUANT_SIZES[t][1])


# --------------------------------------------------------------------------- the searches: C, numba, torch


def _extract(text: str, name: str) -> str:
    m = re.search(r"^static[^\n(]*\b" + name + r"\(", text, re.MULTILINE)
    depth, i = 0, text.index("{", m.end())
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[m.start() : j + 1]
    raise ValueError(name)


_C_HEAD = """#include <math.h>
#include <string.h>
#include <stdint.h>
#include <stdbool.h>
#include <assert.h>
#define GGML_RESTRICT __restrict__
#define GROUP_MAX_EPS 1e-15f
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
"""
_C_WRAP = """
int c_nearest_int(float f) { return nearest_int(f); }
float c_qx(int n, int nmax, const float *x, int8_t *L, int rmse_type, const float *qw) { return make_qx_quants(n, nmax, x, L, rmse_type, qw); }
float c_q3(int n, int nmax, const float *x, int8_t *L, int do_rmse) { return make_q3_quants(n, nmax, x, L, do_rmse); }
float c_qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep, int use_mad) { return make_qkx2_quants(n, nmax, x, w, L, the_min, Laux, rmin, rdelta, nstep, use_mad); }
float c_qkx3(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep, int use_mad) { return make_qkx3_quants(n, nmax, x, w, L, the_min, Laux, rmin, rdelta, nstep, use_mad); }
float c_qp(int n, int nmax, const float *x, uint8_t *L, const float *qw) { return make_qp_quants(n, nmax, x, L, qw); }
"""


@pytest.fixture(scope="module")
def csearch(tmp_path_factory):
    """ggml-quants.c's search helpers alone, compiled as ggml-base compiles them (-O3, no -march: no FMA)."""
    src = _build_ref().ref_dir() / "src" / "ggml" / "src" / "ggml-quants.c"
    if not src.exists() or shutil.which("cc") is None:
        pytest.skip("needs the llama.cpp source (python benchmarks/build_llama_ref.py) and a C compiler")
    text = re.sub(r"#ifdef HAVE_BUGGY_APPLE_LINKER\n.*?#else\n(.*?)#endif\n", r"\1", src.read_text(), flags=re.DOTALL)
    names = ["nearest_int", "make_qx_quants", "make_q3_quants", "make_qkx2_quants", "make_qkx3_quants", "make_qp_quants"]
    d = tmp_path_factory.mktemp("csearch")
    (d / "search.c").write_text(_C_HEAD + "\n".join(_extract(text, n) for n in names) + _C_WRAP)
    subprocess.run(["cc", "-O3", "-DNDEBUG", "-std=gnu11", "-fPIC", "-shared", "-o", str(d / "search.so"), str(d / "search.c")], check=True)
    lib = ctypes.CDLL(str(d / "search.so"))
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.c_nearest_int.argtypes, lib.c_nearest_int.restype = [F], I
    lib.c_qx.argtypes, lib.c_qx.restype = [I, I, P, P, I, P], F
    lib.c_q3.argtypes, lib.c_q3.restype = [I, I, P, P, I], F
    for f in (lib.c_qkx2, lib.c_qkx3):
        f.argtypes, f.restype = [I, I, P, P, P, P, P, F, F, I, I], F
    lib.c_qp.argtypes, lib.c_qp.restype = [I, I, P, P, P], F
    return lib


def sub_blocks(rng: np.random.Generator, S: int, n: int) -> np.ndarray:
    """fp32 ``[S, n]``: a mix of sub-block kinds (normal, heavy-tailed, ties, zeros, signed zeros, one
    sign, tiny, sparse, outlier)."""
    out = np.empty((S, n), np.float32)
    for k in range(S):
        t = k % 10
        x = rng.standard_normal(n)
        x = [x, rng.standard_t(2, n), rng.integers(-4, 5, n) / 2, np.zeros(n), np.abs(x), x * 1e-20,
             np.where(rng.random(n) < 0.8, 0, x), rng.integers(0, 3, n).astype(float),
             np.where(rng.random(n) < 0.5, -0.0, 0.0) + np.where(rng.random(n) < 0.5, 0, np.abs(x)),
             np.where(np.arange(n) == k % n, 30.0, x * 0.1)][t]
        out[k] = x
    return out


def sub_weights(rng: np.random.Generator, S: int, n: int) -> np.ndarray:
    w = rng.random((S, n)).astype(np.float32)
    w[rng.random((S, n)) < 0.3] = 0
    w[::7] = 1
    w[3::11] = 0
    return w


def test_nearest_int_equals_c(csearch):
    rng = np.random.default_rng(0)
    v = (rng.standard_normal(3000) * 10.0 ** rng.integers(-3, 12, 3000)).astype(np.float32)
    special = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 4194303, 4194303.5, 4194304, -4194304, -4194305, 8388608,
                        1.2e7, -1.2e7, -12582912, 3e38, -3e38, np.inf, -np.inf, np.nan, 1e-45, -0.0], np.float32)
    v = np.concatenate([v, special])
    c = np.array([csearch.c_nearest_int(float(f)) for f in v])
    assert np.array_equal(np.array([ks.nearest_int(f) for f in v]), c)
    assert np.array_equal(kq.nearest_int(torch.from_numpy(v)).numpy(), c)


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data


@pytest.mark.parametrize("n", [16, 32])
def test_scalar_searches_equal_c(csearch, n):
    """The numba ports of every search equal ggml-quants.c's functions (scale, min and codes)."""
    rng = np.random.default_rng(n)
    X, W = sub_blocks(rng, 60, n), sub_weights(rng, 60, n)
    A = np.empty(n, np.uint8)
    for x, w in zip(X, W):
        for nmax in (3, 4, 8, 16, 31, 32):
            for rt, has in [(1, True), (1, False), (0, False), (2, False), (3, False), (4, False), (-1, False)]:
                La, Lb = np.zeros(n, np.int8), np.zeros(n, np.int8)
                a = ks.make_qx_quants(n, nmax, x, La, rt, w, has)
                b = csearch.c_qx(n, nmax, _ptr(x), _ptr(Lb), rt, _ptr(w) if has else None)
                assert bits(a) == bits(b) and np.array_equal(La, Lb), ("qx", nmax, rt, has, x)
            for do_rmse in (False, True):
                La, Lb = np.zeros(n, np.int8), np.zeros(n, np.int8)
                a = ks.make_q3_quants(n, nmax, x, La, do_rmse)
                b = csearch.c_q3(n, nmax, _ptr(x), _ptr(Lb), do_rmse)
                assert bits(a) == bits(b) and np.array_equal(La, Lb), ("q3", nmax, do_rmse, x)
            La, Lb = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
            a = ks.make_qp_quants(n, nmax, x, La, w)
            b = csearch.c_qp(n, nmax, _ptr(x), _ptr(Lb), _ptr(w))
            assert bits(a) == bits(b) and np.array_equal(La, Lb), ("qp", nmax, x)
        for nmax, rmin, rdelta, nstep, mad in QKX_PARAMS:
            for three, has in [(False, True), (True, True), (True, False)]:
                La, Lb, mb = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(1, np.float32)
                if three:
                    a, ma = ks.make_qkx3_quants(n, nmax, x, w, has, La, A, rmin, rdelta, nstep, mad)
                    b = csearch.c_qkx3(n, nmax, _ptr(x), _ptr(w) if has else None, _ptr(Lb), _ptr(mb), _ptr(A), rmin, rdelta, nstep, mad)
                else:
                    a, ma = ks.make_qkx2_quants(n, nmax, x, w, La, A, rmin, rdelta, nstep, mad)
                    b = csearch.c_qkx2(n, nmax, _ptr(x), _ptr(w), _ptr(Lb), _ptr(mb), _ptr(A), rmin, rdelta, nstep, mad)
                assert bits(a) == bits(b) and bits(ma) == mb.tobytes() and np.array_equal(La, Lb), ("qkx", three, has, nmax, x)


@pytest.mark.parametrize("n", [16, 32])
def test_torch_searches_equal_numba(n):
    """The vectorised torch searches (layout [n, S]) equal the scalar numba ports sub-block by sub-block."""
    rng = np.random.default_rng(100 + n)
    S = 80
    X, W = sub_blocks(rng, S, n), sub_weights(rng, S, n)
    xt, wt = torch.from_numpy(X.T.copy()), torch.from_numpy(W.T.copy())
    A = np.empty(n, np.uint8)
    for nmax in (4, 8, 16, 32):
        for rt, has in [(1, True), (1, False), (0, False), (3, False), (-1, False)]:
            scale, L = kq.make_qx_quants(xt, nmax, rt, wt if has else None)
            for k in range(S):
                Lk = np.zeros(n, np.int8)
                assert bits(scale[k]) == bits(ks.make_qx_quants(n, nmax, X[k], Lk, rt, W[k], has)), ("qx", nmax, rt, has, k)
                assert np.array_equal(L[:, k].numpy(), Lk), ("qx codes", nmax, rt, has, k)
        for do_rmse in (False, True):
            scale, L = kq.make_q3_quants(xt, nmax, do_rmse)
            for k in range(S):
                Lk = np.zeros(n, np.int8)
                assert bits(scale[k]) == bits(ks.make_q3_quants(n, nmax, X[k], Lk, do_rmse)), ("q3", nmax, k)
                assert np.array_equal(L[:, k].numpy(), Lk), ("q3 codes", nmax, k)
        scale, L = kq.make_qp_quants(xt, wt, nmax)
        for k in range(S):
            Lk = np.zeros(n, np.uint8)
            assert bits(scale[k]) == bits(ks.make_qp_quants(n, nmax, X[k], Lk, W[k])), ("qp", nmax, k)
            assert np.array_equal(L[:, k].numpy(), Lk), ("qp codes", nmax, k)
    for nmax, rmin, rdelta, nstep, mad in QKX_PARAMS:
        for three, has in [(False, True), (True, True), (True, False)]:
            if three:
                scale, the_min, L = kq.make_qkx3_quants(xt, wt if has else None, nmax, rmin, rdelta, nstep, mad)
            else:
                scale, the_min, L = kq.make_qkx2_quants(xt, wt, nmax, rmin, rdelta, nstep, mad)
            for k in range(S):
                Lk = np.zeros(n, np.uint8)
                if three:
                    a, m = ks.make_qkx3_quants(n, nmax, X[k], W[k], has, Lk, A, rmin, rdelta, nstep, mad)
                else:
                    a, m = ks.make_qkx2_quants(n, nmax, X[k], W[k], Lk, A, rmin, rdelta, nstep, mad)
                assert bits(scale[k]) == bits(a) and bits(the_min[k]) == bits(m), ("qkx", three, nmax, nstep, k)
                assert np.array_equal(L[:, k].numpy(), Lk), ("qkx codes", three, nmax, nstep, k)


def test_existing_defaults_unchanged():
    """``make_qkx2_quants(x, w, 15)`` and ``make_qx_quants(x, 32)`` (the q4_k / q6_k callers) are the
    explicit C parameter sets."""
    rng = np.random.default_rng(5)
    X, W = sub_blocks(rng, 50, 32), sub_weights(rng, 50, 32)
    xt, wt = torch.from_numpy(X.T.copy()), torch.from_numpy(W.T.copy())
    for a, b in zip(kq.make_qkx2_quants(xt, wt, 15), kq.make_qkx2_quants(xt, wt, 15, -1.0, 0.1, 20, False)):
        assert torch.equal(a, b)
    for a, b in zip(kq.make_qx_quants(xt, 32), kq.make_qx_quants(xt, 32, 1, None)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [16, 32])
def test_lane_kernels_equal_torch(n):
    """The across-sub-block kernels (``qx_weighted``, ``qkx_rows``: 64 lanes, a partial last tile) equal the
    torch searches, for every caller's parameter set."""
    rng = np.random.default_rng(200 + n)
    S = 200
    X, W = sub_blocks(rng, S, n), sub_weights(rng, S, n)
    x, w = torch.from_numpy(X), torch.from_numpy(W)
    xt, wt = x.t().contiguous(), w.t().contiguous()
    for nmax in (4, 8, 16, 32):
        scale, L = kernels.qx_weighted(x, w, 0, nmax)
        s2, L2 = kq.make_qx_quants(xt, nmax, 1, wt)
        assert bits(scale) == bits(s2) and torch.equal(L.float(), L2.t()), nmax
    for nmax, rmin, rdelta, nstep, mad in QKX_PARAMS:
        scale, the_min, L = kernels.qkx_rows(x, w, nmax, rmin, rdelta, nstep, mad)
        s2, m2, L2 = kq.make_qkx2_quants(xt, wt, nmax, rmin, rdelta, nstep, mad)
        assert bits(scale) == bits(s2) and bits(the_min) == bits(m2) and torch.equal(L.float(), L2.t()), (nmax, nstep)


# --------------------------------------------------------------------------- properties


_VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, 1e-3, -7.0, 3e-20, 1e4, 0.1])


@st.composite
def edge_matrix(draw):
    rows = draw(st.integers(1, 3))
    cols = 32 * draw(st.integers(1, 3))
    base = draw(st.sampled_from(["values", "normal", "mixed"]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    if base == "values":
        vals = draw(st.lists(_VALUES, min_size=rows * cols, max_size=rows * cols))
        x = np.array(vals, np.float32).reshape(rows, cols)
    else:
        x = rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-4, 3)
        if base == "mixed":
            x = np.where(rng.random(x.shape) < 0.5, np.round(x * 2) / 2, 0.0)
        x = x.astype(np.float32)
    qkind = draw(st.sampled_from(["random", "zeros", "ones", "spiky"]))
    qw = {"random": rng.random(cols), "zeros": np.where(rng.random(cols) < 0.5, 0, rng.random(cols)),
          "ones": np.ones(cols), "spiky": np.where(np.arange(cols) % 9 == 0, 1e4, 1e-4)}[qkind].astype(np.float32)
    return x, qw


@PROPS
@given(edge_matrix(), st.sampled_from(list(TYPES)))
def test_property_paths_agree_and_rows_are_independent(case, name):
    """The kernel and torch paths give the same bytes; a row's bytes do not depend on the other rows;
    the decoded values are finite and of the block's magnitude."""
    x, qw = case
    a = encode(name, x, qw, compiled=True)
    assert np.array_equal(a, encode(name, x, qw, compiled=False))
    for r in range(x.shape[0]):
        assert np.array_equal(a[r], encode(name, x[r : r + 1].copy(), qw, compiled=True)[0])
    y = gguf.quants.dequantize(a, TYPES[name]).reshape(x.shape).astype(np.float64)
    xb, yb = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32)
    span = np.maximum(np.abs(xb).max(axis=1), 1e-30)
    assert np.isfinite(yb).all() and (np.abs(yb).max(axis=1) <= 16.0 * span + 1e-6).all()


@PROPS
@given(edge_matrix(), st.sampled_from(list(TYPES)))
def test_property_equals_llama_cpp(ref, case, name):
    x, qw = case
    assert np.array_equal(encode(name, x, qw, compiled=True), ref.quantize(x, TYPES[name], qw))


def test_torch_oracle_is_the_registered_fallback():
    """With the kernels off the weighted encoder is ``encode_weighted_torch`` itself."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    qw = torch.rand(64, generator=torch.Generator().manual_seed(9))
    old = kernels.set_enabled(False)
    try:
        for name, t in TYPES.items():
            assert torch.equal(get_scheme(name).encode(x, qw)["qweight"], encode_weighted_torch(t, x, qw))
    finally:
        kernels.set_enabled(old)


# --------------------------------------------------------------------------- nearest_int's range


def near_max_blocks(rng: np.random.Generator, S: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """All-negative sub-blocks whose weight sits on one or two elements just below the maximum: a fitted
    min lands next to the max, ``(max - min)`` becomes tiny and ``|iscale * (x - min)|`` passes 4194303,
    where C's nearest_int wraps instead of rounding (a few sub-blocks in 10^4)."""
    X = -np.abs(rng.standard_normal((S, n))).astype(np.float32)
    W = np.zeros((S, n), np.float32)
    for k in range(S):
        m = int(rng.integers(1, 3))
        idx = rng.choice(n, m, replace=False)
        W[k, idx] = rng.random(m) * 10.0 ** rng.integers(-20, 20)
        X[k, idx] = X[k].max() - rng.random(m) * 10.0 ** rng.integers(-8, 0)
    return X, W


@pytest.mark.parametrize("nmax", [15, 31])
def test_qkx_codes_beyond_nearest_int_range(nmax, monkeypatch):
    """Torch, lanes and scalar port agree where the codes leave nearest_int's exact range; plain rounding
    (the bound disabled) would not."""
    rng = np.random.default_rng(nmax)
    X, W = near_max_blocks(rng, 20000)
    n = X.shape[1]
    xt, wt = torch.from_numpy(X.T.copy()), torch.from_numpy(W.T.copy())
    scale, the_min, L = kq.make_qkx3_quants(xt, wt, nmax)
    sl, ml, Ll = kernels.qkx_rows(torch.from_numpy(X), torch.from_numpy(W), nmax, -0.9, 0.05, 36, False)
    A = np.empty(n, np.uint8)
    want_s, want_m, want_L = np.empty(len(X), np.float32), np.empty(len(X), np.float32), np.zeros(X.shape, np.uint8)
    for k in range(len(X)):
        want_s[k], want_m[k] = ks.make_qkx3_quants(n, nmax, X[k], W[k], True, want_L[k], A, -0.9, 0.05, 36, False)
    assert bits(scale) == bits(want_s) and bits(the_min) == bits(want_m) and np.array_equal(L.t().numpy(), want_L)
    assert bits(sl) == bits(want_s) and bits(ml) == bits(want_m) and np.array_equal(Ll.numpy(), want_L)
    monkeypatch.setattr(kq, "_ROUND_BOUND", float("inf"))
    naive = kq.make_qkx3_quants(xt, wt, nmax)
    assert not (bits(naive[0]) == bits(want_s) and np.array_equal(naive[2].t().numpy(), want_L)), "the case no longer reaches the wrap"


@pytest.mark.parametrize("name", ["q4_1", "q5_1"])
def test_near_max_blocks_equal_llama_cpp(ref, name):
    """The same situation through the importance matrix: per block one or two columns carry all the
    importance and the rows' values there sit just below the block maximum."""
    x, qw = near_max_importance(21)
    want = ref.quantize(x, TYPES[name], qw)
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    for compiled in (True, False):
        got = encode(name, x, qw, compiled=compiled)
        assert np.array_equal(got, want), (compiled, first_bad(got, want, size))
