"""``qkit eval``: the quality table, one row per scheme."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Optional

import typer

from qkit import (  # ``evaluation.evaluate`` looked up per call (a test replaces it)
    console,
    evaluation,
)
from qkit.cli.common import (
    CalibrationOpt,
    CalibrationSamplesOpt,
    CalibrationSeqlenOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    ExecutorBackendOpt,
    ExecutorOpt,
    ForceOpt,
    JsonOpt,
    MaxModelLenOpt,
    ModelArg,
    PipelineParallelOpt,
    RayAddressOpt,
    RuntimeOpt,
    TensorParallelOpt,
    ThreadsOpt,
    TrustOpt,
    calibration_options,
    engine_options,
    file_inputs,
    handles_errors,
    human_bytes,
    model_inputs,
    parse_list,
    start,
)
from qkit.evaluation import EvalOptions
from qkit.evaluation.columns import domain_captions, domain_cell, domain_title, table_cells, table_headers
from qkit.evaluation.engines import runtime_names
from qkit.evaluation.klstats import format_llama_kl_stats
from qkit.evaluation.measures import fmt_change, fmt_number
from qkit.evaluation.specs import file_paths, plan_paths
from qkit.executors import executor_options
from qkit.methods import method_names
from qkit.simulate.kv_cache import KVCacheOptions
from qkit.simulate.llm_int8 import LLMInt8Options

# Defaults live in qkit.evaluation.EvalOptions; an option left out keeps the dataclass's default.
SchemesOpt = Annotated[Optional[str], typer.Option("--schemes", help="Comma-separated schemes (default: all six), named rows, presets, plan:FORMAT@TARGET, or file:PATH.gguf (an existing GGUF file of the model, scored as it is).", metavar="LIST")]
MethodsOpt = Annotated[Optional[str], typer.Option("--methods", help=f"Comma-separated methods, one row per method for each scheme: {', '.join(method_names())} (default: rtn); calibrated ones use --calibration.", metavar="LIST")]
ReferenceOpt = Annotated[Optional[str], typer.Option("--reference", help="When MODEL is a qkit checkpoint: the model it was made from (default: the default model).")]
CorpusOpt = Annotated[Optional[str], typer.Option("--corpus", help="One text instead of the held-out domains: a UTF-8 text file, hf:DATASET[:CONFIG[:SPLIT]] or kjv:BOOK[,BOOK...] (books of the pinned King James Version, e.g. kjv:Luke) (default: four held-out domains, the Book of Ruth, the GPL-3 text, argparse.py and a play's dialogue, each scored on its own; docs/corpora.md).")]
TokensOpt = Annotated[Optional[int], typer.Option("--tokens", help="Corpus tokens to score, split evenly across the default's domains, at least 3 per text (a standard error needs 2 scored positions; the first token of each window is context only) [default: 2048].")]
WindowOpt = Annotated[Optional[int], typer.Option("--window", help="Window length in tokens [default: min(2048, the model's context)].")]
AgreeTokensOpt = Annotated[Optional[int], typer.Option("--agree-tokens", help="Reference tokens per battery prompt for greedy agreement [default: 9].")]
NoBatteryOpt = Annotated[bool, typer.Option("--no-battery", help="Skip the 16-question battery (its greedy answers cost about 0.6 of a forward pass per row; agreement is still measured): for a frontier read by KL and perplexity.")]
NoRepetitionPenaltyOpt = Annotated[bool, typer.Option("--no-repetition-penalty", help="Pure greedy battery answers (ignore the model's repetition penalty).")]
EvalScaleDtypeOpt = Annotated[Optional[str], typer.Option("--scale-dtype", help="Scale dtype for every scheme [default: fp16].")]
# Run-time simulation options (rows such as llm-int8, kv-int4); defaults from their dataclasses.
ThresholdOpt = Annotated[Optional[float], typer.Option("--threshold", help=f"LLM.int8 rows: input features with some |x| >= this run in 16-bit (default: {LLMInt8Options.threshold:g}).")]
KvResidualOpt = Annotated[Optional[int], typer.Option("--kv-residual", help=f"KV-cache rows: the most recent tokens kept in full precision (default: {KVCacheOptions.kv_residual}).")]
KvGroupOpt = Annotated[Optional[int], typer.Option("--kv-group", help=f"KV-cache rows with per-channel keys: tokens per key scale (default: {KVCacheOptions.kv_group}).")]


PlanCandidatesOpt = Annotated[Optional[str], typer.Option("--candidates", help="plan:FORMAT@TARGET rows: only these types (comma-separated; default: the format's whole ladder).", metavar="LIST")]
KlStatsOpt = Annotated[bool, typer.Option("--kl-stats", help="Also print llama-perplexity --kl-divergence's statistics per row (always in --json).")]


@handles_errors
def eval_(
    model: ModelArg = None,
    schemes: SchemesOpt = None,
    methods: MethodsOpt = None,
    calibration: CalibrationOpt = None,
    calibration_samples: CalibrationSamplesOpt = None,
    calibration_seqlen: CalibrationSeqlenOpt = None,
    reference: ReferenceOpt = None,
    corpus: CorpusOpt = None,
    tokens: TokensOpt = None,
    window: WindowOpt = None,
    agree_tokens: AgreeTokensOpt = None,
    no_repetition_penalty: NoRepetitionPenaltyOpt = False,
    no_battery: NoBatteryOpt = False,
    scale_dtype: EvalScaleDtypeOpt = None,
    threshold: ThresholdOpt = None,
    kv_residual: KvResidualOpt = None,
    kv_group: KvGroupOpt = None,
    device: DeviceOpt = None,
    device_map: DeviceMapOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustOpt = False,
    candidates: PlanCandidatesOpt = None,
    kl_stats: KlStatsOpt = False,
    runtime: RuntimeOpt = None,
    dtype: DtypeOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    pipeline_parallel_size: PipelineParallelOpt = None,
    distributed_executor_backend: ExecutorBackendOpt = None,
    max_model_len: MaxModelLenOpt = None,
    executor: ExecutorOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Print the quality table: size, perplexity, KL divergence, battery and greedy agreement per scheme."""
    words = parse_list(schemes, "--schemes", what="scheme", where="qkit eval --help lists them")
    run = start(json_path, force, threads, [*model_inputs(model), *model_inputs(reference, "the reference"),
                                            *file_inputs("the corpus", corpus), *file_inputs("the calibration text", calibration),
                                            *(i for p in file_paths(words or ()) for i in file_inputs("a file row", p)),
                                            *(i for p in plan_paths(words or ()) for i in file_inputs("a plan row's file", p))])
    given = {
        "schemes": words,
        "methods": parse_list(methods, "--methods", what="method", where=", ".join(method_names())),
        "reference": reference,
        "corpus": corpus,
        "tokens": tokens,
        "window": window,
        "agree_tokens": agree_tokens,
        "scale_dtype": scale_dtype,
        "device": device,
        "device_map": device_map,
        "trust_remote_code": trust_remote_code or None,
        "plan_candidates": parse_list(candidates, "--candidates", what="type", where="e.g. q4_k,q6_k", spaces=True),
        "runtimes": parse_list(runtime, "--runtime", what="runtime", where=", ".join(runtime_names()), lower=True),
        "dtype": dtype.lower() if dtype else None,
        "engine": engine_options(tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, max_model_len),
        "executor": executor_options(executor, ray_address),
    }
    options = dataclasses.replace(EvalOptions(), **{k: v for k, v in given.items() if v is not None})
    simulation = {k: v for k, v in (("threshold", threshold), ("kv_residual", kv_residual), ("kv_group", kv_group)) if v is not None}
    options = _with_pairs(options, "simulation_options", simulation)
    options = _with_pairs(options, "method_options", calibration_options(calibration, calibration_samples, calibration_seqlen))
    if no_repetition_penalty:
        options = dataclasses.replace(options, repetition_penalty=False)
    if no_battery:
        options = dataclasses.replace(options, battery=False)
    options.resolve()  # every check that needs no model, before the model is touched
    run.use_threads()
    report = evaluation.evaluate(model, options=options, on_status=console.status)
    render_eval(report)
    if kl_stats:
        for r in report.rows[1:]:
            if r.llama_kl:
                console.note(f"{r.scheme} (llama-perplexity --kl-divergence's statistics, on qkit's log-probabilities):")
                for line in format_llama_kl_stats(r.llama_kl):
                    console.note(line)
    run.write_json(report.to_dict)


