"""Mixture-of-experts in the calibrated methods: each expert matrix its own ``nn.Linear`` while they run.

transformers (5.x) holds a mixture-of-experts layer's experts fused, as one module with two 3-D
parameters: ``gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj``
``[E, H, I]``, called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. A
checkpoint stores one 2-D matrix per expert (``mlp.experts.3.gate_proj.weight``, mixtral's
``block_sparse_moe.experts.3.w1.weight``), and qkit quantizes those. The methods hook ``nn.Linear``
modules, so none of them would see an expert.

``unfused_experts(model, config, every_token)`` replaces, for the duration of a method, each fused module by
``ExpertLinears``: one ``nn.Linear`` per expert matrix (views of the fused weights, no copy), named as the
checkpoint names them (``linear_names``), whose forward routes exactly as the fused one: expert ``e`` runs
on the tokens whose top-k holds ``e`` and its output, times the router's weight, is added to those
tokens'. Each expert's linears therefore see exactly the tokens the router sends it. With ``every_token``
(llm-compressor's ``moe_calibrate_all_experts``) every expert runs on every token, so its statistics
cover them all, and the layer's output still combines only the router's top-k with its weights. On exit
the fused modules are put back, holding whatever weights the linears hold then (a method's quantized
ones), or nothing where a walk released them.

gpt_oss (``GptOssExperts``) holds its experts otherwise: ``gate_up_proj`` ``[E, H, 2I]`` (``[in, out]`` per expert,
gate and up interleaved by alternate columns: ``gate = gate_up_proj[e][:, ::2]``), ``down_proj`` ``[E, I, H]``,
a bias per expert matrix, the router's softmax over its top-k logits, and a clamped SwiGLU with ``alpha``
(``_apply_gate``). Its ``ExpertLayout`` is ``transposed``: each expert's gate, up and down are the transposed,
column-strided views ``gate_up_proj[e][:, ::2].T`` ``[I, H]``, ``gate_up_proj[e][:, 1::2].T``, ``down_proj[e].T``
``[H, I]`` (nothing copied), with their biases, and the expert computes gpt_oss's clamped SwiGLU. Its checkpoint
stores the fused 3-D tensors (``mlp.experts.gate_up_proj``), not one matrix per expert, so its expert
linears carry the names llama.cpp's converter splits them into (``mlp.experts.3.gate_proj``: ``ffn_gate_exps``
row 3; ``virtual_experts``), which the GGUF route and the importance matrix use; ``qkit quantize --format qkit``
keeps gpt_oss's experts in their source dtype.

The measuring commands leave the fused modules in place: ``expert_matrices(model, config)`` gives each expert
matrix by its stored name as a 2-D view of the fused parameter (``expert_views``), so ``qkit eval`` streams a
row's expert matrices into the model (``evaluation.swap``) and ``qkit inspect sensitivity`` quantizes one in
place under the name ``qkit quantize`` writes it with.

Layer 5 (``methods``), below the methods that use it (``sequential``, ``gptq``, ``imatrix``) and the
measuring commands (``evaluation``, ``inspect``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from qkit.errors import InputError
from qkit.schemes.recipes import expert_count
from qkit.transform import FUSED_MODULES

# The methods that calibrate experts through ``unfused_experts``; the others are refused for a
# mixture-of-experts model (``check_method``).
ROUTED_METHODS = ("gptq", "imatrix", "awq")


@dataclass(frozen=True)
class ExpertLayout:
    """Where an architecture keeps its experts: ``moe`` the sparse block's attribute in a decoder layer
    (in memory), ``stored`` its name in the checkpoint, ``gate``/``up``/``down`` the stored names of each
    expert's three matrices, ``router`` the router's attribute in the sparse block."""

    moe: str
    stored: str
    gate: str
    up: str
    down: str
    router: str = "gate"
    # gpt_oss's GptOssExperts: [E, in, out] parameters, gate and up interleaved by column, a bias per expert
    # matrix, the clamped SwiGLU; the checkpoint stores the fused 3-D tensors (see the module docstring)
    transposed: bool = False

    @property
    def names(self) -> tuple[str, str, str]:
        return self.gate, self.up, self.down

    def stored_name(self, name: str) -> str:
        """A name in the loaded model (``model.layers.0.mlp.gate.weight``) as the checkpoint stores it (mixtral:
        ``model.layers.0.block_sparse_moe.gate.weight``: every mixtral layer's MLP is its sparse block)."""
        return name if self.moe == self.stored else name.replace(f".{self.moe}.", f".{self.stored}.", 1)


_QWEN = ExpertLayout("mlp", "mlp", "gate_proj", "up_proj", "down_proj")
# model_type -> layout: transformers' conversion mapping (``conversion_mapping.py``: qwen2_moe's pattern,
# mixtral's with ``.block_sparse_moe.`` renamed ``.mlp.``), for the architectures whose fused forward
# ``ExpertLinears`` reproduces (tests/test_moe_calibration.py)
LAYOUTS: dict[str, ExpertLayout] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "mixtral": ExpertLayout("mlp", "block_sparse_moe", "w1", "w3", "w2"),
}
# The layouts the calibrated methods route through (``unfused_experts``): LAYOUTS, whose checkpoints store one
# matrix per expert, and gpt_oss, whose experts are calibrated under llama.cpp's per-expert names but whose
# checkpoint stores them fused (``virtual_experts``); ``qkit plan``, the evaluation's swap and ``qkit verify``
# read LAYOUTS only.
GPT_OSS = ExpertLayout("mlp", "mlp", "gate_proj", "up_proj", "down_proj", router="router", transposed=True)
ROUTED_LAYOUTS: dict[str, ExpertLayout] = {**LAYOUTS, "gpt_oss": GPT_OSS}
# transformers' ``use_experts_implementation`` flags of each fused layout, and the parameters it holds
_FLAGS = {False: {"is_transposed": False, "has_bias": False, "is_concatenated": True, "has_gate": True,
                  "has_post_expert_norm": False},
          True: {"is_transposed": True, "has_bias": True, "is_concatenated": False, "has_gate": True,
                 "has_post_expert_norm": False}}
