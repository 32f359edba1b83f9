"""Rows measured in an engine (``qkit eval --runtime vllm,llama.cpp``): the row's file, loaded by the engine.

Layer 6 (``evaluation``): above ``engines`` (the ``Engine`` protocol and its workers) and ``api`` (the one
path that writes files). The runner calls ``engine_rows`` once per engine after its torch rows; the torch
reference is always measured first, since every row is compared with it.

For each spec (and the reference):

1. ``Engine.cannot_run`` gives a reason (a scheme the engine's format has no type for, a run-time
   simulation the engine does not do): a row that says so (``Row.refused``), nothing written.
2. The row's file is written by ``qkit.api.quantize_model`` with ``format=engine.format`` into the row's
   temporary directory, exactly as ``qkit quantize --format ...`` writes it; the reference's is the same
   exporter with nothing quantized (``write_reference``: F32 for an fp32 model). The engine loads that very
   file: a row is scored from the file a user would deploy.
3. ``Engine.run`` measures the same ``EngineJob`` for every row (``build_job``: the torch reference's
   windows, the battery prompts as the torch battery tokenizes them, the reference's greedy continuations
   unpadded); ``EngineRefused`` becomes a refused row.
4. ``engine_scores`` turns ``EngineScores`` into ``TokenScores`` against the torch reference: NLL from the
   engine's target log-probabilities; KL (``kl_per_position``) only from a full distribution (else NaN:
   the table shows "-" and says why); top-1 from the engine's argmax. Battery answers are the engine's
   generated ids decoded by the tokenizer; agreement is its argmax against the reference's tokens.
5. With the torch row of the same spec in the table, ``Row.versus_torch`` holds engine minus torch, paired
   on the same positions: the perplexity change and, with a full distribution, the KL difference.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import ExportError, InputError
from qkit.evaluation.agreement import ReferenceContinuation
from qkit.evaluation.battery import Question, is_correct
from qkit.evaluation.engines import (
    TORCH,
    Engine,
    EngineJob,
    EngineOptions,
    EngineRefused,
    EngineScores,
    get_engine,
)
from qkit.evaluation.engines.worker import engine_python
from qkit.evaluation.klstats import llama_kl_stats
from qkit.evaluation.perplexity import CorpusReference, TokenScores, kl_per_position
from qkit.evaluation.report import Row
from qkit.evaluation.specs import RowSpec, parse_plan_word, row_plan
from qkit.evaluation.stats import mcnemar_exact, wilson_interval
from qkit.export import QKIT, atomic_output, get_format, output_bytes, prepare_export
from qkit.methods import RTN
from qkit.models import ModelRef
from qkit.plan import PlanOptions, read_plan
from qkit.schemes import get_scheme
from qkit.schemes.registry import DEFAULT_SCHEME
from qkit.staging import temporary_directory
from qkit.transform import Rules, new_manifest

REFERENCE = "reference"
TMP_PREFIX = "qkit-eval-"  # the runner's: a killed eval's row directories are removed by the next eval
NO_KL = "returns only the top-k log-probabilities per position: KL needs the full distribution"


def row_name(name: str, runtime: str) -> str:
    """A row's name in the table: ``q4_k_m`` for torch, ``q4_k_m [llama.cpp]`` for an engine."""
    return name if runtime == TORCH else f"{name} [{runtime}]"


def engines_of(runtimes: tuple[str, ...]) -> list[Engine]:
    """The engines ``--runtime`` names (not torch), in the order given, each once."""
    return [get_engine(r) for r in runtimes if r.strip().lower() != TORCH]


def has_torch(runtimes: tuple[str, ...]) -> bool:
    return any(r.strip().lower() == TORCH for r in runtimes)


