"""What one row of the quality table is: a value, not a branch in the runner.

Layer 6 (``evaluation``), above ``methods`` and ``schemes`` (whose names it resolves) and ``simulate``
(whose simulations a row names). The named rows and presets live in ``qkit.evaluation.rows``, which
registers them into ``ROWS`` and ``PRESETS`` here (``qkit.evaluation`` imports it).

A row names its storage ``scheme`` (or ``None``: the reference's full-precision weights), the
``method`` that chose the integers (``rtn``, ``gptq``, ``awq``, ``smoothquant``; see ``qkit.methods``)
and the run-time simulations applied while the model runs (``simulation``: activation quantization,
LLM.int8, a quantized KV cache; see ``qkit.simulate``). Where a row *runs* (torch, vLLM, llama.cpp) is
its runtime, an engine (``qkit.evaluation.engines``), not part of the spec: the same spec is measured in
every engine ``--runtime`` names. ``qkit.evaluation.row_files.write_row`` writes a spec's file through the
same ``quantize_model`` that writes checkpoints; the engine loads it (torch: into the reference model, with
the simulation hooks installed); the runner only loops over specs and engines and measures.

Names on the command line (``qkit eval --schemes ...``) are resolved here:

* a named row (``register_row``, ``ROWS``), e.g. ``w8a8-token`` = int8-row weights + int8 per-token activations;
* a preset (``register_preset``, ``PRESETS``), e.g. ``shipped``: several names at once;
* ``SCHEME+METHOD`` (``int4-g64+gptq``): that scheme with that method;
* ``plan:FORMAT@TARGET`` or ``plan:PLAN.json``: a planned mix;
* ``file:PATH.gguf``: an existing GGUF file of the same model (a peer's, llama-quantize's), scored as it is
  (``RowSpec.file``; named after the file's stem, ``file_labels``);
* otherwise a scheme name (``nf4``, ``int4-g64``, ``q4_k_m``, ...), one row per ``--methods`` entry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkit import reading
from qkit.errors import InputError
from qkit.export.gguf.reader import read_header
from qkit.lists import empty
from qkit.methods import RTN, get_method, make_options
from qkit.methods.calibration import CalibrationOptions
from qkit.plan import PlanOptions, check_format, ladder, parse_allowed, read_plan
from qkit.registry import Registry, unknown_name
from qkit.schemes import get_scheme, scheme_names
from qkit.simulate import get_simulation


@dataclass(frozen=True)
class RowSpec:
    """One row: weights stored in ``scheme`` (None: unquantized), chosen by ``method``, run with ``simulation``.

    ``simulation``: names registered in ``qkit.simulate`` (applied in order). ``simulation_options`` and
    ``method_options``: per-row overrides as sorted ``(key, value)`` pairs (hashable, JSON-able).
    ``label``: the row's name in the table (default: derived, e.g. ``int4-g64`` / ``int4-g64+gptq``).
    ``file``: an existing GGUF file (absolute path) whose weights the row is, instead of a scheme or a plan.
    """

    scheme: str | None
    method: str = RTN
    simulation: tuple[str, ...] = ()
    label: str | None = None
    method_options: tuple[tuple[str, Any], ...] = ()
    simulation_options: tuple[tuple[str, Any], ...] = ()
    plan: str | None = None  # a planned mix instead of one scheme: "FORMAT@TARGET" (PLAN_PREFIX) or a plan file
    file: str | None = None  # a given GGUF file instead of one written (FILE_PREFIX)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.file:
            return Path(self.file).stem
        base = f"{PLAN_PREFIX}{self.plan}" if self.plan else (self.scheme or "fp")
        if self.method != RTN:
            base += f"+{self.method}"
        return "+".join([base, *self.simulation]) if self.simulation else base

    @property
    def quantized(self) -> bool:
        """Whether the row stores weights of its own (a scheme, a plan or a file); else the reference's are used."""
        return self.scheme is not None or self.plan is not None or self.file is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scheme": self.scheme,
            "method": self.method,
            "simulation": list(self.simulation),
            "method_options": dict(self.method_options),
            "simulation_options": dict(self.simulation_options),
            "plan": self.plan,
            "file": self.file,
        }


