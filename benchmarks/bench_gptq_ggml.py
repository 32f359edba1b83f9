"""GPTQ for llama.cpp's types on the default model: RTN, RTN + importance matrix, GPTQ and GPTQ + importance
matrix; with act order (static scales), without it (scales from the error-updated weights), and without it
with static scales (``static_groups``), on one protocol.

Protocol (``qkit eval``'s, as ``benchmarks/bench_calibrated.py``): the first ``--tokens`` (2,048) tokens of the
pinned Book of Ruth scored in one window against the fp32 reference; per row the mean KL divergence with
its SE and the perplexity, and per pair of rows the mean per-token KL difference with its *paired* SE (the
same positions). Calibration: qkit's defaults (pinned KJV Genesis+Exodus, ``--samples`` x ``--seqlen``,
seed 0); the importance matrix ``--imatrix FILE`` (``qkit imatrix``'s, collected from the same text), or
collected here with qkit imatrix's defaults. Every row's weights come from ``qkit.api.quantize_model`` (the
path that writes files), so they are the file's.

The default model's published weights are Q4_1: ``--grid`` lists the matrices whose RTN in each stored type
reproduces them exactly (such a matrix measures nothing for RTN, and any method can only lose there).

Run: ``python benchmarks/bench_gptq_ggml.py [--scheme q4_k_m] [--variants rtn,rtn+imatrix,gptq,...]
[--imatrix FILE] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from qkit.api import QuantizeOptions, imatrix_model, quantize_model
from qkit.checkpoint import iter_tensors
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.token_scores import TokenScores
from qkit.models import load, read_config, resolve
from qkit.schemes import QuantizedTensor, get_scheme, quantize_tensor
from qkit.texts import load_corpus

# gptq: act order (static scales); gptq-noact: the original order, scales from the error-updated weights;
# gptq-static: the original order, static scales
VARIANTS = "rtn,rtn+imatrix,gptq,gptq-noact,gptq-static,gptq+imatrix,gptq-noact+imatrix"


def swap_score(lm, tensors: dict[str, QuantizedTensor], ref: CorpusReference) -> tuple[TokenScores, int]:
    """The scores with ``tensors`` in place of the reference's, and how many of them equal the source exactly
    (on the published Q4_1 grid, as stored)."""
    originals, exact = {}, 0
    with torch.no_grad():
        for name, qt in tensors.items():
            p = lm.get_parameter(name)
            originals[name] = p.detach().clone()
            p.copy_(qt.dequantize(p.dtype))
            exact += bool(torch.equal(p, originals[name]))
    try:
        return ref.score(lm), exact
    finally:
        with torch.no_grad():
            for name, w in originals.items():
                lm.get_parameter(name).copy_(w)


def paired_kl(a: TokenScores, b: TokenScores) -> tuple[float, float]:
    d = a.kl - b.kl
    return d.mean().item(), d.std(unbiased=True).item() / math.sqrt(d.numel())


def on_grid(ref_model, scheme_name: str) -> dict[str, list[str]]:
    """Per stored type: the block projections whose RTN in it reproduces the source weights exactly."""
    scheme = get_scheme(scheme_name).bind(read_config(ref_model.directory))
    out: dict[str, list[str]] = {}
    for name, w in iter_tensors(ref_model.directory):
        if ".layers." not in name or not name.endswith("proj.weight"):
            continue
        for s in {scheme_name: scheme, "q4_1": get_scheme("q4_1")}.values():
            qt = quantize_tensor(w, s, name=name)
            if torch.equal(qt.dequantize(torch.float32), w.float()):
                out.setdefault(f"{qt.scheme.name} (via {s.name})", []).append(name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="q4_k_m")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--imatrix", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--grid", action="store_true", help="list the matrices on each type's RTN grid, then stop")
    ap.add_argument("--leave-out", default=None, metavar="VARIANT",
                    help="also score every row with the matrices VARIANT (run first) reproduces exactly left at the "
                         "source weights: the comparison on the matrices that are not on the published grid")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    ref_model = resolve(None)
    if args.grid:
        found = on_grid(ref_model, args.scheme)
        print(json.dumps({k: {"count": len(v), "tensors": v[:6] + (["..."] if len(v) > 6 else [])} for k, v in found.items()},
                         indent=1))
        return
    variants = [v for v in args.variants.split(",") if v]
    if args.leave_out:  # the variant whose exact matrices are left out runs first
        variants = [args.leave_out, *[v for v in variants if v != args.leave_out]]
    left_out: set[str] | None = None
    scores_out: dict[str, TokenScores] = {}
    loaded = load(ref=ref_model, device="cpu")
    lm, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor(tok(load_corpus().text, add_special_tokens=False)["input_ids"][: args.tokens])
    ref = CorpusReference(lm, ids, window=min(2048, args.tokens))
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
          f"{ref.scored_tokens} scored tokens; torch threads {torch.get_num_threads()}", flush=True)
    rows, scores = [], {}
    with tempfile.TemporaryDirectory(prefix="qkit-bench-") as tmp:
        imatrix = args.imatrix
        if imatrix is None and any("imatrix" in v for v in variants):
            imatrix = str(Path(tmp) / "imatrix.gguf")
            t0 = time.perf_counter()
            imatrix_model(ref_model, output=imatrix)
            print(f"imatrix collected in {time.perf_counter() - t0:.1f} s", flush=True)
        for variant in variants:
            base, _, weighted = variant.partition("+")
            method = "rtn" if base == "rtn" else "gptq"
            mopts = None if method == "rtn" else {"act_order": base == "gptq", "static_groups": base == "gptq-static"}
            opts = QuantizeOptions(force=True, imatrix=imatrix if weighted else None)
            t0 = time.perf_counter()
            r = quantize_model(ref_model, output=Path(tmp) / "out.gguf", scheme=args.scheme, method=method, format="gguf",
                               method_options=mopts, collect=True, options=opts)
            seconds = time.perf_counter() - t0
            s, exact = swap_score(lm, r.quantized, ref)
            scores[variant] = s
            if args.leave_out and left_out is None:
                with torch.no_grad():
                    left_out = {n for n, qt in r.quantized.items()
                                if torch.equal(qt.dequantize(torch.float32), lm.get_parameter(n).float())}
            row = {"row": f"{args.scheme} {variant}", "tensors_exact": exact, "kl": s.kld, "kl_se": s.kld_se, "perplexity": s.perplexity,
                   "perplexity_se": s.perplexity_se, "top1": s.top1_match, "seconds": round(seconds, 1),
                   "load_average": os.getloadavg()[0], "types": dict(sorted(r.schemes_used.items()))}
            for other in ("rtn", "rtn+imatrix"):
                if other in scores and other != variant:
                    row[f"kl_vs_{other}"], row[f"kl_vs_{other}_se"] = paired_kl(s, scores[other])
            if left_out is not None:
                so, _ = swap_score(lm, {n: qt for n, qt in r.quantized.items() if n not in left_out}, ref)
                scores_out[variant] = so
                row["left_out"] = {"matrices": len(left_out), "kl": so.kld, "kl_se": so.kld_se}
                for other in ("rtn", "rtn+imatrix"):
                    if other in scores_out and other != variant:
                        row["left_out"][f"kl_vs_{other}"], row["left_out"][f"kl_vs_{other}_se"] = paired_kl(so, scores_out[other])
            if method == "gptq":
                layers = r.method_record["layers"].values()
                row["layers_gptq_below_rtn"] = sum(v["gptq_error"] < v["rtn_error"] for v in layers)
                row["layers"] = len(layers)
                row["mean_error_ratio"] = sum(v["gptq_error"] / v["rtn_error"] for v in layers if v["rtn_error"] > 0) / len(layers)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"scheme": args.scheme, "tokens": ref.scored_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
