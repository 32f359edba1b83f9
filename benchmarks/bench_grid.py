"""Benchmark: llama.cpp's grid i-quants (iq1_s ... iq3_s) in qkit against llama.cpp's C.

Run:  python benchmarks/bench_grid.py [--repeats 3] [--size 1536] [--types iq2_xxs,...] [--json PATH]

One random ``size x size`` fp32 matrix (seed 0, normal) and one importance vector (seed 1, ``U(0, 2)**3 +
1e-4``: every type is timed with it, since iq1_s, iq2_xxs and iq2_xs have no path without one). Each row is timed
round-robin (every row once per round, after a warm-up round that also compiles or loads the numba
kernel); times are medians over rounds. ``qkit``: ``get_scheme(T).encode(w, quant_weights=qw)`` with torch
at one thread (the kernel then runs on one); ``llama.cpp``: ``ggml_quantize_chunk`` of the reference library
built by ``benchmarks/build_llama_ref.py`` (one thread). The bytes of the two are compared too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from qkit.schemes import get_scheme

TYPES = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s")


def reference():
    spec = importlib.util.spec_from_file_location("build_llama_ref", Path(__file__).with_name("build_llama_ref.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--size", type=int, default=1536, help="the matrix is size x size (a multiple of 256)")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x = np.random.default_rng(0).standard_normal((args.size, args.size)).astype(np.float32)
    qw = ((np.random.default_rng(1).random(args.size) * 2.0) ** 3 + 1e-4).astype(np.float32)
    xt, qt = torch.from_numpy(x), torch.from_numpy(qw)
    ref = reference()
    fns = {}
    for name in [t.strip() for t in args.types.split(",") if t.strip()]:
        s = get_scheme(name)
        fns[f"qkit {name}"] = lambda s=s: s.encode(xt, quant_weights=qt)["qweight"].numpy()
        if ref is not None:
            fns[f"llama.cpp {name}"] = lambda t=s.ggml_type: ref.quantize(x, t, qw)
    out = {k: fn() for k, fn in fns.items()}  # warm-up (numba loads or compiles its kernel)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    print(f"{args.size} x {args.size} fp32, importance vector, one thread, median of {args.repeats} rounds; "
          f"llama.cpp reference {'built' if ref is not None else 'not built'}")
    rows = {}
    for label, t in times.items():
        name = label.split()[-1]
        row = {"median_s": statistics.median(t), "runs": t}
        other = f"llama.cpp {name}"
        if label.startswith("qkit") and other in times:
            row["x_llama_cpp"] = statistics.median(a / b for a, b in zip(t, times[other]))
            row["bytes_equal"] = bool(np.array_equal(out[label], out[other]))
        rows[label] = row
        extra = f"  {row['x_llama_cpp']:.2f}x llama.cpp, bytes equal: {row['bytes_equal']}" if "x_llama_cpp" in row else ""
        print(f"{label:20s} {row['median_s']:8.3f} s{extra}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"size": args.size, "repeats": args.repeats, "rows": rows},
                                                   indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
