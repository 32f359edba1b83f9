"""The inputs of the block projections under the activation quantizations of ``qkit eval``'s W8A8 rows.

Layer 7 (``inspect``): above ``methods`` (SmoothQuant's factors, the fold groups) and ``simulate``
(LLM.int8's threshold), which it reads; ``qkit inspect outliers`` adds this table to its report.

The linears do not read ``h`` itself: q/k/v read ``input_layernorm(h)`` and gate/up read
``post_attention_layernorm(h)`` (RMSNorm: ``w * h / rms(h)``, which rescales every token and weights every
channel). ``linear_input_levels`` measures those inputs ``x [T, K]`` (captured with forward hooks on the
norms) under the activation quantizations of ``qkit eval``'s rows, to say why each row lands where it does.
For a quantization with codes ``q[t, d]``, dimension ``d`` *spans* ``2 max_t |q[t, d]| + 1`` of the 255 int8
levels; the table gives the median over the ``K`` dimensions (the typical dimension):

* per tensor (``w8a8-tensor``): one step ``max|x| / 127``;
* per token (``w8a8-token``): one step per token, ``max_d |x[t, d]| / 127``;
* SmoothQuant (``smoothquant-w8a8``): per token after dividing channel ``d`` by
  ``s[d] = max|x_d|^α / max|W_d|^(1-α)`` (α = 0.5; ``qkit.methods.folding.smoothing_factors`` with the
  column maxima of the linears that read ``x``; ``max|x_d|`` from these prompt tokens, where the method
  uses its calibration text);
* LLM.int8 (``llm-int8``): per token over the dimensions left after the columns holding some
  ``|x| >= 6`` go to 16-bit (their count is reported).
"""

from __future__ import annotations

from typing import Any

import torch

from qkit.errors import InputError
from qkit.methods.folding import model_fold_groups, outlier_ratio, smoothing_factors, weight_absmax
from qkit.methods.smoothquant import DEFAULT_ALPHA
from qkit.simulate.llm_int8 import DEFAULT_THRESHOLD


def _defaults(alpha: float | None, threshold: float | None) -> tuple[float, float]:
    """SmoothQuant's default alpha and LLM.int8's default threshold, from where they are defined."""
    return (DEFAULT_ALPHA if alpha is None else alpha), (DEFAULT_THRESHOLD if threshold is None else threshold)


def _spanned_levels(codes: torch.Tensor) -> float:
    """Median over dimensions of the int8 levels each spans: ``2 max_t |codes[t, d]| + 1``."""
    return float((2 * codes.abs().amax(dim=0) + 1).median())


def _token_codes(x: torch.Tensor) -> torch.Tensor:
    step = x.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(x / torch.where(step > 0, step, torch.ones_like(step))).clamp(-127, 127)


def linear_input_levels(x: torch.Tensor, weight_absmax: torch.Tensor, *, alpha: float | None = None,
                        threshold: float | None = None) -> dict[str, Any]:
    """One linear input ``x`` fp32 ``[T, K]`` read by linears whose column maxima are ``weight_absmax [K]``:
    the int8 levels its typical dimension spans per tensor, per token, after SmoothQuant, with LLM.int8's
    split (see the module doc), and the facts behind them. ``alpha``, ``threshold``: default the SmoothQuant
    method's and LLM.int8's defaults."""
    alpha, threshold = _defaults(alpha, threshold)
    x = x.float()
    m = x.abs().amax(dim=0)
    step = float(m.max()) / 127
    per_tensor = torch.round(x / step).clamp(-127, 127) if step > 0 else torch.zeros_like(x)
    s = smoothing_factors(m, weight_absmax, alpha)
    smoothed = x / s
    cols = (x.abs() >= threshold).any(dim=0)
    rest = x[:, ~cols]
    return {
        "max": float(m.max()),
        "median_dim_max": float(m.median()),
        "max_over_median": outlier_ratio(m),
        "max_over_median_smoothed": outlier_ratio(smoothed.abs().amax(dim=0)),
        "levels": {
            "per_tensor": _spanned_levels(per_tensor),
            "per_token": _spanned_levels(_token_codes(x)),
            "smoothquant": _spanned_levels(_token_codes(smoothed)),
            "llm_int8": _spanned_levels(_token_codes(rest)) if rest.shape[1] else None,
        },
        "llm_int8_columns": int(cols.sum()),
        "dims": int(x.shape[1]),
    }


@torch.no_grad()
def linear_inputs_report(model: torch.nn.Module, input_ids: torch.Tensor, *, alpha: float | None = None,
                         threshold: float | None = None) -> list[dict[str, Any]]:
    """``linear_input_levels`` of every input the block projections read, one forward pass (llama layout:
    q/k/v read ``input_layernorm``'s output, gate/up ``post_attention_layernorm``'s, o_proj the attention
    output, down_proj ``act(gate) * up``); ``[]`` for a model without that layout. SmoothQuant smooths only
    the norm groups by default (as its reference does), so for o_proj and down_proj its column repeats
    per token (``smoothed`` False)."""
    try:
        groups = model_fold_groups(model, linear_groups=True)
    except InputError:
        return []
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def after(name):
        def record(_mod, _args, output):
            seen[name] = output.detach()[0].float().cpu()

        return record

    def before(name):
        def record(_mod, args):
            seen[name] = args[0].detach()[0].float().cpu()

        return record

    handles = [modules[g.linears[0]].register_forward_pre_hook(before(g.name)) if g.prev_is_linear
               else modules[g.prev].register_forward_hook(after(g.name)) for g in groups]
    try:
        model(input_ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    out = []
    for g in groups:
        w = weight_absmax(modules[n].weight.detach().float().cpu() for n in g.linears)
        levels = linear_input_levels(seen[g.name], w, alpha=alpha, threshold=threshold)
        if g.prev_is_linear:  # not smoothed by default: SmoothQuant's activations are these, per token
            levels["levels"]["smoothquant"] = levels["levels"]["per_token"]
            levels["max_over_median_smoothed"] = levels["max_over_median"]
        layer = int(g.prev.split(".layers.")[1].split(".")[0]) if ".layers." in g.prev else -1
        source = f"{g.prev.rsplit('.', 1)[-1]}" if not g.prev_is_linear else f"{g.linears[0].rsplit('.', 1)[-1]} input"
        out.append({"layer": layer, "input": source, "linears": [n.rsplit(".", 1)[-1] for n in g.linears],
                    "smoothed": not g.prev_is_linear, **levels})
    return out


__all__ = ["linear_input_levels", "linear_inputs_report"]
