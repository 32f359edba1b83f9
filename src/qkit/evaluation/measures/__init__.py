"""qkit eval's metrics as registered measures (``base``: the ``Measure`` protocol, ``Evidence``, ``MEASURES``).

The built-in measures register themselves when this package is imported (``builtin``), in the order the
tables show them; a new metric is one class and one ``MEASURES.register`` line there, or in a module
imported below it (docs/architecture.md, "How to add a metric").
"""

from qkit.evaluation.measures.base import (
    MEASURES,
    Evidence,
    FrontierPanel,
    Measure,
    TokenMeasure,
    blank_values,
    estimate,
    fixed,
    fmt_change,
    fmt_estimate,
    fmt_number,
    json_fields,
    measure_values,
    measures,
    num,
    placed,
)

# isort: off
from qkit.evaluation.measures import builtin  # noqa: F401 (registers the built-in measures)
# isort: on

__all__ = ["MEASURES", "Evidence", "FrontierPanel", "Measure", "TokenMeasure", "blank_values", "estimate", "fixed",
           "fmt_change", "fmt_estimate", "fmt_number", "json_fields", "measure_values", "measures", "num", "placed"]
