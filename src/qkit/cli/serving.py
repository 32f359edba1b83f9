"""Serving costs: ``qkit kv``, ``budget``, ``speculate``, ``bench`` and ``simulate batching``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from qkit import console
from qkit.cli.common import (
    ConfigOpt,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    ModelArg,
    ThreadsOpt,
    check_words,
    file_inputs,
    handles_errors,
    model_inputs,
    numbers,
    parse_list,
    reads,
    start,
)
from qkit.errors import InputError
from qkit.models import checked
from qkit.serving import batching as _batching  # defaults come from the library, defined once
from qkit.serving import budget as _budget
from qkit.serving import kv as _kv
from qkit.serving import speculate as _spec
from qkit.serving.bench import BenchConfig as _BenchConfig
from qkit.serving.bench import bench

simulate_app = typer.Typer(help="Simulations of serving policies.", no_args_is_help=True)

_KV_DTYPE_HELP = "Cache dtype: fp32, fp16, bf16, fp8, int8, int4 (int: codes plus an fp16 scale per token and kv head)."  # kv --dtype, budget --kv-dtype


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _timing(t: dict) -> str:
    return f"{t['median'] * 1e3:,.1f} ± {t['spread'] * 1e3:,.1f} ms"


# --------------------------------------------------------------------------- kv


@handles_errors
def kv_(
    model: ModelArg = None,
    config: ConfigOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Resident tokens per user.")] = _kv.DEFAULT_TOKENS,
    users: Annotated[int, typer.Option("--users", help="Concurrent users (sequences).")] = _kv.DEFAULT_USERS,
    dtype: Annotated[str, typer.Option("--dtype", help=_KV_DTYPE_HELP)] = _kv.DEFAULT_KV_DTYPE,
    measure: Annotated[bool, typer.Option("--measure", help="Run the model on a TOKENS-token prompt and sum the cache it allocated.")] = False,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """KV cache bytes per token and in total, against full multi-head and multi-query attention."""
    run = start(json_path, force, threads, reads(model, ("the config", config)))
    _kv.check_options(model=model, config=config, tokens=tokens, users=users, dtype=dtype, measure=measure, device=device)
    run.use_threads()
    if measure:
        if config is None:
            model = checked(model)  # a bad MODEL is refused in one line, before the status line
        _kv.check_measure_size(model=model, config=config, tokens=tokens, dtype=dtype, device=device)  # context, memory
        console.status(f"measuring: one forward pass over {tokens:,} tokens in {dtype}")
    r = _kv.kv_report(model=model, config=config, tokens=tokens, users=users, dtype=dtype, measure=measure, device=device)
    render_kv(r, tokens, users, dtype)
    run.write_json(r.to_dict)


def render_kv(r, tokens: int, users: int, dtype: str) -> None:
    a = r.architecture
    hb = _kv.human_bytes
    console.table(
        ["", ""],
        [
            ["architecture", f"{a.model_type}: {a.layers} layers, {a.heads} heads, {a.kv_heads} kv heads, head dim {a.head_dim}"],
            ["attention", a.attention],
            ["bytes per token", f"{_kv.kv_formula(a.layers, a.kv_heads, a.head_dim, dtype)} = {r.bytes_per_token:,} B"],
            [f"{tokens:,} tokens x {users:,} user{'s' if users != 1 else ''}", f"{r.total_bytes:,} B ({hb(r.total_bytes)})"],
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


# --------------------------------------------------------------------------- budget


@handles_errors
def budget_(
    models: Annotated[Optional[list[str]], typer.Argument(help="Model directories, hub ids, config.json files or the word default (default: the presets).", show_default=False)] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", help=f"Comma-separated built-in shapes: {', '.join(_budget.PRESETS)}.", metavar="LIST")] = None,
    config: Annotated[Optional[list[str]], typer.Option("--config", help="A config.json (repeatable).", metavar="PATH")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="Card sizes in GiB, comma-separated.", metavar="LIST")] = ",".join(f"{g:g}" for g in _budget.DEFAULT_GPUS_GIB),
    reserve: Annotated[float, typer.Option("--reserve", help="GiB kept free for the CUDA context, activations and allocator slack.")] = _budget.DEFAULT_RESERVE_GIB,
    formats: Annotated[str, typer.Option("--formats", help=f"Weight formats, comma-separated: {', '.join(_budget.FORMATS)}.", metavar="LIST")] = ",".join(_budget.DEFAULT_FORMATS),
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help=_KV_DTYPE_HELP)] = _kv.DEFAULT_KV_DTYPE,
    conversation: Annotated[int, typer.Option("--conversation", help="Tokens of one conversation (rows holding fewer are flagged).")] = _budget.DEFAULT_CONVERSATION,
    chapter: Annotated[bool, typer.Option("--chapter", help=f"The chapter's assumptions, stated in the output: nominal 7e9/13e9/70e9 parameters, every weight at the format's bits (int8 = 8, int4 = 4.125), a {_budget.CHAPTER_RESERVE_GIB:g} GiB reserve unless --reserve is given.")] = False,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    ctx: typer.Context = None,
) -> None:
    """Per card size: weight memory per format, KV bytes per token, and the resident tokens that fit."""
    models = check_words(models or [], "MODEL", what="model", where="a directory, hub id, config.json or the word default")
    config = check_words(config or [], "--config", what="config.json", where="a file, or a directory holding one")
    run = start(json_path, force, inputs=[*(i for m in models for i in model_inputs(None if m == "default" else m)),
                                          *(i for c in config for i in file_inputs("the config", c))])
    presets = list(parse_list(preset, "--preset", what="preset", where=", ".join(_budget.PRESETS)) or [])
    # --chapter has its own reserve unless --reserve is given on the command line.
    reserve_given = ctx is None or ctx.get_parameter_source("reserve").name != "DEFAULT"
    r = _budget.budget(
        models=models, presets=presets, configs=config, gpus_gib=_budget.parse_floats(gpu, "--gpu"),
        reserve_gib=reserve if reserve_given or not chapter else None,
        formats=list(parse_list(formats, "--formats", what="format", where=", ".join(_budget.FORMATS))), kv_dtype=kv_dtype,
        conversation=conversation, chapter=chapter,
    )
    render_budget(r)
    run.write_json(r.to_dict)


def render_budget(r) -> None:
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
            title=f"qkit budget: {t.gpu_gib:g} GiB card, {r.reserve_gib:g} GiB reserve, {r.kv_dtype} cache"
                  + (" (the chapter's assumptions)" if r.chapter else ""),
            caption=t.sentence,
            styles=styles,
        )
    for m in r.models:
        a = m["architecture"]
        console.note(f"- {m['label']}: {m['parameters']:,} parameters ({m['source']}); {a['layers']} layers, "
                     f"{a['kv_heads']} kv heads of dim {a['head_dim']} ({a['heads']} query heads)")
    if r.chapter:
        console.note(f"- {r.assumptions}")
        return
    console.note("- bits/w: of the tensors the format's qkit scheme quantizes "
                 f"({', '.join(f'{k}={v}' for k, v in r.formats.items() if v)}): the block projections (attention q/k/v/o "
                 "and MLP matrices), and for a llama.cpp recipe (q4_k_m) also the token embedding and head at llama.cpp's "
                 "types, as its whole file; the rest (norms, biases; the embeddings of the other formats) stays fp16 and is "
                 "included in 'weights'.")


# --------------------------------------------------------------------------- speculate


@handles_errors
def speculate_(
    alpha: Annotated[Optional[list[float]], typer.Option("--alpha", help="Draft acceptance rate in [0, 1] (repeatable).")] = None,
    from_eval: Annotated[Optional[str], typer.Option("--from", help="An eval JSON (qkit eval --json): alpha = each scheme's greedy agreement.", metavar="EVAL.json")] = None,
    gamma: Annotated[str, typer.Option("--gamma", help="Draft lengths, comma-separated.", metavar="LIST")] = ",".join(map(str, _spec.DEFAULT_GAMMAS)),
    cost: Annotated[Optional[float], typer.Option("--cost", help=f"Draft forward cost as a fraction of a target forward (default {_spec.DEFAULT_COST:g}; with --from, the bits/w ratio).")] = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
) -> None:
    """Expected tokens per verification pass and speedup of speculative decoding with a (quantized) draft."""
    run = start(json_path, force, inputs=file_inputs("the eval JSON", from_eval))
    r = _spec.speculate(alphas=alpha or [], from_eval=from_eval, gammas=numbers(gamma, "--gamma", int, "1,2,4,8"), cost=cost)
    render_speculate(r)
    run.write_json(r.to_dict)


def render_speculate(r) -> None:
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
        caption="tokens per pass E = (1 - α^(γ+1)) / (1 - α); speedup = E / (γ·c + 1). SLOWER: below 1x, speculation "
                "slows generation down." + (" α ± SE over the eval's agreement tokens; best: 95% range over α." if r.source else ""),
        styles=styles,
    )
    if r.assumption:
        console.note(f"- assumption: {r.assumption}")
    elif r.rows and r.rows[0].cost_source == "default":
        console.note(f"- draft cost c = {_spec.DEFAULT_COST:g} of a target forward (the default; pass --cost)")


# --------------------------------------------------------------------------- bench


@handles_errors
def bench_(
    model: ModelArg = None,
    config: ConfigOpt = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer sizes (generation to 32 tokens, prompts and caches to 256, batches to 8).")] = False,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help=f"Timed runs per figure, median reported (default {_BenchConfig.repeats}).")] = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
) -> None:
    """Measure generation with and without the KV cache, prefill, decode and batching on this machine."""
    run = start(json_path, force, threads, reads(model, ("the config", config)))
    run.use_threads()
    r = bench(model=model, config=config, device=device, quick=quick, repeats=repeats, threads=threads,
              on_stage=console.status)
    render_bench(r)
    run.write_json(r.to_dict)


def render_bench(r) -> None:
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


# --------------------------------------------------------------------------- simulate batching


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
    force: ForceOpt = False,
) -> None:
    """Static batching (a batch runs until its longest member ends) against continuous batching."""
    run = start(json_path, force, inputs=[*file_inputs("the lengths file", lengths), *file_inputs("the bench JSON", bench_json)])
    if step_ms is not None and bench_json is not None:
        raise InputError("give either --step-ms or --bench, not both")
    cost = (_batching.constant_cost(step_ms / 1e3) if step_ms is not None
            else _batching.cost_from_bench(bench_json) if bench_json is not None else None)
    r = _batching.simulate_batching(requests=requests, slots=slots, seed=seed, lengths_file=lengths, cost=cost)
    render_batching(r)
    run.write_json(r.to_dict)


def render_batching(r) -> None:
    import statistics

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
        caption=f"output lengths: {r.lengths_source} (min {min(r.lengths)}, median {statistics.median(r.lengths):g}, "
                f"max {max(r.lengths)}, total {sum(r.lengths):,}); step cost: {r.cost['source']}. All requests queued at 0; "
                "static batches are returned whole when their longest member ends; prefill not modelled.",
    )
