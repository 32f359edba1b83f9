"""Calibrated methods on the default model: qkit GPTQ (and AWQ where qkit.methods.awq exists) against RTN,
and against llm-compressor when it is installed, on the same calibration tokens, scored on every held-out
domain of ``qkit eval``'s suite.

Protocol: each text of the default eval suite (``qkit.catalog.eval_texts``: Ruth, the GPL-3 licence,
Python's argparse.py, Much Ado About Nothing; what a model is given of it, ``methods.calibration.text_ids``), its
first ``--tokens`` tokens scored in one window; per domain the mean KL to the unquantized model and the
perplexity, and each row's change against qkit's RTN row of the same scheme with the *paired* SE (per-token
differences on the same tokens). The headline of a row is its worst domain. Calibration:
``qkit.methods.calibration`` (the default mix, checked disjoint from every eval text; ``--calibration``
names another, e.g. ``kjv:Genesis,Exodus``), ``--samples`` windows of ``--seqlen`` tokens, seed 0; the
same token ids go to every method, llm-compressor included. Wall time of each quantization is measured here,
in this run (loading the model and tokenizing the calibration text included for qkit).

llm-compressor is an *optional* benchmark dependency, never a project dependency: where it is not
importable this script says so and skips it; issue 9's figures for it (measured on Ruth alone, with
a Bible calibration, by the issue's author on this 2-core machine, llm-compressor 0.14) are printed marked
as cited, not measured in this run. To measure it (llm-compressor 0.14 pins transformers <= 5.17 and
compressed-tensors 0.19, so in a venv of its own):
``python -m venv /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor && /tmp/llmc/bin/pip install --no-deps -e .``
and run this script with that interpreter (its GPTQ took 113 s on the idle 2-core machine). Its path
below follows llm-compressor's documented ``oneshot`` + ``GPTQModifier`` API.

The default model's published weights are Q4_1 (asymmetric group-32 RTN reproduces them exactly): a row
aligned with that grid can look better than it is; int4-g64 (symmetric, groups of 64) is not aligned.

Run: ``python benchmarks/bench_calibrated.py [--schemes int4-g64] [--methods gptq,awq] [--samples 32]
[--seqlen 512] [--tokens 2048] [--calibration SPEC] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from qkit.api import QuantizeOptions, quantize_model
from qkit.catalog import checked_calibration, eval_texts
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.token_scores import TokenScores
from qkit.methods.calibration import CalibrationOptions, calibration_ids, text_ids
from qkit.models import load, resolve
from qkit.schemes import QuantizedTensor

# issue 9: llm-compressor 0.14 on this 2-core machine, same model, Ruth alone after a Bible calibration (cited, not measured here)
CITED = {
    ("int4-g64", "gptq"): {"perplexity": 19.69, "seconds": 1014.0, "calibration": "32 x 512 tokens of KJV Genesis"},
    ("int4-g64", "awq"): {"perplexity": 22.63, "seconds": 1073.0, "calibration": "16 x 512 tokens"},
    ("int4-g64", "rtn"): {"perplexity": 24.31, "seconds": 0.7, "calibration": "none (its rule: absmax/7.5, clamp [-8, 7])"},
}


def domain_row(scores: dict[str, TokenScores], base: dict[str, TokenScores] | None) -> dict:
    """Per domain: KL and perplexity with their SEs and, against ``base`` (qkit's RTN row of the scheme),
    the paired KL difference and perplexity change."""
    out = {}
    for d, s in scores.items():
        r = {"kld": s.kld, "kld_se": s.kld_se, "perplexity": s.perplexity, "perplexity_se": s.perplexity_se}
        if base is not None:
            r["vs_rtn_kld"], r["vs_rtn_kld_se"] = s.kl_change_against(base[d])
            r["vs_rtn_pct"], r["vs_rtn_se_pct"] = s.change_against(base[d])
        out[d] = r
    return out


def swap_score(lm, tensors: dict, refs: dict[str, CorpusReference]) -> dict[str, TokenScores]:
    """Score ``lm`` on every domain with ``tensors`` (QuantizedTensor or float) swapped in, then restore the originals."""
    originals = {}
    with torch.no_grad():
        for name, value in tensors.items():
            p = lm.get_parameter(name)
            originals[name] = p.detach().clone()
            p.copy_(value.dequantize(p.dtype) if isinstance(value, QuantizedTensor) else value.to(p.dtype))  # torch.Tensor has a dequantize too
    try:
        return {d: ref.score(lm) for d, ref in refs.items()}
    finally:
        with torch.no_grad():
            for name, w in originals.items():
                lm.get_parameter(name).copy_(w)


def run_llmcompressor(directory: Path, ids: torch.Tensor, group: int) -> tuple[object, float]:
    """llm-compressor GPTQ (symmetric int4, ``group`` columns per scale) on ``ids``; returns (model, seconds)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = GPTQModifier(
        ignore=["lm_head"],
        config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
    )
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=ids.shape[0])
    return model.eval(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="int4-g64")
    ap.add_argument("--methods", default="gptq,awq", help="calibrated qkit methods (awq only where qkit.methods.awq exists); "
                    "METHOD+KEY=VALUE adds options, e.g. gptq+scale_rule=full-range+act_order=1")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored per held-out domain (one window)")
    ap.add_argument("--calibration", default=None, help="qkit's --calibration (default: the mix)")
    ap.add_argument("--no-peer", action="store_true", help="skip llm-compressor even where it is installed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    ref_model = resolve(None)
    loaded = load(ref=ref_model, device="cpu")
    lm, tok = loaded.model, loaded.tokenizer
    texts = eval_texts(None)
    checked_calibration(args.calibration, texts)
    refs = {}
    for corpus in texts:
        ids = text_ids(tok, corpus)[: args.tokens]
        refs[corpus.name] = CorpusReference(lm, ids, window=min(2048, args.tokens))
    cal_opts = CalibrationOptions(samples=args.samples, seqlen=args.seqlen, source=args.calibration)
    cal_ids, provenance = calibration_ids(tok, cal_opts)
    methods = [m for m in args.methods.split(",") if m and (not m.startswith("awq") or importlib.util.find_spec("qkit.methods.awq"))]
    have_peer = importlib.util.find_spec("llmcompressor") is not None and not args.no_peer
    rows = [{"row": "reference", "domains": {d: {"perplexity": r.own_scores().perplexity, "perplexity_se": r.own_scores().perplexity_se}
                                             for d, r in refs.items()}, "measured": True}]
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"calibration: {provenance['name']} {args.samples} x {args.seqlen} tokens (ids sha256 {provenance['ids_sha256'][:12]}), "
          f"eval: {', '.join(f'{d} {r.scored_tokens}' for d, r in refs.items())} scored tokens; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for scheme in [s for s in args.schemes.split(",") if s]:
        scores: dict[str, dict[str, TokenScores]] = {}
        with tempfile.TemporaryDirectory(prefix="qkit-bench-") as tmp:
            for variant in ["rtn", *methods]:
                method, *extra = variant.split("+")
                options = None if method == "rtn" else {"calibration_samples": args.samples, "calibration_seqlen": args.seqlen}
                if options is not None and args.calibration is not None:
                    options["calibration"] = args.calibration
                for kv in extra:  # KEY=VALUE, the value parsed as JSON where it parses (1, 0.05, true), else a string
                    key, _, value = kv.partition("=")
                    try:
                        options[key] = json.loads(value)
                    except ValueError:
                        options[key] = value
                t0, c0 = time.perf_counter(), time.process_time()
                r = quantize_model(ref_model, output=Path(tmp) / "out", scheme=scheme, method=method,
                                   method_options=options, collect=True, options=QuantizeOptions(force=True))
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                scores[variant] = swap_score(lm, {**r.replaced, **r.quantized}, refs)
                row = {"row": f"qkit {variant} {scheme}", "seconds": seconds, "cpu_seconds": cpu, "measured": True,
                       "domains": domain_row(scores[variant], None if variant == "rtn" else scores["rtn"])}
                rows.append(row)
                print(json.dumps(row), flush=True)
        group = int(scheme.split("-g")[1]) if "-g" in scheme else None
        widths = sorted({m.in_features for m in lm.modules() if isinstance(m, torch.nn.Linear)})
        if have_peer and group and any(w % group for w in widths):
            # llm-compressor refuses a group that does not divide every width (issue 9: 576 at g128)
            rows.append({"row": f"llm-compressor gptq {scheme}", "measured": True,
                         "note": f"not run: group {group} does not divide the widths {widths}, which llm-compressor refuses"})
        elif have_peer and group:
            peer, seconds = run_llmcompressor(ref_model.directory, cal_ids, group)
            ps = {d: ref.score(peer) for d, ref in refs.items()}
            row = {"row": f"llm-compressor gptq {scheme}", "seconds": seconds, "measured": True,
                   "domains": domain_row(ps, scores["rtn"])}
            if "gptq" in scores:
                row["qkit_gptq_vs_peer"] = {d: dict(zip(("kld", "kld_se"), scores["gptq"][d].kl_change_against(ps[d])))
                                            for d in refs}
            rows.append(row)
        else:
            for (s_name, m), c in CITED.items():
                if s_name == scheme:
                    rows.append({"row": f"llm-compressor {m} {scheme} (issue 9, cited: Ruth only)", "perplexity": c["perplexity"],
                                 "seconds": c["seconds"], "calibration": c["calibration"], "measured": False})
    domains = list(refs)
    print()
    print("KL to the unquantized model per held-out domain (nats); in brackets the paired difference against qkit's "
          "RTN row of the scheme, +- its SE; worst: the largest KL ratio to RTN over the domains")
    print(f"| row | {' | '.join(domains)} | worst vs RTN | quantize wall time (CPU time) | measured in this run |")
    print("|---|" + "---|" * (len(domains) + 3))
    for r in rows:
        if r["row"] == "reference":
            cells = [f"ppl {r['domains'][d]['perplexity']:.2f}" for d in domains]
            worst = ""
        elif "domains" in r:
            dd = r["domains"]
            cells = [f"{dd[d]['kld']:.4f}" + (f" ({dd[d]['vs_rtn_kld']:+.4f} ± {dd[d]['vs_rtn_kld_se']:.4f})" if "vs_rtn_kld" in dd[d] else "")
                     for d in domains]
            ratios = [dd[d]["kld"] / (dd[d]["kld"] - dd[d]["vs_rtn_kld"]) for d in domains if "vs_rtn_kld" in dd[d]]
            worst = f"{max(ratios):.2f}x" if ratios else ""
        else:
            cells = [r.get("note", f"ppl {r.get('perplexity', math.nan):.2f} (Ruth)")] + [""] * (len(domains) - 1)
            worst = ""
        secs = (f"{r['seconds']:,.1f} s" if "seconds" in r else "") + (f" ({r['cpu_seconds']:,.0f} s)" if "cpu_seconds" in r else "")
        print(f"| {r['row']} | {' | '.join(cells)} | {worst} | {secs} | {'yes' if r['measured'] else 'no (cited)'} |")
    peer_rows = [r for r in rows if r["row"].startswith("llm-compressor gptq") and "qkit_gptq_vs_peer" in r]
    for p in peer_rows:
        print(f"\nqkit gptq - {p['row']} per domain (KL, paired SE): "
              + ", ".join(f"{d} {v['kld']:+.4f} ± {v['kld_se']:.4f}" for d, v in p["qkit_gptq_vs_peer"].items()))
    if not have_peer:
        why = "skipped (--no-peer)" if args.no_peer else "not installed here (an optional benchmark dependency)"
        print(f"\nllm-compressor {why}: its rows, where shown, are issue 9's figures (Ruth alone), not measured in this run.")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "calibration": provenance}, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
