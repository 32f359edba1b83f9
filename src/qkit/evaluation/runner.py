"""``qkit eval``: one row per spec, computed from the same transform ``qkit quantize`` writes.

The reference model is loaded once. Its corpus log-probabilities, battery answers and greedy
continuations are computed once. Each row is a ``RowSpec`` (``qkit.evaluation.specs``): storage scheme,
method, run-time simulation. For each, ``build_row_model`` replaces the model's quantized matrices in
place by the dequantized output of ``qkit.api.quantize_model`` (which also writes the real checkpoint to
a temporary directory, so the size column is the size that row writes; a method that folds scales also
swaps in the norms it changed), installs the row's run-time hooks (``qkit.simulate``), the row is
measured, and the hooks and original weights are removed and restored. Nothing else changes between rows.
"""

from __future__ import annotations

import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit import __version__
from qkit.api import quantize_model
from qkit.checkpoint import checkpoint_bytes, iter_quantized, tensor_shapes
from qkit.errors import InputError
from qkit.evaluation.agreement import agreement, reference_continuation
from qkit.evaluation.battery import build_prompts, generate_answers, is_correct, load_battery, model_repetition_penalty
from qkit.evaluation.corpora import load_corpus
from qkit.evaluation.perplexity import CorpusReference, TokenScores
from qkit.evaluation.stats import mcnemar_exact, wilson_interval
from qkit.models import ModelRef, load, parse_device, resolve
from qkit.evaluation.specs import RowSpec, resolve_rows
from qkit.methods import RTN
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.schemes import DEFAULT_SCHEMES, QuantizedTensor
from qkit.simulate import RuntimeContext, apply_runtime, runtime_bits
from qkit.transform import is_block_projection

REFERENCE = "reference"
COLLAPSE_FACTOR = 10.0  # a row whose perplexity is this many times the reference's has collapsed


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
    repetition_penalty: bool = True
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    device: str | None = None
    device_map: str | None = None  # "auto" etc.: spread the reference over several devices (accelerate)
    seed: int = 0

    def validate(self) -> None:
        """Every check that needs no model (counts, names, device), so a bad option fails in milliseconds:
        ``evaluate`` calls it before anything is resolved or loaded. The window's upper bound (the model's
        context) is checked once the model is loaded."""
        from qkit.models import check_device_map
        from qkit.schemes.registry import parse_scale_dtype

        for flag, value, least in (("--tokens", self.tokens, 2), ("--agree-tokens", self.agree_tokens, 1),
                                   ("--window", self.window, 2), ("battery_tokens", self.battery_tokens, 1)):
            if value is not None and value < least:
                raise InputError(f"{flag} must be at least {least}, got {value}")
        parse_scale_dtype(self.scale_dtype)
        parse_device(self.device)
        if self.device_map is not None:
            check_device_map(self.device_map)
        specs = resolve_rows(self.schemes, self.methods, dict(self.method_options))  # unknown names, methods
        from qkit.simulate import get_runtime
        from qkit.simulate.options import check_keys

        check_keys(dict(self.runtime_options))  # a misspelt runtime option, even with no runtime row
        for spec in specs:  # unknown runtimes, bad runtime option values (--threshold 0, --kv-residual -1)
            for name in spec.runtime:
                get_runtime(name, dict(spec.runtime_options or self.runtime_options))


@dataclass
class Row:
    scheme: str  # the row's name (RowSpec.name)
    bits_per_weight: float
    size_bytes: int
    perplexity: float
    perplexity_se: float
    perplexity_change_pct: float
    perplexity_change_se_pct: float
    kld: float
    kld_se: float
    top1_match: float
    battery_correct: int
    battery_total: int
    battery_ci95: tuple[float, float]
    battery_answers: list[bool]
    battery_outputs: list[str]
    mcnemar_only_reference: int
    mcnemar_only_row: int
    mcnemar_p: float
    agreement: int
    agreement_total: int
    agreement_ci95: tuple[float, float]
    seconds: float
    matrices: int
    spec: dict = field(default_factory=dict)  # RowSpec.to_dict(): storage scheme, method, runtime
    act_bits: int | None = None  # activation bits simulated at run time (None: unquantized)
    kv_bits: int | None = None  # KV-cache bits simulated at run time (None: the model's dtype)
    runtime_stats: dict = field(default_factory=dict)  # e.g. LLM.int8's share of 16-bit columns per layer
    weights_changed: int | None = None  # quantized tensors whose values differ from the reference's
    method_record: dict = field(default_factory=dict)  # what the method did (calibration, per-layer errors)


