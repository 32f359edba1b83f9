"""Peak memory of ``qkit eval`` on a synthetic 7B-shaped llama in bf16, against the bound of docs/eval-memory.md.

    python benchmarks/bench_eval_memory.py [--layers 32] [--hidden 4096] [--intermediate 11008]
        [--schemes int8-row,q4_k_m] [--tokens 256] [--dtype bf16] [--dir /tmp] [--keep-going]
        [-- EXTRA EVAL ARGS]

The model: random weights (normal, 0.02 for matrices, 1 for norms), written in bf16 shard by shard (one
shard in memory at a time, never the model), with the default model's tokenizer (so its vocabulary,
49152, not llama-2's 32000: 6.88B parameters, 13.76 GB), to a temporary directory under ``--dir`` that is
removed afterwards, whatever ends the run. ``qkit eval MODEL --dtype bf16 --tokens 256 --schemes ...``
then runs in a child process; its peak resident memory is the child's ``ru_maxrss`` (``getrusage``
of the waited children), its seconds the wall clock.

The bound it is compared with (docs/eval-memory.md)::

    weights in the eval dtype + the largest tensor (in the file's dtype) + one chunk of log-probabilities
    + the process's baseline (python, torch, transformers imported, measured here in a child)

Before anything is written, the run refuses when ``MemAvailable`` is below the bound plus 1 GiB
(``--keep-going`` turns that into a warning) and when ``--dir`` has too little free space for the model
plus the largest row checkpoint.

Rows are written by ``qkit.evaluation.row_files.write_row`` and loaded by the torch engine
(``TorchSession.measure``): the row's tensors are streamed from the temporary checkpoint ``quantize_model``
writes (``iter_quantized``, one tensor at a time), written in 256 MiB shards (the shard writer holds a pending shard, and safetensors a serialized copy of it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The synthetic llama writer of tests/test_streaming.py (as benchmarks/bench_streaming.py uses it).
_spec = importlib.util.spec_from_file_location("test_streaming", ROOT / "tests" / "test_streaming.py")
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)

GIB = 1 << 30
SHAPE_7B = dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32)  # llama-2-7b's config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def layout(**shape) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of an untied llama checkpoint (tests/test_streaming.py's)."""
    return synthetic.synthetic_layout(**shape)


