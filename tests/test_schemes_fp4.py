"""FP4 schemes (``mxfp4``, ``nvfp4``): hand-computed cases, bit-exactness against the reference
implementations, and the registry-wide properties.

Oracles, called here (never values copied from them):

* MXFP4: the ``gguf`` package's reference quantizer and dequantizer (``gguf.quants.quantize`` /
  ``dequantize`` with ``GGMLQuantizationType.MXFP4``, gguf 0.19.0): codes and E8M0 bytes bit for bit.
* NVFP4: compressed-tensors 0.20.1, the code llm-compressor runs: ``generate_gparam`` (tensor scale),
  ``calculate_qparams`` (block scales), ``NVFP4PackedCompressor.compress`` (codes, packing) and
  ``decompress`` / ``_dequantize``: packed bytes, E4M3 scale bytes and the global scale bit for bit,
  dequantized weights bit for bit; and gguf's NVFP4 dequantizer for ``E2M1 * E4M3`` (no tensor scale there).

tests/test_schemes_properties.py iterates over ``DEFAULT_SCHEMES`` plus a few int groups (not over
``scheme_names()``), so the FP4 schemes get their registry properties here, with widths that are whole
blocks (the only ones they accept) and the exceptions stated where a property does not hold.
"""

from __future__ import annotations

import contextlib

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, quantize_tensor, scheme_names
from qkit.schemes.e2m1 import E2M1_VALUES, e2m1_codes, e2m1_pack, e2m1_pack_arith, mxfp4_exponents, pack_fp4, unpack_fp4
from qkit.schemes.fp4 import (
    MXFP4Scheme,
    NVFP4Scheme,
    dequantize_nvfp4,
    quantize_nvfp4,
    to_gguf_mxfp4_blocks,
)
from qkit.schemes.registry import scheme_from_dict

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf import quants as gguf_quants  # noqa: E402

from qkit.schemes import kernels  # noqa: E402

PROPS = settings(max_examples=30, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FP4 = ("mxfp4", "nvfp4")
BLOCK = {"mxfp4": 32, "nvfp4": 16}
LEVELS = np.array(E2M1_VALUES)


PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])


@contextlib.contextmanager
def path(compiled: bool):
    """The compiled kernels (qkit.schemes.kernels) on or off: the oracle tests run both encoders."""
    old = kernels.set_enabled(compiled)
    try:
        yield
    finally:
        kernels.set_enabled(old)


def codes_of(qt) -> list[int]:
    return unpack_fp4(qt.qweight.reshape(qt.shape[0], -1)).reshape(-1).tolist()


def realish(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights like a trained model's: normal body, heavy-tailed outlier columns, rounded to bf16 (so
    exact E2M1 midpoints, i.e. ties, occur) and read as fp32."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, torch.randint(0, cols, (max(1, cols // 64),), generator=g)] *= 12
    return w.bfloat16().float()


def weight_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    zeros = torch.randn(8, 64, generator=g)
    zeros[0] = 0.0
    zeros[1, :32] = 0.0
    zeros[2] = -0.0
    zeros[3, 5::7] = -0.0
    return [
        ("normal", torch.randn(32, 256, generator=g) * 0.02),
        ("heavy", torch.randn(32, 256, generator=g) / (torch.rand(32, 256, generator=g) + 0.01)),
        ("realish-bf16", realish(48, 320, 1)),
        ("quarter-integers (ties)", torch.randint(-24, 25, (16, 128), generator=g).float() / 4),
        ("sixteenths (ties)", torch.randint(-96, 97, (16, 128), generator=g).float() / 16),
        ("zeros and -0.0", zeros),
        ("tiny", torch.randn(8, 64, generator=g) * 1e-30),
    ]


# --------------------------------------------------------------------------- the registry


def test_registered_with_fixed_scale_formats_and_manifest_round_trip():
    assert {"mxfp4", "nvfp4"} <= set(scheme_names())
    for name, cls in (("mxfp4", MXFP4Scheme), ("nvfp4", NVFP4Scheme)):
        s = get_scheme(name)
        assert isinstance(s, cls) and s.bits == 4 and s.block_size == BLOCK[name]
        assert get_scheme(name, scale_dtype="fp32") is s  # --scale-dtype does not apply: the format fixes it
        assert scheme_from_dict(s.to_dict()) is s
        with pytest.raises(SchemeError, match="does not match"):
            scheme_from_dict({**s.to_dict(), "block_size": 64})
    assert get_scheme("mxfp4").to_dict()["scale_dtype"] == "e8m0"
    assert get_scheme("nvfp4").to_dict() == {"name": "nvfp4", "kind": "fp4", "bits": 4, "element": "e2m1",
                                             "granularity": "block", "block_size": 16, "scale_dtype": "e4m3",
                                             "global_scale": "fp32"}


