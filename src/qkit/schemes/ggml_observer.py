"""The GPTQ observer of every llama.cpp block type: each block's scales as RTN chooses them, each column
rounded by llama.cpp's own final rounding, the codes written back into RTN's blocks.

Layer 2 (``schemes/``): tensors in, tensors out. Registered in ``qkit.schemes.observers.OBSERVERS`` under
the kind ``ggml``, so ``qkit.methods.gptq`` drives it like the absmax, NF4 and FP4 grids. A unit is one
block of a row: 32 columns (q4_0 ... q8_0, iq4_nl) or a super-block of 256 (q2_k ... q6_k, iq4_xs, tq1_0, tq2_0).

**Scales** (``set_unit``). The type's own encoder runs on the unit's columns (the current weights: the
original ones with static scales, the error-updated ones otherwise), with the importance matrix's entry
for those columns when one is given, and its blocks are kept: their fp16 ``d``, ``dmin`` and sub-block
scales are the grid (:mod:`qkit.schemes.ggml_codes`). One exception: q4_0 / q4_1 / q5_0 / q5_1 with an
importance matrix weight every element by ``qw[j] * sqrtf(sigma2 + x[j]**2)``, ``sigma2`` the mean
square of the *whole row*; the observer takes ``sigma2`` from the matrix as given (``weights``), so a
block's weights do not depend on which columns GPTQ has already changed, and runs the search
(``make_qx_rule`` / ``make_qkx3_rule``, the torch oracle of llama.cpp's bytes) itself. Units set together
(all of them with static scales) are encoded in one call, when the first column is rounded.

**Rounding** (``quantize_into``): llama.cpp's last step for the type, with its parameters read from the
encoder (``a``, ``b`` per row and sub-block), so that with no error feedback the codes are RTN's::

    q8_0                     roundf(w * a), a = 1/d, d = amax/127 (fp32)          clamp -128..127
    tq1_0, tq2_0             roundf(w * a) + 1, a = 1/d, d = amax (fp32)          clamp 0..2
    q4_0, q5_0               (int)(w * a + 8.5 | 16.5), a = 1/d, d = max/-8 | -16   clamp 0..15 | 31
    q4_1, q5_1               (int)((w - min) * a + 0.5), a = 1/d                     clamp 0..15 | 31
      with an importance     nearest_int((w - b) * a): a the search's inverse scale, b its minimum
    q2_k ... q6_k            nearest_int((w + dmin*m) / (d*sc)) from the stored fp16 bytes
    iq4_nl, iq4_xs           best_index_int8(w * a), a = 1/d (fp32 d of the search) | 1/(D * l)

and ``Ŵ = scale * level(q) + offset``, what the type's decoder gives for those bytes. Where the rule does
not give RTN's codes on the unit's own weights (a sub-block scale of 0, whose codes are the search's; a
``d`` below fp32's normal range, where C's casts wrap), the sub-block's codes are frozen to RTN's: its
values then do not depend on the codes, or the weights are below 1e-37. ``parts`` packs the codes into
the kept blocks: a standard block tensor of the type, which every writer stores unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import SchemeError
from qkit.schemes.ggml import GGMLScheme, T, check_importance
from qkit.schemes.ggml_blocks import HALF_BELOW, first_extremes, inverse, signed_extreme
from qkit.schemes.ggml_codes import CODES, BlockCodes, iq4_xs_levels, levels
from qkit.schemes.ggml_weighted import _write_weighted
from qkit.schemes.iquants import best_index_int8, encode_with_scales
from qkit.schemes.kquant_search import (
    fdiv,
    make_qkx3_rule,
    make_qx_rule,
    seq_sum,
    sqrtf,
)
from qkit.schemes.observers import OBSERVERS

# rule kinds (module docstring)
TRUNC, AWAY, NEAREST, DIV, INDEX = "trunc", "away", "nearest", "div", "index"

# per type: (rule without an importance matrix, rule with one); (kind, lo, hi, c)
_RULES: dict[Any, tuple[tuple, tuple]] = {
    T.Q8_0: ((AWAY, -128, 127, 0.0),) * 2,  # quantize_q8_0 ignores the importance matrix
    T.Q4_0: ((TRUNC, 0, 15, 8.5), (NEAREST, -8, 7, 8.0)),
    T.Q5_0: ((TRUNC, 0, 31, 16.5), (NEAREST, -16, 15, 16.0)),
    T.Q4_1: ((TRUNC, 0, 15, 0.5), (NEAREST, 0, 15, 0.0)),
    T.Q5_1: ((TRUNC, 0, 31, 0.5), (NEAREST, 0, 31, 0.0)),
    T.IQ4_NL: ((INDEX, 0, 15, 0.0),) * 2,
    T.IQ4_XS: ((INDEX, 0, 15, 0.0),) * 2,
    T.Q4_K: ((DIV, 0, 15, 0.0),) * 2,
    T.Q5_K: ((DIV, 0, 31, 0.0),) * 2,
    T.Q6_K: ((DIV, -32, 31, 32.0),) * 2,
    T.Q2_K: ((DIV, 0, 3, 0.0),) * 2,
    T.Q3_K: ((DIV, -4, 3, 4.0),) * 2,
    T.TQ1_0: ((AWAY, -1, 1, 1.0),) * 2,  # quantize_tq*_0 ignore the importance matrix
    T.TQ2_0: ((AWAY, -1, 1, 1.0),) * 2,
}
_SEARCHED = {T.Q4_0: 8, T.Q5_0: 16, T.Q4_1: 15, T.Q5_1: 31}  # nmax of the row-weighted 32-block searches


def apply_rule(kind: str, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lo: int, hi: int, c: float,
               out: torch.Tensor) -> torch.Tensor:
    """The codes (fp32, integers) of ``x`` by rule ``kind`` with parameters ``a``, ``b`` (broadcast to
    ``x``) into ``out``; see the module docstring. Clamping before rounding equals rounding before
    clamping for integer bounds; ``+ c`` after rounding also turns a ``-0`` code into ``+0``."""
    if kind == TRUNC:
        return torch.sub(x, b, out=out).mul_(a).add_(c).clamp_(lo, hi).trunc_()
    if kind == AWAY:  # roundf: truncate v + copysign(0.49999997, v) (qkit.schemes.ggml.round_half_away)
        torch.mul(x, a, out=out)
        return out.add_(torch.copysign(torch.full_like(out, HALF_BELOW), out)).clamp_(lo, hi).trunc_().add_(c)
    if kind == NEAREST:
        return torch.sub(x, b, out=out).mul_(a).clamp_(lo, hi).round_().add_(c)
    if kind == DIV:
        return torch.add(x, b, out=out).div_(a).clamp_(lo, hi).round_().add_(c)
    return out.copy_(best_index_int8(torch.mul(x, a)))


@dataclass
class _Unit:
    """One unit's kept blocks and what rounding onto their grid needs; per-sub-block values ``[nsub, rows]``."""

    blocks: torch.Tensor  # uint8 [rows, size]: RTN's blocks (the codes are replaced in ``parts``)
    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    frozen: torch.Tensor | None  # bool [nsub, rows] where the codes stay RTN's, or None
    rtn: torch.Tensor | None  # fp32 [block, rows] RTN's codes (only where some are frozen)