def write_model(directory: Path, tokenizer_dir: Path, *, shard_bytes: int = 2 * GIB, seed: int = 0, **shape) -> int:
    """Write a random bf16 llama (config, shards, index) with the tokenizer of ``tokenizer_dir``; return its bytes."""
    import torch

    src_config = json.loads((tokenizer_dir / "config.json").read_text())
    extra = {"rope_theta": 10000.0, **{k: src_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src_config}}
    total = synthetic.write_synthetic_llama(directory, shard_bytes=shard_bytes, seed=seed, dtype=torch.bfloat16,
                                            config=extra, **shape)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, directory / f)
    return total


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def baseline_rss() -> int:
    """Peak RSS of a child that imports what ``qkit eval`` imports and loads nothing: the process's floor."""
    code = "import torch, transformers, qkit.cli, qkit.evaluation.runner"
    r = subprocess.run([sys.executable, "-c", code + "; import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                       capture_output=True, text=True, check=True)
    return int(r.stdout.split()[-1]) * 1024


def bound_bytes(params: int, largest_bytes: int, vocab: int, eval_itemsize: int, base: int) -> dict[str, int]:
    """docs/eval-memory.md's bound: weights in the eval dtype + the largest tensor + one chunk of log-probs + base."""
    from qkit.evaluation.perplexity import chunk_positions

    chunk = 4 * chunk_positions(vocab) * vocab
    parts = {"weights": params * eval_itemsize, "largest_tensor": largest_bytes, "logprob_chunk": chunk, "baseline": base}
    return {**parts, "bound": sum(parts.values())}


def child(argv: list[str]) -> None:
    """Run ``qkit eval`` in this process."""
    sys.argv = ["qkit", *argv]
    from qkit.__main__ import main

    main()


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (the peak so far), RssAnon and RssFile of a live process, in bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def watch(proc: subprocess.Popen, t0: float, every: float) -> list[dict]:
    """Wait for ``proc``, printing its resident memory every ``every`` seconds (a run cut short still
    says how high it got, and when)."""
    samples = []
    while proc.poll() is None:
        st = proc_status(proc.pid)
        if st:
            samples.append({"t": round(time.perf_counter() - t0, 1), **st})
            print(f"[{samples[-1]['t']:7.0f} s] RSS {st.get('VmRSS', 0) / GIB:6.2f} GiB (anon {st.get('RssAnon', 0) / GIB:.2f}, "
                  f"file {st.get('RssFile', 0) / GIB:.2f}), peak so far {st.get('VmHWM', 0) / GIB:6.2f} GiB", flush=True)
        try:
            proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            pass
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in SHAPE_7B.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--schemes", default="int8-row,q4_k_m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the model is written (default $TMPDIR)")
    ap.add_argument("--keep-going", action="store_true", help="warn instead of refusing when MemAvailable is below the bound")
    ap.add_argument("--json", type=Path, default=None, help="write the measurement here")
    ap.add_argument("--every", type=float, default=15.0, help="seconds between the child's memory samples")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.child:
        child(extra)
        return

    from qkit.models import resolve

    tok_dir = resolve(None).directory
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    shape = {k: getattr(args, k) for k in SHAPE_7B} | {"vocab": vocab}
    shapes = layout(**shape)
    params = sum(math.prod(s) for _, s in shapes)
    largest = 2 * max(math.prod(s) for _, s in shapes)
    base = baseline_rss()
    bound = bound_bytes(params, largest, vocab, {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype], base)
    avail = mem_available()
    print(f"model: {shape}, {params / 1e9:.2f}B parameters, {2 * params / 1e9:.2f} GB bf16; largest tensor {largest / 1e6:.0f} MB")
    print("bound: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in bound.items()) + f"; MemAvailable {avail / GIB:.2f} GiB")
    if avail < bound["bound"] + GIB:
        msg = (f"MemAvailable {avail / GIB:.1f} GiB is below the bound {bound['bound'] / GIB:.1f} GiB + 1 GiB: the eval "
               "would swap or be killed; free memory or pass smaller --layers/--hidden")
        if not args.keep_going:
            sys.exit("refused: " + msg)
        print("warning: " + msg)
    free = shutil.disk_usage(args.dir).free
    need = 2 * params + params + GIB  # the model + the largest row checkpoint (int8: one byte a weight) + slack
    if free < need:
        sys.exit(f"refused: {args.dir} has {free / GIB:.1f} GiB free, the model and a row checkpoint need {need / GIB:.1f} GiB")
    work = Path(tempfile.mkdtemp(prefix="qkit-bench-mem-", dir=args.dir))
    result: dict = {"shape": shape, "parameters": params, "bound": bound, "mem_available": avail,
                    "schemes": args.schemes, "tokens": args.tokens, "dtype": args.dtype}
    try:
        t0 = time.perf_counter()
        model = work / "model"
        nbytes = write_model(model, tok_dir, **shape)
        result["write_seconds"] = time.perf_counter() - t0
        print(f"wrote {nbytes / 1e9:.2f} GB in {result['write_seconds']:.0f} s to {model}")
        out_json = work / "eval.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--",
               "eval", str(model), "--dtype", args.dtype, "--tokens", str(args.tokens), "--schemes", args.schemes,
               "--json", str(out_json), *extra]
        print("running: qkit " + " ".join(cmd[cmd.index("eval"):]), flush=True)
        t1 = time.perf_counter()
        proc = subprocess.Popen(cmd)
        samples = watch(proc, t1, args.every)
        result["eval_seconds"] = time.perf_counter() - t1
        result["rss_samples"] = samples
        result["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        result["exit_code"] = proc.returncode
        if out_json.is_file():
            report = json.loads(out_json.read_text())
            result["rows"] = [{k: r.get(k) for k in ("scheme", "bits_per_weight", "perplexity", "kld", "top1_match", "seconds")}
                              for r in report["rows"]]
            result["provenance_dtype"] = report["provenance"].get("dtype")
        print(f"\nexit {proc.returncode}; eval {result['eval_seconds']:.0f} s; peak RSS {result['peak_rss'] / GIB:.2f} GiB "
              f"against the bound {bound['bound'] / GIB:.2f} GiB ({result['peak_rss'] / bound['bound']:.2f}x)")
        for r in result.get("rows", []):
            print(f"  {r['scheme']:<10} bits/w {r['bits_per_weight']:.3f}  ppl {r['perplexity']:.4g}  {r['seconds']:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