@pytest.mark.parametrize("name", FP4)
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (3, 64), (2, 4, 32)])
def test_stored_bytes_and_bits_per_weight(name, shape):
    """mxfp4: n/2 + n/32 bytes, exactly 4.25 bits per weight; nvfp4: n/2 + n/16 + 4 bytes, 4.5 + 32/n."""
    s = get_scheme(name)
    qt = quantize_tensor(torch.randn(shape), s, name="w")
    n = math.prod(shape)
    assert qt.nbytes == s.nbytes_for(shape)
    assert qt.bits_per_weight == (4.25 if name == "mxfp4" else 4.5 + 32 / n)
    rows = shape[0]
    assert qt.qweight.dtype == torch.uint8 and tuple(qt.qweight.shape) == (rows, n // rows // 2)
    assert qt.scales.dtype == torch.uint8 and tuple(qt.scales.shape) == (rows, n // rows // BLOCK[name])
    if name == "nvfp4":
        assert qt.extra["global_scale"].dtype == torch.float32 and tuple(qt.extra["global_scale"].shape) == (1,)


# --------------------------------------------------------------------------- hand-computed cases


def test_packing_layout():
    """Column 2j in the low nibble of byte j, 2j + 1 in the high nibble (compressed-tensors' layout)."""
    codes = torch.tensor([[1, 2, 15, 8], [7, 0, 0, 9]])
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x8F], [0x07, 0x90]]
    assert unpack_fp4(packed).tolist() == codes.tolist()


def test_e2m1_rounding_and_ties_both_rules():
    """Every midpoint of the E2M1 grid, both signs, saturation, the subnormal 0.5 and signed zeros."""
    y = torch.tensor([[0.0, -0.0, 0.25, -0.25, 0.2500001, 0.5, 0.75, -0.75, 1.0, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0,
                       6.0, 7.0, -7.0, 1e9, -0.1, 0.3, 2.9, 4.9, 5.1]])
    # gguf (MXFP4): ties to the smaller magnitude, a value rounded to zero is +0
    assert e2m1_codes(y, ties_to_even=False).tolist() == [[0, 0, 0, 0, 1, 1, 1, 9, 2, 2, 3, 4, 5, 6, 14,
                                                            7, 7, 15, 7, 0, 1, 5, 6, 7]]
    # compressed-tensors (NVFP4): ties to even, every negative value keeps its sign (-0 is code 8)
    assert e2m1_codes(y, ties_to_even=True).tolist() == [[0, 8, 0, 8, 1, 1, 2, 10, 2, 2, 4, 4, 6, 6, 14,
                                                           7, 7, 15, 7, 8, 1, 5, 6, 7]]


def test_mxfp4_hand_computed_block():
    """amax 7: E = floor(log2 7) - 2 = 0, scale 1, E8M0 byte 127; codes as gguf rounds (ties down, +0)."""
    values = [7.0, 6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.5, 0.2500001, -0.25, -0.3, -0.75, -5.0, -6.5,
              0.0, -0.0, 1.0, 2.9, 4.9, 5.1]
    w = torch.tensor([values + [0.0] * (32 - len(values))])
    qt = quantize_tensor(w, get_scheme("mxfp4"))
    assert qt.scales.tolist() == [[127]]
    assert codes_of(qt)[: len(values)] == [7, 7, 6, 5, 4, 3, 2, 1, 0, 1, 1, 0, 9, 9, 14, 15, 0, 0, 2, 5, 6, 7]
    assert qt.dequantize()[0, : len(values)].tolist() == [6, 6, 4, 3, 2, 1.5, 1, 0.5, 0, 0.5, 0.5, 0, -0.5, -0.5,
                                                          -4, -6, 0, 0, 1, 3, 4, 6]


def test_mxfp4_scales_zero_and_subnormal_blocks():
    w = torch.zeros(1, 128)
    w[0, :32] = 0.1  # log2(0.1) = -3.32: E = -4 - 2 = -6, byte 121, scale 2**-6; 0.1 / 2**-6 = 6.4 -> 6
    w[0, 64] = 2.0**-7  # 0.5 * 2**-6 with a block max of 2**-4 (E = -6): the subnormal E2M1 value 0.5
    w[0, 65] = 2.0**-4
    w[0, 96] = 1e-39  # log2 = -129.6: e = -130 - 2 + 127 < 0, clamped to 0 (gguf's uint8 cast wraps it)
    qt = quantize_tensor(w, get_scheme("mxfp4"))
    assert qt.scales.tolist() == [[121, 0, 121, 0]]  # the all-zero block: byte 0, as gguf writes it
    codes = codes_of(qt)
    assert codes[:32] == [7] * 32 and codes[32:64] == [0] * 32
    assert codes[64:66] == [1, 6]  # 2**-7 / 2**-6 = 0.5 (code 1), 2**-4 / 2**-6 = 4 (code 6)
    out = qt.dequantize()[0]
    assert out[:32].tolist() == [6 * 2.0**-6] * 32 and out[64:66].tolist() == [2.0**-7, 2.0**-4]
    assert out[96].item() == 0.0  # 1e-39 / 2**-127 = 0.17 rounds to 0


