"""The dtypes a command that runs the model may load it in (``--dtype``)."""

from __future__ import annotations

import torch

from qkit.errors import InputError, NonFiniteActivationError

# What a command that runs the model may load it in (``--dtype``); the weights a method quantizes are
# read from the file in their stored dtype whatever the model runs in.
LOAD_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_dtype(name: str) -> torch.dtype:
    """``--dtype NAME`` as a torch dtype; anything else refused in one line."""
    if name not in LOAD_DTYPES:
        raise InputError(f"--dtype {name!r}: the model is loaded in one of {', '.join(LOAD_DTYPES)}")
    return LOAD_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``fp16`` (a ``--dtype`` name), else torch's own name."""
    return next((k for k, v in LOAD_DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))


def non_finite_activations(where: str, dtype: torch.dtype) -> NonFiniteActivationError:
    """The one-line error for activations that became NaN or inf while the model ran in ``dtype``: in fp16 an
    overflow of its range (bf16 has fp32's exponent range at the same memory), else a model that overflows
    on this text whatever the dtype. ``where``: what was found non-finite, e.g. "block 3's output"."""
    if dtype == torch.float16:
        return NonFiniteActivationError(
            f"{where} became NaN or infinite with the model run in fp16: its activations overflow fp16's range "
            "(largest finite value 65504); run with --dtype bf16 (the same memory, fp32's range) or fp32")
    return NonFiniteActivationError(
        f"{where} became NaN or infinite with the model run in {dtype_name(dtype)}: the model itself overflows on "
        "this text; check its weights (qkit eval shows its perplexity) or use another calibration text")


def dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model runs in: its first floating-point parameter's (fp32 for one without any)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_finite(x: torch.Tensor, where: str) -> None:
    """Raise ``non_finite_activations(where, x.dtype)`` when ``x`` holds a NaN or an inf (one reduction over ``x``)."""
    if not bool(torch.isfinite(x).all()):
        raise non_finite_activations(where, x.dtype)


__all__ = ["LOAD_DTYPES", "check_finite", "dtype_name", "dtype_of", "load_dtype", "non_finite_activations"]