def _with_pairs(options: EvalOptions, field: str, given: dict) -> EvalOptions:
    """``options`` with the ``given`` pairs merged into its sorted ``(name, value)`` tuple ``field``."""
    if not given:
        return options
    return dataclasses.replace(options, **{field: tuple(sorted({**dict(getattr(options, field)), **given}.items()))})


def render_domains(report) -> None:
    """An eval suite's rows per domain, each domain scored on its own positions: in each cell every registered
    measure's part of the per-domain table (``columns.domain_cell``: KL and the perplexity change with its paired
    SE; the reference's perplexity ± SE in its row)."""
    rows = [r for r in report.rows if r.domains]
    if not rows:
        return
    names = [d["name"] for d in rows[0].domains]
    table = [[_literal(r.scheme), *(domain_cell(d, r is report.rows[0]) for d in r.domains)] for r in rows]
    scored = {d["name"]: d["scored_tokens"] for d in rows[0].domains}
    console.table(["scheme", *names], table, title=f"per domain: {domain_title()}",
                  caption=f"each domain scored on its own {', '.join(f'{n:,}' for n in dict.fromkeys(scored.values()))} "
                          "positions" + "".join(f"; {c}" for c in domain_captions()) + ".")


def render_eval(report) -> None:
    ref = report.rows[0]
    suite = bool(ref.domains)
    # the measures' columns come from their registry (``evaluation.columns``): over an eval suite each per-domain
    # measure shows its worst domain
    headers = ["scheme", "bits/w", "size", *table_headers(suite)]
    # Rows that simulate run-time quantization get one more column: bits/w stays a weight figure.
    simulated = any(r.act_bits is not None or r.kv_bits is not None for r in report.rows)
    if simulated:
        headers.insert(2, "A/KV bits")
    rows, styles = [], []
    for r in report.rows:
        is_ref = r is ref
        if r.refused is not None:  # an engine could not run it: one line, its reason in the notes below
            rows.append([_literal(r.scheme), "-", *([""] if simulated else []), "-", "not run (see below)"]
                        + [""] * (len(headers) - 4 - simulated))
            styles.append("dim")
            continue
        collapsed = not is_ref and not (r.perplexity < 10 * ref.perplexity)  # NaN / inf count as collapsed
        rows.append([
            _literal(r.scheme),
            fmt_number(r.bits_per_weight, ".3f"),  # "-": a model with no block projection to count bits of
            *([_fmt_simulated_bits(r.act_bits, r.kv_bits)] if simulated else []),
            human_bytes(r.size_bytes),
            *table_cells(r.values(), is_ref, report.provenance["scored_tokens"], suite),
        ])
        styles.append("bold red" if collapsed else None)
    p = report.provenance
    console.table(
        headers,
        rows,
        title=f"qkit eval: {p['model']}",
        caption=(
            (f"worst of {len(ref.domains)} held-out domains ({p['corpus']['name']}: "
             f"{', '.join(d['name'] for d in ref.domains)}), each row's own worst, {p['scored_tokens']:,} scored tokens "
             f"in all (window {p['window']}); " if suite else
             f"perplexity ± SE over {p['scored_tokens']:,} scored tokens of {p['corpus']['name']} (window {p['window']}); ")
            + "Δ ppl ± paired SE; KL(reference || row) and top-1 match on the same tokens; "
            + (f"battery: {p['battery']['questions']} questions, greedy, repetition penalty {p['battery']['repetition_penalty']:g}; "
               if p["battery"]["questions"] else "battery: not run (--no-battery); ")
            + f"agreement: teacher-forced argmax vs the reference's greedy tokens. {p['seconds_total']:.0f} s."
            + (" A row named 'NAME [ENGINE]' was measured by that engine from the file it loads, against the same "
               "torch reference." if any(r.runtime != "torch" for r in report.rows) else "")
        ),
        styles=styles,
    )
    render_domains(report)
    render_versus_torch(report)
    for line in report.notes:
        console.note(_literal(f"- {line}"))
    for r in report.rows:  # what each run-time simulation did (e.g. LLM.int8's share of 16-bit multiply-adds)
        for stats in r.simulation_stats.values():
            if isinstance(stats, dict) and stats.get("summary"):
                console.note(_literal(f"- {r.scheme}: {stats['summary']}"))