def check_engine_lengths(engines: list[Engine], options: EngineOptions, window: int, prompt_lengths: list[int],
                         battery_tokens: int, agree_tokens: int) -> None:
    """Refuse, before any model is loaded, an eval whose sequences exceed ``--max-model-len``: the window,
    the longest battery prompt plus its new tokens, or plus the agreement tokens."""
    if not engines or options.max_model_len is None:
        return
    longest = max(prompt_lengths, default=0)
    need = max(window, longest + battery_tokens, longest + agree_tokens)
    if options.max_model_len < need:
        what = (f"the eval window is {window} tokens" if need == window else
                f"the longest battery prompt ({longest} tokens) with {max(battery_tokens, agree_tokens)} more is {need}")
        raise InputError(f"--max-model-len {options.max_model_len} is too short for --runtime "
                         f"{', '.join(e.name for e in engines)}: {what}; pass --max-model-len {need} or more"
                         + (", or a smaller --window" if need == window else ""))


@dataclass
class TorchSide:
    """What every engine row is compared with, computed once by the torch runtime."""

    ref: ModelRef
    tokenizer: object
    corpus: CorpusReference
    ref_scores: TokenScores
    ref_row: Row
    battery: list[Question]
    prompts: list[str]
    continuation: ReferenceContinuation
    repetition_penalty: float
    battery_tokens: int


def build_job(side: TorchSide) -> EngineJob:
    """The job every engine row measures: the reference's windows, the battery prompts' ids (as
    ``encode_batch`` tokenizes them, without the padding) and the reference's greedy continuations
    (prompt + ``agree_tokens`` ids, the left padding removed)."""
    tok = side.tokenizer
    prompts = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in side.prompts] if side.battery else []
    c = side.continuation
    inputs = [row[mask.bool()].tolist() for row, mask in zip(c.input_ids, c.attention_mask)]
    return EngineJob(windows=side.corpus.windows, battery_prompts=prompts, battery_tokens=side.battery_tokens,
                     repetition_penalty=side.repetition_penalty, agreement_inputs=inputs, agreement_n=c.n)


def engine_scores(scores: EngineScores, corpus: CorpusReference, runtime: str) -> TokenScores:
    """``EngineScores`` -> ``TokenScores`` on the torch reference's positions.

    ``nll = -target_logprobs`` (float64 ``[n]``); ``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))`` with
    ``p`` the torch reference and ``q`` the engine's full distribution (``kl_per_position``; NaN ``[n]``
    without one); ``top1 = argmax q == argmax p``. Raises ``EngineRefused`` when the engine's shapes do
    not pair with the reference's (another vocabulary, another number of positions)."""
    windows = corpus.windows
    if len(scores.target_logprobs) != len(windows) or len(scores.argmax) != len(windows):
        raise EngineRefused(f"{runtime} scored {len(scores.target_logprobs)} windows, the reference {len(windows)}")
    nll, kl, top1 = [], [], []
    for i, (w, ref_top) in enumerate(zip(windows, corpus.ref_argmax)):
        target, argmax = scores.target_logprobs[i], scores.argmax[i]
        if target.numel() != w.numel() - 1 or argmax.numel() != w.numel() - 1:
            raise EngineRefused(f"{runtime} scored {target.numel()} positions of window {i}, the reference {w.numel() - 1}")
        nll.append(-target.double())
        top1.append(argmax.long() == ref_top)
        if scores.full is not None:
            lp = scores.full[i]
            ref_lp = corpus.logprobs(i)  # read back from the reference's store: one window at a time
            if lp.shape != ref_lp.shape:
                raise EngineRefused(f"{runtime}'s log-probabilities are {tuple(lp.shape)} per window, the "
                                    f"reference's {tuple(ref_lp.shape)}: another vocabulary cannot be paired")
            kl.append(kl_per_position(ref_lp, lp.float()).clamp_(min=0.0))
            del ref_lp
        else:
            kl.append(torch.full((w.numel() - 1,), math.nan, dtype=torch.float64))
    return TokenScores(torch.cat(nll), torch.cat(kl), torch.cat(top1))


