"""``qkit report``: one self-contained HTML page from the commands' JSON files (``qkit.report``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from qkit import console
from qkit.cli.common import (
    ForceOpt,
    ThreadsOpt,
    check_words,
    handles_errors,
    model_inputs,
    use_threads,
)
from qkit.errors import InputError
from qkit.outputs import check_apart, check_output_path, claim_output
from qkit.threads import check_threads
from qkit.report import build
from qkit.report.inputs import read_inputs

FilesArg = Annotated[Optional[list[str]], typer.Argument(
    help="JSON files written by qkit eval --json, inspect errors/outliers/sensitivity --json, plan -o, kv --json and "
         "budget --json, one of each kind at most (the kind is read from the content).",
    show_default=False, metavar="JSON")]
ReportOutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="The page to write (HTML, everything inline).",
                                                     metavar="REPORT.html")]
PngOpt = Annotated[Optional[str], typer.Option("--png", help="Also write every figure as DIR/NAME.png (for slides and docs).",
                                               metavar="DIR")]
ReportModelOpt = Annotated[Optional[str], typer.Option("--model", help="The model the missing steps run on (default: the "
                                                       "default model); it must be the model the files are of.")]
RunOpt = Annotated[Optional[str], typer.Option("--run", help=f"Steps to run when no file of that kind is given, "
                                               f"comma-separated: {', '.join(build.STEPS)}, all or none (default: "
                                               f"{','.join(build.DEFAULT_STEPS)}, the cheap ones; errors, sensitivity and "
                                               "eval take minutes).", metavar="LIST", show_default=False)]


@handles_errors
def report(
    files: FilesArg = None,
    output: ReportOutOpt = None,
    png: PngOpt = None,
    model: ReportModelOpt = None,
    run: RunOpt = None,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """One HTML page, offline and self-contained: the quality table, the frontier, errors, sensitivity, outliers, memory."""
    files = check_words(files or [], "JSON", what="JSON file", where="the --json output of a qkit command")
    if output is None:
        raise InputError("missing -o REPORT.html: the page to write")
    reads = [*(("an input JSON", f) for f in files), *model_inputs(model)]
    check_apart([("-o", output), ("--png", png)])  # the page inside the --png directory would be replaced by it
    check_output_path(output, kind="file", force=force, inputs=reads, what="-o", owned=build.is_report_file,
                 describe="a page qkit report wrote")
    claim_output(output, "-o")
    if png is not None:
        check_output_path(png, kind="dir", force=force, inputs=[*reads, ("the report", output)], what="--png",
                     owned=build.is_png_directory, describe="an empty directory or one of PNG files")
        claim_output(png, "--png")
    build.parse_steps(run)
    check_threads(threads)  # numbers first, as every command does
    read_inputs(files)  # a bad file is refused before threads are set or anything runs
    use_threads(threads)
    r = build.build_report(files, model=model, run=run, on_status=console.status)
    try:
        pngs = build.write_report(r, output, png_dir=png)
    finally:
        r.close()
    for line in r.notes:
        console.note(f"- {line}")
    size = len(r.html.encode())
    console.note(f"wrote {output} ({size / 1e6:.2f} MB, {len(r.figures)} figures)"
                 + (f"; {len(pngs)} PNG in {png}" if pngs else ""))
