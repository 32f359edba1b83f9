"""Seconds and peak RSS per step of qkit on the default model and synthetic 0.5B/1.5B/7B-shaped llamas in
bf16 (docs/scale.md).

    python benchmarks/bench_scale.py [--shapes default,0.5b,1.5b,7b,7b-2l]
        [--steps plan,quantize,rtn,imatrix,rtn-imatrix,ct,gptq,awq]
        [--samples 4] [--seqlen 256] [--candidates q4_0,q4_k,q6_k,q8_0,none] [--headroom 3GiB | --max-memory SIZE]
        [--dir /tmp] [--json OUT] [--keep-going] [--src DIR]

Each synthetic model is written by ``benchmarks/bench_eval_memory.py``'s writer (random normal weights, one
shard in memory at a time) in bf16 with the default model's tokenizer (vocabulary 49,152), to a temporary
directory under ``--dir`` removed afterwards. The default model is the pinned one as qkit resolves it
(SmolLM2-135M, dequantized to fp32 on disk), loaded in bf16 for the plan.

Steps, each in its own child process (peak RSS: that child's ``ru_maxrss`` from ``wait4``; seconds: the wall
clock, which includes the imports):

- ``plan``: ``qkit plan MODEL --format gguf --target-bits 4.5 --dtype bf16 --calibration-samples N
  --calibration-seqlen L --check-windows 1 --candidates LIST --max-memory M``, with ``M`` the issue's target,
  the bf16 weights + ``--headroom`` (3 GiB), unless ``--max-memory`` gives it.
- ``quantize``: ``qkit quantize MODEL --plan plan.json --format gguf -o model.gguf``.
- ``rtn``: ``qkit quantize MODEL -s q4_k_m --format gguf -o rtn.gguf`` (streamed, no plan).
- ``imatrix``: ``qkit imatrix MODEL --dtype bf16 --chunks N --chunk-size L -o imatrix.gguf``.
- ``rtn-imatrix``: ``qkit quantize MODEL -s q4_k_m --format gguf --imatrix imatrix.gguf -o rtn-imatrix.gguf``
  (streamed, the matrix the ``imatrix`` step wrote earlier in the same ``--steps``).
- ``ct``: ``qkit quantize MODEL -s int4-g64 --scale-dtype bf16 --format compressed-tensors -o ct`` (streamed; g64
  divides the default model's 576; bf16 scales, which a bf16 checkpoint's dtype holds).
- ``gptq``: ``qkit quantize MODEL -s q4_k_m --format gguf --method gptq --dtype bf16 --calibration-samples N
  --calibration-seqlen L -o gptq.gguf``.
- ``awq``: ``qkit quantize MODEL -s int4-g128 --method awq --calibration-samples N --calibration-seqlen L -o awq``
  (the bf16 file mapped, each block upcast to fp32 while it is processed).

Each row also gets ``seconds / (params x tokens)`` (ns per parameter and calibration token) for the steps
that run the model on the calibration tokens (plan, imatrix, gptq), the ratio to compare across sizes.

``--src DIR`` runs another qkit tree's steps (``PYTHONPATH=DIR``: an earlier commit unpacked by ``git archive``),
for a before/after on the same machine.

A shape whose bf16 weights + headroom exceed ``MemAvailable``, or whose files do not fit in ``--dir``, is
refused before it is written (``--keep-going`` skips it and goes on).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_plan_memory", ROOT / "benchmarks" / "bench_plan_memory.py")
bpm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bpm)
bem = bpm.bem
GIB = 1 << 30

# llama-style shapes with the default tokenizer's vocabulary; heads of 64 (kv = heads: no GQA)
SHAPES = {
    "0.5b": dict(hidden=1024, intermediate=4096, layers=24, heads=16, kv_heads=16),  # 0.50B parameters
    "1.5b": dict(hidden=2048, intermediate=5632, layers=24, heads=32, kv_heads=32),  # 1.43B
    "7b": bem.SHAPE_7B,  # llama-2-7b's: 6.88B with this vocabulary
    # 7B's widths with 2 layers (0.81B): one 7B block's working set (GPTQ's Gram of down_proj's 11,008 inputs,
    # its factor, the column loop's copies) in minutes; the peak above the weights is the 7B run's, less
    # what grows with the layer count (the quantized parts held until the write)
    "7b-2l": {**bem.SHAPE_7B, "layers": 2},
}


STEPS = ("plan", "quantize", "rtn", "imatrix", "rtn-imatrix", "ct", "gptq", "awq")
STREAMED = ("quantize", "rtn", "rtn-imatrix", "ct")  # one tensor at a time: no calibration tokens


def parameters(vocab: int, **shape) -> int:
    return sum(math.prod(s) for _, s in bem.layout(**shape, vocab=vocab))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="default,0.5b,1.5b")
    ap.add_argument("--steps", default="plan,quantize", help=f"of {', '.join(STEPS)}")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--candidates", default="q4_0,q4_k,q6_k,q8_0,none")
    ap.add_argument("--headroom", default="3GiB", help="the plan's --max-memory is the bf16 weights + this")
    ap.add_argument("--max-memory", default=None, help="the plan's --max-memory instead")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep-going", action="store_true")
    ap.add_argument("--src", type=Path, default=None, help="another qkit tree's src/ to run (PYTHONPATH)")
    args = ap.parse_args()
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown or ("rtn-imatrix" in steps and "imatrix" not in steps[: steps.index("rtn-imatrix")]):
        sys.exit(f"--steps: unknown {', '.join(unknown)} (of {', '.join(STEPS)})" if unknown else
                 "--steps: rtn-imatrix needs the imatrix step before it")

    from qkit.checkpoint import tensor_shapes
    from qkit.memory import parse_size
    from qkit.models import resolve

    headroom = parse_size(args.headroom, "--headroom")
    tok_dir = resolve(None).directory
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    imports = bpm.imports_peak()
    print(f"imports alone: peak RSS {imports / GIB:.2f} GiB", flush=True)
    results = []
    for name in args.shapes.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"qkit-scale-{name}-", dir=args.dir))
        try:
            if name == "default":
                model, shape = tok_dir, {}
                params = sum(math.prod(s) for _, s in tensor_shapes(model))
            else:
                shape = SHAPES[name]
                params = parameters(vocab, **shape)
                need, avail, free = 2 * params + headroom, bem.mem_available(), shutil.disk_usage(args.dir).free
                why = (f"MemAvailable {avail / GIB:.1f} GiB < bf16 weights + headroom {need / GIB:.1f} GiB" if avail < need else
                       f"{args.dir} has {free / GIB:.1f} GiB free < {3 * params / GIB:.1f} GiB" if free < 3 * params else None)
                if why:
                    if not args.keep_going:
                        sys.exit(f"refused {name}: {why}")
                    print(f"skipped {name}: {why}")
                    continue
                model = work / "model"
                bpm.write_model(model, dtype="bf16", **shape)
            bf16 = 2 * params
            budget = args.max_memory or str(bf16 + headroom)
            plan = work / "plan.json"
            for step in steps:
                if step == "plan":
                    argv = bpm.plan_argv(model, plan, samples=args.samples, seqlen=args.seqlen, check_windows=1, dtype="bf16",
                                         max_memory=budget, extra=["--candidates", args.candidates])
                elif step == "quantize":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "--plan", str(plan), "--format", "gguf",
                            "-o", str(work / "model.gguf")]
                elif step == "rtn":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "-s", "q4_k_m", "--format", "gguf",
                            "-o", str(work / "rtn.gguf")]
                elif step == "imatrix":
                    argv = [sys.executable, "-m", "qkit", "imatrix", str(model), "--dtype", "bf16", "--chunks",
                            str(args.samples), "--chunk-size", str(args.seqlen), "-o", str(work / "imatrix.gguf")]
                elif step == "rtn-imatrix":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "-s", "q4_k_m", "--format", "gguf",
                            "--imatrix", str(work / "imatrix.gguf"), "-o", str(work / "rtn-imatrix.gguf")]
                elif step == "ct":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "-s", "int4-g64", "--scale-dtype", "bf16",
                            "--format", "compressed-tensors", "-o", str(work / "ct")]
                elif step == "gptq":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "-s", "q4_k_m", "--format", "gguf",
                            "--method", "gptq", "--dtype", "bf16", "--calibration-samples", str(args.samples),
                            "--calibration-seqlen", str(args.seqlen), "-o", str(work / "gptq.gguf")]
                elif step == "awq":
                    argv = [sys.executable, "-m", "qkit", "quantize", str(model), "-s", "int4-g128", "--method", "awq",
                            "--calibration-samples", str(args.samples), "--calibration-seqlen", str(args.seqlen),
                            "-o", str(work / "awq")]
                else:
                    raise AssertionError(step)
                print(f"{name}: qkit {' '.join(argv[argv.index('-m') + 2:])}", flush=True)
                r = bpm.run_child(argv, src=args.src, log=work / f"{step}.log")
                row = {"shape": name, **shape, "parameters": params, "bf16_bytes": bf16, "step": step, "seconds": r["seconds"],
                       "peak_rss": r["peak_rss"], "exit_code": r["exit_code"],
                       "command": "qkit " + " ".join(argv[argv.index("-m") + 2:]),
                       **({"src": str(args.src)} if args.src else {})}
                if step not in STREAMED:  # the steps that run the model over the calibration tokens
                    row["ns_per_param_token"] = 1e9 * r["seconds"] / (params * args.samples * args.seqlen)
                if step == "plan" and plan.is_file():
                    doc = json.loads(plan.read_text())
                    row["memory"] = doc["sensitivity"].get("memory")
                    row["sensitivity_seconds"] = doc["sensitivity"].get("seconds")
                    row["target"] = bf16 + headroom
                if r["exit_code"]:
                    row["error"] = (work / f"{step}.log").read_text().strip().splitlines()[-3:]
                results.append(row)
                mem = row.get("memory") or {}
                print(f"  {step}: exit {r['exit_code']}, {r['seconds']:.0f} s, peak RSS {r['peak_rss'] / GIB:.2f} GiB "
                      f"(bf16 weights {bf16 / GIB:.2f} GiB; peak - weights {(r['peak_rss'] - bf16) / GIB:.2f} GiB)"
                      + (f"; the Fisher {mem.get('fisher', 'in groups')}: {mem.get('passes', mem.get('groups'))} passes, "
                         f"{mem.get('groups')} groups held, estimated {mem.get('estimated_peak_bytes', 0) / GIB:.2f} GiB "
                         f"of {mem.get('budget_bytes', 0) / GIB:.2f}" if mem else "")
                      + (f"; {row['ns_per_param_token']:.3f} ns per parameter x token" if "ns_per_param_token" in row else "")
                      + (f"; {row['error']}" if r["exit_code"] else ""), flush=True)
                if r["exit_code"]:
                    break
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"imports": imports, "rows": results}, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
