"""The dtypes a command that runs the model may load it in (``--dtype``)."""

from __future__ import annotations

import torch

from qkit.errors import InputError

# What a command that runs the model may load it in (``--dtype``); the weights a method quantizes are
# read from the file in their stored dtype whatever the model runs in.
LOAD_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_dtype(name: str) -> torch.dtype:
    """``--dtype NAME`` as a torch dtype; anything else refused in one line."""
    if name not in LOAD_DTYPES:
        raise InputError(f"--dtype {name!r}: the model is loaded in one of {', '.join(LOAD_DTYPES)}")
    return LOAD_DTYPES[name]


__all__ = ["LOAD_DTYPES", "load_dtype"]
