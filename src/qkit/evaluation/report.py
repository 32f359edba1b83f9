"""What ``qkit eval`` returns: one ``Row`` per table row and the ``EvalReport`` holding them.

Layer 6 (``evaluation``): plain values, below the runner that fills them and the notes that read them.
The built-in measures' numbers (``evaluation.measures``) have ``Row`` fields of their names, which the JSON
and the tests have always read; a measure registered since writes into ``Row.measures``, and a row's JSON
holds both side by side (``Row.values``), so the table, the JSON and the report read every measure alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Row:
    scheme: str  # the row's name (RowSpec.name)
    bits_per_weight: float
    size_bytes: int
    perplexity: float
    perplexity_se: float
    perplexity_change_pct: float
    perplexity_change_se_pct: float
    kld: float
    kld_se: float
    top1_match: float
    battery_correct: int
    battery_total: int
    battery_ci95: tuple[float, float]
    battery_answers: list[bool]
    battery_outputs: list[str]
    mcnemar_only_reference: int
    mcnemar_only_row: int
    mcnemar_p: float
    agreement: int
    agreement_total: int
    agreement_ci95: tuple[float, float]
    seconds: float
    matrices: int
    spec: dict = field(default_factory=dict)  # RowSpec.to_dict(): storage scheme, method, simulation
    act_bits: int | None = None  # activation bits simulated at run time (None: unquantized)
    kv_bits: int | None = None  # KV-cache bits simulated at run time (None: the model's dtype)
    simulation_stats: dict = field(default_factory=dict)  # e.g. LLM.int8's share of 16-bit columns per layer
    weights_changed: int | None = None  # quantized tensors whose values differ from the reference's
    method_record: dict = field(default_factory=dict)  # what the method did (calibration, per-layer errors)
    llama_kl: dict = field(default_factory=dict)  # llama-perplexity --kl-divergence's statistics (klstats)
    plan: dict = field(default_factory=dict)  # a planned row's plan (Plan.record: target, bytes, predicted KL, check)
    # a calibrated row against the same scheme with rtn, when both are in the table (paired, same positions):
    # against, kld_change, kld_change_se, perplexity_change_pct, perplexity_change_se_pct
    versus: dict = field(default_factory=dict)
    # Where the row was measured (``qkit.evaluation.engines``): "torch", "vllm", "llama.cpp".
    runtime: str = "torch"
    # An engine row's facts: version, load_seconds, run_seconds, the file it loaded (format), what the
    # engine said (notes), and which statistics it could give (full_distribution: KL and top-1 need it).
    engine: dict = field(default_factory=dict)
    refused: str | None = None  # the engine could not run this row: its reason, in one line (no numbers then)
    # an engine row against the torch row of the same spec (paired, same positions): against,
    # perplexity_change_pct, perplexity_change_se_pct, and kld_change, kld_change_se where KL exists
    versus_torch: dict = field(default_factory=dict)
    # seconds of ``seconds`` spent writing the row's weights (quantize_model, or the engine's file): the
    # rest is measuring. None for a row that writes nothing (the torch reference, a saved checkpoint).
    build_seconds: float | None = None
    # an eval suite's domains (qkit.evaluation.domains.domain_rows): each one's perplexity, change against the
    # reference with its paired SE, KL and top-1, as if it were the only text; [] for one text. The row's own
    # corpus numbers above pool every domain's positions; the table's headline is the worst domain.
    domains: list = field(default_factory=list)
    # the values of measures without a field above (``evaluation.measures``: e.g. ``kld_p99``), by JSON key
    measures: dict = field(default_factory=dict)

    @classmethod
    def build(cls, **values: Any) -> Row:
        """A row from ``values``: each a field of that name, the rest (other measures' keys) into ``measures``."""
        own = {k: v for k, v in values.items() if k in _FIELDS}
        return cls(**own, measures={k: v for k, v in values.items() if k not in _FIELDS})

    def values(self) -> dict[str, Any]:
        """Every field and every measure's value by its JSON key, as the row's JSON holds them (NaN kept)."""
        out = asdict(self)
        extra = out.pop("measures")
        return {**out, **extra}


_FIELDS = frozenset(f.name for f in fields(Row)) - {"measures"}


@dataclass
class EvalReport:
    rows: list[Row]
    provenance: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-able; a number that could not be computed (NaN, inf) is ``None`` (``null``: JSON has no NaN, and
        a reader must not take it for a value)."""
        return _finite({"rows": [r.values() for r in self.rows], "provenance": self.provenance, "notes": self.notes})


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


__all__ = ["EvalReport", "Row"]
