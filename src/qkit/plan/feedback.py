"""The candidates' costs when GPTQ writes them: ``qkit plan --method gptq``.

The Fisher cost of ``sensitivity.candidate_cost`` prices a tensor's weight error element by element
(the diagonal). That is the right price for round-to-nearest, whose errors are nearly independent from
weight to weight, and the wrong one for GPTQ, whose error feedback makes each column's error cancel the
earlier columns' at the layer's output: GPTQ's weights are often *farther* from ``W`` element by element
and closer at the output. So a GPTQ candidate is priced from the RTN candidate's Fisher cost, scaled by
how much GPTQ shrinks the layer's output error on the same inputs::

    cost_gptq(W, c) = cost(W, c) * e(W, Ŵ_gptq(c)) / e(W, Ŵ_rtn(c)),     e(W, Ŵ) = tr((W - Ŵ) G (W - Ŵ)ᵀ)

where ``G = Xᵀ X`` is the Gram matrix of the layer's inputs (the reference model's activations), ``Ŵ_rtn``
what ``--method rtn`` writes (with the importance matrix when the plan has one) and ``Ŵ_gptq`` GPTQ's solve
of ``W`` for the candidate's type (with the same matrix), with the options its quantize will use
(``GPTQOptions()`` by default). **Held out**: the plan's calibration windows are split in two halves; GPTQ
solves against the first half's Gram and both errors are measured with the second half's (with one window,
both are that window's). Measured in sample, GPTQ's error on the tokens it was solved on is optimistic, and
without bound where a layer has more inputs than the tokens (a 2-window, 64-token plan of a 512-wide layer
measured ratios near 0.01 that way). A tensor already on a candidate's grid (RTN lossless) costs 0 for GPTQ
too: nothing is rounded, nothing fed back.

What it assumes: that the KL a tensor's error causes scales with that error's energy at the layer's output
(the ratio of output errors, not of weight errors). The plan's check measures the chosen mix's KL with
GPTQ's weights swapped in (``solved_weights``: each block solved from the outputs of the blocks before it
as they were quantized, as the file's GPTQ pass does) beside the prediction.

Cost: one GPTQ solve per tensor and GPTQ candidate (the Hessian of linears fed the same input prepared
once per block and shared), one forward pass per block; memory besides the model: one block's inputs and
outputs on the calibration windows, the Gram matrices and factors of one block's inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

import torch

from qkit.methods.gptq.errors import output_errors, rtn_dequantized
from qkit.methods.gptq.method import GPTQOptions, HessianInputs
from qkit.methods.gptq.solver import PreparedHessian, gptq_solve, prepare_hessian
from qkit.methods.sequential import BlockInputs, walk_blocks
from qkit.plan.candidates import Candidate
from qkit.schemes.base import Scheme
from qkit.schemes.observers import observer_type
from qkit.threads import one_torch_thread

ESTIMATOR = "fisher-diagonal x gptq/rtn output-error ratio"


def serves(scheme: Scheme | None) -> bool:
    """Whether GPTQ chooses this candidate's codes (None, kept unquantized: no)."""
    return scheme is not None and observer_type(scheme) is not None


def record(options: GPTQOptions) -> dict:
    """The GPTQ options a plan's costs were measured with (the ones quantize must use; see ``same_options``)."""
    return {k: v for k, v in asdict(options).items() if k in MEASURED_OPTIONS}


# the GPTQ options that change the codes (the calibration text and windows change only the Hessian's estimate)
MEASURED_OPTIONS = ("dampening", "hessian_shrink", "act_order", "static_groups", "scale_rule", "block_size")


def _solve(W: torch.Tensor, scheme: Scheme, prepared: PreparedHessian, options: GPTQOptions,
           quant_weights: torch.Tensor | None) -> torch.Tensor:
    with one_torch_thread():  # the column loop is many small operations: faster on one thread (method.py)
        return gptq_solve(W, None, scheme, block_size=options.block_size, prepared=prepared,
                          scale_rule=options.scale_rule, quant_weights=quant_weights,
                          static_groups=options.static_groups).dequantized


