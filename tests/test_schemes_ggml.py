"""llama.cpp's 32-block formats (q8_0, q4_0, q4_1, q5_0, q5_1) against the ``gguf`` package, bit for bit.

The ``gguf`` package implements llama.cpp's reference quantizers (``quantize_row_*_ref``) in numpy and every
dequantizer: it is the oracle here, for the bytes (``gguf.quants.quantize``) and the values
(``gguf.quants.dequantize``). Where numpy and the C code disagree (a block whose first element is -0.0;
weights below fp32's normal range, where the C casts see wrapped or non-finite values), the expected
bytes are worked out by hand below and the recorded llama.cpp output in ``tests/golden/kquants.json``
(see ``test_schemes_kquants.py``) settles them.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from helpers_ggml import CASES, TYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, quantize_tensor, scheme_names
from qkit.schemes.ggml_blocks import HALF_BELOW, round_half_away
from qkit.schemes.registry import scheme_from_dict

BPW = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0}
PROPS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def qkit_bytes(name: str, x: np.ndarray) -> np.ndarray:
    return quantize_tensor(torch.from_numpy(x), get_scheme(name)).qweight.numpy()


def gguf_bytes(name: str, x: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(x, TYPES[name])


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as bit patterns (tells -0.0 from 0.0)."""
    return a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_equal_the_gguf_reference_quantizer(name, case):
    x = CASES[case]
    assert np.array_equal(qkit_bytes(name, x), gguf_bytes(name, x))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_decode_equals_gguf_dequantize(name, case):
    x = CASES[case]
    qt = quantize_tensor(torch.from_numpy(x), get_scheme(name))
    ours = qt.dequantize(torch.float32).numpy()
    assert bits_equal(ours, gguf.quants.dequantize(qt.qweight.numpy(), TYPES[name]))


@pytest.mark.parametrize("name", list(TYPES))
def test_decode_of_arbitrary_blocks_equals_gguf(name):
    """Any block bytes (finite fp16 scales), not only ones qkit wrote, dequantize as in gguf."""
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (64, 8 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    halfs = (rng.standard_normal((blocks.shape[0], 2)) * 0.1).astype(np.float16).view(np.uint8)
    blocks[:, 0:2] = halfs[:, 0:2]  # d
    if name in ("q4_1", "q5_1"):
        blocks[:, 2:4] = halfs[:, 2:4]  # m
    s = get_scheme(name)
    ours = s.decode({"qweight": torch.from_numpy(raw)}, (64, 8 * 32), torch.float32).numpy()
    assert bits_equal(ours, gguf.quants.dequantize(raw, TYPES[name]))


def test_real_model_blocks_from_the_tiny_model(tiny_model_dir):
    from qkit.checkpoint import iter_tensors
    from qkit.transform import is_block_projection

    mats = [t.float().numpy() for n, t in iter_tensors(tiny_model_dir) if is_block_projection(n, tuple(t.shape))]
    assert mats
    for x in mats:
        for name in TYPES:
            assert np.array_equal(qkit_bytes(name, x), gguf_bytes(name, x)), name


@pytest.mark.slow
def test_real_model_blocks_from_the_default_model(default_model_dir):
    """A few real matrices of the default model (576- and 1536-wide) for every 32-block type."""
    from qkit.checkpoint import iter_tensors

    want = {"model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight", "model.layers.29.self_attn.v_proj.weight"}
    mats = {n: t.float().numpy() for n, t in iter_tensors(default_model_dir) if n in want}
    assert set(mats) == want
    for x in mats.values():
        for name in TYPES:
            qt = quantize_tensor(torch.from_numpy(x), get_scheme(name))
            assert np.array_equal(qt.qweight.numpy(), gguf_bytes(name, x)), name
            assert bits_equal(qt.dequantize(torch.float32).numpy(), gguf.quants.dequantize(qt.qweight.numpy(), TYPES[name]))


# --------------------------------------------------------------------------- hand-computed values


def test_golden_q8_0_block():
    """d = 127/127 = 1; codes roundf(x): 2.5 -> 3 and -2.5 -> -3 (half away from zero), 0.49999997 -> 0."""
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, -2.5, HALF_BELOW, -1.5]
    b = qkit_bytes("q8_0", x)[0]
    assert b[:2].tolist() == [0x00, 0x3C]  # fp16 1.0, little-endian
    assert b[2:7].view(np.int8).tolist() == [127, 3, -3, 0, -2]


def test_golden_q4_0_block():
    """max = -8 (the first of largest magnitude, with its sign) -> d = 1, codes min(15, (int)(x + 8.5))."""
    x = np.array([[-8.0, 8.0, 7.5, -0.5] + [0.0] * 12 + [1.0] * 16], np.float32)
    b = qkit_bytes("q4_0", x)[0]
    assert b[:2].tolist() == [0x00, 0x3C]  # d = -8 / -8 = 1.0
    lo = [0, 15, 15, 8] + [8] * 12  # 8 -> min(15, 16); 7.5 -> 16 -> 15; -0.5 -> (int)8.0 = 8
    hi = [9] * 16
    assert b[2:].tolist() == [l | (h << 4) for l, h in zip(lo, hi)]


