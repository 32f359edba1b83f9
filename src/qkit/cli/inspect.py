"""``qkit inspect``: errors, matrix, outliers, sensitivity, next-token. Tables: ``qkit.cli.inspect_render``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from qkit import console
from qkit.bounds import MAX_COUNT, whole
from qkit.cli import inspect_render as render
from qkit.cli.common import (
    CalibrationOpt,
    CalibrationSamplesOpt,
    CalibrationSeqlenOpt,
    DeviceMapOpt,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    ModelArg,
    ScaleDtypeOpt,
    ThreadsOpt,
    calibration_options,
    handles_errors,
    reads,
    repeated_list,
    start,
)
from qkit.inspect import errors as _ierrors  # defaults come from the library, defined once
from qkit.inspect import method_errors as _imethod
from qkit.inspect import nexttoken as _inext
from qkit.inspect import outliers as _iout
from qkit.inspect import sensitivity as _isens
from qkit.errors import InputError
from qkit.methods import get_method
from qkit.models import checked
from qkit.schemes import DEFAULT_SCHEMES
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE

inspect_app = typer.Typer(
    help="Why a scheme hurts: weight errors, outlier matrices and activations, sensitivity, next-token soft labels.",
    no_args_is_help=True,
)

SchemesOpt = Annotated[list[str], typer.Option("--scheme", "-s", help="Scheme(s) to measure, repeatable or comma-separated (default: all six).", metavar="LIST")]


def _split_schemes(values: list[str]) -> tuple[str, ...]:
    return repeated_list(values, "--scheme", what="scheme", where="qkit quantize --help lists them") or DEFAULT_SCHEMES


@inspect_app.command("errors")
@handles_errors
def inspect_errors_(
    model: ModelArg = None,
    scheme: SchemesOpt = [],
    per_matrix: Annotated[bool, typer.Option("--per-matrix", help="Also print every matrix's relative error under each scheme.")] = False,
    method: Annotated[Optional[str], typer.Option("--method", help="Also the output-side error ||WX-ŴX||²/||WX||² per matrix of a calibrated method (gptq) next to RTN's, on its calibration inputs (quantizes the model with it, per scheme).", show_default=False)] = None,
    calibration: CalibrationOpt = None,
    calibration_samples: CalibrationSamplesOpt = None,
    calibration_seqlen: CalibrationSeqlenOpt = None,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Relative error ||W - W_hat||_F / ||W||_F of every projection matrix under each scheme."""
    run = start(json_path, force, threads, reads(model, ("the calibration text", calibration)))
    schemes = _split_schemes(scheme)
    _ierrors.check_schemes(schemes, scale_dtype)
    chooser = get_method(method) if method else None
    if method and chooser is None:
        raise InputError("--method rtn has no calibration inputs to measure an output error on; use --method gptq")
    for s in _ierrors.check_schemes(schemes, scale_dtype) if chooser else ():
        chooser.check(s)
    method_options = calibration_options(calibration, calibration_samples, calibration_seqlen) or None
    if chooser is not None:  # calibration windows the model cannot take: refused before the RTN table
        _imethod.check_method_options(model, method=method, method_options=method_options)
    run.use_threads()
    with console.progress() as bar:
        r = _ierrors.weight_errors(
            model, schemes=schemes, scale_dtype=scale_dtype,
            on_start=lambda n: bar.start("measuring", n), on_matrix=bar.callback(),
        )
    render.errors(r, per_matrix)
    by_method = []
    for s in schemes if chooser else ():
        with console.progress() as bar:
            m = _imethod.method_output_errors(
                model, scheme=s, method=method, scale_dtype=scale_dtype,
                method_options=method_options,
                on_block=lambda done, total: (bar.start(f"{method} ({s}), block by block", total) if done == 1 else None, bar.advance()),
            )
        render.method_errors(m)
        by_method.append(m.to_dict())
    run.write_json(lambda: {**r.to_dict(), **({"output_errors": by_method} if by_method else {})})


