"""The command line. The only module that imports typer; thin: parse, call the library, render, exit.

Every option is defined once (an ``Annotated`` alias below) and takes its default from the library.
Library errors (``QkitError``) become one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkit import console
from qkit.errors import QkitError

app = typer.Typer(
    name="qkit",
    help="Quantize language-model weights and measure, honestly, what it cost.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)



@app.callback()
def _root() -> None:
    """qkit: quantize language-model weights and measure what it cost."""


# --------------------------------------------------------------------------- shared options (defined once)

ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Model directory, hub id, .gguf file or qkit checkpoint; omitted: the pinned default model.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    Optional[str], typer.Option("--json", help="Also write everything the table shows as JSON to PATH ('-': stdout).", metavar="PATH")
]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N. Default: CUDA when available, else CPU.")
]
ScaleDtypeOpt = Annotated[str, typer.Option("--scale-dtype", help="Dtype the scales are stored (and applied) in: fp16, bf16, fp32.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow custom model code from the model's repository.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickled .bin/.pt weights (can run code).")]


def _json_target(json_path: str | None) -> None:
    console.use_stderr_for_tables(json_path == "-")


def handles_errors(fn):
    """Turn ``QkitError`` into one line and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QkitError as exc:
            console.error(str(exc))
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def human_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f} B"


# --------------------------------------------------------------------------- quantize


@app.command()
@handles_errors
def quantize(
    model: ModelArg = None,
    scheme: Annotated[str, typer.Option("--scheme", "-s", help="int8-tensor, int8-row, int4-tensor, int4-row, int4-g128 (int4-gN, int8-gN), nf4.")] = "nf4",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    scale_dtype: ScaleDtypeOpt = "fp16",
    include: Annotated[list[str], typer.Option("--include", help="Also quantize tensors matching this glob (repeatable).")] = [],
    exclude: Annotated[list[str], typer.Option("--exclude", help="Never quantize tensors matching this glob (repeatable).")] = [],
    keep: Annotated[list[str], typer.Option("--keep", help="SCHEME:GLOB, e.g. int8:'*.down_proj.weight' or none:GLOB (repeatable).")] = [],
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
) -> None:
    """Write a quantized safetensors checkpoint of MODEL."""
    from qkit.api import quantize_model
    from qkit.errors import InputError

    _json_target(json_path)
    if output is None:
        raise InputError("missing -o/--output: the directory to write the quantized checkpoint to")
    with console.progress() as bar:
        result = quantize_model(
            model,
            output=output,
            scheme=scheme,
            scale_dtype=scale_dtype,
            include=include,
            exclude=exclude,
            keep=keep,
            force=force,
            device=device,
            allow_pickle=allow_pickle,
            on_start=lambda n: bar.start(f"quantizing ({scheme})", n),
            on_tensor=bar.callback(),
        )
    used = ", ".join(f"{k} x{v}" for k, v in sorted(result.schemes_used.items()))
    console.table(
        ["", ""],
        [
            ["output", str(result.output)],
            ["scheme", used],
            ["matrices quantized", f"{result.matrices:,}"],
            ["parameters quantized", f"{result.parameters:,}"],
            ["bits per weight", f"{result.bits_per_weight:.3f}"],
            ["size before", human_bytes(result.bytes_before)],
            ["size after", human_bytes(result.bytes_after)],
            ["seconds", f"{result.seconds:.1f}"],
        ],
        title=f"qkit quantize: {result.model}",
        show_header=False,
    )
    if json_path:
        console.write_json(json_path, result.to_dict())


# --------------------------------------------------------------------------- eval


def _eval_defaults():
    from qkit.evaluation import EvalOptions

    return EvalOptions()


