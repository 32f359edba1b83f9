"""Peak memory of ``qkit plan`` on a synthetic fp32 llama, against its weights (docs/plan.md, Memory).

    python benchmarks/bench_plan_memory.py [--layers 8] [--hidden 1024] [--intermediate 2816] [--dir /tmp]

The model: random weights written by ``benchmarks/bench_eval_memory.py``'s writer (one shard in memory at
a time) in fp32, with the default model's tokenizer (vocabulary 49,152), to a temporary directory under
``--dir`` removed afterwards. ``qkit plan MODEL --format gguf --target-bits 4.5 --calibration-samples 8
--calibration-seqlen 256 --check-windows 2`` then runs in a child process; its peak resident memory is the
child's ``ru_maxrss``. The imports alone (python, torch, transformers, qkit) are measured in another child
and reported beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
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


def child_peak(argv: list[str]) -> tuple[int, float, subprocess.CompletedProcess]:
    """Run ``argv``; its peak RSS in bytes (the children's maximum so far: run the largest last) and seconds."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, time.perf_counter() - t0, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    import torch

    from qkit.models import resolve

    tokenizer_dir = resolve(None).directory
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = Path(tmp) / "model"
        src = bem.json.loads((tokenizer_dir / "config.json").read_text())
        extra = {"rope_theta": 10000.0, **{k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src}}
        weights = bem.synthetic.write_synthetic_llama(
            model, dtype=torch.float32, config=extra, hidden=args.hidden, intermediate=args.intermediate,
            layers=args.layers, heads=args.hidden // 64, kv_heads=args.hidden // 64, vocab=49152)
        for f in bem.TOKENIZER_FILES:
            if (tokenizer_dir / f).is_file():
                shutil.copy2(tokenizer_dir / f, model / f)
        base, _, _ = child_peak([sys.executable, "-c", "import torch, transformers, qkit.api"])
        peak, seconds, done = child_peak([
            sys.executable, "-m", "qkit", "plan", str(model), "--format", "gguf", "--target-bits", "4.5",
            "--calibration-samples", "8", "--calibration-seqlen", "256", "--check-windows", "2",
            "-o", str(Path(tmp) / "plan.json")])
        if done.returncode:
            sys.exit(f"qkit plan failed: {done.stderr.strip().splitlines()[-1:]}")
    print(f"weights {weights / GIB:.2f} GiB (fp32), imports {base / GIB:.2f} GiB, qkit plan peak RSS {peak / GIB:.2f} GiB "
          f"in {seconds:.0f} s: {(peak - base) / weights:.2f}x the weights over the imports")


if __name__ == "__main__":
    main()
