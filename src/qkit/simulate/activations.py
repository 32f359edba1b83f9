"""Activation fake-quantization: the INPUT of every quantized linear on the int8 grid (W8A8 simulated).

Which linears: the block projections, the same rule that picks the weights ``qkit quantize`` stores
(``qkit.transform.is_block_projection`` on ``NAME.weight``): q/k/v/o and gate/up/down of every block;
embeddings, norms and the LM head keep full-precision inputs, as in llm-compressor's W8A8 recipes.

The quantizer (symmetric, ``qmax = 2**(bits-1) - 1 = 127``), computed in fp32 and cast back to the
input's dtype::

    s     = max|x over the unit| / qmax            (one scale per unit, see below)
    x_hat = clamp(round(x / s), -qmax, qmax) * s   (torch.round: half to even; s = 0 gives 0)

The clamp is to ``[-127, 127]``, not ``[-128, 127]``: with absmax scales ``|x / s| <= 127`` already, so
``-128`` is never produced by a dynamic scale, and a symmetric grid keeps ``q(-x) = -q(x)`` (the int8
GEMMs of LLM.int8/bitsandbytes and of SmoothQuant/vLLM's per-token kernels use the same ±127 range). For
a static scale the clamp is what saturates activations larger than anything seen in calibration.

Units (a ``Granularity`` value over the input viewed as ``[tokens, features]``):

* ``act-int8-tensor``: ``PerTensor()``, dynamic: one scale per forward call, absmax over the whole input
  (every token of every sequence of the batch);
* ``act-int8-token``: ``PerRow()``, dynamic: one scale per token row (what vLLM/llm-compressor's W8A8
  "dynamic per-token" does);
* ``act-int8-static``: ``PerTensor()``, static: one fixed scale per linear, the max ``|x|`` over the
  calibration tokens (``qkit.methods.calibration``: the pinned calibration text, disjoint from the eval
  text), measured once in ``install`` by a forward pass over the calibration ids with the row's weights.

The matmul then runs on the dequantized activations in fp32: the same products as an int8 GEMM with
int32 accumulation and a ``s_x * s_w`` rescale, up to fp32 rounding of the sum (not bit-exact to an
integer GEMM; ``qkit.simulate.llm_int8`` does the exact integer sum where exactness is the point).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qkit.errors import InputError
from qkit.granularity import PerRow, PerTensor
from qkit.methods.calibration import CalibrationOptions, calibration_ids
from qkit.simulate.base import SimulationContext, register_simulation
from qkit.simulate.options import build, register_options
from qkit.transform import is_block_projection

ACT_BITS = 8


def qmax_for(bits: int) -> int:
    if bits not in (4, 8):
        raise InputError(f"simulated bits must be 4 or 8, got {bits!r}")
    return 2 ** (bits - 1) - 1


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, bits: int = ACT_BITS) -> torch.Tensor:
    """``clamp(round(x / s), -qmax, qmax) * s`` in fp32, returned in ``x.dtype``.

    ``scale``: fp32, broadcastable to ``x``, ``>= 0``; a zero scale (an all-zero unit) gives zeros.
    """
    qmax = qmax_for(bits)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.div(x.float(), s).round_().clamp_(-qmax, qmax).mul_(s).to(x.dtype)


def absmax_scale(x: torch.Tensor, granularity: PerTensor | PerRow, bits: int = ACT_BITS) -> torch.Tensor:
    """Dynamic scales of ``x [..., features]``: ``PerTensor`` -> ``[]`` (absmax of everything),
    ``PerRow`` -> ``[..., 1]`` (absmax of each token row), both ``/ qmax``, fp32."""
    qmax = qmax_for(bits)
    a = x.detach().abs()
    if isinstance(granularity, PerTensor):
        return a.amax().float() / qmax
    if isinstance(granularity, PerRow):
        return a.amax(dim=-1, keepdim=True).float() / qmax
    raise InputError(f"activation scales are per tensor or per token, not {granularity!r}")


def quantize_activations(x: torch.Tensor, granularity: PerTensor | PerRow, bits: int = ACT_BITS) -> torch.Tensor:
    """Dynamic fake-quantization of ``x [..., features]`` (see the module doc)."""
    return fake_quantize(x, absmax_scale(x, granularity, bits), bits)


def target_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """``{module name: nn.Linear}`` of the block projections (the weights ``qkit quantize`` targets)."""
    out = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and is_block_projection(f"{name}.weight", tuple(m.weight.shape))
    }
    if not out:
        raise InputError(f"{type(model).__name__} has no block projections to simulate (no layers.N.*_proj linears)")
    return out


@dataclass(frozen=True)
class StaticOptions:
    """Calibration for ``act-int8-static`` (None: the default of ``qkit.methods.calibration``)."""

    calibration: str | None = None
    calibration_samples: int | None = None
    calibration_seqlen: int | None = None

    def calibration_options(self):
        """The ``qkit.methods.calibration.CalibrationOptions`` these stand for (checked: one line if malformed)."""
        given = {k: v for k, v in (("source", self.calibration), ("samples", self.calibration_samples),
                                   ("seqlen", self.calibration_seqlen)) if v is not None}
        options = CalibrationOptions(**given)
        options.check()
        return options


register_options("activations", StaticOptions)


@dataclass
class _Handle:
    hooks: list[Any]
    facts: dict[str, Any] = field(default_factory=dict)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def stats(self) -> dict[str, Any]:
        f = self.facts
        summary = f"int{f['bits']} inputs at {f['linears']} linears, one {f['scales']} scale per {f['granularity']}"
        return {**f, "summary": summary}


@dataclass(frozen=True)
class ActivationSimulation:
    """Fake-quantize the input of every block projection (forward pre-hooks; see the module doc)."""

    name: str
    granularity: PerTensor | PerRow
    static: bool = False
    bits: int = ACT_BITS
    options: StaticOptions = StaticOptions()

    @property
    def act_bits(self) -> int:
        return self.bits

    kv_bits = None

    def calibration_options(self) -> CalibrationOptions | None:
        """What static scales calibrate on (None: dynamic scales calibrate on nothing); ``qkit eval``
        checks it against its corpus before the model loads."""
        return self.options.calibration_options() if self.static else None

    def install(self, model: torch.nn.Module, context: SimulationContext) -> _Handle:
        linears = target_linears(model)
        facts: dict[str, Any] = {"linears": len(linears), "granularity": "token" if isinstance(self.granularity, PerRow) else "tensor",
                                 "scales": "static" if self.static else "dynamic", "bits": self.bits}
        if self.static:
            scales, provenance = calibrate_static(model, linears, context, self.options, self.bits)
            facts["calibration"] = provenance
            facts["static_scales"] = {n: float(s) for n, s in scales.items()}
            hooks = [m.register_forward_pre_hook(_static_hook(scales[n], self.bits)) for n, m in linears.items()]
        else:
            hooks = [m.register_forward_pre_hook(_dynamic_hook(self.granularity, self.bits)) for m in linears.values()]
        return _Handle(hooks, facts)


def _dynamic_hook(granularity: PerTensor | PerRow, bits: int):
    def hook(_module, args):
        return (quantize_activations(args[0], granularity, bits), *args[1:])

    return hook


def _static_hook(scale: torch.Tensor, bits: int):
    def hook(_module, args):
        return (fake_quantize(args[0], scale, bits), *args[1:])

    return hook


@torch.no_grad()
def calibrate_static(
    model: torch.nn.Module,
    linears: Mapping[str, torch.nn.Linear],
    context: SimulationContext,
    options: StaticOptions,
    bits: int = ACT_BITS,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Static per-tensor scales ``max|x| / qmax`` (fp32 scalars) of each linear's input over the
    calibration tokens: ``context.calibration_ids`` if given, else ``calibration_ids(context.extra["tokenizer"],
    ...)``; one sequence per forward pass."""
    ids = context.calibration_ids
    provenance: dict[str, Any] = {}
    if ids is None:
        tok = context.extra.get("tokenizer")
        if tok is None:
            raise InputError("static activation scales need the model's tokenizer to encode the calibration text; use act-int8-token")
        # disjoint from the text the model is evaluated on (``qkit eval --corpus``; default: the pinned Ruth)
        # the default window fitted to the model's context, as every calibrated method's
        ids, provenance = calibration_ids(tok, options.calibration_options().fitted(model.config),
                                          evaluation=context.extra.get("corpus"))
    qmax = qmax_for(bits)
    device = next(model.parameters()).device
    maxima: dict[str, torch.Tensor] = {n: torch.zeros((), dtype=torch.float32, device=device) for n in linears}

    def record(name):
        def hook(_module, args):
            torch.maximum(maxima[name], args[0].detach().abs().amax().float(), out=maxima[name])

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        for row in ids:
            model(input_ids=row[None].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {n: (m / qmax).cpu() for n, m in maxima.items()}, provenance


def _factory(name: str, granularity: PerTensor | PerRow, static: bool = False):
    def make(given: Mapping[str, Any]) -> ActivationSimulation:
        options = build(StaticOptions, given)
        if static:
            options.calibration_options()  # malformed calibration numbers fail here, before any model is loaded
        return ActivationSimulation(name, granularity, static, ACT_BITS, options)

    return make


ACT_TENSOR, ACT_TOKEN, ACT_STATIC = "act-int8-tensor", "act-int8-token", "act-int8-static"
register_simulation(ACT_TENSOR, _factory(ACT_TENSOR, PerTensor()))
register_simulation(ACT_TOKEN, _factory(ACT_TOKEN, PerRow()))
register_simulation(ACT_STATIC, _factory(ACT_STATIC, PerTensor(), static=True))

__all__ = [
    "ACT_STATIC", "ACT_TENSOR", "ACT_TOKEN", "ActivationSimulation", "StaticOptions", "absmax_scale", "calibrate_static",
    "fake_quantize", "qmax_for", "quantize_activations", "target_linears",
]