@app.command("eval")
@handles_errors
def eval_(
    model: ModelArg = None,
    schemes: Annotated[Optional[str], typer.Option("--schemes", help="Comma-separated schemes (default: all six).")] = None,
    reference: Annotated[Optional[str], typer.Option("--reference", help="When MODEL is a qkit checkpoint: the model it was made from (default: the default model).")] = None,
    corpus: Annotated[Optional[str], typer.Option("--corpus", help="A UTF-8 text file or hf:DATASET[:CONFIG[:SPLIT]] (default: the pinned Book of Ruth).")] = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Corpus tokens to score [default: 2048].")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Window length in tokens [default: min(2048, the model's context)].")] = None,
    agree_tokens: Annotated[Optional[int], typer.Option("--agree-tokens", help="Reference tokens per battery prompt for greedy agreement [default: 9].")] = None,
    no_repetition_penalty: Annotated[bool, typer.Option("--no-repetition-penalty", help="Pure greedy battery answers (ignore the model's repetition penalty).")] = False,
    scale_dtype: Annotated[Optional[str], typer.Option("--scale-dtype", help="Scale dtype for every scheme [default: fp16].")] = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Print the quality table: size, perplexity, KL divergence, battery and greedy agreement per scheme."""
    import dataclasses

    from qkit.evaluation import evaluate

    _json_target(json_path)
    given = {
        "schemes": tuple(s.strip() for s in schemes.split(",") if s.strip()) if schemes else None,
        "reference": reference,
        "corpus": corpus,
        "tokens": tokens,
        "window": window,
        "agree_tokens": agree_tokens,
        "scale_dtype": scale_dtype,
        "device": device,
    }
    options = dataclasses.replace(_eval_defaults(), **{k: v for k, v in given.items() if v is not None})
    if no_repetition_penalty:
        options = dataclasses.replace(options, repetition_penalty=False)
    report = evaluate(model, options=options, on_status=console.status)
    _render_eval(report)
    if json_path:
        console.write_json(json_path, report.to_dict())


def _render_eval(report) -> None:
    ref = report.rows[0]
    headers = ["scheme", "bits/w", "size", "perplexity", "Δ ppl", "KL (nats)", "top-1", "battery (95% CI)", "agreement"]
    rows, styles = [], []
    for r in report.rows:
        is_ref = r is ref
        collapsed = not is_ref and r.perplexity >= 10 * ref.perplexity
        rows.append([
            r.scheme,
            f"{r.bits_per_weight:.3f}",
            human_bytes(r.size_bytes),
            f"{r.perplexity:,.2f} ± {r.perplexity_se:,.2f}",
            "" if is_ref else f"{r.perplexity_change_pct:+,.1f}% ± {r.perplexity_change_se_pct:,.1f}",
            f"{r.kld:.4f}",
            f"{100 * r.top1_match:.1f}%",
            f"{r.battery_correct}/{r.battery_total} ({100 * r.battery_ci95[0]:.0f}-{100 * r.battery_ci95[1]:.0f}%)",
            f"{r.agreement}/{r.agreement_total}",
        ])
        styles.append("bold red" if collapsed else None)
    p = report.provenance
    console.table(
        headers,
        rows,
        title=f"qkit eval: {p['model']}",
        caption=(
            f"perplexity ± SE over {p['scored_tokens']:,} scored tokens of {p['corpus']['name']} (window {p['window']}); "
            "Δ ppl ± paired SE; KL(reference || row) and top-1 match on the same tokens; "
            f"battery: {p['battery']['questions']} questions, greedy, repetition penalty {p['battery']['repetition_penalty']:g}; "
            f"agreement: teacher-forced argmax vs the reference's greedy tokens. {p['seconds_total']:.0f} s."
        ),
        styles=styles,
    )
    for line in report.notes:
        console.note(f"- {line}")


# --------------------------------------------------------------------------- serving (kv, budget, speculate, bench, simulate)

from qkit.serving import batching as _batching  # noqa: E402  (defaults come from the library, defined once)
from qkit.serving import budget as _budget  # noqa: E402
from qkit.serving import kv as _kv  # noqa: E402
from qkit.serving import speculate as _spec  # noqa: E402

ConfigOpt = Annotated[
    Optional[str], typer.Option("--config", help="A config.json (or a directory holding one) instead of MODEL.", metavar="PATH")
]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _timing(t: dict) -> str:
    return f"{t['median'] * 1e3:,.1f} ± {t['spread'] * 1e3:,.1f} ms"


def _int_list(text: str, what: str) -> list[int]:
    from qkit.errors import InputError

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, e.g. 1,2,4,8 (got {text!r})") from None


@app.command("kv")
@handles_errors
def kv_(
    model: ModelArg = None,
    config: ConfigOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Resident tokens per user.")] = _kv.DEFAULT_TOKENS,
    users: Annotated[int, typer.Option("--users", help="Concurrent users (sequences).")] = _kv.DEFAULT_USERS,
    dtype: Annotated[str, typer.Option("--dtype", help="Cache dtype: fp32, fp16, bf16, fp8.")] = _kv.DEFAULT_KV_DTYPE,
    measure: Annotated[bool, typer.Option("--measure", help="Run the model on a TOKENS-token prompt and sum the cache it allocated.")] = False,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """KV cache bytes per token and in total, against full multi-head and multi-query attention."""
    _json_target(json_path)
    if measure:
        console.status(f"measuring: one forward pass over {tokens:,} tokens in {dtype}")
    r = _kv.kv_report(model=model, config=config, tokens=tokens, users=users, dtype=dtype, measure=measure,
                      device=device or "cpu")
    a = r.architecture
    hb = _kv.human_bytes
    console.table(
        ["", ""],
        [
            ["architecture", f"{a.model_type}: {a.layers} layers, {a.heads} heads, {a.kv_heads} kv heads, head dim {a.head_dim}"],
            ["attention", a.attention],
            ["bytes per token", f"2 x {a.layers} x {a.kv_heads} x {a.head_dim} x {_kv.dtype_bytes(dtype)} ({dtype}) = {r.bytes_per_token:,} B"],
            [f"{tokens:,} tokens x {users:,} users", f"{r.total_bytes:,} B ({hb(r.total_bytes)})"],
        ],
        title=f"qkit kv: {a.name}",
        show_header=False,
    )
    console.table(
        ["attention", "kv heads", "bytes/token", f"{tokens:,} x {users:,}", "vs this model"],
        [[v["attention"], v["kv_heads"], f"{v['bytes_per_token']:,}", hb(v["total_bytes"]), f"{v['relative_to_model']:.2f}x"]
         for v in r.variants],
        title="the same model under other attention layouts",
    )
    console.table(
        ["users", "tokens each", "resident tokens", "cache"],
        [[f"{s['users']:,}", f"{s['tokens']:,}", f"{s['resident_tokens']:,}", f"{s['total_bytes']:,} B ({hb(s['total_bytes'])})"]
         for s in r.equivalent_splits],
        title="the cache depends only on total resident tokens",
    )
    if r.measured:
        m = r.measured
        verdict = "equal" if m["matches_formula"] else "DIFFERENT (sliding-window or compressed cache layers?)"
        console.note(
            f"measured: {m['tensors']} cache tensors of shape {m['shape']} ({m['dtype']}) hold {m['bytes']:,} B; "
            f"formula {m['formula_bytes']:,} B: {verdict}",
            style=None if m["matches_formula"] else "bold red",
        )
    if json_path:
        console.write_json(json_path, r.to_dict())


@app.command("budget")
@handles_errors
def budget_(
    models: Annotated[Optional[list[str]], typer.Argument(help="Model directories, hub ids, config.json files or the word default (default: the presets).", show_default=False)] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", help=f"Comma-separated built-in shapes: {', '.join(_budget.PRESETS)}.")] = None,
    config: Annotated[Optional[list[str]], typer.Option("--config", help="A config.json (repeatable).", metavar="PATH")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="Card sizes in GiB, comma-separated.")] = ",".join(f"{g:g}" for g in _budget.DEFAULT_GPUS_GIB),
    reserve: Annotated[float, typer.Option("--reserve", help="GiB kept free for the CUDA context, activations and allocator slack.")] = _budget.DEFAULT_RESERVE_GIB,
    formats: Annotated[str, typer.Option("--formats", help=f"Weight formats: {', '.join(_budget.FORMATS)}.")] = ",".join(_budget.DEFAULT_FORMATS),
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="Cache dtype: fp32, fp16, bf16, fp8.")] = _kv.DEFAULT_KV_DTYPE,
    conversation: Annotated[int, typer.Option("--conversation", help="Tokens of one conversation (rows holding fewer are flagged).")] = _budget.DEFAULT_CONVERSATION,
    json_path: JsonOpt = None,
) -> None:
    """Per card size: weight memory per format, KV bytes per token, and the resident tokens that fit."""
    _json_target(json_path)
    presets = [p.strip() for p in preset.split(",") if p.strip()] if preset else []
    r = _budget.budget(
        models=models or [], presets=presets, configs=config or [], gpus_gib=_budget.parse_floats(gpu, "--gpu"),
        reserve_gib=reserve, formats=[f.strip() for f in formats.split(",") if f.strip()], kv_dtype=kv_dtype,
        conversation=conversation,
    )
    hb = _kv.human_bytes
    conv = f"{r.conversation // 1024}k" if r.conversation % 1024 == 0 else f"{r.conversation:,}-token"
    for t in r.tables:
        styles = ["red" if row.status in ("does not fit", "no room for cache") else ("yellow" if row.misleading else None)
                  for row in t.rows]
        console.table(
            ["model", "format", "bits/w", "weights", "KV/token", "left for KV", "max tokens", f"{conv} convs", "status"],
            [[row.model, row.format, f"{row.projection_bits_per_weight:.3f}", hb(row.weight_bytes), f"{row.kv_bytes_per_token:,} B",
              hb(row.free_bytes) if row.free_bytes > 0 else "-", f"{row.max_tokens:,}", f"{row.conversations:,}", row.status]
             for row in t.rows],
            title=f"qkit budget: {t.gpu_gib:g} GiB card, {r.reserve_gib:g} GiB reserve, {r.kv_dtype} cache",
            caption=t.sentence,
            styles=styles,
        )
    for m in r.models:
        a = m["architecture"]
        console.note(f"- {m['label']}: {m['parameters']:,} parameters ({m['source']}); {a['layers']} layers, "
                     f"{a['kv_heads']} kv heads of dim {a['head_dim']} ({a['heads']} query heads)")
    console.note("- bits/w: of the block projections (attention q/k/v/o and MLP matrices), stored in the format's qkit scheme "
                 f"({', '.join(f'{k}={v}' for k, v in r.formats.items() if v)}); embeddings, norms, biases and an untied lm head "
                 "stay fp16 and are included in 'weights'.")
    if json_path:
        console.write_json(json_path, r.to_dict())


@app.command("speculate")
@handles_errors
def speculate_(
    alpha: Annotated[Optional[list[float]], typer.Option("--alpha", help="Draft acceptance rate in [0, 1] (repeatable).")] = None,
    from_eval: Annotated[Optional[str], typer.Option("--from", help="An eval JSON (qkit eval --json): alpha = each scheme's greedy agreement.", metavar="EVAL.json")] = None,
    gamma: Annotated[str, typer.Option("--gamma", help="Draft lengths, comma-separated.")] = ",".join(map(str, _spec.DEFAULT_GAMMAS)),
    cost: Annotated[Optional[float], typer.Option("--cost", help=f"Draft forward cost as a fraction of a target forward [default: {_spec.DEFAULT_COST:g}; with --from, bits/w ratio].")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Expected tokens per verification pass and speedup of speculative decoding with a (quantized) draft."""
    _json_target(json_path)
    r = _spec.speculate(alphas=alpha or [], from_eval=from_eval, gammas=_int_list(gamma, "--gamma"), cost=cost)
    drafts = list(dict.fromkeys(row.draft for row in r.rows))
    by = {(row.draft, row.gamma): row for row in r.rows}
    rows, styles = [], []
    for d in drafts:
        first = by[(d, r.gammas[0])]
        cells = []
        for g in r.gammas:
            row = by[(d, g)]
            cells.append(f"{row.expected_tokens:.2f} tok, {row.speedup:.2f}x" + (" SLOWER" if row.slower else ""))
        best = r.best[d]
        b = by[(d, best["gamma"])]
        ci = f" ({b.speedup_low:.2f}-{b.speedup_high:.2f})" if b.speedup_low is not None else ""
        alpha_txt = f"{first.alpha:.3f}" + (f" ± {first.alpha_se:.3f}" if first.alpha_se is not None else "")
        rows.append([d, alpha_txt, f"{first.cost:.3f}", *cells, f"γ={best['gamma']}: {best['speedup']:.2f}x{ci}"])
        styles.append("red" if best["speedup"] < 1 else None)
    console.table(
        ["draft", "α", "cost c", *[f"γ={g}" for g in r.gammas], "best"],
        rows,
        title="qkit speculate: expected tokens per verification pass, speedup",
        caption="E[tokens] = (1 - α^(γ+1)) / (1 - α); speedup = E[tokens] / (γ·c + 1). SLOWER: below 1x, speculation "
                "slows generation down." + (" α ± SE over the eval's agreement tokens; best: 95% range over α." if r.source else ""),
        styles=styles,
    )
    if r.assumption:
        console.note(f"- assumption: {r.assumption}")
    elif r.rows and r.rows[0].cost_source == "default":
        console.note(f"- draft cost c = {_spec.DEFAULT_COST:g} of a target forward (the default; pass --cost)")
    if json_path:
        console.write_json(json_path, r.to_dict())