@dataclass(frozen=True)
class SimulationSettings:
    """What a row's simulations are built with, from eval's options: ``options`` (``--threshold``,
    ``--kv-residual``, ``--kv-group``), which a row's own ``simulation_options`` replace, and ``calibration``
    (``--calibration``, ``--calibration-samples``, ``--calibration-seqlen``), which choose a static
    activation row's calibration too: the same text a calibrated method's row uses."""

    options: tuple[tuple[str, Any], ...] = ()
    calibration: tuple[tuple[str, Any], ...] = ()

    def for_row(self, spec: RowSpec) -> dict[str, Any]:
        return {**dict(self.calibration), **dict(spec.simulation_options or self.options)}


@dataclass(frozen=True)
class RowSettings:
    """What writing a row's weights and running its simulations read of eval's options: the scales' dtype,
    the types plan rows may choose (``--candidates``, one lower-cased type a word as ``EvalOptions.rows``
    parses them; empty: the format's whole ladder), and what the simulations are built with."""

    scale_dtype: str
    plan_candidates: tuple[str, ...] = ()
    simulations: SimulationSettings = SimulationSettings()


PLAN_PREFIX = "plan:"
FILE_PREFIX = "file:"


def parse_plan_word(word: str) -> tuple[str, float | None, str | None]:
    """``FORMAT@TARGET`` -> ``(format, bits or None, scheme or None)``: TARGET is bits per weight
    (``gguf@4.5``) or a scheme whose bytes the mix gets (``gguf@q4_k_m``: like with like)."""
    fmt, sep, target = word.partition("@")
    if not sep or not fmt or not target:
        raise InputError(f"{PLAN_PREFIX}{word}: write {PLAN_PREFIX}FORMAT@BITS or {PLAN_PREFIX}FORMAT@SCHEME, "
                         "e.g. plan:gguf@4.5 or plan:gguf@q4_k_m (a plan file: plan:PATH.json)")
    fmt = check_format(fmt)
    try:
        bits = float(target)
    except ValueError:
        return fmt, None, get_scheme(target).name
    if not (bits > 0 and bits < 64):
        raise InputError(f"{PLAN_PREFIX}{word}: {target} is not a number of bits per weight above 0 and below 64")
    return fmt, bits, None


def _key(name: str) -> str:
    # Row and preset names are matched stripped and lower-cased, exactly (a "_" is not a "-" here: a word
    # that is not a row falls through to the scheme names, which read "q4_k_m" their own way).
    return name.strip().lower()


# The named rows and presets (registered by ``qkit.evaluation.rows``). A value's description is what
# ``describe`` returns; a name is a row or a preset, never both.
ROWS: Registry[RowSpec] = Registry("row", error=InputError, normalize=_key)
PRESETS: Registry[tuple[str, ...]] = Registry("preset", error=InputError, normalize=_key)
_DESCRIPTIONS: dict[str, str] = {}


def _check_free(kind: str, name: str) -> None:
    if name in ROWS or name in PRESETS:
        raise InputError(f"{kind} name {name!r} is already registered")


def register_row(name: str, spec: RowSpec, description: str = "") -> RowSpec:
    """A named row for ``--schemes`` (its label is ``name``)."""
    _check_free("row", name)
    spec = RowSpec(spec.scheme, spec.method, spec.simulation, name, spec.method_options, spec.simulation_options, spec.plan)
    ROWS.register(name, spec)
    _DESCRIPTIONS[name] = description
    return spec


def register_preset(name: str, names: Iterable[str], description: str = "") -> None:
    """A word for ``--schemes`` that stands for several row or scheme names (validated when used)."""
    _check_free("preset", name)
    PRESETS.register(name, tuple(names))
    _DESCRIPTIONS[name] = description


