"""LLM.int8 (Dettmers et al., arXiv:2208.07339): mixed-precision decomposition of every block projection.

What bitsandbytes 0.50.2 computes (``Linear8bitLt`` in eval mode -> ``MatMul8bitLt.forward`` ->
``int8_vectorwise_quant`` and ``int8_mixed_scaled_mm``, read from its ``autograd/_functions.py`` and
``backends/default/ops.py``), and what this module reproduces, for an input ``X [T, K]`` and a weight
``W [N, K]``:

1. ``X`` is cast to fp16 (bitsandbytes casts every input; the model's own dtype is fp32 here).
2. Outliers: the elements with ``|X| >= threshold`` (``>=``, default 6.0); the *outlier columns* are the
   input features holding one anywhere in the batch.
3. Int8 part: the outlier elements are zeroed, each token row gets ``s_x = max|row| / 127`` over what is
   left (the non-outlier elements of an outlier column still count towards it, as in bitsandbytes), the
   codes are ``round(X * (127 / max|row|))`` (half to even) and the codes of the outlier columns are set to
   0. The weight, cast to fp16, is quantized per output row the same way: ``C_W``, ``s_w = max|W_n| / 127``.
   Output: ``(C_X C_Wᵀ) * s_x s_wᵀ``: the integer product summed *exactly* and rounded once to fp32
   (what bitsandbytes' int32 accumulator gives when ``int8_mm_dequant`` converts it; see
   ``int_matmul_fp32``), then scaled in fp32 (``* s_x``, then ``* s_w``).
4. 16-bit part: the outlier columns of the fp16 input times the same columns of the *int8-dequantized*
   weight ``C_W * s_w`` (bitsandbytes 0.50.2 dequantizes ``CB[:, outlier_cols]``; its TODO to use the
   fp16 weight applies only to ``has_fp16_weights``; the paper describes fp16 weights: with the named
   row's int8-row weights the two coincide), added to the int8 part.

Differences from bitsandbytes, all below fp16 resolution: it rescales with the constant
``6.200124e-05`` where ``1/127**2 = 6.2000124e-05`` (relative 1.8e-5) and rounds its output to fp16;
here the rescale is ``1/127**2`` (folded into the weight row's absmax, in fp32) and the output stays in
the model's dtype (fp32). An all-zero row gets codes 0 here (bitsandbytes divides by zero). Its CPU backend in *training* mode takes another
path (``MatMul8bitFp``: dequantized weight, no activation quantization); eval mode runs the above.

Statistics per linear (``Handle.stats()``): the columns that went to 16-bit at least once (of ``K``), the
mean share per forward call, and the share of multiply-adds ``sum_calls T * outlier_cols / sum_calls T * K``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qkit.bounds import real
from qkit.errors import InputError
from qkit.simulate.base import SimulationContext, register_simulation
from qkit.simulate.activations import target_linears
from qkit.simulate.options import build, register_options

QMAX = 127
DEFAULT_THRESHOLD = 6.0  # bitsandbytes' and the paper's outlier threshold
FP16_MAX = 65504.0  # the largest finite fp16: the --threshold's upper bound
# Integer products |c_x c_w| <= 127 * 127 = 16,129; a sum of K of them stays an exact fp32 integer while
# it is below 2**24, i.e. for K <= 2**24 // 16129 = 1040 terms. Longer sums are split into chunks of
# at most this many columns, each chunk summed in fp32 (exact), the chunks added in fp64 (exact).
EXACT_FP32_TERMS = 2**24 // (QMAX * QMAX)
CHUNK = 1024


@dataclass(frozen=True)
class LLMInt8Options:
    """``threshold``: an input feature goes to 16-bit when some ``|x| >= threshold`` (must be > 0)."""

    threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t or t == float("inf"):
            raise InputError(f"--threshold must be a positive number (LLM.int8's default is {DEFAULT_THRESHOLD}), got {t!r}")
        real(t, "--threshold", 0, FP16_MAX, above=True)  # activations are fp16: a larger threshold never splits a column


register_options("llm-int8", LLMInt8Options)


def rowwise_int8(a: torch.Tensor, threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``int8_vectorwise_quant`` on a 2-D ``a [rows, cols]`` (fp16 in LLM.int8).

    Returns ``(codes, absmax, outlier_cols)``: codes fp32 integers in ``[-127, 127]`` ``[rows, cols]``,
    per-row ``absmax`` fp32 ``[rows]`` (over the elements below ``threshold``), and a bool ``[cols]`` mask of
    the columns holding an element ``>= threshold`` (all False when ``threshold`` is None); the codes of
    those columns are 0.
    """
    if a.dim() != 2:
        raise InputError(f"rowwise_int8 takes a 2-D tensor, got shape {list(a.shape)}")
    af = a.float()
    mag = af.abs()
    cols = torch.zeros(a.shape[1], dtype=torch.bool, device=a.device)
    if threshold is not None:
        outliers = mag >= threshold
        cols = outliers.any(dim=0)
        if bool(cols.any()):
            mag.masked_fill_(outliers, 0.0)
    absmax = mag.amax(dim=1)
    inv = torch.where(absmax > 0, QMAX / absmax, torch.zeros_like(absmax))  # bitsandbytes: A * (127 / row_stats)
    codes = af.mul_(inv[:, None]) if af is not a else af * inv[:, None]
    codes.round_().clamp_(-QMAX, QMAX)
    if bool(cols.any()):
        codes[:, cols] = 0.0  # the outlier elements themselves included: their columns go to 16-bit
    return codes, absmax, cols


