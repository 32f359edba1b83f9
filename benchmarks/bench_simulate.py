"""Overhead of the run-time simulations: an eval row with simulated activation or KV quantization
against a weight-only row, in one run (target: at most 1.5x).

The default model gets int8-row weights once (written as the torch engine writes a row, the runner's
``quantize_row``, and streamed in with ``Swapper.apply``); each row then does exactly what ``qkit eval``
measures per row: the perplexity pass over the first ``--tokens`` tokens of the pinned corpus (KL and top-1
included), the battery's batched greedy generation and the greedy-agreement forward, with the row's
simulations installed (``apply_simulation``, install and removal timed too). Rows are
timed round-robin (``benchmarks/_timing.round_robin``) so they share the machine's load; the table gives
medians and the ratio to the weight-only row.

Run: ``python benchmarks/bench_simulate.py [--repeats 3] [--tokens 2048]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import round_robin  # noqa: E402

from qkit.checkpoint import iter_quantized  # noqa: E402
from qkit.evaluation.agreement import agreement, prefill_prompts, reference_continuation  # noqa: E402
from qkit.evaluation.battery import build_prompts, generate_answers, load_battery, model_repetition_penalty  # noqa: E402
from qkit.evaluation.engines.torch_engine import ENGINE as TORCH_ENGINE  # noqa: E402
from qkit.evaluation.perplexity import CorpusReference  # noqa: E402
from qkit.evaluation import EvalOptions  # noqa: E402
from qkit.evaluation.engine_rows import TMP_PREFIX  # noqa: E402
from qkit.evaluation.row_files import quantize_row  # noqa: E402
from qkit.evaluation.specs import RowSpec  # noqa: E402
from qkit.evaluation.swap import Swapper  # noqa: E402
from qkit.models import load, resolve  # noqa: E402
from qkit.simulate import SimulationContext, apply_simulation  # noqa: E402
from qkit.staging import temporary_directory  # noqa: E402
from qkit.texts import load_corpus  # noqa: E402

ROWS = {
    "int8-row (weight-only)": (),
    "w8a8-tensor": ("act-int8-tensor",),
    "w8a8-token": ("act-int8-token",),
    "llm-int8": ("llm-int8",),
    "int8-row + kv-int8 (token)": ("kv-int8-token",),
    "int8-row + kv-int4 (KIVI)": ("kv-int4-channel",),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    ref = resolve(None)
    loaded = load(ref=ref, device="cpu")
    lm, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor(tok(load_corpus().text, add_special_tokens=False)["input_ids"][: args.tokens])
    corpus_ref = CorpusReference(lm, ids, args.tokens)
    prompts = build_prompts(tok, [q.question for q in load_battery()])
    rp = model_repetition_penalty(lm)
    continuation = reference_continuation(lm, tok, prompts, EvalOptions().agree_tokens)
    with temporary_directory(TMP_PREFIX) as tmp:  # the int8-row weights, as the torch engine loads a row
        out = Path(tmp) / "row"
        quantize_row(TORCH_ENGINE, RowSpec("int8-row"), ref, EvalOptions().rows, out, "int8-row", lambda _m: None)
        Swapper(lm, ref.directory).apply(iter_quantized(out))
    context = SimulationContext(device=torch.device("cpu"), extra={"tokenizer": tok, "model_ref": ref})

    def row(name, simulations):
        def run():
            print(f"  {name}", file=sys.stderr, flush=True)
            with torch.inference_mode(), apply_simulation(lm, simulations, context):
                corpus_ref.score(lm)
                cached = prefill_prompts(lm, *continuation.prompts)  # as the runner: one prefill for both
                agreement(lm, continuation, prompt_cache=cached)
                generate_answers(lm, tok, prompts, EvalOptions().battery_tokens, rp, prompt_cache=cached)

        return run

    times = round_robin({name: row(name, sims) for name, sims in ROWS.items()}, args.repeats)
    base = statistics.median(times[next(iter(ROWS))])
    print(f"one eval row ({ids.numel()} tokens + battery + agreement), {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'row':30} {'median s':>9} {'min-max s':>13} {'x weight-only':>14}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:30} {med:9.2f} {min(ts):6.2f}-{max(ts):6.2f} {med / base:14.2f}")


if __name__ == "__main__":
    main()
