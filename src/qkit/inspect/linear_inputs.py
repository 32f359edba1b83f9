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
from qkit.methods.experts import layout_for, unfused_experts
from qkit.methods.folding import FoldGroup, model_fold_groups, outlier_ratio, smoothing_factors, weight_absmax
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
    per token (``smoothed`` False).

    A mixture-of-experts model (``qkit.methods.experts``' layouts) runs with one linear per expert matrix
    (``unfused_experts``), so an expert's rows are its own: its gate/up read ``post_attention_layernorm``'s
    output on the tokens the router sent it, its down ``act(gate) * up`` of those; the router (and qwen2_moe's
    shared expert) read every token, one row. Expert rows name the linears as the checkpoint does, from the
    layer down (``mlp.experts.3.gate_proj``, mixtral's ``block_sparse_moe.experts.3.w1``), and give
    ``expert`` and ``tokens``; an expert no token reached has no row."""
    config = model.config.to_dict()
    try:
        layout = layout_for(config, "qkit inspect outliers measures the linear inputs of")
    except InputError:  # experts qkit does not lay out (gpt_oss's 3-D ones): no table
        return []
    stored = (lambda n: n) if layout is None else layout.stored_name
    seen: dict[str, torch.Tensor] = {}

    def after(name):
        def record(_mod, _args, output):
            seen[name] = output.detach().reshape(-1, output.shape[-1]).float().cpu()

        return record

    def before(name):
        def record(_mod, args):
            seen[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()

        return record

    with unfused_experts(model, config):
        try:
            groups = model_fold_groups(model, linear_groups=True)
        except InputError:  # not the llama layout: no table
            return []
        modules = dict(model.named_modules())
        inputs = [spec for g in groups for spec in _inputs(g)]
        handles = [modules[hooked].register_forward_pre_hook(before(key)) if pre
                   else modules[hooked].register_forward_hook(after(key)) for key, hooked, pre, *_ in inputs]
        try:
            model(input_ids.to(next(model.parameters()).device))
        finally:
            for h in handles:
                h.remove()
        out = []
        for key, _hooked, _pre, g, linears, source, expert in inputs:
            if key not in seen:  # an expert no token reached
                continue
            w = weight_absmax(modules[n].weight.detach().float().cpu() for n in linears)
            levels = linear_input_levels(seen[key], w, alpha=alpha, threshold=threshold)
            if g.prev_is_linear:  # not smoothed by default: SmoothQuant's activations are these, per token
                levels["levels"]["smoothquant"] = levels["levels"]["per_token"]
                levels["max_over_median_smoothed"] = levels["max_over_median"]
            layer = int(g.prev.split(".layers.")[1].split(".")[0]) if ".layers." in g.prev else -1
            # a sparse MLP's linears from the layer down, as the checkpoint names them; a dense one's by their own name
            name = ((lambda n: stored(n).split(f".layers.{layer}.", 1)[1]) if layout is not None and g.kind in MLP_KINDS
                    else (lambda n: n.rsplit(".", 1)[-1]))
            row = {"layer": layer, "input": source if not g.prev_is_linear else f"{name(linears[0])} input",
                   "linears": [name(n) for n in linears], "smoothed": not g.prev_is_linear, **levels}
            if expert:
                row.update(expert=stored(expert), tokens=int(seen[key].shape[0]))
            out.append(row)
    return out


MLP_KINDS = ("gate_up", "down", "experts_gate_up")  # a mixture-of-experts model's MLP rows name linears from the layer


def _inputs(g: FoldGroup) -> list[tuple[str, str, bool, FoldGroup, tuple[str, ...], str, str | None]]:
    """What ``linear_inputs_report`` hooks for group ``g``: ``(key, hooked module, pre-hook?, g, linears, input
    name, expert)``. A norm's output by a forward hook on the norm; a linear's input by a pre-hook on its first
    reader. A sparse MLP's norm group splits: its non-expert readers on the norm's output (every token), each
    expert's gate/up on its gate's input (the tokens routed to it)."""
    source = g.prev.rsplit(".", 1)[-1]
    if g.kind != "experts_gate_up":
        expert = g.output.rpartition(".")[0] if ".experts." in g.output else None  # an expert's down
        return [(g.name, g.linears[0] if g.prev_is_linear else g.prev, g.prev_is_linear, g, g.linears, source, expert)]
    readers = tuple(n for n in g.linears if ".experts." not in n)
    out = [(g.name, g.prev, False, g, readers, source, None)]
    pairs = [n for n in g.linears if ".experts." in n]
    for gate, up in zip(pairs[::2], pairs[1::2]):  # each expert's gate then up (``moe_groups``)
        expert = gate.rpartition(".")[0]
        out.append((expert, gate, True, g, (gate, up), source, expert))
    return out


__all__ = ["linear_input_levels", "linear_inputs_report"]
