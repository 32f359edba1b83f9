"""llama.cpp's ternary types tq1_0 and tq2_0.

Oracles: ``gguf.quants.quantize`` / ``dequantize`` (the gguf package's transcription of
``quantize_row_tq1_0_ref`` / ``tq2_0_ref``), the built llama.cpp reference library (``ggml_quantize_chunk``;
skipped where ``python benchmarks/build_llama_ref.py`` has not built it), and blocks worked out by hand.
llama-quantize's whole TQ1_0 file is compared in ``tests/test_golden_requantize.py``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.tquants import tq1_trits, tq2_trits

T = gguf.GGMLQuantizationType
TYPES = {"tq1_0": T.TQ1_0, "tq2_0": T.TQ2_0}


def matrix(seed: int) -> np.ndarray:
    """8 x 512 fp32 rows that reach every rounding case: ties at +-0.5 of the scale, zeros, a block of zeros,
    a negative extreme, magnitudes from 1e-3 to 1e3, and blocks below fp32's normal range (1/d overflows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 512)) * 10.0 ** rng.uniform(-3, 3, (8, 1))
    x[0, :256] = rng.integers(-4, 5, 256) / 8  # d = 0.5: every x/d a multiple of 1/4, ties at +-1/2
    x[0, 7] = 0.5
    x[1, 256:] = 0.0
    x[2] = np.where(rng.random(512) < 0.4, 0.0, x[2])
    x[3, :256] = -np.abs(x[3, :256])
    x[4] *= 1e-38 / np.abs(x[4]).max()  # d subnormal, 1/d finite
    x[5] *= 1e-40 / np.abs(x[5]).max()  # 1/d overflows: every trit 0 (x86-64's lroundf of inf and NaN)
    return x.astype(np.float32)


def blocks(name: str, x: np.ndarray, **kw) -> np.ndarray:
    return get_scheme(name).encode(torch.from_numpy(x), **kw)["qweight"].numpy()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's 1/d overflows in the 1e-40 row, as the C does
def test_bit_exact_with_gguf_quantize_and_dequantize(name, seed):
    x = matrix(seed)
    got = blocks(name, x)
    want = gguf.quants.quantize(x, TYPES[name])
    assert got.shape == want.shape and np.array_equal(got, want)
    decoded = get_scheme(name).decode({"qweight": torch.from_numpy(got), "scales": torch.empty(0, dtype=torch.float16)},
                                      x.shape, torch.float32)
    assert np.array_equal(decoded.numpy(), gguf.quants.dequantize(want, TYPES[name]))


@pytest.mark.parametrize("name", TYPES)
def test_bit_exact_with_the_built_llama_cpp(name):
    ref = benchmark_module("build_llama_ref").load()
    if ref is None:
        pytest.skip("llama.cpp reference not built: python benchmarks/build_llama_ref.py")
    x = np.concatenate([matrix(2), matrix(3)])
    assert np.array_equal(blocks(name, x), ref.quantize(x, TYPES[name]))


def test_hand_computed_blocks():
    """One super-block: d = 2, x = [2, -1, 0.9, -0.99, 1, 0, ...]: x/d = 1, -0.5, 0.45, -0.495, 0.5 rounds (half away
    from zero) to +1, -1, 0, 0, +1, stored as t + 1 = 2, 0, 1, 1, 2 (the remaining weights 0: 1)."""
    x = np.zeros((1, 256), np.float32)
    x[0, [0, 32, 64, 96, 128]] = [2.0, -1.0, 0.9, -0.99, 1.0]  # byte 0's five trits in tq1_0, bytes 0 and 32 in tq2_0
    q2 = blocks("tq2_0", x)[0]
    # byte m of group g: trits of weights 128 g + m + 32 n in bits 2n
    assert q2[0] == 2 | 0 << 2 | 1 << 4 | 1 << 6 and q2[1] == 0b01010101 and q2[32] == 2 | 1 << 2 | 1 << 4 | 1 << 6
    assert q2[64:66].view(np.float16)[0] == 2.0
    q1 = blocks("tq1_0", x)[0]
    q = 2 * 81 + 0 * 27 + 1 * 9 + 1 * 3 + 2  # the first trit most significant
    assert q1[0] == (q * 256 + 242) // 243 and q1[1] == (121 * 256 + 242) // 243  # 121: five trits of 1
    assert q1[48] == ((40 * 3) * 256 + 242) // 243  # qh: four trits of 1 (40), then "q *= 3"
    assert q1[52:54].view(np.float16)[0] == 2.0
    for name, trits in (("tq1_0", tq1_trits), ("tq2_0", tq2_trits)):
        t = trits(torch.from_numpy(blocks(name, x)))[0]
        assert t[[0, 32, 64, 96, 128]].tolist() == [2, 0, 1, 1, 2] and int((t == 1).sum()) == 256 - 3


@pytest.mark.parametrize("name", TYPES)
def test_registered_sizes_fallback_and_refusals(name):
    s = get_scheme(name)
    size = gguf.GGML_QUANT_SIZES[TYPES[name]][1]
    assert s.ggml_type == TYPES[name] and s.nbytes_for((3, 512)) == 3 * 2 * size and "\n" not in s.description
    assert s.bits_per_weight == {"tq1_0": 1.6875, "tq2_0": 2.0625}[name]
    assert s.resolve((4, 96)).name == "q4_0"  # tensor_type_fallback: whole 32-blocks, not whole 256-blocks
    with pytest.raises(SchemeError, match="width 100") as exc:
        s.resolve((4, 100), "w")
    assert "\n" not in str(exc.value)
    x = torch.from_numpy(matrix(4)[:2])
    bad = x.clone()
    bad[1, 300] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="w3") as exc:
        quantize_tensor(bad, s, name="w3")
    assert "\n" not in str(exc.value)
    with pytest.raises(SchemeError, match="overflows fp16") as exc:
        s.encode(x * 1e6)
    assert "\n" not in str(exc.value)
    # quantize_tq*_0 ignore an importance matrix: the bytes are the unweighted ones
    assert torch.equal(quantize_tensor(x, s, quant_weights=torch.rand(512) + 0.1).qweight, s.encode(x)["qweight"])
