"""compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``: qkit's ``nvfp4`` / ``mxfp4`` for
vLLM and llm-compressor (used by ``qkit.export.compressed_tensors`` for FP4 schemes).

Matched against compressed-tensors 0.20.1 (``compressors/nvfp4`` ``NVFP4PackedCompressor``,
``compressors/mxfp4`` ``MXFP4PackedCompressor``, ``quantization/quant_scheme.py`` presets ``NVFP4A16`` and
``MXFP4A16``). Per quantized linear ``M`` with weight ``[out, in]``:

* ``M.weight_packed`` uint8 ``[out, in / 2]``: E2M1 codes, column ``2j`` in the low nibble of byte ``j``
  (``pack_fp4_to_uint8``): qkit's ``qweight`` byte for byte.
* nvfp4: ``M.weight_scale`` ``float8_e4m3fn`` ``[out, in / 16]`` (qkit's scale bytes viewed as E4M3) and
  ``M.weight_global_scale`` fp32 ``[1]`` (the divisor: weight = E2M1 * scale / global_scale).
* mxfp4: ``M.weight_scale`` uint8 ``[out, in / 32]``, the E8M0 exponent bytes (scale ``2**(e - 127)``).

No ``weight_shape``: the FP4 compressors take the shape from ``weight_packed``. Config group: the
preset's weights arguments (``type: float``, ``num_bits: 4``, ``strategy: tensor_group`` with group 16
and ``scale_dtype: torch.float8_e4m3fn`` for nvfp4; ``strategy: group`` with group 32 and
``scale_dtype: torch.uint8`` for mxfp4), ``input_activations: null`` (weight-only, W4A16), and the
group's ``format``; the top-level ``format`` is that format, or ``mixed-precision`` when the export
also holds int groups (``pack-quantized``).

qkit's mxfp4 picks block exponents as the OCP spec and gguf do; compressed-tensors' own MXFP4 observer
first rounds the block maximum to a power of two (up from 1.75), a different choice in the same file
format, which its decompressor reads identically.

On CPU, compressed-tensors 0.20.1 decompresses both formats to **bf16** weights whatever the model's
dtype (``unpack_fp4_from_uint8`` defaults to bf16), so transformers can run such a checkpoint only in
bf16: ``runtime_dtype`` tells ``qkit verify`` to load and compare both sides in bf16. There the
library's weight is ``bf16(qkit's fp32 dequantization)`` bit for bit (nvfp4 computes ``E2M1 * (s / gs)``
in fp32 and rounds once; mxfp4 is exact in bf16).
"""

from __future__ import annotations

import torch

from qkit.errors import ExportError
from qkit.export.common import ModelLayout
from qkit.schemes import QuantizedTensor, Scheme, get_scheme
from qkit.schemes import is_fp4 as _is_fp4
from qkit.schemes.fp4 import NVFP4Scheme

FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
# The tensors each module stores (compressed-tensors' ``compression_param_names`` for a W4A16 scheme).
STORED = {"nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"), "mxfp4": ("weight_packed", "weight_scale")}
INT_FORMAT = "pack-quantized"
MIXED = "mixed-precision"
RUNTIME_DTYPE = torch.bfloat16  # what compressed-tensors 0.20.1 decompresses FP4 weights to


def is_fp4(scheme: Scheme) -> bool:
    return _is_fp4(scheme)


def check(layout: ModelLayout) -> None:
    """Every FP4 target's input width must be whole blocks (the schemes refuse it too, but only mid-run)."""
    for tensor, s in sorted(layout.targets.items()):
        if not is_fp4(s):
            continue
        cols = layout.shapes[tensor][1]
        if cols % s.block_size:
            raise ExportError(
                f"{s.name} stores blocks of {s.block_size} along each row, but {tensor} is {cols} wide; "
                f"leave it out with --exclude '{tensor}' or give it int8-row with --keep int8-row:'{tensor}'"
            )


