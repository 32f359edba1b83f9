"""llama.cpp's 3-bit i-quants ``iq3_xxs`` and ``iq3_s``: groups of 4 weights as one point of a grid.

Both split a super-block of 256 weights into eight blocks of 32 and each block into eight groups of 4.
A group's magnitudes ``|x|`` are coded as one point of a grid of 4-vectors whose coordinates are odd
numbers ``2l + 1`` (``l = 0..7``): 256 points for IQ3_XXS, 512 for IQ3_S, llama.cpp's ``kgrid_256`` /
``kgrid_512``. Each block has one scale, searched as ``quantize_row_iq3_xxs_impl`` /
``quantize_row_iq3_s_impl`` search it (``ggml-quants.c``, commit ``LLAMA_CPP_COMMIT``): per candidate
inverse scale ``id = (15 + 0.2 is) / max``, every group rounded to ``l = nearest_int((id |x| - 1) / 2)``
and, where that point is not on the grid, replaced by the nearest of its precomputed neighbours (the
points at the ``nwant`` smallest distances, ``iq3xs_init_impl``: 2 for IQ3_XXS, 3 for IQ3_S), weighted by
``w = qw * sqrt(sigma2 + x**2)`` (``sigma2 = 2 * mean x**2`` of the super-block; without an importance
matrix ``w = x**2``); the best scale by ``sumqx**2 / sumq2``. The block scales are then coded in 4 bits
against one fp16 ``d`` per super-block (``max_scale / 31``, times a fudge factor 1.0125 / 1.033).

==========  ======  ==================================================================  ==============
type        bytes   layout (``block_iq3_xxs`` / ``block_iq3_s``)                        bits / weight
==========  ======  ==================================================================  ==============
iq3_xxs     98      ``d: fp16, qs: u8[64]`` grid indices, ``u32[8]``: per block four     3.0625
                    7-bit sign groups (the 8th sign is their parity) and a 4-bit scale
iq3_s       110     ``d: fp16, qs: u8[64]`` (low 8 bits of the indices), ``qh: u8[8]``     3.4375
                    (bit 8), ``signs: u8[32]``, ``scales: u8[4]`` (4 bits per block)
==========  ======  ==================================================================  ==============

Dequantization (``dequantize_row_iq3_xxs`` / ``_s``, ``gguf.quants``): ``db * grid[index][j] * sign``, with
``db = d * (0.5 + s) * 0.5`` (xxs) or ``d * (1 + 2 s)`` (s) and the decoder's grid values
(``iq3xxs_grid`` / ``iq3s_grid``: ``4, 12, ..., 52, 62`` and ``1, 3, ..., 15``).

**The grids are not copied into qkit**: they are read from the installed ``gguf`` package (its
``quants.IQ3_XXS`` / ``IQ3_S`` decoder grids, llama.cpp's ``iq3xxs_grid`` / ``iq3s_grid`` in the same
order), whose values map back to ``l`` one to one, and the map and neighbour lists are computed from
them as ``iq3xs_init_impl`` does (:func:`grid_tables`). ``tests/test_iquants3.py`` checks them against
``kgrid_256`` / ``kgrid_512`` of the pinned llama.cpp source where it is in the cache.

The search runs in a numba kernel (:mod:`qkit.schemes._kernels_iq3`), the C statement for statement;
there is no torch path (a tensor on another device is encoded on the CPU). Two llama.cpp behaviours are
kept because they are its bytes: IQ3_S, after an all-zero block of 32, writes the later blocks' indices
and signs one block early (its pointers advance only for blocks it does not skip), and IQ3_XXS skips a
block whose largest magnitude is below ``1e-8``. A width that is not whole super-blocks falls back to
``iq4_nl`` (``tensor_type_fallback``). NaN / inf weights are refused (``NonFiniteWeightError``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import gguf
import numpy as np
import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.ggml import T, check_importance, register_codec
from qkit.schemes.ggml_blocks import check_finite, read_fp16
from qkit.schemes.iquants import IQ4_NL
from qkit.schemes.kquants import QK_K, KQuantScheme
from qkit.schemes.registry import register

SIZES = {T.IQ3_XXS: 98, T.IQ3_S: 110}  # sizeof(block_iq3_xxs), sizeof(block_iq3_s)
_NWANT = {T.IQ3_XXS: 2, T.IQ3_S: 3}  # iq3xs_init_impl: neighbours at the 2 / 3 smallest distances
_PACKAGE = {T.IQ3_XXS: gguf.quants.IQ3_XXS, T.IQ3_S: gguf.quants.IQ3_S}


def lattice_tables(l: np.ndarray, bits: int, nwant: int, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(grid, kmap, neighbours)`` of ``iq3xs_init_impl`` / ``iq2xs_init_impl`` for the grid points ``l`` (int
    ``[G, n]``, each coordinate's level): ``grid`` int8 ``[G, n]`` the coordinates ``2l + 1``; ``kmap`` int32
    ``[2**(bits n)]``, for a packed code (``bits`` per coordinate, the first lowest) its grid index, or
    ``-(offset + 1)`` of its neighbour list in ``neighbours`` (uint16: the count, then the grid indices at the
    ``nwant`` smallest squared distances, sorted by distance then index, as the C's ``qsort``). Lists are made
    for the codes a search can reach (every level ``<= top``: the C's clamp); any other code maps to -1,
    which no search looks up."""
    count, n = l.shape
    shifts = bits * np.arange(n)
    grid = (2 * l + 1).astype(np.int8)
    kmap = np.full(1 << (bits * n), -1, np.int32)
    kmap[(l.astype(np.int64) << shifts).sum(axis=1)] = np.arange(count, dtype=np.int32)
    levels = np.stack(np.meshgrid(*[np.arange(top + 1)] * n, indexing="ij"), axis=-1).reshape(-1, n)
    codes = (levels << shifts).sum(axis=1)
    off, pos = codes[kmap[codes] < 0], 2 * levels[kmap[codes] < 0] + 1  # [m], [m, n]
    counts, lists = [], []
    for lo in range(0, len(off), 512):  # in chunks: [512, G, n] differences (16-32 MB)
        d2 = ((grid[None, :, :].astype(np.int32) - pos[lo:lo + 512, None, :]) ** 2).sum(axis=2)  # [c, G]
        order = np.argsort(d2 * count + np.arange(count), axis=1, kind="stable")  # qsort by (d2, index)
        sd2 = np.take_along_axis(d2, order, axis=1)
        rank = np.concatenate([np.zeros((len(sd2), 1), np.int64), np.cumsum(np.diff(sd2, axis=1) > 0, axis=1)], axis=1)
        keep = rank < nwant  # a prefix of each row: row-major order keeps each list in place
        counts.append(keep.sum(axis=1))
        lists.append(order[keep])
    per = np.concatenate(counts)
    starts = np.concatenate([[0], np.cumsum(per + 1)[:-1]])
    neighbours = np.empty(int((per + 1).sum()), np.uint16)
    heads = np.zeros(len(neighbours), bool)
    heads[starts] = True
    neighbours[starts] = per
    neighbours[~heads] = np.concatenate(lists)
    kmap[off] = -(starts + 1)
    return grid, kmap, neighbours