def test_mxfp4_exponent_rounds_log2_to_fp32_first_as_gguf():
    """An amax one ulp below 2**10: the exact exponent is 9, but log2 rounded to fp32 is 10.0, so gguf (and
    qkit) take E = 10 - 2 = 8 (byte 135); 1023.9999 / 2**8 = 3.9999998 rounds to 4 (code 6)."""
    a = torch.nextafter(torch.tensor(1024.0), torch.tensor(0.0))
    w = torch.zeros(1, 32)
    w[0, 0] = a
    qt = quantize_tensor(w, get_scheme("mxfp4"))
    assert qt.scales.tolist() == [[135]] and codes_of(qt)[0] == 6
    ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    assert ref[0, 0] == 135 and torch.equal(to_gguf_mxfp4_blocks(qt.qweight, qt.scales), torch.from_numpy(ref))


def test_mxfp4_exponents_equal_numpys_fp32_log2_near_every_power_of_two():
    ks = np.arange(-149, 128)
    base = (2.0 ** ks.astype(np.float64)).astype(np.float32).view(np.int32).astype(np.int64)
    bits = (base[:, None] + np.arange(-70, 71)[None, :]).reshape(-1)
    bits = np.concatenate([bits, np.random.default_rng(0).integers(1, 0x7F800000, 100_000)])
    x = bits[(bits > 0) & (bits < 0x7F800000)].astype(np.int32).view(np.float32)
    with np.errstate(divide="ignore"):
        ref = np.floor(np.log2(x)) - 2 + 127  # what gguf's MXFP4.quantize_blocks computes
    ours = mxfp4_exponents(torch.from_numpy(x.copy())).numpy()
    keep = ref >= 0  # below 2**-125 gguf's uint8 cast wraps; qkit clamps to 0 (module docstring)
    assert np.array_equal(ours[keep], ref[keep]) and (ours[~keep] == 0).all()


def nvfp4_case() -> torch.Tensor:
    """Tensor amax 6, so the global scale is 2688 / 6 = 448 exactly; one block per row of 16."""
    w = torch.zeros(5, 16)
    w[0] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.5, -0.25, -0.1, -0.0, 0.0, -0.75, -5.0, 5.1])
    w[1, :3] = torch.tensor([3.0, 1.25, -0.6])  # absmax 3
    w[2, :2] = torch.tensor([1.0, -1.0])  # absmax 1
    # w[3] stays zero
    w[4, 0] = 6e-5  # a subnormal E4M3 block scale
    return w


def test_nvfp4_hand_computed():
    qt = quantize_tensor(nvfp4_case(), get_scheme("nvfp4"))
    gs = qt.extra["global_scale"]
    assert gs.tolist() == [448.0]
    scales = qt.scales.view(torch.float8_e4m3fn).float()[:, 0]
    # row 0: 448 * (6/6) = 448 (0x7E); row 1: 448 * 0.5 = 224 (0x76); row 2: 448 * fl(1/6) = 74.67 -> 72 (0x69,
    # E4M3 steps of 8 in [64, 128)); row 3: 0 -> 0.125 (0x20, compressed-tensors' eps); row 4: 448 * 1e-5 =
    # 0.00448 -> 2**-8 (0x02, subnormal: steps of 2**-9)
    assert qt.scales[:, 0].tolist() == [0x7E, 0x76, 0x69, 0x20, 0x02]
    assert scales.tolist() == [448.0, 224.0, 72.0, 0.125, 2.0**-8]
    codes = unpack_fp4(qt.qweight)
    # row 0, step s / gs = 1: ties to even, negative values keep the sign bit (-0.25 and -0.1 are -0, code 8),
    # -0.0 is +0 (torch.sign(-0.0) == 0 in compressed-tensors)
    assert codes[0].tolist() == [7, 6, 6, 4, 4, 2, 2, 0, 1, 8, 8, 0, 0, 10, 14, 7]
    # row 1, step 0.5: 3 -> 6 (code 7), 1.25 -> 2.5 -> 2 (tie to even, code 4), -0.6 -> -1.2 -> -1 (code 10)
    assert codes[1, :3].tolist() == [7, 4, 10]
    # row 2, step 72/448 = 0.1607: 1 / 0.1607 = 6.22 saturates to 6 (code 7)
    assert codes[2, :2].tolist() == [7, 15]
    assert codes[3].tolist() == [0] * 16 and codes[4, 0].item() == 7
    out = qt.dequantize()
    step2 = torch.tensor(72.0) / torch.tensor(448.0)
    assert out[0].tolist() == [6, 4, 4, 2, 2, 1, 1, 0, 0.5, 0, 0, 0, 0, -1, -4, 6]
    assert out[1, :3].tolist() == [3.0, 1.0, -0.5]
    assert out[2, :2].tolist() == [(6 * step2).item(), (-6 * step2).item()]
    assert (out[3] == 0).all()


