"""NF4: the 16 QLoRA levels (normal-distribution quantiles) with an absmax per block of 64.

Blocks are taken over the *flattened* tensor, exactly as bitsandbytes does (a block may cross a row
boundary; a last, shorter block gets its own absmax). Codes are chosen as bitsandbytes'
``quantize_4bit(..., quant_type="nf4")`` chooses them, bit for bit:

    scaled = w * (1 / absmax)        for full blocks (bitsandbytes multiplies by the reciprocal)
    scaled = w / absmax              for the short tail block (bitsandbytes divides there)
    code   = bucketize(scaled, midpoints)   midpoints of adjacent levels in fp32; a value exactly on
                                            a midpoint takes the lower level (``right=False``)

Codes are always computed from the fp32 absmax; the absmax is then stored in ``scale_dtype``
(fp16 by default: 4 + 16/64 = 4.25 bits per weight) and dequantization is ``NF4[code] * stored_absmax``
in fp32, which with ``scale_dtype=float32`` equals bitsandbytes' ``dequantize_4bit`` exactly.
"""

from __future__ import annotations

import torch

from qkit.schemes.packing import pack_nibbles, unpack_nibbles

# The NF4 levels, as float32, from Dettmers et al., "QLoRA" (2023), Appendix E, and bitsandbytes'
# ``get_4bit_type("nf4")``; they are the quantiles of N(0, 1) normalised to [-1, 1] with an exact 0.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def nf4_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, midpoints)`` as fp32 tensors on ``device`` (cached; read-only by convention)."""
    device = torch.device(device)
    if device not in _TABLES:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
        _TABLES[device] = (levels, (levels[:-1] + levels[1:]) / 2)
    return _TABLES[device]


def quantize_nf4(
    w: torch.Tensor, block_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any-shape float ``w`` -> ``(packed uint8[ceil(n/2)], absmax[ceil(n/block_size)] in scale_dtype)``.

    Non-finite input gives a non-finite absmax; callers check it (see ``qkit.transform``).
    """
    _, midpoints = nf4_tables(w.device)
    flat = w.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    n = flat.numel()
    full = n - n % block_size
    blocks = flat[:full].view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)
    # No clamp to [-1, 1] as bitsandbytes does: bucketize maps anything beyond the outer midpoints
    # to code 0 or 15 either way, so the codes are identical and one pass is saved.
    codes = torch.bucketize(scaled.view(-1), midpoints, out_int32=True)
    if full < n:
        tail = flat[full:]
        tail_max = tail.abs().amax()
        tail_codes = torch.bucketize(tail / tail_max.clamp(min=1e-38), midpoints, out_int32=True)
        codes = torch.cat([codes, tail_codes])
        absmax = torch.cat([absmax, tail_max.reshape(1)])
    return pack_nibbles(codes), absmax.to(scale_dtype)


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``NF4[code] * absmax`` in fp32, reshaped to ``shape``."""
    levels, _ = nf4_tables(packed.device)
    n = 1
    for d in shape:
        n *= d
    values = levels[unpack_nibbles(packed, n).long()]
    absmax = absmax.to(torch.float32)
    full = n - n % block_size
    values[:full].view(-1, block_size).mul_(absmax[: full // block_size].unsqueeze(1))
    if full < n:
        values[full:].mul_(absmax[-1])
    return values.reshape(shape).to(dtype)
