"""``qkit eval``'s options: every default once (``EvalOptions``), resolved into the small values each step reads.

Layer 6 (``evaluation``), below the runner. ``EvalOptions.resolve`` is every check that needs no model, the
words of its list options parsed once (``qkit.lists``: ``--schemes``, ``--methods``, ``--candidates``), and
returns an ``EvalRun``: the row specs, the engines, and each step's settings apart, so no step is handed the
whole options value: ``inputs`` (``inputs.InputSettings``: corpus, tokens, window, the rows' calibrations,
the engines' context), ``answering`` (battery and agreement), ``rows`` (``specs.RowSettings``: how a row's
file is written and its simulations built), ``engine`` (the engines' settings in the eval's dtype),
``loading`` (the reference model), ``executor`` and ``models`` (MODEL's ``--reference``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.executors import SERIAL, ExecutorOptions
from qkit.lists import check_words, split_values
from qkit.evaluation.engines import Engine, EngineOptions, check_runtimes, engines_named
from qkit.evaluation.file_rows import check_file_runtimes
from qkit.evaluation.inputs import InputSettings
from qkit.evaluation.windows import check_scored
from qkit.evaluation.specs import RowSettings, RowSpec, SimulationSettings, check_rows
from qkit.methods import RTN
from qkit.models import check_device_map, parse_device
from qkit.schemes import DEFAULT_SCHEMES
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, parse_scale_dtype
from qkit.simulate.options import check_keys
from qkit.texts import joined_sources, split_sources

# The method options that choose a static activation row's calibration too (simulate.activations.StaticOptions).
SIMULATION_CALIBRATION = ("calibration", "calibration_samples", "calibration_seqlen")


@dataclass(frozen=True)
class AnswerSettings:
    """The battery and agreement: tokens per answer and per continuation, whether the battery is answered,
    and whether the model's repetition penalty is used."""

    agree_tokens: int
    battery_tokens: int
    battery: bool
    repetition_penalty: bool