def test_nvfp4_block_scale_that_rounds_above_448_is_clamped():
    """The tensor-max block: fl(fl(2688 / a) * fl(a / 6)) is 448.00003 for a = 3.0417497 (a quarter of random
    maxima do this): clamped to 448, E4M3's largest value (0x7E), as compressed-tensors clamps before the cast."""
    a = torch.tensor(3.0417497158050537)
    gs = 2688.0 / a  # as generate_gparam computes it
    assert (gs * (a / 6.0)).item() > 448.0
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = a, -a / 2
    q, sb, g = quantize_nvfp4(w)
    assert sb.tolist() == [[0x7E]] and g.tolist() == [gs.item()]
    assert unpack_fp4(q)[0, :2].tolist() == [7, 13]  # a / (448 / gs) = 6.0000004 -> 6; -a/2 -> -3 (code 8 + 5)
    ref = reference_nvfp4(w)
    assert torch.equal(q, ref["weight_packed"]) and torch.equal(sb, ref["weight_scale"].view(torch.uint8))


def test_nvfp4_block_scale_saturates_e4m3_with_a_given_global_scale():
    """With a tensor scale 10x the default, gs * a / 6 = 4480 > 448: the block scale saturates at 448 and
    the values saturate at 6 (448 / 4480 = 0.1 per step: 6 / 0.1 = 60 -> 6)."""
    w = nvfp4_case()[:1]
    q, sb, gs = quantize_nvfp4(w, global_scale=torch.tensor([4480.0]))
    assert sb.tolist() == [[0x7E]] and gs.tolist() == [4480.0]
    assert unpack_fp4(q)[0, 0].item() == 7


# --------------------------------------------------------------------------- oracles: gguf (MXFP4)


@PATHS
@pytest.mark.parametrize("case", range(len(weight_cases())), ids=[n for n, _ in weight_cases()])
def test_mxfp4_bit_exact_with_gguf_quantize_and_dequantize(case, compiled):
    _, w = weight_cases()[case]
    with path(compiled):
        qt = quantize_tensor(w, get_scheme("mxfp4"))
    ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    ours = to_gguf_mxfp4_blocks(qt.qweight, qt.scales)
    assert torch.equal(ours, torch.from_numpy(ref).reshape(ours.shape))  # E8M0 bytes and codes, bit for bit
    deq = torch.from_numpy(gguf_quants.dequantize(ref, GGMLQuantizationType.MXFP4).copy())
    assert torch.equal(qt.dequantize().view(torch.int32), deq.view(torch.int32))


@PATHS
@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 4), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-6, 1e-3, 0.02, 1.0, 1e3]), bf16=st.booleans())
def test_mxfp4_bit_exact_with_gguf_random(rows, blocks, seed, scale, bf16, compiled):
    w = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * scale
    if bf16:
        w = w.bfloat16().float()
    with path(compiled):
        qt = quantize_tensor(w, get_scheme("mxfp4"))
    ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    assert torch.equal(to_gguf_mxfp4_blocks(qt.qweight, qt.scales), torch.from_numpy(ref).reshape(rows, -1))


def test_nvfp4_e2m1_times_e4m3_bit_exact_with_ggufs_nvfp4_dequantizer():
    """gguf's NVFP4 block (64 weights: 4 unsigned-E4M3 bytes, then per 16 weights 8 bytes holding weight j
    and j + 8) has no tensor scale: it decodes E2M1 * E4M3, which qkit gives with the global scale set to 1."""
    w = realish(16, 128, 3)
    q, sb, gs = quantize_nvfp4(w)
    rows = w.shape[0]
    codes = unpack_fp4(q).view(rows, -1, 4, 2, 8)  # super block, sub-block, half, element
    qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).to(torch.uint8).reshape(rows, -1, 32)
    blocks = torch.cat((sb.view(rows, -1, 4), qs), dim=2).reshape(rows, -1)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType.NVFP4).copy())
    ours = dequantize_nvfp4(q, sb, torch.tensor([1.0]))
    assert torch.equal(ours, ref)  # values (gguf decodes code 8, -0, as +0)
    assert torch.equal(ours.abs().view(torch.int32), ref.abs().view(torch.int32))


# --------------------------------------------------------------------------- oracles: compressed-tensors (NVFP4)


