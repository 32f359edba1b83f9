"""``qkit eval``: one row per spec, computed from the same transform ``qkit quantize`` writes.

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

Each row's checkpoint is written under ``$TMPDIR/qkit-eval-PID-RANDOM`` (removed when the row is built,
on an exception and on Ctrl-C); one left by a killed eval (SIGKILL) is removed by the next eval, which
says so in a status line.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit import __version__
from qkit.api import quantize_model
from qkit.checkpoint import checkpoint_bytes, iter_quantized, read_manifest, tensor_shapes
from qkit.errors import CheckpointError, InputError
from qkit.evaluation.agreement import agreement, reference_continuation
from qkit.evaluation.battery import build_prompts, generate_answers, is_correct, load_battery, model_repetition_penalty
from qkit.evaluation.corpora import load_corpus
from qkit.evaluation.perplexity import MIN_SCORED, CorpusReference, TokenScores, check_scored, scored_positions
from qkit.evaluation.stats import mcnemar_exact, wilson_interval
from qkit.models import ModelRef, check_complete, load, load_tokenizer, parse_device, resolve
from qkit.outputs import _pid_alive  # the same liveness test as the staging siblings of every output
from qkit.evaluation.specs import RowSpec, resolve_rows
from qkit.methods import RTN, get_method, make_options
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.schemes import DEFAULT_SCHEMES, QuantizedTensor
from qkit.simulate import RuntimeContext, apply_runtime, runtime_bits
from qkit.transform import entry_to_spec, is_block_projection

REFERENCE = "reference"
COLLAPSE_FACTOR = 10.0  # a row whose perplexity is this many times the reference's has collapsed
TMP_PREFIX = "qkit-eval-"  # a row's temporary checkpoint: $TMPDIR/qkit-eval-PID-RANDOM (tempfile's 8 characters)
_TMP_DIR = re.compile(rf"^{TMP_PREFIX}(?P<pid>[0-9]+)-[a-z0-9_]{{8}}$")


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
    trust_remote_code: bool = False  # allow a model's own code (auto_map); never asked for interactively

    def validate(self) -> None:
        """Every check that needs no model (counts, names, device), so a bad option fails in milliseconds:
        ``evaluate`` calls it before anything is resolved or loaded. The window's upper bound (the model's
        context) and the default window's token minimum are checked from the model's config, before loading."""
        from qkit.models import check_device_map
        from qkit.schemes.registry import parse_scale_dtype

        for flag, value, least in (("--agree-tokens", self.agree_tokens, 1),
                                   ("--window", self.window, 2), ("battery_tokens", self.battery_tokens, 1)):
            if value is not None and value < least:
                raise InputError(f"{flag} must be at least {least}, got {value}")
        check_scored(self.tokens, self.window)  # a perplexity without a standard error is never reported
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
        """JSON-able; a number that could not be computed (NaN, inf) is ``None`` (``null``: JSON has no NaN, and
        a reader must not take it for a value)."""
        return _finite({"rows": [asdict(r) for r in self.rows], "provenance": self.provenance, "notes": self.notes})


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Swapper:
    """Replace a model's tensors in place, keeping one copy of the originals to restore."""

    def __init__(self, model):
        self.model = model
        # Parameters and buffers by every name they answer to (tied weights under both names).
        self.targets: dict[str, torch.Tensor] = {**dict(model.named_buffers(remove_duplicate=False)),
                                                 **dict(model.named_parameters(remove_duplicate=False))}
        self.originals: dict[str, torch.Tensor] = {}
        self.changed = 0  # tensors of the last ``apply`` whose values differ from the reference's

    def apply(self, tensors: Iterable[tuple[str, QuantizedTensor | torch.Tensor]]) -> None:
        """Copy each dequantized ``QuantizedTensor`` (or full-precision replacement, e.g. a norm that a
        method folded scales into) into the model's tensor of that name. A stored tensor the model does not
        hold (transformers ignored it when it loaded the reference, e.g. an old ``rotary_emb.inv_freq``) is
        skipped, as it was then; a full-precision tensor equal to the model's is not copied (nor saved)."""
        self.changed = 0
        with torch.no_grad():
            for name, value in tensors:
                p = self.targets.get(name)
                if p is None:
                    continue
                shape = value.shape if isinstance(value, QuantizedTensor) else tuple(value.shape)
                if tuple(p.shape) != tuple(shape):
                    raise InputError(f"{name}: checkpoint shape {list(shape)} != model shape {list(p.shape)}; pass the matching --reference")
                new = value.dequantize(p.dtype) if isinstance(value, QuantizedTensor) else value.to(p.dtype)
                if name not in self.originals:
                    if torch.equal(p, new.to(p.device)):
                        continue
                    self.originals[name] = p.detach().clone()
                p.copy_(new)
                self.changed += not torch.equal(p, self.originals[name])

    def restore(self) -> None:
        with torch.no_grad():
            for name, w in self.originals.items():
                self.targets[name].copy_(w)


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
    config = _config(ref)  # None: transformers cannot read it; ``load`` below says why in one line
    window = _window(options, config) if config is not None else None
    check_complete(ref)  # the reference too, before the status line below (load() reuses the build)
    if checkpoint is not None:  # headers only (and a meta-device build of the config): before anything heavy
        check_complete(checkpoint)  # every tensor its config implies (load() checks the reference's)
        check_checkpoint_matches(checkpoint, ref, config)  # ... and exactly the reference's, shape for shape
    # The tokenizer first (milliseconds; load() reads it again): the corpus and calibration checks need no model.
    tok = load_tokenizer(ref.directory)
    if tok is None:
        raise InputError(f"{ref.spec} has no tokenizer files; eval needs one (tokenizer.json or similar)")
    ids = torch.tensor(tok(corpus.text, add_special_tokens=False)["input_ids"][: options.tokens], dtype=torch.long)
    if window is not None:
        _check_corpus_tokens(corpus, int(ids.numel()), window)
    calibrations = check_calibrations(specs, tok, corpus)

    say("loading the reference model")
    loaded = load(ref=ref, device=options.device, device_map=options.device_map)
    lm = loaded.model
    if window is None:  # only when the config could not be read above but transformers loaded it anyway
        window = _window(options, lm.config)
        _check_corpus_tokens(corpus, int(ids.numel()), window)
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
        "device": str(next(lm.parameters()).device),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "seconds_total": time.perf_counter() - t0,
    }
    return EvalReport(rows, provenance, interpret(rows, corpus_ref.scored_tokens))


