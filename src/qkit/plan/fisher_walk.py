"""The diagonal Fisher of the block projections, block by block: one pass down the model whatever its size.

``sensitivity.fisher_diagonal`` runs the whole model forward and backward per window and holds the float32
diagonal of every target it measures until the last window; a model whose Fisher does not fit beside its
weights (26 GiB of it for a 7B model) then needs a pass over the windows per group of targets, and the
plan's time grows as the parameters times the groups. This walk computes the same numbers with the
transformer blocks as checkpoints:

1. **Forward**, per window: the model's own forward pass, with forward pre-hooks that keep every block's
   input and keyword arguments as the model gives them (a layer of another attention type gets its own
   mask), and a forward hook that makes the last block's output a leaf with gradients, so that only the
   top (the final norm, the head and whatever else the model does after its blocks) records a graph: no
   parameter requires a gradient in this pass. Log-probabilities, the labels sampled from them (seeded,
   as ``fisher_diagonal`` samples them) or given, the loss ``sum_t log p(y_t)`` and its gradient at the
   last block's output.
2. **Down the blocks**, last first: per window, block ``i`` runs again on its kept input with gradients on;
   the backward pass from the gradient at its output gives its targets' gradients (each squared into the
   float32 diagonal the moment autograd has it, then freed) and the gradient at its input, where block
   ``i - 1`` starts. Once every window is through block ``i``, its targets' diagonals are complete and are
   handed to ``consume`` (the planner costs their candidates and frees them) before block ``i - 1`` runs.
   The walk stops at the lowest block with a target.

A mixture-of-experts layer's experts are one fused parameter in transformers (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) and one matrix each in the checkpoint: step 2 then takes the fused parameter's
gradient and adds each planned expert matrix's slice of it, squared, into that matrix's own diagonal
(``views``): exactly the fused parameter's diagonal, sliced (``tests/test_plan_moe.py``, bit for bit).

Block ``i``'s weights change window ``w``'s loss only through block ``i``'s output on ``w``, so step 2 gives
each target the whole gradient of each window's loss: the diagonal ``fisher_diagonal`` measures, from the
same operations in the same order (``tests/test_fisher_walk.py`` checks it bit for bit: llama in fp32 and
bf16, qwen2 with full and sliding-window layers, gpt2).

Cost: the blocks' forward twice and their backward once (gradient checkpointing at the blocks), against a
forward and backward pass of the whole model per group (docs/scale.md: a 7B-shaped plan in 773 s within its
bf16 weights + 3 GiB, where the whole-model passes needed 20 or more). Memory besides the model: the kept inputs
(``n x L`` tensors of ``[1, T, hidden]`` at the model's dtype, each freed once its block is walked), one
window's gradient at the current block boundary, one block's activations for one window, and one
block's diagonal (``qkit.plan.memory``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from qkit.dtypes import dtype_of, non_finite_activations
from qkit.methods.sequential import find_blocks, first_output
from qkit.plan.sensitivity import Fisher


def block_targets(model: torch.nn.Module, targets: Sequence[str]) -> tuple[dict[int, list[str]], list[str]]:
    """``({block index: its targets}, [targets outside the blocks])``: which targets the walk measures, in
    the order given, and which it cannot (an embedding, a tied or untied head: ``fisher_diagonal``)."""
    name, blocks = find_blocks(model)
    inside: dict[int, list[str]] = {}
    outside = []
    for t in targets:
        rest = t[len(name) + 1:] if t.startswith(name + ".") else ""
        index = rest.split(".", 1)[0]
        if index.isdigit() and int(index) < len(blocks) and "." in rest:
            inside.setdefault(int(index), []).append(t)
        else:
            outside.append(t)
    return inside, outside


def fisher_by_blocks(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: Sequence[str],
    consume: Callable[[dict[str, torch.Tensor]], None],
    *,
    views: Mapping[str, tuple[str, tuple]] | None = None,
    seed: int = 0,
    check_windows: int = 0,
    labels: torch.Tensor | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> Fisher:
    """The diagonal Fisher of ``targets`` (parameters inside ``model``'s transformer blocks) over windows
    ``ids`` (int64 ``[n, w]``), by the walk of the module docstring: ``consume({target: float32 [out, in]})``
    is called once per block that holds targets, last block first, with that block's complete diagonals
    (the mean per position, as ``fisher_diagonal`` gives them); the caller keeps or frees them. Returns the
    ``Fisher`` of the walk with an empty ``diag``: the positions, the first ``check_windows`` windows'
    reference log-probabilities, and the labels (sampled with a generator seeded by ``seed``, or
    ``labels``). ``on_step(done, total)`` counts the forward pass and the blocks walked back.

    ``views``: the targets that are a slice of a parameter, ``{target: (parameter name, index)}`` (a
    mixture-of-experts layer's experts, which transformers holds as one fused parameter:
    ``methods.experts.expert_slices``); every other target is a parameter itself. Such a target's diagonal is
    ``grad[index]`` squared, added from the fused parameter's gradient the moment autograd has it: the same
    float32 numbers as that parameter's whole diagonal, sliced, and only the targets' elements held.

    Every parameter's ``requires_grad`` is restored afterwards, also on an error."""
    t0 = time.perf_counter()
    inside, outside = block_targets(model, targets)
    if outside:  # a caller's bug: the planner measures those with fisher_diagonal
        raise ValueError(f"{outside[0]} is not inside the model's transformer blocks")
    if labels is not None and tuple(labels.shape) != tuple(ids.shape):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for windows of shape {tuple(ids.shape)}")
    _, blocks = find_blocks(model)
    params = dict(model.named_parameters())
    seen = dict(views or {})
    device = next(model.parameters()).device
    n, n_blocks = int(ids.shape[0]), len(blocks)
    lowest = min(inside, default=n_blocks)  # the walk down stops at the lowest block with a target
    total = 1 + (n_blocks - lowest)
    say = on_step or (lambda *_: None)
    was = {k: p.requires_grad for k, p in params.items()}
    sampled = torch.empty(ids.shape, dtype=torch.int64) if labels is None else labels
    reference: list[torch.Tensor] = []
    g = torch.Generator(device="cpu").manual_seed(seed)
    try:
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None
        # 1. forward, keeping every block's input and arguments; the gradient at the last block's output
        kept, calls, grads = _forward(model, blocks, lowest, ids, device, sampled, labels is None, g, check_windows,
                                      reference)
        say(1, total)
        # 2. down the blocks
        for i in range(n_blocks - 1, lowest - 1, -1):
            names = inside.get(i, [])
            owner = {t: seen.get(t, (t, ())) for t in names}  # index (): the whole parameter
            diag = {t: torch.zeros(params[p][k].shape, dtype=torch.float32, device=device) for t, (p, k) in owner.items()}
            parts: dict[str, list[tuple[torch.Tensor, tuple]]] = {}
            for t, (p, k) in owner.items():
                parts.setdefault(p, []).append((diag[t], k))
            for p in parts:
                params[p].requires_grad_(True)
            hooks = [params[p].register_post_accumulate_grad_hook(_accumulate(params[p], held)) for p, held in parts.items()]
            try:
                for w in range(n):
                    x = kept[i][w].detach().requires_grad_(i > lowest)  # type: ignore[union-attr]
                    args, kwargs = calls[i][w]
                    kept[i][w] = calls[i][w] = None  # type: ignore[call-overload]
                    with torch.enable_grad():
                        out = first_output(blocks[i](x, *args, **kwargs))
                    torch.autograd.backward(out, grads[w])
                    grads[w] = x.grad if i > lowest else None  # type: ignore[call-overload]
                    del out, x
            finally:
                for h in hooks:
                    h.remove()
                for p in parts:
                    params[p].requires_grad_(False)
                    params[p].grad = None
            kept[i] = calls[i] = []
            for f in diag.values():
                f.div_(int(ids.numel()))
            if diag:
                consume(diag)
            del diag
            say(1 + (n_blocks - i), total)
    finally:
        for k, p in params.items():
            p.grad = None
            p.requires_grad_(was[k])
    return Fisher({}, int(ids.numel()), reference, ids[:check_windows].clone(), time.perf_counter() - t0, sampled)


def _accumulate(p: torch.Tensor, held: Sequence[tuple[torch.Tensor, tuple]]) -> Callable[[torch.Tensor], None]:
    """The hook adding ``p``'s squared gradient into each ``(diagonal, index)`` of ``held``: ``grad[index]``."""
    def hook(_: torch.Tensor) -> None:  # the moment autograd has this parameter's whole gradient of one window
        with torch.no_grad():
            for f, k in held:
                g = p.grad[k]  # a view: () the whole gradient, an expert's slice of a fused one
                f.addcmul_(g, g)  # float32 for a bf16/fp16 gradient (type promotion), as fisher_diagonal
        p.grad = None
    return hook


def _forward(model, blocks: torch.nn.ModuleList, lowest: int, ids: torch.Tensor, device: torch.device, sampled: torch.Tensor,
             sample: bool, g: torch.Generator, check_windows: int, reference: list[torch.Tensor]):
    """Step 1 of the module docstring: ``(kept, calls, grads)``, with ``kept[i][w]`` block ``i``'s input on
    window ``w`` (``[1, T, hidden]``, the model's dtype), ``calls[i][w]`` the other positional and the keyword
    arguments it was called with, and ``grads[w]`` the gradient of ``sum_t log p(y_t)`` at the last block's
    output (blocks below ``lowest``, which the walk does not reach, keep nothing); the labels written into
    ``sampled`` when ``sample``; the first ``check_windows`` windows'
    log-probabilities appended to ``reference``."""
    n = int(ids.shape[0])
    kept: list[list] = [[None] * n for _ in blocks]
    calls: list[list] = [[None] * n for _ in blocks]
    grads: list[torch.Tensor] = []
    at = {"window": 0, "leaf": None}

    def keep(i: int):
        def hook(_m, args, kwargs):
            w = at["window"]
            kept[i][w] = args[0] if args else kwargs["hidden_states"]
            calls[i][w] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
        return hook

    def leaf(_m, _args, out):  # the last block's output, made a leaf: the graph starts here
        h = first_output(out).detach().requires_grad_(True)
        at["leaf"] = h
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h

    hooks = [b.register_forward_pre_hook(keep(i), with_kwargs=True) for i, b in enumerate(blocks) if i >= lowest]
    hooks.append(blocks[-1].register_forward_hook(leaf))
    try:
        for w in range(n):
            at["window"] = w
            with torch.enable_grad():
                lp = torch.log_softmax(model(input_ids=ids[w][None].to(device), use_cache=False).logits[0].float(), dim=-1)
            if not bool(torch.isfinite(lp).all()):  # an fp16 overflow: a Fisher of NaN would price every type alike
                raise non_finite_activations(f"the model's log-probabilities on calibration window {w}", dtype_of(model))
            if sample:
                with torch.no_grad():
                    sampled[w] = torch.multinomial(lp.detach().exp().cpu(), 1, generator=g)[:, 0]
            lp.gather(1, sampled[w].to(device)[:, None]).sum().backward()
            if w < check_windows:
                reference.append(lp.detach().cpu())
            grads.append(at["leaf"].grad)  # type: ignore[union-attr]
            at["leaf"] = None
            del lp
    finally:
        for h in hooks:
            h.remove()
    return kept, calls, grads


__all__ = ["block_targets", "fisher_by_blocks"]