# Pending units are encoded together (one call for many, as static groups set them all before the loop)
# but never more than this many weights at once: the encode's working copies are a few times its input,
# and a 7B down_proj (45M weights) set whole held about 1 GB of them.
FLUSH_ELEMENTS = 1 << 23


class GGMLObserver:
    """One ``[rows, cols]`` matrix of a llama.cpp block type (already resolved for its width: q4_k's
    576-wide fallback is a q5_0 scheme). ``quant_weights``: the importance of each column (fp32
    ``[cols]``), which routes the scale choice through llama.cpp's weighted searches."""

    per_tensor = False

    def __init__(self, scheme: GGMLScheme, rows: int, cols: int, device: torch.device, *,
                 scale_rule: str = "absmax", weights: torch.Tensor | None = None,
                 quant_weights: torch.Tensor | None = None):
        if not isinstance(scheme, GGMLScheme) or scheme.ggml_type not in CODES:
            raise SchemeError(f"GPTQ needs a llama.cpp block type here, not {scheme.name!r}: resolve a recipe per tensor first")
        if scale_rule != "absmax":
            raise SchemeError(f"--scale-rule {scale_rule} applies to absmax schemes; {scheme.name} takes its scales from "
                              "llama.cpp's own search (drop --scale-rule)")
        self.scheme, self.rows, self.device = scheme, rows, device
        self.type = scheme.ggml_type
        self.bc: BlockCodes = CODES[self.type]
        if scheme.resolve((rows, cols)) is not scheme or cols % self.bc.block:
            raise SchemeError(f"{scheme.name} cannot take rows of {cols} (blocks of {self.bc.block}); "
                              f"llama.cpp writes {scheme.resolve((rows, cols)).name} for this width")
        self.unit, self.n_units, self.sub = self.bc.block, cols // self.bc.block, self.bc.sub
        qw = None
        if quant_weights is not None:
            qw = quant_weights.detach().to(device=device, dtype=torch.float32).reshape(-1)
            if qw.numel() != cols:
                raise SchemeError(f"{scheme.name}: an importance vector of {qw.numel()} values for rows of {cols}")
            check_importance(qw, scheme.name)
        self.qw = qw
        self.kind, self.lo, self.hi, self.c = _RULES[self.type][qw is not None]
        self.sigma2 = None
        if qw is not None and self.type in _SEARCHED:  # the row's mean square, as quantize_row_*_impl sums it
            if weights is None:
                raise SchemeError(f"a {scheme.name} observer with an importance matrix needs the weights (sigma2 is the row's)")
            x = weights.detach().to(device=device, dtype=torch.float32)
            s = seq_sum((x * x).t().contiguous())
            self.sigma2 = s.div_(torch.full_like(s, float(cols)))
        self.table = levels(self.bc, device)
        self.units: list[_Unit | None] = [None] * self.n_units
        self.pending: dict[int, torch.Tensor] = {}

    @classmethod
    def block_width(cls, scheme: Any) -> int | None:
        return None  # widths are the scheme's: resolve() gives llama.cpp's fallback type, or refuses

    # ----------------------------------------------------------------- scales

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        self.pending[u] = w.to(torch.float32).contiguous()
        self.units[u] = None
        if len(self.pending) * w.numel() >= FLUSH_ELEMENTS:  # units are one width; bounded: every block is independent
            self._flush()

    def _flush(self) -> None:
        """Encode every pending unit in one call (their columns side by side: every block is independent)."""
        us = sorted(self.pending)
        x = torch.cat([self.pending.pop(u) for u in us], dim=1) if len(us) > 1 else self.pending.pop(us[0])
        qw = None if self.qw is None else torch.cat([self.qw[u * self.unit : (u + 1) * self.unit] for u in us])
        blocks, a, b = self._encode(x, qw)
        bc, k, rows = self.bc, len(us), self.rows
        xb = x.view(rows * k, bc.nsub, bc.sub)
        scale, offset = bc.grid(blocks)
        if self.kind == DIV:
            a, b = scale, (torch.zeros_like(scale) if offset is None else offset.neg())
        mine = apply_rule(self.kind, xb, a.unsqueeze(2), b.unsqueeze(2), self.lo, self.hi, self.c, torch.empty_like(xb))
        rtn = bc.codes(blocks).view(rows * k, bc.nsub, bc.sub)
        frozen = (mine != rtn).any(dim=2)
        if self.kind == DIV:  # a zero d*sc: codes are the search's, the values -dmin*m whatever the codes
            frozen |= a == 0
            a = torch.where(a == 0, torch.ones_like(a), a)

        def per_unit(t: torch.Tensor) -> torch.Tensor:  # [rows * k, n] -> [k, n, rows]
            return t.reshape(rows, k, -1).permute(1, 2, 0).contiguous()

        pa, pb, ps = per_unit(a.expand(-1, bc.nsub)), per_unit(b.expand(-1, bc.nsub)), per_unit(scale.expand(-1, bc.nsub))
        po = None if offset is None else per_unit(offset)
        pf = per_unit(frozen)
        pr = per_unit(rtn.reshape(rows * k, bc.block).float())
        blk = blocks.view(rows, k, bc.size)
        for i, u in enumerate(us):
            any_frozen = bool(pf[i].any())
            self.units[u] = _Unit(blk[:, i].contiguous(), pa[i], pb[i], ps[i], None if po is None else po[i],
                                  pf[i] if any_frozen else None, pr[i] if any_frozen else None)

    def _encode(self, x: torch.Tensor, qw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RTN's blocks of ``x [rows, k * block]`` (uint8 ``[rows * k, size]``) and the rule's ``a``, ``b``
        per block row ``[rows * k, 1 or nsub]`` (DIV's come from the blocks' grid in ``_flush``)."""
        t, bc = self.type, self.bc
        nb = x.numel() // bc.block
        xb = x.view(nb, bc.block)
        zero = torch.zeros(nb, 1, device=x.device)
        if qw is not None and t in _SEARCHED:
            return self._searched(x, qw)
        if t in (T.IQ4_NL, T.IQ4_XS):
            blocks, d = encode_with_scales(x, qw, bc.block)
            blocks = blocks.view(nb, bc.size)
            if t == T.IQ4_NL:
                d = d.view(nb, 1)
            else:  # the codes were rounded with 1 / (D * l), D in fp32
                d = d.view(nb, 1) * iq4_xs_levels(blocks).float()
            return blocks, torch.where(d != 0, fdiv(1.0, d), torch.zeros_like(d)), zero
        parts = self.scheme.encode(x) if qw is None else self.scheme.encode(x, quant_weights=qw)
        blocks = parts["qweight"].reshape(nb, bc.size)
        if t == T.Q8_0:
            return blocks, inverse(xb.abs().amax(dim=1, keepdim=True) / 127), zero
        if t in (T.TQ1_0, T.TQ2_0):
            return blocks, inverse(xb.abs().amax(dim=1, keepdim=True)), zero
        if t in (T.Q4_0, T.Q5_0):
            _, mx = signed_extreme(xb)
            return blocks, inverse(mx / (-8 if t == T.Q4_0 else -16)).unsqueeze(1), zero
        if t in (T.Q4_1, T.Q5_1):
            mn, mx = first_extremes(xb)
            return blocks, inverse((mx - mn) / (15 if t == T.Q4_1 else 31)).unsqueeze(1), mn.unsqueeze(1)
        return blocks, zero, zero  # k-quants: from the stored grid

    def _searched(self, x: torch.Tensor, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q4_0 ... q5_1 with an importance matrix: llama.cpp's weights with the row's ``sigma2`` (set from
        the matrix as given), the search and its rule, the blocks written as ``quantize_row_*_impl`` writes."""
        t = self.type
        sq = x * x
        w = sqrtf(sq.add_(self.sigma2.unsqueeze(1))).mul_(qw)  # qw[j] * sqrtf(sigma2 + x[j]**2)
        xs, ws = x.reshape(-1, 32).t().contiguous(), w.reshape(-1, 32).t().contiguous()
        nmax = _SEARCHED[t]
        if t in (T.Q4_0, T.Q5_0):
            d, L, iscale = make_qx_rule(xs, nmax, ws)
            the_min, shift = None, torch.zeros_like(d)
        else:
            d, the_min, L, iscale, shift = make_qkx3_rule(xs, ws, nmax)
        blocks = torch.empty(xs.shape[1], self.bc.size, dtype=torch.uint8, device=x.device)
        _write_weighted(t, blocks, d, the_min, L.t().contiguous().to(torch.uint8), x)
        a = torch.nan_to_num(iscale, nan=0.0, posinf=0.0, neginf=0.0)  # as codes_into: a non-finite scale codes 0
        return blocks, a.unsqueeze(1), shift.unsqueeze(1)

    # ----------------------------------------------------------------- rounding

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor, col: int = 0) -> None:
        if self.pending:
            self._flush()
        p = self.units[u]
        j = col % self.unit
        s = j // self.sub
        apply_rule(self.kind, w, p.a[s], p.b[s], self.lo, self.hi, self.c, codes)
        if p.frozen is not None:
            torch.where(p.frozen[s], p.rtn[j], codes, out=codes)
        if self.table is not None:
            torch.index_select(self.table, 0, codes.long(), out=deq).mul_(p.scale[s])
        else:
            torch.sub(codes, self.bc.shift, out=deq).mul_(p.scale[s])
        if p.offset is not None:
            deq.add_(p.offset[s])

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        pass  # frozen codes were put in place column by column

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """``encode``'s layout: ``qweight`` uint8 ``[rows, cols / block * size]`` (RTN's blocks with these
        codes), ``scales`` an empty fp16 tensor."""
        if self.pending:
            self._flush()
        bc = self.bc
        blocks = torch.stack([p.blocks[rows] for p in self.units], dim=1)  # [r, n_units, size]
        r = blocks.shape[0]
        flat = blocks.view(r * self.n_units, bc.size)
        bc.pack(codes[rows].to(torch.int32).reshape(r * self.n_units, bc.block), flat)
        return {"qweight": flat.view(r, self.n_units * bc.size), "scales": torch.empty(0, dtype=torch.float16, device=flat.device)}


OBSERVERS.register("ggml", GGMLObserver)

__all__ = ["GGMLObserver", "apply_rule"]
