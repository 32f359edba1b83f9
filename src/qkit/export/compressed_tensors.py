"""compressed-tensors ``pack-quantized``: the layout vLLM and transformers load for int4/int8 weight-only.

Matched against compressed-tensors 0.20.1 (``compressors/pack_quantized``: ``pack_to_int32`` /
``unpack_from_int32``; ``quantization/quant_args.py``: ``QuantizationArgs``, which rejects unknown keys).
Per quantized linear ``M`` with weight ``[out, in]``, for qkit's symmetric absmax codes ``q``:

* ``M.weight_packed`` int32 ``[out, ceil(in * bits / 32)]``: ``32 / bits`` values per word, the first
  column in the lowest bits, each stored as ``q + 2**(bits-1)`` (``q + 8`` for 4 bits, ``q + 128`` for
  8 bits); a row's last word is padded with zero bits. Little-endian bytes, as safetensors stores them.
* ``M.weight_scale`` ``[out, in / group]`` (group) or ``[out, 1]`` (channel), in the weights' dtype: the
  library allocates the scale in the dtype of the weight it replaces, so qkit stores it there and refuses
  a scale dtype that dtype cannot hold exactly (fp16 scales on a bf16 model).
* ``M.weight_shape`` int64 ``[2]`` = ``[out, in]``.

Dequantization on the library side is ``q * weight_scale`` in the scale's dtype; the product of an
8-bit integer and a 16-bit-or-fp32 scale is exact before the final rounding, so it is bit-identical to
qkit's ``dequantize(dtype=weight dtype)`` (tested).

Config: one ``config_groups`` entry per scheme (``targets: ["Linear"]`` when one scheme covers every
quantized linear, else the exact module names), ``ignore`` = the linear modules left unquantized.
A mixture-of-experts model's experts are written as these linears, one per expert matrix, its routers
ignored (``qkit.export.compressed_tensors_moe``).
Refused: nf4 (use ``--format bitsandbytes``), per-tensor scales (vLLM's weight-only kernels take channel
or group scales), and a group size that does not divide every quantized matrix's input width.

FP4 schemes (``nvfp4``, ``mxfp4``) are written as ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``
(``qkit.export.compressed_tensors_fp4``); an export mixing them with int groups is ``mixed-precision``
with each group's ``format``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from qkit.errors import ExportError, InputError
from qkit.export import compressed_tensors_fp4 as fp4
from qkit.export import compressed_tensors_moe as moe
from qkit.export import compressed_tensors_w8a8 as w8a8
from qkit.export.common import (
    EXACT_IN,
    ModelLayout,
    SafetensorsFormat,
    check_scale_in_weight_dtype,
    dense_nbytes,
    dtype_name,
)
from qkit.granularity import PerGroup, PerRow
from qkit.schemes import AbsmaxScheme, NF4Scheme, QuantizedTensor, Scheme, get_scheme
from qkit.schemes.base import DTYPE_NAMES
from qkit.schemes.packing import pack_nibbles, unpack_nibbles

NAME = "compressed-tensors"
STORED = ("weight_packed", "weight_scale", "weight_shape", "weight_global_scale")
# The top-level ``format`` values of the checkpoints this module writes (``qkit verify`` reads these).
CT_FORMATS = (fp4.INT_FORMAT, *fp4.FORMATS.values(), fp4.MIXED)
# What a plan mixes: vLLM's weight-only kernels (Marlin) serve these group sizes; compressed-tensors takes any.
PLAN_GROUPS = (32, 64, 128)
PLAN_TYPES = (*(f"int4-g{g}" for g in PLAN_GROUPS), "int4-row", "int8-row", "nvfp4", "mxfp4")


def _pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[rows, cols]`` (0..2**bits-1) -> int32 ``[rows, ceil(cols*bits/32)]``, first column lowest."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise ExportError("compressed-tensors export needs a little-endian machine")
    per_word = 32 // bits
    pad = (-codes.shape[1]) % per_word
    if pad:  # compressed-tensors pads after the offset, so the padding bits are zeros
        codes = torch.nn.functional.pad(codes, (0, pad))
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # byte j: column 2j low nibble, 2j+1 high nibble
    return codes.contiguous().view(torch.int32)


def _unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`_pack_int32`: int32 ``[rows, words]`` -> uint8 codes ``[rows, cols]``."""
    b = packed.contiguous().view(torch.uint8)
    if bits == 4:
        b = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], -1)
    return b[:, :cols]


