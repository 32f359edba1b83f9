"""What a resolved model reads, and the preamble every command that writes a file shares.

Layer 4 (``qkit.models``). An output must stay clear of every input (``qkit.outputs.check_output_path``):
the files the arguments name are known before the model is resolved, the directory it resolves to (and
the GGUF or hub snapshot it came from) only after. ``resolve_clear_of`` does the second half once for
``quantize_model``, ``plan_model`` and ``imatrix_model``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qkit.errors import InputError
from qkit.models.completeness import check_complete
from qkit.models.files import ModelRef
from qkit.models.resolving import resolve
from qkit.outputs import Input, directory_inputs


def resolved_inputs(ref: ModelRef) -> list[Input]:
    """What a resolved model reads: its local directory (with its symlinks' targets), the GGUF it was
    converted from, the hub snapshot it came from; an output must stay clear of all of them."""
    found = directory_inputs("the model", ref.directory)
    for key, label in (("gguf", "the source GGUF"), ("snapshot", "the model's hub snapshot")):
        if ref.provenance.get(key):
            found.append((label, ref.provenance[key]))
    return found


def resolve_clear_of(model: str | Path | ModelRef | None, given: list[Input], check: Callable[[list[Input]], None], *,
                     allow_pickle: bool, trust_remote_code: bool, quantized: str, complete: bool = True,
                     ) -> tuple[ModelRef, list[Input]]:
    """The preamble of every command that writes a file: resolve ``model`` (a ``ModelRef`` as it is), refuse a
    qkit checkpoint (``quantized``, with ``{spec}``), check its files complete, and ``check`` the output
    again against everything the resolved model reads (``check(given)`` ran before, on what the arguments
    name). Returns the model and all the inputs."""
    ref = model if isinstance(model, ModelRef) else resolve(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if ref.is_quantized:
        raise InputError(quantized.format(spec=ref.spec))
    if complete:
        check_complete(ref, trust_remote_code=trust_remote_code)  # missing tensors: refused before any work
    inputs = [*given, *resolved_inputs(ref)]
    check(inputs)  # a few stat calls: the resolved directory was not known before
    return ref, inputs


__all__ = ["resolve_clear_of", "resolved_inputs"]
