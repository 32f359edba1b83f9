"""Nibble packing: the byte layout (golden), exact round trips, padding, and the unpack of any length."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkit.schemes.packing import pack_nibbles, unpack_nibbles


def test_byte_layout_first_code_in_the_high_nibble():
    codes = torch.tensor([1, 2, 3, 4, 15, 0, 0, 15], dtype=torch.uint8)
    # (1 << 4) | 2 = 0x12, 0x34, (15 << 4) | 0 = 0xF0, 0x0F
    assert pack_nibbles(codes).tolist() == [0x12, 0x34, 0xF0, 0x0F]


def test_odd_count_is_padded_with_the_pad_code():
    codes = torch.tensor([10, 11, 12], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [0xAB, 0xC0]
    assert pack_nibbles(codes, pad=7).tolist() == [0xAB, 0xC7]
    assert unpack_nibbles(pack_nibbles(codes, pad=7), 3).tolist() == [10, 11, 12]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64])
def test_any_integer_dtype_and_shape_packs_the_flattened_codes(dtype):
    codes = torch.arange(16, dtype=dtype).reshape(2, 2, 4)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8,)
    assert packed.tolist() == [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=300), st.integers(0, 15))
def test_round_trip_is_exact(codes, pad):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_nibbles(t, pad=pad)
    assert packed.shape == ((len(codes) + 1) // 2,)
    out = unpack_nibbles(packed, len(codes))
    assert out.dtype == torch.uint8 and out.tolist() == codes
    # independent oracle: the same bytes computed one pair at a time in Python
    padded = codes + [pad] * (len(codes) % 2)
    assert packed.tolist() == [(padded[i] << 4) | padded[i + 1] for i in range(0, len(padded), 2)]


def test_unpack_reads_a_packed_view_of_any_shape():
    packed = torch.tensor([[0x12], [0x34]], dtype=torch.uint8)  # bitsandbytes stores [n/2, 1]
    assert unpack_nibbles(packed, 4).tolist() == [1, 2, 3, 4]
    assert unpack_nibbles(packed, 3).tolist() == [1, 2, 3]
