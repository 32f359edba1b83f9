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
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, DEFAULT_SCHEME

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
DeviceMapOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device-map",
        help="auto | balanced | sequential: spread the model over all GPUs and CPU memory (accelerate); "
        "CPU-placed layers run slower, see the README.",
    ),
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


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _parse_size(text: str) -> int:
    """``500MB`` / ``2GiB`` / ``1048576`` -> bytes."""
    import re

    from qkit.errors import InputError

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _SIZE_UNITS or float(m.group(1)) * _SIZE_UNITS[unit] < 1:
        raise InputError(f"--max-shard-size {text!r} is not a size; write e.g. 500MB, 2GB or 1GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


@app.command()
@handles_errors
def quantize(
    model: ModelArg = None,
    scheme: Annotated[str, typer.Option("--scheme", "-s", help="int8-tensor, int8-row, int4-tensor, int4-row, int4-g128 (int4-gN, int8-gN), nf4.")] = DEFAULT_SCHEME,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    include: Annotated[list[str], typer.Option("--include", help="Also quantize tensors matching this glob (repeatable).")] = [],
    exclude: Annotated[list[str], typer.Option("--exclude", help="Never quantize tensors matching this glob (repeatable).")] = [],
    keep: Annotated[list[str], typer.Option("--keep", help="SCHEME:GLOB, e.g. int8:'*.down_proj.weight' or none:GLOB (repeatable).")] = [],
    fmt: Annotated[str, typer.Option("--format", help="qkit; compressed-tensors (int4-gN, int8-gN, int4-row, int8-row: vLLM, transformers); bitsandbytes (nf4: transformers).")] = "qkit",
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="Largest output shard, e.g. 500MB or 2GB (default 2GiB); bounds peak memory.", metavar="SIZE")] = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
) -> None:
    """Write a quantized safetensors checkpoint of MODEL (qkit's format, or one vLLM/transformers load)."""
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
            format=fmt,
            **({"max_shard_bytes": _parse_size(max_shard_size)} if max_shard_size else {}),
            allow_pickle=allow_pickle,
            on_start=lambda n: bar.start(f"quantizing ({scheme})", n),
            on_tensor=bar.callback(),
        )
    used = ", ".join(f"{k} x{v}" for k, v in sorted(result.schemes_used.items()))
    console.table(
        ["", ""],
        [
            ["output", str(result.output)],
            ["format", result.format],
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
    device_map: DeviceMapOpt = None,
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
        "device_map": device_map,
    }
    options = dataclasses.replace(_eval_defaults(), **{k: v for k, v in given.items() if v is not None})
    if no_repetition_penalty:
        options = dataclasses.replace(options, repetition_penalty=False)
    report = evaluate(model, options=options, on_status=console.status)
    _render_eval(report)
    if json_path:
        console.write_json(json_path, report.to_dict())


def _fmt_change(pct: float, se: float) -> str:
    """A perplexity change: "+6.5% ± 1.0" (paired SE), or "x56,925" once it is a multiple, not a percentage."""
    if pct >= 900:
        return f"x{1 + pct / 100:,.0f}"
    return f"{pct:+,.1f}% ± {se:,.1f}"


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
            "" if is_ref else _fmt_change(r.perplexity_change_pct, r.perplexity_change_se_pct),
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
from qkit.serving.bench import BenchConfig as _BenchConfig  # noqa: E402
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
    r = _kv.kv_report(model=model, config=config, tokens=tokens, users=users, dtype=dtype, measure=measure, device=device)
    a = r.architecture
    hb = _kv.human_bytes
    console.table(
        ["", ""],
        [
            ["architecture", f"{a.model_type}: {a.layers} layers, {a.heads} heads, {a.kv_heads} kv heads, head dim {a.head_dim}"],
            ["attention", a.attention],
            ["bytes per token", f"2 x {a.layers} x {a.kv_heads} x {a.head_dim} x {_kv.dtype_bytes(dtype)} ({dtype}) = {r.bytes_per_token:,} B"],
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
    cost: Annotated[Optional[float], typer.Option("--cost", help=f"Draft forward cost as a fraction of a target forward (default {_spec.DEFAULT_COST:g}; with --from, the bits/w ratio).")] = None,
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
        caption="tokens per pass E = (1 - α^(γ+1)) / (1 - α); speedup = E / (γ·c + 1). SLOWER: below 1x, speculation "
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
    repeats: Annotated[Optional[int], typer.Option("--repeats", help=f"Timed runs per figure, median reported (default {_BenchConfig.repeats}).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch during the run (default: torch's own choice).")] = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Measure generation with and without the KV cache, prefill, decode and batching on this machine."""
    from qkit.serving.bench import bench

    _json_target(json_path)
    r = bench(model=model, config=config, device=device, quick=quick, repeats=repeats, threads=threads,
              on_stage=console.status)
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
    import statistics

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
        caption=f"output lengths: {r.lengths_source} (min {min(r.lengths)}, median {statistics.median(r.lengths):g}, "
                f"max {max(r.lengths)}, total {sum(r.lengths):,}); step cost: {r.cost['source']}. All requests queued at 0; "
                "static batches are returned whole when their longest member ends; prefill not modelled.",
    )
    if json_path:
        console.write_json(json_path, r.to_dict())


# --------------------------------------------------------------------------- verify (export conformance)


@app.command()
@handles_errors
def verify(
    checkpoint: Annotated[Path, typer.Argument(help="A directory written by qkit quantize --format compressed-tensors|bitsandbytes.", show_default=False)],
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Load an exported CHECKPOINT with its target library and compare it with qkit, weight by weight and on logits."""
    from qkit.export.verify import verify_checkpoint

    _json_target(json_path)
    r = verify_checkpoint(checkpoint, device=device)
    rows = [[scheme, f"{v['tensors']}", f"{v['match_export']}", f"{v['identical']}", f"{v['within_tolerance']}",
             f"{v['max_abs_diff']:.3g}"] for scheme, v in r.by_scheme().items()]
    console.table(["scheme", "tensors", "decode = written", "bit-identical", "within rule", "max |diff|"], rows,
                  title=f"qkit verify: {r.checkpoint} ({r.format}, read by {r.library}, {r.dtype} on {r.device})")
    console.note(f"weights: {r.weight_rule} required: {'ok' if r.weights_ok else 'FAILED'}")
    console.note(f"logits on a fixed {r.prompt_tokens}-token prompt: max |diff| {r.logits_max_abs_diff:.3g} "
                 f"(tolerance {r.logits_tolerance:.3g}, max |logit| {r.logits_scale:.3g}): {'ok' if r.logits_ok else 'FAILED'}")
    console.note("verified" if r.passed else "NOT verified", style="bold green" if r.passed else "bold red")
    if json_path:
        console.write_json(json_path, r.to_dict())
    if not r.passed:
        raise typer.Exit(1)


# --------------------------------------------------------------------------- inspect (errors, matrix, outliers, sensitivity, next-token)

from qkit.inspect import errors as _ierrors  # noqa: E402  (defaults come from the library, defined once)
from qkit.inspect import nexttoken as _inext  # noqa: E402
from qkit.inspect import outliers as _iout  # noqa: E402
from qkit.inspect import sensitivity as _isens  # noqa: E402

inspect_app = typer.Typer(
    help="Why a scheme hurts: weight errors, outlier matrices and activations, sensitivity, next-token soft labels.",
    no_args_is_help=True,
)
app.add_typer(inspect_app, name="inspect")

SchemesOpt = Annotated[list[str], typer.Option("--scheme", "-s", help="Scheme(s) to measure, repeatable or comma-separated (default: all six).")]


def _split_schemes(values: list[str]) -> tuple[str, ...]:
    from qkit.schemes import DEFAULT_SCHEMES

    names = tuple(s.strip() for v in values for s in v.split(",") if s.strip())
    return names or DEFAULT_SCHEMES


def _g(x: float) -> str:
    """A magnitude with thousands separators and 3-4 significant digits."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


@inspect_app.command("errors")
@handles_errors
def inspect_errors_(
    model: ModelArg = None,
    scheme: SchemesOpt = [],
    per_matrix: Annotated[bool, typer.Option("--per-matrix", help="Also print every matrix's relative error under each scheme.")] = False,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    json_path: JsonOpt = None,
) -> None:
    """Relative error ||W - W_hat||_F / ||W||_F of every projection matrix under each scheme."""
    _json_target(json_path)
    with console.progress() as bar:
        r = _ierrors.weight_errors(
            model, schemes=_split_schemes(scheme), scale_dtype=scale_dtype,
            on_start=lambda n: bar.start("measuring", n), on_matrix=bar.callback(),
        )
    console.table(
        ["scheme", "matrices", "parameters", "bits/w", "mean", "median", "worst", "worst matrix"],
        [[s.scheme, f"{s.matrices}", f"{s.parameters:,}", f"{s.bits_per_weight:.3f}", f"{s.mean:.4f}",
          f"{s.median:.4f}", f"{s.worst:.4f}", s.worst_matrix] for s in r.summaries()],
        title=f"qkit inspect errors: {r.model}",
        caption=f"relative error ||W - W_hat||_F / ||W||_F per matrix (float64 norms), the transform qkit quantize writes; "
                f"bits/w include the scales. {r.seconds:.1f} s.",
        right=range(1, 7),
    )
    if per_matrix:
        names = list(r.stats)
        by = {(m.name, m.scheme): m.rel_error for m in r.matrices}
        console.table(
            ["matrix", "shape", "max/std", *r.schemes],
            [[n, "x".join(map(str, r.stats[n].shape)), f"{r.stats[n].max_over_std:.1f}",
              *[f"{by[(n, s)]:.4f}" for s in r.schemes]] for n in names],
        )
    sentence = r.ratio_sentence()
    if sentence:
        console.note(sentence)
    if json_path:
        console.write_json(json_path, r.to_dict())


@inspect_app.command("matrix")
@handles_errors
def inspect_matrix_(
    args: Annotated[Optional[list[str]], typer.Argument(help="[MODEL] [NAME]: a tensor name as in the checkpoint, e.g. model.layers.12.mlp.down_proj.weight; without NAME, the top matrices by max/std.", show_default=False, metavar="[MODEL] [NAME]")] = None,
    scheme: SchemesOpt = [],
    top: Annotated[int, typer.Option("--top", help="Without NAME: how many matrices to list.")] = _ierrors.TOP_MATRICES,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    json_path: JsonOpt = None,
) -> None:
    """One matrix: statistics, outliers beyond 6 sigma, error per scheme, int4 levels used. Without NAME: the top 10 by max/std."""
    _json_target(json_path)
    model, name = _ierrors.split_model_and_name(args or [])
    if name is None:
        stats = _ierrors.top_matrices(model, top=top)
        console.table(
            ["matrix", "shape", "mean |w|", "std", "max |w|", "max/std", "> 6 sigma"],
            [[s.name, "x".join(map(str, s.shape)), f"{s.mean_abs:.4f}", f"{s.std:.4f}", f"{s.max_abs:.4f}",
              f"{s.max_over_std:.1f}", f"{s.beyond_6sigma:,} ({100 * s.share_beyond_6sigma:.3f}%)"] for s in stats],
            title=f"qkit inspect matrix: top {len(stats)} projection matrices by max|w| / std",
            caption="std: population standard deviation; > 6 sigma: weights with |w - mean| > 6 std. "
                    "Pass a NAME for one matrix's errors and level usage.",
        )
        if json_path:
            console.write_json(json_path, {"matrices": [s.to_dict() for s in stats]})
        return
    r = _ierrors.inspect_matrix(model, name=name, schemes=_split_schemes(scheme), scale_dtype=scale_dtype)
    s, lv = r.stats, r.int4_tensor
    console.table(
        ["", ""],
        [["shape", "x".join(map(str, s.shape))], ["mean |w|", f"{s.mean_abs:.5f}"], ["std", f"{s.std:.5f}"],
         ["max |w|", f"{s.max_abs:.5f}"], ["max/std", f"{s.max_over_std:.2f}"],
         ["> 6 sigma", f"{s.beyond_6sigma:,} of {s.numel:,} ({100 * s.share_beyond_6sigma:.4f}%)"]]
        + [[f"rel. error {k}", f"{v:.4f}"] for k, v in r.errors.items()],
        title=f"qkit inspect matrix: {s.name}",
        show_header=False,
    )
    console.note(
        f"int4-tensor: step {lv['scale']:.4g} (max|w| / 7); the typical weights (|w - mean| <= 3 std, "
        f"{100 * lv['typical_share']:.2f}% of them) use {lv['typical_levels_used']} of the 16 levels; all weights use "
        f"{lv['levels_used']}; {100 * lv['zero_share']:.1f}% of the weights round to 0."
    )
    if json_path:
        console.write_json(json_path, r.to_dict())


@inspect_app.command("outliers")
@handles_errors
def inspect_outliers_(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Text to run (default: the fixed paragraph in corpora/outliers_prompt.txt).")] = None,
    corpus_tokens: Annotated[Optional[int], typer.Option("--corpus-tokens", help="Run the first N tokens of the pinned corpus instead.", metavar="N")] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", help="Layer of the histogram and the INT8 analysis [default: the middle one].")] = None,
    exclude_top: Annotated[int, typer.Option("--exclude-top", help="Outlier dimensions to leave out of the second INT8 scale.")] = _iout.EXCLUDE_TOP,
    threshold: Annotated[float, typer.Option("--threshold", help="A dimension is an outlier where its max |h| is this many times the median dimension's.")] = _iout.OUTLIER_THRESHOLD,
    top: Annotated[int, typer.Option("--top", help="Largest dimensions to list per layer.")] = _iout.TOP_DIMS,
    device: DeviceOpt = None,
    device_map: DeviceMapOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Residual-stream outliers: largest dimensions per layer, their persistence, a histogram, and tensor-wide INT8."""
    _json_target(json_path)
    console.status("loading the model and running the prompt")
    r = _iout.residual_outliers(model, prompt=prompt, corpus_tokens=corpus_tokens, layer=layer, exclude_top=exclude_top,
                       threshold=threshold, top=top, device=device, device_map=device_map)
    console.table(
        ["layer", "max |h|", "median dim max", "largest dimensions (dim: max |h|)", "outliers"],
        [[f"{p['layer']}", _g(p["max"]), _g(p["median_dim_max"]),
          "  ".join(f"{t['dim']}: {_g(t['value'])}" for t in p["top"]), ",".join(map(str, p["outliers"])) or "-"]
         for p in r.per_layer],
        title=f"qkit inspect outliers: {r.model}",
        caption=f"{r.tokens} tokens ({r.source}); h = residual stream after model.layers.N; max over tokens of |h| per "
                f"dimension; outlier: at least {r.threshold:g}x the median dimension's max.",
        right=[1, 2],
    )
    if r.outlier_dims:
        console.table(
            ["dim", "outlier in", "layers", "first", "peak", "last", f"within {100 * _iout.PLATEAU:.0f}% of peak"],
            [[f"{d['dim']}", f"{d['n_layers']} of {len(r.per_layer)}", d["layer_ranges"],
              f"{_g(d['value_first'])} (layer {d['first_layer']})", f"{_g(d['peak'])} (layer {d['peak_layer']})",
              f"{_g(d['value_last'])} (layer {d['last_layer']})", f"layers {d['near_peak_layers']}"]
             for d in r.outlier_dims],
            title="outlier dimensions: do they persist across layers, with the same value?",
        )
        d = r.outlier_dims[0]
        near = [l for l, v in enumerate(d["values"]) if v >= (1 - _iout.PLATEAU) * d["peak"]]
        console.note(
            f"dim {d['dim']} is an outlier in {d['n_layers']} of {len(r.per_layer)} layers; its max |h| stays within "
            f"{100 * _iout.PLATEAU:.0f}% of {_g(d['peak'])} in {len(near)} layer(s) ({d['near_peak_layers']})."
        )
    bins = r.histogram
    console.histogram(
        [f"{_g(b['lo'])}-{_g(b['hi'])}" for b in bins], [int(b["count"]) for b in bins],
        title=f"layer {r.layer}: per-dimension max |h|, {r.hidden} dimensions in octave bins "
              f"(largest {_g(r.per_layer[r.layer]['max'])})",
    )
    q = r.int8
    a, b = q["all"], q["without_top"]
    names = ("quartile", "median", "quartile")
    console.table(
        ["INT8, one scale per tensor", f"all {r.hidden} dimensions",
         f"without the top {len(q['excluded_dims'])} ({', '.join(map(str, q['excluded_dims']))})"],
        [["scale (max |h| / 127)", f"{a['scale']:.4g}", f"{b['scale']:.4g}"],
         ["levels used (of 256)", f"{a['levels_used']}", f"{b['levels_used']}"]]
        + [[f"levels of dim {ta['dim']} ({n}, max {_g(ta['max_abs'])})", f"{ta['levels']}", f"{tb['levels']}"]
           for n, ta, tb in zip(names, a["typical"], b["typical"])]
        + [["median |h| in steps", f"{q['median_in_steps']:.3g}", f"{q['median_in_steps_without_top']:.3g}"],
           ["99th percentile |h| in steps", f"{q['p99_in_steps']:.3g}", f"{q['p99_in_steps_without_top']:.3g}"]],
        title=f"layer {r.layer}: what tensor-wide INT8 does to the residual stream",
    )
    console.note(
        f"leaving out {len(q['excluded_dims'])} dimension(s) shrinks the INT8 step {q['scale_shrink']:.1f}x; "
        f"|h| at layer {r.layer}: median {q['abs_median']:.3g}, 99th percentile {q['abs_p99']:.3g} "
        f"(one step with all dimensions: {q['all']['scale']:.4g})."
    )
    if json_path:
        console.write_json(json_path, r.to_dict())


@inspect_app.command("sensitivity")
@handles_errors
def inspect_sensitivity_(
    model: ModelArg = None,
    scheme: Annotated[Optional[str], typer.Option("--scheme", "-s", help="The scheme to apply to one layer (or matrix) at a time.")] = None,
    by: Annotated[str, typer.Option("--by", help="layer or matrix.")] = "layer",
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens of the pinned corpus to measure KL on.")] = _isens.DEFAULT_TOKENS,
    text: Annotated[Optional[str], typer.Option("--text", help="Measure on this text instead of the pinned corpus.")] = None,
    keep: Annotated[str, typer.Option("--keep-scheme", help="The scheme the suggestion keeps the most sensitive units at.")] = _isens.KEEP_SCHEME,
    suggest: Annotated[Optional[int], typer.Option("--suggest", help="Units the suggestion keeps [default: the fewest covering half the summed KL, at most a tenth].")] = None,
    threshold: Annotated[float, typer.Option("--threshold", help="Outlier channel: max |x| at least this many times the median channel's.")] = _iout.OUTLIER_THRESHOLD,
    rows: Annotated[int, typer.Option("--rows", help="Ranked units to print (all are in --json).")] = 30,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Which layers' (or matrices') quantization moves the output: KL divergence from the reference, ranked."""
    from qkit.errors import InputError

    _json_target(json_path)
    if scheme is None:
        raise InputError("missing --scheme: the scheme whose damage to measure, e.g. --scheme int4-tensor")
    console.status("loading the model")
    with console.progress() as bar:
        r = _isens.rank_sensitivity(
            model, scheme=scheme, by=by, tokens=tokens, text=text, keep=keep, suggest=suggest, threshold=threshold,
            scale_dtype=scale_dtype, device=device,
            on_start=lambda n: bar.start(f"quantizing one {by} at a time ({scheme})", n), on_unit=bar.callback(),
        )
    shown = r.units[: max(rows, 0)]
    console.table(
        ["rank", by, "KL (nats/token)", "rel. weight error", "max/std", "input outlier dims (residual)"],
        [[f"{i}", u.name, f"{u.kl:.5f}", f"{u.rel_error:.4f}", f"{u.max_over_std:.1f}",
          (", ".join(f"{d}{'*' if d in u.residual_outlier_dims else ''}" for d in u.input_outlier_dims) or "-")]
         for i, u in enumerate(shown, start=1)],
        title=f"qkit inspect sensitivity: {r.model}, {r.scheme} one {by} at a time",
        caption=f"KL(reference || one {by} at {r.scheme}) over {r.tokens} tokens ({r.source}); rel. weight error and "
                f"max/std as in qkit inspect errors; input outlier dims: channels of a hidden-sized input at least "
                f"{threshold:g}x the median channel, * = an outlier dimension of the residual stream "
                f"({', '.join(map(str, r.residual_outlier_dims)) or 'none'})."
                + (f" {len(r.units) - len(shown)} more in --json." if len(shown) < len(r.units) else ""),
        right=[0, 2, 3, 4],
    )
    console.note(r.sentence())
    if r.kept:
        console.note(r.command(model))
    if json_path:
        console.write_json(json_path, r.to_dict())


@inspect_app.command("next-token")
@handles_errors
def inspect_next_token_(
    args: Annotated[list[str], typer.Argument(help="[MODEL] TEXT", show_default=False, metavar="[MODEL] TEXT")],
    top: Annotated[int, typer.Option("--top", help="Most likely next tokens to list.")] = _inext.TOP,
    temperature: Annotated[str, typer.Option("--temperature", help="Comma-separated temperatures.")] = ",".join(f"{t:g}" for t in _inext.TEMPERATURES),
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Top-k next-token probabilities after TEXT at each temperature: the soft labels distillation trains on."""
    from qkit.errors import InputError

    _json_target(json_path)
    if len(args) > 2:
        raise InputError(f"expected [MODEL] TEXT, got {len(args)} arguments; quote the text")
    model, text = (None, args[0]) if len(args) == 1 else (args[0], args[1])
    r = _inext.next_token(model, text=text, top=top, temperatures=temperature, device=device)
    first = r.rows[0]["tokens"]
    console.table(
        ["rank", "token", *[f"p at T={row['temperature']:g}" for row in r.rows]],
        [[f"{i + 1}", repr(t["token"]), *[f"{row['tokens'][i]['prob']:.4f}" for row in r.rows]] for i, t in enumerate(first)],
        title=f"qkit inspect next-token: {r.model}",
        caption=f"after {r.text!r}; p = softmax(logits / T).",
        right=[0, *range(2, 2 + len(r.rows))],
    )
    console.note("first / third: " + ", ".join(f"{row['ratio_first_third']:.3g} at T={row['temperature']:g}" for row in r.rows)
                 + " (at temperature T the ratio is the T=1 ratio to the power 1/T)")
    if json_path:
        console.write_json(json_path, r.to_dict())


# --------------------------------------------------------------------------- entry point


def main() -> None:
    """Entry point: usage errors and ``QkitError`` become one line on stderr and exit code 2."""
    import importlib

    # typer vendors click in some versions: take the exception classes from wherever typer's come from.
    cx = importlib.import_module(typer.BadParameter.__module__)
    no_args = getattr(cx, "NoArgsIsHelpError", ())
    try:
        code = app(standalone_mode=False)
    except no_args as exc:  # bare ``qkit`` or a bare sub-app: show its help
        text = exc.ctx.get_help()  # typer's rich help prints itself and returns ""
        if text:
            print(text)
        sys.exit(0)
    except cx.UsageError as exc:  # unknown option, missing argument, bad value
        where = exc.ctx.command_path if exc.ctx is not None else "qkit"
        console.error(f"{exc.format_message()} (see '{where} --help')")
        sys.exit(exc.exit_code)
    except typer.Abort:
        console.error("interrupted; nothing was written")
        sys.exit(130)
    except QkitError as exc:  # raised outside a command body
        console.error(str(exc))
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
