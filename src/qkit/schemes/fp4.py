"""FP4 block formats: ``mxfp4`` (OCP Microscaling v1.0) and ``nvfp4`` (NVIDIA), both with E2M1 elements.

E2M1 (1 sign, 2 exponent, 1 mantissa bit; OCP MX v1.0 section 5.3.3; the grid, its rounding and packing
live in ``qkit.schemes.e2m1``): magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with codes 0..7 (the code *is* the bit pattern), bit 3 the sign
(code 8 is -0). Weights are quantized as ``[shape[0], prod(shape[1:])]`` (1-D as ``[1, n]``) in blocks
of ``B`` consecutive weights of one row; the row width must be a multiple of ``B``.

**mxfp4** (``B = 32``; 4 + 8/32 = 4.25 bits per weight exactly). The scale selection and rounding of the
``gguf`` package's reference quantizer (``gguf.quants.MXFP4.quantize``, llama.cpp's GGML type MXFP4),
bit for bit::

    a     = max |w| over the block                                    (fp32)
    E     = floor(fl32(log2 a)) - 2       2 = emax of E2M1; e = E + 127, the stored E8M0 byte (a = 0: e = 0)
    scale = 2**E                                                      (OCP: X = 2**(floor(log2 a) - emax))
    code  = nearest E2M1 to w / scale, saturating at 6; a tie goes to the smaller magnitude and a value that
            rounds to 0 is +0 (gguf takes the first of equal errors in the order 0, 0.5, ..., 6, -0, -0.5, ...)
    w_hat = E2M1[code] * 2**(e - 127)                                 (exact in fp32)

``fl32(log2 a)`` is log2 rounded to fp32 *before* the floor, as gguf (numpy) and llama.cpp (``log2f``)
compute it: for an ``a`` within about 2**-20 relative below a power of two it is that power, so ``E`` is one
more than the exact exponent of ``a`` (the block then uses half its range; measured: numpy's and torch's
fp32 log2 equal fp64 log2 rounded to fp32 there, which is what qkit computes). One divergence, by design:
a block with ``0 < a < 2**-125`` would need ``e < 0``; gguf's uint8 cast wraps it (undefined behaviour in
C), qkit clamps to ``e = 0`` (scale ``2**-127``, the smallest E8M0 value).

**nvfp4** (``B = 16``; 4 + 8/16 = 4.5 bits per weight, plus one fp32 per tensor: ``4.5 + 32/n`` for a
tensor of ``n`` weights). The scale selection and rounding of compressed-tensors 0.20.1 / llm-compressor
(``generate_gparam``, ``calculate_qparams``, ``_quantize``, ``cast_to_fp4``, ``pack_fp4_to_uint8``), bit
for bit, all in fp32::

    gs    = 2688 / max(max |w| over the tensor, tiny)     2688 = 448 * 6; inf or NaN -> 1.0 (all-zero tensor);
                                                          computed as torch computes a number over a tensor,
                                                          fl(fl(1 / amax) * 2688), as generate_gparam does
    s     = e4m3(clamp(gs * (a / 6), -448, 448))          a = the block's max |w|; torch's round-to-nearest-even
    s     = 0.125 where s == 0                            (compressed-tensors' "eps" of E4M3 for empty blocks)
    y     = w / (s / gs)                                  two roundings, in this order
    code  = nearest E2M1 to clamp(y, -6, 6), ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
            2.5 -> 2, 3.5 -> 4, 5 -> 4); sign bit set for y < 0, so a small negative weight is -0 (code 8)
    w_hat = E2M1[code] * (s / gs)                         compressed-tensors' ``_dequantize``, in fp32

``gs`` is compressed-tensors' ``weight_global_scale`` (the reciprocal of NVIDIA ModelOpt's
``weight_scale_2``). The reference computes ``a / 6`` in the weights' dtype; qkit computes it in fp32
from the weights read as fp32, which equals the reference on fp32 weights (tested).

Storage (this is also the on-disk layout, ``NAME.<part>``):

* ``qweight`` uint8 ``[rows, cols / 2]``: byte ``j`` of a row holds column ``2j`` in its low nibble and
  ``2j + 1`` in its high nibble: compressed-tensors' ``pack_fp4_to_uint8`` layout, so the export to
  ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` is a copy. (gguf's MXFP4 block puts element ``j`` and
  ``j + 16`` in one byte; ``to_gguf_mxfp4_blocks`` converts.)
* ``scales`` uint8 ``[rows, cols / B]``: mxfp4, the E8M0 bytes ``e`` (scale ``2**(e - 127)``); nvfp4, the
  FP8 E4M3 (``torch.float8_e4m3fn``) bit patterns of ``s`` (``scales.view(torch.float8_e4m3fn)``). Stored as
  uint8 because torch cannot test fp8 for finiteness (``quantize_tensor`` checks float scales).
* nvfp4 only: ``global_scale`` fp32 ``[1]``, ``gs``.

Non-finite input: ``encode`` returns a float NaN ``scales`` (the registry's convention: a non-finite
weight gives a non-finite scale, and ``quantize_tensor`` turns it into ``NonFiniteWeightError`` naming
the tensor); nothing of it is ever stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.base import Layout, SchemeDefaults, as_2d
from qkit.schemes.e2m1 import (
    INF_BITS,
    block_absmax,
    e2m1_pack,
    e2m1_values,
    e8m0_reciprocals,
    e8m0_values,
    mxfp4_exponents,
    pack_fp4,
    unpack_fp4,
    work_buffers,
)
from qkit.schemes.quantized import QuantizedTensor
from qkit.schemes.registry import register

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * 6.0  # compressed-tensors generate_gparam: FP8 max * FP4 max
E4M3_EPS = 0.125  # compressed-tensors _get_dtype_eps(float8_e4m3fn): replaces a zero block scale

# Elements per chunk of rows: large enough that the ~10-20 torch calls per chunk cost little next to the
# arithmetic, small enough that a chunk's temporaries stay in cache. Measured on the default model's
# shapes, one thread, with the lookup rounding and the per-thread buffers (``work_buffers``): 2**19 best (mxfp4
# 8.5x an int8 copy; 2**17 11.8x, 2**21 8.8x).
_CHUNK_ELEMENTS = 1 << 19


def _check_width(name: str, block: int, shape: tuple[int, ...], tensor: str) -> None:
    rows, cols = as_2d(shape)
    if cols % block == 0 and cols > 0:
        return
    others = "nvfp4 (blocks of 16) can, " if block == MXFP4_BLOCK and cols % NVFP4_BLOCK == 0 else ""
    raise SchemeError(
        f"tensor {tensor} is {cols} wide ({cols} = {cols / block:g} x {block}): {name} stores blocks of {block} "
        f"along each row, so the width must be a multiple of {block}; {others}or leave it out "
        f"(qkit quantize --exclude '{tensor}') or give it another scheme (qkit quantize --keep int8-row:'{tensor}')"
    )


def _fp4_layout(name: str, block: int, shape: tuple[int, ...]) -> Layout:
    """qweight uint8 ``[rows, cols/2]`` and one scale byte per block, uint8 ``[rows, cols/block]``."""
    rows, cols = as_2d(tuple(shape))
    if cols % block or cols == 0:
        raise SchemeError(f"{name} stores whole blocks of {block} per row; a width of {cols} is not")
    return {"qweight": ((rows, cols // 2), torch.uint8), "scales": ((rows, cols // block), torch.uint8)}


def _non_finite(device: torch.device) -> dict[str, torch.Tensor]:
    """What ``encode`` returns for NaN / inf input: ``quantize_tensor`` raises on the NaN scale."""
    return {"qweight": torch.zeros(0, dtype=torch.uint8, device=device),
            "scales": torch.full((1,), math.nan, device=device)}


def _rows_per_chunk(cols: int) -> int:
    return max(1, _CHUNK_ELEMENTS // cols)


def _as_fp32_2d(w: torch.Tensor) -> torch.Tensor:
    w2 = w.reshape(as_2d(tuple(w.shape)))
    return w2 if w2.dtype == torch.float32 and w2.is_contiguous() else w2.float().contiguous()


# --------------------------------------------------------------------------- MXFP4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float ``w`` ``[rows, cols]`` (``cols % 32 == 0``) -> ``(qweight uint8 [rows, cols/2], e uint8 [rows, cols/32])``.

    None when ``w`` holds NaN or inf. One chunk of rows at a time (temporaries stay in cache).
    """
    x = _as_fp32_2d(w)
    rows, cols = x.shape
    nb = cols // MXFP4_BLOCK
    qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
    if kernels.available(x):  # two compiled passes: block absmax, then scale + round + pack
        with kernels.owning_the_cores():
            amax_bits = kernels.block_absmax_bits(x, MXFP4_BLOCK)
            if bool((amax_bits >= INF_BITS).any()):
                return None
            e = mxfp4_exponents(amax_bits.view(torch.float32))
            kernels.e2m1_blocks(x, e8m0_reciprocals(e), divide=False, ties_to_even=False, minus_zero=0, out=qweight)
            return qweight, e.to(torch.uint8)
    amax_bits = torch.empty(rows, nb, dtype=torch.int32, device=x.device)
    exps = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    step = min(rows, _rows_per_chunk(cols))  # buffers no larger than the matrix
    work = work_buffers(step * cols, x.device)
    y = work.y[: step * cols].view(step, nb, MXFP4_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        amax = block_absmax(x[r0:r1], MXFP4_BLOCK, work, out=amax_bits[r0:r1])
        e = mxfp4_exponents(amax)  # garbage for a non-finite block: refused after the loop
        exps[r0:r1] = e
        # 1 / 2**(e - 127) = 2**(127 - e): fp32 exponent field 254 - e, normal since e <= 252 (a < 2**128).
        inverse = e8m0_reciprocals(e).unsqueeze(2)
        yc = torch.mul(x[r0:r1].view(r1 - r0, nb, MXFP4_BLOCK), inverse, out=y[: r1 - r0])  # exact: a power-of-two rescale
        e2m1_pack(yc.view(r1 - r0, cols), qweight[r0:r1], ties_to_even=False, work=work)
    if bool((amax_bits >= INF_BITS).any()):
        return None
    return qweight, exps


def dequantize_mxfp4(qweight: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1[code] * 2**(e - 127)`` in fp32 (exact), ``[rows, cols]``, cast to ``dtype``."""
    values = e2m1_values(qweight)
    rows, cols = values.shape
    scale = e8m0_values(exps).reshape(rows, -1, 1)
    return values.view(rows, -1, MXFP4_BLOCK).mul_(scale).view(rows, cols).to(dtype)


# --------------------------------------------------------------------------- NVFP4


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Tensor absmax (fp32 scalar) -> fp32 ``[1]`` global scale, as compressed-tensors' ``generate_gparam``."""
    # A Python number over a tensor, exactly as generate_gparam writes it: torch evaluates it as
    # reciprocal(amax) * 2688 (two roundings), which can differ by an ulp from a true division.
    gs = NVFP4_GLOBAL_NUMERATOR / amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 block absmax + global scale -> E4M3 block scales as fp32 values (``calculate_qparams``)."""
    s = global_scale * (amax / 6.0)
    s = s.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, torch.full_like(s, E4M3_EPS), s)


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Float ``w`` ``[rows, cols]`` (``cols % 16 == 0``) -> ``(qweight uint8 [rows, cols/2], scale bits uint8
    [rows, cols/16], global_scale fp32 [1])``; None when ``w`` holds NaN or inf.

    ``global_scale``: use this tensor scale instead of ``2688 / max|w|`` (as compressed-tensors accepts a
    calibrated one); a block whose ``gs * a / 6`` exceeds 448 then saturates at 448.
    """
    x = _as_fp32_2d(w)
    rows, cols = x.shape
    nb = cols // NVFP4_BLOCK
    if kernels.available(x):  # two compiled passes: block absmax (the tensor's is their max), then the codes
        with kernels.owning_the_cores():
            amax_bits = kernels.block_absmax_bits(x, NVFP4_BLOCK)
            peak = amax_bits.max()
            if int(peak) >= INF_BITS:
                return None
            amax = amax_bits.view(torch.float32)
            gs = nvfp4_global_scale(peak.view(torch.float32)) if global_scale is None else global_scale.float().reshape(1)
            s = nvfp4_block_scales(amax, gs)
            qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
            # a -0.0 (a -0.0 weight, or a negative one the division underflows) is +0, as in e2m1_pack below
            kernels.e2m1_blocks(x, s / gs, divide=True, ties_to_even=True, minus_zero=0, out=qweight)
            return qweight, s.to(torch.float8_e4m3fn).view(torch.uint8), gs
    lo, hi = torch.aminmax(x)  # one read pass: the tensor scale needs max |w| before any block
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return None
    gs = nvfp4_global_scale(torch.maximum(-lo, hi)) if global_scale is None else global_scale.float().reshape(1)
    step = min(rows, _rows_per_chunk(cols))  # buffers no larger than the matrix
    work = work_buffers(step * cols, x.device)
    amax_bits = torch.empty(rows, nb, dtype=torch.int32, device=x.device)
    s = torch.empty(rows, nb, device=x.device)
    blocks_all = x.view(rows, nb, NVFP4_BLOCK)
    qweight = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
    y = work.y[: step * cols].view(step, nb, NVFP4_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        amax = block_absmax(x[r0:r1], NVFP4_BLOCK, work, out=amax_bits[r0:r1])
        sc = s[r0:r1]
        sc.copy_(nvfp4_block_scales(amax, gs))
        divisor = (sc / gs).unsqueeze(2)  # compressed-tensors: scale = scale / global_scale; x / scale
        yc = torch.div(blocks_all[r0:r1], divisor, out=y[: r1 - r0])
        # saturation at 6 is _quantize's clamp(y, -6, 6); a -0.0 (a -0.0 weight, or a negative one that the
        # division underflows) is +0, as compressed-tensors codes it (torch.sign(-0.0) is 0)
        e2m1_pack(yc.view(r1 - r0, cols), qweight[r0:r1], ties_to_even=True, work=work, minus_zero=0)
    scale_bits = s.to(torch.float8_e4m3fn).view(torch.uint8)
    return qweight, scale_bits, gs


def dequantize_nvfp4(
    qweight: torch.Tensor, scale_bits: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``E2M1[code] * (s / gs)`` in fp32 (compressed-tensors' ``_dequantize``), ``[rows, cols]``, cast to ``dtype``."""
    values = e2m1_values(qweight)
    rows, cols = values.shape
    step = scale_bits.view(torch.float8_e4m3fn).float() / global_scale.float().reshape(1)
    return values.view(rows, -1, NVFP4_BLOCK).mul_(step.reshape(rows, -1, 1)).view(rows, cols).to(dtype)


# --------------------------------------------------------------------------- the schemes


@dataclass(frozen=True)
class MXFP4Scheme(SchemeDefaults):
    """OCP MXFP4: E2M1 in blocks of 32 along each row, one E8M0 (power-of-two) scale per block."""

    name: str = "mxfp4"
    kind = "fp4"
    bits = 4
    packed = True
    block_size = MXFP4_BLOCK
    row_block = MXFP4_BLOCK  # blocks lie inside one row
    scale_dtype = torch.uint8  # E8M0 bytes
    fixed_scale_dtype = True  # the scale format is part of the format: --scale-dtype does not apply
    parts = ("qweight", "scales")
    description = "OCP MXFP4: E2M1 values, one power-of-two scale per 32 weights of a row"
    ggml_type = gguf.GGMLQuantizationType.MXFP4  # (39) GGUF stores it as llama.cpp's MXFP4 blocks

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> MXFP4Scheme:
        """Called by ``quantize_tensor`` with the tensor's name: refuse a width that is not whole blocks."""
        _check_width(self.name, self.block_size, shape, name)
        return self

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_width(self.name, self.block_size, tuple(w.shape), "<tensor>")
        out = quantize_mxfp4(w)
        if out is None:
            return _non_finite(w.device)
        return {"qweight": out[0], "scales": out[1]}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = as_2d(shape)
        qweight = parts["qweight"].reshape(rows, cols // 2)
        return dequantize_mxfp4(qweight, parts["scales"].reshape(rows, -1), dtype).reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """``{part: (shape, dtype)}`` that ``encode`` stores: packed codes, one E8M0 byte per block of each row."""
        return _fp4_layout(self.name, self.block_size, shape)

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Stored bytes: ``n/2`` codes + ``n/32`` E8M0 scales = 4.25 bits per weight."""
        n = math.prod(shape)
        return n // 2 + n // self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bits": 4, "element": "e2m1", "granularity": "block",
                "block_size": self.block_size, "scale_dtype": "e8m0", "global_scale": None}

    # GGUF (``qkit.export.gguf``; the ``GGMLCodable`` protocol): llama.cpp's GGML type MXFP4 holds exactly
    # these codes and exponents, in another byte order; the writer stores ``to_ggml_blocks`` and a reader
    # rebuilds the parts with ``from_ggml_blocks`` (bit for bit: tested against ``gguf.quants``).
    def to_ggml_blocks(self, qt: QuantizedTensor) -> torch.Tensor:
        """A ``QuantizedTensor`` of this scheme -> GGML MXFP4 block bytes, uint8 ``[rows, cols/32 * 17]``."""
        rows, cols = as_2d(qt.shape)
        return to_gguf_mxfp4_blocks(qt.qweight.reshape(rows, cols // 2), qt.scales.reshape(rows, -1))

    def from_ggml_blocks(self, blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
        """GGML MXFP4 block bytes ``[rows, cols/32 * 17]`` -> the ``QuantizedTensor`` qkit quantized."""
        rows, cols = as_2d(tuple(shape))
        qweight, exps = from_gguf_mxfp4_blocks(blocks.reshape(rows, -1))
        if tuple(qweight.shape) != (rows, cols // 2):
            raise SchemeError(f"MXFP4 blocks of {list(blocks.shape)} bytes do not hold a {list(shape)} tensor")
        return QuantizedTensor.from_parts(self, {"qweight": qweight, "scales": exps}, tuple(shape), dtype)


@dataclass(frozen=True)
class NVFP4Scheme(SchemeDefaults):
    """NVIDIA NVFP4: E2M1 in blocks of 16 along each row, an FP8 E4M3 scale per block, an fp32 scale per tensor."""

    name: str = "nvfp4"
    kind = "fp4"
    bits = 4
    packed = True
    block_size = NVFP4_BLOCK
    row_block = NVFP4_BLOCK  # blocks lie inside one row
    scale_dtype = torch.float8_e4m3fn  # stored as its uint8 bit patterns (module docstring)
    fixed_scale_dtype = True
    parts = ("qweight", "scales", "global_scale")
    description = "NVIDIA NVFP4: E2M1 values, an FP8 scale per 16 weights of a row, an fp32 scale per matrix"

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> NVFP4Scheme:
        _check_width(self.name, self.block_size, shape, name)
        return self

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.encode_grouped(w, None)

    def encode_grouped(self, w: torch.Tensor, tensor_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``tensor_amax``: the fused group's largest ``max |w|`` (``GroupScaled``), whose global scale
        ``2688 / tensor_amax`` the tensor is quantized with, as llm-compressor's
        ``update_fused_layer_weight_global_scales`` gives q/k/v and gate/up the least of their global scales."""
        _check_width(self.name, self.block_size, tuple(w.shape), "<tensor>")
        out = quantize_nvfp4(w, None if tensor_amax is None else nvfp4_global_scale(tensor_amax))
        if out is None:
            return _non_finite(w.device)
        return {"qweight": out[0], "scales": out[1], "global_scale": out[2]}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = as_2d(shape)
        qweight = parts["qweight"].reshape(rows, cols // 2)
        out = dequantize_nvfp4(qweight, parts["scales"].reshape(rows, -1), parts["global_scale"], dtype)
        return out.reshape(shape)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """``{part: (shape, dtype)}`` that ``encode`` stores: as mxfp4's (E4M3 scale bytes) plus the fp32 global scale."""
        return {**_fp4_layout(self.name, self.block_size, shape), "global_scale": ((1,), torch.float32)}

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Stored bytes: ``n/2`` codes + ``n/16`` E4M3 scales + 4 (the fp32 global scale) = 4.5 + 32/n bits per weight."""
        n = math.prod(shape)
        return n // 2 + n // self.block_size + 4

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bits": 4, "element": "e2m1", "granularity": "block",
                "block_size": self.block_size, "scale_dtype": "e4m3", "global_scale": "fp32"}


MXFP4 = register(MXFP4Scheme())
NVFP4 = register(NVFP4Scheme())


def to_gguf_mxfp4_blocks(qweight: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """qkit mxfp4 parts -> GGML MXFP4 block bytes ``[rows, cols/32 * 17]``: per block the E8M0 byte, then 16
    bytes whose low nibble is element ``j`` and high nibble element ``j + 16`` (``gguf.quants.MXFP4``)."""
    codes = unpack_fp4(qweight)
    rows = codes.shape[0]
    blocks = codes.view(rows, -1, 2, MXFP4_BLOCK // 2)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).to(torch.uint8)
    return torch.cat((exps.reshape(rows, -1, 1), qs), dim=2).reshape(rows, -1)


def from_gguf_mxfp4_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_gguf_mxfp4_blocks`: GGML MXFP4 block bytes uint8 ``[rows, nb * 17]`` ->
    ``(qweight uint8 [rows, nb * 16], exps uint8 [rows, nb])`` in qkit's layout (:func:`pack_fp4`)."""
    rows = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.shape[1] % (MXFP4_BLOCK // 2 + 1):
        raise SchemeError(f"GGML MXFP4 rows are whole 17-byte blocks of uint8; got {blocks.dtype} {list(blocks.shape)}")
    b = blocks.reshape(rows, -1, MXFP4_BLOCK // 2 + 1)
    exps = b[:, :, 0].contiguous()
    qs = b[:, :, 1:]
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2)  # [rows, nb, 2, 16]: elements j and j + 16
    return pack_fp4(codes.reshape(rows, -1)), exps


FP4_SCHEMES = (MXFP4Scheme, NVFP4Scheme)


def is_fp4(scheme: object) -> bool:
    """Whether ``scheme`` is one of the FP4 block schemes (mxfp4, nvfp4): E2M1 codes in blocks along a row."""
    return isinstance(scheme, FP4_SCHEMES)
