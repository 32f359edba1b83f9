"""The planner on the default model: its time, its solver's time, and how well its prediction holds.

    python benchmarks/bench_plan.py [--format gguf] [--candidates LIST] [--budgets 4.25,4.5,...] [--json OUT]

1. **Time**: ``qkit.api.plan_model`` (the Fisher over the calibration windows, every candidate of every
   tensor, the exact solve, the measured check) from a cold start, against one plain forward pass over the
   same calibration tokens (the peer measured in the same run); the solver alone, median of 5.
2. **Prediction against measurement**: for each budget, and for each llama.cpp recipe of the ladder
   (their per-tensor types scored by the same table), the predicted KL (the sum of the tensors' diagonal-
   Fisher costs) beside the KL measured with that mix in the model on the check windows (calibration text);
   Pearson and Spearman correlation over all of them, and the worst ratio either way.

The default candidates exclude q4_1 and q5_1: the default model was published as Q4_1, so those two
reproduce its weights exactly and every plan would take them at zero cost (``qkit plan`` says so when it
happens); without them the plan has to trade types the way it would on any other model.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from qkit.api import plan_model
from qkit.models import read_config, resolve
from qkit.plan import PlanOptions, TensorChoice, check, planner, solve
from qkit.plan.planfile import Plan
from qkit.schemes import get_scheme

HONEST = "q2_k,q3_k,iq4_xs,iq4_nl,q4_0,q4_k,q5_0,q5_k,q6_k,q8_0"
LADDER = ("q2_k-llama", "q3_k_m", "q3_k_l", "iq4_xs-llama", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q8_0")


def recipe_plan(table, base: Plan, recipe: str, config: dict) -> Plan | None:
    """The recipe's per-tensor types, scored by the same table (None when a type is not a candidate)."""
    s = get_scheme(recipe).bind(config)
    tensors = {}
    for i, name in enumerate(table.names):
        t = s.resolve(tuple(table.shapes[name]), name).name
        j = next((k for k, c in enumerate(table.options[i]) if c.name == t), None)
        if j is None:
            return None
        c = table.options[i][j]
        tensors[name] = TensorChoice(c.name, c.scheme, tuple(table.shapes[name]), c.nbytes, table.costs[i][j])
    return Plan(base.model, base.model_fingerprint, base.format, base.method, {"scheme": recipe}, tensors)


def spearman(x, y) -> float:
    rx = torch.tensor(x).argsort().argsort().double()
    ry = torch.tensor(y).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="gguf")
    ap.add_argument("--candidates", default=HONEST, help="comma-separated; 'all' for the format's whole ladder")
    ap.add_argument("--budgets", default="4.25,4.5,4.75,5.0,5.534,6.0,7.0,8.0")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cands = () if args.candidates == "all" else tuple(args.candidates.split(","))
    ref = resolve(None)
    config = read_config(ref.directory)
    budgets = [float(b) for b in args.budgets.split(",")]

    # the peer: one plain forward pass over the same calibration tokens
    from qkit.methods.calibration import calibration_ids
    from qkit.models import load

    loaded = load(ref=ref, device="cpu")
    opts0 = PlanOptions(format=args.format, target_bits=budgets[0], candidates=cands)
    ids, _ = calibration_ids(loaded.tokenizer, opts0.calibration_options())
    with torch.inference_mode():
        t = time.perf_counter()
        for w in ids:
            loaded.model(input_ids=w[None], use_cache=False)
        forward = time.perf_counter() - t
    del loaded

    kept = planner.KeptMeasurements()  # the run's tables, passed to every plan below (measured once)
    t = time.perf_counter()
    first = plan_model(None, options=opts0, kept=kept).plan
    cold = time.perf_counter() - t
    table = next(iter(kept.tables.values()))
    sizes = [[c.nbytes for c in row] for row in table.options]
    solves = []
    for _ in range(5):
        t = time.perf_counter()
        solve(table.costs, sizes, first.target["budget_bytes"])
        solves.append(time.perf_counter() - t)

    points = []
    for b in budgets:
        p = first if b == budgets[0] else plan_model(None, options=PlanOptions(format=args.format, target_bits=b,
                                                                                 candidates=cands), kept=kept).plan
        points.append({"row": f"plan@{b}", "bits": p.bits_per_weight, "predicted": p.predicted_kl,
                       "measured": p.check["measured_kl"], "se": p.check["measured_kl_se"]})
    for recipe in LADDER:
        p = recipe_plan(table, first, recipe, config)
        if p is None:
            continue
        check(p, table, ref)
        points.append({"row": recipe, "bits": p.bits_per_weight, "predicted": p.predicted_kl,
                       "measured": p.check["measured_kl"], "se": p.check["measured_kl_se"]})
    pred = [q["predicted"] for q in points]
    meas = [q["measured"] for q in points]
    ratios = [a / m for a, m in zip(pred, meas) if m > 0]
    pearson = float(torch.corrcoef(torch.tensor([pred, meas]))[0, 1])
    out = {
        "plan_seconds": cold, "forward_seconds": forward, "plan_over_forward": cold / forward,
        "sensitivity_seconds": table.seconds, "solver_median_seconds": statistics.median(solves),
        "solver_states": first.solver["states"], "solver_unit": first.solver["unit"], "exact": first.solver["exact"],
        "points": points, "pearson": pearson, "spearman": spearman(pred, meas),
        "ratio_min": min(ratios), "ratio_max": max(ratios), "candidates": list(cands) or "all",
        "threads": torch.get_num_threads(),
    }
    print(f"plan (cold): {cold:.1f} s  (Fisher {table.seconds['fisher']:.1f} s, candidates {table.seconds['candidates']:.1f} s); "
          f"one forward over the same {ids.numel():,} tokens {forward:.1f} s; solver alone {1000 * out['solver_median_seconds']:.1f} ms "
          f"median of 5 ({out['solver_states']:,} states of {out['solver_unit']} bytes, exact={out['exact']})")
    print(f"{'row':<16}{'bits/w':>8}{'predicted KL':>14}{'measured KL':>18}{'ratio':>8}")
    for q in points:
        print(f"{q['row']:<16}{q['bits']:>8.3f}{q['predicted']:>14.5f}{q['measured']:>11.5f} ± {q['se']:.5f}"
              f"{(q['predicted'] / q['measured'] if q['measured'] > 0 else math.nan):>8.2f}")
    print(f"Pearson {pearson:.3f}, Spearman {out['spearman']:.3f}, predicted/measured from {out['ratio_min']:.2f} to "
          f"{out['ratio_max']:.2f} ({len(points)} mixes, measured on {first.check['positions']:,} calibration positions)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
