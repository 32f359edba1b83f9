"""GGUF files of the default model from llama.cpp, auto-round and qkit, at the same types, scored in llama.cpp.

    python benchmarks/build_llama_ref.py --tools        # once: llama-quantize, -imatrix, -perplexity, -tokenize
    python benchmarks/bench_gguf_peers.py [--types q2_k-llama,q3_k_m,q4_k_m,iq4_xs-llama] [--peers DIR]
                                          [--chunks N] [--threads 2] [--json PATH]

In one run, with the llama.cpp ``build_llama_ref.py`` pins:

1. ``convert_hf_to_gguf.py --outtype f32``: the reference GGUF.
2. ``llama-imatrix -m F32.gguf -f cal.txt -c 512``: one importance matrix, given to every file that uses
   one. ``cal.txt`` is qkit's own calibration windows (``--calibration``; default qkit's mix,
   ``docs/corpora.md``: 32 windows of 512 tokens from ten texts in seven domains), decoded to text, so
   llama-imatrix and qkit's GPTQ Hessian see the same tokens (re-tokenized: within a few tokens a window).
   ``--calibration kjv:Genesis,Exodus`` gives the Bible-only runs of earlier tables.
3. For each type: ``llama-quantize --imatrix imatrix.gguf F32.gguf OUT TYPE`` (llama.cpp's own whole file),
   and qkit's ``quantize --format gguf --scheme TYPE --imatrix imatrix.gguf`` with ``--method rtn`` (the same
   bytes as llama-quantize's, checked) and ``--method gptq`` (GPTQ's error feedback inside the type's blocks;
   its Hessian from the calibration text's default windows; token_embd and output by RTN, as llama.cpp
   writes them). Each file's bytes are printed: llama.cpp's and qkit's files of a type hold the same tensor
   bytes, the token embedding at llama.cpp's type in both (docs/gguf.md, "Whole files"). Until issue 49's
   whole files (2026-12-07) this step ran ``--token-embedding-type f32`` and qkit kept the embedding f32.
3b. ``--plan-gptq RECIPE[,...]``: ``qkit plan --target-scheme RECIPE --method gptq --imatrix imatrix.gguf``
   (the candidates priced for GPTQ's codes; the Q4_1-grid types q4_1 and q5_1 left out, ``PLAN_CANDIDATES``)
   then ``qkit quantize --plan PLAN --method gptq --imatrix imatrix.gguf``: the planned mix at the recipe's
   tensor bytes, compared with llama.cpp's imatrix file of that recipe. Two controls at the same bytes:
   the plan priced for RTN and written by RTN (``qkit plan --method rtn --imatrix``, then ``quantize --plan``),
   and that RTN plan's types written by GPTQ (``--tensor-type`` from its ``--emit-tensor-types`` file, since
   ``quantize --plan`` refuses GPTQ on a plan priced for RTN): what pricing for GPTQ adds over GPTQ alone.
4. Any ``*.gguf`` under ``--peers`` (another tool's files, e.g. auto-round's) is scored too, with its bytes
   as written (its token embedding may be quantized: compare its size before its KL). ``--match-peers``:
   for each peer file, qkit's RTN+imatrix and GPTQ+imatrix files with exactly the peer's type for every
   block tensor and its token embedding (``--tensor-type`` words read from the peer's GGUF with the ``gguf``
   package, the embedding ``--include``d), each paired with the peer.
5. Every file scored by llama.cpp itself, on each held-out domain of qkit eval's suite (Ruth, the GPL-3
   licence, Python's argparse.py, Much Ado About Nothing in the chat template; none in the calibration,
   checked): ``llama-perplexity --kl-divergence-base`` from the F32 file on the domain's text (``-c 512``,
   its first ``--chunks`` chunks), then ``--kl-divergence`` per file with a copy of llama-perplexity that
   also writes its per-token values (``bench_llama_cpp.build_kld_dump_tool``), so that two files' KL are
   paired on the same positions: per domain, mean KL ± SE per file, and per type each file against
   llama.cpp's own file of that type (difference ± paired SE and the ratio); the summary's last column is
   the worst domain's ratio.

The default model's weights were published as Q4_1: a type whose grid holds Q4_1's blocks can round a
tensor back onto the source, and there every method is exact (``bench_gptq_ggml.py --grid`` lists them);
the whole-file KL below includes those tensors, for every file alike. Seconds are wall time on a machine
shared with other jobs: upper bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llama_cpp as b  # noqa: E402
import build_llama_ref as blr  # noqa: E402

from qkit.api import QuantizeOptions, plan_model, quantize_model  # noqa: E402
from qkit.assets import cache_dir  # noqa: E402
from qkit.models import read_config, resolve  # noqa: E402
from qkit.converted import takes  # noqa: E402
from qkit.export.gguf import read_kv_fields, source_gguf  # noqa: E402
from qkit.export.gguf.converter import convert_f32  # noqa: E402
from qkit.export.gguf.requantize import quantize_gguf  # noqa: E402
from qkit.plan import PlanOptions  # noqa: E402
from qkit.catalog import checked_calibration, eval_texts  # noqa: E402
from qkit.methods.calibration import CalibrationOptions, calibration_ids, model_text  # noqa: E402
from qkit.models import load_tokenizer  # noqa: E402

# qkit's scheme name -> llama-quantize's ftype
FTYPES = {"q2_k-llama": "Q2_K", "q3_k_s": "Q3_K_S", "q3_k_m": "Q3_K_M", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M",
          "iq4_xs-llama": "IQ4_XS", "iq4_nl-llama": "IQ4_NL", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
CTX = 512
# the planned mix's candidates: the ladder without q4_1 and q5_1, whose grids hold the published Q4_1 blocks
PLAN_CANDIDATES = ("q2_k", "q3_k", "iq4_xs", "iq4_nl", "q4_0", "q4_k", "q5_0", "q5_k", "q6_k", "q8_0")


def paired(a: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """mean(a - c) and its standard error over the positions (a and c scored on the same positions)."""
    d = a.astype(np.float64) - c.astype(np.float64)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def peer_types(path: Path) -> list[str]:
    """``--tensor-type`` words giving every block tensor of the GGUF file ``path`` the type it has there."""
    import gguf

    return [f"^{re.escape(t.name)}$={t.tensor_type.name.lower()}" for t in gguf.GGUFReader(str(path)).tensors
            if ((t.name.startswith("blk.") and t.name.endswith(".weight")) or t.name == "token_embd.weight")
            and len(t.shape) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16")]


def _embedding(words: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``--include`` for the token embedding where ``words`` set its type (``-s q8_0`` targets the projections only)."""
    return ("model.embed_tokens.weight",) if any("token_embd" in w for w in words) else ()


