"""Serving benchmark: greedy generation with the KV cache against without it, and one batched decode step
against B single steps, on the default model (or MODEL), medians of several runs in one process.

    python benchmarks/bench_serving.py [MODEL] [--tokens 64] [--batch 8] [--repeats 5] [--threads N]

Uses the same primitives as ``qkit bench`` (``qkit.serving.bench``); prints medians, half ranges and ratios.
"""

from __future__ import annotations

import argparse

import torch

from qkit.models import load
from qkit.serving.bench import _crop, _Runner, mac_counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 per free core on a shared machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load(args.model, device="cpu")
    run = _Runner(loaded.model, torch.device("cpu"))
    macs = mac_counts(loaded.model)
    prompt = run.ids(1, args.prompt)
    print(f"model: {loaded.ref.spec}; {torch.get_num_threads()} threads; median ± half range of {args.repeats} runs")
    with torch.inference_mode():
        cached = run.time(lambda: run.generate_cached(prompt, args.tokens), args.repeats, 1)
        uncached = run.time(lambda: run.generate_uncached(prompt, args.tokens), args.repeats, 1)
        print(f"generate {args.tokens} tokens with cache:    {cached.median * 1e3:9.1f} ± {cached.spread * 1e3:.1f} ms"
              f"  ({macs.generate_cached(args.prompt, args.tokens) / 1e9:.2f} GMAC)")
        print(f"generate {args.tokens} tokens without cache: {uncached.median * 1e3:9.1f} ± {uncached.spread * 1e3:.1f} ms"
              f"  ({macs.generate_uncached(args.prompt, args.tokens) / 1e9:.2f} GMAC)")
        print(f"ratio without / with cache: {uncached.median / cached.median:.2f}x")

        nxt1, cache1 = run.forward(run.ids(1, args.cache))
        one = run.time(lambda: run.forward(nxt1, cache1), args.repeats, 1, after=lambda: _crop(cache1, args.cache))
        nxtb, cacheb = run.forward(run.ids(args.batch, args.cache))
        many = run.time(lambda: run.forward(nxtb, cacheb), args.repeats, 1, after=lambda: _crop(cacheb, args.cache))
        print(f"decode step, batch 1, {args.cache}-token cache: {one.median * 1e3:8.1f} ± {one.spread * 1e3:.1f} ms")
        print(f"decode step, batch {args.batch}, {args.cache}-token caches: {many.median * 1e3:8.1f} ± {many.spread * 1e3:.1f} ms")
        print(f"ratio: {args.batch} single steps / one batched step = {args.batch * one.median / many.median:.2f}x throughput")


if __name__ == "__main__":
    main()
