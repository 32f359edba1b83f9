"""Benchmark: what the written-tensor check (``qkit.schemes.fidelity.check_written``) costs beside the quantize.

Run:  python benchmarks/bench_fidelity.py [--repeats 5] [--threads 1] [--schemes q4_k,q8_0,...] [--json PATH]

On the default model's 210 block projections (fp32, loaded once), per scheme, in the same run and round
robin (``_timing.round_robin``): ``quantize_tensor`` over every matrix, and ``check_written`` of each result
against its source (the llama.cpp types decode a slice of rows at a time; the others decode whole). The
medians and the check's share of quantize + check are printed: the cost every written tensor now pays
before a writer stores it. Also the largest relative error each scheme's RTN gives (what the check's limit
of 1 is measured against; docs/guarantees.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
from _timing import round_robin

from qkit.checkpoint import iter_tensors
from qkit.models import resolve
from qkit.schemes import Recipe, get_scheme, quantize_tensor, scheme_names
from qkit.schemes.fidelity import check_written
from qkit.transform import is_block_projection


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schemes", default=None, help="comma-separated (default: every scheme that is not a recipe)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        print("error: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    names = args.schemes.split(",") if args.schemes else [n for n in scheme_names() if not isinstance(get_scheme(n), Recipe)]
    directory = resolve(None).directory
    weights = [(n, t.float()) for n, t in iter_tensors(directory) if is_block_projection(n, tuple(t.shape))]
    rows = {}
    for name in names:
        scheme = get_scheme(name)
        quantized = [(n, t, quantize_tensor(t, scheme, name=n)) for n, t in weights]
        worst = max(check_written(n, t, qt) for n, t, qt in quantized)
        times = round_robin({"quantize": lambda s=scheme: [quantize_tensor(t, s, name=n) for n, t in weights],
                             "check": lambda q=quantized: [check_written(n, t, qt) for n, t, qt in q]}, args.repeats)
        q, c = statistics.median(times["quantize"]), statistics.median(times["check"])
        rows[name] = {"quantize_s": q, "check_s": c, "check_share": c / (q + c), "max_relative_error": worst}
        print(f"{name:12s} quantize {q:7.3f} s  check {c:7.3f} s  check / (quantize + check) {c / (q + c):5.1%}  "
              f"max rel error {worst:.3f}", flush=True)
    record = {"matrices": len(weights), "threads": args.threads, "repeats": args.repeats,
              "cpu": platform.processor() or platform.machine(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