def stored_nbytes(scheme: Scheme, shape: tuple[int, int]) -> int:
    """Bytes :func:`encode` stores for one ``[out, in]`` module of FP4 ``scheme`` (block ``B``: 16 nvfp4, 32 mxfp4)::

        weight_packed        uint8 [out, in / 2]       out * in / 2
        weight_scale         1 byte [out, in / B]      out * in / B     (E4M3 for nvfp4, E8M0 for mxfp4)
        weight_global_scale  fp32 [1], nvfp4 only      4

    (nvfp4: ``0.5625 * out * in + 4``; mxfp4: ``0.53125 * out * in``.) ``ExportError`` for a width that is not
    whole blocks, which the format cannot store."""
    rows, cols = (int(d) for d in shape)
    if not is_fp4(scheme) or cols % scheme.block_size:
        raise ExportError(f"compressed-tensors stores {scheme.name} only in whole blocks of FP4 codes along each row; "
                          f"a [{rows}, {cols}] weight is not")
    return rows * cols // 2 + rows * (cols // scheme.block_size) + (4 if isinstance(scheme, NVFP4Scheme) else 0)


def encode(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    module = name.removesuffix(".weight")
    rows, cols = qt.shape
    out = {f"{module}.weight_packed": qt.qweight.reshape(rows, cols // 2)}
    scales = qt.scales.reshape(rows, -1)
    if isinstance(qt.scheme, NVFP4Scheme):
        out[f"{module}.weight_scale"] = scales.view(torch.float8_e4m3fn)
        out[f"{module}.weight_global_scale"] = qt.extra["global_scale"].reshape(1).to(torch.float32)
    else:
        out[f"{module}.weight_scale"] = scales
    return out


def decode(tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype) -> QuantizedTensor:
    """``tensors``: ``weight_packed``, ``weight_scale`` (and nvfp4's ``weight_global_scale``) of one module."""
    packed = tensors["weight_packed"]
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ExportError(f"weight_packed of an {scheme.name} module must be uint8 [out, in/2]; re-export the checkpoint")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    scale = tensors["weight_scale"]
    want = torch.float8_e4m3fn if isinstance(scheme, NVFP4Scheme) else torch.uint8
    if scale.dtype != want or tuple(scale.shape) != (rows, cols // scheme.block_size):
        raise ExportError(
            f"weight_scale of an {scheme.name} module must be {want} [{rows}, {cols // scheme.block_size}], "
            f"not {scale.dtype} {list(scale.shape)}; re-export the checkpoint"
        )
    parts = {"qweight": packed.contiguous(), "scales": scale.contiguous().view(torch.uint8)}
    if isinstance(scheme, NVFP4Scheme):
        parts["global_scale"] = tensors["weight_global_scale"].reshape(1).to(torch.float32)
    return QuantizedTensor.from_parts(scheme, parts, (rows, cols), dtype)


def weights_args(scheme: Scheme) -> dict:
    """The ``weights`` entry of a config group: compressed-tensors' ``NVFP4A16`` / ``MXFP4A16`` presets."""
    if isinstance(scheme, NVFP4Scheme):
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
            "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}


def infer_scheme(weights: dict) -> Scheme:
    """The qkit scheme of an FP4 config group's ``weights`` (a checkpoint qkit did not write)."""
    group, strategy = weights.get("group_size"), weights.get("strategy")
    if weights.get("num_bits") == 4 and group == 16 and strategy == "tensor_group":
        return get_scheme("nvfp4")
    if weights.get("num_bits") == 4 and group == 32 and strategy == "group":
        return get_scheme("mxfp4")
    raise ExportError(f"qkit reads FP4 as nvfp4 (group 16, tensor_group) or mxfp4 (group 32), not {weights}")


def top_level_format(group_formats: set[str]) -> str:
    return next(iter(group_formats)) if len(group_formats) == 1 else MIXED


def runtime_dtype(quantization_config: dict, dtype: torch.dtype) -> tuple[torch.dtype, str | None]:
    """The dtype transformers + compressed-tensors can run this checkpoint in on CPU, and why, if not ``dtype``."""
    formats = {quantization_config.get("format")} | {
        g.get("format") for g in (quantization_config.get("config_groups") or {}).values()
    }
    if dtype == RUNTIME_DTYPE or not formats & set(FORMATS.values()):
        return dtype, None
    return RUNTIME_DTYPE, (
        f"compressed-tensors decompresses FP4 weights to bfloat16 and cannot run them in a "
        f"{str(dtype).removeprefix('torch.')} model on CPU, so both sides are compared in bfloat16"
    )
