"""``qkit eval``'s options: every default once (``EvalOptions``), and the small values each step reads.

Layer 6 (``evaluation``), below the runner. ``EvalOptions.validate`` is every check that needs no model
(it returns the row specs it resolved); the runner then hands each step only the fields it reads:
``inputs`` (``checks.InputSettings``: corpus, tokens, window, the simulations' calibration, the engines'
context), ``answering`` (battery and agreement), ``rows`` (``specs.RowSettings``: how a row's file is
written and its simulations built) and ``engine_options`` (the engines' settings in the eval's dtype).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qkit.bounds import MAX_COUNT, whole
from qkit.errors import InputError
from qkit.executors import SERIAL, ExecutorOptions
from qkit.evaluation.engines import EngineOptions, check_runtimes, engines_named
from qkit.evaluation.file_rows import check_file_runtimes
from qkit.evaluation.inputs import InputSettings
from qkit.evaluation.perplexity import check_scored, min_tokens
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

    def validate(self) -> list[RowSpec]:
        """Every check that needs no model (counts, names, device), so a bad option fails in milliseconds:
        ``evaluate`` calls it before anything is resolved or loaded. The window's upper bound (the model's
        context) and the default window's token minimum are checked from the model's config, before loading.
        Returns the row specs ``schemes`` and ``methods`` name, resolved."""
        self.executor.validate()  # an unknown executor, Ray not installed, a --ray-address nothing answers at
        if self.executor.name != SERIAL and (self.device_map is not None or parse_device(self.device).type != "cpu"):
            raise InputError(f"--executor {self.executor.name} measures the torch rows in CPU worker processes; "
                             "pass --device cpu (and no --device-map), or drop --executor")
        rows = self.rows
        for flag, value, least in (("--agree-tokens", self.agree_tokens, 1),
                                   ("--window", self.window, 2), ("battery_tokens", self.battery_tokens, 1)):
            if value is not None and value < least:
                raise InputError(f"{flag} must be at least {least}, got {value}")
            if value is not None:
                whole(value, flag, least, MAX_COUNT)  # the upper bound, named
        check_scored(self.tokens, self.window)  # a perplexity without a standard error is never reported
        whole(self.tokens, "--tokens", min_tokens(self.window), MAX_COUNT)  # the upper bound, named
        check_runtimes(self.runtimes, self.dtype, self.engine)  # unknown names, an engine not installed, bad counts
        given = dict(self.method_options)
        if given.get("calibration") is not None:  # an empty value or entry named now, even with no calibrated row
            split_sources(joined_sources(given["calibration"]))
        specs = check_rows(self.schemes, self.methods, given, rows)  # names, simulations, plans, files
        check_file_runtimes(specs, engines_named(self.runtimes))  # a file row in a runtime that cannot load it
        check_keys(dict(self.simulation_options))  # a misspelt simulation option, even with no simulation row
        parse_scale_dtype(self.scale_dtype)
        parse_device(self.device)
        if self.device_map is not None:
            check_device_map(self.device_map)
        return specs

    # ------------------------------------------------------------------ what each step reads

    @property
    def inputs(self) -> InputSettings:
        return InputSettings(self.corpus, self.tokens, self.window, self.rows.simulations, self.engine,
                             self.battery_tokens, self.agree_tokens)

    @property
    def answering(self) -> AnswerSettings:
        return AnswerSettings(self.agree_tokens, self.battery_tokens, self.battery, self.repetition_penalty)

    @property
    def rows(self) -> RowSettings:
        calibration = tuple((k, v) for k, v in self.method_options if k in SIMULATION_CALIBRATION)
        return RowSettings(self.scale_dtype, self.plan_candidates, SimulationSettings(self.simulation_options, calibration))

    @property
    def engine_options(self) -> EngineOptions:
        """The engines' settings; an engine computes in the eval's dtype, as the torch runtime does (vLLM;
        a GGUF's types are its own)."""
        return dataclasses.replace(self.engine, dtype=self.dtype)

    def simulation_options_for(self, spec: RowSpec) -> dict[str, Any]:
        """The options ``spec``'s simulations are built with: the row's own, else eval's; ``--calibration``,
        ``--calibration-samples`` and ``--calibration-seqlen`` choose a static activation row's calibration
        too (the same text a calibrated method's row uses)."""
        return self.rows.simulations.for_row(spec)


__all__ = ["AnswerSettings", "EvalOptions", "SIMULATION_CALIBRATION"]
