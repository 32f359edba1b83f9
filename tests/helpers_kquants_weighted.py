"""The seeded inputs of ``tests/test_kquants_weighted.py`` (q4_k / q5_k / q6_k with and without an importance
matrix), drawn by the same generators in ``tests/test_golden_ggml_reference.py``. No tests here."""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
K_TYPES = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}


def matrix(kind: str, rows: int = 6, cols: int = 1024, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols))
    if kind == "heavy_tailed":
        x = x / (rng.random(x.shape) + 0.01)
    elif kind == "all_zero":
        x = np.zeros((rows, cols))
    elif kind == "ties":  # small integers and halves: rounding ties everywhere
        x = rng.integers(-16, 17, x.shape) / 2
    elif kind == "sparse":
        x = np.where(rng.random(x.shape) < 0.9, 0.0, x)
    elif kind == "one_outlier":
        x = x * 0.01
        x[rows // 2, cols // 3] = 40.0
    elif kind == "negative_rows":  # every sub-block below zero: min < 0 = max never holds
        x = -np.abs(x) - 1.0
    elif kind == "constant":
        x = np.full((rows, cols), -0.75)
    return (x * 0.05).astype(np.float32)


def importance(kind: str | None, cols: int, seed: int = 1) -> np.ndarray | None:
    if kind is None:
        return None
    rng = np.random.default_rng(seed)
    qw = (rng.random(cols) * 2.0 + 1e-3).astype(np.float32)
    if kind == "zeros":  # scattered zeros and one whole super-block's worth (its d and dmin come out 0)
        qw[rng.random(cols) < 0.3] = 0.0
        qw[256:512] = 0.0
    elif kind == "heavy":
        qw = (qw ** 4 * 1e3).astype(np.float32)
    return qw


KINDS = ["random", "heavy_tailed", "all_zero", "ties", "sparse", "one_outlier", "negative_rows", "constant"]
IMATRICES = [None, "random", "zeros", "heavy"]
