"""Measured serving costs on this machine: generation with and without the KV cache, prefill, decode, batching.

Every figure is the median of ``repeats`` timed runs (after ``warmup`` untimed ones; for generation one
short warm-up generation in all) with its spread,
half the range ``(max - min) / 2``. Greedy decoding, seeded random prompt token ids (timing does not
depend on which tokens), one logit row per forward (``logits_to_keep=1``, as a server does).

Multiply-accumulates are counted analytically for one forward over ``new`` tokens after ``past``
cached ones (dense attention kernels compute the masked half of a prefill too, so it is counted)::

    linear    = new x P                 P: parameters of the block projections (q, k, v, o, MLP)
    attention = 2 x layers x heads x head_dim x new x (past + new)      (Q K^T and A V)
    lm head   = hidden x vocab          (one logit row)

Generation of T tokens after a P-token prompt: *with* the cache one prefill ``(0, P)`` then T-1 steps
``(P + t - 1, 1)``; *without* it T full forwards ``(0, P + t)``, t = 0..T-1.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from qkit.bounds import whole
from qkit.errors import InputError
from qkit.models import checked, load, parse_device
from qkit.serving.kv import (
    architecture_from_config,
    cache_kwarg,
    hf_config,
    human_bytes,
    model_from_config,
    output_cache,
    parameter_estimate,
    read_config_file,
)
from qkit.threads import available_memory, check_threads
from qkit.transform import is_block_projection

if TYPE_CHECKING:  # annotations only: transformers is imported where the model is loaded
    from transformers import PreTrainedModel

BENCH_SEED = 0
MAX_REPEATS = 100_000  # timed runs per figure: a median of more says nothing new


@dataclass(frozen=True)
class BenchConfig:
    """What ``qkit bench`` measures. ``quick()`` is the smaller set for a fast look."""

    gen_tokens: tuple[int, ...] = (16, 32, 64, 128)
    prompt_tokens: int = 8
    prefill_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    decode_cache: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    batch_cache: int = 64
    repeats: int = 3
    warmup: int = 1
    knee_gain: float = 1.10  # throughput must grow by at least 10% per doubling before the knee

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(gen_tokens=(16, 32), prefill_tokens=(16, 64, 256), decode_cache=(16, 64, 256), batch_sizes=(1, 2, 4, 8))

    def check(self) -> BenchConfig:
        sizes = (*self.gen_tokens, *self.prefill_tokens, *self.decode_cache, *self.batch_sizes, self.prompt_tokens, self.batch_cache)
        if self.repeats < 1 or self.warmup < 0 or min(sizes) < 1:
            raise InputError("bench sizes and --repeats must be positive integers")
        whole(self.repeats, "--repeats", 1, MAX_REPEATS)
        return self


@dataclass(frozen=True)
class Timing:
    """Seconds of ``len(samples)`` runs: ``median`` and ``spread`` = half the range."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        return (max(self.samples) - min(self.samples)) / 2

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "spread": self.spread, "samples": self.samples}


@dataclass(frozen=True)
class MacCounts:
    """The analytic multiply-accumulate model of one decoder (see the module docstring)."""

    block_params: int
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int

    def forward(self, past: int, new: int, logits: int = 1) -> int:
        linear = new * self.block_params
        attention = 2 * self.layers * self.heads * self.head_dim * new * (past + new)
        return linear + attention + logits * self.hidden * self.vocab

    def generate_cached(self, prompt: int, tokens: int) -> int:
        return self.forward(0, prompt) + sum(self.forward(prompt + t - 1, 1) for t in range(1, tokens))

    def generate_uncached(self, prompt: int, tokens: int) -> int:
        return sum(self.forward(0, prompt + t) for t in range(tokens))


