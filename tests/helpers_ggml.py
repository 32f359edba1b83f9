"""Inputs shared by the tests of llama.cpp's block formats (no tests here): the 32-element types and their
edge cases (``tests/test_schemes_ggml.py``), the k-quant tables and llama.cpp's recorded bytes
(``tests/golden/kquants.json``, ``tests/test_schemes_kquants.py``), and the seeded edge matrices the
kernel-against-torch properties draw (``tests/test_schemes_kernels.py``, ``tests/test_kquants_*.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1}


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    f = np.float32
    heavy = rng.standard_normal((16, 256)) / (rng.random((16, 256)) + 0.01)
    ints = rng.integers(-8, 9, (16, 256)).astype(f)
    halves = (rng.integers(-40, 41, (16, 256)) / 2).astype(f)
    # Ties: a block whose extreme fixes d = 1 (q8_0: 127; q4_0: -8; q5_0: -16) and whose other values
    # are exactly on the rounding boundaries x/d + offset = k + 1/2 or on integers.
    tie = np.tile((np.arange(32) - 15.5).astype(f), (4, 1))
    tie[0, 0], tie[1, 0], tie[2, 0], tie[3, 0] = 127, -8, -16, 31
    return {
        "normal": rng.standard_normal((32, 512)).astype(f),
        "weight_like": (rng.standard_normal((32, 576)) * 0.02).astype(f),
        "heavy_tailed": heavy.astype(f),
        "small_integers": ints,
        "halves": halves,
        "ties": tie,
        "positive": rng.random((8, 256)).astype(f),
        "constant_rows": np.repeat(np.array([[3.0], [-2.5], [1e-3], [0.0]], f), 64, axis=1),
        "all_zero": np.zeros((4, 256), f),
        "sparse": np.where(rng.random((16, 256)) < 0.7, 0.0, rng.standard_normal((16, 256))).astype(f),
        "large": (rng.standard_normal((8, 256)) * 4e3).astype(f),
        "tiny_normal": (rng.standard_normal((8, 256)) * 1e-30).astype(f),
        # subnormal weights (fp16 scales underflow to 0): the gguf package and C agree on these
        "subnormal_2e-130": (rng.standard_normal((8, 256)) * 2.0**-130).astype(f),
        "subnormal_2e-145": (rng.standard_normal((8, 256)) * 2.0**-145).astype(f),
        "subnormal_ulps": (rng.integers(-3, 4, (8, 256)) * 2.0**-149).astype(f),
    }


CASES = cases()


K_TYPES = {"q4_k": T.Q4_K, "q6_k": T.Q6_K}
ALL_TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, **K_TYPES}
NAME_OF = {t.name: n for n, t in ALL_TYPES.items()}
GOLDEN = json.loads((Path(__file__).parent / "golden" / "kquants.json").read_text())


def edge_matrix(seed: int, scale_exp: int, zeros: float, kind: int, rows: int, blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 256 * blocks, generator=gen)
    if kind == 1:  # small integers and halves: rounding ties everywhere
        w = torch.randint(-16, 17, w.shape, generator=gen).float() / 2
    elif kind == 2:  # heavy tails
        w = w / (torch.rand(w.shape, generator=gen) + 0.01)
    elif kind == 3:  # +a and -a both the block's extreme (q4_0 / q5_0 / q6_k take the first)
        w = torch.randint(-3, 4, w.shape, generator=gen).float()
    w = w * torch.tensor(2.0**scale_exp)
    mask = torch.rand(w.shape, generator=gen)
    w[mask < zeros] = 0.0
    w[mask < zeros / 2] = -0.0
    return w
