"""Golden tests: every scheme on small matrices whose codes, scales and dequantized values are computed
by hand (the working is in the comments), plus the bits-per-weight figures of the quality table.

fp16 values used below (10 fraction bits, round to nearest even):
  1/127 = 2**-7 * 1.007874..; 0.007874 * 1024 = 8.06 -> 8   -> fp16 2**-7 * (1 + 8/1024)  = 129/16384
  0.1   = 2**-4 * 1.6;        0.6 * 1024 = 614.4 -> 614       -> fp16 2**-4 * 1638/1024    = 0.0999755859375
  0.2   = 2**-3 * 1.6                                         -> fp16 2**-3 * 1638/1024    = 0.199951171875
  0.3/7 = 0.0428571 = 2**-5 * 1.371428; 0.371428 * 1024 = 380.3 -> 380 -> 2**-5 * 1404/1024 = 0.0428466796875
"""

from __future__ import annotations

import pytest
import torch

from qkit.granularity import PerGroup, PerRow, PerTensor
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.nf4 import NF4_LEVELS, nf4_tables
from qkit.schemes.packing import unpack_nibbles

S_1_127 = 129 / 16384  # fp16(1/127)
S_01 = 0.0999755859375  # fp16(0.1)
S_02 = 0.199951171875  # fp16(0.2)
S_03_7 = 0.0428466796875  # fp16(0.3/7)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_int8_row_hand_computed():
    w = t([[1.0, -0.5, 0.25, 0.0], [0.0, 127.0, -63.5, 0.5]])
    qt = quantize_tensor(w, get_scheme("int8-row"))
    # Row 0: absmax 1 -> scale fp16(1/127) = 129/16384. w/scale = 16384/129 * w:
    #   1.0 -> 127.008 -> 127;  -0.5 -> -63.504 -> -64;  0.25 -> 31.75 -> 32;  0 -> 0.
    # Row 1: absmax 127 -> scale exactly 1: round half to even: -63.5 -> -64, 0.5 -> 0.
    assert qt.qweight.dtype == torch.int8
    assert qt.qweight.tolist() == [[127, -64, 32, 0], [0, 127, -64, 0]]
    assert qt.scales.dtype == torch.float16 and qt.scales.shape == (2, 1)
    assert qt.scales.float().flatten().tolist() == [S_1_127, 1.0]
    # q * scale: 127*129/16384 = 16383/16384, -64*129/16384 = -0.50390625, 32*129/16384 = 0.251953125.
    assert qt.dequantize().tolist() == [[16383 / 16384, -0.50390625, 0.251953125, 0.0], [0.0, 127.0, -64.0, 0.0]]


def test_int8_tensor_hand_computed():
    w = t([[1.0, -0.5, 0.25, 0.0], [0.0, 127.0, -63.5, 0.5]])
    qt = quantize_tensor(w, get_scheme("int8-tensor"))
    # One absmax, 127 -> scale 1; q = round half to even of w itself: -0.5 -> 0, 0.25 -> 0, 0.5 -> 0.
    assert qt.scales.shape == (1, 1) and qt.scales.item() == 1.0
    assert qt.qweight.tolist() == [[1, 0, 0, 0], [0, 127, -64, 0]]
    assert qt.dequantize().tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 127.0, -64.0, 0.0]]


