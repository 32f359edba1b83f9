"""The 16-question factual battery: prompts, batched greedy generation and the scorer.

An answer counts when one accepted string appears in the model's output, case-insensitively and on
word boundaries (so "Paris" counts in "It is Paris." but not in "Parisian"). Prompts use the model's
chat template where it has one, else ``Question: ...\\nAnswer:``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from qkit.texts import data_file


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]


def load_battery(name: str = "battery.json") -> list[Question]:
    data = json.loads(data_file(name).read_text())
    return [Question(q["question"], tuple(q["answers"])) for q in data["questions"]]


def is_correct(output: str, answers: tuple[str, ...] | list[str]) -> bool:
    """True when any accepted answer appears in ``output`` (case-insensitive, on word boundaries)."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", output, flags=re.IGNORECASE) for a in answers)


def build_prompts(tokenizer, questions: list[str]) -> list[str]:
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions
        ]
    return [f"Question: {q}\nAnswer:" for q in questions]


def encode_batch(tokenizer, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded batch (generation appends on the right). Chat prompts already hold special tokens."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward and ``generate`` take a KV cache by: ``cache`` in transformers
    releases that renamed it, ``past_key_values`` before (the old name warns, then goes)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, repetition_penalty: float, *,
                     prompt_cache=None) -> list[str]:
    """Greedy answers for all prompts in one left-padded batch; decoding stops per sequence at EOS.

    ``generate`` runs one prefill over ``[B, L]`` (the longest prompt) and then up to ``max_new_tokens - 1``
    decode steps of ``[B, 1]`` each, until every sequence has ended. ``prompt_cache``: this model's
    ``agreement.prefill_prompts`` of the same batch, which ``generate`` continues from (one step of the
    prompts' last tokens instead of the prefill) and consumes. The answers equal those of one prompt at a
    time on CPU, and those without the cache (tests/test_eval_speed.py); nothing promises that on every
    backend, since padding and the batch size change the shapes of the matrix products."""
    from transformers import GenerationConfig

    if prompt_cache is None:
        batch = encode_batch(tokenizer, prompts)
        ids, mask, cache = batch["input_ids"], batch["attention_mask"], None
    else:
        if prompt_cache.cache is None:
            raise RuntimeError("this prompt cache was consumed by generation; prefill the prompts again")
        ids, mask, cache = prompt_cache.input_ids, prompt_cache.attention_mask, prompt_cache.cache
        prompt_cache.cache = None  # generate extends it in place
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        repetition_penalty=repetition_penalty,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    extra = {cache_keyword(model): cache} if cache is not None else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, **extra)
    new = out[:, ids.shape[1] :].cpu()
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def model_repetition_penalty(model) -> float:
    """The repetition penalty of the model's own generation config (1.0 when it sets none)."""
    gc = getattr(model, "generation_config", None)
    value = getattr(gc, "repetition_penalty", None) if gc is not None else None
    return float(value) if value else 1.0
