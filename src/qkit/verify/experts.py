"""A mixture-of-experts export's per-expert matrices against transformers' fused experts.

A qwen3_moe, qwen2_moe or mixtral export stores one 2-D matrix per expert under the checkpoint's name
(``model.layers.N.mlp.experts.E.gate_proj``, mixtral's ``model.layers.N.block_sparse_moe.experts.E.w1``), each
quantized as a dense linear is. transformers (5.x) holds a layer's experts fused in two 3-D parameters,
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (expert ``e``'s gate rows, then its up rows) and ``down_proj``
``[E, H, I]``, and renames mixtral's ``block_sparse_moe`` to ``mlp`` (its conversion mapping;
``qkit.methods.experts.LAYOUTS`` records both). ``qkit verify`` therefore

* stacks qkit's dequantized experts into those two parameters (``fuse``) to load qkit's side, and
* reads the library's dequantized expert ``e`` back out of its fused parameters (``library_expert``) to
  compare it with qkit's, matrix by matrix, as it compares a dense linear.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qkit.errors import InputError, ModelLoadError
from qkit.methods.experts import LAYOUTS, ExpertLayout
from qkit.schemes.recipes import expert_count

# One expert's stored matrix: ``HEAD.STORED.experts.E.NAME.weight``
_EXPERT = re.compile(r"^(?P<head>.+)\.(?P<stored>[^.]+)\.experts\.(?P<e>\d+)\.(?P<name>[^.]+)\.weight$")


@dataclass(frozen=True)
class ExpertSite:
    """Where a stored expert matrix lives in transformers' model: the fused module ``module``
    (``model.layers.0.mlp.experts``), its parameter ``param`` (``gate_up_proj`` or ``down_proj``), the expert
    ``expert`` and which half of its rows (``part``: 0 gate, 1 up, None the whole ``down_proj[e]``)."""

    module: str
    param: str
    expert: int
    part: int | None


def layout(config: Mapping, names: list[str]) -> ExpertLayout | None:
    """The experts' layout of a checkpoint whose stored weights are ``names``; None when none is an expert
    matrix. An architecture qkit cannot map onto transformers' fused experts is refused in one line."""
    if not any(_EXPERT.match(n) for n in names):
        return None
    arch = str(config.get("model_type"))
    if arch not in LAYOUTS:
        raise InputError(
            f"{arch} stores one matrix per expert ({next(n for n in names if _EXPERT.match(n))}), and qkit verify maps "
            f"those onto transformers' fused experts for {', '.join(sorted(LAYOUTS))} only; it cannot verify this "
            "checkpoint")
    return LAYOUTS[arch]


def site(name: str, lay: ExpertLayout) -> ExpertSite | None:
    """The fused parameter holding the stored expert weight ``name`` (``....experts.E.gate_proj.weight``), or
    None for any other weight."""
    m = _EXPERT.match(name)
    if m is None or m["stored"] != lay.stored or m["name"] not in lay.names:
        return None
    part = lay.names.index(m["name"])
    module = f"{m['head']}.{lay.moe}.experts"
    return ExpertSite(module, "down_proj", int(m["e"]), None) if part == 2 else \
        ExpertSite(module, "gate_up_proj", int(m["e"]), part)


def fuse(state: dict[str, torch.Tensor], config: Mapping, lay: ExpertLayout) -> dict[str, torch.Tensor]:
    """``state`` (stored names, one 2-D tensor per expert matrix) as transformers' state dict: each layer's
    experts stacked into ``gate_up_proj`` ``[E, 2I, H]`` = ``cat(gate_e, up_e)`` and ``down_proj`` ``[E, H, I]``,
    ``STORED.`` renamed ``MOE.`` (mixtral's router). A layer missing some expert's matrix is a
    ``ModelLoadError`` naming it."""
    n = expert_count(dict(config))
    out: dict[str, torch.Tensor] = {}
    held: dict[tuple[str, str], dict[tuple[int, int | None], torch.Tensor]] = {}
    for name, t in state.items():
        s = site(name, lay)
        if s is None:
            out[name.replace(f".{lay.stored}.", f".{lay.moe}.") if lay.stored != lay.moe else name] = t
        else:
            held.setdefault((s.module, s.param), {})[(s.expert, s.part)] = t
    for (module, param), parts in held.items():
        halves = (0, 1) if param == "gate_up_proj" else (None,)
        lacking = [(e, h) for e in range(n) for h in halves if (e, h) not in parts]
        if lacking:
            e, h = lacking[0]
            which = lay.names[2 if h is None else h]
            stored = module.removesuffix(f".{lay.moe}.experts") + f".{lay.stored}.experts.{e}.{which}.weight"
            raise ModelLoadError(f"the checkpoint lacks {stored} ({len(lacking)} of the {n} experts' matrices of "
                                 f"{module}.{param}); re-export it")
        out[f"{module}.{param}"] = torch.stack([torch.cat([parts[(e, h)] for h in halves]) for e in range(n)])
    return out


def library_expert(model: torch.nn.Module, s: ExpertSite) -> torch.Tensor:
    """Expert ``s.expert``'s matrix as the library holds it: its rows of the fused parameter (gate the first
    half of ``gate_up_proj[e]``, up the second, down all of ``down_proj[e]``)."""
    w = getattr(model.get_submodule(s.module), s.param).detach()[s.expert]
    return w if s.part is None else w.chunk(2)[s.part]


__all__ = ["ExpertSite", "fuse", "layout", "library_expert", "site"]
