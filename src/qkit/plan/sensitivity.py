"""Measured sensitivity: the damage each candidate type does to the model's output, per tensor.

The estimator is the **diagonal Fisher** of the model's own output distribution, measured on the
calibration text (never the eval text). For a change ``delta`` of the weights, the mean KL divergence
from the reference's next-token distribution to the changed model's is, to second order,

    KL(p_ref || p_q)  ~=  1/2 delta^T F delta,     F = E_t E_{y ~ p_ref(.|x_<t)} [ g g^T ],  g = d log p(y | x_<t) / d theta

(``F`` is the Hessian of the KL at the reference: its gradient there is zero). qkit keeps ``F``'s
diagonal, per weight, so a tensor's cost under a candidate is::

    cost(W, c) = 1/2 sum_ij F_ij (W_ij - dequantize(quantize(W, c))_ij)^2       (nats per position)

measured with exactly the codes the written file holds (``quantize_tensor``, with the importance
matrix when one is given). Labels ``y`` are **sampled from the reference** (seeded), which makes ``F``
the true Fisher; the text's own next tokens would give the empirical Fisher, which is not the KL's
Hessian. One backward pass per calibration window of ``w`` tokens gives, for every target at once,
``g_w = d/dW sum_t log p(y_t)`` and ``F ~= 1/(n w) sum_w g_w^2`` (cross-position terms have zero mean
under independent samples, so the square of the window's sum estimates the sum of the positions').

What it assumes, and what the plan checks: that costs add over tensors (the diagonal drops every
cross term, within a tensor and between tensors) and that the quadratic holds at the candidates'
error sizes (it under-counts where a type's damage is no longer small, e.g. 2-bit types). Every plan
therefore measures the KL of the chosen mix on calibration windows and reports it beside the
prediction (``measured_kl``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qkit.dtypes import dtype_of, non_finite_activations
from qkit.schemes import quantize_tensor
from qkit.schemes.base import Scheme


@dataclass
class Fisher:
    """``diag`` ``{target: float32 [out, in]}``: the mean per-position diagonal Fisher; ``positions``
    the positions it averages over; ``reference`` the reference's log-probabilities of the first check
    windows (float32 ``[w, V]`` each), kept for ``measured_kl``; ``check_ids`` those windows; ``labels``
    (int64 ``[n, w]``) the labels sampled for every window, which a later pass over other targets is given
    (``fisher_diagonal(labels=...)``) so that every group of a grouped Fisher sees the same labels."""

    diag: dict[str, torch.Tensor]
    positions: int
    reference: list[torch.Tensor]
    check_ids: torch.Tensor
    seconds: float
    labels: torch.Tensor | None = None


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities at every position of one window: float32 ``[w, V]``."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def fisher_diagonal(
    model,
    ids: torch.Tensor,
    targets: Sequence[str],
    *,
    seed: int = 0,
    check_windows: int = 0,
    on_window: Callable[[int, int], None] | None = None,
    labels: torch.Tensor | None = None,
) -> Fisher:
    """The diagonal Fisher of ``model``'s parameters named ``targets`` over windows ``ids`` (int64
    ``[n, w]``): one forward and one backward pass per window, labels sampled from the model itself with
    a ``torch.Generator`` seeded by ``seed`` (or ``labels``, int64 ``[n, w]``, those of an earlier pass:
    ``Fisher.labels``). Only the targets get gradients; every parameter's ``requires_grad`` is restored
    afterwards. The first ``check_windows`` windows' log-probabilities are kept (``Fisher.reference``).

    The diagonal is accumulated in float32 whatever the model's dtype (a bf16 model's gradients are
    squared in float32: exact, a bf16 product fits in float32's mantissa). A target's value depends only
    on its own gradients, so measuring the targets in groups (one call per group, each given the first
    call's ``labels``) gives every target exactly the value one call over all of them gives; the memory
    held is then one group's diagonal (``qkit.plan.memory``)."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    missing = [t for t in targets if t not in params]
    if missing:  # a caller's bug, not a user's input: the targets come from the model's own headers
        raise KeyError(f"the model has no parameter {missing[0]}")
    if labels is not None and tuple(labels.shape) != tuple(ids.shape):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for windows of shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    was = {n: p.requires_grad for n, p in params.items()}
    diag = {t: torch.zeros(params[t].shape, dtype=torch.float32, device=device) for t in targets}
    reference: list[torch.Tensor] = []
    sampled = torch.empty(ids.shape, dtype=torch.int64) if labels is None else labels
    g = torch.Generator(device="cpu").manual_seed(seed)

    def accumulate(p: torch.Tensor, f: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:  # the moment autograd has this parameter's whole gradient
            with torch.no_grad():
                f.addcmul_(p.grad, p.grad)  # computed in float32 for a bf16/fp16 gradient (type promotion)
            p.grad = None  # freed now, not at the end of the backward pass: one target's gradient at a time
        return hook

    hooks = []
    try:
        for n, p in params.items():
            p.requires_grad_(n in diag)
            p.grad = None
        hooks = [params[t].register_post_accumulate_grad_hook(accumulate(params[t], f)) for t, f in diag.items()]
        for i, window in enumerate(ids):
            lp = _logprobs(model, window.to(device))
            if not bool(torch.isfinite(lp).all()):  # an fp16 overflow: a Fisher of NaN would price every type alike
                raise non_finite_activations(f"the model's log-probabilities on calibration window {i}", dtype_of(model))
            if labels is None:
                with torch.no_grad():
                    sampled[i] = torch.multinomial(lp.detach().exp().cpu(), 1, generator=g)[:, 0]
            y = sampled[i].to(device)[:, None]
            lp.gather(1, y).sum().backward()
            if i < check_windows:
                reference.append(lp.detach().cpu())
            del lp
            if on_window is not None:
                on_window(i + 1, int(ids.shape[0]))
    finally:
        for h in hooks:
            h.remove()
        for n, p in params.items():
            p.grad = None
            p.requires_grad_(was[n])
    positions = int(ids.numel())
    for f in diag.values():
        f.div_(positions)
    return Fisher(diag, positions, reference, ids[:check_windows].clone(), time.perf_counter() - t0, sampled)


# Elements per chunk of the float64 sum: torch.sum(dtype=float64) would first cast the whole tensor to
# float64 (twice the float32 tensor), the largest transient of the cost; 1M elements is 8 MB.
_SUM_CHUNK = 1 << 20


def candidate_cost(w: torch.Tensor, fisher: torch.Tensor, scheme: Scheme | None, *, name: str = "<tensor>",
                   quant_weights: torch.Tensor | None = None) -> tuple[float, bool]:
    """``(cost, lossless)`` of storing ``w`` (float ``[out, in]``) as ``scheme`` (None: unquantized, cost 0):
    ``1/2 sum F (w - w_hat)^2`` in float64 (nats per position), and whether ``w_hat == w`` exactly (the
    source weights already lie on the candidate's grid).

    Memory: besides what ``quantize_tensor`` takes, one float32 copy of ``w`` (the dequantized weights,
    then the error in their place is a second, freed with them); nothing outlives the call."""
    if scheme is None:
        return 0.0, True
    qt = quantize_tensor(w, scheme, name=name, quant_weights=quant_weights)
    w_hat = qt.dequantize(torch.float32).to(w.device)
    del qt  # the codes: not needed once dequantized
    delta = torch.sub(w, w_hat)  # float32 (a bf16 w promoted exactly, element by element, without a copy)
    del w_hat
    lossless = not bool(delta.any())
    # elementwise in fp32 (F * d^2 is a product of two fp32 numbers: one rounding), in place; summed in fp64
    term = delta.square_().mul_(fisher).view(-1)
    cost = 0.5 * math.fsum(float(c.sum(dtype=torch.float64)) for c in term.split(_SUM_CHUNK))
    return cost, lossless


def measured_kl(model, fisher: Fisher) -> tuple[float, float]:
    """Mean KL (nats) from the stored reference log-probabilities to ``model``'s on the check windows, and
    its standard error over positions: what the prediction is compared with."""
    device = next(model.parameters()).device
    kls = []
    with torch.inference_mode():
        for window, ref in zip(fisher.check_ids, fisher.reference):
            lp = _logprobs(model, window.to(device)).cpu()
            kls.append((ref.exp() * (ref - lp)).sum(-1).double())
    kl = torch.cat(kls)
    n = kl.numel()
    se = kl.std(unbiased=True).item() / math.sqrt(n) if n >= 2 else float("nan")
    return kl.mean().item(), se


__all__ = ["Fisher", "candidate_cost", "fisher_diagonal", "measured_kl"]
