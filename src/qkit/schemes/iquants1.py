"""llama.cpp's 1-bit i-quants ``iq1_s`` and ``iq1_m``: groups of 8 weights as one point of a ternary grid.

A super-block of 256 weights is split into blocks of 32 (IQ1_S) or 16 (IQ1_M), and each block into groups
of 8 coded as one of 2048 points of ``{-1, 0, 1}**8`` (llama.cpp's ``kgrid_1bit_2048``), shifted by
``+-0.125`` (``IQ1S_DELTA``: one sign per block of 32 in IQ1_S, per group of 8 in IQ1_M) and scaled by a
3-bit block scale ``2s + 1`` times one fp16 ``d`` per super-block. ``quantize_row_iq1_s_impl`` /
``quantize_row_iq1_m_impl`` (``ggml-quants.c``, commit ``LLAMA_CPP_COMMIT``) search each block exactly: the
weights sorted, every split into the three levels tried with both shifts, the best by ``sumqx**2 /
sumq2`` with ``w = qw * sqrt(sigma2 + x**2)``; a group whose levels are not on the grid takes the nearest
of its neighbours (the points at the 3 smallest distances, ``iq2xs_init_impl``).
:mod:`qkit.schemes._kernels_iq1` lists where the two differ.

==========  ======  ===================================================================  ==============
type        bytes   layout (``block_iq1_s`` / ``block_iq1_m``)                             bits / weight
==========  ======  ===================================================================  ==============
iq1_s       50      ``d: fp16, qs: u8[32]`` (low 8 bits of the indices), ``qh: u16[8]``     1.5625
                    (per block: 3 high bits per group, the 3-bit scale, the shift's sign)
iq1_m       56      ``qs: u8[32], qh: u8[16]`` (3 high bits and the shift's sign per         1.75
                    group), ``scales: u16[4]`` (3 bits per block; ``d``'s fp16 bits in the
                    top nibbles)
==========  ======  ===================================================================  ==============

Dequantization (``dequantize_row_iq1_s`` / ``_m``, ``gguf.quants``): ``d * (2s + 1) * (grid[index][j] +
delta)``, ``delta = -0.125`` where the sign bit is set, else ``0.125``.

**The grid is not copied into qkit**: it is read from the installed ``gguf`` package's decoder grid and the
map and neighbour lists computed as ``iq2xs_init_impl`` does (:func:`qkit.schemes.iquants3.lattice_tables`);
``tests/test_iquants2.py`` checks it against ``kgrid_1bit_2048`` of the pinned source where it is cached.

**An importance matrix is required** for IQ1_S (llama.cpp asserts one), refused without one in one line;
IQ1_M has a path without one (``w = x**2``), which qkit follows. llama-quantize requires a matrix for both.
The search runs in a numba kernel, the C statement for statement; a width that is not whole super-blocks
falls back to ``iq4_nl``. NaN / inf weights are refused (``NonFiniteWeightError``).

Speed (one 1536 x 1536 random matrix with an importance vector, one thread, median of 3, ``python
benchmarks/bench_grid.py``, a shared 2-core Intel Xeon with AVX-512): iq1_s 0.46 s, iq1_m 0.47 s;
llama.cpp's ``ggml_quantize_chunk`` 0.34 s, 0.32 s (docs/gguf.md, "IQ2 and IQ1").
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import torch

from qkit.errors import SchemeError
from qkit.schemes.ggml import T, register_codec
from qkit.schemes.ggml_blocks import read_fp16
from qkit.schemes.iquants import IQ4_NL
from qkit.schemes.iquants2 import ImportanceGridScheme
from qkit.schemes.iquants3 import GridScheme, grid_levels, lattice_tables, numba_module, search_encoder
from qkit.schemes.kquants import QK_K
from qkit.schemes.registry import register

SIZES = {T.IQ1_S: 50, T.IQ1_M: 56}  # sizeof(block_iq1_s), sizeof(block_iq1_m)
DELTA = 0.125  # IQ1S_DELTA, IQ1M_DELTA


@functools.cache
def grid_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(grid, kmap, neighbours, values)`` of ``iq2xs_init_impl`` for IQ1_S / IQ1_M (one grid, nwant 3; levels
    0..2 reachable) and ``values`` fp32 ``[2048, 8]`` the decoder's grid (``-1, 0, 1``)."""
    l, values = grid_levels(gguf.quants.IQ1_S)
    return (*lattice_tables(l, 2, 3, 2), values)