def _walk(model, ids: torch.Tensor, targets: set[str], read: Callable[[str], torch.Tensor], options: GPTQOptions,
          each: Callable[[str, torch.Tensor, torch.Tensor, PreparedHessian, torch.nn.Linear], None], *,
          sequential: bool, held_out: bool, device: torch.device) -> None:
    """Walk ``model``'s blocks on ``ids``; for every target linear call ``each(name, W, G, prepared, linear)``
    with its source weights ``W`` (fp32, from ``read``), a Gram ``G`` of its inputs and the factor GPTQ solves
    with, prepared once for the linears fed the same input. ``held_out`` (two windows or more): the factor
    from the first half of the windows, ``G`` from the second; otherwise both from every window.
    ``sequential``: the next block sees this block's outputs after ``each`` changed its weights; otherwise the
    reference outputs (``each`` must then leave the weights alone). The model is put back on ``device``
    afterwards (the walk leaves blocks on the CPU)."""
    n = int(ids.shape[0])
    halves = held_out and n >= 2

    def process(_i: int, _block: torch.nn.Module, inputs: BlockInputs) -> list[torch.Tensor] | None:
        linears = {k: m for k, m in inputs.linears().items() if inputs.prefix + k + ".weight" in targets}
        if not linears:
            return None
        parts = [(inputs.hidden[k:k + 1], inputs.kwargs[k:k + 1]) for k in range(len(inputs.hidden))] if halves \
            else [(inputs.hidden, inputs.kwargs)]
        accs = [HessianInputs() for _ in parts]
        outputs: list[torch.Tensor] = []
        for acc, (hidden, kwargs) in zip(accs, parts):
            outputs += BlockInputs(inputs.block, inputs.prefix, hidden, kwargs).forward(on_input=acc.add, modules=linears)
        solve_acc, measure_acc = accs[0], accs[-1]
        prepared: dict[str, PreparedHessian] = {}
        for k, linear in linears.items():
            owner = solve_acc.owner[k]
            if owner not in prepared:
                with one_torch_thread():
                    prepared[owner] = prepare_hessian(solve_acc.gram(owner), options.dampening, options.act_order,
                                                    options.hessian_shrink)
            G = measure_acc.gram(measure_acc.owner[k])
            full = inputs.prefix + k + ".weight"
            each(full, read(full).to(device=G.device, dtype=torch.float32), G, prepared[owner], linear)
        for acc in accs:
            acc.release()
        return None if sequential else outputs

    try:  # held out: two batches, the halves (the first ceil(n/2) windows, then the rest)
        walk_blocks(model, ids, process, device=device, batch_size=(n + 1) // 2 if halves else n)
    finally:
        if device.type != "cpu":
            model.to(device)


def output_error_ratios(model, ids: torch.Tensor, options: Mapping[str, Sequence[Candidate]],
                        read: Callable[[str], torch.Tensor], *, gptq: GPTQOptions,
                        quant_weights: Callable[[str, Candidate], torch.Tensor | None], device: torch.device,
                        on_tensor: Callable[[int, int], None] | None = None) -> tuple[dict[str, list[float]], dict]:
    """Per target and candidate, ``e(W, Ŵ_gptq) / e(W, Ŵ_rtn)`` (module docstring; 1.0 for a candidate GPTQ
    does not serve, or whose RTN output error is 0), with the reference's inputs; and a record (seconds,
    solves, tokens). ``read(name)``: the tensor's source weights; ``quant_weights(name, candidate)``: the
    importance weights that candidate quantizes with (None: unweighted). The model is not changed."""
    t0 = time.perf_counter()
    ratios: dict[str, list[float]] = {}
    solves = 0

    def each(name: str, W: torch.Tensor, G: torch.Tensor, prepared: PreparedHessian, _linear) -> None:
        nonlocal solves
        row = []
        for c in options[name]:
            if not serves(c.scheme):
                row.append(1.0)
                continue
            qw = quant_weights(name, c)
            rtn = rtn_dequantized(W, c.scheme, qw)
            e_rtn, e_gptq = output_errors(W, [rtn, _solve(W, c.scheme, prepared, gptq, qw)], G)
            solves += 1
            row.append(e_gptq / e_rtn if e_rtn > 0 else 1.0)
        ratios[name] = row
        if on_tensor is not None:
            on_tensor(len(ratios), len(options))

    _walk(model, ids, set(options), read, gptq, each, sequential=False, held_out=True, device=device)
    missing = set(options) - set(ratios)
    for name in missing:  # a target outside the blocks (or not an nn.Linear): GPTQ writes it by RTN
        ratios[name] = [1.0] * len(options[name])
    n = int(ids.shape[0])
    solved_on = (n + 1) // 2 if n >= 2 else n
    return ratios, {"estimator": ESTIMATOR, "gptq": record(gptq), "solves": solves,
                    "solved_on_windows": solved_on, "measured_on_windows": n - solved_on if n >= 2 else n,
                    "rtn_targets": sorted(missing), "seconds": round(time.perf_counter() - t0, 3)}


def solved_weights(model, ids: torch.Tensor, chosen: Mapping[str, Candidate], read: Callable[[str], torch.Tensor], *,
                   gptq: GPTQOptions, quant_weights: Callable[[str, Candidate], torch.Tensor | None],
                   device: torch.device) -> list[str]:
    """Put into ``model`` GPTQ's dequantized weights for each target's ``chosen`` candidate (RTN's for a
    candidate GPTQ does not serve and for a target outside the blocks), solving each block from the outputs
    of the blocks before it as already changed (what the file's GPTQ pass does). Returns the names changed
    (the caller restores them)."""
    changed: list[str] = []

    def each(name: str, W: torch.Tensor, _G, prepared: PreparedHessian, linear: torch.nn.Linear) -> None:
        c = chosen[name]
        if c.scheme is None:
            return
        qw = quant_weights(name, c)
        W_hat = _solve(W, c.scheme, prepared, gptq, qw) if serves(c.scheme) else rtn_dequantized(W, c.scheme, qw)
        changed.append(name)
        linear.weight.data.copy_(W_hat.to(device=linear.weight.device, dtype=linear.weight.dtype))

    _walk(model, ids, {n for n, c in chosen.items() if c.scheme is not None}, read, gptq, each, sequential=True,
          held_out=False, device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(set(chosen) - set(changed)):
            c = chosen[name]
            if c.scheme is not None and name in params:
                params[name].copy_(rtn_dequantized(read(name).float(), c.scheme, quant_weights(name, c)).to(params[name].dtype))
                changed.append(name)
    return changed


__all__ = ["ESTIMATOR", "MEASURED_OPTIONS", "output_error_ratios", "record", "serves", "solved_weights"]