# gpt_oss's gate_up_proj [E, H, 2I] holds expert e's gate in its even columns, its up in the odd ones
GATE_COLUMNS, UP_COLUMNS = slice(0, None, 2), slice(1, None, 2)
_PARAMS = {False: {"gate_up_proj", "down_proj"},
           True: {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}}
# Why another mixture-of-experts architecture's experts are not calibrated, where that is known
_WHY_NOT = {
    "gpt_oss": "gpt_oss stores each layer's experts as 3-D tensors [experts, in, out] (mlp.experts.gate_up_proj, "
               "gate and up interleaved by column, with biases), not one 2-D matrix per expert, which is what qkit "
               "plans and writes in its own format (qkit quantize writes its attention, and with --format gguf its "
               "experts too)",
}


def fused_modules(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """vLLM's fused modules of a model of ``config`` (``transform.fused_key``): ``transform.FUSED_MODULES``, plus
    each expert's gate and up where the architecture names them otherwise (mixtral's ``w1``/``w3``, which vLLM's
    fused-MoE loader stacks into one ``w13`` per expert)."""
    layout = LAYOUTS.get(str(config.get("model_type")))
    if layout is None or layout.gate in FUSED_MODULES["gate_up_proj"]:
        return dict(FUSED_MODULES)
    return {**FUSED_MODULES, "w13": (layout.gate, layout.up)}


def layout_for(config: Mapping[str, Any], doing: str = "calibration is routed to",
               layouts: Mapping[str, ExpertLayout] = ROUTED_LAYOUTS) -> ExpertLayout | None:
    """The experts' layout of a mixture-of-experts ``config`` among ``layouts`` (default: every one the methods
    route calibration through; ``LAYOUTS``: those stored one matrix per expert); None for a dense model. Another
    architecture is refused in one line naming why (``doing``: what reaches the experts of the known
    architectures only, e.g. ``qkit plan prices``)."""
    n = expert_count(dict(config))
    if n <= 1:
        return None
    arch = str(config.get("model_type"))
    if arch in layouts:
        return layouts[arch]
    why = _WHY_NOT.get(arch, f"qkit does not know how {arch} holds its experts: quantize it with --method rtn")
    raise InputError(f"a mixture-of-experts {arch} model ({n} experts per layer): {doing} the experts of "
                     f"{', '.join(sorted(layouts))} models only; {why}")


def check_method(config: Mapping[str, Any], method: str, options: Any) -> None:
    """Refuse, in one line before any work, a calibrated ``method`` (with ``options``) that cannot serve a
    model of ``config``: ``--calibrate-all-experts`` without experts; on a mixture-of-experts model, a method
    other than ``ROUTED_METHODS``, an architecture without a layout, and ``--holdout``."""
    every = bool(getattr(options, "calibrate_all_experts", False))
    n = expert_count(dict(config))
    if n <= 1:
        if every:
            raise InputError("--calibrate-all-experts sends every calibration token to every expert; this model has no "
                             "experts: drop it")
        return
    if method not in ROUTED_METHODS:
        raise InputError(
            f"--method {method} is not run on mixture-of-experts models ({n} experts per layer): it moves activation "
            "outliers into the weights for int8 activations, and qkit runs no expert's activations in int8 (the W8A8 "
            "rows are refused on these models); use --method gptq, awq (or imatrix)")
    # awq searches its scales over 2-D linears: the layouts stored one matrix per expert (not gpt_oss's)
    layout_for(config, "awq folds scales into", LAYOUTS) if method == "awq" else layout_for(config)
    if getattr(options, "holdout", 0):
        raise InputError("--holdout keeps whole calibration windows out of each Hessian; an expert is calibrated on the "
                         "tokens routed to it, not on windows: drop --holdout for a mixture-of-experts model")


def _transposed(fused: torch.nn.Module) -> bool:
    """Whether ``fused`` holds gpt_oss's layout (``ExpertLayout.transposed``): transformers' own flag."""
    return bool(getattr(fused, "is_transposed", False))


def expert_views(fused: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each expert's ``(gate [I, H], up [I, H], down [H, I])`` (``[out, in]``, as ``nn.Linear``) of a fused experts
    module: views of its two parameters, nothing copied, so writing into one writes the model's weight.
    Concatenated: ``gate_up_proj[e, :I]``, ``gate_up_proj[e, I:]``, ``down_proj[e]``; gpt_oss's transposed
    layout: ``gate_up_proj[e][:, 0::2].T``, ``gate_up_proj[e][:, 1::2].T``, ``down_proj[e].T`` (strided)."""
    gate_up, down = fused.gate_up_proj.data, fused.down_proj.data
    if _transposed(fused):
        return [(gate_up[e][:, GATE_COLUMNS].T, gate_up[e][:, UP_COLUMNS].T, down[e].T) for e in range(gate_up.shape[0])]
    inter = down.shape[2]
    return [(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(gate_up.shape[0])]


def expert_biases(fused: torch.nn.Module) -> list[tuple[torch.Tensor | None, ...]]:
    """Each expert's ``(gate [I], up [I], down [H])`` biases (views of ``gate_up_proj_bias[e][0::2]``,
    ``[1::2]``, ``down_proj_bias[e]``: gpt_oss's), or Nones for a layout without biases."""
    if not _transposed(fused):
        return [(None, None, None)] * fused.gate_up_proj.shape[0]
    gate_up, down = fused.gate_up_proj_bias.data, fused.down_proj_bias.data
    return [(gate_up[e][GATE_COLUMNS], gate_up[e][UP_COLUMNS], down[e]) for e in range(gate_up.shape[0])]


def _gated(fused: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(gate(x), up(x)) -> the down projection's input`` of one expert of ``fused``: ``act(g) * u``, or gpt_oss's
    clamped SwiGLU (transformers' ``GptOssExperts._apply_gate``: gate clamped above at ``limit``, up to
    ``[-limit, limit]``, ``(u + 1) * g * sigmoid(alpha * g)``)."""
    if not _transposed(fused):
        act = fused.act_fn
        return lambda g, u: act(g) * u
    alpha, limit = fused.alpha, fused.limit

    def clamped_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = g.clamp(min=None, max=limit), u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    return clamped_swiglu


def _matrices(layout: ExpertLayout, inter: int, e: int) -> tuple[tuple[str, str, tuple], ...]:
    """Expert ``e``'s three matrices in a fused module whose experts are ``inter`` wide: ``(stored name, fused
    parameter, index of its slice)``, gate, up, down: ``gate_up_proj[e, :inter]``, ``gate_up_proj[e, inter:]``,
    ``down_proj[e]`` (transformers' conversion concatenates each expert's gate and up rows, then stacks)."""
    return ((layout.gate, "gate_up_proj", (e, slice(0, inter))), (layout.up, "gate_up_proj", (e, slice(inter, 2 * inter))),
            (layout.down, "down_proj", (e,)))


def stored_path(path: str, layout: ExpertLayout) -> str:
    """A fused experts module's path (``model.layers.0.mlp.experts``) as the checkpoint names it (mixtral:
    ``model.layers.0.block_sparse_moe.experts``)."""
    head = path[: len(path) - len(layout.moe + ".experts")]
    return f"{head}{layout.stored}.experts"


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    """An ``nn.Linear`` whose weight (and bias) are ``weight`` and ``bias`` themselves (views: nothing is copied)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


class _Expert(torch.nn.Module):
    """One expert: ``down(gated(gate(x), up(x)))`` (``_gated``), its linears under the checkpoint's names."""

    def __init__(self, layout: ExpertLayout, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                 gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        for name, w, b in zip(layout.names, weights, biases):
            self.add_module(name, _linear(w, b))
        object.__setattr__(self, "_gated", gated)  # the fused module's activation, shared by every expert
        object.__setattr__(self, "_names", layout.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(self._gated(gate(x), up(x)))


class ExpertLinears(torch.nn.ModuleList):
    """A fused experts module as one ``_Expert`` per expert (see the module docstring). ``routed``: int64
    ``[E]``, the tokens the router has sent each expert since it was last zeroed."""

    def __init__(self, fused: torch.nn.Module, layout: ExpertLayout, every_token: bool, router: torch.nn.Module):
        gated = _gated(fused)
        super().__init__(_Expert(layout, w, b, gated) for w, b in zip(expert_views(fused), expert_biases(fused)))
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "every_token", every_token)
        object.__setattr__(self, "router", router)  # the sparse block's: its input is the experts'
        object.__setattr__(self, "routed", torch.zeros(len(self), dtype=torch.int64))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[T, H]``, ``top_k_index`` int ``[T, k]``, ``top_k_weights`` ``[T, k]`` -> ``[T, H]``:
        ``sum over the k chosen e of weight * expert_e(x)``, experts in index order as transformers adds them."""
        out = torch.zeros_like(hidden_states)
        picks = top_k_index.reshape(-1)
        self.routed += torch.bincount(picks[picks < len(self)].cpu(), minlength=len(self))
        for e, expert in enumerate(self):
            pos, token = torch.where(top_k_index.T == e)  # the order transformers' one-hot mask gives
            if self.every_token:
                y = expert(hidden_states)[token]
            elif token.numel():
                y = expert(hidden_states[token])
            else:
                continue
            # index_put_ (a token picks an expert once: no index repeats) rather than index_add_, whose CPU
            # kernel waits on the thread pool: 20 ms against 0.01 ms for [128, 64] rows on a busy 2-core machine
            out.index_put_((token,), (y * top_k_weights[token, pos, None]).to(out.dtype), accumulate=True)
        return out

    def stored_path(self, path: str) -> str:
        """This module's path (``path``, e.g. ``mlp.experts`` or ``model.layers.0.mlp.experts``) as the checkpoint
        names it (mixtral: ``model.layers.0.block_sparse_moe.experts``)."""
        return stored_path(path, self.layout)

    def restore(self, fused: torch.nn.Module) -> None:
        """Put the experts' current weights (and biases) back into ``fused``'s parameters (empty where they were
        released), in its layout: concatenated, or gpt_oss's transposed with gate and up interleaved by column."""
        linears = [[getattr(e, n) for e in self] for n in self.layout.names]
        gate, up, down = ([m.weight.data for m in ms] for ms in linears)
        params = dict(fused.named_parameters(recurse=False))
        if any(w.numel() == 0 for w in (*gate, *up, *down)):
            for p in params.values():
                p.data = torch.empty(0, dtype=p.dtype)
            return
        if not self.layout.transposed:
            fused.gate_up_proj.data = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            fused.down_proj.data = torch.stack(down)
            return
        # row 2j of [gate; up] interleaved is gate row j, row 2j+1 up row j: gate_up_proj[e] is its transpose
        fused.gate_up_proj.data = torch.stack([torch.stack([g, u], 1).flatten(0, 1).T for g, u in zip(gate, up)])
        fused.down_proj.data = torch.stack([d.T for d in down])
        gb, ub, db = ([m.bias.data for m in ms] for ms in linears)
        fused.gate_up_proj_bias.data = torch.stack([torch.stack([g, u], 1).flatten() for g, u in zip(gb, ub)])
        fused.down_proj_bias.data = torch.stack(db)


def _fused(module: torch.nn.Module) -> bool:
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.ndim == 3 and not isinstance(module, ExpertLinears)


def fused_paths(model: torch.nn.Module) -> list[str]:
    """Where ``model`` holds experts fused in 3-D parameters (``gate_up_proj`` ``[E, ., .]``), whatever the
    architecture (gpt_oss's too): modules whose experts no hook on ``nn.Linear`` reaches."""
    return [name for name, module in model.named_modules() if _fused(module)]


def _check_fused(name: str, module: torch.nn.Module, layout: ExpertLayout) -> None:
    """The fused layout ``ExpertLinears`` reproduces and ``expert_views`` reads (transformers'
    ``use_experts_implementation`` flags): concatenated gate/up, [out, in] per expert, no biases, a gate, no
    norm after each expert; or, for a ``transposed`` layout, gpt_oss's [in, out], interleaved, with biases."""
    flags = _FLAGS[layout.transposed]
    odd = [k for k, v in flags.items() if getattr(module, k, v) != v]
    params = {n for n, _ in module.named_parameters(recurse=False)}
    if odd or params != _PARAMS[layout.transposed] or not name.endswith(f"{layout.moe}.experts"):
        raise InputError(f"{name} ({type(module).__name__}) is not the fused experts layout qkit reads one matrix per "
                         f"expert from ({', '.join(odd) or ', '.join(sorted(params))}); quantize it with --method rtn")


@dataclass(frozen=True)
class FusedExperts:
    """One fused experts module of a loaded model: ``path`` where it sits (``model.layers.0.mlp.experts``),
    ``stored`` the name the checkpoint gives its experts (mixtral: ``model.layers.0.block_sparse_moe.experts``)."""

    path: str
    stored: str
    module: torch.nn.Module
    layout: ExpertLayout

    def matrices(self) -> dict[str, torch.Tensor]:
        """Each expert matrix by the name the checkpoint stores it under (``{stored}.3.gate_proj.weight``):
        ``expert_views``, so writing into one writes the model's fused weight."""
        return {f"{self.stored}.{e}.{n}.weight": w for e, views in enumerate(expert_views(self.module))
                for n, w in zip(self.layout.names, views)}


def fused_experts(model: torch.nn.Module, config: Mapping[str, Any]) -> list[FusedExperts]:
    """Every fused experts module of ``model`` (of ``config``), in module order: none for a dense model, nor for
    a mixture-of-experts architecture without a layout (gpt_oss, whose 3-D experts qkit keeps in their source
    dtype). A module not laid out as ``expert_views`` reads it is refused in one line."""
    layout = LAYOUTS.get(str(config.get("model_type"))) if expert_count(dict(config)) > 1 else None
    return [] if layout is None else _found(model, layout)


def _found(model: torch.nn.Module, layout: ExpertLayout) -> list[FusedExperts]:
    """Every fused experts module of ``model``, each checked to hold ``layout`` (refused in one line otherwise)."""
    found = [(name, module) for name, module in model.named_modules() if _fused(module)]
    for name, module in found:
        _check_fused(name, module, layout)
    return [FusedExperts(name, stored_path(name, layout), module, layout) for name, module in found]


def stored_aliases(model: torch.nn.Module, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Each parameter of ``model`` that the checkpoint stores under another name, by that name (mixtral's router
    ``model.layers.0.mlp.gate.weight`` as ``model.layers.0.block_sparse_moe.gate.weight``); {} where the names
    agree (a dense model, qwen3_moe, qwen2_moe, or an architecture without a layout)."""
    layout = LAYOUTS.get(str(config.get("model_type"))) if expert_count(dict(config)) > 1 else None
    if layout is None or layout.moe == layout.stored:
        return {}
    return {layout.stored_name(n): p for n, p in model.named_parameters() if f".{layout.moe}." in n}


def expert_matrices(model: torch.nn.Module, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every expert matrix of ``model`` (``fused_experts``) by its stored name: a 2-D view ``[out, in]`` of the
    fused parameter it lives in, the tensor ``qkit quantize`` reads and writes under that name."""
    return {n: w for f in fused_experts(model, config) for n, w in f.matrices().items()}


@contextmanager
def unfused_experts(model: torch.nn.Module, config: Mapping[str, Any], every_token: bool = False) -> Iterator[list[ExpertLinears]]:
    """Within the block, every fused experts module of ``model`` is an ``ExpertLinears`` (module docstring);
    yields them (none for a dense model). A mixture-of-experts model without one is refused in one line."""
    layout = layout_for(config)
    swapped: list[tuple[torch.nn.Module, torch.nn.Module, ExpertLinears]] = []
    try:
        if layout is not None:
            for found in _found(model, layout):
                module = found.module
                parent = model.get_submodule(found.path.rpartition(".")[0])
                unfused = ExpertLinears(module, layout, every_token, getattr(parent, layout.router))
                # the views own the weights now: a walk that releases a block's parameters frees them
                for p in module.parameters(recurse=False):
                    p.data = torch.empty(0, dtype=p.dtype)
                parent.experts = unfused
                swapped.append((parent, module, unfused))
            if not swapped:
                raise InputError(f"{type(model).__name__} holds no fused experts module although its config gives "
                                 f"{expert_count(dict(config))} experts; quantize it with --method rtn")
        yield [u for _, _, u in swapped]
    finally:
        for parent, fused, unfused in reversed(swapped):
            unfused.restore(fused)
            parent.experts = fused


def expert_slices(model: torch.nn.Module, config: Mapping[str, Any]) -> dict[str, tuple[str, tuple]]:
    """Where each expert matrix the checkpoint stores sits in ``model``'s fused parameters: ``{stored name
    (model.layers.0.mlp.experts.3.gate_proj.weight): (the fused parameter's name in the model, the index of
    its slice)}``, e.g. ``("model.layers.0.mlp.experts.gate_up_proj", (3, slice(0, I)))``: the slices
    ``ExpertLinears`` takes as its linears' weights. ``params[p][index]`` is a view (writing it writes the
    fused parameter) holding exactly the stored tensor as loaded. {} for a dense model; a mixture-of-experts
    model without a known layout or without a fused experts module is refused in one line."""
    layout = layout_for(config, layouts=LAYOUTS)
    if layout is None:
        return {}
    out: dict[str, tuple[str, tuple]] = {}
    for name, module in model.named_modules():
        if not _fused(module):
            continue
        _check_fused(name, module, layout)
        stored, inter = stored_path(name, layout), module.down_proj.shape[2]
        for e in range(module.gate_up_proj.shape[0]):
            out.update({f"{stored}.{e}.{m}.weight": (f"{name}.{p}", i) for m, p, i in _matrices(layout, inter, e)})
    if not out:
        raise InputError(f"{type(model).__name__} holds no fused experts module although its config gives "
                         f"{expert_count(dict(config))} experts; quantize it with --method rtn")
    return out


def routed_width(config: Mapping[str, Any]) -> int:
    """The experts' intermediate width one token computes through: ``num_experts_per_tok`` experts of
    ``moe_intermediate_size`` (mixtral: ``intermediate_size``), plus qwen2_moe's shared expert; 0 for a dense
    model (what a block's saved activations scale with, ``qkit.plan.memory``)."""
    if expert_count(dict(config)) <= 1:
        return 0
    width = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    return int(config.get("num_experts_per_tok") or 1) * width + int(config.get("shared_expert_intermediate_size") or 0)


def linear_names(root: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` under ``root`` by its name as the checkpoint names the weight, ``.weight`` left off
    (an expert's: ``block_sparse_moe.experts.3.w1`` for mixtral, though it sits at ``mlp.experts.3.w1``)."""
    renames = [(n + ".", m.stored_path(n) + ".") for n, m in root.named_modules() if isinstance(m, ExpertLinears)]
    out = {}
    for n, m in root.named_modules():
        if isinstance(m, torch.nn.Linear):
            old, new = next(((o, s) for o, s in renames if n.startswith(o)), ("", ""))
            out[new + n[len(old):]] = m
    return out


def routers(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The router of every ``ExpertLinears`` under ``root``, by its weight's stored name, ``.weight`` left off
    (``mlp.gate``, ``block_sparse_moe.gate``): its input is the tokens the experts choose among."""
    return {m.stored_path(n)[: -len(".experts")] + "." + m.layout.router: m.router
            for n, m in root.named_modules() if isinstance(m, ExpertLinears)}


def routed_tokens(root: torch.nn.Module, reset: bool = False) -> dict[str, int]:
    """The tokens the router has sent each expert under ``root`` (by its stored prefix,
    ``mlp.experts.3``), since the counts were last reset; ``reset``: zero them after reading."""
    out = {}
    for n, m in root.named_modules():
        if isinstance(m, ExpertLinears):
            out.update({f"{m.stored_path(n)}.{e}": int(c) for e, c in enumerate(m.routed.tolist())})
            if reset:
                m.routed.zero_()
    return out


__all__ = ["GATE_COLUMNS", "GPT_OSS", "UP_COLUMNS", "ROUTED_LAYOUTS", "ExpertLayout", "ExpertLinears", "FusedExperts",
           "LAYOUTS", "ROUTED_METHODS", "check_method", "expert_biases", "expert_matrices", "expert_slices", "expert_views", "fused_experts", "fused_modules",
           "fused_paths", "layout_for", "linear_names", "routed_tokens", "routed_width", "routers",
           "stored_aliases", "stored_path", "unfused_experts"]