def test_all_zero_and_negative_zero_blocks_follow_the_c_code():
    """C starts from ``max = 0.0f`` and keeps it for a block of zeros, so q4_0's d is 0.0f / -8 = -0.0
    (fp16 0x8000) whatever the zeros' signs; numpy takes the block's first element, so a block starting
    with -0.0 gets +0.0 in the gguf package. q4_1's m is the first zero's sign (``if (v < min)``)."""
    x = np.zeros((2, 32), np.float32)
    x[1, 0] = -0.0
    q40 = qkit_bytes("q4_0", x)
    assert q40[:, :2].tolist() == [[0x00, 0x80], [0x00, 0x80]]
    assert (q40[:, 2:] == 0x88).all()  # codes 8: (int)(0 * 0 + 8.5)
    assert gguf_bytes("q4_0", x)[1, :2].tolist() == [0x00, 0x00]  # the gguf package differs here
    q41 = qkit_bytes("q4_1", x)
    assert q41[0, :4].tolist() == [0, 0, 0x00, 0x00] and q41[1, :4].tolist() == [0, 0, 0x00, 0x80]
    assert (q41[:, 4:] == 0).all()


def test_weights_below_the_normal_range_follow_the_c_casts():
    """max = -7 * 2**-149: d = max / -8 rounds to 2**-149 (fp32), 1/d overflows to inf, x * inf is inf
    or NaN, and x86-64 converts those to 0x80000000: every code 0, every byte 0 (the gguf package agrees
    here; the recorded llama.cpp bytes in kquants.json cover more such blocks)."""
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = np.array([-7, 1, 2], np.float32) * np.float32(2.0**-149)
    b = qkit_bytes("q4_0", x)[0]
    assert b[:2].tolist() == [0, 0]  # fp16(2**-149) = 0
    assert (b[2:] == 0).all()
    assert np.array_equal(b, gguf_bytes("q4_0", x)[0])


def test_round_half_away():
    """Every float within 4 ulps of k + 1/2 and of k (k up to 256), and random values, against an exact
    formula: ``t + trunc(2 * (v - t))`` with ``t = trunc(v)`` (both steps exact in fp32)."""
    ks = np.arange(-256, 257, dtype=np.float32)
    centres = np.concatenate([ks, ks + np.float32(0.5)])
    bits = centres.view(np.int32)[:, None] + np.arange(-4, 5, dtype=np.int32)[None, :]
    near = bits.reshape(-1).view(np.float32)
    near = near[np.isfinite(near)]  # stepping below +0.0 in the bit pattern gives NaNs
    rand = (np.random.default_rng(2).standard_normal(200_000) * 60).astype(np.float32)
    v = torch.from_numpy(np.concatenate([near, rand, [HALF_BELOW, -HALF_BELOW, 0.5, -0.5, 0.0]]).astype(np.float32))
    t = torch.trunc(v)
    exact = t + torch.trunc((v - t) * 2)
    assert torch.equal(torch.trunc(round_half_away(v)), exact)


# --------------------------------------------------------------------------- registry, sizes, refusals


