"""llama.cpp's iq3_xxs and iq3_s, with and without an importance matrix.

Oracles: the built llama.cpp reference library (``ggml_quantize_chunk``; skipped where ``python
benchmarks/build_llama_ref.py`` has not built it; ``tests/test_golden_ggml_reference.py`` holds its bytes'
digests for the same seeded inputs, so CI checks them without it), ``gguf.quants.dequantize`` for the
decoders, and llama.cpp's own ``kgrid_256`` / ``kgrid_512`` read out of the pinned source where it is in the
qkit cache (the grids qkit takes from the gguf package must be those).
"""

from __future__ import annotations

import re

import gguf
import helpers_iquants as iq
import numpy as np
import pytest
import torch
from conftest import benchmark_module

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.methods import get_method
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.iquants3 import grid_tables

T = gguf.GGMLQuantizationType
TYPES = {"iq3_xxs": T.IQ3_XXS, "iq3_s": T.IQ3_S}
SOURCE = benchmark_module("build_llama_ref").ref_dir() / "src" / "ggml" / "src" / "ggml-quants.c"


def encode(name: str, x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    kw = {} if qw is None else {"quant_weights": torch.from_numpy(qw)}
    return get_scheme(name).encode(torch.from_numpy(x), **kw)["qweight"].numpy()


@pytest.mark.parametrize("name", TYPES)
def test_bytes_equal_the_built_llama_cpp(name):
    ref = benchmark_module("build_llama_ref").load()
    if ref is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    for kind in iq.KINDS:
        for imat in iq.IMATRICES:
            x, qw = iq.matrix(kind, 12, 1024, seed=iq.KINDS.index(kind)), iq.imatrix(imat, 1024, seed=3)
            assert np.array_equal(encode(name, x, qw), ref.quantize(x, TYPES[name], qw)), (kind, imat)


@pytest.mark.parametrize("name", TYPES)
def test_decoder_equals_gguf_dequantize(name):
    x, qw = iq.matrix("mixed_scales", 6, 512, seed=1), iq.imatrix("positive", 512, seed=2)
    b = encode(name, x, qw)
    got = get_scheme(name).decode({"qweight": torch.from_numpy(b), "scales": torch.empty(0, dtype=torch.float16)},
                                  x.shape, torch.float32).numpy()
    want = gguf.quants.dequantize(b, TYPES[name])
    assert np.array_equal(got, want)
    assert np.abs(got - x).mean() < 0.3 * np.abs(x).mean()  # a 3-bit code, not noise


@pytest.mark.parametrize("name", TYPES)
def test_grid_is_llama_cpps_kgrid(name):
    """The grid read from the gguf package, as ``l`` codes, is ``kgrid_256`` / ``kgrid_512`` of the pinned source."""
    if not SOURCE.is_file():
        pytest.skip(f"llama.cpp's source is not in the qkit cache ({SOURCE})")
    grid, kmap, neighbours, _ = grid_tables(TYPES[name])
    size = len(grid)
    body = re.search(rf"kgrid_{size}\[{size}\] = \{{(.*?)\}};", SOURCE.read_text(), re.S).group(1)
    kgrid = np.array([int(v) for v in body.replace("\n", " ").split(",") if v.strip()])
    l = (grid.astype(np.int64) - 1) // 2  # noqa: E741
    assert np.array_equal((l << np.array([0, 3, 6, 9])).sum(axis=1), kgrid)
    assert np.array_equal(kmap[kgrid], np.arange(size)) and (kmap < 0).sum() == 4096 - size
    # every point off the grid lists its neighbours at the 2 (xxs) / 3 (s) smallest distances, nearest first
    at = -kmap[kmap < 0][0] - 1
    count = neighbours[at]
    assert count >= 1 and neighbours[at + 1:at + 1 + count].max() < size


def test_an_all_zero_block_moves_iq3_s_later_blocks_as_llama_cpp_does():
    """IQ3_S's qs/signs pointers advance only for blocks it codes: after an all-zero block of 32 the later
    blocks' grid indices and signs sit one block early (llama.cpp's bytes); their qh bits stay in place.
    Without an importance matrix a block's codes depend on its own weights only, so they can be compared."""
    x = iq.matrix("normal", 1, 256, seed=4)
    a = encode("iq3_s", x)[0]
    x[0, :32] = 0.0
    b = encode("iq3_s", x)[0]
    assert np.array_equal(b[2:58], a[10:66]) and not b[58:66].any()  # grid indices of blocks 1..7, then nothing
    assert np.array_equal(b[74:102], a[78:106]) and not b[102:106].any()  # their signs
    assert np.array_equal(b[67:74], a[67:74]) and b[66] == 0  # qh: per block, in place
    assert b[106] & 0x0F == 0  # block 0's 4-bit scale


@pytest.mark.parametrize("name", TYPES)
def test_registered_sizes_fallback_refusals_and_no_gptq(name):
    s = get_scheme(name)
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    assert s.nbytes_for((3, 512)) == 3 * 2 * size and s.bits_per_weight == {"iq3_xxs": 3.0625, "iq3_s": 3.4375}[name]
    assert s.resolve((4, 96)).name == "iq4_nl"  # tensor_type_fallback
    bad = torch.from_numpy(iq.matrix("normal", 2, 256, seed=0))
    bad[1, 9] = float("inf")
    with pytest.raises(NonFiniteWeightError, match="w7") as exc:
        quantize_tensor(bad, s, name="w7")
    assert "\n" not in str(exc.value)
    with pytest.raises(SchemeError, match="GPTQ cannot choose the codes") as exc:
        get_method("gptq").check(s)
    assert "\n" not in str(exc.value)