@dataclass
class EvalReport:
    rows: list[Row]
    provenance: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rows": [asdict(r) for r in self.rows], "provenance": self.provenance, "notes": self.notes}


class _Swapper:
    """Replace a model's quantized matrices in place, keeping one copy of the originals to restore."""

    def __init__(self, model):
        self.model = model
        self.originals: dict[str, torch.Tensor] = {}
        self.changed = 0  # tensors of the last ``apply`` whose values differ from the reference's

    def apply(self, tensors: dict[str, QuantizedTensor | torch.Tensor]) -> None:
        """Copy each dequantized ``QuantizedTensor`` (or full-precision replacement, e.g. a norm that a
        method folded scales into) into the model's parameter of that name."""
        self.changed = 0
        with torch.no_grad():
            for name, value in tensors.items():
                p = self.model.get_parameter(name)
                shape = value.shape if isinstance(value, QuantizedTensor) else tuple(value.shape)
                if tuple(p.shape) != tuple(shape):
                    raise InputError(f"{name}: checkpoint shape {list(shape)} != model shape {list(p.shape)}; pass the matching --reference")
                if name not in self.originals:
                    self.originals[name] = p.detach().clone()
                p.copy_(value.dequantize(p.dtype) if isinstance(value, QuantizedTensor) else value.to(p.dtype))
                self.changed += not torch.equal(p, self.originals[name])

    def restore(self) -> None:
        with torch.no_grad():
            for name, w in self.originals.items():
                self.model.get_parameter(name).copy_(w)


