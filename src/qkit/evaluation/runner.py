"""``qkit eval``: one row per spec, computed from the same transform ``qkit quantize`` writes.

Layer 6 (``evaluation``): above ``methods`` and ``simulate`` (layer 5) and ``models``; it calls
``qkit.api.quantize_model``, the one path that writes checkpoints, which imports nothing of evaluation.
The checks that need no model are in ``checks``, the notes under the table in ``notes``.

The reference model is loaded once. Its corpus log-probabilities, battery answers and greedy
continuations are computed once. Each row is a ``RowSpec`` (``qkit.evaluation.specs``): storage scheme,
method, run-time simulation. For each, ``build_row_model`` replaces the model's quantized matrices in
place by the dequantized output of ``qkit.api.quantize_model`` (which also writes the real checkpoint to
a temporary directory, so the size column is the size that row writes; a method that folds scales also
swaps in the norms it changed), installs the row's run-time hooks (``qkit.simulate``), the row is
measured, and the hooks and original weights are removed and restored. Nothing else changes between rows.

A saved checkpoint (``qkit eval CHECKPOINT --reference MODEL``) is measured the same way: every tensor it
stores (quantized ones dequantized, the others, such as norms a method folded scales into, as stored) is
copied into the reference model, so it gives exactly the row ``qkit eval MODEL`` computes in memory.

Every refusal comes before the reference model is loaded: options, window against the model's context,
token counts too small for a standard error, the corpus and calibration texts (readable, disjoint), and a
checkpoint's tensor names and shapes against the reference's headers.

``--runtime`` names where rows are measured: ``torch`` (the above) and engines (``vllm``, ``llama.cpp``).
After the torch rows, each engine measures the reference and every spec from the file ``quantize_model``
writes in the engine's format, in a worker subprocess (``qkit.evaluation.engine_rows``); qkit's torch
model is released first. The torch reference is always measured: every row is compared with it.

Each row's checkpoint is written under ``$TMPDIR/qkit-eval-PID-RANDOM`` (removed when the row is built,
on an exception and on Ctrl-C); one left by a killed eval (SIGKILL) is removed by the next eval, which
says so in a status line.
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import (
    checkpoint_bytes,
    iter_quantized,
    read_manifest,
    tensor_shapes,
)
from qkit.errors import InputError
from qkit.evaluation.agreement import agreement, prefill_prompts, reference_continuation
from qkit.evaluation.battery import (
    build_prompts,
    encode_batch,
    generate_answers,
    is_correct,
    load_battery,
    model_repetition_penalty,
)
from qkit.evaluation.checks import (
    check_calibrations,
    check_checkpoint_matches,
    check_corpus_tokens,
    choose_window,
    read_config,
)
from qkit.evaluation.engine_rows import (
    TorchSide,
    assemble_row,
    check_engine_lengths,
    engine_provenance,
    engine_rows,
    engines_of,
    has_torch,
)
from qkit.evaluation.engines import DTYPES, TORCH, EngineOptions, check_runtimes
from qkit.evaluation.klstats import llama_kl_stats
from qkit.evaluation.notes import interpret
from qkit.evaluation.perplexity import CorpusReference, TokenScores, check_scored
from qkit.evaluation.report import EvalReport, Row
from qkit.evaluation.specs import (  # row_plan and the --candidates words: re-exported for older callers
    RowSpec,
    comma_words,
    parse_plan_word,
    resolve_rows,
    row_plan,
)
from qkit.evaluation.swap import Swapper
from qkit.methods import RTN
from qkit.models import (
    ModelRef,
    check_complete,
    check_device_map,
    load,
    load_tokenizer,
    parse_device,
    resolve,
)
from qkit.plan import check_plan_matches, ladder, parse_allowed, read_plan
from qkit.schemes import DEFAULT_SCHEMES, QuantizedTensor
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, parse_scale_dtype
from qkit.simulate import RuntimeContext, apply_runtime, get_runtime, runtime_bits
from qkit.simulate.options import check_keys
from qkit.staging import (
    remove_stale_temporary,  # the same liveness test as the staging siblings of every output
    temporary_directory,
)
from qkit.texts import load_corpus
from qkit.transform import is_block_projection
from qkit.version import __version__

REFERENCE = "reference"
_RUNTIME_CALIBRATION = ("calibration", "calibration_samples", "calibration_seqlen")  # simulate.activations.StaticOptions
ROW_SHARD_BYTES = 256 << 20  # a row's temporary checkpoint: the shard writer holds one shard (safetensors a copy)
TMP_PREFIX = "qkit-eval-"  # a row's temporary checkpoint: $TMPDIR/qkit-eval-PID-RANDOM (qkit.staging.temporary_directory)


@dataclass(frozen=True)
class EvalOptions:
    """Every default of ``qkit eval``, defined once."""

    schemes: tuple[str, ...] = DEFAULT_SCHEMES  # scheme names, named rows (w8a8-token, ...) or presets
    methods: tuple[str, ...] = (RTN,)  # one row per method for each scheme name
    method_options: tuple[tuple[str, Any], ...] = ()  # e.g. (("calibration_samples", 32),) for gptq/awq
    runtime_options: tuple[tuple[str, Any], ...] = ()  # e.g. (("threshold", 6.0),) for llm-int8
    reference: str | None = None  # when MODEL is a qkit checkpoint: the model it was made from
    corpus: str | None = None
    tokens: int = 2048
    window: int | None = None  # default: min(2048, the model's maximum context)
    agree_tokens: int = 9
    battery_tokens: int = 32
    battery: bool = True  # False: no battery answers (agreement still reads the battery prompts)
    repetition_penalty: bool = True
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    device: str | None = None
    device_map: str | None = None  # "auto" etc.: spread the reference over several devices (accelerate)
    seed: int = 0
    trust_remote_code: bool = False  # allow a model's own code (auto_map); never asked for interactively
    plan_candidates: tuple[str, ...] = ()  # the types plan rows may choose (default: the format's whole ladder)
    # Where rows are measured (``qkit.evaluation.engines``): "torch" (qkit's own forward pass, with the
    # simulation hooks), or an engine that loads the row's written file: "vllm", "llama.cpp".
    runtimes: tuple[str, ...] = ("torch",)
    dtype: str = "fp32"  # the torch runtime's model dtype (bf16, fp16, fp32); the reference is scored in it too
    engine: EngineOptions = EngineOptions()  # vLLM's parallelism and the engines' own settings

    def validate(self) -> None:
        """Every check that needs no model (counts, names, device), so a bad option fails in milliseconds:
        ``evaluate`` calls it before anything is resolved or loaded. The window's upper bound (the model's
        context) and the default window's token minimum are checked from the model's config, before loading."""
        for flag, value, least in (("--agree-tokens", self.agree_tokens, 1),
                                   ("--window", self.window, 2), ("battery_tokens", self.battery_tokens, 1)):
            if value is not None and value < least:
                raise InputError(f"{flag} must be at least {least}, got {value}")
        check_scored(self.tokens, self.window)  # a perplexity without a standard error is never reported
        check_runtimes(self.runtimes, self.dtype, self.engine)  # unknown names, an engine not installed, bad counts
        parse_scale_dtype(self.scale_dtype)
        parse_device(self.device)
        if self.device_map is not None:
            check_device_map(self.device_map)
        specs = resolve_rows(self.schemes, self.methods, dict(self.method_options))  # unknown names, methods
        check_keys(dict(self.runtime_options))  # a misspelt runtime option, even with no runtime row
        for spec in specs:  # unknown runtimes, bad runtime option values (--threshold 0, --kv-residual -1)
            for name in spec.runtime:
                get_runtime(name, self.runtime_options_for(spec))
            if spec.plan is not None and spec.plan.endswith(".json"):
                read_plan(spec.plan)  # a missing or malformed plan file: refused before the reference loads
            elif spec.plan is not None:
                planned = row_plan(spec, self)
                planned.check()  # a target scheme that is no scheme
                if self.plan_candidates and not planned.candidates:
                    raise InputError(f"--candidates names no type that {spec.name}'s format {planned.format} offers "
                                     f"({', '.join(ladder(planned.format))})")
        formats = {parse_plan_word(s.plan)[0] for s in specs if s.plan is not None and not s.plan.endswith(".json")}
        if self.plan_candidates:
            if not formats:
                raise InputError("--candidates chooses the types of plan rows (plan:FORMAT@TARGET); the table has none")
            offered = {w for f in formats for w in ladder(f)}
            unknown = [w for w in comma_words(self.plan_candidates) if w not in offered]
            if unknown:  # a typo, or a type no planned format offers
                parse_allowed(sorted(formats)[0], unknown)
                raise InputError(f"--candidates {unknown[0]}: not a type the plan rows' formats ({', '.join(sorted(formats))}) offer")

    def runtime_options_for(self, spec: RowSpec) -> dict[str, Any]:
        """The options ``spec``'s runtimes are built with: the row's own, else eval's; ``--calibration``,
        ``--calibration-samples`` and ``--calibration-seqlen`` choose a static activation row's calibration
        too (the same text a calibrated method's row uses)."""
        calibration = {k: v for k, v in self.method_options if k in _RUNTIME_CALIBRATION}
        return {**calibration, **dict(spec.runtime_options or self.runtime_options)}


def evaluate(
    model: str | Path | None = None,
    *,
    options: EvalOptions = EvalOptions(),
    on_status: Callable[[str], None] | None = None,
) -> EvalReport:
    """Evaluate MODEL under every scheme (or a saved qkit checkpoint against its reference).

    Every input is checked before the reference model is loaded (see the module docstring)."""
    say = on_status or (lambda _m: None)
    options.validate()  # a bad option fails before anything is loaded
    torch.manual_seed(options.seed)
    removed = remove_stale_row_dirs()
    if removed:
        say(f"removed {len(removed)} temporary row checkpoint(s) left by killed evals: {', '.join(map(str, removed))}")
    target = resolve(model, trust_remote_code=options.trust_remote_code)
    checkpoint: ModelRef | None = None
    if target.is_quantized:
        checkpoint, ref = target, resolve(options.reference, trust_remote_code=options.trust_remote_code)
        if ref.is_quantized:
            raise InputError(f"--reference {ref.spec} is itself a qkit checkpoint; pass the original model it was made from")
        specs: list[RowSpec] = []
    else:
        if options.reference is not None:
            raise InputError("--reference is only for evaluating a saved qkit checkpoint; drop it or pass a checkpoint as MODEL")
        ref = target
        specs = resolve_rows(options.schemes, options.methods, dict(options.method_options))  # validate names first
    corpus = load_corpus(options.corpus)
    config = read_config(ref)  # None: transformers cannot read it; ``load`` below says why in one line
    window = choose_window(options.window, options.tokens, config) if config is not None else None
    check_complete(ref)  # the reference too, before the status line below (load() reuses the build)
    if checkpoint is not None:  # headers only (and a meta-device build of the config): before anything heavy
        check_complete(checkpoint)  # every tensor its config implies (load() checks the reference's)
        check_checkpoint_matches(checkpoint, ref, config)  # ... and exactly the reference's, shape for shape
    for spec in specs:  # a plan file made for another model: refused from the headers, before the reference loads
        if spec.plan is not None and spec.plan.endswith(".json"):
            check_plan_matches(read_plan(spec.plan), dict(tensor_shapes(ref.directory)), ref.spec)
    # The tokenizer first (milliseconds; load() reads it again): the corpus and calibration checks need no model.
    tok = load_tokenizer(ref.directory)
    if tok is None:
        raise InputError(f"{ref.spec} has no tokenizer files; eval needs one (tokenizer.json or similar)")
    ids = torch.tensor(tok(corpus.text, add_special_tokens=False)["input_ids"][: options.tokens], dtype=torch.long)
    if window is not None:
        check_corpus_tokens(corpus, int(ids.numel()), window)
    calibrations = check_calibrations(specs, tok, corpus, config, options.runtime_options_for)
    questions = load_battery()
    prompts = build_prompts(tok, [q.question for q in questions])  # agreement's prompts too
    battery = questions if options.battery else []  # the questions answered (--no-battery: none)
    engines = engines_of(options.runtimes)  # each installed (EvalOptions.validate): their lengths, before loading
    if window is not None:
        check_engine_lengths(engines, options.engine, min(window, int(ids.numel())), [len(tok(p, add_special_tokens=False)["input_ids"])
                                                                for p in prompts], options.battery_tokens, options.agree_tokens)

    say("loading the reference model")
    loaded = load(ref=ref, device=options.device, device_map=options.device_map, dtype=DTYPES[options.dtype])
    lm = loaded.model
    if window is None:  # only when the config could not be read above but transformers loaded it anyway
        window = choose_window(options.window, options.tokens, lm.config)
        check_corpus_tokens(corpus, int(ids.numel()), window)
    if ids.numel() < options.tokens:
        say(f"note: the corpus has only {ids.numel()} tokens; using all of them")

    t0 = time.perf_counter()
    say("reference: perplexity")
    corpus_ref = CorpusReference(lm, ids, window)
    rp = model_repetition_penalty(lm) if options.repetition_penalty else 1.0
    say("reference: greedy continuations for agreement")
    batch = encode_batch(tok, prompts)
    ref_prompts = prefill_prompts(lm, batch["input_ids"], batch["attention_mask"])  # shared with its battery
    continuation = reference_continuation(lm, tok, prompts, options.agree_tokens, prompt_cache=ref_prompts)

    def measure(name: str, bits: float, size: int, matrices: int, started: float, ref_row: Row | None, **facts) -> Row:
        if ref_row is not None:
            say(f"{name}: perplexity and KL divergence")
        scores: TokenScores = corpus_ref.score(lm) if ref_row is not None else ref_scores
        row_scores[name] = scores
        say(f"{name}: agreement and battery" if battery else f"{name}: agreement")
        # one prefill of the prompts for both (agreement reads on a copy of its cache; the battery consumes it)
        cached = prefill_prompts(lm, *continuation.prompts) if ref_row is not None else ref_prompts
        agree = agreement(lm, continuation, prompt_cache=cached)
        outputs = generate_answers(lm, tok, prompts, options.battery_tokens, rp, prompt_cache=cached) if battery else []
        cached.cache = None  # consumed by the battery, or not needed: its keys and values go now
        answers = [is_correct(o, q.answers) for o, q in zip(outputs, battery)]
        return assemble_row(name, scores, ref_scores, ref_row, outputs, answers, agree, bits, size, matrices,
                            time.perf_counter() - started, **facts)

    row_scores: dict[str, TokenScores] = {}
    ref_scores = corpus_ref.own_scores()
    shapes = tensor_shapes(ref.directory)
    ref_targets = [n for n, s in shapes if is_block_projection(n, s)]
    ref_bits = 8 * lm.get_parameter(ref_targets[0]).element_size() if ref_targets else float("nan")
    rows = [measure(REFERENCE, ref_bits, checkpoint_bytes(ref.directory), 0, t0, None)]

    swapper = Swapper(lm, ref.directory)
    try:
        if checkpoint is not None:
            t1 = time.perf_counter()
            quantized: list[tuple[int, int, str]] = []  # (nbytes, numel, scheme) per quantized weight

            def stream():  # every stored tensor in file order, one in memory at a time
                for name, value in iter_quantized(checkpoint.directory):
                    if isinstance(value, QuantizedTensor):
                        quantized.append((value.nbytes, value.numel, value.scheme.name))
                    yield name, value

            swapper.apply(stream())
            bits = 8 * sum(q[0] for q in quantized) / max(1, sum(q[1] for q in quantized))
            label = f"checkpoint ({'+'.join(sorted({q[2] for q in quantized}))})"
            manifest = read_manifest(checkpoint.directory) or {}
            rows.append(measure(label, bits, checkpoint_bytes(checkpoint.directory), len(quantized), t1, rows[0],
                                method_record=manifest.get("method") or {}))
        context = RuntimeContext(device=next(lm.parameters()).device, extra={"tokenizer": tok, "model_ref": ref, "corpus": corpus})
        for spec in specs if has_torch(options.runtimes) else []:  # --runtime without torch: its reference only
            t1 = time.perf_counter()
            built = build_row_model(spec, ref, swapper, options, say)
            build_seconds = time.perf_counter() - t1 if built is not None else None
            bits = built.bits_per_weight if built is not None else rows[0].bits_per_weight
            size = built.bytes_after if built is not None else rows[0].size_bytes
            matrices = built.matrices if built is not None else 0
            act_bits, kv_bits = runtime_bits(spec.runtime, options.runtime_options_for(spec))
            with apply_runtime(lm, spec.runtime, context, options.runtime_options_for(spec)) as stats:
                row = measure(spec.name, bits, size, matrices, t1, rows[0], spec=spec.to_dict(), act_bits=act_bits,
                              kv_bits=kv_bits, method_record=built.method_record if built is not None else {},
                              weights_changed=swapper.changed if built is not None else None,
                              plan=(built.plan or {}) if built is not None else {}, build_seconds=build_seconds)
            row.runtime_stats = stats
            row.llama_kl = llama_kl_stats(row_scores[spec.name], ref_scores)
            rows.append(row)
            swapper.restore()
    finally:
        swapper.restore()
    compare_methods(rows, specs, row_scores)
    torch_scores = dict(row_scores)
    device = str(next(lm.parameters()).device)
    if engines:  # the engines load their own copy of the weights: qkit's is released first
        del swapper, lm, loaded, context
        gc.collect()
    side = TorchSide(ref, tok, corpus_ref, ref_scores, rows[0], battery, prompts, continuation, rp, options.battery_tokens)
    for engine in engines:  # each row's file written in the engine's format and measured there
        rows.extend(engine_rows(engine, specs, side, eval_options=options, torch_scores=torch_scores,
                                row_scores=row_scores, say=say, checkpoint=rows[1].scheme if checkpoint else None))

    provenance = {
        "model": ref.spec,
        "model_kind": ref.kind,
        "model_source": ref.provenance,
        "checkpoint": str(checkpoint.directory) if checkpoint else None,
        "corpus": corpus.provenance(),
        "calibration": calibrations,
        "tokenizer": getattr(tok, "name_or_path", None) or type(tok).__name__,
        "tokenizer_class": type(tok).__name__,
        "tokens": int(ids.numel()),
        "scored_tokens": corpus_ref.scored_tokens,
        "window": window,
        "battery": {"questions": len(battery), "max_new_tokens": options.battery_tokens, "repetition_penalty": rp,
                    "chat_template": bool(getattr(tok, "chat_template", None))},
        "agreement": {"prompts": len(prompts), "tokens_per_prompt": options.agree_tokens},
        "scale_dtype": options.scale_dtype,
        "seed": options.seed,
        "qkit_version": __version__,
        "torch_version": torch.__version__,
        "device": device,
        "dtype": options.dtype,
        "runtimes": [TORCH, *(e.name for e in engines)] if has_torch(options.runtimes) else [e.name for e in engines],
        "engines": engine_provenance(engines, rows, options.engine),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "seconds_total": time.perf_counter() - t0,
    }
    return EvalReport(rows, provenance, interpret(rows, corpus_ref.scored_tokens, default_model=ref.kind == "default"))


def compare_methods(rows: list[Row], specs: list[RowSpec], scores: dict[str, TokenScores]) -> None:
    """Each row whose method is not rtn, against the row of the same scheme and runtime with rtn when the
    table has one (``Row.versus``): the paired KL and perplexity differences on the same positions. What
    the method (gptq, awq, the importance matrix) bought, with its uncertainty."""
    for spec in specs:
        if spec.plan is not None:  # plan:FORMAT@SCHEME against that scheme's row, same method: like with like
            target = None if spec.plan.endswith(".json") else parse_plan_word(spec.plan)[2]
            if target is None:
                continue
            base = RowSpec(target, spec.method, spec.runtime).name
        elif spec.method == RTN:
            continue
        else:
            base = RowSpec(spec.scheme, RTN, spec.runtime).name
        if base not in scores or spec.name not in scores:
            continue
        row = next(r for r in rows if r.scheme == spec.name)
        kl, kl_se = scores[spec.name].kl_change_against(scores[base])
        pct, pct_se = scores[spec.name].change_against(scores[base])
        row.versus = {"against": base, "kld_change": kl, "kld_change_se": kl_se,
                      "perplexity_change_pct": pct, "perplexity_change_se_pct": pct_se}


# --------------------------------------------------------------------------- rows' temporary checkpoints


def remove_stale_row_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove ``qkit-eval-PID-*`` directories under ``parent`` (default: ``tempfile.gettempdir()``, i.e.
    ``$TMPDIR``) whose writer process is gone (an eval killed by SIGKILL or a power cut); return them.
    A live eval's directory (its PID exists) is never touched (``qkit.staging.remove_stale_temporary``)."""
    return remove_stale_temporary(TMP_PREFIX, parent)


def build_row_model(spec: RowSpec, ref: ModelRef, swapper: Swapper, options: EvalOptions, say: Callable[[str], None]):
    """Put ``spec``'s weights into the swapper's model: ``quantize_model`` (the path that writes
    checkpoints) into a temporary directory, then that checkpoint's tensors streamed into the model
    (quantized ones dequantized; the others, such as norms a method folded scales into, copied where they
    differ from the model's). Returns the ``QuantizeResult`` (None for unquantized weights)."""
    if spec.scheme is None and spec.plan is None:
        return None
    planned = row_plan(spec, options) if spec.plan is not None else None
    # The writer's PID in the name: a killed eval's directory is found and removed by the next one.
    with temporary_directory(TMP_PREFIX) as tmp:
        say(f"{spec.name}: " + ("planning and quantizing" if planned is not None else "quantizing")
            + (f" ({spec.method})" if spec.method != RTN else ""))
        result = quantize_model(
            model=ref, output=Path(tmp) / "row", scheme=spec.scheme, method=spec.method,
            method_options=dict(spec.method_options) or None,
            options=QuantizeOptions(scale_dtype=options.scale_dtype, device="cpu", plan=planned,
                                    max_shard_bytes=ROW_SHARD_BYTES),
        )
        # The row's own file, one tensor in memory at a time: bit for bit what collect=True held, which was
        # every quantized tensor of the row at once (6.9 GB of int8 codes on a 7B; docs/eval-memory.md).
        swapper.apply(iter_quantized(Path(tmp) / "row"))
    return result


_Swapper = Swapper  # the name older scripts import
