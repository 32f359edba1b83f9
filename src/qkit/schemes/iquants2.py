"""llama.cpp's 2-bit i-quants ``iq2_xxs``, ``iq2_xs`` and ``iq2_s``: groups of 8 weights as one point of a grid.

A super-block of 256 weights is split into blocks of 32 (IQ2_XXS) or 16 (IQ2_XS, IQ2_S), each with one
4-bit scale, and each block into groups of 8. A group's magnitudes ``|x|`` are coded as one point of a
grid of 8-vectors whose coordinates are ``2l + 1`` (``l = 0..2``): 256, 512 and 1024 points, llama.cpp's
``kgrid_2bit_256`` / ``_512`` / ``_1024``. Each block's scale is searched as ``quantize_row_iq2_xxs_impl``
/ ``_xs_impl`` / ``_s_impl`` search it (``ggml-quants.c``, commit ``LLAMA_CPP_COMMIT``): per candidate
inverse scale ``id = (5 + 0.1 is) / max``, every group rounded to ``l = nearest_int((id |x| - 1) / 2)``
clamped to 0..2 and, where that point is not on the grid, replaced by the nearest of its precomputed
neighbours (the points at the ``nwant`` smallest distances, ``iq2xs_init_impl``: 2 for IQ2_XXS / IQ2_XS,
1 for IQ2_S), weighted by ``w = qw * sqrt(sigma2 + x**2)``; the best scale by ``sumqx**2 / sumq2``. The
block scales are coded in 4 bits against one fp16 ``d = max_scale / 31`` per super-block (IQ2_S: times
0.9875). :mod:`qkit.schemes._kernels_iq2` lists where the three searches differ.

==========  ======  ===================================================================  ==============
type        bytes   layout (``block_iq2_xxs`` / ``_xs`` / ``_s``)                           bits / weight
==========  ======  ===================================================================  ==============
iq2_xxs     66      ``d: fp16, qs: u32[16]``: per block of 32 a word of four 8-bit grid     2.0625
                    indices, a word of four 7-bit sign groups and the 4-bit scale
iq2_xs      74      ``d: fp16, qs: u16[32]`` (9-bit index, 7 sign bits per group),          2.3125
                    ``scales: u8[8]`` (4 bits per block of 16)
iq2_s       82      ``d: fp16, qs: u8[32]`` (low 8 bits of the indices), ``signs: u8[32]``,   2.5625
                    ``qh: u8[8]`` (bits 8-9), ``scales: u8[8]``
==========  ======  ===================================================================  ==============

Dequantization (``dequantize_row_iq2_*``, ``gguf.quants``): ``d * (0.5 + s) * 0.25 * grid[index][j] * sign``
with the decoder's grid values ``8, 25, 43`` (``iq2xxs_grid`` / ``iq2xs_grid`` / ``iq2s_grid``); a 7-bit
sign group's 8th sign is the parity of the seven (``ksigns_iq2xs``).

**The grids are not copied into qkit**: they are read from the installed ``gguf`` package's decoder grids,
and the map and neighbour lists are computed from them as ``iq2xs_init_impl`` does
(:func:`qkit.schemes.iquants3.lattice_tables`); ``tests/test_iquants2.py`` checks them against
``kgrid_2bit_*`` of the pinned llama.cpp source where it is in the cache.

**An importance matrix is required** for IQ2_XXS and IQ2_XS: llama.cpp's quantizers assert one
(``GGML_ASSERT(quant_weights)``), so qkit refuses to encode them without one in one line (``SchemeError``).
IQ2_S has a path without one (``w = 0.25 sigma2 + x**2``), which qkit follows; ``llama-quantize`` still
requires a matrix for all three (``tensor_requires_imatrix``), and so does ``quantize_gguf``.

The search runs in a numba kernel, the C statement for statement; there is no torch path. A width that is
not whole super-blocks falls back to ``iq4_nl`` (``tensor_type_fallback``). NaN / inf weights are refused (``NonFiniteWeightError``).

Speed (one 1536 x 1536 random matrix with an importance vector, one thread, median of 3, ``python
benchmarks/bench_grid.py``, a shared 2-core Intel Xeon with AVX-512): iq2_xxs 0.73 s, iq2_xs 1.92 s, iq2_s
0.49 s; llama.cpp's ``ggml_quantize_chunk`` 0.62 s, 1.60 s, 0.47 s (docs/gguf.md, "IQ2 and IQ1").
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
from qkit.schemes.iquants3 import GridScheme, grid_levels, lattice_tables, numba_module, search_encoder, signs_of
from qkit.schemes.kquants import QK_K
from qkit.schemes.registry import register

SIZES = {T.IQ2_XXS: 66, T.IQ2_XS: 74, T.IQ2_S: 82}  # sizeof(block_iq2_xxs), sizeof(block_iq2_xs), sizeof(block_iq2_s)
_NWANT = {T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 1}  # iq2xs_init_impl's nwant
_PACKAGE = {T.IQ2_XXS: gguf.quants.IQ2_XXS, T.IQ2_XS: gguf.quants.IQ2_XS, T.IQ2_S: gguf.quants.IQ2_S}
_KIND = {T.IQ2_XXS: 0, T.IQ2_XS: 1, T.IQ2_S: 2}  # _kernels_iq2.XXS, XS, S


@functools.cache
def grid_tables(t: T) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(grid, kmap, neighbours, values)`` of ``iq2xs_init_impl`` (:func:`lattice_tables`: 2 bits per
    coordinate, levels 0..2 reachable) and ``values`` fp32 ``[G, 8]`` the decoder's grid (``gguf.quants``)."""
    l, values = grid_levels(_PACKAGE[t])
    return (*lattice_tables(l, 2, _NWANT[t], 2), values)