def mac_counts(model: PreTrainedModel) -> MacCounts:
    """The MAC model of a loaded transformers causal LM (block projections counted from its parameters)."""
    cfg = model.config.get_text_config()
    block = sum(p.numel() for n, p in model.named_parameters() if is_block_projection(n, tuple(p.shape)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return MacCounts(block, cfg.num_hidden_layers, cfg.num_attention_heads, head_dim, cfg.hidden_size, cfg.vocab_size)


# --------------------------------------------------------------------------- primitives


class _Runner:
    """Forward passes of one model with the cache keyword of this transformers version."""

    def __init__(self, model: PreTrainedModel, device: torch.device):
        self.model = model
        self.device = device
        self.cache_kw = cache_kwarg(model)
        self.vocab = int(model.config.get_text_config().vocab_size)
        self.last_result: Any = None

    def ids(self, batch: int, tokens: int, seed: int = BENCH_SEED) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (batch, tokens), generator=g).to(self.device)

    def forward(self, ids: torch.Tensor, cache: Any = None, use_cache: bool = True) -> tuple[torch.Tensor, Any]:
        kwargs = {self.cache_kw: cache} if cache is not None else {}
        out = self.model(input_ids=ids, use_cache=use_cache, logits_to_keep=1, **kwargs)
        return out.logits[:, -1:].argmax(-1), output_cache(out)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate_cached(self, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
        nxt, cache = self.forward(prompt)
        out = [nxt]
        for _ in range(tokens - 1):
            nxt, cache = self.forward(nxt, cache)
            out.append(nxt)
        return torch.cat(out, dim=1)

    def generate_uncached(self, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
        ids = prompt
        for _ in range(tokens):
            nxt, _ = self.forward(ids, use_cache=False)
            ids = torch.cat([ids, nxt], dim=1)
        return ids[:, prompt.shape[1] :]

    def time(self, fn: Callable[[], Any], repeats: int, warmup: int, after: Callable[[], Any] | None = None) -> Timing:
        """Median-able samples of ``fn``; ``after`` (untimed) restores state between runs.
        ``self.last_result`` keeps what the last run returned."""
        samples = []
        for i in range(warmup + repeats):
            self.sync()
            t0 = time.perf_counter()
            self.last_result = fn()
            self.sync()
            dt = time.perf_counter() - t0
            if after is not None:
                after()
            if i >= warmup:
                samples.append(dt)
        return Timing(samples)


def _crop(cache: Any, length: int) -> None:
    """Cut a cache back to ``length`` tokens (transformers 5 ``crop`` takes a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# --------------------------------------------------------------------------- report


@dataclass
class BenchReport:
    model: str
    device: str
    threads: int
    machine: str
    dtype: str
    config: dict[str, Any]
    generation: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    batching: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench(
    *,
    model: str | None = None,
    config: str | None = None,
    device: str | None = None,
    quick: bool = False,
    repeats: int | None = None,
    threads: int | None = None,
    settings: BenchConfig | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> BenchReport:
    """Measure generation, prefill, decode and batching of MODEL (or a random model from a config.json).

    ``threads`` sets torch's CPU threads for the run and restores the previous number afterwards (on a
    machine shared with other jobs, one thread per free core avoids oversubscribed thread barriers).
    """

    check_threads(threads)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(model, config, device, quick, repeats, settings, on_stage)
    finally:
        torch.set_num_threads(previous)


def _bench(model, config, device, quick, repeats, settings, on_stage) -> BenchReport:

    cfg = settings or (BenchConfig.quick() if quick else BenchConfig())
    if repeats is not None:
        cfg = replace(cfg, repeats=repeats)
    cfg.check()
    if model is not None and config is not None:
        raise InputError("give either MODEL or --config, not both")
    dev = parse_device(device)
    # A bad MODEL or --config is refused in one line, before the first stage line.
    if config is None:
        model = checked(model)
    else:
        config_dict = read_config_file(config)
        check_random_model_fits(architecture_from_config(config_dict, str(config)), dev)  # sizes and memory, before building it
        hf_config(config_dict)  # and transformers' own checks, before the first stage line
    stage = on_stage or (lambda _s: None)
    start = time.perf_counter()
    stage("loading the model")
    if config is not None:
        lm = model_from_config(config_dict, torch.float32, dev)
        name = f"{config} (random weights)"
    else:
        loaded = load(model, device=dev)
        lm, name = loaded.model, loaded.ref.spec
    run = _Runner(lm, dev)
    macs = mac_counts(lm)
    report = BenchReport(
        name, str(dev), torch.get_num_threads(), platform.processor() or platform.machine(),
        str(next(lm.parameters()).dtype).removeprefix("torch."), {**asdict(cfg), "mac_model": asdict(macs)},
    )
    with torch.inference_mode():
        _generation(run, cfg, macs, report, stage)
        _prefill_decode(run, cfg, macs, report, stage)
        _batching(run, cfg, report, stage)
    report.seconds = time.perf_counter() - start
    return report


def check_random_model_fits(arch: Any, device: torch.device) -> None:
    """Refuse a ``--config`` whose random fp32 model (``parameter_estimate`` x 4 bytes) does not fit in the
    memory free on ``device`` (``qkit.threads.available_memory``), before it is built."""

    need, free = parameter_estimate(arch) * 4, available_memory(str(device))
    if free is not None and need > free:
        raise InputError(
            f"--config {arch.name} describes a model of {parameter_estimate(arch):,} parameters: its random fp32 weights "
            f"need about {human_bytes(need)}, more than the {human_bytes(free)} free on {device}; pass a smaller config"
        )


def _generation(run: _Runner, cfg: BenchConfig, macs: MacCounts, report: BenchReport, stage) -> None:
    prompt = run.ids(1, cfg.prompt_tokens)
    # One short warm-up generation in both modes; a generation is itself tens of forwards, so each
    # timed size needs no warm-up run of its own (the uncached 128-token one would cost a full run).
    for _ in range(cfg.warmup):
        run.generate_cached(prompt, 4)
        run.generate_uncached(prompt, 4)
    for t in cfg.gen_tokens:
        stage(f"generation: {t} tokens with and without the cache")
        with_cache = run.time(lambda: run.generate_cached(prompt, t), cfg.repeats, 0)
        tokens_cached = run.last_result
        without = run.time(lambda: run.generate_uncached(prompt, t), cfg.repeats, 0)
        # The two modes must produce the same greedy tokens (the cache is an optimisation, not a change).
        same = bool(torch.equal(tokens_cached, run.last_result))
        report.generation.append({
            "tokens": t,
            "with_cache": with_cache.to_dict(),
            "without_cache": without.to_dict(),
            "speedup": without.median / with_cache.median,
            "macs_with_cache": macs.generate_cached(cfg.prompt_tokens, t),
            "macs_without_cache": macs.generate_uncached(cfg.prompt_tokens, t),
            "same_tokens": same,
        })


def _prefill_decode(run: _Runner, cfg: BenchConfig, macs: MacCounts, report: BenchReport, stage) -> None:
    for n in cfg.prefill_tokens:
        stage(f"prefill: {n}-token prompt")
        ids = run.ids(1, n)
        tm = run.time(lambda: run.forward(ids), cfg.repeats, cfg.warmup)
        report.prefill.append({
            "tokens": n, "seconds": tm.to_dict(), "seconds_per_token": tm.median / n,
            "time_to_first_token": tm.median, "macs": macs.forward(0, n),
        })
    for n in cfg.decode_cache:
        stage(f"decode: one step against a {n}-token cache")
        nxt, cache = run.forward(run.ids(1, n))
        tm = run.time(lambda: run.forward(nxt, cache), cfg.repeats, cfg.warmup, after=lambda: _crop(cache, n))
        report.decode.append({
            "cache_tokens": n, "seconds": tm.to_dict(), "tokens_per_second": 1.0 / tm.median, "macs": macs.forward(n, 1),
        })


def _batching(run: _Runner, cfg: BenchConfig, report: BenchReport, stage) -> None:
    rows = []
    for b in cfg.batch_sizes:
        stage(f"batching: one decode step for {b} requests with {cfg.batch_cache}-token caches")
        nxt, cache = run.forward(run.ids(b, cfg.batch_cache))
        tm = run.time(lambda: run.forward(nxt, cache), cfg.repeats, cfg.warmup, after=lambda: _crop(cache, cfg.batch_cache))
        rows.append({"batch": b, "step_seconds": tm.to_dict(), "tokens_per_second": b / tm.median,
                     "latency_per_token": tm.median})
    report.batching = {"cache_tokens": cfg.batch_cache, "rows": rows, "knee": find_knee(rows, cfg.knee_gain),
                       "knee_rule": f"first B after which the next batch size gains < {cfg.knee_gain - 1:.0%} throughput"}


def find_knee(rows: Sequence[dict[str, Any]], gain: float) -> int | None:
    """The first batch size whose successor raises throughput by less than ``gain`` x; None if it keeps growing."""
    ordered = sorted(rows, key=lambda r: r["batch"])
    for a, b in zip(ordered, ordered[1:]):
        if b["tokens_per_second"] < gain * a["tokens_per_second"]:
            return int(a["batch"])
    return None