def grid_levels(cls: type) -> tuple[np.ndarray, np.ndarray]:
    """``(l, values)`` of a gguf-package i-quant class (``gguf.quants.IQ3_XXS``, ``IQ2_S``, ...): its decoder grid
    fp32 ``[G, n]`` as each value's index in the class's ``grid_map`` (llama.cpp's ``kgrid_*`` levels), and the
    grid itself."""
    cls.init_grid()
    values = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)
    levels = np.array(cls.grid_map, dtype=np.float32)
    l = np.searchsorted(levels, values).astype(np.int64)  # noqa: E741  the decoder's value -> l
    if not np.array_equal(levels[np.minimum(l, len(levels) - 1)], values):
        raise SchemeError(f"the gguf package's {cls.__name__} grid holds values outside its grid_map; qkit cannot read it")
    return l, values


@functools.cache
def grid_tables(t: T) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(grid, kmap, neighbours, values)`` of ``iq3xs_init_impl`` (:func:`lattice_tables`, 3 bits per
    coordinate, every code reachable) and ``values`` fp32 ``[G, 4]`` the decoder's grid (``gguf.quants``)."""
    l, values = grid_levels(_PACKAGE[t])
    return (*lattice_tables(l, 3, _NWANT[t], 7), values)


def search_encoder(t: T, size: int, tables: Callable[[], tuple], kernel: Callable[[], Callable]):
    """The importance-weighted row encoder of a grid type whose search is the numba ``kernel()(x, qw, cols,
    grid, kmap, neighbours, lo, hi, out, bad)`` (its other arguments bound), ``size`` bytes per super-block."""
    def encode(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 rows ``[rows, cols]`` (``cols % 256 == 0``) and the importance of each column (fp32 ``[cols]``,
        or None) -> block bytes uint8 ``[rows, cols / 256 * size]``."""
        rows, cols = x.shape
        n = rows * cols // QK_K
        xn = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        peak = xn.abs().amax() if xn.numel() else xn.new_zeros(())
        check_finite(peak)
        if qw is not None:
            check_importance(qw, t.name.lower())
        qn = np.empty(0, np.float32) if qw is None else qw.detach().to("cpu", torch.float32).contiguous().numpy()
        grid, kmap, neighbours = tables()[:3]
        out = np.empty((n, size), np.uint8)
        bad = np.zeros(n, np.uint8)
        run_kernel = kernel()
        flat = xn.numpy().reshape(-1)
        run = lambda lo, hi: run_kernel(flat, qn, cols, grid, kmap, neighbours, lo, hi, out, bad)  # noqa: E731
        with kernels.owning_the_cores():
            kernels._split(run, n, unit=64)  # noqa: SLF001  64 super-blocks: about a millisecond of the search
        if bad.any():
            raise SchemeError(f"{t.name.lower()}: llama.cpp's search finds no grid point for a block (its weights overflow "
                              "fp32 in the search; llama.cpp aborts here); scale the weights down or exclude the tensor")
        return torch.from_numpy(out).view(rows, -1).to(x.device)

    return encode


def numba_module(name: str, what: str):
    """``qkit.schemes.NAME``, a numba kernel module, imported on first use (numba is heavy), or ``SchemeError``."""
    try:
        return importlib.import_module(f"qkit.schemes.{name}")
    except ImportError as exc:
        raise SchemeError(f"{what} are encoded by a numba kernel, and numba cannot be imported ({exc}); "
                          "install numba or choose another type") from None


def _weighted(t: T):
    def kernel():
        run = numba_module("_kernels_iq3", "iq3_xxs and iq3_s").run_iq3
        return lambda x, qw, cols, *rest: run(x, qw, cols, t == T.IQ3_XXS, *rest)

    return search_encoder(t, SIZES[t], lambda: grid_tables(t), kernel)


def signs_of(bits: torch.Tensor) -> torch.Tensor:
    """uint8 sign bytes ``[..., m]`` -> fp32 ``[..., m, 8]``: -1 where bit ``j`` is set, else 1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return 1.0 - 2.0 * ((bits.unsqueeze(-1) >> shifts) & 1).float()


def decode_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    values = torch.from_numpy(grid_tables(T.IQ3_XXS)[3]).to(b.device)
    words = b[:, 66:98].contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [nb, 8]
    db = read_fp16(b, 0) * (0.5 + (words >> 28).float()) * 0.5  # [nb, 8]
    seven = (words.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127  # [nb, 8, 4]
    parity = torch.zeros_like(seven)
    for j in range(7):  # ksigns_iq2xs: the 8th sign bit is the parity of the seven
        parity ^= (seven >> j) & 1
    signs = signs_of((seven | (parity << 7)).to(torch.uint8))  # [nb, 8, 4, 8]
    grid = values[b[:, 2:66].long()].view(nb, 8, 4, 8)  # two points per group of 8
    return (db.view(nb, 8, 1, 1) * grid * signs).reshape(nb, QK_K)


def decode_iq3_s(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    values = torch.from_numpy(grid_tables(T.IQ3_S)[3]).to(b.device)
    sc = b[:, 106:110].long()
    s = torch.stack([sc & 15, sc >> 4], dim=2).view(nb, 8)
    db = read_fp16(b, 0) * (1 + 2 * s).float()
    high = ((b[:, 66:74].long().unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1).view(nb, 64)
    grid = values[b[:, 2:66].long() | (high << 8)].view(nb, 8, 4, 8)
    signs = signs_of(b[:, 74:106].view(nb, 8, 4))
    return (db.view(nb, 8, 1, 1) * grid * signs).reshape(nb, QK_K)


def _unweighted(t: T):
    weighted = _weighted(t)

    def encode(x: torch.Tensor) -> torch.Tensor:
        """fp32 blocks ``[nb, 256]`` -> block bytes ``[nb, size]`` (llama.cpp's path without an importance matrix)."""
        return weighted(x.reshape(-1, QK_K))

    return encode


for _t, _decode in ((T.IQ3_XXS, decode_iq3_xxs), (T.IQ3_S, decode_iq3_s)):
    register_codec(_t, _unweighted(_t), _decode, weighted=_weighted(_t))

class GridScheme(KQuantScheme):
    """An i-quant whose codes are grid points of 4 or 8 weights (iq3_xxs, iq3_s, iq2_*). Its own ``kind``: GPTQ rounds one
    weight at a time onto a scale's levels and has no observer for a search over whole groups, so
    ``--method gptq`` refuses it before any work; nor does a plan mix it in (``qkit_format.plan_types``)."""

    kind = "ggml-grid"


IQ3_XXS = register(GridScheme(
    "iq3_xxs", T.IQ3_XXS, 3, fallback=IQ4_NL,
    description="llama.cpp IQ3_XXS: groups of 4 weights as one of 256 grid points, 4-bit block scales; needs an imatrix in llama.cpp",
))
IQ3_S = register(GridScheme(
    "iq3_s", T.IQ3_S, 3, fallback=IQ4_NL,
    description="llama.cpp IQ3_S: groups of 4 weights as one of 512 grid points, sign bits, 4-bit block scales",
))

__all__ = ["GridScheme", "IQ3_S", "IQ3_XXS", "SIZES", "decode_iq3_s", "decode_iq3_xxs", "grid_levels", "grid_tables",
           "lattice_tables", "numba_module", "search_encoder", "signs_of"]