@inspect_app.command("matrix")
@handles_errors
def inspect_matrix_(
    args: Annotated[Optional[list[str]], typer.Argument(help="[MODEL] [NAME]: a tensor name as in the checkpoint, e.g. model.layers.12.mlp.down_proj.weight; without NAME, the top matrices by max/std.", show_default=False, metavar="[MODEL] [NAME]")] = None,
    scheme: SchemesOpt = [],
    top: Annotated[int, typer.Option("--top", help="Without NAME: how many matrices to list.")] = _ierrors.TOP_MATRICES,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """One matrix: statistics, outliers beyond 6 sigma, error per scheme, int4 levels used. Without NAME: the top 10 by max/std."""
    model, name = _ierrors.split_model_and_name(args or [])
    run = start(json_path, force, threads, reads(model))
    schemes = _split_schemes(scheme)
    _ierrors.check_schemes(schemes, scale_dtype)
    _ierrors.check_top(top)  # given with NAME too: every number given is checked
    run.use_threads()
    if name is None:
        stats = _ierrors.top_matrices(model, top=top)
        render.top_matrices(stats)
        run.write_json(lambda: {"matrices": [s.to_dict() for s in stats]})
        return
    r = _ierrors.inspect_matrix(model, name=name, schemes=schemes, scale_dtype=scale_dtype)
    render.matrix(r)
    run.write_json(r.to_dict)


@inspect_app.command("outliers")
@handles_errors
def inspect_outliers_(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Text to run (default: the fixed paragraph in corpora/outliers_prompt.txt).")] = None,
    corpus_tokens: Annotated[Optional[int], typer.Option("--corpus-tokens", help="Run the first N tokens of the pinned corpus instead.", metavar="N")] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", help="Layer of the histogram and the INT8 analysis [default: the middle one].")] = None,
    exclude_top: Annotated[int, typer.Option("--exclude-top", help="Outlier dimensions to leave out of the second INT8 scale.")] = _iout.EXCLUDE_TOP,
    threshold: Annotated[float, typer.Option("--threshold", help="A dimension is an outlier where its max |h| is this many times the median dimension's.")] = _iout.OUTLIER_THRESHOLD,
    top: Annotated[int, typer.Option("--top", help="Largest dimensions to list per layer.")] = _iout.TOP_DIMS,
    device: DeviceOpt = None,
    device_map: DeviceMapOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Residual-stream outliers: largest dimensions per layer, their persistence, a histogram, and tensor-wide INT8."""
    run = start(json_path, force, threads, reads(model))
    _iout.check_options(prompt=prompt, corpus_tokens=corpus_tokens, exclude_top=exclude_top, threshold=threshold,
                        top=top, device=device, device_map=device_map, layer=layer)
    run.use_threads()
    ref = checked(model)  # a bad MODEL is refused in one line, before the status line
    if corpus_tokens is not None:  # so is more than the model's context
        _iout.check_context(corpus_tokens, _iout.resolve_with_context(ref)[1], "--corpus-tokens", ref.spec)
    console.status("loading the model and running the prompt")
    r = _iout.residual_outliers(ref, prompt=prompt, corpus_tokens=corpus_tokens, layer=layer, exclude_top=exclude_top,
                                threshold=threshold, top=top, device=device, device_map=device_map)
    render.outliers(r)
    run.write_json(r.to_dict)


@inspect_app.command("sensitivity")
@handles_errors
def inspect_sensitivity_(
    model: ModelArg = None,
    scheme: Annotated[Optional[str], typer.Option("--scheme", "-s", help="The scheme to apply to one layer (or matrix) at a time.")] = None,
    by: Annotated[str, typer.Option("--by", help="layer or matrix.")] = "layer",
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens of the pinned corpus to measure KL on.")] = _isens.DEFAULT_TOKENS,
    text: Annotated[Optional[str], typer.Option("--text", help="Measure on this text instead of the pinned corpus.")] = None,
    keep: Annotated[str, typer.Option("--keep-scheme", help="The scheme the suggestion keeps the most sensitive units at.")] = _isens.KEEP_SCHEME,
    suggest: Annotated[Optional[int], typer.Option("--suggest", help="Units the suggestion keeps [default: the fewest covering half the summed KL, at most a tenth].")] = None,
    threshold: Annotated[float, typer.Option("--threshold", help="Outlier channel: max |x| at least this many times the median channel's.")] = _iout.OUTLIER_THRESHOLD,
    rows: Annotated[int, typer.Option("--rows", help="Ranked units to print (all are in --json).")] = 30,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Which layers' (or matrices') quantization moves the output: KL divergence from the reference, ranked."""
    run = start(json_path, force, threads, reads(model))
    if scheme is None:
        raise InputError("missing --scheme: the scheme whose damage to measure, e.g. --scheme int4-tensor")
    _isens.check_options(scheme=scheme, by=by, tokens=tokens, keep=keep, suggest=suggest, threshold=threshold,
                         scale_dtype=scale_dtype, device=device)
    whole(rows, "--rows", 0, MAX_COUNT)  # what the table prints: the CLI's own option
    run.use_threads()
    ref = checked(model)  # a bad MODEL is refused in one line, before the status line
    _iout.check_context(tokens, _iout.resolve_with_context(ref)[1], "--tokens", ref.spec)  # so is more than its context
    console.status("loading the model")
    with console.progress() as bar:
        r = _isens.rank_sensitivity(
            ref, scheme=scheme, by=by, tokens=tokens, text=text, keep=keep, suggest=suggest, threshold=threshold,
            scale_dtype=scale_dtype, device=device,
            on_start=lambda n: bar.start(f"quantizing one {by} at a time ({scheme})", n), on_unit=bar.callback(),
        )
    render.sensitivity(r, by, rows, threshold, model)
    run.write_json(r.to_dict)


@inspect_app.command("next-token")
@handles_errors
def inspect_next_token_(
    args: Annotated[list[str], typer.Argument(help="[MODEL] TEXT", show_default=False, metavar="[MODEL] TEXT")],
    top: Annotated[int, typer.Option("--top", help="Most likely next tokens to list.")] = _inext.TOP,
    temperature: Annotated[str, typer.Option("--temperature", help="Comma-separated temperatures.", metavar="LIST")] = ",".join(f"{t:g}" for t in _inext.TEMPERATURES),
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Top-k next-token probabilities after TEXT at each temperature: the soft labels distillation trains on."""
    if len(args) > 2:
        raise InputError(f"expected [MODEL] TEXT, got {len(args)} arguments; quote the text")
    model, text = (None, args[0]) if len(args) == 1 else (args[0], args[1])
    run = start(json_path, force, threads, reads(model))
    _inext.check_options(top=top, temperatures=temperature, device=device)
    run.use_threads()
    r = _inext.next_token(model, text=text, top=top, temperatures=temperature, device=device)
    render.next_token(r)
    run.write_json(r.to_dict)
