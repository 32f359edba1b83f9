"""Greedy agreement: how often a model picks the reference's greedy token, given the reference's prefix.

The reference greedily extends each battery prompt by ``n`` tokens (pure argmax, EOS not special, so
every prompt yields exactly ``n`` positions). Each model then reads those tokens teacher-forced and its
argmax at each of the ``n`` positions is compared with the reference's token. This is also the
acceptance rate a quantized *draft* model gets in greedy speculative decoding.

The prompts are read once per model (``prefill_prompts``): a KV cache of every prompt token but the
last, shared by agreement and the battery (``battery.generate_answers``), so a row pays for one prefill
of the 16 prompts, not two. Agreement then costs one cached forward of ``n`` positions per prompt (the
prompt's last token and the reference's first ``n - 1``) on a copy of that cache. The reference's own tokens come from the same cached computation, one position longer at a
time, so the reference agrees with itself on every position (tested).

Left padding with explicit ``position_ids`` (cumulative attention mask), so padded and unpadded
prompts see the same positions.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch

from qkit.evaluation.battery import cache_keyword, encode_batch


@dataclass
class ReferenceContinuation:
    input_ids: torch.Tensor  # [B, L + n] left-padded prompt followed by the reference's n tokens
    attention_mask: torch.Tensor  # [B, L + n]
    n: int

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, -self.n :]

    @property
    def prompts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The left-padded prompt ids and mask ``[B, L]``: the battery's batch."""
        return self.input_ids[:, : -self.n], self.attention_mask[:, : -self.n]


@dataclass
class PromptCache:
    """One model's KV cache of a left-padded prompt batch ``input_ids``/``attention_mask`` ``[B, L]``
    over its first ``L - 1`` positions. ``extend`` reads more tokens after it, leaving it as it was;
    ``battery.generate_answers`` consumes it (``cache`` is None afterwards)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: object

    @property
    def cached(self) -> int:
        return self.input_ids.shape[1] - 1

    def extend(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Argmax ``[B, 1 + m]`` at the prompt's last position and at each of ``tokens`` (``[B, m]``,
        teacher-forced after the prompt): the prediction for the position after each. One cached forward
        of ``1 + m`` positions on a copy of the cache (the prompts' keys and values only: megabytes), so the
        cache itself stays the prompts' (a copy, not ``crop``, which sliding-window caches do not undo)."""
        if self.cache is None:
            raise RuntimeError("this prompt cache was consumed by generation; prefill the prompts again")
        device = next(model.parameters()).device
        ids = torch.cat([self.input_ids[:, -1:], tokens.to(self.input_ids)], dim=1)
        mask = torch.cat([self.attention_mask, torch.ones_like(tokens, dtype=self.attention_mask.dtype)], dim=1)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)[:, -ids.shape[1] :]
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                           use_cache=True, **{cache_keyword(model): copy.deepcopy(self.cache)}).logits
            return logits.argmax(-1).cpu()


def prefill_prompts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PromptCache:
    """``model``'s KV cache of the left-padded batch ``[B, L]`` up to its last position (one forward of
    ``L - 1`` positions; nothing of the lm_head's output is kept)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    if input_ids.shape[1] > 1:
        head_ids, head_mask = input_ids[:, :-1], attention_mask[:, :-1]
        pos = (head_mask.cumsum(-1) - 1).clamp_(min=0)
        with torch.inference_mode():
            keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            model(input_ids=head_ids.to(device), attention_mask=head_mask.to(device), position_ids=pos.to(device),
                  use_cache=True, **keep, **{cache_keyword(model): cache})
    return PromptCache(input_ids, attention_mask, cache)


def _argmax_next(model, ids: torch.Tensor, mask: torch.Tensor, at: slice = slice(None)) -> torch.Tensor:
    """Argmax at the positions ``at`` of one uncached forward pass over ``[B, T]`` (the prediction for
    position t+1 at index t). Engines' stand-ins in the tests read rows this way."""
    device = next(model.parameters()).device
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device), use_cache=False).logits
        return logits[:, at].argmax(-1).cpu()


def reference_continuation(model, tokenizer, prompts: list[str], n: int, *,
                           prompt_cache: PromptCache | None = None) -> ReferenceContinuation:
    """The reference's ``n`` greedy tokens after each prompt. ``prompt_cache``: the reference's own
    ``prefill_prompts`` of the same batch, reused (and left as it was)."""
    if prompt_cache is None:
        batch = encode_batch(tokenizer, prompts)
        prompt_cache = prefill_prompts(model, batch["input_ids"], batch["attention_mask"])
    ids, mask = prompt_cache.input_ids, prompt_cache.attention_mask
    tokens = ids[:, :0]
    for _ in range(n):
        tokens = torch.cat([tokens, prompt_cache.extend(model, tokens)[:, -1:]], dim=1)
    return ReferenceContinuation(torch.cat([ids, tokens], dim=1), torch.cat([mask, torch.ones_like(tokens)], dim=1), n)


def agreement(model, ref: ReferenceContinuation, *, prompt_cache: PromptCache | None = None) -> torch.Tensor:
    """Bool ``[B, n]``: the model's teacher-forced argmax equals the reference's token. ``prompt_cache``:
    this model's ``prefill_prompts`` of ``ref.prompts``, reused (and left as it was)."""
    if prompt_cache is None:
        prompt_cache = prefill_prompts(model, *ref.prompts)
    pred = prompt_cache.extend(model, ref.targets[:, :-1])
    return pred == ref.targets