def row_names() -> list[str]:
    return ROWS.names()


def preset_names() -> list[str]:
    return PRESETS.names()


def describe(name: str) -> str:
    return _DESCRIPTIONS.get(name, "")


def resolve_rows(
    names: Iterable[str],
    methods: Iterable[str] = (RTN,),
    method_options: Mapping[str, Any] | None = None,
) -> list[RowSpec]:
    """Names from ``--schemes`` and ``--methods`` (their words, as ``EvalOptions.resolve`` parses them: none
    blank) -> row specs, in order, duplicates dropped.

    A scheme name gives one row per method; a named row or a preset gives its own rows (their method is
    their own). Unknown names, unknown methods and a method that cannot serve a scheme are refused here,
    before any model is loaded.
    """
    names = list(names)
    methods = [m.strip().lower() for m in methods]
    # No names is the reference row alone (``EvalOptions(schemes=())``); the command line refuses an empty
    # --schemes where it parses the string. Names with no method to run them by are a mistake.
    if names and not methods:
        raise empty("--methods", "method", "qkit eval --help lists them")
    chosen = {m: get_method(m) for m in methods}  # validates the method names
    opts = tuple(sorted((method_options or {}).items()))
    specs: list[RowSpec] = []

    def add(name: str, depth: int = 0) -> None:
        key = _key(name)
        if key in PRESETS and depth < 4:
            for n in PRESETS.get(key):
                add(n, depth + 1)
            return
        if key in ROWS:
            specs.append(ROWS.get(key))
            return
        if key.startswith(FILE_PREFIX):  # a given GGUF file, scored as it is: file:PATH (the path keeps its case)
            specs.append(RowSpec(None, file=file_path(name)))
            return
        if key.startswith(PLAN_PREFIX):  # a planned mix: plan:FORMAT@TARGET[+METHOD] or plan:FILE.json[+METHOD]
            # the target as given: a plan file's path keeps its case (the key is lower-cased)
            word, _, method_word = name.strip()[len(PLAN_PREFIX):].partition("+")
            method_word = method_word.lower()
            if not word.lower().endswith(".json"):
                word = word.lower()
                parse_plan_word(word)
            method_word = method_word or RTN
            get_method(method_word)
            specs.append(RowSpec(None, method_word, plan=word.strip()))
            return
        if "+" in key:  # SCHEME+METHOD: one row with that method, whatever --methods says
            scheme_word, _, method_word = key.partition("+")
            method = get_method(method_word)
            scheme = get_scheme(scheme_word)
            if method is not None:
                method.check(scheme)
            specs.append(RowSpec(scheme.name, method_word, method_options=opts if method is not None else ()))
            return
        try:
            scheme = get_scheme(key)
        except InputError:
            # One refusal over three registries (schemes, rows, presets), in the registries' one wording.
            listed = [*scheme_names(), "int4-gN / int8-gN", f"rows {', '.join(ROWS) or '-'}",
                      f"presets {', '.join(PRESETS) or '-'}"]
            guesses = {n: n for n in [*scheme_names(), *ROWS, *PRESETS]}
            raise InputError(unknown_name("scheme", name, listed, guesses=guesses, normalize=str.lower)) from None
        for m, method in chosen.items():
            if method is not None:
                method.check(scheme)
            specs.append(RowSpec(scheme.name, m, method_options=opts if method is not None else ()))

    for n in names:
        add(n)
    specs = name_files(specs)
    unique: dict[str, RowSpec] = {}
    for s in specs:
        unique.setdefault(s.name, s)
    return list(unique.values())


def file_path(word: str) -> str:
    """``file:PATH`` -> PATH, absolute (``~`` expanded); an empty PATH is refused."""
    path = word.strip()[len(FILE_PREFIX):].strip()
    if not path:
        raise InputError(f"{FILE_PREFIX} names no file; write {FILE_PREFIX}PATH.gguf (an existing GGUF file of the same model)")
    return os.path.abspath(os.path.expanduser(path))