def agreement_of(scores: EngineScores, continuation: ReferenceContinuation, runtime: str) -> torch.Tensor:
    """Bool ``[B, n]``: the engine's teacher-forced argmax equals the reference's greedy token."""
    targets = continuation.targets
    got = [a.long().reshape(-1) for a in scores.agreement_argmax]
    if len(got) != targets.shape[0] or any(a.numel() != targets.shape[1] for a in got):
        raise EngineRefused(f"{runtime} returned {len(got)} agreement rows, the reference {targets.shape[0]} of "
                            f"{targets.shape[1]} tokens")
    return torch.stack(got) == targets


def assemble_row(name: str, scores: TokenScores, ref_scores: TokenScores, ref_row: Row | None, outputs: list[str],
                 answers: list[bool], agree: torch.Tensor, bits: float, size: int, matrices: int, seconds: float,
                 **facts) -> Row:
    """One table row from its measurements (torch and engine rows alike). ``ref_row`` None: the reference
    itself (no change, McNemar against nothing). ``agree``: bool ``[B, n]``."""
    k, n = int(agree.sum()), int(agree.numel())
    if ref_row is None:
        change, change_se, (only_ref, only_row, p) = 0.0, 0.0, (0, 0, 1.0)
    else:
        change, change_se = scores.change_against(ref_scores)
        only_ref, only_row, p = mcnemar_exact(ref_row.battery_answers, answers)
    return Row(
        scheme=name, bits_per_weight=bits, size_bytes=size,
        perplexity=scores.perplexity, perplexity_se=scores.perplexity_se,
        perplexity_change_pct=change, perplexity_change_se_pct=change_se,
        kld=scores.kld, kld_se=scores.kld_se, top1_match=scores.top1_match,
        battery_correct=sum(answers), battery_total=len(answers), battery_ci95=wilson_interval(sum(answers), len(answers)),
        battery_answers=answers, battery_outputs=outputs,
        mcnemar_only_reference=only_ref, mcnemar_only_row=only_row, mcnemar_p=p,
        agreement=k, agreement_total=n, agreement_ci95=wilson_interval(k, n),
        seconds=seconds, matrices=matrices, **facts,
    )


def refused_row(name: str, reason: str, seconds: float = 0.0, **facts) -> Row:
    """A row the engine could not run: its reason, and no numbers (NaN, ``null`` in JSON)."""
    nan = math.nan
    return Row(scheme=name, bits_per_weight=nan, size_bytes=0, perplexity=nan, perplexity_se=nan,
               perplexity_change_pct=nan, perplexity_change_se_pct=nan, kld=nan, kld_se=nan, top1_match=nan,
               battery_correct=0, battery_total=0, battery_ci95=(nan, nan), battery_answers=[], battery_outputs=[],
               mcnemar_only_reference=0, mcnemar_only_row=0, mcnemar_p=nan, agreement=0, agreement_total=0,
               agreement_ci95=(nan, nan), seconds=seconds, matrices=0, refused=reason, **facts)


def plan_refusal(spec: RowSpec, engine: Engine) -> str | None:
    """A plan row is written in the format it was planned for; another engine's format cannot take it."""
    if spec.plan is None:
        return None
    fmt = read_plan(spec.plan).format if spec.plan.endswith(".json") else parse_plan_word(spec.plan)[0]
    if fmt != engine.format:
        return (f"the plan chose {fmt} types; {engine.name} loads {engine.format}: plan for it "
                f"(plan:{engine.format}@TARGET)")
    return None


def write_reference(ref: ModelRef, fmt: str, out: Path) -> Path:
    """The reference in format ``fmt``, unquantized; returns what the engine loads. For a safetensors
    format (qkit, compressed-tensors) that is the reference's own directory: with nothing quantized those
    formats store exactly its tensors. For another container (GGUF: one file) it is the exporter
    ``quantize_model`` uses, given no target: every tensor in the source's float type (F32 for an fp32
    model), written to ``out``."""
    if fmt == QKIT or get_format(fmt).container == "safetensors":
        return ref.directory
    shapes = dict(tensor_shapes(ref.directory))
    manifest = new_manifest(get_scheme(DEFAULT_SCHEME), Rules())  # names a default even with nothing quantized
    export = prepare_export(fmt, ref.directory, {}, shapes, manifest, ref=ref)
    with atomic_output(export, out) as tmp:
        writer = export.writer(tmp, 1 << 62)  # one file or shard: the engine reads it as written
        for name, tensor in iter_tensors(ref.directory):
            writer.add(name, tensor)
        writer.close()
    return out