def evaluate(
    model: str | Path | None = None,
    *,
    options: EvalOptions = EvalOptions(),
    on_status: Callable[[str], None] | None = None,
) -> EvalReport:
    """Evaluate MODEL under every scheme (or a saved qkit checkpoint against its reference)."""
    say = on_status or (lambda _m: None)
    options.validate()  # a bad option fails before anything is loaded
    torch.manual_seed(options.seed)
    target = resolve(model)
    checkpoint: ModelRef | None = None
    if target.is_quantized:
        checkpoint, ref = target, resolve(options.reference)
        specs: list[RowSpec] = []
    else:
        if options.reference is not None:
            raise InputError("--reference is only for evaluating a saved qkit checkpoint; drop it or pass a checkpoint as MODEL")
        ref = target
        specs = resolve_rows(options.schemes, options.methods, dict(options.method_options))  # validate names first
    corpus = load_corpus(options.corpus)

    say("loading the reference model")
    loaded = load(ref=ref, device=options.device, device_map=options.device_map)
    lm, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise InputError(f"{ref.spec} has no tokenizer files; eval needs one (tokenizer.json or similar)")
    max_ctx = int(getattr(lm.config, "max_position_embeddings", 2048) or 2048)
    window = options.window or min(2048, max_ctx)
    if window > max_ctx:
        raise InputError(f"--window {window} exceeds the model's maximum context {max_ctx}; pass --window {max_ctx} or less")
    ids = torch.tensor(tok(corpus.text, add_special_tokens=False)["input_ids"][: options.tokens])
    if ids.numel() < options.tokens:
        say(f"note: the corpus has only {ids.numel()} tokens; using all of them")

    t0 = time.perf_counter()
    say("reference: perplexity")
    corpus_ref = CorpusReference(lm, ids, window)
    battery = load_battery()
    prompts = build_prompts(tok, [q.question for q in battery])
    rp = model_repetition_penalty(lm) if options.repetition_penalty else 1.0
    say("reference: greedy continuations for agreement")
    continuation = reference_continuation(lm, tok, prompts, options.agree_tokens)

    def measure(name: str, bits: float, size: int, matrices: int, started: float, ref_row: Row | None, **facts) -> Row:
        if ref_row is not None:
            say(f"{name}: perplexity and KL divergence")
        scores: TokenScores = corpus_ref.score(lm) if ref_row is not None else ref_scores
        say(f"{name}: battery")
        outputs = generate_answers(lm, tok, prompts, options.battery_tokens, rp)
        answers = [is_correct(o, q.answers) for o, q in zip(outputs, battery)]
        say(f"{name}: agreement")
        agree = agreement(lm, continuation)
        k, n = int(agree.sum()), int(agree.numel())
        if ref_row is None:
            change, change_se, (only_ref, only_row, p) = 0.0, 0.0, (0, 0, 1.0)
        else:
            change, change_se = scores.change_against(ref_scores)
            only_ref, only_row, p = mcnemar_exact(ref_row.battery_answers, answers)
        return Row(
            scheme=name,
            bits_per_weight=bits,
            size_bytes=size,
            perplexity=scores.perplexity,
            perplexity_se=scores.perplexity_se,
            perplexity_change_pct=change,
            perplexity_change_se_pct=change_se,
            kld=scores.kld,
            kld_se=scores.kld_se,
            top1_match=scores.top1_match,
            battery_correct=sum(answers),
            battery_total=len(answers),
            battery_ci95=wilson_interval(sum(answers), len(answers)),
            battery_answers=answers,
            battery_outputs=outputs,
            mcnemar_only_reference=only_ref,
            mcnemar_only_row=only_row,
            mcnemar_p=p,
            agreement=k,
            agreement_total=n,
            agreement_ci95=wilson_interval(k, n),
            seconds=time.perf_counter() - started,
            matrices=matrices,
            **facts,
        )

    ref_scores = corpus_ref.own_scores()
    shapes = tensor_shapes(ref.directory)
    ref_targets = [n for n, s in shapes if is_block_projection(n, s)]
    ref_bits = 8 * lm.get_parameter(ref_targets[0]).element_size() if ref_targets else float("nan")
    rows = [measure(REFERENCE, ref_bits, checkpoint_bytes(ref.directory), 0, t0, None)]

    swapper = _Swapper(lm)
    try:
        if checkpoint is not None:
            t1 = time.perf_counter()
            quantized = {n: v for n, v in iter_quantized(checkpoint.directory) if isinstance(v, QuantizedTensor)}
            swapper.apply(quantized)
            bits = 8 * sum(q.nbytes for q in quantized.values()) / max(1, sum(q.numel for q in quantized.values()))
            label = f"checkpoint ({'+'.join(sorted({q.scheme.name for q in quantized.values()}))})"
            rows.append(measure(label, bits, checkpoint_bytes(checkpoint.directory), len(quantized), t1, rows[0]))
        context = RuntimeContext(device=next(lm.parameters()).device, extra={"tokenizer": tok, "model_ref": ref})
        for spec in specs:
            t1 = time.perf_counter()
            built = build_row_model(spec, ref, swapper, options, say)
            bits = built.bits_per_weight if built is not None else rows[0].bits_per_weight
            size = built.bytes_after if built is not None else rows[0].size_bytes
            matrices = built.matrices if built is not None else 0
            act_bits, kv_bits = runtime_bits(spec.runtime, dict(spec.runtime_options or options.runtime_options))
            with apply_runtime(lm, spec.runtime, context, dict(spec.runtime_options or options.runtime_options)) as stats:
                row = measure(spec.name, bits, size, matrices, t1, rows[0], spec=spec.to_dict(), act_bits=act_bits,
                              kv_bits=kv_bits, method_record=built.method_record if built is not None else {},
                              weights_changed=swapper.changed if built is not None else None)
            row.runtime_stats = stats
            rows.append(row)
            swapper.restore()
    finally:
        swapper.restore()

    provenance = {
        "model": ref.spec,
        "model_kind": ref.kind,
        "model_source": ref.provenance,
        "checkpoint": str(checkpoint.directory) if checkpoint else None,
        "corpus": corpus.provenance(),
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
        "device": str(next(lm.parameters()).device),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "seconds_total": time.perf_counter() - t0,
    }
    return EvalReport(rows, provenance, interpret(rows))