def reference_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4 path as llm-compressor runs it for a weight (fp32)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    del ct
    rows, cols = w.shape
    gs = generate_gparam(w.min(), w.max()) if global_scale is None else global_scale
    blocks = w.view(rows, cols // 16, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), NVFP4A16["weights"], global_scale=gs)
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    state = {"weight": w.clone(), "weight_scale": scale.clone(), "weight_global_scale": gs.clone()}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    return {**compressed, "scale_fp32": scale, "dense_bf16": NVFP4PackedCompressor.decompress(dict(compressed), scheme)["weight"]}


@PATHS
@pytest.mark.parametrize("case", range(len(weight_cases())), ids=[n for n, _ in weight_cases()])
def test_nvfp4_bit_exact_with_compressed_tensors(case, compiled):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize

    _, w = weight_cases()[case]
    with path(compiled):
        qt = quantize_tensor(w, get_scheme("nvfp4"))
    ref = reference_nvfp4(w)
    assert torch.equal(qt.qweight, ref["weight_packed"])  # codes and packing
    assert torch.equal(qt.scales, ref["weight_scale"].view(torch.uint8))  # E4M3 block scales
    assert torch.equal(qt.extra["global_scale"].view(torch.int32), ref["weight_global_scale"].view(torch.int32))
    # dequantization: the library's fp32 formula, and its own decompressor (bf16) bit for bit
    rows, cols = w.shape
    values = unpack_fp4_from_uint8(ref["weight_packed"], rows, cols, dtype=torch.float32).view(rows, -1, 16)
    dense = _dequantize(values, ref["scale_fp32"].unsqueeze(-1), global_scale=ref["weight_global_scale"]).view(rows, cols)
    assert torch.equal(qt.dequantize(torch.float32).view(torch.int32), dense.view(torch.int32))
    assert torch.equal(qt.dequantize(torch.bfloat16), ref["dense_bf16"])


@PATHS
def test_nvfp4_saturation_with_given_global_scale_matches_compressed_tensors(compiled):
    w = nvfp4_case()
    gs = torch.tensor([4480.0])
    with path(compiled):
        q, sb, _ = quantize_nvfp4(w, global_scale=gs)
    ref = reference_nvfp4(w, global_scale=gs)
    assert torch.equal(q, ref["weight_packed"]) and torch.equal(sb, ref["weight_scale"].view(torch.uint8))


@PATHS
@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 5), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-6, 1e-3, 0.02, 1.0, 1e3]), bf16=st.booleans(), outlier=st.booleans())
def test_nvfp4_bit_exact_with_compressed_tensors_random(rows, blocks, seed, scale, bf16, outlier, compiled):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 16 * blocks, generator=g) * scale
    if outlier:
        w[0, 0] *= 1000.0  # most blocks far below the tensor max: small and subnormal E4M3 scales
    if bf16:
        w = w.bfloat16().float()
    with path(compiled):
        q, sb, gs = quantize_nvfp4(w)
    ref = reference_nvfp4(w)
    assert torch.equal(q, ref["weight_packed"])
    assert torch.equal(sb, ref["weight_scale"].view(torch.uint8))
    assert torch.equal(gs, ref["weight_global_scale"])


# --------------------------------------------------------------------------- registry-wide properties


@st.composite
def block_matrices(draw, block: int) -> torch.Tensor:
    """fp32 ``[rows, k * block]``: normal, uniform, heavy-tailed or quarter-integer bodies at magnitudes
    1e-6 .. 1e3, with zero rows, exact zeros and special values written on top."""
    rows = draw(st.integers(1, 5))
    cols = block * draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "uniform", "heavy", "quarters"]))
    if kind == "normal":
        w = torch.randn(rows, cols, generator=gen)
    elif kind == "uniform":
        w = torch.rand(rows, cols, generator=gen) * 2 - 1
    elif kind == "heavy":
        w = torch.randn(rows, cols, generator=gen) / (torch.rand(rows, cols, generator=gen) + 0.01)
    else:
        w = torch.randint(-24, 25, (rows, cols), generator=gen).float() / 4
    w *= 10.0 ** draw(st.sampled_from([-6, -3, -1, 0, 1, 3]))
    if draw(st.booleans()):
        w[torch.rand(rows, cols, generator=gen) < 0.3] = 0.0
    for r in draw(st.lists(st.integers(0, rows - 1), max_size=2)):
        w[r] = 0.0
    for i, v in draw(st.lists(st.tuples(st.integers(0, rows * cols - 1),
                                        st.floats(-1e4, 1e4, allow_nan=False, width=32)), max_size=4)):
        w.view(-1)[i] = v
    return w


def element_steps(qt) -> torch.Tensor:
    """The step each weight's E2M1 value is multiplied by, float64 ``[rows, cols]``, computed here: mxfp4
    ``2**(e - 127)``, nvfp4 ``fl32(E4M3 scale / global scale)`` (compressed-tensors divides first)."""
    rows, cols = qt.shape[0], math.prod(qt.shape[1:])
    b = qt.scheme.block_size
    if qt.scheme.name == "mxfp4":
        step = torch.pow(2.0, qt.scales.double() - 127)
    else:
        step = (qt.scales.view(torch.float8_e4m3fn).float() / qt.extra["global_scale"]).double()
    return step.reshape(rows, -1).repeat_interleave(b, dim=1)[:, :cols]


def nearest_e2m1_ties_down(y: np.ndarray) -> np.ndarray:
    """Independent rounding in float64: the nearest of the 8 magnitudes to |y| (so saturating at 6), a tie
    to the smaller one (the first minimum); signed values."""
    dist = np.abs(np.abs(y)[..., None] - LEVELS)
    return np.sign(y) * LEVELS[np.argmin(dist, axis=-1)]