def _swap_nibbles(b: torch.Tensor) -> torch.Tensor:
    return (b << 4) | (b >> 4)  # uint8: the shifted-out bits drop


def _largest_dividing_group(widths: set[int], below: int) -> int | None:
    """The largest power-of-two group size below ``below`` (and at least 16) that divides every width."""
    g = math.gcd(*widths)
    size = 1 << ((below - 1).bit_length() - 1) if below > 1 else 0
    while size >= 16:
        if g % size == 0:
            return size
        size //= 2
    return None


def stored_nbytes(scheme: Scheme, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Bytes ``CompressedTensorsFormat.encode`` stores for one linear ``M`` with weight ``[out, in]`` of dtype
    ``dtype`` (the module docstring's layout)::

        weight_packed  int32 [out, ceil(in * bits / 32)]       out * ceil(in * bits / 32) * 4
        weight_scale   dtype [out, ceil(in / group)] or [out, 1]  out * (ceil(in / group) or 1) * itemsize(dtype)
        weight_shape   int64 [2]                               16

    The scale is stored in the **weight's** dtype, whatever the scheme's scale dtype (int4-g64 on an fp32
    ``[1536, 576]``: 1536*72*4 + 1536*9*4 + 16 = 497,680 bytes). FP4 schemes:
    ``compressed_tensors_fp4.stored_nbytes``. ``ExportError`` for a scheme compressed-tensors cannot store
    (nf4, per-tensor scales)."""
    if fp4.is_fp4(scheme):
        return fp4.stored_nbytes(scheme, shape)
    if FORMAT.refusal(scheme) is not None:
        raise ExportError(f"compressed-tensors stores int4/int8 with channel or group scales and FP4, not {scheme.name}; "
                          "use int4-g64, int4-row or int8-row")
    rows, cols = (int(d) for d in shape)
    words = -(-cols * scheme.bits // 32)  # a row's last int32 word is zero-padded (_pack_int32)
    scale_cols = scheme.granularity.scale_shape((rows, cols))[1]
    return rows * words * 4 + rows * scale_cols * dtype.itemsize + 2 * 8


class CompressedTensorsFormat(SafetensorsFormat):
    """The ``Format`` of ``--format compressed-tensors`` (``ct``); see the module docstring."""

    name = NAME
    library = "compressed-tensors"
    help = "int4-gN, int8-gN, int4-row, int8-row, nvfp4, mxfp4: vLLM, transformers"
    ties_fused = True  # vLLM refuses one fused layer (qkv_proj, gate_up_proj) whose shards differ in scheme

    # ---- what it holds: the one answer (the checks, the planner and the vLLM engine ask it)
    def refusal(self, scheme: Scheme, tensor: str | None = None) -> str | None:
        """None for int4/int8 with channel or group scales and FP4; else the one-line reason (naming ``tensor``)."""
        if fp4.is_fp4(scheme):
            return None
        if isinstance(scheme, NF4Scheme):
            return ("compressed-tensors has no NF4 codebook: export nf4 with --format bitsandbytes, "
                    "or choose int4-g64 / int4-row for --format compressed-tensors")
        if not isinstance(scheme, AbsmaxScheme):  # a llama.cpp block type, a recipe: no compressed-tensors layout
            where = f" ({tensor})" if tensor else ""
            return (f"--format compressed-tensors cannot store {scheme.name}{where}: it holds int4/int8 with "
                    "channel or group scales and MXFP4/NVFP4; write llama.cpp's types with --format gguf, or choose "
                    "int8-row / int4-g64 for compressed-tensors")
        if not isinstance(scheme.granularity, (PerGroup, PerRow)):
            return (f"--format compressed-tensors cannot express {scheme.name} (one scale per matrix: vLLM's "
                    f"weight-only kernels take channel or group scales); use int{scheme.bits}-row or int{scheme.bits}-g64")
        return None

    def plan_types(self) -> tuple[str, ...]:
        return PLAN_TYPES

    def stored_nbytes(self, scheme: Scheme | None, shape: tuple[int, int], dtype: torch.dtype) -> int:
        return dense_nbytes(shape, dtype) if scheme is None else stored_nbytes(scheme, shape, dtype)

    def check_candidates(self, schemes: Sequence[Scheme], dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
        """An int candidate stores ``weight_scale`` in the weights' dtype: refuse scales ``dtype`` cannot hold."""
        ints = [s.name for s in schemes if not fp4.is_fp4(s)]
        if ints and scale_dtype not in EXACT_IN[dtype]:
            fix = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
            raise InputError(
                f"compressed-tensors stores weight_scale in the weights' dtype ({dtype_name(dtype)}), which cannot "
                f"hold {DTYPE_NAMES[scale_dtype]} scales exactly, so {ints[0]} cannot be planned; plan with "
                f"--scale-dtype {fix}, or leave the int candidates out of --candidates"
            )

    def for_activations(self, activations: str) -> w8a8.W8A8Format:
        """W8A8 (``int-quantized``): int8 per-channel weights with ``activations`` quantized at run time."""
        return w8a8.W8A8Format(activations)

    def reader(self, quantization_config: dict) -> SafetensorsFormat | None:
        if w8a8.is_w8a8(quantization_config):  # int-quantized W8A8 (qkit.export.compressed_tensors_w8a8)
            return w8a8.FORMAT
        qc = quantization_config
        return self if qc.get("quant_method") == NAME and qc.get("format") in CT_FORMATS else None

    def stored_parts(self, keys: list[str]) -> dict[str, str]:
        """Stored key -> module, for every key whose last part is one this format stores (``STORED``)."""
        out = {}
        for k in keys:
            module, _, part = k.rpartition(".")
            if part in STORED:
                out[k] = module
        return out

    def check(self, layout: ModelLayout) -> None:
        moe.check(layout, NAME)  # the linears, and a mixture-of-experts model's experts and routers
        by_scheme: dict[str, list[str]] = {}
        for tensor, s in layout.targets.items():
            by_scheme.setdefault(s.name, []).append(tensor)
        for tensor, s in sorted(layout.targets.items()):
            why = self.refusal(s, tensor)
            if why is not None:
                raise ExportError(why)
            if fp4.is_fp4(s):
                continue  # checked by fp4.check below
            check_scale_in_weight_dtype(layout, tensor, s.scale_dtype)
        for name, tensors in sorted(by_scheme.items()):
            s = layout.targets[tensors[0]]
            if fp4.is_fp4(s) or not isinstance(s.granularity, PerGroup):
                continue
            g = s.granularity.size
            widths = {layout.shapes[t][1] for t in tensors}
            bad = sorted(t for t in tensors if layout.shapes[t][1] % g)
            if bad:
                w = layout.shapes[bad[0]][1]
                alt = _largest_dividing_group(widths, g)
                fix = (
                    f"int{s.bits}-g{alt} can (it divides every width: {', '.join(map(str, sorted(widths)))})"
                    if alt else f"int{s.bits}-row can"
                )
                raise ExportError(
                    f"compressed-tensors (and vLLM's kernels) need the group size to divide every quantized "
                    f"matrix's input width: {bad[0]} is {w} wide ({w} = {w / g:g} x {g}), so {name} cannot be "
                    f"exported; {fix}"
                )
        fp4.check(layout)

    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        s = qt.scheme
        if fp4.is_fp4(s):
            return fp4.encode(name, qt)
        rows, cols = qt.shape
        if s.bits == 4 and cols % 8 == 0:
            # No padding: qkit's byte is (c[2j] << 4) | c[2j+1], compressed-tensors' is c[2j] | (c[2j+1] << 4),
            # so each byte just swaps its nibbles (one pass instead of unpack + repack).
            packed = _swap_nibbles(qt.qweight).view(rows, cols // 2).view(torch.int32)
        elif s.bits == 4:
            packed = _pack_int32(unpack_nibbles(qt.qweight, rows * cols).view(rows, cols), 4)  # codes are q + 8
        else:
            packed = _pack_int32((qt.qweight.to(torch.int16) + 128).to(torch.uint8), 8)
        module = name.removesuffix(".weight")
        return {
            f"{module}.weight_packed": packed,
            f"{module}.weight_scale": qt.scales.reshape(rows, -1).to(qt.dtype),
            f"{module}.weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
        }

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """``tensors``: ``weight_packed``, ``weight_scale``, ``weight_shape`` of one module."""
        need = fp4.STORED.get(scheme.name, ("weight_packed", "weight_scale", "weight_shape"))
        if [k for k in need if k not in tensors]:
            raise ExportError(f"a compressed-tensors {scheme.name} module lacks some of {', '.join(need)}; re-export it")
        if fp4.is_fp4(scheme):
            return fp4.decode(tensors, scheme, dtype)
        if not isinstance(scheme, AbsmaxScheme):
            raise ExportError(f"a compressed-tensors module cannot hold {scheme.name}; re-export the checkpoint")
        rows, cols = (int(v) for v in tensors["weight_shape"].tolist())
        if scheme.bits == 4 and cols % 8 == 0:
            qweight = _swap_nibbles(tensors["weight_packed"].contiguous().view(torch.uint8).reshape(-1))
        elif scheme.bits == 4:
            qweight = pack_nibbles(_unpack_int32(tensors["weight_packed"], 4, cols))
        else:
            codes = _unpack_int32(tensors["weight_packed"], 8, cols)
            qweight = (codes.to(torch.int16) - 128).to(torch.int8)
        stored = tensors["weight_scale"]
        scales = stored.to(scheme.scale_dtype)
        if not torch.equal(scales.to(stored.dtype), stored):
            raise ExportError(
                f"weight_scale ({stored.dtype}) does not fit {scheme.scale_dtype} exactly; the checkpoint was "
                "changed after export"
            )
        return QuantizedTensor(scheme, qweight, scales.reshape(scheme.granularity.scale_shape((rows, cols))),
                               (rows, cols), dtype)

    def infer_scheme(self, quantization_config: dict, module: str, tensors: dict[str, torch.Tensor]) -> Scheme:
        """The qkit scheme of a module of a compressed-tensors checkpoint that qkit did not write."""
        groups = quantization_config.get("config_groups") or {}
        if len(groups) != 1:
            raise ExportError(
                "this compressed-tensors checkpoint has several config groups and no qkit-export.json; "
                "qkit verify checks qkit exports and single-group checkpoints"
            )
        w = next(iter(groups.values())).get("weights") or {}
        if w.get("type") == "float":
            return fp4.infer_scheme(w)
        bits, strategy = w.get("num_bits"), w.get("strategy")
        if w.get("type") != "int" or not w.get("symmetric", True) or bits not in (4, 8) or strategy not in ("group", "channel"):
            raise ExportError(
                f"qkit reads symmetric int4/int8 group or channel schemes, not {w}; verify another checkpoint"
            )
        name = f"int{bits}-g{w.get('group_size')}" if strategy == "group" else f"int{bits}-row"
        return get_scheme(name, tensors["weight_scale"].dtype)

    def quantization_config(self, layout: ModelLayout) -> dict:
        by_scheme: dict[Scheme, list[str]] = {}
        for module, s in sorted(layout.quantized_modules.items()):
            by_scheme.setdefault(s, []).append(module)
        groups = {}
        for i, (s, modules) in enumerate(sorted(by_scheme.items(), key=lambda kv: (-len(kv[1]), kv[0].name))):
            if fp4.is_fp4(s):
                groups[f"group_{i}"] = {"targets": ["Linear"] if len(by_scheme) == 1 else modules,
                                        "weights": fp4.weights_args(s), "input_activations": None,
                                        "output_activations": None, "format": fp4.FORMATS[s.name]}
                continue
            group = isinstance(s.granularity, PerGroup)
            groups[f"group_{i}"] = {
                "targets": ["Linear"] if len(by_scheme) == 1 else modules,
                "weights": {
                    "num_bits": s.bits,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group" if group else "channel",
                    "group_size": s.granularity.size if group else None,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        formats = {g.get("format", fp4.INT_FORMAT) for g in groups.values()}
        if len(formats) > 1:  # mixed-precision: every group names its format
            for g in groups.values():
                g.setdefault("format", fp4.INT_FORMAT)
        return {
            "quant_method": "compressed-tensors",
            "format": fp4.top_level_format(formats),
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": moe.ignore(layout),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    def runtime_dtype(self, quantization_config: dict, dtype: torch.dtype) -> tuple[torch.dtype, str | None]:
        return fp4.runtime_dtype(quantization_config, dtype)


FORMAT = CompressedTensorsFormat()
