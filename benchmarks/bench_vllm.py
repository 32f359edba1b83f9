"""vLLM as an eval runtime: its load time, and scoring a row's tokens in vLLM against a torch forward.

    QKIT_ENGINE_PYTHON=/work/vllm-venv/bin/python python benchmarks/bench_vllm.py \\
        [--rows reference,w8a8-token] [--tokens 2048] [--repeats 3] [--json PATH]

For each row, its file is written once, as ``qkit eval --runtime vllm`` writes it (``quantize_model`` with
``--format compressed-tensors``, W8A8 ``--activations int8-token`` for ``w8a8-token``; the reference is the
model directory itself). Then ``--repeats`` rounds, each timing, on the same machine load (round robin):

* **vLLM**: ``VllmEngine.run`` on the first ``--tokens`` tokens of the eval corpus (one window, scoring only:
  no battery, no agreement), a fresh worker each time. Reported apart: ``load_seconds`` (vLLM's ``LLM(...)``:
  config, weights, KV cache), ``run_seconds`` (the batched ``prompt_logprobs`` call and the conversion of
  its top-k dicts to arrays), and the worker's wall time (process start and ``import vllm`` included);
* **torch**: qkit's torch runtime's work for the same tokens on the reference model: one forward pass, the
  float64 log-softmax, the target log-probabilities (the fp32 reference; a simulated W8A8 row adds its
  activation hooks on top of this).

Prints the medians and ``vLLM run / torch forward`` (issue 22's target: at most 2x once loaded), the
perplexities both measured (the reference's must agree to within the per-token noise), and
``os.getloadavg()`` before and after: other processes on the machine move every figure. Exits 0 with one
line when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qkit.api import QuantizeOptions, quantize_model
from qkit.errors import QkitError
from qkit.evaluation.engines.base import EngineJob, EngineOptions
from qkit.evaluation.engines.vllm import ENGINE
from qkit.models import resolve
from qkit.texts import load_corpus

# row -> (scheme, the run-time simulations its file carries); None: the unquantized reference
ROWS = {"reference": (None, ()), "w8a8-token": ("int8-row", ("act-int8-token",)),
        "int8-row": ("int8-row", ()), "int4-g64": ("int4-g64", ())}


def corpus_ids(directory: Path, tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    text = load_corpus().text
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:tokens], dtype=torch.long)


def torch_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """float64 ``[w-1]``: log q(x_t | x_<t) of the reference model, as the torch runtime scores a window."""
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, :-1]
        return torch.log_softmax(logits.double(), -1).gather(1, ids[1:, None])[:, 0]


def ppl(target: torch.Tensor) -> float:
    return math.exp(-float(target.double().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="reference,w8a8-token")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--python", default=None, help="the interpreter with vLLM (default: $QKIT_ENGINE_PYTHON or this one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}")
    options = EngineOptions(python=args.python)
    try:
        ENGINE.check_available(options)
    except QkitError as e:
        print(f"skipped: {e}")
        return
    load_before = os.getloadavg()
    ref = resolve(None)
    ids = corpus_ids(ref.directory, args.tokens)
    job = EngineJob(windows=[ids], battery_prompts=[], battery_tokens=1, repetition_penalty=1.0,
                    agreement_inputs=[], agreement_n=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ref.directory), dtype=torch.float32).eval()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="qkit-bench-vllm-") as tmp:
        paths = {}
        for name in rows:
            scheme, sims = ROWS[name]
            if scheme is None:
                paths[name] = ref.directory
                continue
            t0 = time.perf_counter()
            quantize_model(ref, output=Path(tmp) / name, scheme=scheme,
                           options=QuantizeOptions(**ENGINE.export_options(sims)))
            print(f"{name}: written in {time.perf_counter() - t0:.1f} s")
            paths[name] = Path(tmp) / name
        samples = {name: {"load": [], "run": [], "wall": [], "torch": []} for name in rows}
        for r in range(args.repeats):
            for name in rows:
                t0 = time.perf_counter()
                s = ENGINE.run(paths[name], job, options)
                wall = time.perf_counter() - t0
                t1 = time.perf_counter()
                target = torch_forward(model, ids)
                torch_s = time.perf_counter() - t1
                d = samples[name]
                d["load"].append(s.load_seconds)
                d["run"].append(s.run_seconds)
                d["wall"].append(wall)
                d["torch"].append(torch_s)
                d["vllm_ppl"], d["torch_ppl"], d["version"], d["notes"] = ppl(s.target_logprobs[0]), ppl(target), s.version, s.notes
                print(f"round {r + 1} {name}: vLLM load {s.load_seconds:.1f} s, score {s.run_seconds:.2f} s, "
                      f"worker {wall:.1f} s; torch forward {torch_s:.2f} s", flush=True)
        for name, d in samples.items():
            med = {k: statistics.median(d[k]) for k in ("load", "run", "wall", "torch")}
            results[name] = {**{f"{k}_median_s": v for k, v in med.items()}, "samples": {k: d[k] for k in ("load", "run", "wall", "torch")},
                             "run_over_torch": med["run"] / med["torch"], "vllm_perplexity": d["vllm_ppl"],
                             "torch_reference_perplexity": d["torch_ppl"], "vllm_version": d["version"], "notes": d["notes"]}
    out = {"tokens": int(ids.numel()), "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "rows": results}
    print(f"{'row':<12} {'vLLM load':>10} {'vLLM score':>11} {'worker':>8} {'torch fwd':>10} {'score/torch':>12} "
          f"{'ppl vLLM':>9} {'ppl torch ref':>14}")
    for name, r in results.items():
        print(f"{name:<12} {r['load_median_s']:>9.1f}s {r['run_median_s']:>10.2f}s {r['wall_median_s']:>7.1f}s "
              f"{r['torch_median_s']:>9.2f}s {r['run_over_torch']:>11.2f}x {r['vllm_perplexity']:>9.4f} "
              f"{r['torch_reference_perplexity']:>14.4f}")
    print(f"load average before {load_before}, after {out['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":  # vLLM is in a worker subprocess, but keep scripts spawn-safe all the same
    main()
