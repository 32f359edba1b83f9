"""Observers: how a scheme's scales are chosen from weights, and how one column is rounded onto its grid.

Layer 2 (the schemes layer: tensors in, tensors out, no I/O). A *scale rule* turns the weights of some
scale units into stored scales; an *observer* holds one matrix's scales unit by unit and rounds columns
onto the scheme's grid with them. GPTQ (``qkit.methods.gptq``) drives an observer column by column,
setting each unit's scales from the error-updated weights; ``round_to_nearest`` drives the same observer
over the untouched weights, which is RTN. With the ``absmax`` rule that gives the scheme's own
``encode`` bit for bit (``tests/test_gptq.py``), so RTN and GPTQ share one grid and one set of rules.

Scale rules (absmax schemes; NF4, mxfp4 and nvfp4 always use their own rule). Every rule writes a valid
tensor of the same scheme (decoding is ``q * scale`` whatever chose the scale)::

    absmax      scale = absmax / qmax, qkit's rule (``qkit.schemes.absmax.absmax_scales``): what rtn writes
    full-range  scale = absmax / (qmax + 0.5), codes clamped to [-qmax-1, qmax]: the full signed range, as
                compressed-tensors' symmetric observer (llm-compressor) chooses it
    mse         per unit, the scale p * absmax / qmax, p in {1.00, 0.99, ..., 0.80}, that minimises
                sum |w - Ŵ|^2.4 over the unit (the reference GPTQ quantizer's ``mse`` search, on a shorter grid)

Observers are registered in ``OBSERVERS`` under a scheme's name (``mxfp4``, ``nvfp4``: one kind ``fp4``,
two grids) or its kind (``absmax``, ``nf4``); ``observer_for(scheme, ...)`` looks the name up first, then
the kind. The grids, each bit for bit the scheme's RTN:

* absmax: one scale per group / row / tensor, codes ``clamp(round(w / s), -qmax-1, qmax)``, a zero unit
  codes 0;
* nf4: one absmax per block of 64 columns of a row, codes picked by ``qkit.schemes.nf4.nf4_codes`` from
  ``w * (1 / absmax)`` in fp32, the absmax stored in the scheme's scale dtype;
* mxfp4: per block of 32, the E8M0 exponent ``e`` of the block's absmax (``mxfp4_exponents``), codes the
  E2M1 rounding of ``w * 2**(127 - e)`` with gguf's rule (ties to the smaller magnitude, +0 for a value
  that rounds to 0), ``Ŵ = E2M1 * 2**(e - 127)``;
* nvfp4: the fp32 global scale ``gs`` once from the whole weight, or from its fused group's ``tensor_amax``
  (``GroupScaled``; ``nvfp4_global_scale``), per block of
  16 the E4M3 scale ``s`` of the block's absmax (``nvfp4_block_scales``), codes the ties-to-even rounding
  of ``w / (s / gs)`` (-0 for a small negative), ``Ŵ = E2M1 * (s / gs)``;
* ggml (every llama.cpp block type, registered by ``qkit.schemes.ggml_observer``): each block's scales and
  minimums from the type's own encoder (with an importance matrix's entry, its weighted search), the
  codes by llama.cpp's final rounding of the type.

An observer keeps per-unit values as rows (``[n_units, rows]``) so a column loop reads contiguous vectors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from qkit.errors import SchemeError
from qkit.granularity import PerGroup, PerTensor
from qkit.registry import Registry
from qkit.schemes.absmax import absmax_scales
from qkit.schemes.base import GroupScaled
from qkit.schemes.e2m1 import e2m1_codes, e2m1_table, e8m0_reciprocals, e8m0_values, mxfp4_exponents, pack_fp4
from qkit.schemes.fp4 import nvfp4_block_scales, nvfp4_global_scale
from qkit.schemes.ggml import is_llama_type
from qkit.schemes.nf4 import nf4_codes, nf4_tables
from qkit.schemes.packing import pack_nibbles

if TYPE_CHECKING:  # annotations only: observers are found by the scheme's name or kind, never by class
    from qkit.schemes import AbsmaxScheme, NF4Scheme, Scheme
    from qkit.schemes.fp4 import MXFP4Scheme, NVFP4Scheme

# --------------------------------------------------------------------------- scale rules

ScaleRule = Callable[[torch.Tensor, int, torch.dtype], torch.Tensor]
"""``rule(units [n, k] fp32, bits, scale_dtype) -> stored scales [n] in scale_dtype``."""

MSE_SHRINK = tuple(1 - i / 100 for i in range(21))  # p = 1.00, 0.99, ..., 0.80: the first wins ties
MSE_NORM = 2.4  # the reference GPTQ quantizer's norm

# Exact names (no normalising): the rule is recorded in the manifest as given.
SCALE_RULES: Registry[ScaleRule] = Registry("scale rule", normalize=lambda name: name)


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


@SCALE_RULES.decorator("absmax")
def absmax_rule(units: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """``absmax / qmax`` in ``scale_dtype`` (rounded up where the cast lost a code): qkit's rule."""
    return absmax_scales(units, bits, scale_dtype)[:, 0]