@pytest.mark.parametrize("name", FP4)
@PROPS
@given(data=st.data(), in_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_shape_dtype_and_error_at_most_half_a_step_of_the_blocks_grid(name, data, in_dtype):
    """Per weight, with ``d`` its block's step and ``y = W / d``: the value is the nearest E2M1 level to
    ``y`` (ties as the scheme's oracle), so ``|W - W_hat| <= d * (half the gap between the two levels
    around |y|)``, or ``d * (|y| - 6)`` where ``|y| > 6`` saturates. mxfp4: ``y`` and ``W_hat`` are exact
    (power-of-two steps). nvfp4: ``y = fl(W / d)`` and ``W_hat = fl(level * d)`` are rounded once each:
    slack ``2**-23 * (|W| + |W_hat|)``, and near a midpoint either neighbour may win."""
    w = data.draw(block_matrices(BLOCK[name])).clamp(-6e4, 6e4).to(in_dtype)  # finite in fp16 too
    qt = quantize_tensor(w, get_scheme(name), name="w")
    out = qt.dequantize()
    assert out.shape == w.shape and out.dtype == in_dtype and torch.isfinite(out).all()
    wf = w.double()
    w_hat = qt.dequantize(torch.float32).double()
    d = element_steps(qt)
    y = (wf / d).numpy()
    j = np.clip(np.searchsorted(LEVELS, np.abs(y), side="right") - 1, 0, 6)
    half_gap = (LEVELS[j + 1] - LEVELS[j]) / 2
    bound = torch.from_numpy(np.maximum(half_gap, np.abs(y) - 6.0)) * d
    if name == "nvfp4":
        bound += 2.0**-23 * (wf.abs() + w_hat.abs())
    err = (wf - w_hat).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    if name == "mxfp4":  # exact arithmetic: the value is exactly gguf's rounding of y
        assert np.array_equal(w_hat.numpy(), nearest_e2m1_ties_down(y) * d.numpy())


@pytest.mark.parametrize("name", FP4)
@PROPS
@given(data=st.data())
def test_scale_selection(name, data):
    """mxfp4: every block's max lands in [4, 8) steps (down to 4 - 2**-20 relative where gguf's fp32 log2
    rounds up to the next power of two), except blocks of zeros and blocks whose max is below 2**-125
    (hypothesis writes fp32 subnormals into the matrices), which store byte 0; nvfp4: the tensor scale is
    2688 / max|W|."""
    w = data.draw(block_matrices(BLOCK[name]))
    qt = quantize_tensor(w, get_scheme(name))
    rows = w.shape[0]
    amax = w.abs().view(rows, -1, BLOCK[name]).amax(-1).double()
    if name == "mxfp4":
        ratio = amax / torch.pow(2.0, qt.scales.double() - 127)
        normal = amax >= 2.0**-125  # below, the exponent would be negative: clamped to byte 0 (module doc)
        assert ((ratio[normal] >= 4 * (1 - 2.0**-20)) & (ratio[normal] < 8)).all()
        assert (qt.scales[~normal] == 0).all() and (ratio[~normal] < 4).all()
    else:
        # a Python number over a tensor, as generate_gparam computes it (torch: reciprocal, then multiply);
        # inf for an all-zero matrix, where compressed-tensors uses 1.0
        expected = 2688.0 / w.abs().max()
        assert qt.extra["global_scale"].item() == (expected.item() if torch.isfinite(expected) else 1.0)


@PROPS
@given(w=block_matrices(32))
def test_mxfp4_requantization_is_exact(w):
    """A block's largest dequantized value is 4 or 6 steps (module doc: the max lands in [4, 8) steps and
    rounds to 4 or 6), so re-quantizing finds the same exponent, and every value is on the grid already."""
    s = get_scheme("mxfp4")
    qt = quantize_tensor(w, s)
    qt2 = quantize_tensor(qt.dequantize(), s)
    assert torch.equal(qt2.qweight, qt.qweight) and torch.equal(qt2.scales, qt.scales)


@PROPS
@given(w=block_matrices(16))
def test_nvfp4_requantization_keeps_the_error_bound(w):
    """Not idempotent, and that is expected: the tensor scale is recomputed from the dequantized tensor's
    max (moved by the FP4 and E4M3 roundings), so every block scale can change. The half-step bound of
    the property above holds for the second pass as for any input (checked there); here: the second pass
    moves no weight by more than that bound of its own grid."""
    s = get_scheme("nvfp4")
    w_hat = quantize_tensor(w, s).dequantize()
    qt2 = quantize_tensor(w_hat, s)
    d = element_steps(qt2)
    w_hat2 = qt2.dequantize().double()
    y = (w_hat.double() / d).abs().numpy()
    j = np.clip(np.searchsorted(LEVELS, y, side="right") - 1, 0, 6)
    bound = torch.from_numpy(np.maximum((LEVELS[j + 1] - LEVELS[j]) / 2, y - 6.0)) * d
    bound += 2.0**-23 * (w_hat.double().abs() + w_hat2.abs())
    assert ((w_hat.double() - w_hat2).abs() <= bound).all()


@pytest.mark.parametrize("name", FP4)
@PROPS
@given(data=st.data())
def test_zeros_give_exact_zeros_and_no_nan(name, data):
    """A zero weight decodes to 0 (+0 or nvfp4's -0 of a small negative: equal to 0); an all-zero matrix
    stores E8M0 byte 0 (mxfp4, as gguf) or E4M3 0.125 (nvfp4: compressed-tensors replaces a zero block
    scale by E4M3's "eps", 0x20) and a tensor scale of 1.0, and decodes to zeros."""
    w = data.draw(block_matrices(BLOCK[name]))
    s = get_scheme(name)
    w_hat = quantize_tensor(w, s).dequantize()
    assert not torch.isnan(w_hat).any() and (w_hat[w == 0] == 0).all()
    z = quantize_tensor(torch.zeros_like(w), s)
    assert (z.scales == (0 if name == "mxfp4" else 0x20)).all()
    assert torch.equal(z.dequantize(), torch.zeros_like(w))
    if name == "nvfp4":
        assert z.extra["global_scale"].tolist() == [1.0]


@pytest.mark.parametrize("name", FP4)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 4), c=st.floats(1e-3, 1e4).flatmap(lambda v: st.sampled_from([v, -v])))
@PROPS
def test_constant_rows(name, rows, blocks, c):
    """mxfp4: every block of constant ``c`` has the same exponent and code, ``|c|`` in [4, 8) steps -> 4 or 6
    steps. nvfp4: every block is a tensor-max block, step ``fl(e4m3(448.0...) / gs)``, so the value is 6 steps
    (``c`` is 6 steps up to the roundings: ties cannot occur near 6)."""
    s = get_scheme(name)
    w = torch.full((rows, BLOCK[name] * blocks), c)
    qt = quantize_tensor(w, s)
    out = qt.dequantize()
    assert (out == out.view(-1)[0]).all() and math.copysign(1, out.view(-1)[0].item()) == math.copysign(1, c)
    codes = set(unpack_fp4(qt.qweight).reshape(-1).tolist())
    assert len(codes) == 1 and (codes.pop() & 7) in ((6, 7) if name == "mxfp4" else (7,))