@dataclass(frozen=True)
class EvalOptions:
    """Every default of ``qkit eval``, defined once."""

    schemes: tuple[str, ...] = DEFAULT_SCHEMES  # scheme names, named rows (w8a8-token, ...) or presets
    methods: tuple[str, ...] = (RTN,)  # one row per method for each scheme name
    method_options: tuple[tuple[str, Any], ...] = ()  # e.g. (("calibration_samples", 32),) for gptq/awq
    simulation_options: tuple[tuple[str, Any], ...] = ()  # e.g. (("threshold", 6.0),) for llm-int8
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
    # Where rows are measured, the engines of ``qkit.evaluation.engines``: "torch" (qkit's own forward pass,
    # with the simulation hooks), or an engine that loads the row's written file: "vllm", "llama.cpp".
    runtimes: tuple[str, ...] = ("torch",)
    dtype: str = "fp32"  # the torch runtime's model dtype (bf16, fp16, fp32); the reference is scored in it too
    engine: EngineOptions = EngineOptions()  # vLLM's parallelism and the engines' own settings
    # Where the torch rows run (qkit.executors): here one after another, or each a Ray task (--executor ray)
    executor: ExecutorOptions = ExecutorOptions()

    def resolve(self) -> EvalRun:
        """Every check that needs no model (counts, names, device), so a bad option fails in milliseconds:
        ``evaluate`` calls it before anything is resolved or loaded. The window's upper bound (the model's
        context) and the default window's token minimum are checked from the model's config, before loading.
        Returns what each step reads, resolved: the row specs ``schemes`` and ``methods`` name, the engines
        ``runtimes`` names, the calibrations the rows read, and the settings of each step."""
        self.executor.validate()  # an unknown executor, Ray not installed, a --ray-address nothing answers at
        if self.executor.name != SERIAL and (self.device_map is not None or parse_device(self.device).type != "cpu"):
            raise InputError(f"--executor {self.executor.name} measures the torch rows in CPU worker processes; "
                             "pass --device cpu (and no --device-map), or drop --executor")
        # every list option's words parsed once (qkit.lists: a blank word or an empty entry refused, naming it)
        schemes = check_words(self.schemes, "--schemes", what="scheme", where="qkit eval --help lists them")
        methods = check_words(self.methods, "--methods", what="method")
        rows = self.rows
        check_scored(self.tokens, self.window)  # a perplexity without a standard error is never reported
        for flag, value in (("--agree-tokens", self.agree_tokens), ("battery_tokens", self.battery_tokens)):
            if value < 1:
                raise InputError(f"{flag} must be at least 1, got {value}")
            whole(value, flag, 1, MAX_COUNT)  # the upper bound, named
        check_runtimes(self.runtimes, self.dtype, self.engine)  # unknown names, an engine not installed, bad counts
        given = dict(self.method_options)
        if given.get("calibration") is not None:  # an empty value or entry named now, even with no calibrated row
            split_sources(joined_sources(given["calibration"]))
        specs, calibrations = check_rows(schemes, methods, given, rows)  # names, plans, simulations, files
        engines = engines_named(self.runtimes)
        check_file_runtimes(specs, engines)  # a file row in a runtime that cannot load it
        check_keys(dict(self.simulation_options))  # a misspelt simulation option, even with no simulation row
        parse_scale_dtype(self.scale_dtype)
        parse_device(self.device)
        if self.device_map is not None:
            check_device_map(self.device_map)
        inputs = InputSettings(self.corpus, self.tokens, self.window, calibrations, self.engine, self.battery_tokens,
                               self.agree_tokens)
        answering = AnswerSettings(self.agree_tokens, self.battery_tokens, self.battery, self.repetition_penalty)
        # the engines compute in the eval's dtype, as the torch runtime does (vLLM; a GGUF's types are its own)
        engine = dataclasses.replace(self.engine, dtype=self.dtype)
        return EvalRun(specs, engines, inputs, answering, rows, engine, Loading(self.device, self.device_map, self.dtype),
                       self.executor, Pairing(self.reference, self.trust_remote_code), self.seed, self.scale_dtype)

    @property
    def rows(self) -> RowSettings:
        """How a row's file is written and its simulations built: ``--candidates`` parsed (each word may hold
        several, at commas and spaces; lower-cased), the calibration options a static activation row reads."""
        candidates = split_values(self.plan_candidates, "--candidates", what="type", where="e.g. q4_k,q6_k", spaces=True)
        calibration = tuple((k, v) for k, v in self.method_options if k in SIMULATION_CALIBRATION)
        return RowSettings(self.scale_dtype, tuple(w.lower() for w in candidates),
                           SimulationSettings(self.simulation_options, calibration))


@dataclass(frozen=True)
class Loading:
    """How the reference model is loaded: ``device`` (None: the default), ``device_map`` (spread over several
    devices), ``dtype`` (``engines.DTYPES``' name: the torch runtime's)."""

    device: str | None
    device_map: str | None
    dtype: str


@dataclass(frozen=True)
class Pairing:
    """What MODEL is paired with: ``reference`` (``--reference``, for a saved qkit checkpoint) and whether a
    model's own code may run (``trust_remote_code``)."""

    reference: str | None
    trust_remote_code: bool


@dataclass(frozen=True)
class EvalRun:
    """``EvalOptions`` resolved (``EvalOptions.resolve``), each step's part apart: ``specs`` (the rows),
    ``engines`` (torch first), ``inputs`` (what reading the inputs reads, the rows' calibrations too),
    ``answering`` (battery and agreement), ``rows`` (how a row's file is written and its simulations built),
    ``engine`` (the engines' settings in the eval's dtype), ``loading`` (the reference model), ``executor``
    (where the torch rows run), ``models`` (MODEL's reference), ``seed`` and ``scale_dtype`` (recorded)."""

    specs: list[RowSpec]
    engines: list[Engine]
    inputs: InputSettings
    answering: AnswerSettings
    rows: RowSettings
    engine: EngineOptions
    loading: Loading
    executor: ExecutorOptions
    models: Pairing
    seed: int
    scale_dtype: str


__all__ = ["AnswerSettings", "EvalOptions", "EvalRun", "Loading", "Pairing", "SIMULATION_CALIBRATION"]
