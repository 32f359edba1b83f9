"""The plan's check: the chosen mix swapped into the model that measured the sensitivity, its KL measured
on the check windows beside the prediction (the solver assumes costs add; this says how far they do), and
the model's weights restored from its files."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from qkit.checkpoint import iter_tensors, tensor_reader
from qkit.models import ModelRef
from qkit.plan import feedback
from qkit.plan.candidates import Candidate
from qkit.plan.costing import candidate_weights
from qkit.plan.planfile import Plan
from qkit.plan.sensitivity import measured_kl
from qkit.schemes import quantize_tensor


def check_mix(plan: Plan, table, ref: ModelRef, quant_weights: Mapping[str, torch.Tensor] | None = None, *,
              forget: Callable[[], None] = lambda: None) -> None:
    """The planner's step 5 (``table``: its ``planner.Table``): the plan's mix swapped into the table's model (the same codes the file holds; for a table
    priced for GPTQ, GPTQ's weights solved block after block, ``feedback.solved_weights``, on the sensitivity
    windows after the check's, so that the check is not measured on the tokens GPTQ was fitted to), its KL
    measured on the check windows beside the prediction, into ``plan.check``; the weights restored (if that
    fails, ``forget()``: the caller drops its cached model)."""
    fisher = table.fisher
    if fisher is None or not fisher.reference:
        plan.check = {"measured_kl": None, "windows": 0}
        return
    model = table.model
    params = stored_parameters(model, table.views)
    weights = dict(quant_weights or {})
    t0 = time.perf_counter()
    device = str(next(model.parameters()).device)
    # A swapped parameter is restored from the file it was loaded from when it equals that file's tensor
    # (checked before the swap; no second copy of the model's weights); any other one from a copy.
    swapped: list[str] = []
    copies: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, w in iter_tensors(ref.directory, device=device):
                t = plan.tensors.get(name)
                if t is None or t.scheme is None:
                    continue
                p = params[name]
                if not torch.equal(p, w.to(p.dtype)):
                    copies[name] = p.detach().clone()
                swapped.append(name)
                if table.gptq is None:
                    qt = quantize_tensor(w, t.scheme, name=name, quant_weights=candidate_weights(weights, name, Candidate(t.type, t.scheme, t.nbytes)))
                    p.copy_(qt.dequantize(p.dtype))
            solved_on = None
            if table.gptq is not None:  # solved on the windows the check does not measure (all, if it measures all)
                n_check = len(fisher.reference)
                solve_ids = table.ids[n_check:] if int(table.ids.shape[0]) > n_check else table.ids
                solved_on = {"windows": int(solve_ids.shape[0]), "held_out": solve_ids is not table.ids}
                chosen = {n: Candidate(t.type, t.scheme, t.nbytes) for n, t in plan.tensors.items()}
                feedback.solved_weights(model, solve_ids, chosen, tensor_reader(ref.directory, chosen, device),
                                        gptq=table.gptq, quant_weights=lambda n, c: candidate_weights(weights, n, c),
                                        device=torch.device(device))
        kl, se = measured_kl(model, fisher)
    finally:
        _restore(params, swapped, copies, ref, device, forget)
    pred = plan.predicted_kl
    plan.check = {"measured_kl": kl, "measured_kl_se": se, "predicted_kl": pred,
                  "ratio": (pred / kl) if kl > 0 else None, "windows": len(fisher.reference),
                  "positions": int(fisher.check_ids.numel()), "seconds": round(time.perf_counter() - t0, 3),
                  "text": "calibration windows (the first check windows of the sensitivity pass), never the eval text",
                  **({"gptq_solved_on": solved_on} if solved_on is not None else {})}


def stored_parameters(model: torch.nn.Module, views: Mapping[str, tuple[str, tuple]]) -> dict[str, torch.Tensor]:
    """``model``'s parameters by the names its files give them: each parameter, and each of ``views``' slices
    (``{stored name: (parameter, index)}``, a mixture-of-experts layer's expert matrices,
    ``methods.experts.expert_slices``) as a view of its fused parameter, which writing it writes."""
    params = dict(model.named_parameters())
    return {**params, **{t: params[p][k] for t, (p, k) in views.items()}}


def _restore(params: Mapping[str, torch.Tensor], names: Sequence[str], copies: Mapping[str, torch.Tensor],
             ref: ModelRef, device: str, forget: Callable[[], None]) -> None:
    """Put back the weights ``check`` swapped: from ``copies``, else from the model's file. If that fails
    (an interrupt, a file gone), ``forget()``: the cached model is dropped so that no later plan measures a
    changed one."""
    todo = set(names)
    try:
        with torch.no_grad():
            for name in todo & copies.keys():
                params[name].copy_(copies[name])
            todo -= copies.keys()
            if todo:
                for name, w in iter_tensors(ref.directory, device=device):
                    if name in todo:
                        params[name].copy_(w)
                        todo.discard(name)
    finally:
        if todo:
            forget()


__all__ = ["check_mix", "stored_parameters"]
