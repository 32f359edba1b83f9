"""How far apart GPTQ files of one type land when only the calibration windows change, scored in llama.cpp.

    python benchmarks/bench_gguf_peers.py --types q4_k_m      # once: F32.gguf, imatrix.gguf, the KL base
    python benchmarks/bench_gptq_spread.py [--type q4_k_m] [--seeds 0,1,2] [--versus FILE ...] [--json PATH]

For each seed, ``qkit quantize --format gguf -s TYPE --method gptq --imatrix imatrix.gguf`` with the default
32 x 512 calibration windows drawn with that seed (``GPTQOptions.calibration_seed``) from the same text,
written under ``bench_gguf_peers``' work directory with the matrix ``bench_gguf_peers.py`` collected there.
Every seed's file and every ``--versus`` file (another tool's file of the type, or a GPTQ file written by
another qkit version) is scored by ``llama-perplexity --kl-divergence`` against that run's F32 base on Ruth,
per position, and every pair of files is compared on the same positions (difference ± paired SE).

GPTQ's codes depend on every rounding decision before them: a change in the last bit of the dampening
(``mean(diag H)`` summed in another order) changed 200 of the default model's 210 q4_k_m matrices, which is
the size of difference the windows' seed also makes. A comparison of GPTQ with another method is only as
firm as this spread.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gguf_peers as peers  # noqa: E402
import bench_llama_cpp as b  # noqa: E402
import build_llama_ref as blr  # noqa: E402

from qkit.api import QuantizeOptions, quantize_model  # noqa: E402
from qkit.assets import cache_dir  # noqa: E402
from qkit.models import resolve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="q4_k_m", help="a llama.cpp type or recipe qkit writes (-s)")
    ap.add_argument("--seeds", default="0,1,2", help="calibration seeds, one GPTQ file each")
    ap.add_argument("--versus", type=Path, nargs="*", default=[], help="other GGUF files of the model to score beside them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: integers separated by commas, got {args.seeds!r}") from None
    missing = [str(p) for p in args.versus if not p.is_file()]
    if not seeds or missing:
        raise SystemExit(f"--versus: no such file: {', '.join(missing)}" if missing else "--seeds: none given")
    if not blr.tool_path("llama-perplexity").exists():
        print("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
        return 0
    work = cache_dir() / "bench_gguf_peers"
    im, base = work / "imatrix.gguf", work / "F32-kjv-ruth.kld"  # the matrix and Ruth's base bench_gguf_peers wrote
    if not (im.is_file() and base.is_file()):
        raise SystemExit(f"run python benchmarks/bench_gguf_peers.py --types {args.type} first ({im.name} and {base.name} in {work})")
    files: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    for s in seeds:
        q = work / f"spread-{args.type}+gptq+imatrix-seed{s}.gguf"
        t0 = time.perf_counter()
        quantize_model(resolve(None), output=q, scheme=args.type, method="gptq", format="gguf",
                       options=QuantizeOptions(force=True, imatrix=str(im), method_options={"calibration_seed": s}))
        name = f"qkit gptq+imatrix seed {s}"
        files[name], seconds[name] = q, round(time.perf_counter() - t0, 1)
        print(f"  {name}: {seconds[name]} s", flush=True)
    for p in args.versus:
        files[p.name] = p
    tool = b.build_kld_dump_tool()
    kl: dict[str, np.ndarray] = {}
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "type": args.type, "llama_cpp_commit": blr.commit(), "files": {}}
    for name, f in files.items():
        dump = work / "kld-spread.dump"
        r = b.llama_kl_divergence(f, base, args.threads, tool=tool, dump=dump)
        if r.get("error"):
            raise SystemExit(f"{name}: llama.cpp refused it: {r['error'][-200:]}")
        kl[name] = b.read_kld_dump(dump)["kld"].astype(np.float64)
        mean, se = float(kl[name].mean()), float(kl[name].std(ddof=1) / math.sqrt(len(kl[name])))
        doc["files"][name] = {"path": str(f), "kl": mean, "kl_se": se, "seconds": seconds.get(name)}
        print(f"  {name:44s} KL {mean:.5f} ± {se:.5f}", flush=True)
    names = list(kl)
    doc["pairs"] = []
    for i, a in enumerate(names):
        for c in names[i + 1:]:
            d, se = peers.paired(kl[a], kl[c])
            doc["pairs"].append({"a": a, "b": c, "kl_difference": d, "paired_se": se})
            print(f"  {a} minus {c}: {d:+.5f} ± {se:.5f} ({d / se:+.1f} SE)" if se > 0 else f"  {a} = {c}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
