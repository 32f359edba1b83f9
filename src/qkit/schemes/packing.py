"""Exact nibble packing: two 4-bit codes per byte.

Order (the same as bitsandbytes' NF4 storage): for the flattened code sequence ``c``, byte ``i`` holds
``c[2i]`` in its high nibble and ``c[2i+1]`` in its low nibble: ``byte = (c[2i] << 4) | c[2i+1]``.
An odd count is padded with one code ``pad`` (0 unless a caller needs another: NF4 pads with the code
of 0.0, as bitsandbytes does). Packed shape: ``[ceil(n / 2)]`` (uint8).
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """Pack integer codes (any shape and integer dtype, values 0..15) into ``uint8[ceil(n/2)]``.

    The shift and the ``or`` run in the codes' own dtype on the ``n/2`` pairs; the one conversion to
    uint8 is the last step, so int32 codes are not first copied to uint8.
    """
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_full((1,), pad)])
    pairs = flat.view(-1, 2)
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8[ceil(n/2)]`` -> ``uint8[n]`` codes 0..15."""
    packed = packed.reshape(-1)
    out = torch.empty(packed.numel(), 2, dtype=torch.uint8, device=packed.device)
    out[:, 0] = packed >> 4
    out[:, 1] = packed & 0x0F
    return out.view(-1)[:n]
