"""Evaluation: perplexity on a pinned corpus, a factual battery, greedy agreement, KL divergence.

Layer 6: above ``methods``, ``simulate`` and ``export`` (layer 5), below ``inspect``, ``api`` and ``cli``
(layer 7). ``rows`` registers the named rows and presets into ``specs`` when the package is imported.
"""

from qkit.evaluation import rows  # noqa: F401 (registers the named rows and presets)
from qkit.evaluation.options import EvalOptions
from qkit.evaluation.report import EvalReport, Row
from qkit.evaluation.runner import evaluate

__all__ = ["EvalOptions", "EvalReport", "Row", "evaluate"]
