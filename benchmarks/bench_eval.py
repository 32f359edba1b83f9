"""Perplexity throughput: qkit's evaluation loop against a plain transformers forward pass.

Both score the same first 2,048 tokens of the pinned corpus on the default model in one window:
- peer: ``model(input_ids, labels=input_ids).loss`` (transformers computes logits and cross-entropy);
- qkit: ``CorpusReference.score`` (logits, log-softmax, per-token NLL, and also the KL divergence and
  top-1 match against the stored reference; the extra work qkit does per row).
Reports medians over repeats, tokens per second and the ratio qkit / peer (target >= 1.0).
Run: ``python benchmarks/bench_eval.py [--repeats 5] [--tokens 2048]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkit.texts import load_corpus
from qkit.evaluation.perplexity import CorpusReference, position_logprobs
from qkit.models import load


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    loaded = load(None, device="cpu")
    lm, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor(tok(load_corpus().text, add_special_tokens=False)["input_ids"][: args.tokens])
    ref = CorpusReference(lm, ids, window=args.tokens)

    def peer():
        with torch.inference_mode():
            return lm(input_ids=ids[None], labels=ids[None], use_cache=False).loss.item()

    def qkit_ppl_only():
        lp = position_logprobs(lm, ids)
        return (-lp.gather(1, ids[1:, None])).mean().item()

    def qkit_row():
        return ref.score(lm).perplexity

    # Same number to the last digits: the two paths compute the same mean NLL.
    assert abs(peer() - qkit_ppl_only()) < 1e-4
    rows = []
    for name, fn in (("transformers forward + loss", peer), ("qkit perplexity", qkit_ppl_only), ("qkit full row (ppl + KL + top-1)", qkit_row)):
        ts = timed(fn, args.repeats)
        rows.append((name, statistics.median(ts), min(ts), max(ts)))
    base = rows[0][1]
    n = ids.numel() - 1
    print(f"perplexity throughput, {n} scored tokens, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'path':36} {'median s':>9} {'min-max s':>13} {'tokens/s':>9} {'ratio':>6}")
    for name, med, lo, hi in rows:
        print(f"{name:36} {med:9.3f} {lo:6.3f}-{hi:6.3f} {n / med:9.0f} {base / med:6.2f}")
    print("ratio = peer time / this path's time (>= 1.0: no cost on top of the model's own forward pass)")


if __name__ == "__main__":
    main()
