"""Streaming quantization throughput on a synthetic ~2 GB llama, against the I/O floor.

    python benchmarks/bench_streaming.py [--layers 32] [--runs 3] [--schemes int8-row,int4-g128,nf4] [--dir DIR]

The model comes from ``tests/test_streaming.py`` (random fp32 weights, written shard by shard, never
downloaded). Peer measured in the same run: the I/O floor, i.e. read every tensor with the same streaming
reader and rewrite it unchanged with the same shard writer. Both read from a warm page cache (one
warm-up pass first). Reported: median seconds of ``--runs`` runs, GB/s of source weights, and the ratio
to the floor (target: within 1.5x). ``os.sync()`` (untimed) before every run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("test_streaming", ROOT / "tests" / "test_streaming.py")
synthetic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(synthetic)

from qkit.api import QuantizeOptions, quantize_model  # noqa: E402
from qkit.checkpoint import DEFAULT_MAX_SHARD_BYTES, ShardWriter, iter_tensors  # noqa: E402


def settle() -> None:
    """Flush dirty pages first (untimed), so a run does not pay for the previous run's writeback."""
    os.sync()


def io_floor(src: Path, out: Path, max_shard_bytes: int) -> float:
    settle()
    t0 = time.perf_counter()
    out.mkdir(parents=True)
    writer = ShardWriter(out, None, max_shard_bytes)
    for name, t in iter_tensors(src):
        writer.add(name, t)
    writer.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=synthetic.SYNTHETIC["layers"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schemes", default="int8-row,int4-g128,nf4")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="qkit-bench-", dir=args.dir))
    try:
        src = base / "synthetic"
        t0 = time.perf_counter()
        nbytes = synthetic.write_synthetic_llama(src, layers=args.layers)
        print(f"synthetic llama: {args.layers} layers, {nbytes / 1e9:.2f} GB fp32 in "
              f"{len(list(src.glob('*.safetensors')))} shards (written in {time.perf_counter() - t0:.1f} s)")
        io_floor(src, base / "warmup", args.max_shard_bytes)  # warm the page cache
        shutil.rmtree(base / "warmup")
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        times: dict[str, list[float]] = {"io-floor": [], **{s: [] for s in schemes}}
        for run in range(args.runs):
            out = base / "out"
            times["io-floor"].append(io_floor(src, out, args.max_shard_bytes))
            shutil.rmtree(out)
            for s in schemes:
                settle()
                t = time.perf_counter()
                quantize_model(src, output=out, scheme=s,
                               options=QuantizeOptions(device="cpu", max_shard_bytes=args.max_shard_bytes))
                times[s].append(time.perf_counter() - t)
                shutil.rmtree(out)
        floor = statistics.median(times["io-floor"])
        best_floor = min(times["io-floor"])
        print(f"\n{'':<12}{'median s':>10}{'GB/s':>8}{'x floor':>9}{'best s':>9}{'x best floor':>14}   runs (s)")
        for name, ts in times.items():
            med, best = statistics.median(ts), min(ts)
            print(f"{name:<12}{med:>10.2f}{nbytes / 1e9 / med:>8.2f}{med / floor:>9.2f}{best:>9.2f}{best / best_floor:>14.2f}   "
                  + ", ".join(f"{t:.2f}" for t in ts))
        print("\nio-floor: read every tensor and rewrite it unchanged (same reader, same shard writer); "
              "GB/s = source GB / s; warm page cache.")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
