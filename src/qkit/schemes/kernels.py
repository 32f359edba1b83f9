"""Compiled CPU kernels (numba) for llama.cpp's block formats and FP4, bit-exact with the torch encoders.

The torch encoders (:mod:`qkit.schemes.ggml`, :mod:`qkit.schemes.kquants`, :mod:`qkit.schemes.fp4`) stay
the oracle (``tests/test_schemes_kernels.py`` compares the two paths; the gguf, llama.cpp and
compressed-tensors oracle tests run both) and the path for tensors on other devices.

**k-quant searches.** ``make_qkx2_quants`` (q4_k, q5_k; with the importance matrix ``make_qkx3_quants``,
the same search with the caller's weights) and ``make_qx_quants`` (q6_k) try 16 to 37 candidate
scales per sub-block and keep the best, each candidate a pass of rounding and *sequential* fp32 sums over
the sub-block (the C loops add in order; any other order rounds differently and can pick another
candidate). In torch that is ~40 tensor operations per candidate over multi-megabyte intermediates; the C
reference runs it one sub-block at a time, scalar. These kernels run the C loops *across* sub-blocks
(:mod:`qkit.schemes._kernels_lanes`, one implementation for every type): 64 sub-blocks are laid out
element-major (element ``i`` of sub-block ``k`` at ``i * 64 + k``), so every C statement becomes one loop
over the lanes that LLVM vectorises (AVX2 / AVX-512) without reordering anything: each lane adds its own
terms in the C order. No fast-math: no FMA contraction, no reassociation, IEEE division and square root.
Rounding is the C ``nearest_int``: ``(v + 12582912.f) - 12582912.f`` rounds half to even for the bounded
``|v| < 2**22`` the candidates give (a lane that could leave that range is redone by the scalar port of
:mod:`qkit.schemes._kernels_search`); an inverse scale that overflows (a sub-block narrower than about
4e-38) is replaced by 0 before rounding, giving code 0, as the C trick gives for inf and NaN. The final
codes (the C ``nearest_int`` trick itself) and their packing are compiled too. With an importance
matrix, q4_k and q5_k run the whole ``quantize_row_q{4,5}_K_impl`` in one kernel (:func:`k45_impl`, in
:mod:`qkit.schemes._kernels_kquants`): the lane search over eight super-blocks at a time, then per
super-block the scalar ``make_qp_quants`` of the eight scales and minimums, fp16 ``d`` / ``dmin`` (rounded
in the kernel, round to nearest even) and the codes from them. Measured on one thread against
``ggml_quantize_chunk`` (the default model's 576x576, 1536x576 and 576x1536 projections as 1536-wide
rows, median of 5, a shared 2-core x86-64): q4_k / q5_k 4.8-5.7x faster without and 5.9-7.1x with an
importance matrix, q6_k 3.3-3.6x / 3.1-3.4x.

**32-element blocks** (q8_0, q4_0, q4_1, q5_0, q5_1): one pass per block; extremes as integer reductions
over the fp32 bits, the C statements per block; blocks the C casts treat specially are handed back
(:func:`blocks32`). **FP4**: block absmax from the bits, then scale, E2M1 rounding (the integer formula of
:func:`qkit.schemes.e2m1.e2m1_pack_arith`) and packing in one pass (:func:`e2m1_blocks`).

Threads: the work is split into one contiguous range per torch thread (``torch.get_num_threads()``, which
``--threads`` sets; see :func:`owning_the_cores`); the kernels release the GIL. Compiled on first use
(~5 s) and cached on disk (numba's ``cache=True``). Where numba cannot be imported, ``QKIT_KERNELS=torch``
is set, or the tensor is not on the CPU, the callers use the torch code (:func:`available`).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import torch

from qkit.threads import one_torch_thread

_STATE: dict[str, Any] = {"on": os.environ.get("QKIT_KERNELS", "numba") != "torch", "jit": None, "threads": None}


def _jit() -> ModuleType | None:
    """The compiled module, imported once; ``None`` (torch code) where numba cannot be imported."""
    if _STATE["jit"] is None:
        try:
            from qkit.schemes import _kernels_jit  # local: imports numba (heavy), only when a tensor needs a kernel
        except ImportError:  # numba is a dependency; this keeps a broken install usable, on the torch path
            _STATE["on"] = False
            return None
        _STATE["jit"] = _kernels_jit
    return _STATE["jit"]


def _kq() -> ModuleType:
    """The compiled q5_k / importance-matrix k-quant module (after :func:`_jit`, which decides whether numba
    is importable: callers check :func:`available` first)."""
    from qkit.schemes import _kernels_kquants  # local: imports numba, as _jit

    return _kernels_kquants


def available(x: torch.Tensor) -> bool:
    """Whether the compiled kernels take ``x``: a CPU tensor, numba importable, not disabled (by
    ``QKIT_KERNELS=torch`` in the environment or :func:`set_enabled`)."""
    return bool(_STATE["on"]) and x.device.type == "cpu" and _jit() is not None


def set_enabled(on: bool) -> bool:
    """Turn the kernels on or off for this process (tests compare both paths); returns the old state."""
    old = bool(_STATE["on"])
    _STATE["on"] = bool(on)
    return old


_POOL: list[ThreadPoolExecutor] = []


@contextlib.contextmanager
def owning_the_cores() -> Iterator[None]:
    """For an encoder that mixes kernels with torch operations: torch at one thread inside, the kernels
    split over the threads torch had. Measured: with torch's pool at 2 threads, its OpenMP workers keep
    spinning after each small torch operation and take the core the kernel's second thread needs (a q4_k
    matrix 40 ms on one thread, 45 ms on two); this way, 2 threads give ~1.8x."""
    if _STATE["threads"] is not None:  # nested: already set up
        yield
        return
    with one_torch_thread() as n:
        _STATE["threads"] = n
        try:
            yield
        finally:
            _STATE["threads"] = None


def _split(run, S: int, unit: int) -> None:  # noqa: ANN001
    """``run(lo, hi)`` over ``[0, S)`` in one contiguous range per thread: torch's thread count, or the
    one :func:`owning_the_cores` saved (the kernels release the GIL), but no more threads than ranges of
    ``unit`` items. ``unit`` is about half a millisecond of the kernel's work: handing a range to a pool
    thread costs ~70 us, and below that size a second thread was measured slower, not faster (a q4_0
    pass over 8k blocks 0.22 ms on one thread, 0.25 ms on two; over 32k blocks 1.0 -> 0.6 ms)."""
    threads = max(1, min(_STATE["threads"] or torch.get_num_threads(), S // unit))
    if threads == 1:
        run(0, S)
        return
    if not _POOL or _POOL[0]._max_workers < threads:  # noqa: SLF001
        _POOL[:] = [ThreadPoolExecutor(max_workers=threads, thread_name_prefix="qkit-kernel")]
    step = -(-S // threads // 64) * 64  # whole tiles of the kernels' 64 lanes
    jobs = [_POOL[0].submit(run, lo, min(S, lo + step)) for lo in range(0, S, step)]
    for j in jobs:
        j.result()


def _lanes() -> ModuleType:
    """The row drivers of the 64-lane scale searches (after :func:`_jit`, as :func:`_kq`)."""
    from qkit.schemes import _kernels_rows  # local: imports numba, as _jit

    return _kernels_rows


_NO_WEIGHTS = np.zeros((1, 1), np.float32)  # the ``w`` argument of the drivers where they make the weights


def _qkx(x: torch.Tensor, w: torch.Tensor | None, first: int, nmax: int, rmin: float, rdelta: float, nstep: int,
         use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qkit.schemes._kernels_rows.run_qkx` on every row of ``x`` ``[S, n]``, split over the threads:
    with ``w`` ``None`` the _ref paths' weights, else row ``(first + s) % P`` of ``w`` ``[P, n]``."""
    lanes = _lanes()
    S, n = x.shape
    xn = x.detach().contiguous().numpy()
    wn = _NO_WEIGHTS if w is None else w.detach().contiguous().numpy()
    mode = lanes.W_REF if w is None else lanes.W_GIVEN
    scale, the_min = np.empty(S, np.float32), np.empty(S, np.float32)
    L = np.empty((S, n), np.uint8)
    unit = max(1, 16384 // (n * (max(nstep, 0) + 2)))  # sub-blocks of about half a millisecond
    args = (nmax, float(rmin), float(rdelta), int(nstep), bool(use_mad), scale, the_min, L)
    _split(lambda lo, hi: lanes.run_qkx(xn, wn, int(first), mode, lo, hi, *args), S, unit)
    return torch.from_numpy(scale), torch.from_numpy(the_min), torch.from_numpy(L)


def _qx(x: torch.Tensor, w: torch.Tensor | None, first: int, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qkit.schemes._kernels_rows.run_qx` on every row of ``x`` ``[S, n]``, split over the threads:
    with ``w`` ``None`` the weights ``x*x``, else row ``(first + s) % P`` of ``w`` ``[P, n]``."""
    lanes = _lanes()
    S, n = x.shape
    xn = x.detach().contiguous().numpy()
    wn = _NO_WEIGHTS if w is None else w.detach().contiguous().numpy()
    mode = lanes.W_SQUARE if w is None else lanes.W_GIVEN
    scale, L = np.empty(S, np.float32), np.empty((S, n), np.uint8)
    _split(lambda lo, hi: lanes.run_qx(xn, wn, int(first), mode, lo, hi, nmax, scale, L), S, 4096 // n)
    return torch.from_numpy(scale), torch.from_numpy(L)


def qkx2(x: torch.Tensor, nmax: int, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, false)`` on every row of
    ``x`` ``[S, n]`` fp32 (a sub-block a row) with the _ref paths' weights ``av_x + |x|`` (q4_k's
    arguments by default; q5_k's are ``31, -0.5, 0.1, 15``). Returns ``(scale [S], the_min [S], L [S, n]
    uint8)``, as :func:`qkit.schemes.kquant_search.make_qkx2_quants` (the oracle in the tests)."""
    return _qkx(x, None, 0, nmax, rmin, rdelta, nstep, False)


def qkx_rows(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` / ``make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad)`` on every row of ``x``, ``w`` fp32 ``[S, n]``: ``(scale [S], the_min [S], L uint8 [S, n])``,
    equal to :func:`qkit.schemes.kquant_search.make_qkx2_quants` (the two C functions differ only where
    ``weights`` is ``NULL``: pass ``w = x*x`` for that)."""
    return _qkx(x, w, 0, nmax, rmin, rdelta, nstep, use_mad)


def qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, 1, NULL)`` on every row of ``x`` ``[S, n]`` fp32: ``(scale [S],
    L [S, n] uint8)``, the stored codes ``l + nmax`` (0 for an all-zero row), as
    :func:`qkit.schemes.kquant_search.make_qx_quants`."""
    return _qx(x, None, 0, nmax)


def qx_weighted(x: torch.Tensor, qw: torch.Tensor, first: int, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, 1, qw)`` on every row of ``x`` ``[S, n]`` fp32, row ``s`` with the
    weights ``qw[(first + s) % P]`` (``qw`` fp32 ``[P, n]``: the importance of one matrix row's sub-blocks,
    or ``[S, n]`` with ``first = 0``: a weight per element). Returns ``(scale [S], L [S, n] uint8)`` as :func:`qx`."""
    return _qx(x, qw, first, nmax)


def row_weights(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """The weights of the 32-block ``quantize_row_*_impl``: ``qw[j] * sqrtf(sigma2 + x[r, j]**2)`` fp32
    ``[rows, cols]`` for ``x`` fp32 ``[rows, cols]``, ``qw`` fp32 ``[cols]`` (``sigma2`` the row's mean square,
    summed in order), as :func:`qkit.schemes.ggml_weighted.row_weights`."""
    jit, (rows, cols) = _jit(), x.shape
    xn, qn = x.detach().contiguous().numpy(), qw.detach().contiguous().numpy()
    w = np.empty((rows, cols), np.float32)
    _split(lambda lo, hi: jit._run_row_weights(xn, qn, lo, hi, w), rows, max(1, 2**18 // cols))
    return torch.from_numpy(w)


def k45_impl(x: torch.Tensor, qw: torch.Tensor, first: int, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_row_q4_K_impl`` (``nmax=15``) / ``quantize_row_q5_K_impl`` (31) on every super-block of ``x``
    ``[nb, 256]`` fp32, super-block ``s`` with the importance ``qw[(first + s) % P]`` (``qw`` fp32 ``[P, 256]``,
    one matrix row's). Returns ``(blocks uint8 [nb, 144 or 176], dm fp32 [nb, 2])``: the fp32 ``d`` and
    ``dmin`` before their rounding to fp16 (where one overflows, that block's codes are not written)."""
    nb = x.shape[0]
    xn, qn = x.detach().contiguous().numpy(), qw.detach().contiguous().numpy()
    out = np.empty((nb, 144 if nmax == 15 else 176), np.uint8)
    dm = np.empty((nb, 2), np.float32)
    _split(lambda lo, hi: _kq()._run_k45_impl(xn, qn, first, lo, hi, nmax, out, dm), nb, unit=256)
    return torch.from_numpy(out), torch.from_numpy(dm)


def q5_k_codes(x: torch.Tensor, L: torch.Tensor, dd: torch.Tensor, dm: torch.Tensor, out: torch.Tensor) -> None:
    """q5_k's final codes, packed into ``out[:, 16:176]`` (``qh`` and ``qs`` of ``block_q5_K`` ``[nb, 176]``),
    from ``x`` ``[nb, 256]``, the search's codes ``L`` uint8 ``[nb, 256]`` and ``d*sc`` / ``dmin*m`` fp32 ``[nb, 8]``."""
    kq, args = _kq(), [t.detach().contiguous().numpy() for t in (x, L, dd, dm)]
    on = out.numpy()
    _split(lambda lo, hi: kq._run_q5_k_codes(*args, lo, hi, on), x.shape[0], unit=2048)


BLOCK32_KINDS = {"q8_0": 0, "q4_0": 1, "q5_0": 2, "q4_1": 3, "q5_1": 4}


def blocks32(x: torch.Tensor, kind: str, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's ``quantize_row_<kind>_ref`` on every row of ``x`` ``[nb, 32]`` fp32, except the fp16
    header: ``(blocks uint8 [nb, size] with the codes written after the header, d fp32 [nb], min fp32 [nb]
    (q4_1 / q5_1), flags uint8 [nb])``; ``flags`` 2 marks a block with NaN or inf, 1 a ``d`` below fp32's
    normal range: their bytes are not written (:mod:`qkit.schemes.ggml` re-encodes them with its torch
    code, which is exact there and refuses non-finite weights)."""
    jit = _jit()
    nb = x.shape[0]
    xn = x.detach().contiguous().numpy()
    out = np.empty((nb, size), np.uint8)
    d, m = np.empty(nb, np.float32), np.empty(nb, np.float32)
    flags = np.empty(nb, np.uint8)
    k = BLOCK32_KINDS[kind]
    _split(lambda lo, hi: jit._run_blocks32(xn, xn.view(np.int32), lo, hi, k, out, d, m, flags), nb, unit=16384)
    return torch.from_numpy(out), torch.from_numpy(d), torch.from_numpy(m), torch.from_numpy(flags)


def q4_k_codes(x: torch.Tensor, L: torch.Tensor, dd: torch.Tensor, dm: torch.Tensor, out: torch.Tensor) -> None:
    """q4_k's final codes, packed into ``out[:, 16:144]`` (``block_q4_K`` bytes ``[nb, 144]``) from ``x``
    ``[nb, 256]``, the search's codes ``L`` uint8 ``[nb, 256]`` and ``d*sc`` / ``dmin*m`` fp32 ``[nb, 8]``."""
    jit, args = _jit(), [t.detach().contiguous().numpy() for t in (x, L, dd, dm)]
    on = out.numpy()
    _split(lambda lo, hi: jit._run_q4_k_codes(*args, lo, hi, on), x.shape[0], unit=2048)


def q6_k_codes(x: torch.Tensor, L: torch.Tensor, dd: torch.Tensor, zero: torch.Tensor, out: torch.Tensor) -> None:
    """q6_k's final codes, packed into ``out[:, :192]`` (``ql`` and ``qh`` of ``block_q6_K`` ``[nb, 210]``)
    from ``x`` ``[nb, 256]``, the search's stored codes ``L`` uint8 ``[nb, 256]``, ``d*sc`` fp32 ``[nb, 16]``
    and the all-zero super-blocks ``zero`` bool ``[nb]``."""
    jit, args = _jit(), [t.detach().contiguous().numpy() for t in (x, L, dd, zero)]
    on = out.numpy()
    _split(lambda lo, hi: jit._run_q6_k_codes(*args, lo, hi, on), x.shape[0], unit=2048)


def block_absmax_bits(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``x`` ``[rows, cols]`` -> int32 ``[rows, cols / block]``: the bits of each block's ``max |x|``
    (``>= 0x7F800000`` where the block holds NaN or inf)."""
    jit, rows = _jit(), x.shape[0]
    xi = x.detach().contiguous().view(torch.int32).numpy()
    out = np.empty((rows, x.shape[1] // block), np.int32)
    _split(lambda lo, hi: jit._run_block_absmax(xi, lo, hi, block, out), rows, unit=max(1, 2**22 // x.shape[1]))
    return torch.from_numpy(out)


def e2m1_blocks(x: torch.Tensor, scale: torch.Tensor, *, divide: bool, ties_to_even: bool, minus_zero: int, out: torch.Tensor) -> None:
    """E2M1 codes of ``x / scale`` (``divide``) or ``x * scale`` per block (``scale`` fp32 ``[rows, blocks]``),
    packed into uint8 ``out`` ``[rows, cols / 2]``, an exact ``-0.0`` coded ``minus_zero``: one pass, the
    bytes of :func:`qkit.schemes.e2m1.e2m1_pack` on the same values."""
    jit, rows = _jit(), x.shape[0]
    block = x.shape[1] // scale.shape[1]
    args = (x.detach().contiguous().numpy(), scale.detach().contiguous().numpy(), divide, ties_to_even, minus_zero)
    on = out.numpy()
    _split(lambda lo, hi: jit._run_e2m1(*args, lo, hi, block, on), rows, unit=max(1, 2**20 // x.shape[1]))