def converted_f32(ref, out: Path) -> dict:
    """The F32 GGUF llama.cpp's tools read for a model of another architecture than llama/qwen2: the
    converter's (``qkit.converted``), with the source GGUF's own tokenizer fields for a model qkit converted
    from one (the pinned Gemma 3), as ``qkit quantize --format gguf`` writes them."""
    t = time.perf_counter()
    source = source_gguf(ref.directory, ref)
    fields = None if source is None else [f for f in read_kv_fields(source) if f[0].startswith("tokenizer.")]
    quantize_gguf(convert_f32(ref.directory, vocab=source is None), out, "F32", tokenizer=fields, record=False, force=True)
    return {"command": "qkit.converted: convert_f32 + quantize_gguf(F32" + (", the source GGUF's tokenizer)" if fields else ")"),
            "seconds": round(time.perf_counter() - t, 2), "bytes": out.stat().st_size}


def calibration_text(model_dir: Path, source: str | None, out: Path) -> dict:
    """qkit's calibration windows for ``source`` (None: the default mix), decoded and joined, written to
    ``out`` for llama-imatrix; returns their provenance (name, windows, ids_sha256, parts' shares)."""
    tok = load_tokenizer(model_dir)
    from transformers import AutoConfig

    ids, prov = calibration_ids(tok, CalibrationOptions(source=source).fitted(AutoConfig.from_pretrained(model_dir)))
    out.write_text("".join(tok.decode(row.tolist()) for row in ids), encoding="utf-8")
    return {k: prov.get(k) for k in ("name", "sha256", "samples", "seqlen", "ids_sha256", "parts")}


