"""``--method imatrix``: collect the importance matrix from the calibration text, then quantize through
llama.cpp's weighted searches, in one step (``qkit imatrix`` + ``qkit quantize --imatrix FILE`` in two).

The calibration options mean what ``qkit imatrix`` means by them: ``calibration_samples`` chunks of
``calibration_seqlen`` tokens, consecutive from the start of the text as llama-imatrix takes them
(``calibration_seed`` is not used: nothing is sampled). The tensors are quantized from the source
checkpoint's own tensors, exactly as ``--imatrix FILE`` with the same matrix quantizes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import SchemeError
from qkit.dtypes import load_dtype
from qkit.methods import CalibratedOptions, MethodResult
from qkit.methods.imatrix.collect import ImatrixOptions, collect, collect_memory, imatrix_ids
from qkit.methods.memory import Model
from qkit.methods.imatrix.names import quant_weights_for, refuse_unsupported, unreached_experts
from qkit.models import ModelRef, load, read_config
from qkit.schemes import QuantizedTensor, Scheme, is_llama_type, quantize_tensor


@dataclass(frozen=True)
class ImatrixMethodOptions(CalibratedOptions):
    """``calibration*``: the text, chunks (``calibration_samples``) and chunk size (``calibration_seqlen``);
    ``batch_size``: chunks per forward pass."""

    batch_size: int = ImatrixOptions.batch

    def collection(self) -> ImatrixOptions:
        return ImatrixOptions(source=self.calibration, chunks=self.calibration_samples,
                              chunk_size=self.seqlen, batch=self.batch_size, dtype=self.dtype,
                              calibrate_all_experts=self.calibrate_all_experts)

    def __post_init__(self) -> None:
        self.collection().check()

    def check(self) -> None:
        self.__post_init__()


class ImatrixMethod:
    name = "imatrix"
    calibrated = True
    options_type = ImatrixMethodOptions

    def check(self, scheme: Scheme) -> None:
        if not is_llama_type(scheme):
            raise SchemeError(f"the importance matrix weights llama.cpp's block types' own searches, not {scheme.name}; "
                              "use q2_k ... q8_0, iq4_nl, iq4_xs or a llama.cpp recipe (q4_k_m, ...)")

    def memory(self, model: Model, targets: Mapping[str, Scheme], options: ImatrixMethodOptions) -> dict[str, int]:
        """The collection's (``collect_memory``); the quantize after it streams as rtn's does."""
        return collect_memory(model, options.collection())

    def run(
        self,
        ref: ModelRef,
        targets: dict[str, Scheme],
        options: ImatrixMethodOptions,
        *,
        device: torch.device,
        on_block: Callable[[int, int], None] | None = None,
    ) -> MethodResult:
        t0 = time.perf_counter()
        config = read_config(ref.directory)
        refuse_unsupported(config)
        matrix, provenance = matrix_for(ref, options.collection(), device, on_block)
        shapes = dict(tensor_shapes(ref.directory))
        weights = quant_weights_for(matrix, config, shapes, targets)
        quantized: dict[str, QuantizedTensor] = {}
        for name, tensor in iter_tensors(ref.directory):
            if name in targets:
                w = tensor.to(device) if tensor.device != device else tensor
                quantized[name] = quantize_tensor(w, targets[name], name=name, quant_weights=weights.get(name))
        record = {"calibration": provenance, "imatrix": matrix.to_record(len(weights)), "dtype": options.dtype,
                  "seconds": round(time.perf_counter() - t0, 3)}
        if unreached := unreached_experts(matrix, config, list(targets)):  # weighted by 1s, as llama-quantize
            record["imatrix"]["unreached_experts"] = unreached
        return MethodResult(quantized, {}, record)


# The last matrix collected in this process, by (model directory, collection options, device): one entry.
_LAST: dict[tuple, tuple] = {}


def matrix_for(ref: ModelRef, collection: ImatrixOptions, device: torch.device,
               on_chunk: Callable[[int, int], None] | None = None) -> tuple:
    """``(Imatrix, calibration provenance)`` of ``ref`` collected with ``collection``; the same model and
    options again in this process (an eval's rows, a plan then its quantize) reuse the last one."""
    key = (str(ref.directory), collection, str(device))
    if key not in _LAST:
        config = read_config(ref.directory)
        loaded = load(ref=ref, device=device, dtype=load_dtype(collection.dtype))
        chunks, provenance = imatrix_ids(loaded.tokenizer, collection)
        matrix = collect(loaded.model, config, chunks, collection, on_chunk=on_chunk, provenance=provenance)
        del loaded
        _LAST.clear()
        _LAST[key] = (matrix, provenance)
    return _LAST[key]

METHOD = ImatrixMethod()
