"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv:2210.17323): integers and scales chosen against calibration activations.

For one linear layer with weight ``W [rows, cols]`` and calibration inputs ``X [cols, n]``, GPTQ
minimises the output error ``||W X - Ŵ X||²`` column by column. With ``H = 2 X Xᵀ`` (the Hessian of that
error; accumulated here as ``X Xᵀ`` in fp32, upper triangle only, then mirrored: the factor 2 and 1/n do
not change the solution), dampened by ``λ = dampening * mean(diag H)`` on the diagonal, and ``U`` the
upper Cholesky factor of ``H⁻¹`` (fp32 as in the reference, computed as ``J L⁻¹ J`` from the Cholesky
factor ``L`` of the reversed ``H``, see ``inverse_hessian_factor``), each column ``j`` in turn is
quantized and its error spread over the columns not yet quantized::

    q_j   = Q(w_j)                          the scheme's grid, with the scale of w_j's group
    e_j   = (w_j - q_j) / U[j, j]
    w_k  -= e_j * U[j, k]     for k > j     (applied lazily: within a block of 128 columns at once,
                                             then to the columns after the block in one matmul)

Numerics and choices, as the reference implementation (github.com/IST-DASLab/gptq) makes them:

* dead inputs (``H[i, i] == 0``: the column never sees a nonzero input): ``H[i, i] = 1``, ``W[:, i] = 0``;
* a non-positive-definite ``H`` (Cholesky fails): the dampening is multiplied by 10 and retried, up to
  ``MAX_DAMP_RETRIES`` times; the retries are reported in the record (after that, the layer is written
  with RTN and the record says so);
* scales per group are computed when the group's first column is reached, from the current (error-
  updated) weights, with qkit's own rule for the scheme (absmax: ``scale = absmax / qmax`` stored in the
  scheme's scale dtype and that stored value used both ways; NF4: the block's absmax, codes picked
  exactly as ``qkit.schemes.nf4`` picks them; mxfp4 / nvfp4: the block's scale and E2M1 codes exactly as
  ``qkit.schemes.fp4`` chooses them, see below); the lazy blocks are a multiple of the group size, so a
  group never straddles a block and "current" is exact. Per-row and per-tensor scales are set at column 0
  (from the original weights). A short last group per row (576 columns, g128) is a group like any other.
* ``act_order`` (on by default: it measured better, see the README): columns are processed by
  descending ``diag(H)``; the scales are then *static groups*
  (computed once from the original weights in the original column order, the reference's
  ``static_groups``), so the stored checkpoint keeps the original column order and the scheme's layout;
  codes are put back in the original order before packing.
* FP4 (``qkit.schemes.fp4``, bit for bit with its RTN, so a diagonal ``H`` gives RTN's bytes): mxfp4, per
  block of 32 columns of a row, the E8M0 exponent ``e`` of the block's current absmax
  (``mxfp4_exponents``), codes the E2M1 rounding of ``w * 2**(127 - e)`` with gguf's rule (ties to the
  smaller magnitude, +0 for a value that rounds to 0), ``Ŵ = E2M1 * 2**(e - 127)``; nvfp4, the fp32 global
  scale ``gs`` once from the whole weight (``nvfp4_global_scale``, as RTN: before dead columns are
  zeroed), per block of 16 the E4M3 scale ``s`` of the block's current absmax (``nvfp4_block_scales``),
  codes the ties-to-even rounding of ``w / (s / gs)`` (-0 for a small negative), ``Ŵ = E2M1 * (s / gs)``.
  The parts are ``encode``'s layout (``qweight`` packed by ``pack_fp4``, uint8 ``scales`` ``[rows, cols/B]``,
  nvfp4's ``global_scale``). A width that is not whole blocks is refused (one line), as with nf4.

The result is a ``QuantizedTensor`` of the *same* scheme RTN writes (built with the scheme's own parts
layout), so every writer and exporter takes it unchanged. Targets outside the transformer blocks (or not
``nn.Linear``) are quantized with RTN, and the record lists them.

Layer by layer (``qkit.methods.sequential.walk_blocks``). By default all calibration windows go through a
block in one batch and each linear is quantized in its forward pre-hook, before it runs: its ``H`` comes
from inputs that already went through the block's quantized earlier linears (the reference's "true
sequential" order: q/k/v, then o, then gate/up, then down), and the block's output, computed with every
linear quantized, is the next block's input: one forward pass per block. Linears fed the same tensor
(q/k/v, gate/up) share its ``H``, dead columns, permutation and ``U``. With ``batch_size`` below the
number of windows, ``H`` is accumulated batch by batch with the block's original weights, the linears
are quantized, and the block is run again (two passes per block, peak memory one batch).

