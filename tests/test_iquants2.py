"""llama.cpp's iq2_xxs, iq2_xs, iq2_s, iq1_s and iq1_m, with an importance matrix (iq2_s and iq1_m without one too).

Oracles: the built llama.cpp reference library (``ggml_quantize_chunk``; skipped where ``python
benchmarks/build_llama_ref.py`` has not built it; ``tests/test_golden_ggml_reference.py`` holds its bytes'
digests for the same seeded inputs, so CI checks them without it), ``gguf.quants.dequantize`` for the
decoders, and llama.cpp's own ``kgrid_2bit_256`` / ``_512`` / ``_1024`` / ``kgrid_1bit_2048`` read out of the pinned source where
it is in the qkit cache (the grids qkit takes from the gguf package must be those).
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
from qkit.schemes import iquants1, iquants2

T = gguf.GGMLQuantizationType
TYPES = {"iq2_xxs": T.IQ2_XXS, "iq2_xs": T.IQ2_XS, "iq2_s": T.IQ2_S, "iq1_s": T.IQ1_S, "iq1_m": T.IQ1_M}
UNWEIGHTED = ("iq2_s", "iq1_m")  # the others' C asserts an importance matrix
# per type: its grid's name in ggml-quants.c, nwant, bits per weight, the bound on the relative RMS error of
# normal weights (a code, not noise)
FACTS = {"iq2_xxs": ("kgrid_2bit_256", 2, 2.0625, 0.55), "iq2_xs": ("kgrid_2bit_512", 2, 2.3125, 0.45),
         "iq2_s": ("kgrid_2bit_1024", 1, 2.5625, 0.4), "iq1_s": ("kgrid_1bit_2048", 3, 1.5625, 0.7),
         "iq1_m": ("kgrid_1bit_2048", 3, 1.75, 0.7)}


def grid_tables(name: str):
    return iquants1.grid_tables() if name.startswith("iq1") else iquants2.grid_tables(TYPES[name])
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
        for imat in iq.IMATRICES if name in UNWEIGHTED else iq.IMATRICES[1:]:
            x, qw = iq.matrix(kind, 12, 1024, seed=iq.KINDS.index(kind)), iq.imatrix(imat, 1024, seed=3)
            assert np.array_equal(encode(name, x, qw), ref.quantize(x, TYPES[name], qw)), (kind, imat)


@pytest.mark.parametrize("name", TYPES)
def test_decoder_equals_gguf_dequantize(name):
    for kind in ("mixed_scales", "normal"):
        x, qw = iq.matrix(kind, 6, 512, seed=1), iq.imatrix("positive", 512, seed=2)
        b = encode(name, x, qw)
        got = get_scheme(name).decode({"qweight": torch.from_numpy(b), "scales": torch.empty(0, dtype=torch.float16)},
                                      x.shape, torch.float32).numpy()
        assert np.array_equal(got, gguf.quants.dequantize(b, TYPES[name]))
    rel = np.sqrt(((got - x) ** 2).mean() / (x**2).mean())  # normal weights: a 2-bit code, not noise
    assert rel < FACTS[name][3], rel


@pytest.mark.parametrize("name", TYPES)
def test_grid_is_llama_cpps_kgrid(name):
    """The grid read from the gguf package, as ``l`` codes, is ``kgrid_2bit_*`` / ``kgrid_1bit_2048`` of the
    pinned source, and the neighbour lists are ``iq2xs_init_impl``'s: every reachable code off the grid lists
    the points at the ``nwant`` (2, 2, 1, 3, 3) smallest distances, sorted by distance then index."""
    if not SOURCE.is_file():
        pytest.skip(f"llama.cpp's source is not in the qkit cache ({SOURCE})")
    grid, kmap, neighbours, _ = grid_tables(name)
    size, (table, nwant, _, _) = len(grid), FACTS[name]
    body = re.search(rf"{table}\[\w+\] = \{{(.*?)\}};", SOURCE.read_text(), re.S).group(1)
    kgrid = np.array([int(v) for v in body.replace("\n", " ").split(",") if v.strip()])
    l = (grid.astype(np.int64) - 1) // 2  # noqa: E741
    assert np.array_equal((l << (2 * np.arange(8))).sum(axis=1), kgrid)
    assert np.array_equal(kmap[kgrid], np.arange(size))
    code = int(np.flatnonzero(kmap < -1)[7])  # one code off the grid, checked by brute force
    pos = 2 * ((code >> (2 * np.arange(8))) & 3) + 1
    d2 = ((grid.astype(np.int64) - pos) ** 2).sum(axis=1)
    want = [g for dist in np.unique(d2)[:nwant] for g in np.flatnonzero(d2 == dist)]
    at = -kmap[code] - 1
    assert list(neighbours[at + 1:at + 1 + neighbours[at]]) == want


@pytest.mark.parametrize("name", [n for n in TYPES if n not in UNWEIGHTED])
def test_refused_without_an_importance_matrix(name):
    with pytest.raises(SchemeError, match="needs an importance matrix") as exc:
        quantize_tensor(torch.from_numpy(iq.matrix("normal", 2, 256, seed=0)), get_scheme(name), name="w")
    assert "\n" not in str(exc.value)


def test_an_all_zero_super_block_is_zero_bytes_and_a_zero_block_keeps_its_place():
    """A super-block of zeros is all zero bytes (``d = 0``); IQ2_S writes the codes of the blocks after a zero
    block at their own places (no pointer shift as in IQ3_S): the zero block's indices, signs, high bits and
    scale are 0, and the rest still decodes to the weights. Grid point 0 is ``(8, ..., 8)``, not zeros, so
    the zero block decodes to ``d * 0.5 * 0.25 * 8 = d`` (as llama.cpp's and gguf's decoders give it)."""
    x, qw = iq.matrix("normal", 2, 256, seed=4), iq.imatrix("positive", 256, seed=1)
    x[0] = 0.0
    x[1, :16] = 0.0
    for name in TYPES:
        b = encode(name, x, qw)
        assert not b[0].any()
    b = encode("iq2_s", x, qw)[1]
    assert not b[2:4].any() and not b[34:36].any() and b[66] & 0x0F == 0 and b[74] & 0x0F == 0
    got = gguf.quants.dequantize(b[None], T.IQ2_S)[0]
    d = np.float32(b[:2].view(np.float16)[0])
    assert np.array_equal(got[:16], np.full(16, d)) and np.sqrt(((got - x[1]) ** 2).mean() / (x[1] ** 2).mean()) < 0.4


@pytest.mark.parametrize("name", TYPES)
def test_registered_sizes_fallback_refusals_and_no_gptq(name):
    s = get_scheme(name)
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    assert s.nbytes_for((3, 512)) == 3 * 2 * size
    assert s.bits_per_weight == FACTS[name][2]
    assert s.resolve((4, 96)).name == "iq4_nl"  # tensor_type_fallback
    bad = torch.from_numpy(iq.matrix("normal", 2, 256, seed=0))
    bad[1, 9] = float("inf")
    with pytest.raises(NonFiniteWeightError, match="w7"):
        quantize_tensor(bad, s, name="w7", quant_weights=torch.ones(256))
    with pytest.raises(SchemeError, match="GPTQ cannot choose the codes"):
        get_method("gptq").check(s)


def test_quantize_refuses_iq2_xxs_without_a_matrix_before_writing(wide_model, tmp_path):
    """``qkit quantize -s iq2_xxs`` with no importance matrix: one line from ``compile_choice``, nothing written
    (llama.cpp's quantizer would abort on the first tensor)."""
    from qkit.api import quantize_model
    from qkit.errors import InputError

    with pytest.raises(InputError, match=r"would be iq2_xxs, which llama.cpp quantizes only with an importance matrix.*"
                                         r"give --imatrix FILE or --method imatrix, or choose iq2_s$") as exc:
        quantize_model(wide_model, output=tmp_path / "out", scheme="iq2_xxs")
    assert "\n" not in str(exc.value) and not (tmp_path / "out").exists()
