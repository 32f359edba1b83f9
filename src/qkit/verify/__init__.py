"""``qkit verify CHECKPOINT``: does the target library read an export exactly as qkit means it?

Two models are built from the same files:

* **qkit's side**: every quantized module's stored tensors are read back by qkit (``Format.decode``)
  into the ``QuantizedTensor`` qkit wrote, dequantized with qkit's own ``dequantize`` to the model's
  dtype, and loaded into a plain transformers model;
* **the library's side**: ``AutoModelForCausalLM.from_pretrained`` on the directory, i.e. transformers
  with compressed-tensors or with bitsandbytes, exactly as a user loads it.

First, qkit's reading must reproduce, byte for byte, the codes and scales qkit quantized (their sha256 is
recorded per tensor in ``qkit-export.json`` at export), so an encoding error cannot hide behind a decoder
that shares it. Then (1) every quantized weight is compared tensor by tensor: the library's dequantized weight
(compressed-tensors: the dense weight it decompresses on the first forward; bitsandbytes:
``bitsandbytes.functional.dequantize_4bit``) against qkit's. Both compute ``q * scale`` exactly and round
once to the model's dtype, so they must be bit-identical in fp32; in fp16/bf16 they may differ by one
rounding step (``|a - b| <= eps(dtype) * |b|``). (2) The logits of both models on a fixed prompt are
compared: ``max |a - b| <= LOGITS_RTOL * max(1, max |b|)`` (1e-4 in fp32, 2e-2 in 16-bit dtypes).

W8A8 (``int-quantized``, ``qkit.export.compressed_tensors_w8a8``): transformers on CPU decompresses the int8
weights and fake-quantizes each quantized linear's input per token (``max|x| / 127.5``, clamp ``[-128, 127]``,
compressed-tensors' dynamic rule); qkit's side applies that same rule, so the logits are held to the fp32
tolerance above. The library is also compared with qkit's own ``act-int8-token`` simulation (``max|x| / 127``,
what the ``smoothquant-w8a8`` eval row and vLLM's int8 kernels use): within twice the effect of the activation
quantization itself (``VerifyResult.activations``).

bitsandbytes on CPU: on a CPU with AVX512-BF16, ``Linear4bit.forward`` (bitsandbytes 0.50.2) repacks the
weight into a bf16 kernel layout (absmax rounded to bf16, compute in bf16, every input width a multiple
of the block size). That path depends on the machine, so ``verify`` reads through bitsandbytes' generic
CPU path (``dequantize_4bit`` + matmul, the same on every machine); ``fast_cpu_kernel=True`` keeps the
machine's path and the bf16 tolerance.

GGUF (``qkit verify FILE.gguf``, or the OUT directory holding ``model.gguf``): qkit reads each quantized
tensor's block bytes, undoes llama.cpp's q/k row permutation, and checks them against the sha256 recorded
at export (the file's ``qkit.export`` field); then every tensor is dequantized twice, by qkit's scheme and by
the ``gguf`` package (llama.cpp's reference, ``gguf.quants.dequantize``), and by transformers' loader
(``from_pretrained(..., gguf_file=)``); all three must be bit-identical in fp32. The logits of transformers'
model and of a transformers model holding qkit's weights (same config, read from the file) are compared on
the fixed prompt with the fp32 rule above.

Mixture-of-experts exports (qwen3_moe, qwen2_moe, mixtral; ``experts``): the file stores one matrix per expert,
transformers fuses a layer's experts into ``gate_up_proj`` / ``down_proj``. qkit's experts are stacked into those
parameters for qkit's model, and each expert's rows of the library's are compared with qkit's matrix, as a dense
linear's weight is. What the library cannot load (W8A8 experts in transformers 5.25) and the GGUF files of llama.cpp's
converter (qwen3moe, mixtral as a llama with experts) are refused in one line, never passed.

The package: ``result`` (the report and the rules), ``safetensors`` (export directories), ``experts`` (the per-expert
names against transformers' fused parameters), ``gguf_file``
(GGUF files), ``activations`` (W8A8: the library against qkit's run-time simulation), ``vllm`` (``qkit verify
--runtime vllm``: vLLM serving the directory, compared on log-probabilities). ``verify_checkpoint`` asks the
registered formats which one a path is (``Format.recognises``) and reads it with the reader of that format's
container.

A consumer of written files, not a format: it sits above ``export`` (the formats' readers), ``simulate`` (the
W8A8 rule) and ``evaluation.engines`` (vLLM's worker), and nothing below imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from qkit import reading
from qkit.errors import InputError
from qkit.export import recognise
from qkit.verify.gguf_file import verify_gguf
from qkit.verify.result import LOGITS_RTOL, PROMPT, TensorCheck, VerifyResult
from qkit.verify.safetensors import iter_decoded, read_format, verify_safetensors

# The reader of each container (``Format.container``).
READERS = {"safetensors": verify_safetensors, "gguf": verify_gguf}


def verify_checkpoint(
    checkpoint: str | Path, *, device: str | None = None, fast_cpu_kernel: bool = False,
    trust_remote_code: bool = False,
) -> VerifyResult:
    """Load ``checkpoint`` with its target library and compare it with qkit's reading (see the module doc).

    ``trust_remote_code``: allow the checkpoint's own Python (an ``auto_map`` copied from its model);
    without it such a checkpoint is refused first, and every transformers call is told ``False``.
    """
    path = Path(checkpoint)
    fix = "pass the -o directory of qkit quantize --format ..."
    try:  # a FIFO, a device or a link loop (or one among its files) is refused before a reader opens it
        if path.is_dir():
            reading.check_entries(path, str(checkpoint), fix)
        elif os.path.lexists(path):
            reading.check_existing(path, str(checkpoint), fix)
        fmt = recognise(path)
        is_dir = path.is_dir()
    except PermissionError as exc:
        raise InputError(f"permission denied reading {exc.filename or path}; make it readable") from exc
    if fmt is None and not is_dir:
        raise InputError(f"no such checkpoint directory: {checkpoint}; {fix}")
    # A directory no format recognises goes to the safetensors reader, which says in one line what it is not.
    read = READERS[fmt.container if fmt is not None else "safetensors"]
    return read(checkpoint, device=device, fast_cpu_kernel=fast_cpu_kernel, trust_remote_code=trust_remote_code)


__all__ = ["LOGITS_RTOL", "PROMPT", "READERS", "TensorCheck", "VerifyResult", "iter_decoded", "read_format",
           "verify_checkpoint", "verify_gguf", "verify_safetensors"]