Speed. The column loop's operations touch ``rows`` numbers each, so it runs on one CPU thread (a thread
barrier per operation costs more than the operation on a shared machine) and in sub-blocks of 16 columns
(the per-column update stays small; each sub-block's error reaches the rest of its lazy block in one
matmul). The forward passes and the Hessians (matmuls) use every thread.

Record (manifest ``method``): options, calibration provenance, per-layer output-side reconstruction
error ``||W X - Ŵ X||² / ||W X||²`` on the calibration inputs for RTN and for GPTQ (computed from the
undamped ``Xᵀ X``: ``tr(Δ XXᵀ Δᵀ)``), per-layer solve seconds, per-block seconds, dampening retries.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import InputError, SchemeError
from qkit.granularity import PerGroup, PerTensor
from qkit.methods import MethodResult
from qkit.methods.calibration import DEFAULT_SAMPLES, DEFAULT_SEED, DEFAULT_SEQLEN, CalibrationOptions
from qkit.schemes import QuantizedTensor, quantize_tensor
from qkit.schemes.absmax import absmax_scales, dequantize_absmax, quantize_absmax
from qkit.schemes.fp4 import (
    MXFP4Scheme,
    NVFP4Scheme,
    e2m1_codes,
    e2m1_table,
    e8m0_reciprocals,
    e8m0_values,
    mxfp4_exponents,
    nvfp4_block_scales,
    nvfp4_global_scale,
    pack_fp4,
)
from qkit.schemes.nf4 import nf4_codes, nf4_tables
from qkit.schemes.packing import pack_nibbles
from qkit.schemes.registry import AbsmaxScheme, NF4Scheme
from qkit.threads import one_torch_thread

DEFAULT_DAMPENING = 0.01  # fraction of mean(diag H) added to the diagonal (the reference's percdamp)
DEFAULT_BLOCK_SIZE = 128  # columns per lazy batch update (the reference's blocksize)
MAX_DAMP_RETRIES = 5  # dampening x10 each time H (or H^-1) is not positive definite
# How an absmax scheme's scales are chosen (NF4, mxfp4, nvfp4 always use their own rule). Every rule writes a valid
# tensor of the same scheme (decoding is q * scale whatever chose the scale):
#   absmax      qkit's rule, what --method rtn writes: scale = absmax / qmax (the default);
#   full-range  scale = absmax / (qmax + 0.5), codes clamped to [-qmax-1, qmax]: the full signed range, as
#               compressed-tensors' symmetric observer (llm-compressor) chooses it (issue 9);
#   mse         per group, the scale p * absmax / qmax with p in {1.00, 0.99, ..., 0.80} that minimises
#               sum |w - Ŵ|^2.4 over the group (the reference GPTQ quantizer's ``mse`` search, on a shorter grid).
SCALE_RULES = ("absmax", "full-range", "mse")
MSE_SHRINK = tuple(1 - i / 100 for i in range(21))
MSE_NORM = 2.4


