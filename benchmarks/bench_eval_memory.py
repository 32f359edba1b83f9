"""Peak memory of ``qkit eval`` on a synthetic 7B-shaped llama in bf16, against the bound of docs/eval-memory.md.

    python benchmarks/bench_eval_memory.py [--layers 32] [--hidden 4096] [--intermediate 11008]
        [--schemes int8-row,q4_k_m] [--tokens 256] [--dtype bf16] [--dir /tmp] [--keep-going]
        [--as-main] [-- EXTRA EVAL ARGS]

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

Rows are built as ``qkit.evaluation.runner.build_row_model`` builds them, with one difference unless
``--as-main``: the row's tensors are streamed from the temporary checkpoint ``quantize_model`` writes
(``iter_quantized``) instead of kept in memory (``collect=True`` holds every quantized tensor of the row
at once: 6.9 GB of int8 codes for this model), and that checkpoint is written in 256 MiB shards, not
2 GiB ones (the shard writer holds a pending shard, and safetensors a serialized copy of it). That is
the runner change docs/eval-memory.md proposes; ``--as-main`` measures the runner as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
ROW_SHARD_BYTES = 256 << 20  # a streamed row's checkpoint shards: the writer holds one (and its serialization)
SHAPE_7B = dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32)  # llama-2-7b's config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def layout(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of an untied llama checkpoint, in ``LlamaForCausalLM.state_dict`` order."""
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (hidden, hidden)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (intermediate, hidden)), (p + "mlp.up_proj.weight", (intermediate, hidden)),
                (p + "mlp.down_proj.weight", (hidden, intermediate))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def write_model(directory: Path, tokenizer_dir: Path, *, shard_bytes: int = 2 * GIB, seed: int = 0, **shape) -> int:
    """Write a random bf16 llama (config, shards, index, the tokenizer of ``tokenizer_dir``); return its bytes."""
    import torch
    from safetensors.torch import save_file

    src_config = json.loads((tokenizer_dir / "config.json").read_text())
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"], "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
        "vocab_size": shape["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "dtype": "bfloat16", "hidden_act": "silu", "rope_theta": 10000.0,
        **{k: src_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src_config},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, directory / f)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shp in layout(**shape):
        nbytes = 2 * math.prod(shp)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shp))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, members in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shp in members:
            t = torch.randn(shp, generator=gen, dtype=torch.bfloat16) if len(shp) == 2 else torch.ones(shp, dtype=torch.bfloat16)
            if len(shp) == 2:
                t.mul_(0.02)  # typical init scale: codes spread over their range, activations of a sane size
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
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


def child(stream: bool, argv: list[str]) -> None:
    """Run ``qkit eval`` in this process, rows streamed from their checkpoint when ``stream``."""
    if stream:
        install_streamed_rows()
    sys.argv = ["qkit", *argv]
    from qkit.__main__ import main

    main()


def install_streamed_rows() -> None:
    """``runner.build_row_model`` with its tensors streamed from the row's own temporary checkpoint
    (``iter_quantized``, one tensor at a time) instead of ``collect=True``: the change this benchmark's
    docs propose. The values are the same (a row and its checkpoint are bit-identical)."""
    from qkit.api import QuantizeOptions, quantize_model
    from qkit.checkpoint import iter_quantized
    from qkit.evaluation import runner
    from qkit.methods import RTN
    from qkit.staging import temporary_directory

    def build_row_model(spec, ref, swapper, options, say):
        if spec.scheme is None and spec.plan is None:
            return None
        planned = runner.row_plan(spec, options) if spec.plan is not None else None
        with temporary_directory(runner.TMP_PREFIX) as tmp:
            say(f"{spec.name}: " + ("planning and quantizing" if planned is not None else "quantizing")
                + (f" ({spec.method})" if spec.method != RTN else ""))
            result = quantize_model(
                model=ref, output=Path(tmp) / "row", scheme=spec.scheme, method=spec.method, collect=False,
                method_options=dict(spec.method_options) or None,
                options=QuantizeOptions(scale_dtype=options.scale_dtype, device="cpu", plan=planned,
                                        max_shard_bytes=ROW_SHARD_BYTES),
            )
            swapper.apply(iter_quantized(Path(tmp) / "row"))
        return result

    runner.build_row_model = build_row_model


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
    ap.add_argument("--as-main", action="store_true", help="rows as the runner builds them now (collect=True)")
    ap.add_argument("--json", type=Path, default=None, help="write the measurement here")
    ap.add_argument("--every", type=float, default=15.0, help="seconds between the child's memory samples")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.child:
        child(args.stream, extra)
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
                    "schemes": args.schemes, "tokens": args.tokens, "dtype": args.dtype, "streamed_rows": not args.as_main}
    try:
        t0 = time.perf_counter()
        model = work / "model"
        nbytes = write_model(model, tok_dir, **shape)
        result["write_seconds"] = time.perf_counter() - t0
        print(f"wrote {nbytes / 1e9:.2f} GB in {result['write_seconds']:.0f} s to {model}")
        out_json = work / "eval.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *(["--stream"] if not args.as_main else []), "--",
               "eval", str(model), "--dtype", args.dtype, "--tokens", str(args.tokens), "--schemes", args.schemes,
               "--json", str(out_json), *extra]
        print("running: qkit " + " ".join(cmd[cmd.index("eval"):]) + ("" if args.as_main else "   (rows streamed)"), flush=True)
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