def build_row_model(spec: RowSpec, ref: ModelRef, swapper: _Swapper, options: EvalOptions, say: Callable[[str], None]):
    """Put ``spec``'s weights into the swapper's model: ``quantize_model`` (the path that writes
    checkpoints) into a temporary directory, then the dequantized matrices and any replaced
    full-precision tensors swapped in. Returns the ``QuantizeResult`` (None for unquantized weights)."""
    if spec.scheme is None:
        return None
    say(f"{spec.name}: quantizing" + (f" ({spec.method})" if spec.method != RTN else ""))
    with tempfile.TemporaryDirectory(prefix="qkit-eval-") as tmp:
        result = quantize_model(
            ref=ref, output=Path(tmp) / "row", scheme=spec.scheme, scale_dtype=options.scale_dtype, collect=True,
            device="cpu", method=spec.method, method_options=dict(spec.method_options) or None,
        )
    swapper.apply({**result.replaced, **result.quantized})
    return result


def interpret(rows: list[Row]) -> list[str]:
    """What the numbers do and do not support, in words."""
    ref = rows[0]
    notes: list[str] = []
    others = rows[1:]
    if not others:
        return notes
    collapsed = [r for r in others if r.perplexity >= COLLAPSE_FACTOR * ref.perplexity]
    for r in others:
        if r.weights_changed == 0 and r.matrices:
            notes.append(f"{r.scheme} reproduces the reference's weights bit for bit: its grid is the one the reference was "
                         "published in (the default model is Q4_1: asymmetric blocks of 32), so this row measures nothing "
                         "about the scheme or method; do not compare it with the others.")
    for r in collapsed:
        notes.append(f"{r.scheme} collapsed: perplexity {r.perplexity:,.0f} is {r.perplexity / ref.perplexity:,.0f}x the reference's {ref.perplexity:.2f}.")
    for r in others:
        if r in collapsed:
            continue
        lo = r.perplexity_change_pct - 2 * r.perplexity_change_se_pct
        hi = r.perplexity_change_pct + 2 * r.perplexity_change_se_pct
        if lo <= 0 <= hi:
            notes.append(f"{r.scheme}: perplexity change {r.perplexity_change_pct:+.2f}% (±{2 * r.perplexity_change_se_pct:.2f}%, 2 paired SE) is indistinguishable from the reference on these tokens.")
        else:
            notes.append(f"{r.scheme}: perplexity {r.perplexity_change_pct:+.2f}% (±{2 * r.perplexity_change_se_pct:.2f}%, 2 paired SE) against the reference, a real difference on these tokens.")
    survivors = sorted((r for r in others if r not in collapsed and r.bits_per_weight < 6), key=lambda r: r.perplexity)
    if len(survivors) > 1 and all(r.bits_per_weight < 5 for r in survivors):
        notes.append("4-bit rows from best to worst perplexity: " + " < ".join(f"{r.scheme} ({r.perplexity:.2f})" for r in survivors) + ".")
    elif len(survivors) > 1:  # a mixed recipe (q4_k_m on 576-wide rows: mostly Q5_0) is not a 4-bit row: say its bits
        notes.append("rows below 6 bits per weight from best to worst perplexity (bits/w): " + " < ".join(
            f"{r.scheme} ({r.perplexity:.2f}, {r.bits_per_weight:.2f})" for r in survivors) + ".")
    distinct = [r for r in others if r.mcnemar_p < 0.05]
    if distinct:
        notes.append("battery differences distinguishable from the reference (exact McNemar p < 0.05): "
                     + ", ".join(f"{r.scheme} ({r.battery_correct}/{r.battery_total}, {_p(r.mcnemar_p)})" for r in distinct) + ".")
    if len(distinct) < len(others):
        same = [r.scheme for r in others if r.mcnemar_p >= 0.05]
        notes.append(f"battery differences of {', '.join(same)} against the reference are not distinguishable "
                     f"(exact McNemar p >= 0.05): with {ref.battery_total} questions, a difference needs at least "
                     f"{_min_discordant(0.05)} answers changing in one direction to count.")
    best = max(others, key=lambda r: r.agreement)
    notes.append(f"greedy agreement is the acceptance rate of a quantized draft in speculative decoding: best {best.scheme} "
                 f"{best.agreement}/{best.agreement_total} ({100 * best.agreement / best.agreement_total:.0f}%).")
    return notes


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _min_discordant(alpha: float) -> int:
    """Smallest n such that n discordant pairs all in one direction reach exact McNemar p < alpha."""
    n = 1
    while 2 * 0.5**n >= alpha:
        n += 1
    return n