@pytest.mark.parametrize("name", list(TYPES))
def test_registered_with_exact_bits_per_weight(name):
    s = get_scheme(name)
    assert name in scheme_names()
    assert (s.kind, s.ggml_type, s.block_size) == ("ggml", TYPES[name], 32)
    assert s.bits_per_weight == BPW[name]
    qt = quantize_tensor(torch.randn(64, 256), s)
    assert qt.bits_per_weight == BPW[name]
    assert qt.qweight.dtype == torch.uint8 and tuple(qt.qweight.shape) == (64, 256 // 32 * s.type_size)
    assert qt.scales.dtype == torch.float16 and qt.scales.numel() == 0
    assert s.nbytes_for((64, 256)) == qt.nbytes


@pytest.mark.parametrize("name", list(TYPES))
def test_to_dict_round_trips_through_the_registry(name):
    s = get_scheme(name)
    d = s.to_dict()
    assert d["kind"] == "ggml" and d["ggml_type"] == TYPES[name].name and d["block_size"] == 32
    assert "scale_dtype" not in d  # fixed by the format (fp16 inside the blocks)
    assert scheme_from_dict(d) is s


@pytest.mark.parametrize("name", list(TYPES))
def test_scale_dtype_is_part_of_the_format(name):
    assert get_scheme(name, scale_dtype="fp32") is get_scheme(name)


@pytest.mark.parametrize("name", list(TYPES))
def test_a_width_that_is_not_a_multiple_of_32_is_refused_in_one_line(name):
    with pytest.raises(SchemeError) as exc:
        quantize_tensor(torch.randn(4, 100), get_scheme(name), name="model.layers.0.mlp.up_proj.weight")
    msg = str(exc.value)
    assert "\n" not in msg and "model.layers.0.mlp.up_proj.weight" in msg and "width 100" in msg and "multiple of 32" in msg


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(name, bad):
    w = torch.randn(4, 64)
    w[2, 33] = bad
    with pytest.raises(NonFiniteWeightError, match="NaN or infinite"):
        quantize_tensor(w, get_scheme(name), name="w")


@pytest.mark.parametrize(("name", "big"), [("q8_0", 1e7), ("q4_0", 1e6), ("q4_1", 1e6), ("q5_0", 2e6), ("q5_1", 3e6)])
def test_a_block_scale_overflowing_fp16_is_refused(name, big):
    w = torch.randn(2, 64)
    w[1, 5] = big
    with pytest.raises(SchemeError, match="overflows fp16"):
        quantize_tensor(w, get_scheme(name), name="w")


# --------------------------------------------------------------------------- properties


@st.composite
def matrices(draw):
    rows = draw(st.integers(1, 4))
    blocks = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    w = torch.randn(rows, 32 * blocks, generator=gen) * 10.0 ** draw(st.sampled_from([-4, -2, 0, 2]))
    if draw(st.booleans()):
        w[torch.rand(w.shape, generator=gen) < 0.3] = 0.0
    return w


@pytest.mark.parametrize("name", list(TYPES))
@PROPS
@given(w=matrices(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_shape_dtype_zeros_and_determinism(name, w, dtype):
    w = w.to(dtype)
    s = get_scheme(name)
    qt = quantize_tensor(w, s)
    out = qt.dequantize()
    assert out.shape == w.shape and out.dtype == dtype
    if name in ("q8_0", "q4_0", "q5_0"):  # symmetric: a zero weight is code 0 / the middle code
        assert (out[w == 0] == 0).all()
    blocks = w.reshape(-1, 32)
    zero_blocks = (blocks == 0).all(dim=1)
    assert (out.reshape(-1, 32)[zero_blocks] == 0).all()  # q4_1/q5_1 too: d = 0, m = 0
    again = quantize_tensor(w.t().contiguous().t(), s)  # same values, column-major memory
    assert torch.equal(again.qweight, qt.qweight)


@pytest.mark.parametrize("name", list(TYPES))
@PROPS
@given(w=matrices())
def test_error_bound(name, w):
    """Per weight, with ``d`` the block's fp32 scale and ``d16`` / ``m16`` the stored fp16 ones:

    * q8_0, q4_1, q5_1: ``|w - w_hat| <= |d|/2 + qmax * |d16 - d| + |m16 - min|`` (round to nearest of the
      fp32 scale; dequantizing with the fp16 values moves each weight by at most the last two terms);
    * q4_0, q5_0: the same with a whole step ``|d|`` where ``x/d`` is above the top code (``max`` maps to
      the bottom code ``-8`` / ``-16``, so a weight of the other sign and nearly the same size maps to
      ``+8`` / ``+16`` and is clamped to ``7`` / ``15``), half a step elsewhere.
    Plus fp32 slack ``2**-22 * (|w| + |w_hat|)``, for blocks whose fp16 scale is normal."""
    s = get_scheme(name)
    qt = quantize_tensor(w, s)
    w_hat = qt.dequantize(torch.float32)
    x = w.reshape(-1, 32).double()
    err = (x - w_hat.reshape(-1, 32).double()).abs()
    b = qt.qweight.reshape(-1, s.type_size)
    d16 = b[:, 0:2].contiguous().view(torch.float16).double()
    if name in ("q4_1", "q5_1"):
        levels = 15 if name == "q4_1" else 31
        mn, mx = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        d = (mx - mn) / levels
        m16 = b[:, 2:4].contiguous().view(torch.float16).double()
        bound = d / 2 + levels * (d16 - d).abs() + (m16 - mn).abs()
    elif name == "q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        bound = d / 2 + 127 * (d16 - d).abs()
    else:
        levels = 8 if name == "q4_0" else 16
        first = x.abs().argmax(dim=1, keepdim=True)
        d = x.gather(1, first) / -levels
        top = (x / d) > levels - 0.5
        bound = torch.where(top, d.abs(), d.abs() / 2) + levels * (d16 - d).abs()
    bound = bound + 2.0**-22 * (x.abs() + w_hat.reshape(-1, 32).double().abs())
    normal = d16.abs() >= 2.0**-14
    assert (err <= bound)[normal.expand_as(err)].all()


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_0"])
@PROPS
@given(w=matrices())
def test_requantization_is_exact_for_the_symmetric_types(name, w):
    """``w_hat = q * d16`` holds ``-levels * d16`` (q4_0/q5_0: the extreme gets the bottom code; q8_0: +-127)
    as its largest magnitude, exact in fp32, so re-quantizing recomputes ``d = d16`` exactly, the same
    codes (``q * d16 / d16`` within an ulp of ``q``) and the same bytes, wherever ``d16`` is a normal fp16
    number (checked per block)."""
    s = get_scheme(name)
    qt = quantize_tensor(w, s)
    qt2 = quantize_tensor(qt.dequantize(torch.float32), s)
    b, b2 = qt.qweight.reshape(-1, s.type_size), qt2.qweight.reshape(-1, s.type_size)
    normal = b[:, 0:2].contiguous().view(torch.float16).float().abs().squeeze(1) >= 2.0**-14
    assert torch.equal(b[normal], b2[normal])