def engine_rows(
    engine: Engine,
    specs: list[RowSpec],
    side: TorchSide,
    *,
    eval_options,
    torch_scores: dict[str, TokenScores],
    row_scores: dict[str, TokenScores],
    say: Callable[[str], None],
    checkpoint: str | None = None,
) -> list[Row]:
    """The reference and every spec measured in ``engine`` (see the module docstring), in spec order.

    ``eval_options``: the ``EvalOptions`` (scale dtype, the engine's options, plan candidates);
    ``torch_scores``: the torch rows' scores by name (for ``Row.versus_torch``); ``row_scores``: filled
    with this engine's rows' scores by their table names; ``checkpoint``: a saved checkpoint's label (it
    is qkit's format: its engine row is refused, the reference still runs)."""
    # The engine computes in the eval's dtype, as the torch runtime does (vLLM; a GGUF's types are its own).
    options: EngineOptions = dataclasses.replace(eval_options.engine, dtype=eval_options.dtype)
    job = build_job(side)
    rows = []
    todo: list[tuple[str, RowSpec | None]] = [(REFERENCE, None)]
    todo += [(checkpoint, None)] if checkpoint is not None else []
    todo += [(s.name, s) for s in specs]
    for name, spec in todo:
        label = row_name(name, engine.name)
        base = {"runtime": engine.name, "spec": spec.to_dict() if spec is not None else {}}
        t0 = time.perf_counter()
        if name == checkpoint:
            rows.append(refused_row(label, f"a saved qkit checkpoint is qkit's format, not {engine.format}: write the "
                                           f"row with qkit quantize --format {engine.format} from the reference, or "
                                           f"eval the reference with --runtime {engine.name} --schemes ...", **base))
            continue
        reason = (plan_refusal(spec, engine) if spec is not None else None) or engine.cannot_run(
            spec.scheme if spec is not None else None, spec.runtime if spec is not None else ())
        if reason is not None:
            say(f"{label}: not run ({reason})")
            rows.append(refused_row(label, reason, **base))
            continue
        try:
            with temporary_directory(TMP_PREFIX) as tmp:
                facts, path = _write_row_file(engine, spec, side, eval_options, Path(tmp), label, say)
                write_seconds = time.perf_counter() - t0
                say(f"{label}: loading and measuring in {engine.name}")
                measured = engine.run(path, job, options)
            scores = engine_scores(measured, side.corpus, engine.name)
            agree = agreement_of(measured, side.continuation, engine.name)
            if len(measured.battery_ids) != len(side.battery):
                raise EngineRefused(f"{engine.name} answered {len(measured.battery_ids)} battery prompts of {len(side.battery)}")
        except EngineRefused as e:
            say(f"{label}: {engine.name} refused it ({e})")
            rows.append(refused_row(label, str(e), seconds=time.perf_counter() - t0, **base))
            continue
        row_scores[label] = scores
        tok = side.tokenizer
        outputs = [tok.decode(ids, skip_special_tokens=True) for ids in measured.battery_ids]
        answers = [is_correct(o, q.answers) for o, q in zip(outputs, side.battery)]
        full = measured.full is not None
        record = {"name": engine.name, "version": measured.version, "format": engine.format,
                  "file_bytes": facts.pop("size"), "write_seconds": write_seconds,
                  "load_seconds": measured.load_seconds, "run_seconds": measured.run_seconds,
                  "full_distribution": full, "notes": list(measured.notes) + ([] if full else [f"{engine.name} {NO_KL}"])}
        row = assemble_row(label, scores, side.ref_scores, side.ref_row, outputs, answers, agree,
                           seconds=time.perf_counter() - t0, engine=record, size=record["file_bytes"],
                           build_seconds=write_seconds, **facts, **base)
        if full:
            row.llama_kl = llama_kl_stats(scores, side.ref_scores)
        against = REFERENCE if spec is None else spec.name
        if against in torch_scores:
            row.versus_torch = versus(scores, torch_scores[against], against, full)
        rows.append(row)
    return rows


