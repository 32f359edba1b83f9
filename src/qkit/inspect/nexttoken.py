"""The next-token distribution after a text, at several temperatures: the soft labels distillation trains on.

For the logits ``z [V]`` at the last position and a temperature ``T``::

    p_T = softmax(z / T)          (fp64)
    ratio_T = p_T[first] / p_T[third] = exp((z_first - z_third) / T)

so ``ratio_2 = sqrt(ratio_1)``: doubling the temperature takes the square root of every probability ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit.bounds import MAX_COUNT, real, whole
from qkit.errors import InputError
from qkit.inspect.outliers import check_context, encode, model_context
from qkit.lists import split_list
from qkit.models import LoadedModel, load, parse_device

TOP = 5
TEMPERATURES = (1.0, 2.0)
# logits / T stay finite in fp64 and softmax defined: 1e-320 made every logit infinite
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3


def parse_temperatures(value: str | Sequence[float]) -> list[float]:
    """``"1,2"`` or ``[1, 2]`` -> ``[1.0, 2.0]``; each must be a positive number."""
    items = split_list(value, "--temperature", what="temperature", where="e.g. 1,2") if isinstance(value, str) else list(value)
    try:
        temps = [float(t) for t in items]
    except ValueError as exc:
        raise InputError(f"--temperature takes comma-separated positive numbers such as 1,2; got {value!r}") from exc
    if not temps or any(not t > 0 for t in temps):
        raise InputError(f"--temperature takes comma-separated positive numbers such as 1,2; got {value!r}")
    return [real(t, "--temperature", MIN_TEMPERATURE, MAX_TEMPERATURE) for t in temps]


def top_k_at(logits: torch.Tensor, k: int, temperature: float) -> tuple[list[int], list[float]]:
    """``logits [V]`` -> the ``k`` most likely ids and their probabilities under ``softmax(z / T)`` (fp64)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    probs, ids = p.topk(k)
    return ids.tolist(), probs.tolist()


@dataclass
class NextTokenReport:
    model: str
    text: str
    top: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per temperature

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_options(*, top: int = TOP, temperatures: Sequence[float] | str = TEMPERATURES, device: str | None = None) -> list[float]:
    """Every check of ``next_token``'s options (none needs the model); returns the temperatures."""
    temps = parse_temperatures(temperatures)
    if top < 3:
        raise InputError(f"--top must be at least 3 (the ratio compares the first and the third), got {top}")
    whole(top, "--top", 3, MAX_COUNT)
    parse_device(device)
    return temps


def next_token(
    model: str | Path | None = None,
    *,
    text: str,
    top: int = TOP,
    temperatures: Sequence[float] | str = TEMPERATURES,
    device: str | None = None,
    loaded: LoadedModel | None = None,
) -> NextTokenReport:
    """Top-``top`` next-token probabilities after ``text`` at each temperature, and the first/third ratio."""
    temps = check_options(top=top, temperatures=temperatures, device=device if loaded is None else None)
    loaded = loaded or load(model, device=device)
    lm = loaded.model
    ids = encode(loaded.tokenizer, text, what="TEXT")
    check_context(ids.shape[1], model_context(lm), "TEXT", loaded.ref.spec)  # before the forward pass
    ids = ids.to(next(lm.parameters()).device)
    with torch.no_grad():
        logits = lm(ids, use_cache=False).logits[0, -1].float().cpu()
    top = min(top, logits.numel())
    report = NextTokenReport(loaded.ref.spec, text, top)
    for t in temps:
        token_ids, probs = top_k_at(logits, top, t)
        report.rows.append(
            {
                "temperature": t,
                "tokens": [
                    {"id": i, "token": loaded.tokenizer.decode([i]), "prob": p} for i, p in zip(token_ids, probs)
                ],
                "ratio_first_third": probs[0] / probs[2] if probs[2] > 0 else float("inf"),
            }
        )
    return report
