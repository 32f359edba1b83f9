"""The seeded inputs of ``tests/test_kquants_low.py`` (q2_k / q3_k), drawn by the same generators in
``tests/test_golden_ggml_reference.py``. No tests here."""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
TYPES = {"q2_k": (T.Q2_K, 84), "q3_k": (T.Q3_K, 110)}


def matrix(kind: str, rows: int = 8, cols: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols))
    if kind == "heavy":
        x = x / (rng.random(x.shape) + 0.01)
    elif kind == "zeros":
        x = np.zeros_like(x)
    elif kind == "ties":  # small integers and halves: rounding ties in every search
        x = rng.integers(-6, 7, x.shape) / 2
    elif kind == "sparse":
        x = np.where(rng.random(x.shape) < 0.85, 0.0, x)
    elif kind == "outlier":
        x = x * 1e-3
        x[:, 37] = 50.0
    elif kind == "negative":  # all-negative sub-blocks: fitted minimums clamp at 0
        x = -np.abs(x) - 2.0
    elif kind == "tiny":
        x = x * 1e-30
    return x.astype(np.float32)


KINDS = ["random", "heavy", "zeros", "ties", "sparse", "outlier", "negative", "tiny"]


def importance(kind: str, cols: int, seed: int = 1) -> np.ndarray | None:
    rng = np.random.default_rng(seed)
    if kind == "none":
        return None
    qw = rng.random(cols) * 3 + 0.01
    if kind == "zeros":  # columns never seen in calibration, and whole zero super-blocks
        qw = np.where(rng.random(cols) < 0.4, 0.0, qw)
        if cols > 256:
            qw[:256] = 0.0
    return qw.astype(np.float32)


IMATRIX = ["none", "random", "zeros"]