# --------------------------------------------------------------------------- checks before the model is loaded


def _config(ref: ModelRef):
    """The reference's transformers config (no weights read), or None when transformers cannot build it
    (``load`` then refuses with its own one-line message). Never runs repository code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ref.directory), trust_remote_code=ref.trust_remote_code)
    except Exception:  # noqa: BLE001 - any failure here is reported by ``load``, which reads the same file
        return None


def _window(options: EvalOptions, config) -> int:
    """The window (``--window`` or min(2048, the model's context)), checked against the context and the tokens."""
    max_ctx = int(getattr(config, "max_position_embeddings", 2048) or 2048)
    window = options.window or min(2048, max_ctx)
    if window > max_ctx:
        raise InputError(f"--window {window} exceeds the model's maximum context {max_ctx}; pass --window {max_ctx} or less")
    check_scored(options.tokens, window)
    return window


def _check_corpus_tokens(corpus, n: int, window: int) -> None:
    """A corpus shorter than ``--tokens`` must still score ``MIN_SCORED`` positions."""
    scored = scored_positions(n, window)
    if scored < MIN_SCORED:
        raise InputError(
            f"the corpus {corpus.name} has only {n} token(s), which score {scored} position(s) in windows of {window} "
            f"(the first token of each window has no context); a standard error needs {MIN_SCORED}: pass a longer --corpus"
        )


def check_calibrations(specs: list[RowSpec], tokenizer, corpus) -> list[dict]:
    """Every calibrated row's calibration text, read, checked disjoint from the eval ``corpus`` and sampled
    (``qkit.methods.calibration.calibration_ids``) before the model is loaded, so an unreadable, overlapping
    or too short text is refused in one line before the reference row. Returns each distinct text's
    provenance (the method reads and samples it again when its row is built: milliseconds next to a row)."""
    from qkit.methods.calibration import calibration_ids

    seen: dict[Any, dict] = {}
    for spec in specs:
        method = get_method(spec.method)
        if method is None or not method.calibrated:
            continue
        chosen = make_options(method, dict(spec.method_options)).calibration_options()
        if chosen not in seen:
            seen[chosen] = calibration_ids(tokenizer, chosen, evaluation=corpus)[1]
    return list(seen.values())


def _stored_weights(directory: Path) -> dict[str, tuple[int, ...]]:
    """A checkpoint's weights by name and shape from its headers and manifest: a quantized weight's stored
    parts (``W.qweight``, ``W.scales``, ...) stand for ``W`` with its original shape."""
    entries = (read_manifest(directory) or {}).get("tensors") or {}
    if not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint {directory}: the manifest's 'tensors' is not a JSON object; re-create it")
    out: dict[str, tuple[int, ...]] = {}
    parts: dict[str, set[str]] = {}
    for key, shape in tensor_shapes(directory):
        base, dot, part = key.rpartition(".")
        if dot and base in entries:
            parts.setdefault(base, set()).add(part)
        else:
            out[key] = tuple(shape)
    lacking = []
    for name, entry in entries.items():
        try:
            scheme, shape, _dtype = entry_to_spec(entry)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {directory}: malformed manifest entry for {name} ({exc!r}); re-create it") from exc
        if set(scheme.parts) - parts.get(name, set()):  # iter_quantized would find this only after the model loads
            lacking.append(f"{name}.{'/'.join(sorted(set(scheme.parts) - parts.get(name, set())))}")
        out[name] = shape
    if lacking:
        raise CheckpointError(f"checkpoint {directory} lacks stored parts {', '.join(sorted(lacking)[:3])}"
                              + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "") + "; re-create it")
    return out


def check_checkpoint_matches(checkpoint: ModelRef, ref: ModelRef, config=None) -> None:
    """Refuse, from both headers and before anything is loaded, a checkpoint whose weights are not the
    reference's: every tensor the reference stores must be in the checkpoint (quantized or as stored) with the
    same shape, and nothing else (a tied ``lm_head.weight`` may be stored on one side only)."""
    have = _stored_weights(checkpoint.directory)
    want = dict(tensor_shapes(ref.directory))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    optional = {n for n in {*have, *want} if tied and n.endswith("lm_head.weight")}
    missing = sorted(n for n in want.keys() - have.keys() if n not in optional)
    extra = sorted(n for n in have.keys() - want.keys() if n not in optional)
    wrong = sorted(n for n in want.keys() & have.keys() if tuple(want[n]) != tuple(have[n]))
    if not (missing or extra or wrong):
        return

    def some(names: list[str], fmt=lambda n: n) -> str:
        return ", ".join(fmt(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = ([f"missing {some(missing)}"] if missing else []) + ([f"extra {some(extra)}"] if extra else []) + (
        [f"shape of {some(wrong, lambda n: f'{n} {list(have[n])} (reference {list(want[n])})')}"] if wrong else [])
    raise InputError(
        f"checkpoint {checkpoint.spec} does not match the reference {ref.spec} ({'; '.join(parts)}); "
        "pass the --reference it was made from, or re-create the checkpoint"
    )


# --------------------------------------------------------------------------- rows' temporary checkpoints


def remove_stale_row_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove ``qkit-eval-PID-*`` directories under ``parent`` (default: ``tempfile.gettempdir()``, i.e.
    ``$TMPDIR``) whose writer process is gone (an eval killed by SIGKILL or a power cut); return them.
    A live eval's directory (its PID exists) is never touched."""
    root = Path(parent or tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    removed = []
    for p in sorted(entries):
        m = _TMP_DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group("pid"))):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
    return removed


def build_row_model(spec: RowSpec, ref: ModelRef, swapper: _Swapper, options: EvalOptions, say: Callable[[str], None]):
    """Put ``spec``'s weights into the swapper's model: ``quantize_model`` (the path that writes
    checkpoints) into a temporary directory, then the dequantized matrices and any replaced
    full-precision tensors swapped in. Returns the ``QuantizeResult`` (None for unquantized weights)."""
    if spec.scheme is None:
        return None
    # The writer's PID in the name: a killed eval's directory is found and removed by the next one.
    with tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-") as tmp:
        say(f"{spec.name}: quantizing" + (f" ({spec.method})" if spec.method != RTN else ""))
        result = quantize_model(
            ref=ref, output=Path(tmp) / "row", scheme=spec.scheme, scale_dtype=options.scale_dtype, collect=True,
            device="cpu", method=spec.method, method_options=dict(spec.method_options) or None,
        )
    swapper.apply([*result.replaced.items(), *result.quantized.items()])
    return result


def interpret(rows: list[Row], scored_tokens: int | None = None) -> list[str]:
    """What the numbers do and do not support, in words. A statistic that could not be computed (NaN or
    infinite: no standard error, a model that produced NaN log-probabilities) is said to be missing, never
    called a difference or a match."""
    ref = rows[0]
    notes: list[str] = []
    others = rows[1:]
    if not others:
        return notes
    finite = math.isfinite
    # A non-finite perplexity (NaN or inf log-probabilities) has collapsed as surely as a 10x one.
    collapsed = [r for r in others if not finite(r.perplexity) or r.perplexity >= COLLAPSE_FACTOR * ref.perplexity]
    for r in others:
        if r.weights_changed == 0 and r.matrices:
            notes.append(f"{r.scheme} reproduces the reference's weights bit for bit: its grid is the one the reference was "
                         "published in (the default model is Q4_1: asymmetric blocks of 32), so this row measures nothing "
                         "about the scheme or method; do not compare it with the others.")
    for r in collapsed:
        if not finite(r.perplexity):
            notes.append(f"{r.scheme} collapsed: its perplexity is {r.perplexity} (the model's log-probabilities are not "
                         "finite); none of its corpus statistics can be compared.")
        else:
            notes.append(f"{r.scheme} collapsed: perplexity {r.perplexity:,.0f} is {r.perplexity / ref.perplexity:,.0f}x the reference's {ref.perplexity:.2f}.")
    on = f" on {scored_tokens:,} scored tokens" if scored_tokens is not None else ""
    for r in others:
        if r in collapsed:
            continue
        if not (finite(r.perplexity_change_pct) and finite(r.perplexity_change_se_pct)):
            notes.append(f"{r.scheme}: perplexity change {r.perplexity_change_pct:+.2f}% has no standard error{on}; "
                         "it is neither a difference nor a match: score more tokens (--tokens).")
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
    if ref.battery_total:  # McNemar needs paired answers; no questions, no test
        distinct = [r for r in others if finite(r.mcnemar_p) and r.mcnemar_p < 0.05]
        if distinct:
            notes.append("battery differences distinguishable from the reference (exact McNemar p < 0.05): "
                         + ", ".join(f"{r.scheme} ({r.battery_correct}/{r.battery_total}, {_p(r.mcnemar_p)})" for r in distinct) + ".")
        same = [r.scheme for r in others if finite(r.mcnemar_p) and r.mcnemar_p >= 0.05]
        if same:
            notes.append(f"battery differences of {', '.join(same)} against the reference are not distinguishable "
                         f"(exact McNemar p >= 0.05): with {ref.battery_total} questions, a difference needs at least "
                         f"{_min_discordant(0.05)} answers changing in one direction to count.")
    measured = [r for r in others if r.agreement_total]
    if measured:
        best = max(measured, key=lambda r: r.agreement / r.agreement_total)
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