@dataclass(frozen=True)
class GPTQOptions:
    """Options of ``--method gptq``; every default defined here once."""

    calibration: str | None = None  # None: the pinned KJV Genesis+Exodus; a UTF-8 file; hf:DATASET
    calibration_samples: int = DEFAULT_SAMPLES
    calibration_seqlen: int = DEFAULT_SEQLEN
    calibration_seed: int = DEFAULT_SEED
    dampening: float = DEFAULT_DAMPENING
    # columns by descending diag(H), static group scales: measured on the default model (README), int4-g64
    # perplexity 19.26 with it against 21.25 without; act_order=False gives the reference's default order
    act_order: bool = True
    scale_rule: str = "absmax"  # see SCALE_RULES
    block_size: int = DEFAULT_BLOCK_SIZE
    # calibration windows per forward call; None: all in one batch, one pass per block (true sequential)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        self.check()  # malformed options are refused when the options are made, before any model is read

    def check(self) -> None:
        if not (isinstance(self.dampening, (int, float)) and 0 < self.dampening < 1e3 and math.isfinite(self.dampening)):
            raise InputError(f"--dampening must be a positive fraction of the mean Hessian diagonal (e.g. 0.01), got {self.dampening!r}")
        if self.scale_rule not in SCALE_RULES:
            raise InputError(f"unknown GPTQ scale rule {self.scale_rule!r}; use one of {', '.join(SCALE_RULES)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InputError(f"GPTQ block size must be a positive integer, got {self.block_size!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise InputError(f"calibration batch size must be a positive integer, got {self.batch_size!r}")
        self.calibration_options().check()

    def calibration_options(self) -> CalibrationOptions:
        return CalibrationOptions(self.calibration, self.calibration_samples, self.calibration_seqlen, self.calibration_seed)


# --------------------------------------------------------------------------- grids


class _AbsmaxGrid:
    """qkit's absmax rule, one scale per unit of ``unit`` columns of a row (or one for the tensor).

    Per-unit values are kept as rows (``[n_units, rows]``) so the column loop reads contiguous vectors."""

    def __init__(self, scheme: AbsmaxScheme, rows: int, cols: int, device: torch.device, scale_rule: str = "absmax"):
        self.scheme = scheme
        self.qmax = 2 ** (scheme.bits - 1) - 1
        self.rule = scale_rule
        g = scheme.granularity
        self.per_tensor = isinstance(g, PerTensor)
        self.unit = g.size if isinstance(g, PerGroup) else cols
        self.n_units = -(-cols // self.unit)
        r = 1 if self.per_tensor else rows
        self.stored = torch.zeros(self.n_units, r, dtype=scheme.scale_dtype, device=device)
        self.divisor = torch.ones(self.n_units, r, device=device)
        self.scale = torch.zeros(self.n_units, r, device=device)

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        """Scales of unit ``u`` from ``w [rows, unit_cols]`` (fp32, the current weights; any strides)."""
        units = w.reshape(1, -1) if self.per_tensor else w
        if self.rule == "absmax":
            s = absmax_scales(units, self.scheme.bits, self.scheme.scale_dtype)[:, 0]
        else:
            s = self._searched(units)
        self.stored[u] = s
        f = s.float()
        self.scale[u] = f
        self.divisor[u] = torch.where(f > 0, f, torch.ones_like(f))  # zero unit -> codes set to 0 in finish()

    def _searched(self, units: torch.Tensor) -> torch.Tensor:
        """Stored scales ``[n]`` of ``units [n, k]`` under the ``full-range`` or ``mse`` rule (see ``SCALE_RULES``)."""
        absmax = units.abs().amax(dim=1)
        dtype = self.scheme.scale_dtype
        if self.rule == "full-range":
            return (absmax / (self.qmax + 0.5)).to(dtype)
        shrink = torch.tensor(MSE_SHRINK, device=units.device)
        cand = (shrink[:, None] * absmax[None, :] / self.qmax).to(dtype).float()  # [C, n]
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))[:, :, None]
        q = torch.div(units[None], safe).round_().clamp_(-self.qmax - 1, self.qmax).mul_(cand[:, :, None])
        err = q.sub_(units[None]).abs_().pow_(MSE_NORM).sum(dim=2)  # [C, n]
        best = err.argmin(dim=0)  # the first (largest) scale among equals: p = 1 wins ties
        return cand.gather(0, best[None])[0].to(dtype)

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor) -> None:
        """Column ``w [rows]`` (fp32) -> codes (as floats) and dequantized values, written into ``codes``/``deq``."""
        torch.div(w, self.divisor[u], out=codes).round_().clamp_(-self.qmax - 1, self.qmax)
        torch.mul(codes, self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        """``codes [rows, cols]``: a unit whose scale is 0 (all zeros when its scale was set) gets code 0."""
        zero = (self.scale == 0).T[:, units]  # [rows or 1, cols]
        codes.masked_fill_(zero.expand_as(codes), 0.0)

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """Stored parts of the rows ``rows`` (codes in the original column order)."""
        q = codes[rows].to(torch.int8)
        scales = self.stored.T if self.per_tensor else self.stored.T[rows]
        shape = self.scheme.granularity.scale_shape(tuple(q.shape))
        return {"qweight": self.scheme.pack_codes(q), "scales": scales.reshape(shape).clone()}


class _NF4Grid:
    """NF4 codebook, one absmax per block of ``block_size`` columns (blocks within rows: cols % 64 == 0)."""

    def __init__(self, scheme: NF4Scheme, rows: int, cols: int, device: torch.device):
        self.scheme = scheme
        self.unit = scheme.block_size
        self.n_units = cols // self.unit
        self.per_tensor = False
        self.levels, _ = nf4_tables(device)
        self.inverse = torch.zeros(self.n_units, rows, device=device)
        self.stored = torch.zeros(self.n_units, rows, dtype=scheme.scale_dtype, device=device)
        self.scale = torch.zeros(self.n_units, rows, device=device)

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        absmax = w.abs().amax(dim=1)
        # qkit/bitsandbytes: codes from the fp32 absmax (w * (1 / absmax)), the absmax stored in scale_dtype
        self.inverse[u] = 1.0 / absmax.clamp(min=1e-38)
        self.stored[u] = absmax.to(self.scheme.scale_dtype)
        self.scale[u] = self.stored[u].float()

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor) -> None:
        c = nf4_codes(w * self.inverse[u])
        codes.copy_(c)
        torch.mul(self.levels[c], self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        pass  # a zero block: every value scales to 0 or beyond +-1; its levels times absmax 0 decode to 0

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        return {"qweight": pack_nibbles(codes[rows].to(torch.int32)), "scales": self.stored.T[rows].reshape(-1).clone()}


class _MXFP4Grid:
    """MXFP4: E2M1 codes, one E8M0 (power-of-two) scale per block of 32 columns of a row, chosen and
    applied exactly as ``qkit.schemes.fp4.quantize_mxfp4`` does (gguf's rule, ties to the smaller magnitude,
    a value that rounds to 0 is +0)."""

    ties_to_even = False

    def __init__(self, scheme: MXFP4Scheme, rows: int, cols: int, device: torch.device):
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

    def set_unit(self, u: int, w: torch.Tensor) -> None:
        e = mxfp4_exponents(w.abs().amax(dim=1))
        self.stored[u] = e.to(torch.uint8)
        self.multiplier[u] = e8m0_reciprocals(e)  # 2**(127 - e): the scheme multiplies by it, exactly
        self.scale[u] = e8m0_values(e)

    def _codes(self, w: torch.Tensor, u: int) -> torch.Tensor:
        torch.mul(w, self.multiplier[u], out=self._y[0, : self.rows])
        return e2m1_codes(self._y, ties_to_even=self.ties_to_even)[0, : self.rows].long()

    def quantize_into(self, w: torch.Tensor, u: int, codes: torch.Tensor, deq: torch.Tensor) -> None:
        c = self._codes(w, u)
        codes.copy_(c)
        torch.mul(self.values[c], self.scale[u], out=deq)

    def finish(self, codes: torch.Tensor, units: torch.Tensor) -> None:
        pass  # a zero block has e = 0: its values scale to 0 and code +0, which decodes to 0

    def parts(self, codes: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """As ``encode``: ``qweight`` uint8 ``[rows, cols / 2]`` (``pack_fp4``), ``scales`` uint8 ``[rows, cols / B]``."""
        return {"qweight": pack_fp4(codes[rows].to(torch.uint8)),
                "scales": self.stored.T[rows].clone(memory_format=torch.contiguous_format)}


class _NVFP4Grid(_MXFP4Grid):
    """NVFP4: E2M1 codes, one E4M3 scale ``s`` per block of 16 columns of a row and one fp32 global scale
    ``gs`` for the tensor, computed once from the whole weight given (``W`` as the solve receives it),
    exactly as ``qkit.schemes.fp4.quantize_nvfp4`` (compressed-tensors' rule): ``y = w / (s / gs)``, ties to
    even, a negative value that rounds to 0 is -0."""

    ties_to_even = True

    def __init__(self, scheme: NVFP4Scheme, rows: int, cols: int, device: torch.device, weights: torch.Tensor):
        super().__init__(scheme, rows, cols, device)  # type: ignore[arg-type]
        self.global_scale = nvfp4_global_scale(weights.to(device=device, dtype=torch.float32).abs().amax())

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


_BLOCK_SCHEMES = (NF4Scheme, MXFP4Scheme, NVFP4Scheme)  # blocks along each row: cols must be whole blocks


def _whole_blocks(scheme: Any, cols: int, tensor: str | None = None) -> None:
    """One-line refusal of a width that is not whole blocks of a block scheme (nf4, mxfp4, nvfp4)."""
    if not isinstance(scheme, _BLOCK_SCHEMES) or (cols > 0 and cols % scheme.block_size == 0):
        return
    what = f"{tensor} has {cols} columns" if tensor else f"this matrix has {cols} columns"
    raise SchemeError(
        f"GPTQ with {scheme.name} needs rows that are whole blocks of {scheme.block_size} ({what}): "
        f"{scheme.name} blocks would cross rows; use an absmax scheme (int4-gN, int4-row), "
        + (f"leave it out with --exclude '{tensor}', " if tensor else "")
        + "or --method rtn"
    )


def _grid(scheme: Any, rows: int, cols: int, device: torch.device, scale_rule: str = "absmax",
          weights: torch.Tensor | None = None):
    """The grid GPTQ rounds ``W [rows, cols]`` onto; ``weights`` (``W`` itself) is needed by nvfp4 only,
    whose global scale is the whole tensor's."""
    if isinstance(scheme, AbsmaxScheme):
        return _AbsmaxGrid(scheme, rows, cols, device, scale_rule)
    _whole_blocks(scheme, cols)
    if isinstance(scheme, NF4Scheme):
        return _NF4Grid(scheme, rows, cols, device)
    if isinstance(scheme, NVFP4Scheme):
        if weights is None:
            raise InputError("GPTQ with nvfp4 needs the weights: its global scale is the whole tensor's")
        return _NVFP4Grid(scheme, rows, cols, device, weights)
    if isinstance(scheme, MXFP4Scheme):
        return _MXFP4Grid(scheme, rows, cols, device)
    raise SchemeError(_unsupported(scheme))


def _unsupported(scheme: Any) -> str:
    return (f"GPTQ cannot choose the codes of scheme {scheme.name!r} (kind {getattr(scheme, 'kind', '?')}); "
            "it serves absmax schemes (int8-tensor, int8-row, int4-tensor, int4-row, int4-gN, int8-gN), nf4, "
            "mxfp4 and nvfp4 (not the llama.cpp block formats): pick one of those or use --method rtn")


# --------------------------------------------------------------------------- the solver


@dataclass
class SolveResult:
    """What one GPTQ solve of a ``[rows, cols]`` matrix produced."""

    codes: torch.Tensor  # [rows, cols] in the original column order (float holding integers / int codes)
    dequantized: torch.Tensor  # [rows, cols] fp32, what the stored parts decode to
    grid: Any  # holds the scales; ``grid.parts(codes, rows)`` gives the stored parts
    dampening: float  # the fraction finally used
    retries: int  # how many times the dampening was raised
    dead: int  # dead input columns
    fallback: bool = False  # H never became positive definite: RTN was used


def inverse_hessian_factor(H: torch.Tensor, dampening: float, retries: int = MAX_DAMP_RETRIES) -> tuple[torch.Tensor | None, float, int]:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``Uᵀ U = (H + λI)⁻¹``), ``λ = dampening * mean(diag H)``.

    fp32, as the reference. Computed without forming the inverse: with ``J`` the reversal permutation and
    ``J (H + λI) J = L Lᵀ``, ``U = J L⁻¹ J`` (upper triangular, and ``Uᵀ U = J L⁻ᵀ L⁻¹ J = (H + λI)⁻¹``):
    one Cholesky and one triangular solve. Retries with ``dampening * 10`` while the factorisation fails;
    returns ``(U or None, dampening used, retries)``. ``H``: symmetric ``[cols, cols]``; not modified.
    """
    H32 = H.to(torch.float32)
    mean_diag = H32.diagonal().mean()
    eye = torch.eye(H32.shape[0], dtype=torch.float32, device=H32.device)
    damp = dampening
    for attempt in range(retries + 1):
        Hd = H32.flip(0, 1).clone()  # J H J; its diagonal is H's diagonal reversed
        Hd.diagonal().add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            U = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
            if bool(torch.isfinite(U).all()):
                return U, damp, attempt
        damp *= 10
    return None, damp / 10, retries


@dataclass
class PreparedHessian:
    """What every linear fed the same inputs shares: dead columns, the act-order permutation and ``U``."""

    U: torch.Tensor | None  # fp32 [cols, cols], upper Cholesky factor of (H + λI)^-1, permuted order; None: failed
    perm: torch.Tensor | None  # act order: processing order of the original columns
    dead: torch.Tensor  # bool [cols]: H[i, i] == 0
    dampening: float  # the fraction finally used
    retries: int


def prepare_hessian(H: torch.Tensor, dampening: float = DEFAULT_DAMPENING, act_order: bool = False) -> PreparedHessian:
    """Dead columns (``H[i, i] = 1``), act-order permutation (descending ``diag H``) and the factor ``U``."""
    H = H.to(torch.float32).clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    perm = None
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        H = H[perm][:, perm]
    U, damp, retries = inverse_hessian_factor(H, dampening)
    return PreparedHessian(U, perm, dead, damp, retries)


# Columns per inner sub-block: the per-column update touches rows x SUB_BLOCK weights, small enough for
# torch to run it on one thread (a thread-pool barrier per column costs milliseconds on a busy machine);
# each sub-block's error then reaches the rest of the lazy block in one matmul. Same arithmetic, regrouped.
SUB_BLOCK = 16


def gptq_solve(
    W: torch.Tensor,
    H: torch.Tensor | None,
    scheme: Any,
    *,
    dampening: float = DEFAULT_DAMPENING,
    block_size: int = DEFAULT_BLOCK_SIZE,
    act_order: bool = False,
    prepared: PreparedHessian | None = None,
    scale_rule: str = "absmax",
) -> SolveResult:
    """GPTQ of one weight ``W [rows, cols]`` against ``H [cols, cols]`` (``Xᵀ X`` of its inputs, any scale),
    or against ``prepared`` (``prepare_hessian(H, dampening, act_order)``, shared by layers with one input).

    Runs on ``W``'s device, fp32. Returns codes in the original column order,
    the dequantized weights and the grid holding the scales (see the module docstring for every choice).
    """
    rows, cols = W.shape
    if prepared is None:
        if H is None or tuple(H.shape) != (cols, cols):
            raise InputError(f"H has shape {None if H is None else list(H.shape)}, expected [{cols}, {cols}]")
        prepared = prepare_hessian(H.to(W.device), dampening, act_order)
    perm, U = prepared.perm, prepared.U
    device = W.device
    W = W.to(torch.float32).clone()
    # nvfp4's global scale: from the whole W as given (as RTN computes it), before dead columns are zeroed
    grid = _grid(scheme, rows, cols, device, scale_rule, weights=W)
    n_dead = int(prepared.dead.sum())
    if n_dead:
        W[:, prepared.dead] = 0.0
    static = perm is not None or grid.unit >= cols or grid.per_tensor
    if static:  # scales from the original weights, original column order
        for u in range(grid.n_units):
            grid.set_unit(u, W[:, u * grid.unit : (u + 1) * grid.unit])
    if U is None:
        return _rtn_fallback(W, grid, prepared.dampening, prepared.retries, n_dead)
    if perm is not None:
        W = W[:, perm]
    # Lazy blocks are whole groups, and every group start begins a sub-block, so a group's scale is
    # computed from fully updated weights. The loop works on transposed copies (``[cols, rows]``), so each
    # column is a contiguous vector.
    unit = grid.unit
    bs = block_size if static else unit * max(1, block_size // unit)
    order = torch.arange(cols) if perm is None else perm.cpu()
    unit_of = (order // unit).tolist()
    Wt = W.T.contiguous()
    codes_t = torch.zeros(cols, rows, device=device)
    Q_t = torch.zeros(cols, rows, device=device)
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        n = i2 - i1
        W1 = Wt[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        diag = U1.diagonal().tolist()
        s1 = 0
        while s1 < n:
            s2 = min(s1 + SUB_BLOCK, n)
            if not static:
                s2 = min(s2, ((i1 + s1) // unit + 1) * unit - i1)
            for i in range(s1, s2):
                j = i1 + i
                if not static and j % unit == 0:
                    grid.set_unit(unit_of[j], W1[i : i + unit].T)
                w = W1[i]
                q = Q_t[j]
                grid.quantize_into(w, unit_of[j], codes_t[j], q)
                err = torch.sub(w, q, out=Err1[i]).div_(diag[i])
                if i + 1 < s2:
                    W1[i + 1 : s2].addr_(U1[i, i + 1 : s2], err, alpha=-1.0)
            if s2 < n:
                W1[s2:].addmm_(U1[s1:s2, s2:].T, Err1[s1:s2], alpha=-1.0)
            s1 = s2
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err1, alpha=-1.0)
    codes, Q = codes_t.T, Q_t.T
    if perm is not None:
        inv = torch.argsort(perm)
        codes, Q = codes[:, inv], Q[:, inv]
    codes, Q = codes.contiguous(), Q.contiguous()
    grid.finish(codes, torch.arange(cols, device=device) // unit)
    return SolveResult(codes, Q, grid, prepared.dampening, prepared.retries, n_dead)


def _rtn_fallback(W: torch.Tensor, grid: Any, damp: float, retries: int, n_dead: int) -> SolveResult:
    """H never became positive definite: round to nearest on the same grid (``W`` in the original order)."""
    for u in range(grid.n_units):
        grid.set_unit(u, W[:, u * grid.unit : (u + 1) * grid.unit])
    Wt = W.T.contiguous()
    codes_t, Q_t = torch.zeros_like(Wt), torch.zeros_like(Wt)
    for j in range(W.shape[1]):
        grid.quantize_into(Wt[j], j // grid.unit, codes_t[j], Q_t[j])
    codes, Q = codes_t.T.contiguous(), Q_t.T.contiguous()
    grid.finish(codes, torch.arange(W.shape[1], device=W.device) // grid.unit)
    return SolveResult(codes, Q, grid, damp, retries, n_dead, fallback=True)


def output_errors(W: torch.Tensor, W_hats: list[torch.Tensor], XtX: torch.Tensor) -> list[float]:
    """``||W X - Ŵ X||² / ||W X||²`` for each ``Ŵ`` of ``W_hats``, from ``XtX = X Xᵀ`` (any positive scale):
    ``tr(Δ G Δᵀ) / tr(W G Wᵀ)`` with ``Δ = W - Ŵ``; fp32 matmuls, row sums accumulated in fp64."""
    G = XtX.to(torch.float32)
    W = W.to(device=G.device, dtype=torch.float32)

    def quad(M: torch.Tensor) -> float:
        return float(torch.linalg.vecdot(M @ G, M).sum(dtype=torch.float64))

    den = quad(W)
    return [quad(W - h.to(device=G.device, dtype=torch.float32)) / den if den > 0 else 0.0 for h in W_hats]


def rtn_dequantized(W: torch.Tensor, scheme: Any) -> torch.Tensor:
    """What ``--method rtn`` would store for ``W`` (fp32 ``[rows, cols]``), dequantized to fp32: absmax
    schemes through qkit's own quantizer without packing the codes; others through ``quantize_tensor``."""
    if isinstance(scheme, AbsmaxScheme):
        q, scales = quantize_absmax(W, scheme.bits, scheme.granularity, scheme.scale_dtype)
        return dequantize_absmax(q, scales, scheme.granularity, torch.float32)
    return quantize_tensor(W, scheme).dequantize(torch.float32)


def output_error(W: torch.Tensor, W_hat: torch.Tensor, XtX: torch.Tensor) -> float:
    """``||W X - Ŵ X||² / ||W X||²`` (see ``output_errors``)."""
    return output_errors(W, [W_hat], XtX)[0]


# --------------------------------------------------------------------------- the method


def _source_dtypes(directory) -> dict[str, torch.dtype]:
    from qkit.checkpoint import open_safetensors, weight_files

    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    out = {}
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for k in f.keys():
                out[k] = names.get(f.get_slice(k).get_dtype(), torch.float32)
    return out


def accumulate_gram(H: torch.Tensor, x: torch.Tensor, chunk: int = 256) -> None:
    """``H += xᵀ x`` on and above the diagonal only (``x [n, d]``, ``H [d, d]`` fp32); ``symmetrize(H)``
    completes it. Block rows of ``chunk`` columns: about 60-70 % of a full product's multiply-adds for
    d = 576-1536 (the Hessians cost about as much as the block's forward pass)."""
    d = x.shape[1]
    for a in range(0, d, chunk):
        b = min(a + chunk, d)
        H[a:b, a:].addmm_(x[:, a:b].T, x[:, a:])


def symmetrize(H: torch.Tensor) -> torch.Tensor:
    """The full symmetric matrix from its upper triangle (as ``accumulate_gram`` leaves it), in place."""
    strict = H.triu(1)
    return H.copy_(H.triu().add_(strict.T))


class _Inputs:
    """``Xᵀ X`` (fp32) per distinct input tensor: linears called in a row with the *same* tensor object
    (q/k/v on the attention norm's output, gate/up on the MLP norm's) share one accumulator and one
    prepared factor."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._complete: set[str] = set()
        self.owner: dict[str, str] = {}
        self.tokens: dict[str, int] = {}
        self._last: tuple[torch.Tensor, str] | None = None

    def add(self, name: str, x: torch.Tensor) -> str:
        """Account ``x`` (the input of linear ``name``); returns the name owning its accumulator."""
        if self._last is not None and self._last[0] is x:
            self.owner[name] = self._last[1]
            return self._last[1]
        self._last = (x, name)
        self.owner[name] = name
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        if name not in self._sums:
            self._sums[name] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
            self.tokens[name] = 0
        self._complete.discard(name)
        accumulate_gram(self._sums[name], x2)
        self.tokens[name] += x2.shape[0]
        return name

    def gram(self, owner: str) -> torch.Tensor:
        """The full ``Xᵀ X`` of ``owner``'s input."""
        if owner not in self._complete:
            symmetrize(self._sums[owner])
            self._complete.add(owner)
        return self._sums[owner]

    def release(self) -> None:
        self._last = None


@dataclass
class GPTQMethod:
    """``--method gptq``: see the module docstring."""

    name: str = "gptq"
    calibrated: bool = True
    options_type: type = GPTQOptions

    def check(self, scheme: Any) -> None:
        if isinstance(scheme, (AbsmaxScheme, *_BLOCK_SCHEMES)):
            return  # nf4 / fp4 rows that are not whole blocks are refused per matrix, before any pass
        raise SchemeError(_unsupported(scheme))

    def run(self, ref: Any, targets: dict[str, Any], options: GPTQOptions, *, device: torch.device,
            on_block: Callable[[int, int], None] | None = None) -> MethodResult:
        from qkit.checkpoint import iter_tensors, tensor_shapes
        from qkit.methods.calibration import calibration_ids
        from qkit.methods.sequential import walk_blocks
        from qkit.models import load
        from qkit.schemes.registry import as_2d

        options.check()
        for scheme in targets.values():
            self.check(scheme)
        shapes = dict(tensor_shapes(ref.directory))
        for name, scheme in targets.items():  # a matrix a block scheme cannot serve row-wise: refused before any work
            if name in shapes:
                _whole_blocks(scheme, as_2d(shapes[name])[1], name)
        t_start = time.perf_counter()
        loaded = load(ref=ref, device="cpu", dtype=torch.float32)
        ids, provenance = calibration_ids(loaded.tokenizer, options.calibration_options())
        batch = options.batch_size or ids.shape[0]
        one_pass = batch >= ids.shape[0]
        dtypes = _source_dtypes(ref.directory)
        quantized: dict[str, QuantizedTensor] = {}
        layers: dict[str, dict[str, Any]] = {}
        blocks: list[dict[str, Any]] = []

        def solve(full: str, linear: torch.nn.Linear, XtX: torch.Tensor, prepared: PreparedHessian, tokens: int,
                  shared: float) -> None:
            scheme = targets[full]
            ts = time.perf_counter()
            W = linear.weight.detach().to(device=XtX.device, dtype=torch.float32)
            with one_torch_thread():
                solved = gptq_solve(W, None, scheme, block_size=options.block_size, prepared=prepared,
                                    scale_rule=options.scale_rule)
            seconds = time.perf_counter() - ts
            parts = {k: v.cpu() for k, v in solved.grid.parts(solved.codes, slice(0, W.shape[0])).items()}
            qt = QuantizedTensor.from_parts(scheme, parts, tuple(linear.weight.shape), dtypes.get(full, torch.float32))
            # The solve's dequantized weights are what the stored parts decode to (bit for bit: tested), so
            # the codes need not be unpacked again here.
            W_hat = solved.dequantized
            rtn_err, gptq_err = output_errors(W, [rtn_dequantized(W, scheme), W_hat], XtX)
            layers[full] = {
                "rtn_error": rtn_err,
                "gptq_error": gptq_err,
                "seconds": round(seconds + shared, 4),
                "tokens": tokens,
                "dampening": solved.dampening,
                "dampening_retries": solved.retries,
                "dead_columns": solved.dead,
                **({"fallback": "rtn (H not positive definite)"} if solved.fallback else {}),
            }
            quantized[full] = qt
            linear.weight.data.copy_(W_hat.to(linear.weight.device))

        def prepare(XtX: torch.Tensor) -> PreparedHessian:
            with one_torch_thread():
                return prepare_hessian(XtX, options.dampening, options.act_order)

        def process(i: int, block: torch.nn.Module, inputs) -> list[torch.Tensor] | None:
            t0 = time.perf_counter()
            linears = {n: m for n, m in inputs.linears().items() if inputs.prefix + n + ".weight" in targets}
            if not linears:
                return None
            acc = _Inputs()
            if one_pass:
                # True sequential, one pass: each linear is quantized in its forward pre-hook, from inputs
                # that already went through the block's quantized earlier linears; the block's outputs are
                # the next block's inputs. Linears fed the same tensor share its Hessian and factor.
                cache: dict[str, PreparedHessian] = {}

                def quantize_now(n: str, x: torch.Tensor) -> None:
                    tp = time.perf_counter()
                    owner = acc.add(n, x)
                    if owner == n:
                        cache.clear()
                        cache[owner] = prepare(acc.gram(owner))
                    shared = time.perf_counter() - tp
                    solve(inputs.prefix + n + ".weight", linears[n], acc.gram(owner), cache[owner], acc.tokens[owner], shared)

                outputs = inputs.forward(on_input=quantize_now, modules=linears)
            else:
                # Batches: accumulate every Hessian with the block's original weights, quantize, and let the
                # walker run the block again with the quantized weights.
                inputs.forward(on_input=acc.add, modules=linears)
                outputs = None
                prepared = {}
                for n in linears:
                    owner = acc.owner[n]
                    tp = time.perf_counter()
                    if owner not in prepared:
                        prepared[owner] = prepare(acc.gram(owner))
                    solve(inputs.prefix + n + ".weight", linears[n], acc.gram(owner), prepared[owner],
                          acc.tokens[owner], time.perf_counter() - tp)
            acc.release()
            blocks.append({"block": i, "seconds": round(time.perf_counter() - t0, 3)})
            return outputs

        walk_blocks(loaded.model, ids, process, device=device, batch_size=batch, on_block=on_block)
        rtn_fallback = sorted(set(targets) - set(quantized))
        if rtn_fallback:  # targets outside the blocks (or not nn.Linear): round to nearest, streamed
            for name, tensor in iter_tensors(ref.directory):
                if name in rtn_fallback:
                    quantized[name] = quantize_tensor(tensor, targets[name], name=name)
        record = {
            "options": dataclasses.asdict(options),
            "calibration": provenance,
            "passes": "one per block (true sequential: each linear quantized in its forward pre-hook)" if one_pass
            else "two per block (Hessians with the original weights, then the block re-run quantized)",
            "hessian": "X^T X accumulated in fp32; dampening and the Cholesky factor of the inverse in fp32",
            "scales": ("static groups from the original weights, original column order (act_order)" if options.act_order
                       else "per group when its first column is reached, from the error-updated weights"),
            "layers": dict(sorted(layers.items())),
            "blocks": blocks,
            "dampening_retries": {n: r["dampening_retries"] for n, r in sorted(layers.items()) if r["dampening_retries"]},
            "rtn_fallback": rtn_fallback,
            "seconds": round(time.perf_counter() - t_start, 3),
        }
        return MethodResult(quantized=quantized, replaced={}, record=record)


METHOD = GPTQMethod()

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_DAMPENING", "GPTQOptions", "METHOD", "PreparedHessian", "SolveResult",
           "gptq_solve", "inverse_hessian_factor", "output_error", "output_errors", "prepare_hessian"]