@app.command("bench")
@handles_errors
def bench_(
    model: ModelArg = None,
    config: ConfigOpt = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer sizes (generation to 32 tokens, prompts and caches to 256, batches to 8).")] = False,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="Timed runs per figure (median reported) [default: 3].")] = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Measure generation with and without the KV cache, prefill, decode and batching on this machine."""
    from qkit.serving.bench import bench

    _json_target(json_path)
    r = bench(model=model, config=config, device=device, quick=quick, repeats=repeats, on_stage=console.status)
    reps = r.config["repeats"]
    console.table(
        ["tokens", "with cache", "without cache", "speedup", "MACs with", "MACs without", "same tokens"],
        [[g["tokens"], _timing(g["with_cache"]), _timing(g["without_cache"]), f"{g['speedup']:.1f}x",
          f"{g['macs_with_cache'] / 1e9:,.2f} G", f"{g['macs_without_cache'] / 1e9:,.2f} G", "yes" if g["same_tokens"] else "NO"]
         for g in r.generation],
        title=f"qkit bench: {r.model} on {r.device} ({r.threads} threads, {r.dtype}): greedy generation after a "
              f"{r.config['prompt_tokens']}-token prompt",
        caption=f"median ± half range of {reps} runs; MACs analytic (block projections + attention + one lm-head row per forward)",
    )
    decode = {d["cache_tokens"]: d for d in r.decode}
    prefill = {p["tokens"]: p for p in r.prefill}
    sizes = sorted(set(decode) | set(prefill))
    console.table(
        ["tokens", "prefill = TTFT", "prefill per token", "decode step", "decode tokens/s"],
        [[f"{n:,}",
          _timing(prefill[n]["seconds"]) if n in prefill else "-",
          f"{prefill[n]['seconds_per_token'] * 1e3:,.2f} ms" if n in prefill else "-",
          _timing(decode[n]["seconds"]) if n in decode else "-",
          f"{decode[n]['tokens_per_second']:,.1f}" if n in decode else "-"] for n in sizes],
        title="prefill of an N-token prompt; decode of one token against an N-token cache",
        caption="time to first token = the prefill (its logits give the first token); tokens/s = 1 / decode step",
    )
    b = r.batching
    knee = b["knee"]
    console.table(
        ["batch", "step", "tokens/s", "per-request latency"],
        [[row["batch"], _timing(row["step_seconds"]), f"{row['tokens_per_second']:,.1f}", _ms(row["latency_per_token"]) + "/token"]
         for row in b["rows"]],
        title=f"batched decode: B requests, each with a {b['cache_tokens']}-token cache",
        caption=(f"knee at B = {knee}" if knee else "no knee: throughput still grows at the largest batch") + f" ({b['knee_rule']})",
    )
    console.note(f"- {r.seconds:.0f} s in all; --json PATH keeps these figures for qkit simulate batching --bench PATH")
    if json_path:
        console.write_json(json_path, r.to_dict())


simulate_app = typer.Typer(help="Simulations of serving policies.", no_args_is_help=True)
app.add_typer(simulate_app, name="simulate")


@simulate_app.command("batching")
@handles_errors
def simulate_batching_(
    requests: Annotated[int, typer.Option("--requests", help="Requests in the queue.")] = _batching.DEFAULT_REQUESTS,
    slots: Annotated[int, typer.Option("--slots", help="Sequences per batch.")] = _batching.DEFAULT_SLOTS,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the output-length draw.")] = _batching.DEFAULT_SEED,
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="A file of output lengths (integers) instead of the seeded draw.", metavar="FILE")] = None,
    step_ms: Annotated[Optional[float], typer.Option("--step-ms", help="Cost of one decode step in ms (any batch size).")] = None,
    bench_json: Annotated[Optional[str], typer.Option("--bench", help="A qkit bench --json file: measured step cost per batch size.", metavar="BENCH.json")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Static batching (a batch runs until its longest member ends) against continuous batching."""
    from qkit.errors import InputError

    _json_target(json_path)
    if step_ms is not None and bench_json is not None:
        raise InputError("give either --step-ms or --bench, not both")
    cost = (_batching.constant_cost(step_ms / 1e3) if step_ms is not None
            else _batching.cost_from_bench(bench_json) if bench_json is not None else None)
    r = _batching.simulate_batching(requests=requests, slots=slots, seed=seed, lengths_file=lengths, cost=cost)
    unit = r.cost["unit"]
    fmt = (lambda x: f"{x:,.2f} s") if unit == "s" else (lambda x: f"{x:,.0f} steps")
    rate = "tokens/s" if unit == "s" else "tokens/step"
    console.table(
        ["policy", "makespan", f"throughput ({rate})", "mean latency", "p95 latency", "slot utilisation"],
        [[p.policy, fmt(p.makespan), f"{p.throughput:,.2f}", fmt(p.mean_latency), fmt(p.p95_latency), f"{100 * p.utilisation:.1f}%"]
         for p in (r.static, r.continuous)]
        + [["continuous vs static", "", f"{r.throughput_ratio:.2f}x", f"{r.mean_latency_ratio:.2f}x lower",
            f"{r.p95_latency_ratio:.2f}x lower", ""]],
        title=f"qkit simulate batching: {r.requests} requests, {r.slots} slots",
        caption=f"output lengths: {r.lengths_source} (min {min(r.lengths)}, median {sorted(r.lengths)[len(r.lengths) // 2]}, "
                f"max {max(r.lengths)}, total {sum(r.lengths):,}); step cost: {r.cost['source']}. All requests queued at 0; "
                "static batches are returned whole when their longest member ends; prefill not modelled.",
    )
    if json_path:
        console.write_json(json_path, r.to_dict())


# --------------------------------------------------------------------------- entry point


def main() -> None:
    try:
        app()
    except QkitError as exc:  # raised outside a command body (e.g. while parsing)
        console.error(str(exc))
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
