"""SmoothQuant (Xiao et al., arXiv:2211.10438): move activation outliers into the weights, then RTN.

For each group of linears sharing an input (``qkit.methods.folding``: q/k/v after ``input_layernorm``,
gate/up after ``post_attention_layernorm``; with ``linear_groups`` also o after v and down after up), the
per-input-channel ``max|X|`` over the calibration text and ``max|W|`` over the group's weight columns give
the migration scales ``s = max|X|^α / max|W|^(1-α)`` (default α = 0.5). ``1/s`` is folded into the norm
(or the preceding linear) and ``s`` into the linears' input columns, so the saved model is an ordinary
model with the original full-precision outputs, whose activations are easier to quantize: a channel
``1000x`` the median ends ``1000^(1-α)`` times the median when its weight column is typical. The scaled
weights are then quantized round-to-nearest with the requested scheme (``int8-row`` for W8A8; any
absmax scheme works). Activation quantization itself happens at run time (``qkit.simulate``'s
``act-int8-token``, the ``smoothquant-w8a8`` eval row) or in the serving engine (the compressed-tensors
W8A8 export, ``quantize_model(..., format="compressed-tensors", activations="int8-token")``).

Like the reference (``smoothquant/calibration.py`` + ``smooth.py``), the statistics come from one pass of
the full-precision model over the calibration text (qkit's pinned text, disjoint from the eval text), and
by default only the norm groups are smoothed: the reference smooths ``input_layernorm`` -> q/k/v and
``post_attention_layernorm`` -> gate/up for llama. Folding one group changes only that group's input, so
statistics from the unfolded model stay valid for every group.

The record (manifest ``method``): options, calibration provenance, and per group ``max|X| / median`` of
the input channels before and after smoothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from qkit.errors import SchemeError
from qkit.methods import CalibratedOptions, MethodResult
from qkit.methods.calibration import calibration_ids
from qkit.methods.folding import (
    check_alpha,
    collect_channel_stats,
    fold,
    model_fold_groups,
    options_record,
    outlier_ratio,
    smoothing_factors,
    in_source_dtypes,
    weight_absmax,
)
from qkit.methods.memory import RETENTION, Model, one_quantize, quantized_bytes
from qkit.methods.sequential import DEFAULT_BATCH_SIZE
from qkit.models import ModelRef, load
from qkit.schemes import AbsmaxScheme, QuantizedTensor, Scheme, quantize_tensor
from qkit.schemes.fidelity import check_written

DEFAULT_ALPHA = 0.5  # the paper's default for most models (section 4.2)


@dataclass(frozen=True)
class SmoothQuantOptions(CalibratedOptions):
    """``alpha``: migration strength in [0, 1] (0: no migration, 1: all of it into the weights);
    ``calibration*``: which calibration tokens (as GPTQ's: source, samples, seqlen, seed); ``linear_groups``: also
    smooth o_proj (after v_proj) and down_proj (after up_proj), beyond the reference's norm groups;
    ``batch_size``: calibration windows per forward pass."""

    alpha: float = DEFAULT_ALPHA
    linear_groups: bool = False
    batch_size: int = DEFAULT_BATCH_SIZE

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        self.calibration_options().check()
        self.fp32_only("smoothquant")

    def check(self) -> None:
        """Validated on construction; kept so every method's options answer ``check()`` alike."""
        self.__post_init__()


class SmoothQuantMethod:
    name = "smoothquant"
    calibrated = True
    options_type = SmoothQuantOptions

    def check(self, scheme: Scheme) -> None:
        if not isinstance(scheme, AbsmaxScheme):
            raise SchemeError(
                f"smoothquant writes symmetric integer weights for int8 activations, not {scheme.name}; "
                "use int8-row (W8A8) or another absmax scheme (int4-g64, int8-g128, ...)"
            )

    def memory(self, model: Model, targets: Mapping[str, Scheme], options: SmoothQuantOptions) -> dict[str, int]:
        """Beside the process (``qkit.methods.memory``): the model in fp32, the quantized targets, and the
        larger of one batch's forward through the whole model (with its logits) and one target's quantize."""
        batch, T, d = min(options.batch_size, options.calibration_samples), options.seqlen, model.dims
        forward = model.block_forward(batch, T) + batch * T * d.vocab * (model.a + 4)
        work = max(int(RETENTION * max(model.load, forward)), one_quantize(model, targets))
        return {"the model's weights in fp32": model.loaded(), "the quantized tensors": quantized_bytes(model, targets),
                "one batch's forward or one tensor's quantize": work}

    def run(
        self,
        ref: ModelRef,
        targets: dict[str, Scheme],
        options: SmoothQuantOptions,
        *,
        device: torch.device,
        on_block: Callable[[int, int], None] | None = None,
    ) -> MethodResult:
        t0 = time.perf_counter()
        loaded = load(ref=ref, device=device)
        model = loaded.model
        ids, provenance = calibration_ids(loaded.tokenizer, options.calibration_options(model.config))
        result = smooth_model(model, ids, targets, options, on_block=on_block)
        result.quantized = in_source_dtypes(result.quantized, ref.directory)
        result.record = {
            "options": options_record(options),
            "calibration": provenance,
            **result.record,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        return result


def smooth_model(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: dict[str, Scheme],
    options: SmoothQuantOptions,
    *,
    on_block: Callable[[int, int], None] | None = None,
) -> MethodResult:
    """Smooth ``model`` in place (fold every group whose linears include a target) and quantize the targets.

    ``ids``: calibration token ids ``[samples, seqlen]``. Returns the ``MethodResult`` without calibration
    provenance: ``quantized`` (every target), ``replaced`` (changed tensors that are not targets: norms, a
    kept preceding linear), ``record`` (``groups``: per group ``outlier_ratio_before`` / ``_after``).
    """
    groups = [g for g in model_fold_groups(model, linear_groups=options.linear_groups)
              if any(w in targets for w in g.weight_names)]
    batches = [ids[i : i + options.batch_size] for i in range(0, ids.shape[0], options.batch_size)]
    stats = collect_channel_stats(model, groups, batches)
    changed: dict[str, torch.Tensor] = {}
    per_group: dict[str, dict[str, float]] = {}
    for k, g in enumerate(groups):
        act = stats[g.name].absmax  # per input column of the linears
        weights = [model.get_submodule(n).weight for n in g.linears]
        s = smoothing_factors(g.reduce(act, "max"), g.reduce(weight_absmax(weights), "max"), options.alpha)
        changed.update({n: t for n, t in fold(model, g, s).items() if n not in targets})  # targets: quantized below
        per_group[g.name] = {
            "outlier_ratio_before": round(outlier_ratio(act), 4),
            "outlier_ratio_after": round(outlier_ratio(act / g.expand(s)), 4),
        }
        if on_block is not None:
            on_block(k + 1, len(groups))
    state = model.state_dict()
    quantized: dict[str, QuantizedTensor] = {}
    checked: dict[str, float] = {}
    for name, scheme in targets.items():  # checked against the smoothed weight, which the file does not hold
        quantized[name] = quantize_tensor(state[name].detach(), scheme, name=name)
        checked[name] = check_written(name, state[name].detach(), quantized[name], cause=(
            "SmoothQuant's migration of the activations' range into it; compare --method rtn or a smaller --alpha"))
    replaced = {n: t.detach().clone() for n, t in changed.items() if n not in targets}
    return MethodResult(quantized, replaced, {"groups": per_group, "folded": len(groups)}, checked)


METHOD = SmoothQuantMethod()

__all__ = ["DEFAULT_ALPHA", "METHOD", "SmoothQuantMethod", "SmoothQuantOptions", "smooth_model"]
