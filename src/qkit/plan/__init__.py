"""The planner: the best mix of types for a byte budget, from measured per-tensor sensitivity.

``candidates`` (what each format can store a tensor as, and its exact bytes), ``sensitivity`` (the
diagonal-Fisher estimate of each candidate's damage), ``solve`` (the exact multiple-choice knapsack),
``planfile`` (the plan JSON) and ``planner`` (the steps together). ``qkit.api.plan_model`` and
``qkit plan`` wrap them; ``qkit quantize --plan`` writes what a plan chose.

Layer 5b: above ``methods`` (the importance matrix, the calibration text) and ``export`` (each format's
exact stored bytes, ``candidates``), below ``evaluation`` (plan rows) and ``api``. It is its own package,
not part of ``methods``: a method chooses the integers and scales of a scheme it is given and knows no file
format, while the planner chooses each tensor's scheme from the formats' stored bytes and runs methods to
cost the candidates; inside ``methods`` it would lift the methods' package above ``export``.
"""

from qkit.plan.candidates import (
    KEEP,
    Candidate,
    candidates,
    check_format,
    ladder,
    parse_allowed,
    plan_format,
    plan_formats,
)
from qkit.plan.planfile import (
    Plan,
    TensorChoice,
    check_plan_matches,
    is_plan_file,
    read_plan,
    write_plan,
)
from qkit.plan.planner import (
    KeptMeasurements,
    Table,
    check,
    choose,
    planned_targets,
    precheck,
    sensitivity_table,
)
from qkit.plan.planfile import base_type, upgrades
from qkit.plan.budget import budget_bytes
from qkit.plan.options import PlanOptions
from qkit.plan.solve import Solution, solve

__all__ = ["KEEP", "Candidate", "Plan", "PlanOptions", "Solution", "Table", "TensorChoice", "base_type",
           "KeptMeasurements", "budget_bytes", "candidates", "check", "check_format", "check_plan_matches", "choose", "is_plan_file",
           "ladder", "parse_allowed", "plan_format", "plan_formats", "planned_targets", "precheck", "read_plan", "sensitivity_table", "solve", "upgrades", "write_plan"]
