"""Benchmark: llama.cpp's block formats in qkit, over the default model's 210 projection matrices.

Run:  python benchmarks/bench_ggml.py [--repeats 3] [--threads N] [--schemes q8_0,...] [--synthetic] [--json PATH]

Everything is measured in the same run on the same fp32 matrices in memory (the default model's block
projections, or ``--synthetic``: random matrices of the same shapes, 576x576, 192x576, 1536x576,
576x1536, 30 layers). Rows are timed round-robin (every row once per round, after a warm-up round);
times are medians over rounds, ratios medians of same-round ratios, so load that drifts between rounds
cancels. Besides wall time, CPU time of this process (``time.process_time``, all its threads) is
reported: on a shared machine it is the better measure of the work itself.

* peer ``w.to(int8)``: a plain fp32 -> int8 copy of every matrix (the issue's target: every scheme within 10x);
* each scheme: ``qkit.schemes.quantize_tensor`` over every matrix. For q4_k / q6_k the 576-wide matrices
  take llama.cpp's fallback (q5_0 / q8_0, ``tensor_type_fallback``): the types actually written are listed;
* peer ``gguf numpy``: ``gguf.quants.quantize`` (the gguf package's numpy reference) for the 32-block types;
* peer ``llama.cpp``: llama.cpp's reference quantizer (``ggml_quantize_chunk``, one thread, the per-row
  work of ``llama-quantize``) with the same resolved type per matrix, when built by
  ``benchmarks/build_llama_ref.py`` (else skipped);
* kernel rows ``q4_k/q6_k down_proj``: the 30 1536-wide down_proj matrices, the only ones the k-quants
  take themselves, against llama.cpp on the same (the issue's target: q4_k within 2x of llama.cpp).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from qkit.schemes import get_scheme, quantize_tensor

SCHEMES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def load_matrices(synthetic: bool) -> list[tuple[str, torch.Tensor]]:
    if not synthetic:
        try:
            from qkit.checkpoint import iter_tensors
            from qkit.models import resolve
            from qkit.transform import is_block_projection

            d = resolve(None).directory
            return sorted((n, t.float().contiguous().clone()) for n, t in iter_tensors(d) if is_block_projection(n, tuple(t.shape)))
        except Exception as exc:  # noqa: BLE001 - fall back to synthetic shapes
            print(f"default model unavailable ({exc}); using synthetic matrices")
    gen = torch.Generator().manual_seed(0)
    projs = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [(f"model.layers.{i}.{p}.weight", torch.randn(s, generator=gen) * 0.02) for i in range(30) for p, s in zip(projs, SHAPES)]


def reference():
    spec = importlib.util.spec_from_file_location("build_llama_ref", Path(__file__).with_name("build_llama_ref.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load()


def round_robin(fns: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall and process CPU seconds of every fn, once per round, after one warm-up round."""
    for fn in fns.values():
        fn()
    out = {k: {"wall": [], "cpu": []} for k in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            out[label]["cpu"].append(time.process_time() - c0)
            out[label]["wall"].append(time.perf_counter() - w0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--synthetic", action="store_true", help="random matrices of the default model's shapes")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import gguf

    mats = load_matrices(args.synthetic)
    arrays = [(n, t.numpy()) for n, t in mats]
    down = [(n, t) for n, t in mats if t.shape[1] % 256 == 0]
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    ref = reference()
    fns: dict = {"peer: w.to(int8)": lambda: [t.to(torch.int8) for _, t in mats]}
    resolved: dict[str, dict[str, int]] = {}
    for name in schemes:
        s = get_scheme(name)
        types = [s.resolve(tuple(t.shape), n) for n, t in mats]
        resolved[name] = dict(Counter(r.name for r in types))
        fns[name] = lambda s=s: [quantize_tensor(t, s, name=n) for n, t in mats]
        if s.block_size == 32:
            fns[f"peer: gguf numpy {name}"] = lambda t_=s.ggml_type: [gguf.quants.quantize(a, t_) for _, a in arrays]
        if ref is not None:
            fns[f"peer: llama.cpp {name}"] = lambda ts=[r.ggml_type for r in types]: [ref.quantize(a, t_) for (_, a), t_ in zip(arrays, ts)]
    for name in ("q4_k", "q6_k"):
        if name in schemes and down:
            s = get_scheme(name)
            fns[f"{name} down_proj"] = lambda s=s: [quantize_tensor(t, s, name=n) for n, t in down]
            if ref is not None:
                fns[f"peer: llama.cpp {name} down_proj"] = lambda t_=s.ggml_type: [ref.quantize(t.numpy(), t_) for _, t in down]
    times = round_robin(fns, args.repeats)
    base = times["peer: w.to(int8)"]
    rows = {}
    for label, r in times.items():
        key = label.removeprefix("peer: llama.cpp ").removeprefix("peer: gguf numpy ")
        ref_label = f"peer: llama.cpp {key}"
        row = {
            "wall_s": statistics.median(r["wall"]),
            "cpu_s": statistics.median(r["cpu"]),
            "x_int8_copy_wall": statistics.median(a / b for a, b in zip(r["wall"], base["wall"])),
            "x_int8_copy_cpu": statistics.median(a / b for a, b in zip(r["cpu"], base["cpu"])),
            "runs": r,
        }
        if not label.startswith("peer") and ref_label in times:
            rr = times[ref_label]
            row["x_llama_cpp_cpu"] = statistics.median(a / b for a, b in zip(r["cpu"], rr["cpu"]))
            row["x_llama_cpp_wall"] = statistics.median(a / b for a, b in zip(r["wall"], rr["wall"]))
        if not label.startswith("peer") and f"peer: gguf numpy {label}" in times:
            rr = times[f"peer: gguf numpy {label}"]
            row["gguf_over_this_cpu"] = statistics.median(b / a for a, b in zip(r["cpu"], rr["cpu"]))
        rows[label] = row
    n_weights = sum(t.numel() for _, t in mats)
    print(f"{len(mats)} matrices, {n_weights / 1e6:.1f}M weights, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats} round-robin rounds; llama.cpp reference {'built' if ref else 'not built'} (1 thread)")
    print(f"{'':34s} {'wall s':>8s} {'cpu s':>8s} {'x int8 (cpu)':>13s} {'x llama.cpp (cpu)':>18s} {'gguf/this':>10s}")
    verdicts = []
    for label, r in rows.items():
        xl = f"{r['x_llama_cpp_cpu']:18.2f}" if "x_llama_cpp_cpu" in r else " " * 18
        gg = f"{r['gguf_over_this_cpu']:10.2f}" if "gguf_over_this_cpu" in r else " " * 10
        note = ""
        if label in resolved:
            ok = r["x_int8_copy_cpu"] <= 10
            verdicts.append(ok)
            note = f"  <=10x int8: {'met' if ok else 'MISSED'}; types {resolved[label]}"
        if label == "q4_k down_proj" and "x_llama_cpp_cpu" in r:
            ok = r["x_llama_cpp_cpu"] <= 2
            verdicts.append(ok)
            note = f"  <=2x llama.cpp: {'met' if ok else 'MISSED'}"
        print(f"{label:34s} {r['wall_s']:8.3f} {r['cpu_s']:8.3f} {r['x_int8_copy_cpu']:13.1f} {xl} {gg}{note}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rows": rows, "resolved": resolved, "threads": torch.get_num_threads(),
                                                    "matrices": len(mats)}, indent=2, sort_keys=True) + "\n")
    print(f"targets met: {sum(verdicts)}/{len(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
