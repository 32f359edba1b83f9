"""``qkit report`` as a library call: read the JSON files, run the missing steps asked for, draw, write.

``build_report(files, model=..., run=...)`` returns a ``Report`` (the HTML and its figures); ``write_report``
puts it in place atomically (a hidden sibling renamed over the output: no half-written page) and, with
``png_dir``, writes every figure as ``DIR/NAME.png`` the same way (a staged directory moved into place).

The steps a report can run itself when no file of that kind is given (``STEPS``), on MODEL (default: the
default model), each with a status line:

- ``kv``, ``budget``: formulas on the model's config, a second or two (run by default);
- ``outliers``: one forward pass over the 78-token outlier prompt (run by default);
- ``errors`` (every block projection under the six default schemes), ``sensitivity`` (one layer at a time at
  ``SENSITIVITY_SCHEME`` on 256 tokens) and ``eval`` (qkit eval's defaults: six schemes, 2,048 tokens) take
  minutes to tens of minutes on a CPU, so they run only when asked (``run=("errors", ...)``, ``--run``).

A step runs only on the model the files are of: with the default steps and files of another model, the
steps are skipped (the sections keep their note); asked for explicitly, the mismatch is refused first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkit import evaluation, staging
from qkit.errors import InputError
from qkit.inspect import errors as _errors
from qkit.inspect import outliers as _outliers
from qkit.inspect import sensitivity as _sensitivity
from qkit.lists import split_list
from qkit.models import checked
from qkit.report import figures as _figures
from qkit.report.inputs import Inputs, read_inputs, same_model
from qkit.report.page import render
from qkit.serving import budget as _budget
from qkit.serving import kv as _kv

STEPS = ("kv", "budget", "outliers", "errors", "sensitivity", "eval")
DEFAULT_STEPS = ("kv", "budget", "outliers")  # the cheap ones: formulas and one short forward pass
SENSITIVITY_SCHEME = "int4-g128"
GENERATOR = "qkit report"  # the page's <meta name="generator">: how --force knows a file is a report qkit wrote


@dataclass
class Report:
    """A built report: ``html`` (the page), ``figures`` (for ``--png``), ``inputs`` (what it was built from),
    ``notes`` (what was skipped or run, in words)."""

    html: str
    figures: list[_figures.Figure]
    inputs: Inputs
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        for f in self.figures:
            f.close()


def parse_steps(text: str | None) -> tuple[tuple[str, ...], bool]:
    """``--run`` -> ``(steps, explicit)``: None is the default steps; ``none`` is no step; ``all`` every step."""
    if text is None:
        return DEFAULT_STEPS, False
    words = [w.lower() for w in split_list(text, "--run", what="step", where=f"{', '.join(STEPS)}, all or none")]
    if words == ["none"]:
        return (), True
    if words == ["all"]:
        return STEPS, True
    bad = [w for w in words if w not in STEPS]
    if bad or not words:
        raise InputError(f"--run {text!r}: steps are {', '.join(STEPS)} (comma-separated), all or none")
    return tuple(s for s in STEPS if s in words), True


def _run_step(step: str, model: str | None, ref, on_status: Callable[[str], None]) -> dict:
    """One step's JSON, as the command's ``--json`` would write it."""
    if step == "kv":
        on_status("kv: KV-cache bytes per token (qkit kv)")
        return _kv.kv_report(model=model).to_dict()
    if step == "budget":
        on_status("budget: memory per card (qkit budget)")
        return _budget.budget(models=[model if model is not None else _budget.DEFAULT_MODEL_WORD]).to_dict()
    if step == "outliers":
        on_status("outliers: loading the model and running the outlier prompt (qkit inspect outliers)")
        return _outliers.residual_outliers(ref).to_dict()
    if step == "errors":
        on_status("errors: every block projection under the six default schemes (qkit inspect errors)")
        return _errors.weight_errors(model, ref=ref).to_dict()
    if step == "sensitivity":
        on_status(f"sensitivity: one layer at a time at {SENSITIVITY_SCHEME} (qkit inspect sensitivity)")
        return _sensitivity.rank_sensitivity(ref, scheme=SENSITIVITY_SCHEME).to_dict()
    if step == "eval":
        on_status("eval: the quality table (qkit eval, its defaults)")
        return evaluation.evaluate(model, options=evaluation.EvalOptions(), on_status=on_status).to_dict()
    raise AssertionError(step)  # pragma: no cover - parse_steps admits only STEPS


def build_report(
    files: Sequence[str | os.PathLike] = (),
    *,
    model: str | None = None,
    run: str | None = None,
    on_status: Callable[[str], None] | None = None,
) -> Report:
    """Read ``files`` (``qkit.report.inputs``), run the missing steps of ``run`` (``parse_steps``) on ``model``,
    and draw the page. Every refusal (a bad file, another model, no matplotlib) comes before any step runs."""
    say = on_status or (lambda _m: None)
    steps, explicit = parse_steps(run)
    inputs = read_inputs(list(files))
    _figures.require_matplotlib()  # refused before any step runs
    notes: list[str] = []
    missing = [s for s in steps if s not in inputs.docs]
    ref = None
    if missing:
        # resolves MODEL (no weights loaded) to compare it with the files' model before a step runs
        ref = checked(model)
        given = inputs.model()
        if given is not None and not same_model(ref.spec, given):
            if explicit:
                raise InputError(f"--run {','.join(missing)} would run on {ref.spec!r}, but the files are of {given!r}; "
                                 "pass that model as --model, or --run none")
            notes.append(f"not run ({', '.join(missing)}): the files are of {given!r}, not {ref.spec!r}; pass --model")
            missing = []
    for step in missing:
        t0 = time.perf_counter()
        doc = _run_step(step, model, ref, say)
        inputs.docs[step], inputs.paths[step], inputs.seconds[step] = doc, None, time.perf_counter() - t0
        notes.append(f"ran {step} on {ref.spec} in {inputs.seconds[step]:.1f} s")
    say("drawing the report")
    html, figs = render(inputs)
    return Report(html, figs, inputs, notes)


def is_report_file(path: str | os.PathLike) -> bool:
    """A page ``qkit report`` wrote (``--force`` replaces only those): its head names the generator."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"<!DOCTYPE html>") and f'<meta name="generator" content="{GENERATOR}'.encode() in head


def is_png_directory(path: str | os.PathLike) -> bool:
    """A directory ``--png`` may write into again: empty, or holding only ``.png`` files."""
    try:
        return all(e.is_file() and e.name.endswith(".png") for e in os.scandir(path))
    except OSError:
        return False


def write_report(report: Report, out: str | os.PathLike, *, png_dir: str | os.PathLike | None = None,
                 on_stale: Callable[[list[Path]], None] | None = None) -> list[Path]:
    """Write the page to ``out`` atomically and, with ``png_dir``, every figure as ``png_dir/NAME.png``; return
    the PNG paths. The targets were checked before any work (``qkit.outputs.check_output_path``)."""
    pngs: list[Path] = []
    if png_dir is not None:
        target = Path(png_dir)
        with staging.staged(target, directory=True, what="--png", on_stale=on_stale) as tmp:
            for f in report.figures:
                f.png(tmp / f"{f.name}.png")
            staging.publish_directory(tmp, target)
        pngs = [target / f"{f.name}.png" for f in report.figures]
    staging.write_text(out, report.html, what="-o", on_stale=on_stale)
    return pngs


__all__ = ["DEFAULT_STEPS", "GENERATOR", "SENSITIVITY_SCHEME", "STEPS", "Report", "build_report", "is_png_directory",
           "is_report_file", "parse_steps", "write_report"]