def domain_texts(model_dir: Path, work: Path) -> dict[str, Path]:
    """Each held-out domain of qkit eval's suite as the model is given it (``methods.calibration.model_text``: dialogue
    in the chat template), one file each under ``work``."""
    tok = load_tokenizer(model_dir)
    out = {}
    for corpus in eval_texts(None):
        path = work / f"eval-{corpus.name}.txt"
        path.write_text(model_text(corpus, tok), encoding="utf-8")
        out[corpus.name] = path
    return out


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q2_k-llama,q3_k_m,q4_k_m,iq4_xs-llama")
    ap.add_argument("--peers", type=Path, default=None, help="a folder of other tools' GGUF files to score too")
    ap.add_argument("--chunks", type=int, default=6, help="eval chunks of 512 tokens per domain (Ruth holds 6)")
    ap.add_argument("--calibration", default=None,
                    help="qkit's --calibration for both tools (default: qkit's mix; kjv:Genesis,Exodus: the Bible)")
    ap.add_argument("--holdout", type=int, default=0, help="gptq --holdout N (windows held out, RTN's codes where better)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model qkit resolves (default: the default model; gemma3-270m)")
    ap.add_argument("--hessian-shrink", type=float, default=None, help="gptq --hessian-shrink S for every GPTQ file")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="score the files a previous run wrote (its seconds not re-measured)")
    ap.add_argument("--match-peers", action="store_true", help="qkit files at each peer file's block types (step 4)")
    ap.add_argument("--plan-gptq", default="", help="recipes (e.g. q4_k_m) to plan a GPTQ mix at the bytes of (step 3b)")
    args = ap.parse_args(argv)
    if not all(blr.tool_path(t).exists() for t in ("llama-quantize", "llama-imatrix", "llama-perplexity")):
        print("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
        return 0
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        raise SystemExit(f"--types: {', '.join(unknown)} not one of {', '.join(FTYPES)}")
    work = cache_dir() / ("bench_gguf_peers" + (f"-{args.model}" if args.model else ""))
    work.mkdir(parents=True, exist_ok=True)
    ref = resolve(args.model)
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "llama_cpp_commit": blr.commit(), "threads": args.threads,
                 "load_average_start": os.getloadavg()[0], "files": {}, "steps": {}}
    f32 = work / "F32.gguf"
    if not f32.exists():
        doc["steps"]["convert"] = converted_f32(ref, f32) if takes("gguf", read_config(ref.directory)) else \
            b.convert_f32(ref.directory, f32, work)
    cal = work / "cal.txt"
    doc["calibration"] = calibration_text(ref.directory, args.calibration, cal)
    domains = domain_texts(ref.directory, work)
    checked_calibration(args.calibration, eval_texts(None))
    im = work / "imatrix.gguf"
    cmd = [blr.tool_path("llama-imatrix"), "-m", f32, "-f", cal, "-c", CTX, "-o", im, "-t", args.threads]
    sec = math.nan
    if not (args.reuse and im.exists()):
        sec, p = b.sh(cmd)
        b.check(p, "llama-imatrix")
    doc["steps"]["imatrix"] = {"command": f"llama-imatrix -m F32.gguf -f cal.txt -c {CTX}", "seconds": round(sec, 1)}
    print(f"imatrix on {doc['calibration']['name']}: {sec:.1f} s", flush=True)
    method_options = {"holdout": args.holdout} if args.holdout else {}
    if args.hessian_shrink is not None:
        method_options["hessian_shrink"] = args.hessian_shrink
    if args.calibration is not None:
        method_options["calibration"] = args.calibration

    files: dict[str, dict] = {}

    def add(name: str, path: Path, seconds: float, how: str, type_: str | None) -> None:
        files[name] = {"path": str(path), "bytes": path.stat().st_size, "sha256_16": b._file_digest(path)[:16],
                       "seconds": round(seconds, 1), "how": how, "type": type_}
        print(f"  {name:32s} {path.stat().st_size / 1e6:8.2f} MB  {seconds:7.1f} s", flush=True)

    for t in types:
        ft = FTYPES[t]
        out = work / f"llama-{t}+imatrix.gguf"
        if args.reuse and all(p.exists() for p in (out, *(work / f"qkit-{t}+{m}+imatrix.gguf" for m in ("rtn", "gptq")))):
            add(f"llama.cpp {t}+imatrix", out, math.nan, "(reused)", t)
            for method in ("rtn", "gptq"):
                add(f"qkit {t}+{method}+imatrix", work / f"qkit-{t}+{method}+imatrix.gguf", math.nan, "(reused)", t)
            continue
        out.unlink(missing_ok=True)
        sec, p = b.sh([blr.tool_path("llama-quantize"), "--imatrix", im, f32, out, ft, args.threads])
        b.check(p, f"llama-quantize {ft}")
        add(f"llama.cpp {t}+imatrix", out, sec, f"llama-quantize --imatrix imatrix.gguf F32.gguf OUT {ft}", t)
        for method in ("rtn", "gptq"):
            q = work / f"qkit-{t}+{method}+imatrix.gguf"
            _, sec = timed(quantize_model, ref, output=q, scheme=t, method=method, format="gguf",
                           options=QuantizeOptions(force=True, imatrix=str(im),
                                                   method_options=method_options if method == "gptq" else None))
            add(f"qkit {t}+{method}+imatrix", q, sec,
                f"qkit quantize --format gguf --scheme {t} --method {method} --imatrix imatrix.gguf", t)
        files[f"qkit {t}+rtn+imatrix"]["same_bytes_as_llama_cpp"] = b.compare_files(out, work / f"qkit-{t}+rtn+imatrix.gguf")["identical"]
    for t in [t for t in args.plan_gptq.split(",") if t]:
        cands = ",".join(PLAN_CANDIDATES)
        popts = PlanOptions(format="gguf", target_scheme=t, candidates=PLAN_CANDIDATES, calibration=args.calibration)
        plan_cmd = f"qkit plan --format gguf --target-scheme {t} --candidates {cands} --imatrix imatrix.gguf"
        rplan, tt = work / f"plan-{t}+rtn+imatrix.json", work / f"plan-{t}+rtn+imatrix.tensor-types"
        # the planned GPTQ mix, then the controls: the RTN-priced plan at the same budget, written by RTN and by GPTQ
        rows = [(f"qkit plan@{t}+gptq+imatrix", work / f"plan-{t}+gptq+imatrix.json", "gptq",
                 f"{plan_cmd} --method gptq -o PLAN; qkit quantize --plan PLAN --method gptq --imatrix imatrix.gguf"),
                (f"qkit plan@{t}+rtn+imatrix", rplan, "rtn",
                 f"{plan_cmd} -o PLAN; qkit quantize --plan PLAN --imatrix imatrix.gguf"),
                (f"qkit plan@{t}(rtn-priced)+gptq+imatrix", None, "gptq",
                 f"{plan_cmd} -o PLAN --emit-tensor-types TT; qkit quantize -s q8_0 --tensor-type $(cat TT) --method gptq "
                 "--imatrix imatrix.gguf")]
        for label, plan, method, how in rows:
            q = work / f"{label.replace(' ', '-')}.gguf"
            if args.reuse and q.exists():
                add(label, q, math.nan, "(reused)", t)
                continue
            sec_plan = 0.0
            if plan is not None:
                run = dataclasses.replace(popts, imatrix=str(im), force=True, method=method,
                                          emit_tensor_types=tt if method == "rtn" else None)
                r, sec_plan = timed(plan_model, ref, options=run, output=plan)
                opts = QuantizeOptions(force=True, imatrix=str(im), plan=str(plan),
                                       method_options=method_options if method == "gptq" else None)
            else:  # the plan's types, the embedding's among them (a whole-file plan chooses it too)
                words = tuple(tt.read_text().split())
                opts = QuantizeOptions(force=True, imatrix=str(im), tensor_types=words, include=_embedding(words),
                                       method_options=method_options)
            _, sec = timed(quantize_model, ref, output=q, method=method, format="gguf",
                           **({} if plan is not None else {"scheme": "q8_0"}), options=opts)
            add(label, q, sec_plan + sec, how, t)
            if plan is not None:
                files[label].update(plan_seconds=round(sec_plan, 1), predicted_kl=r.plan.predicted_kl,
                                    check_kl=r.plan.check.get("measured_kl"), planned_bytes=r.plan.nbytes,
                                    budget_bytes=r.plan.target.get("budget_bytes"), types=r.plan.record()["types"])
    written: set[Path] = set()
    for peer in sorted(args.peers.glob("**/*.gguf")) if args.peers else []:
        record = peer.with_suffix(".json")
        how = json.loads(record.read_text()).get("command", "") if record.is_file() else ""
        kind = next((t for t in types if t.split("-")[0] in peer.name.lower()), None)
        add(f"peer {peer.stem}", peer, 0.0, how, kind)
        if args.match_peers:
            words = peer_types(peer)
            key = hashlib.sha256("\n".join(words).encode()).hexdigest()[:12]  # peers of the same types share qkit's files
            for method in ("rtn", "gptq"):
                label = f"qkit @{peer.stem}+{method}+imatrix"
                q = work / f"qkit-at-{key}+{method}+imatrix.gguf"
                sec = math.nan
                if not (q in written or (args.reuse and q.exists())):
                    written.add(q)
                    _, sec = timed(quantize_model, ref, output=q, scheme="q8_0", method=method, format="gguf",
                                   options=QuantizeOptions(force=True, imatrix=str(im), tensor_types=tuple(words),
                                                           include=_embedding(words),
                                                           method_options=method_options if method == "gptq" else None))
                add(label, q, sec, f"qkit quantize -s q8_0 --tensor-type WORDS --method {method} --imatrix imatrix.gguf "
                    f"(WORDS: every block tensor's type in {peer.name}, and its token_embd's)", kind)
                files[label]["peer"] = f"peer {peer.stem}"

    print("scoring in llama.cpp", flush=True)
    tool = b.build_kld_dump_tool()
    kl: dict[str, dict[str, np.ndarray]] = {}  # domain -> file -> per-position KL
    doc["domains"] = {}
    for domain, text in domains.items():
        base = work / f"F32-{domain}.kld"
        base_run = b.llama_kld_base(f32, text, CTX, args.threads, base, args.chunks)
        if base_run.get("error"):
            raise SystemExit(f"{domain}: {base_run['error']}")
        doc["domains"][domain] = base_run
        kl[domain] = {}
        print(f" {domain}: {base_run.get('chunks')} chunks", flush=True)
        for name, f in files.items():
            dump = work / "kld.dump"
            r = b.llama_kl_divergence(Path(f["path"]), base, args.threads, tool=tool, dump=dump)
            scores = f.setdefault("domains", {})
            if r.get("error"):
                scores[domain] = {"error": r["error"][-400:]}
                print(f"  {name}: llama.cpp refused it: {r['error'][-200:]}", flush=True)
                continue
            values = b.read_kld_dump(dump)
            kl[domain][name] = values["kld"]
            scores[domain] = {"kl": float(values["kld"].mean()),
                              "kl_se": float(values["kld"].std(ddof=1) / math.sqrt(len(values))),
                              "same_top": float(values["same_top"].mean()), "positions": len(values),
                              "ppl": float(np.exp(values["nll"].astype(np.float64).mean())), "llama_stats": r["stats"]}
            print(f"  {name:40s} KL {scores[domain]['kl']:.5f} ± {scores[domain]['kl_se']:.5f}  "
                  f"same top {100 * scores[domain]['same_top']:.1f}%", flush=True)

    def versus(name: str, other: str, key: str) -> None:
        """Per domain, ``name`` minus ``other`` (paired on the same positions) and the ratio of their means."""
        out = {}
        for domain, k in kl.items():
            if name in k and other in k:
                d, se = paired(k[name], k[other])
                out[domain] = {"kl_difference": d, "paired_se": se, "ratio": float(k[name].mean() / k[other].mean())}
        if out:
            files[name][key] = {"file": other, "bytes_ratio": files[name]["bytes"] / files[other]["bytes"], "domains": out,
                                "worst_ratio": max(v["ratio"] for v in out.values()),
                                "beyond_2se_everywhere": all(v["kl_difference"] < -2 * v["paired_se"] for v in out.values())}

    for name, f in files.items():
        own = f"llama.cpp {f['type']}+imatrix"
        if name != own and own in files:
            versus(name, own, "versus_llama_cpp")
        if f.get("peer") in files:  # qkit at a peer's types, paired with the peer
            versus(name, f["peer"], "versus_peer")
    for t in [t for t in args.plan_gptq.split(",") if t]:  # the controls against the GPTQ-priced plan, paired
        for name in (f"qkit plan@{t}+rtn+imatrix", f"qkit plan@{t}(rtn-priced)+gptq+imatrix"):
            if name in files:
                versus(name, f"qkit plan@{t}+gptq+imatrix", "versus_gptq_priced_plan")
    doc["files"] = files
    short = {d: d.split("-")[0][:8] for d in kl}
    print()
    print("KL per domain (llama.cpp, -c 512); x: the ratio to llama.cpp's imatrix file of the type, (Δ/SE): the paired difference in SE")
    print(f"{'file':40s} {'MB':>7s} " + " ".join(f"{short[d]:>22s}" for d in kl) + f" {'worst x':>8s}")
    for name, f in files.items():
        v = f.get("versus_llama_cpp", {}).get("domains", {})
        cells = []
        for d in kl:
            sc = f.get("domains", {}).get(d, {})
            if "kl" not in sc:
                cells.append(f"{'-':>22s}")
            elif d in v:
                cells.append(f"{sc['kl']:.4f} {v[d]['ratio']:5.2f}x ({v[d]['kl_difference'] / v[d]['paired_se']:+5.1f})"
                             if v[d]["paired_se"] > 0 else f"{sc['kl']:.4f} {v[d]['ratio']:5.2f}x (  =  )")
            else:
                cells.append(f"{sc['kl']:22.4f}")
        worst = f.get("versus_llama_cpp", {}).get("worst_ratio")
        print(f"{name:40s} {f['bytes'] / 1e6:7.2f} " + " ".join(cells) + (f" {worst:8.3f}" if worst else ""))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