def test_int4_row_hand_computed_and_packed_layout():
    w = t([[0.7, -0.35, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    qt = quantize_tensor(w, get_scheme("int4-row"))
    # Row 0: absmax 0.7 -> 0.7/7 = 0.1 -> fp16 0.0999755859375. w/scale: 7.0017 -> 7, -3.5009 -> -4,
    # 1.0002 -> 1, 0 -> 0 (qmax = 7, clamp to [-8, 7]). Row 1: zeros -> scale 0, q 0, no NaN.
    assert qt.scales.float().flatten().tolist() == [S_01, 0.0]
    # Stored offset-binary codes q + 8 = [15, 4, 9, 8, 8, 8, 8, 8], two per byte, first in the high nibble.
    assert qt.qweight.dtype == torch.uint8
    assert qt.qweight.tolist() == [0xF4, 0x98, 0x88, 0x88]
    expected = [[7 * S_01, -4 * S_01, S_01, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert qt.dequantize().tolist() == t(expected).tolist()
    # The -0.35 weight is the worst: |-0.35 + 0.39990234375| = 0.0499 <= scale/2 = 0.04999.
    assert (w - qt.dequantize()).abs().max().item() <= S_01 / 2


def test_int4_tensor_hand_computed():
    w = t([[1.4, -0.7], [0.2, 0.0]])
    qt = quantize_tensor(w, get_scheme("int4-tensor"))
    # absmax 1.4 -> 0.2 -> fp16 0.199951171875; w/scale: 7.0017 -> 7, -3.5009 -> -4, 1.0002 -> 1, 0.
    assert qt.scales.float().tolist() == [[S_02]]
    assert qt.qweight.tolist() == [0xF4, 0x98]
    assert qt.dequantize().tolist() == t([[7 * S_02, -4 * S_02], [S_02, 0.0]]).tolist()


def test_group_of_two_short_last_group_never_crosses_rows():
    scheme = get_scheme("int4-g2")
    assert scheme.granularity == PerGroup(2)
    w = t([[0.7, -0.35, 1.4, 0.2, -0.3], [0.0, 0.0, 7.0, -3.5, 0.0]])
    qt = quantize_tensor(w, scheme)
    # Row 0 groups: [0.7, -0.35] scale fp16(0.1); [1.4, 0.2] scale fp16(0.2); the short last group
    # [-0.3] has its own scale fp16(0.3/7) = 0.0428466796875 and -0.3/that = -7.0017 -> -7.
    # Row 1 groups: [0, 0] scale 0; [7, -3.5] scale exactly 1, -3.5 -> -4 (half to even); [0] scale 0.
    # (Groups crossing rows would have paired -0.3 with row 1's first 0.0 instead.)
    assert qt.scales.shape == (2, 3)
    assert qt.scales.float().tolist() == [[S_01, S_02, S_03_7], [0.0, 1.0, 0.0]]
    # q = [7, -4, 7, 1, -7 | 0, 0, 7, -4, 0] -> codes [15, 4, 15, 9, 1, 8, 8, 15, 4, 8]
    assert qt.qweight.tolist() == [0xF4, 0xF9, 0x18, 0x8F, 0x48]
    expected = [[7 * S_01, -4 * S_01, 7 * S_02, S_02, -7 * S_03_7], [0.0, 0.0, 7.0, -4.0, 0.0]]
    assert qt.dequantize().tolist() == t(expected).tolist()
    # 5 bytes of codes + 6 fp16 scales = 17 bytes for 10 weights.
    assert qt.bits_per_weight == pytest.approx(8 * 17 / 10)


def test_int8_group_family_member():
    w = t([[2.54, -1.27, 0.0, 0.0, 1.0]])
    qt = quantize_tensor(w, get_scheme("int8-g4"))
    # Group [2.54, -1.27, 0, 0]: the scale is fp16(2.54/127 = 0.02) = 2**-6 * 1.28 -> 0.28*1024 = 286.72
    # -> 287 -> 0.0200042724609375; 2.54/s = 126.97 -> 127; -1.27/s = -63.49 -> -63.
    # Group [1.0]: scale fp16(1/127) = 129/16384, q = 127.
    s0 = 0.0200042724609375
    assert qt.scales.float().tolist() == [[s0, S_1_127]]
    assert qt.qweight.tolist() == [[127, -63, 0, 0, 127]]
    assert qt.dequantize().tolist() == t([[127 * s0, -63 * s0, 0.0, 0.0, 16383 / 16384]]).tolist()


def test_fp32_scales_are_the_exact_fp32_quotient():
    w = t([[0.7, -0.35, 0.1, 0.0]])
    qt = quantize_tensor(w, get_scheme("int4-row", scale_dtype="fp32"))
    s = t(0.7) / 7  # fp32 0.7 / 7 = 0.099999998...
    assert qt.scales.dtype == torch.float32 and qt.scales.item() == s.item()
    # 0.7/s = 7, -0.35/s = -3.5 exactly in fp32 -> half to even -> -4, 0.1/s = 1.
    assert qt.qweight.tolist() == [0xF4, 0x98]


def test_nf4_levels_and_midpoints_block():
    """One full block of 64 with absmax 2: values on the levels, exactly on the fp32 midpoints (ties
    take the lower level, as bitsandbytes' ``bucketize(right=False)``), and one fp32 step above them."""
    levels, midpoints = nf4_tables()
    above = torch.nextafter(midpoints, torch.full_like(midpoints, 2.0))
    w = torch.cat([levels, midpoints, t([0.0]), above, torch.zeros(17)]) * 2  # exact: times 2
    assert w.numel() == 64
    qt = quantize_tensor(w, get_scheme("nf4", scale_dtype="fp32"))
    # codes: 0..15 | 0..14 (ties down), 7 (zero) | 1..15 (just above), 7 x 17
    assert qt.qweight.tolist() == (
        [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]
        + [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xE7]
        + [0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC, 0xDE, 0xF7]
        + [0x77] * 8
    )
    assert qt.scales.tolist() == [2.0]
    codes = unpack_nibbles(qt.qweight, 64).long()
    assert qt.dequantize().tolist() == (levels[codes] * 2).tolist()
    assert qt.dequantize()[:16].tolist() == [2 * v for v in NF4_LEVELS]


def test_nf4_short_tail_block_hand_computed():
    # n = 4 < 64: one short block, absmax 1. Against the midpoints (-0.6106, -0.4600), ..., (0.2920, 0.3893):
    # 1.0 -> 15; -0.5 lies in (-0.6106, -0.4600] -> 2 (level -0.5251); 0 -> 7; 0.3 in (0.2920, 0.3893] -> 11.
    qt = quantize_tensor(t([1.0, -0.5, 0.0, 0.3]), get_scheme("nf4"))
    assert qt.qweight.tolist() == [0xF2, 0x7B]
    assert qt.scales.dtype == torch.float16 and qt.scales.tolist() == [1.0]
    assert qt.dequantize().tolist() == [1.0, -0.5250730514526367, 0.0, 0.33791524171829224]


def test_nf4_odd_count_pads_with_the_code_of_zero():
    # n = 3: codes [15, 0, 7] + pad. bitsandbytes pads the *scaled* values with 0.0, i.e. code 7.
    qt = quantize_tensor(t([0.5, -0.5, 0.0]), get_scheme("nf4"))
    assert qt.qweight.tolist() == [0xF0, 0x77]
    assert qt.dequantize().tolist() == [0.5, -0.5, 0.0]


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("int4-g128", (576, 576), 4 + 16 * 5 / 576),  # 576 = 4.5 groups -> 5 scales per row: 4.1389
        ("int4-g128", (4, 1536), 4.125),  # 12 full groups per row
        ("int4-g64", (4, 1536), 4.25),
        ("int8-g128", (2, 256), 8.125),
        ("int8-row", (3, 576), 8 + 16 / 576),
        ("int4-row", (3, 576), 4 + 16 / 576),
        ("int8-tensor", (576, 576), 8 + 16 / (576 * 576)),
        ("int4-tensor", (576, 576), 4 + 16 / (576 * 576)),
        ("nf4", (576, 576), 4.25),
        ("nf4", (1536, 576), 4.25),
    ],
)
def test_bits_per_weight(name, shape, expected):
    qt = quantize_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(0)), get_scheme(name))
    assert qt.bits_per_weight == pytest.approx(expected, rel=1e-12)


def test_int4_g128_on_576_wide_rows_prints_as_4_1389():
    qt = quantize_tensor(torch.ones(576, 576), get_scheme("int4-g128"))
    assert round(qt.bits_per_weight, 4) == 4.1389
    assert qt.scales.shape == (576, 5)


def test_fp32_scales_cost_32_bits_each():
    qt = quantize_tensor(torch.ones(576, 576), get_scheme("nf4", scale_dtype="fp32"))
    assert qt.bits_per_weight == pytest.approx(4.5)
    qt = quantize_tensor(torch.ones(3, 576), get_scheme("int8-row", scale_dtype="fp32"))
    assert qt.bits_per_weight == pytest.approx(8 + 32 / 576)


def test_granularity_values_of_the_named_schemes():
    assert get_scheme("int8-tensor").granularity == PerTensor()
    assert get_scheme("int8-row").granularity == PerRow()
    assert get_scheme("int4-g128").granularity == PerGroup(128)
    assert get_scheme("nf4").block_size == 64


def test_higher_rank_and_1d_tensors_keep_their_shape():
    w = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 12
    qt = quantize_tensor(w, get_scheme("int8-row"))
    # As [2, 12]: row 0 = -12..-1 (absmax 12), row 1 = 0..11 (absmax 11).
    assert qt.qweight.shape == (2, 12) and qt.scales.shape == (2, 1)
    assert qt.dequantize().shape == (2, 3, 4)
    qt1 = quantize_tensor(t([0.0, 1.0, -2.0]), get_scheme("int4-g2"))
    assert qt1.scales.shape == (1, 2) and qt1.dequantize().shape == (3,)