def int_matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``exact_int_matmul(a, b)`` rounded once to fp32, without fp64 passes where the sum allows it.

    One chunk is exact in fp32. Two chunks: each partial sum is exact, so their fp32 sum is the exact
    integer rounded once (an IEEE addition is correctly rounded), as an int32 -> fp32 conversion rounds
    it. Three or more: the fp64 sum of ``exact_int_matmul``, then one rounding.
    """
    k = a.shape[1]
    if k <= CHUNK:
        return a @ b.T
    if k <= 2 * CHUNK:
        return (a[:, :CHUNK] @ b[:, :CHUNK].T).add_(a[:, CHUNK:] @ b[:, CHUNK:].T)
    return exact_int_matmul(a, b).float()


def exact_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [N, K]ᵀ`` of integer-valued fp32 tensors with ``|entries| <= 127``, exact, as fp64.

    Each chunk of ``CHUNK <= EXACT_FP32_TERMS`` columns is summed by an fp32 matmul, exact because every
    partial sum is an integer below ``2**24`` in magnitude (any summation order, with or without FMA);
    the chunk sums are added in fp64 (exact below ``2**53``). What an int8 GEMM with int32 accumulation gives.
    """
    k = a.shape[1]
    if k <= CHUNK:
        return (a @ b.T).double()
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for start in range(0, k, CHUNK):
        out += (a[:, start : start + CHUNK] @ b[:, start : start + CHUNK].T).double()
    return out


@dataclass
class Int8Weight:
    """A linear's weight as LLM.int8 stores it: codes fp32 ``[N, K]``, per-row absmax fp32 ``[N]``."""

    codes: torch.Tensor
    absmax: torch.Tensor

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> Int8Weight:
        codes, absmax, _ = rowwise_int8(w.detach().to(torch.float16))
        return cls(codes, absmax)

    def dequantize_columns(self, cols: torch.Tensor) -> torch.Tensor:
        """``C_W[:, cols] * absmax / 127`` fp32 ``[N, n_cols]`` (bitsandbytes' ``int8_vectorwise_dequant``)."""
        return self.codes[:, cols] * (self.absmax[:, None] / QMAX)


