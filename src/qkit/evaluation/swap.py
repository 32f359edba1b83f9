"""Replace a model's tensors in place and put the reference's back: how every eval row gets its weights.

Layer 6 (``evaluation``). ``Swapper.apply`` copies a row's dequantized tensors into the reference model;
``Swapper.restore`` puts the reference's values back before the next row.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qkit.errors import InputError
from qkit.schemes import QuantizedTensor


class Swapper:
    """Replace a model's tensors in place, keeping one copy of the originals to restore."""

    def __init__(self, model, source=None):
        self.model = model
        self.source = source  # the reference's directory (a ModelRef.directory): originals can be re-read from it
        # Parameters and buffers by every name they answer to (tied weights under both names).
        self.targets: dict[str, torch.Tensor] = {**dict(model.named_buffers(remove_duplicate=False)),
                                                 **dict(model.named_parameters(remove_duplicate=False))}
        self.originals: dict[str, torch.Tensor] = {}
        self.changed = 0  # tensors of the last ``apply`` whose values differ from the reference's

    def apply(self, tensors: Iterable[tuple[str, QuantizedTensor | torch.Tensor]]) -> None:
        """Copy each dequantized ``QuantizedTensor`` (or full-precision replacement, e.g. a norm that a
        method folded scales into) into the model's tensor of that name. A stored tensor the model does not
        hold (transformers ignored it when it loaded the reference, e.g. an old ``rotary_emb.inv_freq``) is
        skipped, as it was then; a full-precision tensor equal to the model's is not copied (nor saved)."""
        self.changed = 0
        with torch.no_grad():
            for name, value in tensors:
                p = self.targets.get(name)
                if p is None:
                    continue
                shape = value.shape if isinstance(value, QuantizedTensor) else tuple(value.shape)
                if tuple(p.shape) != tuple(shape):
                    raise InputError(f"{name}: checkpoint shape {list(shape)} != model shape {list(p.shape)}; pass the matching --reference")
                new = value.dequantize(p.dtype) if isinstance(value, QuantizedTensor) else value.to(p.dtype)
                if name not in self.originals:
                    if torch.equal(p, new.to(p.device)):
                        continue
                    self.originals[name] = p.detach().clone()
                p.copy_(new)
                self.changed += not torch.equal(p, self.originals[name])

    def restore(self) -> None:
        with torch.no_grad():
            for name, w in self.originals.items():
                self.targets[name].copy_(w)
