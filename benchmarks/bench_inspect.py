"""Benchmark: ``qkit inspect errors`` over all six schemes of the default model, against peers.

Run:  QKIT_CACHE=... python benchmarks/bench_inspect.py [--repeats 3] [--threads N] [--json PATH]

Measured in the same run, round robin (every row once per round, so that all rows see the same load on a
shared machine), medians of ``--repeats`` rounds after one warm-up round:

* ``qkit.inspect.weight_errors`` over the 210 block projections and all six schemes (the whole command's
  work: streaming reads, statistics, quantize + dequantize, float64 norms);
* peer "stream + norm": stream every projection from the memory-mapped checkpoint and take its float64
  norm (the floor of any per-matrix streaming pass);
* peer "quantize + dequantize only": ``quantize_tensor(...).dequantize()`` for all six schemes on matrices
  already in memory (what the transform alone costs; the rest of ``weight_errors`` is overhead).

Target (from the project's issue): ``qkit inspect errors`` over all six schemes under 30 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from _timing import round_robin

from qkit.inspect.errors import iter_projections, weight_errors
from qkit.models import resolve
from qkit.schemes import DEFAULT_SCHEMES, get_scheme, quantize_tensor

TARGET_S = 30.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = resolve(None)
    schemes = [get_scheme(s) for s in DEFAULT_SCHEMES]
    mats = [(n, t.clone()) for n, t in iter_projections(ref.directory)]

    def stream_norm():
        return [float(torch.linalg.vector_norm(w, dtype=torch.float64)) for _, w in iter_projections(ref.directory)]

    def transform_only():
        for _, w in mats:
            for s in schemes:
                quantize_tensor(w, s).dequantize(torch.float32)

    fns = {
        "qkit inspect errors (6 schemes)": lambda: weight_errors(ref=ref),
        "peer: stream + float64 norm": stream_norm,
        "peer: quantize + dequantize only": transform_only,
    }
    times = round_robin(fns, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    main_label = next(iter(fns))
    print(f"{len(mats)} matrices, {sum(w.numel() for _, w in mats):,} weights, {len(schemes)} schemes, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    for label, m in med.items():
        ratio = med[main_label] / m
        print(f"  {label:<36} {m:8.2f} s   (inspect errors / this: {ratio:5.2f}x)")
    ok = med[main_label] < TARGET_S
    print(f"target: under {TARGET_S:.0f} s -> {'ok' if ok else 'MISSED'} ({med[main_label]:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": med, "times_s": times, "target_s": TARGET_S, "ok": ok}, f, indent=2, sort_keys=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
