"""Peak memory of ``qkit plan`` on a synthetic llama, against its weights and the plan's own estimate
(docs/plan-measurements.md, Memory).

    python benchmarks/bench_plan_memory.py [--layers 8] [--hidden 1024] [--intermediate 2816] [--dtype fp32]
        [--samples 8] [--seqlen 256] [--max-memory SIZE] [--src DIR] [--dir /tmp] [--json OUT]

The model: random weights written by ``benchmarks/bench_eval_memory.py``'s writer (one shard in memory at
a time) in ``--dtype``, with the default model's tokenizer (vocabulary 49,152), to a temporary directory
under ``--dir`` removed afterwards. ``qkit plan MODEL --format gguf --target-bits 4.5 --calibration-samples
8 --calibration-seqlen 256 --check-windows 2 --dtype DTYPE [--max-memory SIZE]`` then runs in a child
process; its peak resident memory is the child's own high-water mark (``VmHWM`` at its exit, see
``PEAK_CODE`` for why not ``ru_maxrss``), and is sampled along the way from ``/proc/PID/status``. The imports alone (python, torch, transformers, qkit) are measured in another child
and reported beside it. ``--src DIR`` runs another qkit tree's ``qkit plan`` (``PYTHONPATH=DIR``: e.g. an
earlier commit unpacked by ``git archive``), for a before/after; ``--dtype``/``--max-memory`` are then not
passed to it when it is older than them (``--old``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_eval_memory", ROOT / "benchmarks" / "bench_eval_memory.py")
bem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bem)
GIB = 1 << 30
DTYPES = ("fp32", "bf16")


def write_model(directory: Path, *, dtype: str, **shape) -> int:
    """A random llama of ``shape`` in ``dtype`` with the default model's tokenizer; its bytes."""
    import torch

    from qkit.models import resolve

    tokenizer_dir = resolve(None).directory
    src = json.loads((tokenizer_dir / "config.json").read_text())
    extra = {"rope_theta": 10000.0, **{k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src}}
    nbytes = bem.synthetic.write_synthetic_llama(
        directory, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], config=extra, shard_bytes=2 * GIB,
        **{"vocab": src["vocab_size"], **shape})
    for f in bem.TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, directory / f)
    return nbytes


# Run as ``python -c PEAK_CODE OUT MODULE ARGS...``: the module as ``python -m MODULE ARGS...`` would, then,
# at exit, this process's own high-water mark (``VmHWM``: of the memory map exec gave it) written to OUT. Not
# ``wait4``'s ``ru_maxrss``: Linux carries the parent's peak RSS into the child's across fork and exec, so a
# child of a parent that has written a model reports at least the parent's peak.
PEAK_CODE = """
import atexit, runpy, sys
out, module = sys.argv[1], sys.argv[2]
def hwm():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                with open(out, "w") as f:
                    f.write(str(int(line.split()[1]) * 1024))
atexit.register(hwm)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def imports_peak(src: Path | None = None) -> int:
    """Peak RSS of a child that imports what ``qkit plan`` imports and loads nothing (its own ``VmHWM``)."""
    code = ("import torch, transformers, qkit.api, qkit.cli\n"
            "print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env(src))
    return int(r.stdout.split()[-1])


def _env(src: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def run_child(argv: list[str], *, src: Path | None = None, every: float = 5.0, log: Path | None = None) -> dict:
    """Run ``argv`` (``[python, "-m", module, ...]``) in a child: its peak RSS (its own ``VmHWM`` at exit;
    if it was killed, the highest sampled), seconds and exit code, and its resident memory sampled every
    ``every`` seconds."""
    assert argv[:2] == [sys.executable, "-m"], argv
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".hwm") as hwm, open(log if log is not None else os.devnull, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", PEAK_CODE, hwm.name, *argv[2:]], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(src))
        samples = []
        while proc.poll() is None:
            st = bem.proc_status(proc.pid)
            if st:
                samples.append({"t": round(time.perf_counter() - t0, 1), **st})
            try:
                proc.wait(timeout=every)
            except subprocess.TimeoutExpired:
                pass
        text = Path(hwm.name).read_text().strip()
    peak = int(text) if text else max((s.get("VmHWM", 0) for s in samples), default=0)
    return {"peak_rss": peak, "seconds": round(time.perf_counter() - t0, 1), "exit_code": proc.returncode, "samples": samples}


def plan_argv(model: Path, out: Path, *, samples: int, seqlen: int, check_windows: int, dtype: str | None,
              max_memory: str | None, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "qkit", "plan", str(model), "--format", "gguf", "--target-bits", "4.5",
            "--calibration-samples", str(samples), "--calibration-seqlen", str(seqlen), "--check-windows", str(check_windows),
            "-o", str(out), *extra]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if max_memory is not None:
        argv += ["--max-memory", max_memory]
    return argv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="the file's dtype and the plan's --dtype")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--check-windows", type=int, default=2)
    ap.add_argument("--max-memory", default=None)
    ap.add_argument("--src", type=Path, default=None, help="another qkit tree's src/ to run (PYTHONPATH)")
    ap.add_argument("--old", action="store_true", help="--src is older than --dtype/--max-memory: pass neither")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None, help="an existing model directory to plan instead of writing one")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.model is not None:
            from qkit.checkpoint import checkpoint_bytes

            model, weights = args.model, checkpoint_bytes(args.model)
        else:
            model = Path(tmp) / "model"
            heads = args.hidden // 64
            weights = write_model(model, dtype=args.dtype, hidden=args.hidden, intermediate=args.intermediate,
                                  layers=args.layers, heads=heads, kv_heads=heads)
        base = imports_peak(args.src)
        out = Path(tmp) / "plan.json"
        argv = plan_argv(model, out, samples=args.samples, seqlen=args.seqlen, check_windows=args.check_windows,
                         dtype=None if args.old else args.dtype, max_memory=None if args.old else args.max_memory, extra=extra)
        r = run_child(argv, src=args.src, log=Path(tmp) / "plan.log")
        if r["exit_code"]:
            sys.exit(f"qkit plan failed: {(Path(tmp) / 'plan.log').read_text().strip().splitlines()[-3:]}")
        plan = json.loads(out.read_text())
    mem = plan.get("sensitivity", {}).get("memory") or {}
    peak = r["peak_rss"]
    result = {"shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "vocab": 49152},
              "samples": r["samples"], "dtype": args.dtype, "weights": weights, "imports": base, "peak_rss": peak, "seconds": r["seconds"],
              "memory": mem, "sensitivity_seconds": plan.get("sensitivity", {}).get("seconds"),
              "command": "qkit " + " ".join(argv[argv.index("plan"):])}
    print(f"weights {weights / GIB:.2f} GiB ({args.dtype}), imports {base / GIB:.2f} GiB, qkit plan peak RSS {peak / GIB:.2f} GiB "
          f"in {r['seconds']:.0f} s: {(peak - base) / weights:.2f}x the weights over the imports; peak - weights "
          f"{(peak - weights) / GIB:.2f} GiB")
    if mem:
        print(f"plan's estimate {mem['estimated_peak_bytes'] / GIB:.2f} GiB for a budget of {mem['budget_bytes'] / GIB:.2f} GiB "
              f"({mem['budget_from']}), {mem['groups']} Fisher group(s); measured/estimated "
              f"{peak / mem['estimated_peak_bytes']:.2f}; sensitivity seconds {result['sensitivity_seconds']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
