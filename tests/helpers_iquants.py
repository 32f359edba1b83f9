"""The seeded inputs of ``tests/test_iquants.py`` (iq4_nl / iq4_xs), drawn by the same generators in
``tests/test_golden_ggml_reference.py``. No tests here."""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
TYPES = {"iq4_nl": T.IQ4_NL, "iq4_xs": T.IQ4_XS}
KINDS = ["normal", "heavy", "zero", "small_integers", "halves", "sparse", "outlier", "tiny", "mixed_scales", "signed_zeros"]
IMATRICES = ["none", "positive", "zeros"]


def matrix(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """fp32 ``[rows, cols]`` test rows of one ``kind``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols))
    if kind == "heavy":
        x = x / (rng.random(x.shape) + 0.01)
    elif kind == "zero":
        x = np.zeros_like(x)
    elif kind == "small_integers":  # exact ties between grid points and between candidate scales
        x = rng.integers(-8, 9, x.shape).astype(np.float64)
    elif kind == "halves":
        x = rng.integers(-40, 41, x.shape) / 2
    elif kind == "sparse":
        x = np.where(rng.random(x.shape) < 0.9, 0.0, x)
        x[:1, :] = 0.0
        x[1:2, 32:64] = 0.0
    elif kind == "outlier":
        x[np.arange(rows), rng.integers(0, cols, rows)] *= 300.0
    elif kind == "tiny":  # sub-blocks below GROUP_MAX_EPS, near it, and subnormal
        x = x * np.array([1e-17, 1e-15, 3e-15, 1e-12, 1e-40, 1.0, 1e-30, 2e-15])[np.arange(cols) // 32 % 8]
    elif kind == "mixed_scales":
        x = x * 10.0 ** rng.integers(-6, 4, (rows, 1))
    elif kind == "signed_zeros":
        x = np.where(rng.random(x.shape) < 0.5, -0.0, 0.0)
        x[:, ::37] = 0.25
    return x.astype(np.float32)


def imatrix(kind: str, cols: int, seed: int) -> np.ndarray | None:
    rng = np.random.default_rng(seed + 1)
    if kind == "none":
        return None
    qw = (rng.random(cols) * 2.0) ** 3 + 1e-4
    if kind == "zeros":
        qw[rng.random(cols) < 0.3] = 0.0
        qw[32:64] = 0.0  # a whole block of 32
        qw[256:512] = 0.0  # a whole super-block of 256
    return qw.astype(np.float32)