def _weighted(t: T):
    def kernel():
        run = numba_module("_kernels_iq1", "iq1_s and iq1_m").run_iq1
        return lambda x, qw, cols, *rest: run(x, qw, cols, t == T.IQ1_M, *rest)

    return search_encoder(t, SIZES[t], grid_tables, kernel)


def _unweighted(t: T):
    weighted = _weighted(t)

    def encode(x: torch.Tensor) -> torch.Tensor:
        """fp32 blocks ``[nb, 256]`` -> block bytes: IQ1_M's path without an importance matrix; IQ1_S refuses."""
        if t == T.IQ1_S:
            raise SchemeError("iq1_s needs an importance matrix (llama.cpp's quantizer asserts one); "
                              "quantize with --method imatrix or give one, or choose iq1_m")
        return weighted(x.reshape(-1, QK_K))

    return encode


def _levels(b: torch.Tensor, index: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """``grid[index] + delta``: fp32 ``[..., 8]`` from 11-bit indices and the sign bits (-delta where set)."""
    values = torch.from_numpy(grid_tables()[3]).to(b.device)
    return values[index] + torch.where(sign != 0, -DELTA, DELTA).to(torch.float32).unsqueeze(-1)


def decode_iq1_s(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    qh = b[:, 34:50].contiguous().view(torch.int16).long() & 0xFFFF  # [nb, 8]
    dl = read_fp16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()  # [nb, 8]
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7  # [nb, 8, 4]
    index = b[:, 2:34].long().view(nb, 8, 4) | (high << 8)
    sign = (qh & 0x8000).unsqueeze(-1).expand(nb, 8, 4)
    return (dl.view(nb, 8, 1, 1) * _levels(b, index, sign)).reshape(nb, QK_K)


def decode_iq1_m(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc = b[:, 48:56].contiguous().view(torch.int16).long() & 0xFFFF  # [nb, 4]
    bits = ((sc[:, 0] >> 12) & 0xF) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = bits.to(torch.int16).view(torch.float16).float()  # [nb]
    s = ((sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7).view(nb, 16)
    dl = d.unsqueeze(1) * (2 * s + 1).float()  # [nb, 16]
    nib = (b[:, 32:48].long().unsqueeze(-1) >> torch.tensor([0, 4], device=b.device)) & 15  # [nb, 16, 2]
    index = b[:, :32].long().view(nb, 16, 2) | ((nib & 7) << 8)
    return (dl.view(nb, 16, 1, 1) * _levels(b, index, nib & 8)).reshape(nb, QK_K)


for _t, _decode in ((T.IQ1_S, decode_iq1_s), (T.IQ1_M, decode_iq1_m)):
    register_codec(_t, _unweighted(_t), _decode, weighted=_weighted(_t))

IQ1_S = register(ImportanceGridScheme(
    "iq1_s", T.IQ1_S, 1, fallback=IQ4_NL,
    description="llama.cpp IQ1_S: groups of 8 weights as one of 2048 ternary grid points, 3-bit block scales; needs an imatrix",
))
IQ1_M = register(GridScheme(
    "iq1_m", T.IQ1_M, 1, fallback=IQ4_NL,
    description="llama.cpp IQ1_M: groups of 8 weights as one of 2048 ternary grid points, a shift per group, 3-bit scales",
))

__all__ = ["DELTA", "IQ1_M", "IQ1_S", "SIZES", "decode_iq1_m", "decode_iq1_s", "grid_tables"]
