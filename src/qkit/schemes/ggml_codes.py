"""Where each llama.cpp block type keeps its codes, and the grid its stored scales give.

Layer 2 (``schemes/``): tensors in, tensors out. For every type of :mod:`qkit.schemes.ggml`,
:mod:`qkit.schemes.kquants`, :mod:`qkit.schemes.kquants_low`, :mod:`qkit.schemes.iquants` and
:mod:`qkit.schemes.tquants`, a
:class:`BlockCodes` says how to read the codes out of block bytes and write them back (with the packers
those modules use, so only the code bits change), and the grid of each sub-block that the stored fp16
scales and minimums give, exactly as the type's decoder computes it (fp32)::

    Ŵ = scale * level(code) + offset      level(code) = code - shift  (iq4_*: kvalues_iq4nl[code])

==========  =====  ===  =====  ================================  ===============================
type        block  sub  shift  scale                             offset
==========  =====  ===  =====  ================================  ===============================
q8_0        32     32   0      ``d`` (codes are int8)            --
q4_0, q5_0  32     32   8, 16  ``d``                             --
q4_1, q5_1  32     32   0      ``d``                             ``m``
iq4_nl      32     32   table  ``d``                             --
q4_k, q5_k  256    32   0      ``d * sc_j``                      ``-(dmin * m_j)``
q6_k        256    16   32     ``d * sc_j`` (``sc_j`` int8)      --
q2_k        256    16   0      ``d * (scales_j & 15)``           ``-(dmin * (scales_j >> 4))``
q3_k        256    16   4      ``d * sc_j`` (6-bit, ``-32``)     --
iq4_xs      256    32   table  ``d * (ls_j - 32)``               --
tq1_0,      256    256  1      ``d``                             --
tq2_0
==========  =====  ===  =====  ================================  ===============================

``x + (-y)`` is ``x - y`` in IEEE arithmetic, so these equal the decoders bit for bit
(``tests/test_gptq_ggml.py`` checks every type). GPTQ (``qkit.schemes.ggml_observer``) rounds error-updated
weights onto these grids and writes its codes back into the blocks RTN's encoder produced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkit.schemes.ggml import T, _low_high, _with_high_bit
from qkit.schemes.ggml_blocks import high_bits, pack_low_high, pack_nibbles_or, read_fp16
from qkit.schemes.iquants import KVALUES_IQ4NL
from qkit.schemes.kquants import _pack_codes, _scale_min_k4, pack_q6_codes, q6_codes
from qkit.schemes.kquants_low import (
    _q3_unpack_scales,
    pack_2bit,
    pack_q3_codes,
    q3_codes,
    unpack_2bit,
)
from qkit.schemes.tquants import TQ1_SIZE, TQ2_SIZE, pack_tq1, pack_tq2, tq1_trits, tq2_trits

Grid = tuple[torch.Tensor, torch.Tensor | None]  # (scale [nb, nsub], offset [nb, nsub] or None), fp32


@dataclass(frozen=True)
class BlockCodes:
    """One type's codes and grid. ``codes(blocks [nb, size]) -> int32 [nb, block]``; ``pack(codes, blocks)``
    writes int codes ``[nb, block]`` into the blocks in place (nothing but the code bits changes);
    ``grid(blocks) -> (scale, offset)`` per sub-block of ``sub`` weights."""

    block: int
    size: int
    sub: int
    shift: int  # level = code - shift (for the table types: unused)
    table: bool  # iq4_nl / iq4_xs: level = KVALUES_IQ4NL[code]
    codes: Callable[[torch.Tensor], torch.Tensor]
    pack: Callable[[torch.Tensor, torch.Tensor], None]
    grid: Callable[[torch.Tensor], Grid]

    @property
    def nsub(self) -> int:
        return self.block // self.sub


# --------------------------------------------------------------------------- 32-blocks


def _nibbles(at: int) -> tuple[Callable, Callable]:
    """Codes as ``qs[j] = q[j] | q[j + 16] << 4`` at byte ``at`` (q4_0, q4_1, iq4_nl)."""

    def codes(b: torch.Tensor) -> torch.Tensor:
        return _low_high(b[:, at : at + 16]).to(torch.int32)

    def pack(q: torch.Tensor, b: torch.Tensor) -> None:
        pack_nibbles_or(q.to(torch.uint8), b[:, at : at + 16])

    return codes, pack


def _five_bits(at: int) -> tuple[Callable, Callable]:
    """5-bit codes: ``qh`` (bit 4 of every code) at byte ``at``, the low nibbles after it (q5_0, q5_1)."""

    def codes(b: torch.Tensor) -> torch.Tensor:
        return _with_high_bit(b[:, at : at + 4], b[:, at + 4 : at + 20]).to(torch.int32)

    def pack(q: torch.Tensor, b: torch.Tensor) -> None:
        q = q.to(torch.uint8).contiguous()
        high_bits(q, b[:, at : at + 4])
        pack_low_high(q, b[:, at + 4 : at + 20])

    return codes, pack


def _q8_codes(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.int32)


def _q8_pack(q: torch.Tensor, b: torch.Tensor) -> None:
    b[:, 2:34] = q.to(torch.int8).view(torch.uint8)


def _d(b: torch.Tensor) -> Grid:
    return read_fp16(b, 0), None


def _d_m(b: torch.Tensor) -> Grid:
    return read_fp16(b, 0), read_fp16(b, 2)


# --------------------------------------------------------------------------- super-blocks of 256


def _k45_codes(nmax: int) -> Callable:
    def codes(b: torch.Tensor) -> torch.Tensor:
        nb = b.shape[0]
        at = 16 if nmax == 15 else 48
        qs = b[:, at:].reshape(nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
        if nmax == 31:  # bit s of qh[l]: bit 4 of element l of sub-block s
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
            q = q | (((b[:, 16:48].unsqueeze(1) >> shifts) & 1) << 4)
        return q.reshape(nb, 256).to(torch.int32)

    return codes


def _k45_pack(nmax: int) -> Callable:
    def pack(q: torch.Tensor, b: torch.Tensor) -> None:
        _pack_codes(q.to(torch.uint8).reshape(-1, 8, 32), nmax, b)

    return pack


def _k45_grid(b: torch.Tensor) -> Grid:
    sc, m = _scale_min_k4(b[:, 4:16])
    return read_fp16(b, 0) * sc.float(), (read_fp16(b, 2) * m.float()).neg_()


def _q6_grid(b: torch.Tensor) -> Grid:
    return read_fp16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float(), None


def _q2_grid(b: torch.Tensor) -> Grid:
    sc = b[:, :16].to(torch.int32)
    return read_fp16(b, 80) * (sc & 0xF).float(), (read_fp16(b, 82) * (sc >> 4).float()).neg_()


def _q2_pack(q: torch.Tensor, b: torch.Tensor) -> None:
    pack_2bit(q.to(torch.uint8), b[:, 16:80])


def _q3_grid(b: torch.Tensor) -> Grid:
    return read_fp16(b, 108) * _q3_unpack_scales(b[:, 96:108]).float(), None


def iq4_xs_levels(b: torch.Tensor) -> torch.Tensor:
    """The signed sub-block scales ``ls_j - 32`` of ``block_iq4_xs`` bytes ``[nb, 136]``: int64 ``[nb, 8]``."""
    nb = b.shape[0]
    sh = b[:, 2].long() | (b[:, 3].long() << 8)
    sl = b[:, 4:8].long()
    lo = torch.stack([sl & 0xF, sl >> 4], dim=2).reshape(nb, 8)
    hi = (sh.unsqueeze(1) >> torch.arange(0, 16, 2, device=b.device)) & 3
    return (lo | (hi << 4)) - 32


def _xs_grid(b: torch.Tensor) -> Grid:
    return read_fp16(b, 0) * iq4_xs_levels(b).float(), None


def _xs_codes(b: torch.Tensor) -> torch.Tensor:
    return _low_high(b[:, 8:].reshape(-1, 16)).reshape(b.shape[0], 256).to(torch.int32)


def _xs_pack(q: torch.Tensor, b: torch.Tensor) -> None:
    qs = torch.empty(q.shape[0] * 8, 16, dtype=torch.uint8, device=q.device)
    pack_nibbles_or(q.to(torch.uint8).reshape(-1, 32), qs)
    b[:, 8:] = qs.view(-1, 128)


_q40, _q41, _q50, _q51 = _nibbles(2), _nibbles(4), _five_bits(2), _five_bits(4)

CODES: dict[Any, BlockCodes] = {
    T.Q8_0: BlockCodes(32, 34, 32, 0, False, _q8_codes, _q8_pack, _d),
    T.Q4_0: BlockCodes(32, 18, 32, 8, False, *_q40, _d),
    T.Q4_1: BlockCodes(32, 20, 32, 0, False, *_q41, _d_m),
    T.Q5_0: BlockCodes(32, 22, 32, 16, False, *_q50, _d),
    T.Q5_1: BlockCodes(32, 24, 32, 0, False, *_q51, _d_m),
    T.IQ4_NL: BlockCodes(32, 18, 32, 0, True, *_q40, _d),
    T.Q4_K: BlockCodes(256, 144, 32, 0, False, _k45_codes(15), _k45_pack(15), _k45_grid),
    T.Q5_K: BlockCodes(256, 176, 32, 0, False, _k45_codes(31), _k45_pack(31), _k45_grid),
    T.Q6_K: BlockCodes(256, 210, 16, 32, False, lambda b: q6_codes(b).to(torch.int32),
                       lambda q, b: pack_q6_codes(q.to(torch.uint8), b), _q6_grid),
    T.Q2_K: BlockCodes(256, 84, 16, 0, False, lambda b: unpack_2bit(b[:, 16:80]).to(torch.int32), _q2_pack, _q2_grid),
    T.Q3_K: BlockCodes(256, 110, 16, 4, False, q3_codes, pack_q3_codes, _q3_grid),
    T.IQ4_XS: BlockCodes(256, 136, 32, 0, True, _xs_codes, _xs_pack, _xs_grid),
    T.TQ1_0: BlockCodes(256, TQ1_SIZE, 256, 1, False, tq1_trits, lambda q, b: pack_tq1(q.to(torch.uint8), b),
                        lambda b: (read_fp16(b, TQ1_SIZE - 2), None)),
    T.TQ2_0: BlockCodes(256, TQ2_SIZE, 256, 1, False, tq2_trits, lambda q, b: pack_tq2(q.to(torch.uint8), b),
                        lambda b: (read_fp16(b, TQ2_SIZE - 2), None)),
}


def levels(codes: BlockCodes, device: torch.device) -> torch.Tensor | None:
    """The table of level values by code for the table types (fp32 ``[16]``), else None."""
    return torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=device) if codes.table else None


def dequantize_codes(bc: BlockCodes, blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``scale * level(q) + offset`` for int codes ``q [nb, block]`` on the grid of ``blocks [nb, size]``:
    fp32 ``[nb, block]`` (equal to decoding ``blocks`` with ``q`` packed into them)."""
    nb = blocks.shape[0]
    scale, offset = bc.grid(blocks)
    table = levels(bc, blocks.device)
    lv = table[q.long()] if table is not None else (q - bc.shift).float()
    out = scale.unsqueeze(2) * lv.view(nb, bc.nsub, bc.sub)
    if offset is not None:
        out = out + offset.unsqueeze(2)
    return out.reshape(nb, bc.block)


__all__ = ["CODES", "BlockCodes", "dequantize_codes", "iq4_xs_levels", "levels"]
