"""Evaluation: perplexity on a pinned corpus, a factual battery, greedy agreement, KL divergence."""

from qkit.evaluation.runner import EvalOptions, EvalReport, Row, evaluate

__all__ = ["EvalOptions", "EvalReport", "Row", "evaluate"]