def llm_int8_matmul(x: torch.Tensor, weight: Int8Weight, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` (any float dtype) -> ``(y fp32 [T, N], outlier_cols bool [K])`` (steps 1-4 of the module doc)."""
    xh = x.to(torch.float16)
    codes, absmax, cols = rowwise_int8(xh, threshold)
    y = int_matmul_fp32(codes, weight.codes)
    y.mul_(absmax[:, None]).mul_((weight.absmax / (QMAX * QMAX))[None, :])
    if bool(cols.any()):
        y += xh[:, cols].float() @ weight.dequantize_columns(cols).T
    return y, cols


@dataclass
class _LayerStats:
    in_features: int
    union: torch.Tensor
    calls: int = 0
    tokens: int = 0
    outlier_token_cols: int = 0  # sum over calls of T * outlier columns
    share_sum: float = 0.0  # sum over calls of outlier columns / K

    def add(self, tokens: int, cols: torch.Tensor) -> None:
        n = int(cols.sum())
        self.union |= cols
        self.calls += 1
        self.tokens += tokens
        self.outlier_token_cols += tokens * n
        self.share_sum += n / self.in_features

    def to_dict(self) -> dict[str, Any]:
        union = int(self.union.sum())
        return {
            "in_features": self.in_features,
            "columns_16bit": union,
            "column_fraction": union / self.in_features,
            "mean_call_column_fraction": self.share_sum / self.calls if self.calls else 0.0,
            "mac_fraction": self.outlier_token_cols / (self.tokens * self.in_features) if self.tokens else 0.0,
            "calls": self.calls,
            "outlier_columns": torch.nonzero(self.union).flatten().tolist(),
        }


@dataclass
class _Handle:
    restore: list[tuple[torch.nn.Module, Any]]
    layers: dict[str, _LayerStats]
    threshold: float
    out_features: dict[str, int] = field(default_factory=dict)

    def remove(self) -> None:
        for module, had in self.restore:
            if had is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = had
        self.restore.clear()

    def stats(self) -> dict[str, Any]:
        per = {n: s.to_dict() for n, s in self.layers.items()}
        macs = sum(s.tokens * s.in_features * self.out_features[n] for n, s in self.layers.items())
        macs16 = sum(s.outlier_token_cols * self.out_features[n] for n, s in self.layers.items())
        with_outliers = sum(1 for s in per.values() if s["columns_16bit"])
        top = max(per, key=lambda n: per[n]["mac_fraction"]) if per else None
        summary = (f"threshold {self.threshold:g}: {with_outliers} of {len(per)} linears had 16-bit columns; "
                   f"{100 * macs16 / macs if macs else 0.0:.2f}% of multiply-adds in 16-bit")
        if top is not None and per[top]["columns_16bit"]:
            summary += (f" (most: {top}, {per[top]['columns_16bit']} of {per[top]['in_features']} columns, "
                        f"{100 * per[top]['mac_fraction']:.1f}% of its multiply-adds)")
        return {
            "threshold": self.threshold,
            "linears": len(per),
            "mac_fraction": macs16 / macs if macs else 0.0,
            "linears_with_outliers": with_outliers,
            "summary": summary,
            "per_linear": per,
        }


@dataclass(frozen=True)
class LLMInt8Simulation:
    """Replace the forward of every block projection by ``llm_int8_matmul`` (restored on ``remove``)."""

    options: LLMInt8Options = LLMInt8Options()
    name: str = "llm-int8"
    act_bits: int = 8
    kv_bits: None = None

    def calibration_options(self) -> None:
        return None  # nothing calibrated

    def install(self, model: torch.nn.Module, context: SimulationContext) -> _Handle:
        linears = target_linears(model)
        handle = _Handle([], {}, float(self.options.threshold))
        for name, module in linears.items():
            weight = Int8Weight.from_weight(module.weight)
            stats = _LayerStats(module.in_features, torch.zeros(module.in_features, dtype=torch.bool, device=module.weight.device))
            handle.layers[name] = stats
            handle.out_features[name] = module.out_features
            handle.restore.append((module, module.__dict__.get("forward")))
            module.forward = _forward(module, weight, stats, float(self.options.threshold))
        return handle


def _forward(module: torch.nn.Linear, weight: Int8Weight, stats: _LayerStats, threshold: float):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y, cols = llm_int8_matmul(flat, weight, threshold)
        stats.add(flat.shape[0], cols)
        if module.bias is not None:
            y = y + module.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    return forward


def _factory(given: Mapping[str, Any]) -> LLMInt8Simulation:
    return LLMInt8Simulation(build(LLMInt8Options, given))


register_simulation("llm-int8", _factory)

__all__ = [
    "CHUNK", "DEFAULT_THRESHOLD", "EXACT_FP32_TERMS", "Int8Weight", "LLMInt8Options", "LLMInt8Simulation",
    "exact_int_matmul", "llm_int8_matmul", "rowwise_int8",
]
