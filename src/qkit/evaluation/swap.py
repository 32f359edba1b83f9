"""Replace a model's tensors in place and put the reference's back: how every eval row gets its weights.

Layer 6 (``evaluation``). ``Swapper.apply`` copies a row's dequantized tensors into the reference model;
``Swapper.restore`` puts the reference's values back before the next row.

Memory: the originals are not held. ``restore`` reads the replaced tensors back from the reference's own
safetensors files (``source``) with ``qkit.checkpoint.iter_tensors`` (plain reads into one tensor's buffer,
not a memory map, so the file's pages never count in this process's resident memory) and casts each to
the model's dtype, which is exactly what loading the model did (``copy_`` rounds to nearest-even, as
``Tensor.to`` does). Only a tensor the source files do not hold (a tied head the file does not store, a
buffer, a model loaded without ``source``) is kept as a clone when it is first replaced. Extra memory:
the largest replaced tensor, in the file's dtype, while it is read back.

Mixture-of-experts: transformers holds a layer's experts fused in two 3-D parameters, and the checkpoint
(and every row's file) stores one 2-D matrix per expert. Each expert matrix is a target under its stored
name, as a view of the fused parameter (``qkit.methods.experts.expert_matrices``), so a row's expert
matrices are copied into the model and read back like any other weight. A quantized tensor the model holds
under no name is refused in one line rather than skipped: a row never scores weights it left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import InputError
from qkit.methods.experts import expert_matrices, stored_aliases
from qkit.schemes import QuantizedTensor


def model_tensors(model) -> dict[str, torch.Tensor]:
    """A loaded transformers ``model``'s parameters and buffers by every name they answer to (tied weights
    under both names), and each expert matrix by the name the checkpoint stores it under (a view of its fused
    parameter: ``expert_matrices``), and a parameter the checkpoint names otherwise under its stored name too
    (mixtral's router, which AWQ rewrites: ``stored_aliases``): every tensor a row's file can name."""
    config = model.config.to_dict()
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False)),
            **stored_aliases(model, config), **expert_matrices(model, config)}


class Swapper:
    """Replace a model's tensors in place; restore them from ``source`` (the reference's model directory,
    a ``ModelRef.directory`` with safetensors files), or from clones where ``source`` lacks them."""

    def __init__(self, model, source: str | Path | None = None):
        self.model = model
        self.source = Path(source) if source is not None else None
        self.targets: dict[str, torch.Tensor] = model_tensors(model)
        # The tensor names the source files store (headers only): those are re-read, never cloned.
        self.stored: frozenset[str] = frozenset(n for n, _ in tensor_shapes(self.source)) if self.source else frozenset()
        self.originals: dict[str, torch.Tensor] = {}  # clones of replaced tensors the source does not hold
        self.reread: set[str] = set()  # replaced tensors to read back from the source on restore
        self.changed = 0  # tensors of the last ``apply`` whose values differ from the reference's

    def apply(self, tensors: Iterable[tuple[str, QuantizedTensor | torch.Tensor]]) -> None:
        """Copy each dequantized ``QuantizedTensor`` (or full-precision replacement, e.g. a norm that a
        method folded scales into) into the model's tensor of that name, dequantized straight to the
        model's dtype (``value.dequantize(p.dtype)``). A full-precision tensor the model does not hold
        (transformers ignored it when it loaded the reference, e.g. an old ``rotary_emb.inv_freq``) is
        skipped, as it was then; a quantized one is refused (``InputError``): the row would leave it out. A
        tensor equal to the model's is not copied (nor marked for restore).

        ``changed`` counts the tensors whose new values differ from the reference's; called again before
        ``restore``, a tensor replaced both times counts as changed (its reference value is not held)."""
        self.changed = 0
        with torch.no_grad():
            for name, value in tensors:
                p = self.targets.get(name)
                if p is None and isinstance(value, QuantizedTensor):
                    raise InputError(f"the row quantizes {name}, which the loaded {type(self.model).__name__} holds "
                                     "under no name; it would be scored without it")
                if p is None:
                    continue
                shape = value.shape if isinstance(value, QuantizedTensor) else tuple(value.shape)
                if tuple(p.shape) != tuple(shape):
                    raise InputError(f"{name}: checkpoint shape {list(shape)} != model shape {list(p.shape)}; pass the matching --reference")
                new = value.dequantize(p.dtype) if isinstance(value, QuantizedTensor) else value.to(p.dtype)
                new = new.to(p.device)
                if name in self.reread or name in self.originals:  # already replaced: p holds a row's values
                    p.copy_(new)
                    self.changed += 1 if name in self.reread else not torch.equal(p, self.originals[name])
                    continue
                if torch.equal(p, new):
                    continue
                if name in self.stored:
                    self.reread.add(name)
                else:
                    self.originals[name] = p.detach().clone()
                p.copy_(new)
                self.changed += 1

    def restore(self) -> None:
        """Put the reference's values back: every re-read tensor from the source files (one tensor in
        memory at a time, cast to the model's dtype), every cloned one from its clone."""
        with torch.no_grad():
            if self.reread:
                left = set(self.reread)
                for name, stored in iter_tensors(self.source):
                    if name in left:
                        self.targets[name].copy_(stored)
                        left.discard(name)
                        if not left:
                            break  # closes the file: the rest is not read
                if left:  # the headers named them when this swapper was built: the files changed since
                    raise InputError(f"{self.source} no longer holds {sorted(left)[0]}; the reference's files changed "
                                     "during the eval: restore them and run it again")
                self.reread.clear()
            for name, w in self.originals.items():
                self.targets[name].copy_(w)
            self.originals.clear()