@pytest.mark.parametrize("name", FP4)
def test_deterministic_and_thread_independent(name):
    w = realish(1536, 576, 5)
    s = get_scheme(name)
    a = quantize_tensor(w, s)
    b = quantize_tensor(w.t().contiguous().t(), s)  # same values, column-major memory
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        c = quantize_tensor(w, s)
    finally:
        torch.set_num_threads(before)
    for other in (b, c):
        assert all(torch.equal(a.parts[k], other.parts[k]) for k in s.parts)


@pytest.mark.parametrize("name", FP4)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weight_names_the_tensor(name, bad):
    w = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    w[5, 63] = bad
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*NaN or infinite"):
        quantize_tensor(w, get_scheme(name), name="model.layers.3.mlp.up_proj.weight")


@pytest.mark.parametrize(("name", "cols", "needle"), [
    ("mxfp4", 48, "48 = 1.5 x 32): mxfp4 stores blocks of 32 along each row, so the width must be a multiple of 32; "
                  "nvfp4 (blocks of 16) can, or leave it out (qkit quantize --exclude 'layer.w')"),
    ("mxfp4", 50, "multiple of 32; or leave it out (qkit quantize --exclude 'layer.w') or give it another scheme (qkit quantize --keep"),
    ("nvfp4", 40, "40 = 2.5 x 16): nvfp4 stores blocks of 16"),
])
def test_width_not_whole_blocks_is_refused_naming_what_works(name, cols, needle):
    with pytest.raises(SchemeError) as err:
        quantize_tensor(torch.randn(4, cols), get_scheme(name), name="layer.w")
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SchemeError, match="multiple of"):  # encode on its own, without a name
        get_scheme(name).encode(torch.randn(4, cols))


def test_low_precision_inputs_are_read_as_fp32():
    w = realish(8, 64, 9)
    for name in FP4:
        a = quantize_tensor(w, get_scheme(name))
        b = quantize_tensor(w.bfloat16(), get_scheme(name))  # the values are bf16 already: same result
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
        assert b.dequantize().dtype == torch.bfloat16


# --------------------------------------------------------------------------- the write/read path and inspect


def test_checkpoint_round_trip_is_the_in_memory_result(tiny_model_dir, tmp_path):
    """qkit quantize writes NAME.qweight / .scales (/ .global_scale); loading gives exactly the weights the
    in-memory transform (the eval path) dequantizes (nvfp4: q/k/v and gate/up with their fused group's scale)."""
    from conftest import fused_amax
    from safetensors.torch import load_file

    from qkit.api import QuantizeOptions, quantize_model
    from qkit.models import load

    src = load_file(str(tiny_model_dir / "model.safetensors"))
    for name in FP4:
        out = tmp_path / name
        r = quantize_model(tiny_model_dir, output=out, scheme=name, options=QuantizeOptions(device="cpu"))
        assert r.matrices == 14
        model = load(out, device="cpu").model
        params = dict(model.named_parameters())
        stored = {}
        for f in sorted(out.glob("*.safetensors")):
            stored.update(load_file(str(f)))
        for key, w in src.items():
            if key.endswith("proj.weight"):
                assert {k.removeprefix(key + ".") for k in stored if k.startswith(key + ".")} == set(get_scheme(name).parts)
                amax = fused_amax(src, key) if name == "nvfp4" else None
                assert torch.equal(params[key].detach(), quantize_tensor(w, get_scheme(name), tensor_amax=amax).dequantize()), key


