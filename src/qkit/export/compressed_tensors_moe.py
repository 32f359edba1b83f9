"""Mixture-of-experts models in compressed-tensors: each expert matrix a quantized linear, the routers ignored.

A qwen3_moe, qwen2_moe or mixtral checkpoint stores one 2-D matrix per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``, mixtral's ``model.layers.N.block_sparse_moe.experts.E.w1.weight``).
transformers 5 builds no ``nn.Linear`` for them (it fuses a layer's experts into 3-D parameters on load), so
they are not among ``ModelLayout.linears``; the compressed-tensors formats accept them as linears all the same
and store each exactly as a dense linear (``weight_packed`` / ``weight_scale`` / ``weight_shape``, FP4's parts, or
W8A8's ``weight`` / ``weight_scale``) under the checkpoint's own module name. That is the layout llm-compressor
writes for its MoE recipes (``examples/quantizing_moe``: ``targets="Linear"``, the routers ignored) and the one
vLLM reads: its fused-MoE loader maps ``experts.E.gate_proj.weight_packed`` (mixtral: ``experts.E.w1.…``) to the
layer's stacked ``w13_weight_packed`` (``FusedMoE.make_expert_params_mapping``), and
``CompressedTensorsMoEMethod.get_moe_method`` picks one scheme for the whole fused layer by probing the names
``<layer>.experts.0.gate_proj`` / ``up_proj`` / ``down_proj`` against the config's ignore list and targets. What
follows from that, and is checked here before any work:

* **One scheme for every expert, in a group that targets ``"Linear"``.** vLLM finds a fused layer's scheme by its
  class (``"Linear"`` is extended to ``FusedMoE``), because mixtral's ``w1``/``w2``/``w3`` never match the
  ``gate_proj`` names it probes; and a ``"Linear"`` target beside named ones would also claim every fused
  ``qkv_proj`` by class ahead of its named shards (``find_matched_target`` tries the class before the fused
  shards). A mixture-of-experts export therefore holds one scheme: mixing one in by ``--keep`` is refused.
* **No expert left in the source dtype.** vLLM loads all of a layer's experts as one module of one scheme, so an
  expert kept unquantized (``--keep none:GLOB``, ``--exclude``) is refused rather than written as a file vLLM
  cannot load.
* **The routers in ``ignore``** (``mlp.gate``, ``block_sparse_moe.gate``, ``shared_expert_gate``:
  ``transform.is_router``, which also keeps them out of the targets), as llm-compressor's recipes ignore
  ``re:.*mlp.gate$`` and its configs then list each one by name.
* **Fused experts are refused.** gpt_oss stores a layer's experts as 3-D tensors (``mlp.experts.gate_up_proj``
  ``[E, H, 2I]``, with biases), which qkit does not quantize; a compressed-tensors config targeting ``"Linear"``
  would tell vLLM those fused layers are quantized too.

Dense models are unaffected: with no expert and no router, ``check`` is ``check_linear_targets`` and ``ignore``
is ``ModelLayout.kept_linears``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from qkit.errors import ExportError
from qkit.export.common import ModelLayout, check_linear_targets
from qkit.transform import is_router

# One expert's matrix, stored as its own 2-D weight: ``....experts.E.NAME.weight``.
_EXPERT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def expert_weights(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The stored per-expert 2-D matrices (``....experts.E.NAME.weight``), sorted."""
    return sorted(n for n, shape in shapes.items() if len(shape) == 2 and _EXPERT.search(n))


def fused_experts(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Stored tensors of experts held fused, not one matrix per expert (gpt_oss's ``mlp.experts.gate_up_proj``)."""
    return sorted(n for n in shapes if ".experts." in n and not _PER_EXPERT.search(n))


def routers(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The modules of the stored routers (``transform.is_router``), sorted."""
    return sorted(n.removesuffix(".weight") for n in shapes if is_router(n))


def check(layout: ModelLayout, fmt: str) -> None:
    """Refuse (``ExportError``, one line) what the module docstring says a compressed-tensors file cannot hold;
    for a dense model this is ``check_linear_targets``."""
    fused = fused_experts(layout.shapes)
    if fused:
        raise ExportError(
            f"--format {fmt} cannot write this model: it stores its experts fused ({fused[0]} "
            f"{list(layout.shapes[fused[0]])}), not as one 2-D matrix per expert, so qkit leaves them in their source "
            "dtype, and a compressed-tensors config would tell vLLM they are quantized; quantize its attention with "
            "--format qkit"
        )
    experts = expert_weights(layout.shapes)
    check_linear_targets(layout, fmt, also=(e.removesuffix(".weight") for e in experts))
    if not experts:
        return
    kept = [e for e in experts if e not in layout.targets]
    if kept:
        raise ExportError(
            f"--format {fmt} writes a mixture-of-experts layer as vLLM loads it, all its experts in one scheme, but "
            f"{len(kept)} of {len(experts)} expert matrices would stay in their source dtype ({kept[0]}); drop the "
            "--keep none / --exclude that matches them, or use --format qkit"
        )
    if len({*layout.targets.values()}) > 1:
        schemes = sorted({s.name for s in layout.targets.values()})
        raise ExportError(
            f"--format {fmt} stores a mixture-of-experts model in one scheme (vLLM finds a fused expert layer's "
            f"scheme through the config's 'Linear' target), but this export mixes {', '.join(schemes)}; drop --keep, "
            "or use --format qkit"
        )


def ignore(layout: ModelLayout) -> list[str]:
    """The config's ``ignore``: the linears left unquantized and the routers (none in a dense model), sorted."""
    kept = layout.kept_linears
    extra = [r for r in routers(layout.shapes) if r not in set(kept)]
    return sorted([*kept, *extra]) if extra else kept