def file_paths(names: Iterable[str]) -> list[str]:
    """The files ``--schemes`` words name as rows (``file:PATH``), as given: what the command reads, which
    no output of it may be."""
    return [w.strip()[len(FILE_PREFIX):].strip() for w in names if _key(w).startswith(FILE_PREFIX)]


def plan_paths(names: Iterable[str]) -> list[str]:
    """The plan files ``--schemes`` words name as rows (``plan:PATH.json[+METHOD]``), as given: what the command
    reads, which no output of it may be."""
    words = [w.strip()[len(PLAN_PREFIX):].partition("+")[0].strip() for w in names if _key(w).startswith(PLAN_PREFIX)]
    return [w for w in words if w.lower().endswith(".json")]


def check_file(path: str) -> None:
    """A file row's file: it exists, is a file, and its header is GGUF's (``read_header``: milliseconds)."""
    word, p = f"{FILE_PREFIX}{path}", Path(path)
    if not os.path.lexists(p):
        raise InputError(f"{word}: no such file; pass an existing GGUF file of the reference model")
    if p.is_dir():
        raise InputError(f"{word} is not a file; pass the .gguf file inside the directory")
    try:  # a FIFO, a device or a link loop: refused before it is opened (qkit.reading)
        reading.check_file(p, word, "pass an existing GGUF file of the reference model")
    except FileNotFoundError:  # a dangling link
        raise InputError(f"{word}: no such file; pass an existing GGUF file of the reference model") from None
    try:
        read_header(p, word)
    except OSError as exc:
        raise InputError(f"cannot read {word} ({exc.strerror or exc})") from None


def file_labels(paths: list[str], taken: set[str]) -> list[str]:
    """Each file row's name: its file's stem (``q4_k_m`` for ``/peers/q4_k_m.gguf``), with as many parent
    directories as it takes (``iters0/model``) to differ from ``taken`` (the other rows' names) and from
    each other; the whole path where nothing shorter does."""
    parts = [(*Path(p).parent.parts, Path(p).stem) for p in paths]
    depth = [1] * len(paths)
    while True:
        labels = ["/".join(ps[-d:]) for ps, d in zip(parts, depth)]
        clash = [i for i, label in enumerate(labels) if label in taken or labels.count(label) > 1]
        grow = [i for i in clash if depth[i] < len(parts[i])]
        if not grow:
            return [paths[i] if i in clash else label for i, label in enumerate(labels)]
        for i in grow:
            depth[i] += 1


def name_files(specs: list[RowSpec]) -> list[RowSpec]:
    """The file rows checked (``check_file``; the same file twice, by any path, is refused) and named
    (``file_labels``: unique within the table, the reference row's name included)."""
    files = [s for s in specs if s.file is not None]
    if not files:
        return specs
    seen: dict[tuple[int, int], str] = {}
    for s in files:
        check_file(s.file)
        st = os.stat(s.file)
        first = seen.get((st.st_dev, st.st_ino))
        seen[(st.st_dev, st.st_ino)] = s.file
        if first is not None:
            same = "" if first == s.file else f" (also as {FILE_PREFIX}{first})"
            raise InputError(f"{FILE_PREFIX}{s.file} is given twice{same}: name each file once")
    taken = {s.name for s in specs if s.file is None} | {"reference"}  # measuring.REFERENCE: the reference row's name
    named = iter([dataclasses.replace(s, label=label) for s, label in zip(files, file_labels([s.file for s in files], taken))])
    return [next(named) if s.file is not None else s for s in specs]