@SCALE_RULES.decorator("full-range")
def full_range_rule(units: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """``absmax / (qmax + 0.5)`` in ``scale_dtype``: codes then reach ``-qmax - 1`` (compressed-tensors)."""
    return (units.abs().amax(dim=1) / (_qmax(bits) + 0.5)).to(scale_dtype)


@SCALE_RULES.decorator("mse")
def mse_rule(units: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per unit, the candidate ``p * absmax / qmax`` (``p`` in ``MSE_SHRINK``, cast to ``scale_dtype``) with the
    least ``sum |w - q * s|^2.4``, ``q = clamp(round(w / s), -qmax-1, qmax)``; the largest ``p`` among equals."""
    qmax = _qmax(bits)
    absmax = units.abs().amax(dim=1)
    shrink = torch.tensor(MSE_SHRINK, device=units.device)
    cand = (shrink[:, None] * absmax[None, :] / qmax).to(scale_dtype).float()  # [C, n]
    safe = torch.where(cand > 0, cand, torch.ones_like(cand))[:, :, None]
    q = torch.div(units[None], safe).round_().clamp_(-qmax - 1, qmax).mul_(cand[:, :, None])
    err = q.sub_(units[None]).abs_().pow_(MSE_NORM).sum(dim=2)  # [C, n]
    best = err.argmin(dim=0)  # the first (largest) scale among equals: p = 1 wins ties
    return cand.gather(0, best[None])[0].to(scale_dtype)


# --------------------------------------------------------------------------- the observer protocol


class Observer(Protocol):
    """One ``[rows, cols]`` matrix's scales on one scheme's grid, set unit by unit.

    ``unit``: columns per scale unit (a group, a block, or ``cols`` for per-row / per-tensor scales);
    ``n_units``: units per row; ``per_tensor``: one scale for the whole matrix."""

    unit: int
    n_units: int
    per_tensor: bool

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        """Scales of unit ``u`` from ``w [rows, unit_cols]`` (fp32, the current weights; any strides)."""

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor, col: int = 0) -> None:
        """Column ``w [rows]`` (fp32) of unit ``u`` -> its codes (as fp32) into ``codes``, ``Ŵ`` into ``deq``;
        ``col``: the column's index in the matrix (original order; where a unit holds several sub-blocks)."""

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        """Last fix-ups of ``codes [rows, cols]`` (``units [cols]``: each column's unit), in place."""

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """The scheme's stored parts of rows ``rows`` from ``codes`` (original column order): ``encode``'s layout."""


class ObserverType(Protocol):
    """An observer class: built for one matrix; ``block_width`` says whether rows must be whole blocks."""

    def __call__(self, scheme: Any, rows: int, cols: int, device: torch.device, *, scale_rule: str = "absmax",
                 weights: torch.Tensor | None = None, **importance: torch.Tensor) -> Observer: ...

    def block_width(self, scheme: Any) -> int | None:
        """Columns per block when scales run in blocks along each row (``cols`` must be a multiple), else None."""


OBSERVERS: Registry[ObserverType] = Registry("observer", error=SchemeError)


# --------------------------------------------------------------------------- the grids


@OBSERVERS.decorator("absmax")
class AbsmaxObserver:
    """Symmetric integer codes, one scale per unit of ``unit`` columns of a row (or one for the tensor),
    chosen by the scale rule ``scale_rule`` (``SCALE_RULES``)."""

    def __init__(self, scheme: AbsmaxScheme, rows: int, cols: int, device: torch.device, *,
                 scale_rule: str = "absmax", weights: torch.Tensor | None = None):
        self.scheme = scheme
        self.qmax = _qmax(scheme.bits)
        self.rule = SCALE_RULES.get(scale_rule)
        g = scheme.granularity
        self.per_tensor = isinstance(g, PerTensor)
        self.unit = g.size if isinstance(g, PerGroup) else cols
        self.n_units = -(-cols // self.unit)
        r = 1 if self.per_tensor else rows
        self.stored = torch.zeros(self.n_units, r, dtype=scheme.scale_dtype, device=device)
        self.divisor = torch.ones(self.n_units, r, device=device)
        self.scale = torch.zeros(self.n_units, r, device=device)

    @classmethod
    def block_width(cls, scheme: Any) -> int | None:
        return None  # a short last group per row (576 columns, g128) is a group like any other

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        units = w.reshape(1, -1) if self.per_tensor else w
        s = self.rule(units, self.scheme.bits, self.scheme.scale_dtype)
        self.stored[u] = s
        f = s.float()
        self.scale[u] = f
        self.divisor[u] = torch.where(f > 0, f, torch.ones_like(f))  # zero unit -> codes set to 0 in finish()

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor, col: int = 0) -> None:
        torch.div(w, self.divisor[u], out=codes).round_().clamp_(-self.qmax - 1, self.qmax)
        torch.mul(codes, self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        """A unit whose scale is 0 (all zeros when its scale was set) gets code 0."""
        zero = (self.scale == 0).T[:, units]  # [rows or 1, cols]
        codes.masked_fill_(zero.expand_as(codes), 0.0)

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        q = codes[rows].to(torch.int8)
        scales = self.stored.T if self.per_tensor else self.stored.T[rows]
        shape = self.scheme.granularity.scale_shape(tuple(q.shape))
        return {"qweight": self.scheme.pack_codes(q), "scales": scales.reshape(shape).clone()}


@OBSERVERS.decorator("nf4")
class NF4Observer:
    """NF4 codebook, one absmax per block of ``block_size`` columns (blocks within rows)."""

    def __init__(self, scheme: NF4Scheme, rows: int, cols: int, device: torch.device, *,
                 scale_rule: str = "absmax", weights: torch.Tensor | None = None):
        self.scheme = scheme
        self.unit = scheme.block_size
        self.n_units = cols // self.unit
        self.per_tensor = False
        self.levels, _ = nf4_tables(device)
        self.inverse = torch.zeros(self.n_units, rows, device=device)
        self.stored = torch.zeros(self.n_units, rows, dtype=scheme.scale_dtype, device=device)
        self.scale = torch.zeros(self.n_units, rows, device=device)

    @classmethod
    def block_width(cls, scheme: NF4Scheme) -> int | None:
        return scheme.block_size

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        absmax = w.abs().amax(dim=1)
        # qkit/bitsandbytes: codes from the fp32 absmax (w * (1 / absmax)), the absmax stored in scale_dtype
        self.inverse[u] = 1.0 / absmax.clamp(min=1e-38)
        self.stored[u] = absmax.to(self.scheme.scale_dtype)
        self.scale[u] = self.stored[u].float()

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor, col: int = 0) -> None:
        c = nf4_codes(w * self.inverse[u])
        codes.copy_(c)
        torch.mul(self.levels[c], self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        pass  # a zero block: every value scales to 0 or beyond +-1; its levels times absmax 0 decode to 0

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        return {"qweight": pack_nibbles(codes[rows].to(torch.int32)), "scales": self.stored.T[rows].reshape(-1).clone()}


@OBSERVERS.decorator("mxfp4")
class MXFP4Observer:
    """MXFP4: E2M1 codes, one E8M0 (power-of-two) scale per block of 32 columns of a row, chosen and
    applied exactly as ``qkit.schemes.fp4.quantize_mxfp4`` does (gguf's rule, ties to the smaller magnitude,
    a value that rounds to 0 is +0)."""

    ties_to_even: ClassVar[bool] = False

    def __init__(self, scheme: MXFP4Scheme, rows: int, cols: int, device: torch.device, *,
                 scale_rule: str = "absmax", weights: torch.Tensor | None = None):
        self.scheme = scheme
        self.unit = scheme.block_size
        self.n_units = cols // self.unit
        self.per_tensor = False
        self.rows = rows
        self.values = e2m1_table(device)  # by code; code 8 is -0.0
        self.stored = torch.zeros(self.n_units, rows, dtype=torch.uint8, device=device)  # the scheme's ``scales`` bytes
        self.multiplier = torch.zeros(self.n_units, rows, device=device)  # w -> E2M1 units
        self.scale = torch.zeros(self.n_units, rows, device=device)  # E2M1 units -> w
        # One column's E2M1 argument, padded to an even length (the FP4 rounding packs pairs of values).
        self._y = torch.zeros(1, rows + rows % 2, device=device)

    @classmethod
    def block_width(cls, scheme: MXFP4Scheme) -> int | None:
        return scheme.block_size

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        e = mxfp4_exponents(w.abs().amax(dim=1))
        self.stored[u] = e.to(torch.uint8)
        self.multiplier[u] = e8m0_reciprocals(e)  # 2**(127 - e): the scheme multiplies by it, exactly
        self.scale[u] = e8m0_values(e)

    def _codes(self, w: torch.Tensor, u: int) -> torch.Tensor:
        torch.mul(w, self.multiplier[u], out=self._y[0, : self.rows])
        return e2m1_codes(self._y, ties_to_even=self.ties_to_even)[0, : self.rows].long()

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor, col: int = 0) -> None:
        c = self._codes(w, u)
        codes.copy_(c)
        torch.mul(self.values[c], self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        pass  # a zero block has e = 0: its values scale to 0 and code +0, which decodes to 0

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """As ``encode``: ``qweight`` uint8 ``[rows, cols / 2]`` (``pack_fp4``), ``scales`` uint8 ``[rows, cols / B]``."""
        return {"qweight": pack_fp4(codes[rows].to(torch.uint8)),
                "scales": self.stored.T[rows].clone(memory_format=torch.contiguous_format)}


@OBSERVERS.decorator("nvfp4")
class NVFP4Observer(MXFP4Observer):
    """NVFP4: E2M1 codes, one E4M3 scale ``s`` per block of 16 columns of a row and one fp32 global scale
    ``gs`` for the tensor, computed once from ``weights`` (the whole matrix, as given), exactly as
    ``qkit.schemes.fp4.quantize_nvfp4`` (compressed-tensors' rule): ``y = w / (s / gs)``, ties to even, a
    negative value that rounds to 0 is -0."""

    ties_to_even = True

    def __init__(self, scheme: NVFP4Scheme, rows: int, cols: int, device: torch.device, *,
                 scale_rule: str = "absmax", weights: torch.Tensor | None = None,
                 tensor_amax: torch.Tensor | None = None):
        if weights is None and tensor_amax is None:
            raise SchemeError("an nvfp4 observer needs the weights: its global scale is the whole tensor's")
        super().__init__(scheme, rows, cols, device)  # type: ignore[arg-type]
        # ``tensor_amax``: a fused group's (``GroupScaled``), whose global scale every shard shares
        amax = weights.to(device=device, dtype=torch.float32).abs().amax() if tensor_amax is None else tensor_amax
        self.global_scale = nvfp4_global_scale(amax.to(device=device, dtype=torch.float32))

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        s = nvfp4_block_scales(w.abs().amax(dim=1), self.global_scale)
        self.stored[u] = s.to(torch.float8_e4m3fn).view(torch.uint8)
        self.scale[u] = s / self.global_scale  # compressed-tensors: scale / global_scale, both ways

    def _codes(self, w: torch.Tensor, u: int) -> torch.Tensor:
        y = self._y[0, : self.rows]
        torch.div(w, self.scale[u], out=y).add_(0.0)  # -0.0 + 0.0 = +0.0, as quantize_nvfp4
        return e2m1_codes(self._y, ties_to_even=True)[0, : self.rows].long()

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """As MXFP4's, with the E4M3 bit patterns as ``scales`` and ``global_scale`` fp32 ``[1]``."""
        return {**super().parts(codes, rows), "global_scale": self.global_scale.clone()}


# --------------------------------------------------------------------------- lookup and RTN


def observer_type(scheme: Scheme) -> ObserverType | None:
    """The observer class of ``scheme``: registered under its name (``mxfp4``), else its kind (``absmax``)."""
    return OBSERVERS.find(scheme.name) or OBSERVERS.find(scheme.kind)


def observer_for(scheme: Scheme, rows: int, cols: int, device: torch.device, *, scale_rule: str = "absmax",
                 weights: torch.Tensor | None = None, quant_weights: torch.Tensor | None = None,
                 tensor_amax: torch.Tensor | None = None) -> Observer:
    """A fresh observer for a ``[rows, cols]`` matrix of ``scheme`` (``weights``: that matrix, which nvfp4's
    global scale and the llama.cpp types' importance weighting need; ``quant_weights``: an importance
    matrix's entry, fp32 ``[cols]``, which only the llama.cpp types take; ``tensor_amax``: a fused group's
    largest ``max |w|``, which only nvfp4 takes, ``quantize_tensor``'s). A scheme with no observer raises ``SchemeError``."""
    kind = observer_type(scheme)
    if kind is None:
        raise SchemeError(f"no observer chooses the codes of scheme {scheme.name!r} (kind {scheme.kind}); "
                          f"observers exist for: {', '.join(OBSERVERS.names())}")
    if tensor_amax is not None:
        if not isinstance(scheme, GroupScaled):
            raise SchemeError(f"{scheme.name} has no per-tensor scale a fused layer shares (nvfp4 has)")
        return kind(scheme, rows, cols, device, scale_rule=scale_rule, weights=weights, tensor_amax=tensor_amax)
    if quant_weights is None:
        return kind(scheme, rows, cols, device, scale_rule=scale_rule, weights=weights)
    if not is_llama_type(scheme):  # only llama.cpp's encoders take one
        raise SchemeError(f"{scheme.name} does not take an importance matrix (--imatrix applies to llama.cpp's block types)")
    return kind(scheme, rows, cols, device, scale_rule=scale_rule, weights=weights, quant_weights=quant_weights)


def round_to_nearest(W: torch.Tensor, observer: Observer) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN through an observer: every unit's scales from ``W [rows, cols]`` (fp32, untouched), then each
    column rounded. Returns ``(codes, Ŵ)``, both fp32 ``[rows, cols]``; ``observer.parts(codes, rows)``
    gives the stored parts. One column at a time (the loop GPTQ runs, without its error feedback)."""
    for u in range(observer.n_units):
        observer.set_unit(u, W[:, u * observer.unit : (u + 1) * observer.unit])
    Wt = W.T.contiguous()
    codes_t, Q_t = torch.zeros_like(Wt), torch.zeros_like(Wt)
    for j in range(W.shape[1]):
        observer.quantize_into(Wt[j], j // observer.unit, codes_t[j], Q_t[j], j)
    codes, Q = codes_t.T.contiguous(), Q_t.T.contiguous()
    observer.finish(codes, torch.arange(W.shape[1], device=W.device) // observer.unit)
    return codes, Q


__all__ = ["MSE_NORM", "MSE_SHRINK", "OBSERVERS", "SCALE_RULES", "AbsmaxObserver", "MXFP4Observer", "NF4Observer",
           "NVFP4Observer", "Observer", "ObserverType", "ScaleRule", "absmax_rule", "full_range_rule", "mse_rule",
           "observer_for", "observer_type", "round_to_nearest"]
