"""llama.cpp's 32-element block formats as qkit schemes: ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``.

Storage (the contract the GGUF exporter relies on): ``qweight`` is uint8 ``[rows, bytes_per_row]`` and
row ``r`` is exactly the llama.cpp blocks of row ``r`` (``[rows, cols]`` as in ``as_2d``; the blocks run
along the last dimension, ggml's ``ne[0]``), little-endian, in the C struct layout of ``ggml-common.h``;
the scales live inside the blocks, so ``scales`` is an empty fp16 tensor. Per block of 32 weights
``x[0..31]`` (``QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32``), with ``fp16()`` round-to-nearest-even:

==========  =====  ==========================================  ======================================
type        bytes  layout                                      codes (``quantize_row_*_ref``)
==========  =====  ==========================================  ======================================
``q8_0``    34     ``d: fp16, qs: int8[32]``                   ``d = amax/127``; ``qs = roundf(x/d)``
``q4_0``    18     ``d: fp16, qs: u8[16]``                     ``d = max/-8``; ``q = min(15, (int8)(x/d + 8.5))``
``q4_1``    20     ``d: fp16, m: fp16, qs: u8[16]``            ``d = (max-min)/15``; ``q = min(15, (int8)((x-min)/d + 0.5))``
``q5_0``    22     ``d: fp16, qh: u32, qs: u8[16]``            ``d = max/-16``; ``q = min(31, (int8)(x/d + 16.5))``
``q5_1``    24     ``d: fp16, m: fp16, qh: u32, qs: u8[16]``   ``d = (max-min)/31``; ``q = (u8)((x-min)/d + 0.5)``
==========  =====  ==========================================  ======================================

``max`` is the first element of largest magnitude, with its sign (``+0`` for a block of zeros); ``min``
and ``max`` of q4_1/q5_1 are the plain extremes. ``x/d`` is ``x * (1/d)`` (``1/d`` computed once, 0 when
``d`` is 0), every operation in fp32 in llama.cpp's order; the casts ``(int8)`` / ``(u8)`` truncate
toward zero. The nibbles pack element ``j`` (low) with element ``j + 16`` (high) into ``qs[j]``; bit ``j``
of ``qh`` is bit 4 of code ``j``. Bits per weight: 8.5, 4.5, 5.0, 5.5, 6.0.

Dequantization (``dequantize_row_*``, ``gguf.quants.dequantize``), in fp32: ``q8_0``: ``q * d``;
``q4_0``: ``(q - 8) * d``; ``q4_1``: ``q * d + m``; ``q5_0``: ``(q - 16) * d``; ``q5_1``: ``q * d + m``,
with ``d`` and ``m`` the stored fp16 values.

Exactness: the bytes equal llama.cpp's reference quantizer (``ggml_quantize_chunk`` without an
importance matrix, which calls ``quantize_row_*_ref``) bit for bit, and ``gguf.quants.quantize``, which
implements the same reference (the tests compare both). Where the C code converts a non-finite or
out-of-range float to an integer (only in blocks whose ``d`` is below fp32's normal range, i.e. weights
under about 1e-37), qkit reproduces what that conversion does on x86-64 (``cvttss2si``: the code of a
block whose ``1/d`` overflows is 0); such blocks dequantize to zeros either way.

**With an importance matrix** (``encode(w, quant_weights=qw)``, ``qw`` fp32 ``[cols]``), q4_0 ... q5_1 take
llama.cpp's ``quantize_row_*_impl`` paths, registered by :mod:`qkit.schemes.ggml_weighted` (which has
the formula); q8_0 ignores the matrix, as llama.cpp does. :func:`check_importance` refuses a NaN, inf
or negative importance for every block type.

On CPU the encoders run as one compiled pass per block (:func:`compiled`, :mod:`qkit.schemes.kernels`);
the torch encoders below are its oracle and handle what it hands back (NaN / inf weights, fp16
overflow, scales below fp32's normal range).

A row width that is not a multiple of 32 is refused (``resolve`` raises ``SchemeError``); llama.cpp's
quantizer would store such a tensor as F16. Weights with NaN or inf are refused by ``encode``
(``NonFiniteWeightError``) because the scales are inside the blocks, where ``quantize_tensor``'s scale
check cannot see them; a block scale that overflows fp16 (weights above about 5e5 for q4_0, 8e6 for
q8_0) is refused with ``SchemeError``, where llama.cpp would write inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf
import torch

from qkit.errors import SchemeError
from qkit.schemes import kernels
from qkit.schemes.base import Layout, Recipe, SchemeDefaults, as_2d
from qkit.schemes.ggml_blocks import (  # the shared block helpers, also imported from here by the family files
    c_bytes,
    first_extremes,
    fp16_bytes,
    fp16_scale,
    high_bits,
    inverse,
    pack_low_high,
    pack_nibbles_or,
    read_fp16,
    round_half_away,
    signed_extreme,
    subnormal,
)
from qkit.schemes.quantized import QuantizedTensor
from qkit.schemes.registry import register

# the most weights ``GGMLScheme.encode`` converts to float32 at once (a run of whole rows; at least one row)
ENCODE_ELEMENTS = 1 << 22

T = gguf.GGMLQuantizationType
QK = 32  # elements per block of the 32-block types (QK4_0 ... QK8_0 in ggml-common.h)


@dataclass(frozen=True)
class GGMLScheme(SchemeDefaults):
    """One llama.cpp block type: ``encode`` writes its block bytes, ``decode`` dequantizes them.

    ``bits`` is the width of one code; ``bits_per_weight`` counts every scale and minimum too
    (``8 * type_size / block_size``). ``qweight`` is the block bytes GGUF stores, so ``to_ggml_blocks`` and
    ``from_ggml_blocks`` (the ``GGMLCodable`` protocol) are the identity on them.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    bits: int
    description: str = field(default="", compare=False)  # one line, for --help and the docs' table
    kind = "ggml"
    # llama.cpp's quantizer asserts an importance matrix (iq2_xxs, iq2_xs): encode refuses without one, and
    # qkit.choice refuses such a tensor before any work where no matrix entry will reach it (needs_importance)
    requires_importance = False
    scale_dtype = torch.float16  # fp16 d (and m / dmin) inside every block: part of the format
    fixed_scale_dtype = True  # get_scheme ignores --scale-dtype for these schemes
    parts = ("qweight", "scales")

    @property
    def block_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.ggml_type][0]

    row_block = block_size  # type: ignore[assignment]  # blocks lie inside one row

    @property
    def type_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def resolve(self, shape: tuple[int, ...], name: str = "<tensor>") -> GGMLScheme:
        """The scheme actually used for a tensor of ``shape``: this one, or ``SchemeError`` for a width
        no 32-block type can take."""
        cols = shape[-1] if shape else 1
        if cols % QK:
            raise SchemeError(
                f"tensor {name}: width {cols} is not a multiple of {QK}, which every llama.cpp block type "
                f"needs ({self.name} included; llama.cpp would keep it as F16); exclude it from quantization (qkit quantize --exclude)"
            )
        return self

    def nbytes_for(self, shape: tuple[int, ...], name: str | None = None) -> int:
        """Bytes stored for a weight of ``shape`` (after ``resolve``): ``rows * cols / block * type_size``."""
        scheme = self.resolve(tuple(shape), name or "<tensor>")
        rows, cols = as_2d(tuple(shape))
        return rows * cols // scheme.block_size * scheme.type_size

    def encode(self, w: torch.Tensor, quant_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Any-shape float ``w`` -> ``{"qweight": uint8 [rows, cols/block * type_size], "scales": fp16 [0]}``.

        ``quant_weights``: the importance of each column, fp32 ``[cols]`` (an importance matrix's entry for
        this tensor: mean ``x**2`` of the column's input), which routes through llama.cpp's
        ``quantize_row_*_impl`` code; ``None`` is llama.cpp's path without an importance matrix.

        ``quantize_tensor`` calls ``resolve`` first; called directly, a width this type cannot take is a
        ``SchemeError`` (a k-quant does not silently write its fallback's bytes under its own name)."""
        rows, cols = as_2d(tuple(w.shape))
        width = w.shape[-1] if w.dim() else 1
        if self.resolve(tuple(w.shape)) is not self or width % self.block_size:
            raise SchemeError(
                f"{self.name} cannot take width {width} (blocks of {self.block_size}); quantize with "
                f"quantize_tensor, which resolves it to {self.resolve(tuple(w.shape)).name} as llama.cpp does"
            )
        qw = None
        if quant_weights is not None and self.ggml_type in _WEIGHTED:
            qw = quant_weights.detach().to(device=w.device, dtype=torch.float32).reshape(-1)
            if qw.numel() != cols:
                raise SchemeError(f"{self.name}: an importance vector of {qw.numel()} values for rows of {cols}")
            check_importance(qw, self.name)
        # every llama.cpp type codes each row by itself (ggml_quantize_chunk takes any run of rows), so a
        # large tensor is encoded a run of rows at a time: its float32 copy is one run's, never the whole
        # tensor's (a 7B model's 49,152 x 4096 embedding: 16 MiB instead of 805 MiB); the bytes are the same
        x2 = w.reshape(rows, cols)
        step = max(1, ENCODE_ELEMENTS // max(cols, 1))
        if rows <= step:
            return {"qweight": self._encode_rows(x2, qw), "scales": torch.empty(0, dtype=torch.float16, device=w.device)}
        out = torch.empty(rows, cols // self.block_size * self.type_size, dtype=torch.uint8, device=w.device)
        for r in range(0, rows, step):
            out[r:r + step] = self._encode_rows(x2[r:r + step], qw)
        return {"qweight": out, "scales": torch.empty(0, dtype=torch.float16, device=w.device)}

    def _encode_rows(self, x2: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
        """Rows ``[n, cols]`` -> their block bytes uint8 ``[n, cols / block * type_size]`` (``qw``: the importance
        vector through llama.cpp's weighted path, or None)."""
        x2 = x2.float() if x2.dtype != torch.float32 else x2
        n, cols = x2.shape
        if qw is not None:
            blocks = _WEIGHTED[self.ggml_type](x2.contiguous(), qw.contiguous())
        else:
            blocks = _ENCODERS[self.ggml_type](x2.reshape(n * cols // self.block_size, self.block_size).contiguous())
        return blocks.view(n, cols // self.block_size * self.type_size)

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        blocks = parts["qweight"].reshape(-1, self.type_size)
        return _DECODERS[self.ggml_type](blocks).reshape(shape).to(dtype)

    def part_layout(self, shape: tuple[int, ...]) -> Layout:
        """``{part: (shape, dtype)}`` that ``encode`` stores for a weight of ``shape`` (checked on reading)."""
        rows, cols = as_2d(tuple(shape))
        width = shape[-1] if shape else 1
        if width % self.block_size:
            raise SchemeError(f"{self.name} stores whole blocks of {self.block_size} per row; a width of {width} is not")
        return {"qweight": ((rows, cols // self.block_size * self.type_size), torch.uint8), "scales": ((0,), torch.float16)}

    def to_ggml_blocks(self, qt: QuantizedTensor) -> torch.Tensor:
        """The block bytes GGUF stores: the ``qweight`` itself, uint8 ``[rows, bytes_per_row]``."""
        return qt.qweight

    def from_ggml_blocks(self, blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
        """GGUF block bytes uint8 ``[rows, bytes_per_row]`` -> the ``QuantizedTensor`` (``scales`` empty, as ``encode``'s)."""
        return QuantizedTensor(self, blocks.contiguous(), torch.empty(0, dtype=self.scale_dtype), tuple(shape), dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "ggml_type": self.ggml_type.name,
            "bits": self.bits,
            "block_size": self.block_size,
            "type_size": self.type_size,
            "bits_per_weight": self.bits_per_weight,
        }


# --------------------------------------------------------------------------- encoders: fp32 [nb, 32] -> u8 [nb, size]


def encode_q8_0(x: torch.Tensor) -> torch.Tensor:
    hi, lo = x.amax(dim=1), x.amin(dim=1)
    amax = torch.maximum(hi, lo.neg()).abs()  # MAX(amax, fabsf(v)): +0 for a block of zeros
    d = amax / 127
    h = fp16_scale(d, "scale", amax)
    idv = inverse(d)
    v = round_half_away(x * idv.unsqueeze(1))
    out = torch.empty(x.shape[0], 34, dtype=torch.uint8, device=x.device)
    out[:, :2] = fp16_bytes(h)
    weird = subnormal(d)
    if bool(weird.any()):  # codes may leave [-128, 127] (C keeps the low byte) or be inf/NaN
        rows = weird.nonzero().squeeze(1)
        exact = c_bytes(v.index_select(0, rows), idv.index_select(0, rows), None)
        v.index_fill_(0, rows, 0.0)
    out[:, 2:] = v.to(torch.int8).view(torch.uint8)  # |v| <= 127 * (1 + 2**-22) elsewhere: in range
    if bool(weird.any()):
        out[rows, 2:] = exact
    return out


def _codes(x: torch.Tensor, shift: torch.Tensor | None, d: torch.Tensor, offset: float, cap: int | None) -> torch.Tensor:
    """uint8 codes ``[nb, 32]``: the byte C stores for ``MIN(cap, (int8_t)((x - shift) * (1/d) + offset))``
    (``(uint8_t)(...)`` without a cap). Where ``d`` is a normal fp32 number the value lies in
    ``[0, 2 * offset + levels)`` and one conversion to uint8 truncates it; blocks with a subnormal ``d``
    take the exact path (:func:`c_bytes`)."""
    idv = inverse(d)
    if shift is None:
        v = torch.mul(x, idv.unsqueeze(1)).add_(offset)
    else:
        v = torch.sub(x, shift.unsqueeze(1)).mul_(idv.unsqueeze(1)).add_(offset)
    weird = subnormal(d)
    if bool(weird.any()):
        rows = weird.nonzero().squeeze(1)
        exact = c_bytes(v.index_select(0, rows), idv.index_select(0, rows), cap)
        v.index_fill_(0, rows, 0.0)
    q = v.to(torch.uint8)
    if cap is not None:
        q.clamp_(max=cap)
    if bool(weird.any()):
        q.index_copy_(0, rows, exact)
    return q


def encode_q4_0(x: torch.Tensor) -> torch.Tensor:
    amax, mx = signed_extreme(x)
    d = mx / -8
    h = fp16_scale(d, "scale", amax)
    q = _codes(x, None, d, 8.5, 15)
    out = torch.empty(x.shape[0], 18, dtype=torch.uint8, device=x.device)
    out[:, :2] = fp16_bytes(h)
    pack_nibbles_or(q, out[:, 2:])
    return out


def encode_q5_0(x: torch.Tensor) -> torch.Tensor:
    amax, mx = signed_extreme(x)
    d = mx / -16
    h = fp16_scale(d, "scale", amax)
    q = _codes(x, None, d, 16.5, 31)
    out = torch.empty(x.shape[0], 22, dtype=torch.uint8, device=x.device)
    out[:, :2] = fp16_bytes(h)
    high_bits(q, out[:, 2:6])
    pack_low_high(q, out[:, 6:])
    return out


def encode_q4_1(x: torch.Tensor) -> torch.Tensor:
    mn, mx = first_extremes(x)
    d = (mx - mn) / 15
    out = torch.empty(x.shape[0], 20, dtype=torch.uint8, device=x.device)
    peak = torch.stack([mn, mx])
    out[:, :2] = fp16_bytes(fp16_scale(d, "scale", peak))
    out[:, 2:4] = fp16_bytes(fp16_scale(mn, "minimum", peak))
    pack_nibbles_or(_codes(x, mn, d, 0.5, 15), out[:, 4:])
    return out


def encode_q5_1(x: torch.Tensor) -> torch.Tensor:
    mn, mx = first_extremes(x)
    d = (mx - mn) / 31
    out = torch.empty(x.shape[0], 24, dtype=torch.uint8, device=x.device)
    peak = torch.stack([mn, mx])
    out[:, :2] = fp16_bytes(fp16_scale(d, "scale", peak))
    out[:, 2:4] = fp16_bytes(fp16_scale(mn, "minimum", peak))
    q = _codes(x, mn, d, 0.5, None)  # no clamp in C: (uint8_t)(x0 + 0.5f), split into a nibble and bit 4
    high_bits(q, out[:, 4:8])
    pack_low_high(q, out[:, 8:])
    return out


# --------------------------------------------------------------------------- decoders: u8 [nb, size] -> fp32 [nb, 32]


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """``qs`` uint8 ``[nb, 16]`` -> codes ``[nb, 32]``: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _with_high_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit codes ``[nb, 32]`` (uint8) from ``qh`` bytes ``[nb, 4]`` and ``qs`` ``[nb, 16]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    bits = ((qh.unsqueeze(2) >> shifts) & 1).view(-1, 32)
    return _low_high(qs) | (bits << 4)


def decode_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * read_fp16(b, 0)


def decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    return read_fp16(b, 0) * (_low_high(b[:, 2:]).to(torch.int8) - 8).float()


def decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    return (read_fp16(b, 0) * _low_high(b[:, 4:]).float()) + read_fp16(b, 2)


def decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    return read_fp16(b, 0) * (_with_high_bit(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16).float()


def decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    return (read_fp16(b, 0) * _with_high_bit(b[:, 4:8], b[:, 8:]).float()) + read_fp16(b, 2)


def compiled(kind: str, size: int, encode: Any) -> Any:
    """``encode`` (the torch encoder above, the oracle) run by the compiled kernel where it takes the tensor
    (:mod:`qkit.schemes.kernels`, same bytes): the kernel writes the codes and returns ``d`` (and ``min``)
    in fp32, converted to fp16 here as the torch encoders do. A tensor with a NaN / inf weight or a scale
    beyond fp16 goes back to ``encode``, which refuses it with its own message; blocks whose ``d`` is below
    fp32's normal range (weights under ~1e-37) are re-encoded by ``encode``, the only code that reproduces
    the C casts there."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if not kernels.available(x) or x.shape[0] == 0:
            return encode(x)
        with kernels.owning_the_cores():
            return finish(x)

    def finish(x: torch.Tensor) -> torch.Tensor:
        out, d, m, flags = kernels.blocks32(x, kind, size)
        h = d.to(torch.float16)
        mins = m.to(torch.float16) if kind in ("q4_1", "q5_1") else None
        if bool((flags == 2).any()) or not bool(torch.isfinite(h).all()) or (mins is not None and not bool(torch.isfinite(mins).all())):
            return encode(x)
        out[:, :2] = fp16_bytes(h)
        if mins is not None:
            out[:, 2:4] = fp16_bytes(mins)
        if bool(flags.any()):
            rows = flags.nonzero().squeeze(1)
            out[rows] = encode(x.index_select(0, rows))
        return out

    run.__name__ = run.__qualname__ = encode.__name__
    run.__doc__ = encode.__doc__
    return run


_ENCODERS: dict[Any, Any] = {
    T.Q8_0: compiled("q8_0", 34, encode_q8_0),
    T.Q4_0: compiled("q4_0", 18, encode_q4_0),
    T.Q4_1: compiled("q4_1", 20, encode_q4_1),
    T.Q5_0: compiled("q5_0", 22, encode_q5_0),
    T.Q5_1: compiled("q5_1", 24, encode_q5_1),
}
_DECODERS: dict[Any, Any] = {T.Q8_0: decode_q8_0, T.Q4_0: decode_q4_0, T.Q4_1: decode_q4_1, T.Q5_0: decode_q5_0, T.Q5_1: decode_q5_1}


# The importance-weighted encoders (llama.cpp's ``quantize_row_*_impl`` with ``quant_weights``): fp32 rows
# ``[rows, cols]`` and the importance of each column, fp32 ``[cols]`` -> block bytes uint8
# ``[rows, cols / block * type_size]``. A row is the unit (the ``_impl`` paths weight every element by
# ``qw[j] * sqrtf(sigma2 + x[j]**2)``, ``sigma2`` the row's mean square). A type without one (q8_0:
# ``quantize_q8_0`` ignores the matrix) quantizes as without an importance matrix, as llama.cpp does.
_WEIGHTED: dict[Any, Any] = {}


# --------------------------------------------------------------------------- with an importance matrix


# The range of an importance vector's largest value within which llama.cpp's weighted searches (fp32
# sums of qw * sqrt(sigma2 + x^2) * x^2 and their products) give the same codes whatever the vector's
# scale: scaling a real entry (the wide test model's ffn_down) by powers of two changed no code of any
# weighted type while its largest value stayed in [5.2e-14, 2.5e11] (q4_k, the narrowest); beyond, the
# sums flush to zero or overflow and whole tensors come out as zeros (3e38 sums: every block tensor of a
# q4_k_m file). The bounds keep a margin of 20x below and 25x above; a real matrix is far inside (the
# default model's entries peak between 0.085 and 1.65e4, mean squares of its layer inputs).
IMPORTANCE_RANGE = (1e-12, 1e10)


def importance_problem(qw: torch.Tensor) -> str | None:
    """Why the importance vector ``qw`` (fp32 ``[cols]``) cannot weight a search, in words, or None: a NaN,
    an inf or a negative value (it holds mean squares of activations), all zeros (every block's weights
    vanish: llama.cpp writes the tensor as zeros), or a largest value outside ``IMPORTANCE_RANGE``."""
    bad = ~torch.isfinite(qw) | (qw < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        return f"importance value {qw[i].item()} for column {i} is not a finite non-negative number"
    top = float(qw.max()) if qw.numel() else 0.0
    if top == 0.0:
        return "its importance values are all zero (no column would weigh anything: the tensor would be written as zeros)"
    lo, hi = IMPORTANCE_RANGE
    if not lo <= top <= hi:
        return (f"its largest importance value {top:.3g} lies outside [{lo:g}, {hi:g}], where llama.cpp's fp32 "
                "searches stay exact (beyond it their sums flush to zero or overflow and the codes come out as zeros)")
    return None


def check_importance(qw: torch.Tensor, what: str) -> None:
    """``SchemeError`` (one line) when the importance vector ``qw`` holds a NaN, an inf or a negative value
    (an importance matrix holds mean squares of activations). The encoders accept what llama.cpp's accept
    (all zeros, any scale: their bytes are tested against the C on such vectors); what a user's matrix
    may hold beyond that is ``importance_problem``'s, checked where a matrix file meets a model."""
    bad = ~torch.isfinite(qw) | (qw < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise SchemeError(
            f"{what}: importance value {qw[i].item()} for column {i} is not a finite non-negative number "
            "(an importance matrix holds mean squares of activations); recompute or fix the importance matrix"
        )


def register_codec(ggml_type: gguf.GGMLQuantizationType, encode: Any, decode: Any, weighted: Any = None) -> None:
    """Add the encoder and decoder of another block type (``qkit.schemes.kquants`` adds Q4_K and Q6_K),
    and its importance-weighted row encoder ``weighted(x [rows, cols], qw [cols]) -> uint8 [rows, bytes]``."""
    _ENCODERS[ggml_type] = encode
    _DECODERS[ggml_type] = decode
    if weighted is not None:
        _WEIGHTED[ggml_type] = weighted


def register_weighted(ggml_type: gguf.GGMLQuantizationType, weighted: Any) -> None:
    """Add the importance-weighted row encoder of a block type whose plain codec is already registered."""
    _WEIGHTED[ggml_type] = weighted


def needs_importance(scheme: object) -> bool:
    """Whether ``scheme`` (as resolved for a tensor) cannot be encoded without an importance vector: llama.cpp's
    quantizer asserts one (iq2_xxs, iq2_xs)."""
    return isinstance(scheme, GGMLScheme) and scheme.requires_importance


def uses_importance(ggml_type: gguf.GGMLQuantizationType) -> bool:
    """Whether llama.cpp's quantizer for ``ggml_type`` reads an importance matrix (q8_0's does not)."""
    return ggml_type in _WEIGHTED


Q8_0 = register(GGMLScheme("q8_0", T.Q8_0, 8, "llama.cpp Q8_0: blocks of 32, 8-bit codes, an fp16 scale"))
Q4_0 = register(GGMLScheme("q4_0", T.Q4_0, 4, "llama.cpp Q4_0: blocks of 32, 4-bit codes, an fp16 scale"))
Q4_1 = register(GGMLScheme("q4_1", T.Q4_1, 4, "llama.cpp Q4_1: blocks of 32, 4-bit codes, an fp16 scale and minimum"))
Q5_0 = register(GGMLScheme("q5_0", T.Q5_0, 5, "llama.cpp Q5_0: blocks of 32, 5-bit codes, an fp16 scale"))
Q5_1 = register(GGMLScheme("q5_1", T.Q5_1, 5, "llama.cpp Q5_1: blocks of 32, 5-bit codes, an fp16 scale and minimum"))


def is_llama_type(scheme: object) -> bool:
    """Whether ``scheme`` is one of llama.cpp's: a block type (q2_k ... q8_0, iq4_nl, iq4_xs) or a recipe
    (q4_k_m, ...), whose scales come from llama.cpp's own searches and which an importance matrix weights."""
    return isinstance(scheme, (GGMLScheme, Recipe))