def test_inspect_errors_places_fp4_between_int4_groups_and_nf4(tiny_model_dir):
    from qkit.inspect.errors import weight_errors

    r = weight_errors(tiny_model_dir, schemes=["int4-g32", "int4-g16", "nf4", "mxfp4", "nvfp4"])
    means = {s.scheme: s.mean for s in r.summaries()}
    assert {s.scheme: s.bits_per_weight for s in r.summaries()}["mxfp4"] == 4.25
    sentence = r.ratio_sentence()
    assert sentence.startswith("int4: ") and "\n" not in sentence
    for name, peer in (("mxfp4", "int4-g32"), ("nvfp4", "int4-g16")):
        lo, hi = sorted((means[peer], means["nf4"]))
        where = "between" if lo <= means[name] <= hi else "below both" if means[name] < lo else "above both"
        assert f"{name} (E2M1 in blocks of {BLOCK[name]}," in sentence
        assert f"mean error {means[name]:.4g}, {where} " in sentence
        assert f"{peer}'s {means[peer]:.4g}" in sentence and f"nf4's {means['nf4']:.4g}" in sentence
    # without int4 peers of the same block size, the finest int4 scheme present is the comparison
    alone = weight_errors(tiny_model_dir, schemes=["int4-row", "mxfp4"]).ratio_sentence()
    assert alone.startswith("fp4: mxfp4 (E2M1 in blocks of 32, power-of-two scales) mean error ") and "int4-row's" in alone


# --------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model_every_matrix_bits_and_oracles(default_model_dir):
    """All 210 block projections (widths 576 and 1536: whole blocks): mxfp4 exactly 4.25 bits per weight
    (4 + 8/32), nvfp4 exactly 4.5 + 32/n (4 + 8/16, plus one fp32 tensor scale over n weights); the first
    layer's matrices bit-exact against gguf (mxfp4) and compressed-tensors (nvfp4)."""
    from qkit.checkpoint import iter_tensors
    from qkit.transform import is_block_projection

    mx, nv = get_scheme("mxfp4"), get_scheme("nvfp4")
    seen = 0
    for name, t in iter_tensors(default_model_dir):
        if not is_block_projection(name, tuple(t.shape)):
            continue
        w = t.float()
        n = w.numel()
        a, b = quantize_tensor(w, mx, name=name), quantize_tensor(w, nv, name=name)
        assert a.bits_per_weight == 4.25 and 8 * a.nbytes == 4.25 * n
        assert b.bits_per_weight == 4.5 + 32 / n and 8 * b.nbytes == 4.5 * n + 32
        if ".layers.0." in name:
            ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
            assert torch.equal(to_gguf_mxfp4_blocks(a.qweight, a.scales), torch.from_numpy(ref)), name
            r = reference_nvfp4(w)
            assert torch.equal(b.qweight, r["weight_packed"]) and torch.equal(b.scales, r["weight_scale"].view(torch.uint8))
        seen += 1
    assert seen == 210


@pytest.mark.parametrize("ties_to_even", [False, True])
def test_lookup_rounding_equals_the_integer_rounding_on_every_bucket_edge(ties_to_even):
    """The table lookup (``e2m1_pack``) against the integer rounding it replaces (``e2m1_pack_arith``):
    every bucket start of the top 11 bits and its neighbours one and two ulps away, both signs, signed
    zeros and subnormals, plus a million random finite bit patterns (any magnitude: saturation included)."""
    starts = torch.arange(2048, dtype=torch.int64) << 21
    edges = torch.cat([starts + d for d in (-2, -1, 0, 1, 2)]).remainder(2**32)
    edges = torch.where(edges >= 2**31, edges - 2**32, edges).to(torch.int32)
    g = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    y = torch.cat([edges, random_bits]).view(torch.float32)
    y = torch.cat([y[torch.isfinite(y)], torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149)])])
    y = y[: y.numel() // 2 * 2].reshape(1, -1).contiguous()
    assert (y == 0.25).any() and (y == -0.75).any() and (y == 5.0).any()  # the ties are in the sample
    fast = e2m1_pack(y, torch.empty(1, y.shape[1] // 2, dtype=torch.uint8), ties_to_even=ties_to_even)
    slow = e2m1_pack_arith(y, torch.empty(1, y.shape[1] // 2, dtype=torch.uint8), ties_to_even=ties_to_even)
    assert torch.equal(fast, slow)
