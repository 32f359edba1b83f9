"""Greedy agreement: how often a model picks the reference's greedy token, given the reference's prefix.

The reference greedily extends each battery prompt by ``n`` tokens (pure argmax, EOS not special, so
every prompt yields exactly ``n`` positions). Each model then reads prompt + those tokens once,
teacher-forced, and its argmax at each of the ``n`` positions is compared with the reference's token.
This is also the acceptance rate a quantized *draft* model gets in greedy speculative decoding.

Left padding with explicit ``position_ids`` (cumulative attention mask), so padded and unpadded
prompts see the same positions. The reference's tokens come from full forward passes (no KV cache),
the same computation as the teacher-forced pass, so the reference agrees with itself on every position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkit.evaluation.battery import encode_batch


@dataclass
class ReferenceContinuation:
    input_ids: torch.Tensor  # [B, L + n] left-padded prompt followed by the reference's n tokens
    attention_mask: torch.Tensor  # [B, L + n]
    n: int

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, -self.n :]


def _argmax_next(model, ids: torch.Tensor, mask: torch.Tensor, at: slice = slice(None)) -> torch.Tensor:
    """Argmax at the positions ``at``: ``[B, T]`` for all of them (the prediction for position t+1 at
    index t). One forward pass over all ``T`` positions whatever ``at`` (the same logits); only the
    argmax is restricted to the positions asked for."""
    device = next(model.parameters()).device
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device), use_cache=False).logits
        return logits[:, at].argmax(-1).cpu()


def reference_continuation(model, tokenizer, prompts: list[str], n: int) -> ReferenceContinuation:
    batch = encode_batch(tokenizer, prompts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for _ in range(n):
        nxt = _argmax_next(model, ids, mask, slice(-1, None))
        ids = torch.cat([ids, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    return ReferenceContinuation(ids, mask, n)


def agreement(model, ref: ReferenceContinuation) -> torch.Tensor:
    """Bool ``[B, n]``: the model's teacher-forced argmax equals the reference's token."""
    pred = _argmax_next(model, ref.input_ids, ref.attention_mask, slice(-ref.n - 1, -1))
    return pred == ref.targets
