"""The importance matrix and the GGUF ladder against llama.cpp's own tools, on the default model.

    python benchmarks/build_llama_ref.py --tools      # once: llama-quantize, -imatrix, -perplexity, -tokenize
    python benchmarks/bench_imatrix.py [--json PATH] [--repeats 3] [--threads 1,2] [--skip-bytes] [--skip-speed]

In one run, with the llama.cpp that ``build_llama_ref.py`` pins:

1. **Collection.** ``llama-imatrix -m F32.gguf -f cal.txt -c 512 --chunks 32 -t T`` (the pinned calibration
   text, Genesis+Exodus) against ``qkit.methods.imatrix.collect`` on the same token ids (llama-tokenize's,
   checked equal to the HF tokenizer's) in this process at T torch threads, and against one plain forward
   pass of the same model over the same chunks (``model(input_ids)``, logits included), median of
   ``--repeats``. Counts must be equal; the sums are compared per value (relative difference). Part of the
   difference is llama.cpp's arithmetic on the activations (its kernels vs torch fp32), part its fp32
   sequential accumulation over 16,384 tokens; qkit sums in fp64.
2. **Bytes.** For every llama-quantize recipe of the ladder and every uniform type (``--pure``), with and
   without the importance matrix: ``llama-quantize [--imatrix ref.gguf] F32.gguf OUT FTYPE T`` (a recipe's
   whole file, token_embd at llama.cpp's type, as qkit's; for ``--pure`` with ``--token-embedding-type f32``,
   as qkit's uniform types keep it) against ``quantize_model(scheme, format="gguf", imatrix=...)``; the 210
   block projections compared by type and bytes (``bench_llama_cpp.compare_files``). Until issue 49's whole
   files (2026-12-07) every row ran ``--token-embedding-type f32`` and qkit kept the embedding f32.
3. **Speed.** The same quantizations timed (the recipes in ``TIMED``): llama-quantize (whole process: load, quantize, write) against
   ``quantize_model`` (also load, quantize, write), at each ``--threads``, median of ``--repeats``; and each
   type's encoder alone over the 210 matrices against a plain int8 copy of the same matrices
   (``torch.round(w * s).to(torch.int8)`` with a per-row scale: the floor of any per-row quantizer).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llama_cpp as b  # noqa: E402
import build_llama_ref as blr  # noqa: E402
from _timing import round_robin  # noqa: E402

from qkit.api import QuantizeOptions, quantize_model  # noqa: E402
from qkit.assets import cache_dir  # noqa: E402
from qkit.checkpoint import iter_tensors  # noqa: E402
from qkit.methods.imatrix import ImatrixOptions, collect, imatrix_ids, read  # noqa: E402
from qkit.models import load, read_config, resolve  # noqa: E402
from qkit.schemes import get_scheme, quantize_tensor  # noqa: E402
from qkit.texts import load_calibration_text  # noqa: E402
from qkit.threads import one_torch_thread  # noqa: E402, F401
from qkit.transform import is_block_projection  # noqa: E402

RECIPES = [("q2_k-llama", "Q2_K"), ("q3_k_s", "Q3_K_S"), ("q3_k_m", "Q3_K_M"), ("q3_k_l", "Q3_K_L"),
           ("iq4_nl-llama", "IQ4_NL"), ("iq4_xs-llama", "IQ4_XS"), ("q4_k_s", "Q4_K_S"), ("q4_k_m", "Q4_K_M"),
           ("q5_k_s", "Q5_K_S"), ("q5_k_m", "Q5_K_M"), ("q6_k", "Q6_K"), ("q8_0", "Q8_0")]
# uniform types: llama-quantize --pure with an ftype whose default type is that type
PURE = [("q2_k", "Q2_K"), ("q3_k", "Q3_K_M"), ("q4_k", "Q4_K_M"), ("q5_k", "Q5_K_M"), ("iq4_nl", "IQ4_NL"),
        ("iq4_xs", "IQ4_XS"), ("q4_0", "Q4_0"), ("q4_1", "Q4_1"), ("q5_0", "Q5_0"), ("q5_1", "Q5_1")]
CHUNKS, CTX = 32, 512
# timed at every --threads, --repeats times (the others are compared once, for their bytes)
TIMED = {"q2_k-llama", "q3_k_m", "iq4_xs-llama", "q4_k_m", "q5_k_m", "q6_k"}


def collection(work: Path, f32: Path, threads: list[int], repeats: int) -> tuple[dict, Path]:
    cal = work / "cal.txt"
    cal.write_text(load_calibration_text(None).text)
    ref_im = work / "llama-imatrix.gguf"
    res: dict = {"command": f"llama-imatrix -m F32.gguf -f cal.txt -c {CTX} --chunks {CHUNKS} -t T"}
    for t in threads:
        times = []
        for _ in range(repeats):
            sec, p = b.sh([blr.tool_path("llama-imatrix"), "-m", f32, "-f", cal, "-c", CTX, "--chunks", CHUNKS,
                           "-o", ref_im, "-t", t])
            b.check(p, "llama-imatrix")
            times.append(sec)
        res[f"llama_t{t}_s"] = round(statistics.median(times), 3)
    ref = resolve(None)
    loaded = load(ref=ref)
    config = read_config(ref.directory)
    opts = ImatrixOptions()
    chunks, prov = imatrix_ids(loaded.tokenizer, opts)
    lids = torch.tensor(b.llama_tokens(f32, cal)[: CHUNKS * CTX]).view(CHUNKS, CTX)
    res["same_token_ids"] = bool(torch.equal(lids, chunks))
    res["bos"] = prov["bos"]
    model = loaded.model
    got = {}

    def run_collect() -> None:
        got["m"] = collect(model, config, chunks, opts)

    def run_forward() -> None:
        with torch.inference_mode():
            for i in range(0, CHUNKS, opts.batch):
                model(input_ids=chunks[i : i + opts.batch], use_cache=False)

    for t in threads:
        torch.set_num_threads(t)
        times = round_robin({"collect": run_collect, "forward": run_forward}, repeats)
        c, f = statistics.median(times["collect"]), statistics.median(times["forward"])
        res[f"qkit_t{t}"] = {"collect_s": round(c, 3), "forward_s": round(f, 3), "collect_over_forward": round(c / f, 3)}
    ours, theirs = got["m"], read(ref_im)
    rel, counts_equal = [], True
    for n, e in theirs.entries.items():
        f = ours.entries[n]
        counts_equal &= bool(np.array_equal(e.counts, f.counts))
        rel.append((np.abs(e.sums - f.sums) / np.maximum(np.abs(e.sums), 1e-30)).ravel())
    r = np.concatenate(rel)
    res["entries"] = {"llama": len(theirs.entries), "qkit": len(ours.entries), "same_names": set(theirs.entries) == set(ours.entries)}
    res["counts_equal"] = counts_equal
    res["sums_relative_difference"] = {"median": float(np.median(r)), "p99": float(np.quantile(r, 0.99)), "max": float(r.max())}
    return res, ref_im


def bytes_and_speed(work: Path, f32: Path, im: Path, threads: list[int], repeats: int, speed: bool) -> dict:
    out: dict = {}
    for kind, table in (("recipe", RECIPES), ("pure", PURE)):
        for scheme, ftype in table:
            for weighted in (False, True):
                key = f"{scheme}{'+imatrix' if weighted else ''}"
                lq = work / f"llama-{key}.gguf"
                qk = work / f"qkit-{key}.gguf"
                cmd = [blr.tool_path("llama-quantize"), *(["--imatrix", im] if weighted else []),
                       *(["--pure", "--token-embedding-type", "f32"] if kind == "pure" else []), f32, lq, ftype]
                opts = QuantizeOptions(scheme=scheme, format="gguf", imatrix=str(im) if weighted else None, force=True)
                row: dict = {"llama_quantize": " ".join(["llama-quantize", *map(str, cmd[1:-3]), "F32.gguf", "OUT.gguf", ftype])}
                timed = speed and scheme in TIMED
                times_l: dict[int, list[float]] = {t: [] for t in threads}
                times_q: dict[int, list[float]] = {t: [] for t in threads}
                for t in threads if timed else threads[:1]:
                    for _ in range(repeats if timed else 1):
                        lq.unlink(missing_ok=True)
                        sec, p = b.sh([*cmd, t])
                        b.check(p, f"llama-quantize {key}")
                        times_l[t].append(sec)
                        torch.set_num_threads(t)
                        t0 = time.perf_counter()
                        quantize_model(None, output=qk, options=opts)
                        times_q[t].append(time.perf_counter() - t0)
                cmp = b.compare_files(lq, qk)
                row.update({"identical": cmp["identical"], "blocks_compared": cmp["blocks_compared"],
                            "blocks_differing": cmp["blocks_differing"], "type_mismatch": len(cmp["type_mismatch"]),
                            "types": cmp["types_llama_qkit"]})
                if timed:
                    for t in threads:
                        ls, qs = statistics.median(times_l[t]), statistics.median(times_q[t])
                        row[f"t{t}"] = {"llama_s": round(ls, 3), "qkit_s": round(qs, 3), "qkit_over_llama": round(qs / ls, 3)}
                out[key] = row
                print(f"  {key:22s} identical={row['identical']} blocks_differing={row['blocks_differing']}"
                      + "".join(f"  t{t}: {row[f't{t}']['qkit_s']:.2f}s vs {row[f't{t}']['llama_s']:.2f}s" for t in threads if f"t{t}" in row),
                      flush=True)
    return out


def encoder_speed(im: Path, repeats: int) -> dict:
    """Each type's encoder over the 210 projections (one thread), against a plain int8 copy."""
    ref = resolve(None)
    mats = {n: t.float().contiguous() for n, t in iter_tensors(ref.directory) if is_block_projection(n, tuple(t.shape))}
    config = read_config(ref.directory)
    from qkit.methods.imatrix import quant_weights_for

    matrix = read(im)
    torch.set_num_threads(1)

    def int8_copy() -> None:
        for w in mats.values():
            s = 127.0 / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            torch.round(w * s).to(torch.int8)

    fns = {"int8 copy": int8_copy}
    for name in ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]:
        s = get_scheme(name)
        qw = quant_weights_for(matrix, config, {n: tuple(w.shape) for n, w in mats.items()}, dict.fromkeys(mats, s))
        fns[name] = lambda s=s: [quantize_tensor(w, s, name=n) for n, w in mats.items()]
        fns[name + "+imatrix"] = lambda s=s, qw=qw: [quantize_tensor(w, s, name=n, quant_weights=qw.get(n)) for n, w in mats.items()]
    times = round_robin(fns, repeats)
    base = statistics.median(times["int8 copy"])
    weights = sum(w.numel() for w in mats.values())
    return {k: {"seconds": round(statistics.median(v), 4), "over_int8_copy": round(statistics.median(v) / base, 2),
                "ns_per_weight": round(statistics.median(v) / weights * 1e9, 2)} for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--skip-bytes", action="store_true")
    p.add_argument("--skip-speed", action="store_true", help="bytes only (one run per file)")
    args = p.parse_args(argv)
    if not all(blr.tool_path(t).exists() for t in ("llama-quantize", "llama-imatrix", "llama-tokenize")):
        print("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
        return 0
    threads = [int(x) for x in args.threads.split(",")]
    work = cache_dir() / "bench_imatrix"
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "F32.gguf"
    if not f32.exists():
        b.convert_f32(resolve(None).directory, f32, work)
    doc: dict = {"machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count()},
                 "llama_cpp_commit": blr.commit(), "threads": threads, "repeats": args.repeats,
                 "date": time.strftime("%Y-%m-%d")}
    print("[1] collection", flush=True)
    doc["collection"], im = collection(work, f32, threads, args.repeats)
    print(json.dumps(doc["collection"], indent=1), flush=True)
    if not args.skip_bytes:
        print("[2-3] bytes and speed against llama-quantize", flush=True)
        doc["ladder"] = bytes_and_speed(work, f32, im, threads, args.repeats, not args.skip_speed)
    if not args.skip_speed:
        print("[3] encoders against a plain int8 copy (1 thread)", flush=True)
        doc["encoders"] = encoder_speed(im, args.repeats)
        print(json.dumps(doc["encoders"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