def _write_row_file(engine: Engine, spec: RowSpec | None, side: TorchSide, options, tmp: Path, label: str,
                    say: Callable[[str], None]) -> tuple[dict, Path]:
    """Write the row's file for ``engine`` under ``tmp``; return the row's facts (bits, size, matrices,
    method record, plan) and the path the engine loads."""
    if spec is None:
        say(f"{label}: writing the unquantized reference as {engine.format}")
        path = write_reference(side.ref, engine.format, tmp / "reference")
        return {"bits": side.ref_row.bits_per_weight, "size": output_bytes(path) if path != side.ref.directory
                else side.ref_row.size_bytes, "matrices": 0}, path
    say(f"{label}: quantizing as {engine.format}" + (f" ({spec.method})" if spec.method != RTN else ""))
    planned = None
    if spec.plan is not None:
        planned = row_plan(spec, options)
        if isinstance(planned, PlanOptions) and planned.format != engine.format:  # plan_refusal said so first
            raise EngineRefused(f"the plan is for {planned.format}")
    # The engine's format, and what the file must declare for the row's simulations (vLLM: W8A8 activations).
    export = {"format": engine.format, **engine.export_options(spec.runtime)}
    try:
        result = quantize_model(
            model=side.ref, output=tmp / "row", scheme=spec.scheme, method=spec.method,
            method_options=dict(spec.method_options) or None,
            options=QuantizeOptions(scale_dtype=options.scale_dtype, device="cpu", plan=planned, **export),
        )
    except ExportError as e:  # the engine's format cannot hold this row (e.g. int4-g128 on 576-wide matrices)
        raise EngineRefused(f"{engine.format} cannot store it: {e}") from None
    return {"bits": result.bits_per_weight, "size": result.bytes_after, "matrices": result.matrices,
            "method_record": result.method_record, "plan": result.plan or {}}, tmp / "row"


def engine_provenance(engines: list[Engine], rows: list[Row], options: EngineOptions) -> dict:
    """Per engine: the format it loaded, whether it gave the full distribution, its version (from the rows
    it ran; None when it ran none) and the interpreter its worker ran in."""
    out = {}
    for e in engines:
        versions = sorted({r.engine["version"] for r in rows if r.runtime == e.name and r.engine.get("version")})
        out[e.name] = {"format": e.format, "extra": e.extra, "full_distribution": e.full_distribution,
                       "version": versions[0] if versions else None, "python": engine_python(options.python)}
    return out


def versus(scores: TokenScores, torch_scores: TokenScores, against: str, full: bool) -> dict:
    """Engine minus torch on the same positions: ``exp(mean(nll_e - nll_t)) - 1`` in percent with its paired
    SE, and (with a full distribution) ``mean(KL_e - KL_t)`` with its paired SE."""
    pct, pct_se = scores.change_against(torch_scores)
    out = {"against": against, "perplexity_change_pct": pct, "perplexity_change_se_pct": pct_se}
    if full:
        kl, kl_se = scores.kl_change_against(torch_scores)
        out.update(kld_change=kl, kld_change_se=kl_se)
    return out


__all__ = ["REFERENCE", "TorchSide", "agreement_of", "assemble_row", "build_job", "check_engine_lengths", "engine_rows",
           "engine_provenance", "engine_scores", "engines_of", "has_torch", "plan_refusal", "refused_row", "row_name", "versus",
           "write_reference"]