def row_plan(spec: RowSpec, options: RowSettings):
    """A plan row's plan: its file, or ``PlanOptions`` for ``FORMAT@TARGET`` with eval's ``--candidates``
    (measured once for every row of the same format and method: ``qkit.plan.planner``)."""
    if spec.plan.endswith(".json"):
        return spec.plan
    fmt, bits, scheme = parse_plan_word(spec.plan)
    return PlanOptions(format=fmt, target_bits=bits, target_scheme=scheme,
                       candidates=for_format(fmt, options.plan_candidates), scale_dtype=options.scale_dtype)


def check_rows(names: Iterable[str], methods: Iterable[str], method_options: Mapping[str, Any],
               settings: RowSettings) -> tuple[list[RowSpec], tuple[CalibrationOptions, ...]]:
    """The rows ``--schemes`` and ``--methods`` name (``resolve_rows``), each checked before any model: its plan
    (``check_plan_rows``), a calibrated method's options (``make_options``), its simulations built with their
    options (an unknown one, ``--threshold 0``, ``--kv-residual -1``). Returns them, and the calibration tokens
    they read, each distinct one once in order of first use (a ``CalibrationOptions`` is checked when made:
    malformed numbers, an empty source): a calibrated method's, and a simulation's that calibrates
    (``act-int8-static``'s scales)."""
    specs = resolve_rows(names, methods, method_options)
    check_plan_rows(specs, settings)
    chosen: dict[CalibrationOptions, None] = {}
    for spec in specs:
        method = get_method(spec.method)
        if method is not None and method.calibrated:
            chosen.setdefault(make_options(method, dict(spec.method_options)).calibration_options())
        for name in spec.simulation:
            wants = get_simulation(name, settings.simulations.for_row(spec)).calibration_options()
            if wants is not None:
                chosen.setdefault(wants)
    return specs, tuple(chosen)


def check_plan_rows(specs: list[RowSpec], writing: RowSettings) -> None:
    """Refuse, before the reference loads, a plan row that cannot be planned: a missing or malformed plan
    file, a target scheme that is no scheme, ``--candidates`` that name no type a plan row's format offers
    (or a table with no plan row to choose for)."""
    for spec in specs:
        if spec.plan is not None and spec.plan.endswith(".json"):
            read_plan(spec.plan)  # a missing or malformed plan file
        elif spec.plan is not None:
            planned = row_plan(spec, writing)
            planned.check()  # a target scheme that is no scheme
            if writing.plan_candidates and not planned.candidates:
                raise InputError(f"--candidates names no type that {spec.name}'s format {planned.format} offers "
                                 f"({', '.join(ladder(planned.format))})")
    if not writing.plan_candidates:
        return
    formats = {parse_plan_word(s.plan)[0] for s in specs if s.plan is not None and not s.plan.endswith(".json")}
    if not formats:
        raise InputError("--candidates chooses the types of plan rows (plan:FORMAT@TARGET); the table has none")
    offered = {w for f in formats for w in ladder(f)}
    unknown = [w for w in writing.plan_candidates if w not in offered]
    if unknown:  # a typo, or a type no planned format offers
        parse_allowed(sorted(formats)[0], unknown)
        raise InputError(f"--candidates {unknown[0]}: not a type the plan rows' formats ({', '.join(sorted(formats))}) offer")


def for_format(fmt: str, words: tuple[str, ...]) -> tuple[str, ...]:
    """The ``--candidates`` words that format ``fmt`` offers (a table may plan for several formats); every
    word must belong to some plan row's format (``check_plan_rows``)."""
    offered = set(ladder(fmt))
    return tuple(w for w in words if w in offered)


__all__ = ["FILE_PREFIX", "PLAN_PREFIX", "check_file", "file_labels", "file_path", "file_paths", "plan_paths", "name_files", "PRESETS", "ROWS", "RowSpec", "RowSettings", "SimulationSettings", "check_plan_rows", "check_rows", "for_format", "parse_plan_word", "row_plan", "describe", "preset_names", "register_preset", "register_row", "resolve_rows", "row_names"]
