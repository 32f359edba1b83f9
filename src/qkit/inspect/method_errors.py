"""The output-side error of a calibrated method per matrix, next to RTN's: ``qkit inspect errors --method``.

Layer 7 (``inspect``): quantizes through ``qkit.api.quantize_model`` (the path that writes checkpoints,
into a temporary directory) and reads the per-matrix errors the method recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkit.api import QuantizeOptions, block_progress, quantize_model
from qkit.errors import InputError
from qkit.inspect.errors import _ref_for
from qkit.methods import get_method, make_options
from qkit.methods.calibration import check_fits
from qkit.models import ModelRef, read_config
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.staging import temporary_directory

TMP_PREFIX = "qkit-inspect-"  # the method's checkpoint: $TMPDIR/qkit-inspect-PID-RANDOM

OUTPUT_ERROR_NOTE = (
    "output error ||W X - Ŵ X||² / ||W X||² on the calibration inputs each matrix sees (earlier blocks already "
    "quantized); weight-space error ||W - Ŵ|| / ||W|| (the table above) is not what GPTQ minimises: it spends "
    "weight error where the inputs make it cheap, so its weight error can be larger than RTN's while its outputs are closer."
)


@dataclass
class MethodErrors:
    """Per matrix, RTN's and the method's output-side error (from the method's record, see ``qkit.methods.gptq``)."""

    model: str
    scheme: str
    method: str
    layers: dict[str, dict[str, float]]  # name -> {"rtn": ..., method: ...}
    calibration: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "scheme": self.scheme, "method": self.method, "layers": self.layers,
                "calibration": self.calibration, "note": OUTPUT_ERROR_NOTE}


def check_method_options(
    model: str | Path | None = None,
    *,
    method: str,
    method_options: dict[str, Any] | None = None,
    ref: ModelRef | None = None,
) -> None:
    """Refuse, before any matrix is measured, calibration options the method or the model cannot take
    (malformed numbers, windows beyond the model's context, activations beyond memory): the CLI calls this
    before the RTN table, so a bad ``--calibration-seqlen`` costs milliseconds. Reads the config only."""
    chooser = get_method(method)
    if chooser is None or not chooser.calibrated:
        return
    calibration = make_options(chooser, method_options).calibration_options()
    calibration.check()
    check_fits(calibration, read_config(_ref_for(model, ref).directory))


def method_output_errors(
    model: str | Path | None = None,
    *,
    scheme: str,
    method: str,
    method_options: dict[str, Any] | None = None,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    ref: ModelRef | None = None,
    on_block: Callable[[int, int], None] | None = None,
) -> MethodErrors:
    """Quantize MODEL with ``method`` (into a temporary directory, through ``quantize_model``) and return the
    output-side error per matrix it recorded, next to RTN's on the same calibration inputs."""
    ref = _ref_for(model, ref)
    # $TMPDIR/qkit-inspect-PID-RANDOM: removed on exit; a SIGKILLed run's is removed by the next one
    with temporary_directory(TMP_PREFIX) as tmp:
        r = quantize_model(ref, output=tmp / "m", scheme=scheme, method=method, method_options=method_options,
                           options=QuantizeOptions(scale_dtype=scale_dtype),
                           progress=None if on_block is None else block_progress(on_block))
    key = f"{r.method}_error"
    layers = {n: {"rtn": v["rtn_error"], r.method: v[key]} for n, v in sorted((r.method_record.get("layers") or {}).items())
              if "rtn_error" in v and key in v}
    if not layers:
        raise InputError(f"method {method} records no per-matrix output error; use --method gptq")
    return MethodErrors(ref.spec, scheme, r.method, layers, r.method_record.get("calibration") or {})


__all__ = ["OUTPUT_ERROR_NOTE", "MethodErrors", "check_method_options", "method_output_errors"]
