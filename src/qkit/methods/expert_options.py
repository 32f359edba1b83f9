"""What the methods that fit each expert of a mixture-of-experts model to the tokens routed to it (gptq, awq)
share: the ``--min-expert-tokens`` option (``ExpertOptions``), the test of an expert matrix calibrated on too few
tokens (``few_tokens``), and the record's per-expert token counts (``experts_record``). The routing itself is
``qkit.methods.experts``; docs/moe.md.

Layer 5 (``methods``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qkit.bounds import MAX_COUNT, whole
from qkit.llama_names import expert_index

DEFAULT_MIN_EXPERT_TOKENS = 128  # an expert matrix calibrated on fewer tokens is written by rtn (gptq, awq)


@dataclass(frozen=True)
class ExpertOptions:
    """The option of the methods that fit each expert to the tokens routed to it (gptq, awq):
    ``min_expert_tokens``, below which an expert matrix is written by rtn instead (``few_tokens``)."""

    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS

    def check_experts(self) -> None:
        whole(self.min_expert_tokens, "--min-expert-tokens", 0, MAX_COUNT)


def few_tokens(name: str, tokens: int, options: ExpertOptions) -> bool:
    """Whether ``name`` (a stored tensor name) is an expert matrix calibrated on too few tokens to be fitted to
    them: none at all, or fewer than ``options.min_expert_tokens``; such a matrix is written by rtn."""
    return expert_index(name) is not None and (tokens == 0 or tokens < options.min_expert_tokens)


def expert_of(name: str) -> str | None:
    """The expert a stored expert matrix belongs to (``model.layers.0.mlp.experts.3.up_proj.weight`` ->
    ``model.layers.0.mlp.experts.3``: ``routed_tokens``' keys); None for another tensor."""
    return name.rsplit(".", 2)[0] if expert_index(name) is not None else None


def experts_record(options: Any, routed: Mapping[str, int], calibrated_on: Mapping[str, int],
                   fallback: Iterable[str]) -> dict[str, Any]:
    """A mixture-of-experts model's part of a routed method's record: per expert the tokens the router sent it
    (``routed``, by ``expert_of``'s name) and those its statistics were taken on (``calibrated_on``: all of them
    with ``calibrate_all_experts``), and the expert matrices written by rtn instead (``fallback``)."""
    return {
        "calibrate_all_experts": options.calibrate_all_experts,
        "min_expert_tokens": options.min_expert_tokens,
        "tokens": {e: {"routed": n, "calibrated_on": calibrated_on.get(e, 0)} for e, n in sorted(routed.items())},
        "rtn_fallback": sorted(fallback),
    }


__all__ = ["DEFAULT_MIN_EXPERT_TOKENS", "ExpertOptions", "expert_of", "experts_record", "few_tokens"]
