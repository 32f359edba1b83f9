"""llama.cpp's converter through qkit's bridge: time and peak memory of the F32 GGUF and of the row map.

    python benchmarks/bench_converter.py [MODEL ...]     # default: the default model (SmolLM2-135M)

For each model, in a fresh cache folder for the converted files (the converter's tree comes from qkit's
cache): ``convert_f32`` alone, then ``row_map`` alone (each a subprocess of its own: the seconds include
starting Python and importing torch, transformers and the converter), with the worker's own seconds per
step and its peak resident memory, and whether the row map applied to the Hugging Face tensors gives
every moved tensor of the F32 file bit for bit; then llama.cpp's ``convert_hf_to_gguf.py MODEL --outtype
f32`` run directly by the same Python (``converter.standalone``: wall seconds, peak resident memory of the
child from ``getrusage``), and whether its file has the same sha256 as ``convert_f32``'s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkit import assets
from qkit.checkpoint import iter_tensors
from qkit.export.gguf import converter
from qkit.export.gguf.reader import float32_tensors
from qkit.models import resolve


def direct(model: Path, out: Path) -> tuple[float, int]:
    """``convert_hf_to_gguf.py`` run as its README says, with its own gguf-py (and qkit's shim, so that a
    machine without sentencepiece runs it too); wall seconds and the child's peak RSS in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd, env = converter.standalone(model, out, Path(tmp))
        # a parent of its own, so that RUSAGE_CHILDREN is this run's child alone
        measure = ("import resource, subprocess, sys, time; t = time.perf_counter(); subprocess.run(sys.argv[1:], "
                   "check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                   "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
        done = subprocess.run([sys.executable, "-c", measure, *cmd], check=True, env=env, capture_output=True, text=True)
    seconds, rss = done.stdout.split()
    return float(seconds), int(rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path)
    args = ap.parse_args()
    models = args.models or [resolve(None).directory]
    tree = converter.converter_root()
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "cache"
            shutil.copytree(tree, cache / tree.relative_to(assets.cache_dir()))
            os.environ["QKIT_CACHE"] = str(cache)
            t0 = time.perf_counter()
            f32 = converter.convert_f32(model)
            t_f32 = time.perf_counter() - t0
            rec_f32 = converter._record(f32, None)
            t0 = time.perf_counter()
            rows = converter.row_map(model)
            t_rows = time.perf_counter() - t0
            rec_rows = converter.convert([model], f32=False, rows=True)[0].record
            out = Path(tmp) / "direct.gguf"
            t_direct, rss_direct = direct(model, out)
            same = assets.sha256_file(out) == assets.sha256_file(f32)
            kinds: dict[str, int] = {}
            for t in rows.gguf.values():
                kinds[t.kind] = kinds.get(t.kind, 0) + 1
            hf = dict(iter_tensors(model))
            stored = float32_tensors(f32)
            rebuilt = all(torch.equal(rows.apply(hf, n), torch.from_numpy(stored[n].copy()))
                          for n, t in rows.gguf.items() if t.kind in ("rows", "transposed"))
            gib = 1024**3
            print(f"{model}: {rec_f32['architecture']} ({rec_f32['converter_class']}), {f32.stat().st_size:,} bytes F32")
            print(f"  convert_f32  {t_f32:6.1f} s wall (worker: import {rec_f32['seconds']['import']:.1f} s, checks {rec_f32['seconds']['checks']:.1f} s, "
                  f"convert {rec_f32['seconds']['f32']:.1f} s), peak {rec_f32['peak_rss_bytes'] / gib:.2f} GiB")
            print(f"  row_map      {t_rows:6.1f} s wall (worker: import {rec_rows['seconds']['import']:.1f} s, checks {rec_rows['seconds']['checks']:.1f} s, "
                  f"3 probe passes {rec_rows['seconds']['rows']:.1f} s), peak {rec_rows['peak_rss_bytes'] / gib:.2f} GiB; "
                  f"tensors {dict(sorted(kinds.items()))}, every moved tensor rebuilt bit for bit: {rebuilt}")
            print(f"  convert_hf_to_gguf.py directly  {t_direct:6.1f} s wall, peak {rss_direct / gib:.2f} GiB; "
                  f"same sha256 as convert_f32: {same}")
            os.environ.pop("QKIT_CACHE")


if __name__ == "__main__":
    main()
