"""One ``qkit eval`` row, part by part, against one plain forward pass over the same tokens.

A frontier of planned mixes evaluates many rows, so the cost of a row beyond the reference is what
matters. On the default model (the pinned corpus's first ``--tokens`` tokens in one window), each round
times, in this order:

- peer: ``forward``, one plain forward pass and log-softmax over the window (``position_logprobs`` as it
  stood when this benchmark was written, frozen below so that speeding up qkit's copy cannot move the peer);
- ``build``: ``row_files.quantize_row`` (``qkit.api.quantize_model``, as the torch engine's row is written)
  writing the row's checkpoint to a temporary directory, then its tensors streamed into the model
  (``Swapper.apply``, as ``TorchSession.measure`` does);
- ``perplexity+KL``: ``CorpusReference.score`` (forward, NLL, KL against the stored reference, top-1);
- ``prefill``: ``agreement.prefill_prompts``, the 16 battery prompts' KV cache (shared by the next two);
- ``agreement``: one cached forward of ``--agree-tokens`` positions per prompt, on a copy of that cache;
- ``battery``: ``generate_answers`` continuing from the cache (greedy, ``--battery-tokens`` new tokens);
- ``restore``: the reference's weights read back (``Swapper.restore``).

Round-robin (one warm-up round, then ``--repeats`` rounds), so every part sees the same machine load;
prints each part's median wall time, min-max, its ratio to the peer's median, the same for the
process's CPU seconds (steadier on a shared machine), and the row's total (the sum of the parts'
medians) over the peer: the target is <= 1.5. The battery is split into its decode steps (forward hooks
on the model) and what ``generate`` spends outside the model, and each step is set beside the floor of
a memory-bound step: the model's bytes over the machine's copy bandwidth (a 1 GiB ``clone``, read plus
write, timed here). ``--eval`` also runs ``evaluate`` on the scheme and prints the rows' own ``seconds``
against the peer median.

Run: ``python benchmarks/bench_eval_row.py [--scheme q4_0] [--repeats 5] [--tokens 2048] [--threads 2] [--eval]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from qkit.checkpoint import iter_quantized
from qkit.evaluation.agreement import agreement, prefill_prompts, reference_continuation
from qkit.evaluation.battery import (
    build_prompts,
    generate_answers,
    load_battery,
    model_repetition_penalty,
)
from qkit.evaluation.engines.torch_engine import ENGINE as TORCH_ENGINE
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.engine_rows import TMP_PREFIX
from qkit.evaluation.row_files import quantize_row
from qkit.evaluation.specs import resolve_rows
from qkit.evaluation.swap import Swapper
from qkit.models import load, resolve
from qkit.staging import temporary_directory
from qkit.texts import load_corpus


def plain_forward(model, window_ids: torch.Tensor) -> torch.Tensor:
    """The peer: ``position_logprobs`` as it stood (forward without a cache, then a float32 log-softmax)."""
    with torch.inference_mode():
        logits = model(input_ids=window_ids[None], use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def round_robin_cpu(fns: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``_timing.round_robin`` (one warm-up round, then ``repeats`` rounds), timing both the wall clock and
    the process's CPU seconds (all threads): on a shared machine the CPU seconds move less with the load."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[label].append(time.perf_counter() - t0)
            cpu[label].append(time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="q4_0")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--battery-tokens", type=int, default=EvalOptions.battery_tokens)
    ap.add_argument("--agree-tokens", type=int, default=EvalOptions.agree_tokens)
    ap.add_argument("--eval", action="store_true", help="also run evaluate() on the scheme and print its rows' seconds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ref = resolve(None)
    loaded = load(ref=ref, device="cpu")
    lm, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor(tok(load_corpus().text, add_special_tokens=False)["input_ids"][: args.tokens])
    corpus_ref = CorpusReference(lm, ids, window=int(ids.numel()))
    prompts = build_prompts(tok, [q.question for q in load_battery()])
    rp = model_repetition_penalty(lm)
    continuation = reference_continuation(lm, tok, prompts, args.agree_tokens)
    swapper = Swapper(lm, ref.directory)
    spec = resolve_rows((args.scheme,), EvalOptions.methods, {})[0]
    options = EvalOptions(schemes=(args.scheme,), tokens=args.tokens)
    state: dict = {}

    def build():
        with temporary_directory(TMP_PREFIX) as tmp:
            out = Path(tmp) / "row"
            quantize_row(TORCH_ENGINE, spec, ref, options.rows, out, spec.name, lambda _m: None)
            swapper.apply(iter_quantized(out))

    def prefill():
        state["cache"] = prefill_prompts(lm, *continuation.prompts)

    # The battery's forward passes, timed by hooks (the forward signature generate() inspects stays the
    # model's): the first of each generate() is the prompts' prefill, each later one a decode step.
    battery_calls: list[list[float]] = []  # per battery run: seconds of each forward pass
    started: list[float] = []

    def pre_hook(*_):
        started.append(time.perf_counter())

    def post_hook(*_):
        seconds = time.perf_counter() - started.pop()
        if state.get("in_battery"):
            battery_calls[-1].append(seconds)

    lm.register_forward_pre_hook(pre_hook)
    lm.register_forward_hook(post_hook)

    def battery():
        battery_calls.append([])
        state["in_battery"] = True
        try:
            generate_answers(lm, tok, prompts, args.battery_tokens, rp, prompt_cache=state.pop("cache"))
        finally:
            state["in_battery"] = False

    # Dict order is the round's order: the model holds the row's weights from swap to restore.
    parts = {
        "forward (peer)": lambda: plain_forward(lm, ids),
        "build (quantize+swap)": build,
        "perplexity+KL": lambda: corpus_ref.score(lm),
        "prefill": prefill,
        "agreement": lambda: agreement(lm, continuation, prompt_cache=state["cache"]),
        "battery": battery,
        "restore": swapper.restore,
    }
    try:
        times, cpu = round_robin_cpu(parts, args.repeats)
    finally:
        swapper.restore()
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    peer, cpeer = med["forward (peer)"], cmed["forward (peer)"]
    print(f"eval row {args.scheme}: default model, {ids.numel()} tokens in 1 window, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (round-robin after a warm-up); load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'part':20} {'wall s':>8} {'min-max s':>15} {'/ forward':>10} {'CPU s':>8} {'/ forward':>10}")
    for k, v in times.items():
        print(f"{k:20} {med[k]:8.3f} {min(v):7.3f}-{max(v):7.3f} {med[k] / peer:10.2f} {cmed[k]:8.3f} {cmed[k] / cpeer:10.2f}")
    row = sum(m for k, m in med.items() if k != "forward (peer)")
    crow = sum(m for k, m in cmed.items() if k != "forward (peer)")
    print(f"{'row (sum of parts)':20} {row:8.3f} {'':15} {row / peer:10.2f} {crow:8.3f} {crow / cpeer:10.2f}   (target <= 1.50)")
    runs = battery_calls[1:]  # without the warm-up round; run i is times["battery"][i]
    step = statistics.median(x for c in runs for x in c)
    steps = statistics.median(len(c) for c in runs)
    rest = statistics.median(t - sum(c) for t, c in zip(times["battery"], runs))
    big = torch.empty(2**28)  # 1 GiB of float32
    copy_s = statistics.median(_timed(big.clone) for _ in range(5))
    bandwidth = 2 * big.numel() * 4 / copy_s  # bytes read plus written per second
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    floor = weights / bandwidth
    print(f"battery (wall) = {steps} model calls (the prompts' last tokens, then decode steps) x {step:.3f} s "
          f"({steps * step / peer:.2f} x forward) + {rest:.3f} s outside the model's forward")
    print(f"a memory-bound step reads every weight once: {weights / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s copy bandwidth "
          f"= {floor:.3f} s, so {steps} steps >= {steps * floor:.2f} s ({steps * floor / peer:.2f} x forward)")
    b, t = continuation.input_ids.shape
    print(f"prefill: {b} x {t - args.agree_tokens - 1} positions; agreement: {b} x {args.agree_tokens} on the cache "
          f"(the peer: {ids.numel()})")

    if args.eval:
        report = evaluate(None, options=EvalOptions(schemes=(args.scheme,), tokens=args.tokens,
                                                    battery_tokens=args.battery_tokens, agree_tokens=args.agree_tokens))
        for r in report.rows:
            print(f"evaluate() row {r.scheme:12} {r.seconds:8.3f} s  {r.seconds / peer:6.2f} x forward")


if __name__ == "__main__":
    main()
