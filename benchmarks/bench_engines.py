"""What an engine row costs against a torch row, on the default model (``qkit eval --runtime torch,ENGINE``).

    python benchmarks/bench_engines.py [--engine llama.cpp] [--schemes q8_0] [--tokens 2048] [--repeats 3] [--json PATH]

Runs ``qkit.evaluation.evaluate`` with ``--runtime torch,ENGINE`` ``--repeats`` times (each a fresh eval: the
reference is loaded and measured each time) and reports, per scheme, the median over the repeats of:

* **torch row**: ``Row.seconds`` (quantize + swap + score + battery + agreement), of which
  ``Row.build_seconds`` quantizing and swapping, the rest (**torch measure**) scoring, the battery and
  agreement on the loaded model;
* **engine row**: ``Row.seconds`` (write the row's file + start the worker + load + measure), of which
  ``build_seconds`` writing the file, ``engine.load_seconds`` the engine loading it and
  ``engine.run_seconds`` scoring, generating and agreement in the engine once loaded;
* the ratios **engine run / torch measure** (the issue's target: at most 2x once the model is loaded) and
  **engine row / torch row**.

The engine's reference row is reported the same way (its file is the unquantized GGUF). The machine's
load (other processes) moves every figure: the script prints ``os.getloadavg()`` before and after.
Skips (one line, exit 0) when the engine is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from qkit.errors import QkitError
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.engines import EngineOptions, get_engine


def one_run(engine: str, schemes: tuple[str, ...], tokens: int) -> dict:
    report = evaluate(None, options=EvalOptions(schemes=schemes, runtimes=("torch", engine), tokens=tokens))
    rows = {r.scheme: r for r in report.rows}
    out = {}
    for name in ("reference", *schemes):
        t, e = rows[name], rows[f"{name} [{get_engine(engine).name}]"]
        if e.refused is not None:
            out[name] = {"refused": e.refused}
            continue
        build = t.build_seconds or 0.0
        out[name] = {
            "torch_row": t.seconds, "torch_build": build, "torch_measure": t.seconds - build,
            "engine_row": e.seconds, "engine_build": e.build_seconds, "engine_load": e.engine["load_seconds"],
            "engine_run": e.engine["run_seconds"], "version": e.engine["version"],
            "perplexity_torch": t.perplexity, "perplexity_engine": e.perplexity,
        }
    out["_scored_tokens"] = report.provenance["scored_tokens"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="llama.cpp")
    ap.add_argument("--schemes", default="q8_0")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    try:
        get_engine(args.engine).check_available(EngineOptions())
    except QkitError as e:
        print(f"skipped: {e}")
        return 0
    load_before = os.getloadavg()
    runs = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        runs.append(one_run(args.engine, schemes, args.tokens))
        print(f"run {i + 1}/{args.repeats}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    doc = {"engine": args.engine, "tokens": args.tokens, "scored_tokens": runs[0]["_scored_tokens"],
           "repeats": args.repeats, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
           "loadavg_before": load_before, "loadavg_after": load_after,
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": {}}
    keys = ("torch_row", "torch_build", "torch_measure", "engine_row", "engine_build", "engine_load", "engine_run")
    print(f"{args.engine} against torch, {doc['scored_tokens']} scored tokens, median of {args.repeats}, "
          f"{doc['threads']} threads (load average {load_before[0]:.1f} -> {load_after[0]:.1f})")
    print(f"{'row':<12}" + "".join(f"{k:>15}" for k in keys) + f"{'run/measure':>13}{'row/row':>9}")
    for name in ("reference", *schemes):
        if "refused" in runs[0][name]:
            doc["rows"][name] = runs[0][name]
            print(f"{name:<12} not run: {runs[0][name]['refused']}")
            continue
        med = {k: statistics.median(r[name][k] for r in runs) for k in keys}
        med["run_over_measure"] = med["engine_run"] / med["torch_measure"]
        med["row_over_row"] = med["engine_row"] / med["torch_row"]
        med["version"] = runs[0][name]["version"]
        med["perplexity_torch"], med["perplexity_engine"] = runs[0][name]["perplexity_torch"], runs[0][name]["perplexity_engine"]
        doc["rows"][name] = med
        print(f"{name:<12}" + "".join(f"{med[k]:>14.2f}s" for k in keys)
              + f"{med['run_over_measure']:>12.2f}x{med['row_over_row']:>8.2f}x")
    print("torch_row of the reference: measuring only (it is loaded once, before the rows); build: quantize + swap "
          "(torch) or writing the file (engine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
