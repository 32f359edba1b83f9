"""Benchmark: quantizing to mxfp4 / nvfp4 against a plain fp32 -> int8 copy and the reference implementations.

Run:  python benchmarks/bench_fp4.py [--layers 30] [--repeats 5] [--threads N] [--ref-layers 1] [--json PATH]

Everything is measured in one run, on the same fp32 matrices already in memory: the default model's
block projections by shape (per layer q 576x576, k 192x576, v 192x576, o 576x576, gate 1536x576,
up 1536x576, down 576x1536; ``--layers`` of them, 30 in the model), seeded normal weights (std 0.02;
the code path does not depend on the values' distribution, only the roundings' outcomes do).

* ``qkit.schemes.quantize_tensor`` with ``mxfp4`` and ``nvfp4`` over all matrices, against ``w.to(torch.int8)``
  of the same matrices. Target (the issue): at most 10x the int8 copy. For context, ``--context`` schemes
  (int4-g32 and nf4 by default) are timed in the same rounds.
* The references on the first ``--ref-layers`` layers (they are slow): gguf 0.19's numpy MXFP4 quantizer
  (``gguf.quants.quantize(w, GGMLQuantizationType.MXFP4)``) and compressed-tensors 0.20.1's NVFP4 path as
  llm-compressor runs it on CPU (``generate_gparam`` + ``calculate_qparams`` + ``NVFP4PackedCompressor.compress``),
  each against qkit on the same matrices.

Rows are timed round-robin (every row once per round) and ratios are medians of same-round ratios, so
load that drifts between rounds cancels. On an oversubscribed machine multi-threaded torch ops stall on
each other (every op waits for its slowest thread): there compare with ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from _timing import round_robin

from qkit.schemes import get_scheme, quantize_tensor

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def make_matrices(layers: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * 0.02 for _ in range(layers) for shape in SHAPES]


def reference_fns(mats: list[torch.Tensor]) -> dict:
    fns = {}
    try:
        from gguf import GGMLQuantizationType
        from gguf import quants as gq

        arrays = [m.numpy() for m in mats]
        fns["ref: gguf numpy MXFP4"] = lambda: [gq.quantize(a, GGMLQuantizationType.MXFP4) for a in arrays]
    except ImportError:  # pragma: no cover - gguf is a dependency
        pass
    try:
        from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16
        from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

        scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)

        def ct_nvfp4(w: torch.Tensor) -> dict:
            gs = generate_gparam(w.min(), w.max())
            blocks = w.view(w.shape[0], -1, 16)
            scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
            return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)

        fns["ref: compressed-tensors NVFP4"] = lambda: [ct_nvfp4(m) for m in mats]
    except ImportError:  # pragma: no cover - a test dependency
        pass
    return fns


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30, help="layers of the default model's shapes (30 = the model)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--ref-layers", type=int, default=1, help="layers the (slow) references are timed on; 0 skips them")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--context", default="int4-g32,nf4", help="other qkit schemes timed alongside, for context ('' for none)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    mats = make_matrices(args.layers)
    n = sum(m.numel() for m in mats)
    mx, nv = get_scheme("mxfp4"), get_scheme("nvfp4")
    fns = {
        "peer: w.to(int8)": lambda: [m.to(torch.int8) for m in mats],
        "mxfp4": lambda: [quantize_tensor(m, mx) for m in mats],
        "nvfp4": lambda: [quantize_tensor(m, nv) for m in mats],
    }
    for name in args.context.split(","):
        if name.strip():
            s = get_scheme(name)
            fns[f"context: {s.name}"] = lambda s=s: [quantize_tensor(m, s) for m in mats]
    times = round_robin(fns, args.repeats)
    copy = times["peer: w.to(int8)"]
    res: dict = {"weights": n, "matrices": len(mats), "threads": torch.get_num_threads(), "rows": {}, "references": {}}
    print(f"{len(mats)} matrices ({args.layers} layers of the default model's shapes), {n / 1e6:.1f} M weights, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats} round-robin rounds")
    print(f"{'':32s} {'seconds':>9s} {'ns/weight':>10s} {'x int8 copy':>12s}  target")
    verdicts = []
    for label, runs in times.items():
        med = statistics.median(runs)
        ratio = median_ratio(runs, copy)
        target = ""
        if not label.startswith(("peer:", "context:")):
            ok = ratio <= 10.0
            verdicts.append(ok)
            target = f"<= 10x int8 copy: {'met' if ok else 'MISSED'}"
        res["rows"][label] = {"seconds": med, "ns_per_weight": med / n * 1e9, "x_int8_copy": ratio, "runs": runs,
                              "target": target}
        print(f"{label:32s} {med:9.4f} {med / n * 1e9:10.2f} {ratio:12.1f}  {target}")

    if args.ref_layers > 0:
        sub = mats[: 7 * args.ref_layers]
        m = sum(t.numel() for t in sub)
        ref = reference_fns(sub)
        ref["qkit mxfp4"] = lambda: [quantize_tensor(t, mx) for t in sub]
        ref["qkit nvfp4"] = lambda: [quantize_tensor(t, nv) for t in sub]
        rt = round_robin(ref, max(1, min(args.repeats, 3)))
        print(f"references, on {len(sub)} matrices ({m / 1e6:.2f} M weights):")
        print(f"{'':32s} {'seconds':>9s} {'ns/weight':>10s} {'ref / qkit':>12s}")
        for label, ours in (("ref: gguf numpy MXFP4", "qkit mxfp4"), ("ref: compressed-tensors NVFP4", "qkit nvfp4")):
            if label not in rt:
                continue
            for row in (label, ours):
                med = statistics.median(rt[row])
                speed = median_ratio(rt[label], rt[ours]) if row == label else 1.0
                res["references"][row] = {"seconds": med, "ns_per_weight": med / m * 1e9, "ref_over_qkit": speed,
                                          "runs": rt[row]}
                print(f"{row:32s} {med:9.4f} {med / m * 1e9:10.2f} {speed:12.1f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(f"targets met: {sum(verdicts)}/{len(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