def _weighted(t: T):
    def kernel():
        run = numba_module("_kernels_iq2", "iq2_xxs, iq2_xs and iq2_s").run_iq2
        return lambda x, qw, cols, *rest: run(x, qw, cols, _KIND[t], *rest)

    return search_encoder(t, SIZES[t], lambda: grid_tables(t), kernel)


def _unweighted(t: T):
    weighted = _weighted(t)

    def encode(x: torch.Tensor) -> torch.Tensor:
        """fp32 blocks ``[nb, 256]`` -> block bytes ``[nb, size]``: IQ2_S's path without an importance matrix;
        IQ2_XXS and IQ2_XS refuse (llama.cpp asserts a matrix)."""
        if t != T.IQ2_S:
            raise SchemeError(f"{t.name.lower()} needs an importance matrix (llama.cpp's quantizer asserts one); "
                              "quantize with --method imatrix or give one, or choose iq2_s")
        return weighted(x.reshape(-1, QK_K))

    return encode


def _db(b: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """``d * (0.5 + s) * 0.25`` per block of 16, from the fp16 ``d`` and the 4-bit scales packed two a byte."""
    s = torch.stack([scale_bytes & 15, scale_bytes >> 4], dim=2).reshape(b.shape[0], -1)
    return read_fp16(b, 0) * (0.5 + s.float()) * 0.25


def _parity_signs(seven: torch.Tensor) -> torch.Tensor:
    """7-bit sign groups (int64) -> fp32 ``[..., 8]`` signs: the 8th is the parity of the seven."""
    parity = torch.zeros_like(seven)
    for j in range(7):  # ksigns_iq2xs: seven bit planes, not elements
        parity ^= (seven >> j) & 1
    return signs_of((seven | (parity << 7)).to(torch.uint8))


def decode_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    values = torch.from_numpy(grid_tables(T.IQ2_XXS)[3]).to(b.device)
    words = b[:, 2:66].contiguous().view(torch.int32).long().view(nb, 8, 2) & 0xFFFFFFFF
    db = read_fp16(b, 0) * (0.5 + (words[:, :, 1] >> 28).float()) * 0.25  # [nb, 8]
    seven = (words[:, :, 1:2] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127  # [nb, 8, 4]
    index = b[:, 2:66].view(nb, 8, 8)[:, :, :4].long()  # the four index bytes of each block's first word
    grid = values[index]  # [nb, 8, 4, 8]
    return (db.view(nb, 8, 1, 1) * grid * _parity_signs(seven)).reshape(nb, QK_K)


def decode_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    values = torch.from_numpy(grid_tables(T.IQ2_XS)[3]).to(b.device)
    qs = b[:, 2:66].contiguous().view(torch.int16).long() & 0xFFFF  # [nb, 32]
    db = _db(b, b[:, 66:74].long())  # [nb, 16]
    grid = values[qs & 511].view(nb, 16, 2, 8)
    signs = _parity_signs(qs >> 9).view(nb, 16, 2, 8)
    return (db.view(nb, 16, 1, 1) * grid * signs).reshape(nb, QK_K)


def decode_iq2_s(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    values = torch.from_numpy(grid_tables(T.IQ2_S)[3]).to(b.device)
    db = _db(b, b[:, 74:82].long())  # [nb, 16]
    high = (b[:, 66:74].long().unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], device=b.device)) & 3  # [nb, 8, 4]
    grid = values[b[:, 2:34].long() | (high.view(nb, 32) << 8)].view(nb, 16, 2, 8)
    signs = signs_of(b[:, 34:66]).view(nb, 16, 2, 8)
    return (db.view(nb, 16, 1, 1) * grid * signs).reshape(nb, QK_K)


class ImportanceGridScheme(GridScheme):
    """A grid i-quant llama.cpp encodes only with an importance matrix (iq2_xxs, iq2_xs: the C asserts one)."""

    requires_importance = True


for _t, _decode in ((T.IQ2_XXS, decode_iq2_xxs), (T.IQ2_XS, decode_iq2_xs), (T.IQ2_S, decode_iq2_s)):
    register_codec(_t, _unweighted(_t), _decode, weighted=_weighted(_t))

IQ2_XXS = register(ImportanceGridScheme(
    "iq2_xxs", T.IQ2_XXS, 2, fallback=IQ4_NL,
    description="llama.cpp IQ2_XXS: groups of 8 weights as one of 256 grid points, 4-bit block scales; needs an imatrix",
))
IQ2_XS = register(ImportanceGridScheme(
    "iq2_xs", T.IQ2_XS, 2, fallback=IQ4_NL,
    description="llama.cpp IQ2_XS: groups of 8 weights as one of 512 grid points, 4-bit scales per 16; needs an imatrix",
))
IQ2_S = register(GridScheme(
    "iq2_s", T.IQ2_S, 2, fallback=IQ4_NL,
    description="llama.cpp IQ2_S: groups of 8 weights as one of 1024 grid points, sign bits, 4-bit scales per 16",
))

__all__ = ["IQ2_S", "ImportanceGridScheme", "IQ2_XS", "IQ2_XXS", "SIZES", "decode_iq2_s", "decode_iq2_xs", "decode_iq2_xxs", "grid_tables"]
