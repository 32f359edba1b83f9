"""llama.cpp's importance matrix: collect it (``collect``), read and write its files (``file``), and match it
to a model's tensors (``names``). Layer 5 (``methods``): a way of choosing the codes, used by every llama.cpp
block type's ``quantize_row_*_impl`` path (``qkit.schemes.ggml``: ``encode(w, quant_weights=...)``).

    chunks, provenance = imatrix_ids(tokenizer, ImatrixOptions())     # [32, 512], llama-imatrix's chunks
    im = collect(model, config, chunks, ImatrixOptions())               # sums of x**2 and token counts
    write_gguf(im, Path("imatrix.gguf"))                                # the file llama-quantize reads
    qw = quant_weights_for(read("imatrix.gguf"), config, shapes, targets)  # {hf name: fp32 [cols]}
"""

from qkit.methods.imatrix.collect import ImatrixOptions, check_collect_memory, collect, imatrix_ids
from qkit.methods.imatrix.file import Imatrix, ImatrixEntry, read, write_gguf
from qkit.methods.imatrix.names import gguf_names, quant_weights_for, refuse_unsupported, unreached_experts


def imatrix_record(matrix: Imatrix, weighted: int) -> dict:
    """The manifest's record of the importance matrix a checkpoint was quantized with."""
    return matrix.to_record(weighted)


__all__ = [
    "Imatrix",
    "ImatrixEntry",
    "ImatrixOptions",
    "check_collect_memory",
    "collect",
    "gguf_names",
    "imatrix_ids",
    "imatrix_record",
    "quant_weights_for",
    "read",
    "refuse_unsupported",
    "unreached_experts",
    "write_gguf",
]