def _literal(text: str) -> str:
    """``text`` printed as written: rich reads ``[word]`` as markup (a row named ``q4_k_m [llama.cpp]``
    lost its runtime), so an opening bracket is escaped."""
    return text.replace("[", "\\[")


def render_versus_torch(report) -> None:
    """Engine minus torch per engine row that has the torch row of its spec: paired perplexity change and KL
    difference (``Row.versus_torch``), with the engine's load and run times."""
    rows = [r for r in report.rows if r.versus_torch]
    if not rows:
        return
    table = []
    for r in rows:
        v, e = r.versus_torch, r.engine
        kl = (f"{v['kld_change']:+.4f} ± {v['kld_change_se']:.4f}" if "kld_change" in v and math.isfinite(v["kld_change"])
              else "- (no full distribution)")
        table.append([_literal(r.scheme), _literal(v["against"]), fmt_change(v["perplexity_change_pct"], v["perplexity_change_se_pct"]), kl,
                      f"{e.get('load_seconds', math.nan):.1f} s", f"{e.get('run_seconds', math.nan):.1f} s",
                      f"{r.seconds:.1f} s"])
    console.table(["engine row", "torch row", "Δ ppl (engine - torch)", "Δ KL (engine - torch)", "load", "run", "row"],
                  table, title="engine minus torch, paired on the same tokens (± paired SE)",
                  caption="load: the engine loading the file; run: scoring, battery and agreement in the engine; "
                          "row: everything, writing the file included.")


def _fmt_simulated_bits(act_bits: int | None, kv_bits: int | None) -> str:
    """"A8", "KV4", "A8 KV8" or "" (the row quantizes neither at run time)."""
    return " ".join(p for p in (f"A{act_bits}" if act_bits else "", f"KV{kv_bits}" if kv_bits else "") if p)
