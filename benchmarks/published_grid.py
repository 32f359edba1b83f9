"""Which llama.cpp types round a pinned model's published weights back onto themselves.

A pinned model (``qkit.pinned_models``) is a GGUF: its weights were quantized once by llama.cpp, and qkit's
reference is those weights dequantized. RTN in a type whose grid holds them reproduces them exactly, so a
row (or a method's gain) in that type measures the model's history, not the scheme. For every weight
matrix this reads its stored type from the GGUF (the ``gguf`` package) and quantizes qkit's reference
weight (the converted directory ``qkit.models.resolve`` gives) with qkit's RTN in each candidate type or
recipe, through ``quantize_tensor`` (a k-quant on a width it cannot take resolves to llama.cpp's fallback, a
recipe to its type for the tensor, as written). Per source type and candidate: how many matrices come back
bit for bit, and the median relative error ||w_hat - w|| / ||w||.

Run: ``python benchmarks/published_grid.py [--model gemma3-270m] [--types q8_0,q4_k,...] [--embedding]
[--json out.json]``. Fetches the model once (as ``qkit eval gemma3-270m`` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import gguf
import torch

from qkit.checkpoint import iter_tensors
from qkit.errors import SchemeError
from qkit.models import read_config, resolve
from qkit.pinned_models import PINNED_MODELS
from qkit.schemes import get_scheme, quantize_tensor

TYPES = "q8_0,q6_k,q5_k,q5_0,q5_1,q4_k,q4_0,q4_1,iq4_nl,iq4_xs,q3_k,q2_k"


def stored_types(path) -> tuple[str, dict[str, str]]:
    """The GGUF's architecture and each tensor's stored type, by GGUF name (``blk.0.attn_q.weight``: ``Q5_0``)."""
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name: t.tensor_type.name for t in reader.tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", help="a pinned model's name")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--embedding", action="store_true", help="also the token embedding (large: slow in the k-quants)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pinned = PINNED_MODELS.get(args.model)
    ref = resolve(pinned.name)
    arch, stored = stored_types(pinned.asset.path)
    config = read_config(ref.directory)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                     config["num_hidden_layers"])
    types, schemes = [], {}
    for t in (t for t in args.types.split(",") if t):
        try:  # a recipe binds to the model's architecture, or refuses it (q4_k_m on gemma3_text today)
            schemes[t] = get_scheme(t).bind(config)
            types.append(t)
        except SchemeError as exc:
            print(f"{t}: left out ({exc})")
    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # source -> candidate -> errors
    as_types: dict[str, set[str]] = defaultdict(set)  # candidate -> the types it resolved to
    t0 = time.perf_counter()
    for name, w in iter_tensors(ref.directory):
        if w.dim() != 2 or (not args.embedding and "embed" in name):
            continue
        source = stored[names.get_name(name.removesuffix(".weight")) + ".weight"]
        w = w.float()
        for t in types:
            qt = quantize_tensor(w, schemes[t], name=name)
            as_types[t].add(qt.scheme.name)
            w_hat = qt.dequantize(torch.float32)
            err = 0.0 if torch.equal(w_hat, w) else ((w_hat - w).norm() / w.norm()).item()
            found[source][t].append(err)
    seconds = time.perf_counter() - t0
    as_type = {t: "|".join(sorted(v)) for t, v in as_types.items()}
    table = {source: {t: {"tensors": len(errs), "exact": sum(e == 0.0 for e in errs),
                          "median_rel_error": statistics.median(errs), "max_rel_error": max(errs),
                          "stored_as": as_type[t]}
                      for t, errs in by_type.items()}
             for source, by_type in sorted(found.items())}
    print(f"{pinned.title}: {arch}, {sum(len(next(iter(v.values()))) for v in found.values())} matrices, {seconds:.0f} s")
    print("| source type | matrices | " + " | ".join(f"{t}" + (f" (as {as_type[t]})" if as_type[t] != t else "")
                                                   for t in types) + " |")
    print("|---|---|" + "---|" * len(types))
    for source, by_type in table.items():
        n = next(iter(by_type.values()))["tensors"]
        cells = [f"{c['exact']} exact" if c["exact"] == n else
                 f"{c['exact']} exact, {c['median_rel_error']:.4f}" if c["exact"] else f"{c['median_rel_error']:.4f}"
                 for c in by_type.values()]
        print(f"| {source} | {n} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": pinned.name, "architecture": arch, "seconds": seconds, "table": table}, f, indent=1,
                      sort_keys=True)


if __name__ == "__main__":
    main()
