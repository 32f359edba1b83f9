"""File rows: an existing GGUF file of the reference model as a row (``qkit eval --schemes file:PATH.gguf``).

Layer 6 (``evaluation``), above ``engines`` (which engines load such a file), ``measuring`` (the
``RowFile`` it becomes) and ``export.gguf.reader`` (its header and tensors). A peer's file
(``llama-quantize --imatrix``'s, auto-round's) is scored on the same tokens as every other row: the
spec (``RowSpec.file``, parsed and named in ``specs``) is a value like a scheme's, and its ``RowFile`` is
the file itself, never written again:

- ``--runtime llama.cpp`` loads that very file (the engine's own path for qkit's GGUF rows);
- ``--runtime torch`` dequantizes its tensors with the ``gguf`` package into the reference model
  (``GGUFWeights.iter_tensors``), as a qkit checkpoint's are streamed in.

Refused in one line, before the reference model loads: an engine that does not load a GGUF file as it is
(``check_file_runtimes``, vLLM), and a file that is not of the reference model (``check_file_matches``:
another architecture, other tensor names or shapes). The missing file, a file that is not GGUF, the same
file twice and an empty ``file:`` are refused when the words are resolved (``specs.name_files``).

Bits per weight and size (``file_row``) are counted as for a GGUF row qkit writes: the tensors stored in a
quantized type, ``8 * bytes / weights``; and the file's bytes on disk (``GGUFWeights``).
"""

from __future__ import annotations

from qkit.errors import InputError
from qkit.evaluation.engines import ENGINES, Engine, runtime_names
from qkit.evaluation.measuring import RowFile
from qkit.evaluation.specs import FILE_PREFIX, RowSpec
from qkit.export.gguf import FORMAT as GGUF_FORMAT
from qkit.export.gguf.reader import GGUFWeights, read_weights
from qkit.models import ModelRef, read_config

FILE_FORMAT = GGUF_FORMAT  # what a file row's file is: one GGUF file


def file_refusal(spec: RowSpec, engine: Engine) -> str | None:
    """Why ``engine`` cannot measure the file row ``spec`` (it does not load a GGUF file as it is), or None."""
    if spec.file is None or engine.loads_file(FILE_FORMAT):
        return None
    able = [n for n in runtime_names() if ENGINES.get(n).loads_file(FILE_FORMAT)]
    return (f"{engine.name} does not load a GGUF file as it is (it loads {engine.format}); score "
            f"{FILE_PREFIX}{spec.file} with --runtime {' or '.join(able)}")


def check_file_runtimes(specs: list[RowSpec], engines: list[Engine]) -> None:
    """Refuse, before any model, a file row in a runtime that cannot load it (``file_refusal``)."""
    for spec in specs:
        for engine in engines:
            reason = file_refusal(spec, engine)
            if reason is not None:
                raise InputError(f"--runtime {engine.name}: {reason}")


def file_weights(spec: RowSpec, ref: ModelRef) -> GGUFWeights:
    """``spec``'s file matched to the reference (``read_weights``: headers only); ``InputError`` if it is not of it."""
    return read_weights(spec.file, ref.directory, read_config(ref.directory), what=f"{FILE_PREFIX}{spec.file}")


def check_file_matches(specs: list[RowSpec], ref: ModelRef) -> None:
    """Refuse, from the headers, a file row whose file is not of the reference model (see ``read_weights``)."""
    for spec in specs:
        if spec.file is not None:
            file_weights(spec, ref)


def file_row(spec: RowSpec, ref: ModelRef) -> RowFile:
    """The file row's ``RowFile``: the file itself (nothing written), the torch engine's reader of its
    tensors, and its facts: bits per weight and the number of tensors over those stored in a quantized
    type, the file's size."""
    weights = file_weights(spec, ref)
    facts = {"bits_per_weight": weights.bits_per_weight, "size_bytes": weights.size_bytes,
             "matrices": len(weights.quantized), "method_record": {}, "plan": {}, "build_seconds": None}
    return RowFile(spec, weights.path, facts, {}, read=weights.iter_tensors)


__all__ = ["FILE_FORMAT", "check_file_matches", "check_file_runtimes", "file_refusal", "file_row", "file_weights"]
