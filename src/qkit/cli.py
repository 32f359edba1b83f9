"""The command line. The only module that imports typer; thin: parse, call the library, render, exit.

Every option is defined once (an ``Annotated`` alias below) and takes its default from the library.
Library errors (``QkitError``) become one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkit import console
from qkit.errors import QkitError

app = typer.Typer(
    name="qkit",
    help="Quantize language-model weights and measure, honestly, what it cost.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)



@app.callback()
def _root() -> None:
    """qkit: quantize language-model weights and measure what it cost."""


# --------------------------------------------------------------------------- shared options (defined once)

ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Model directory, hub id, .gguf file or qkit checkpoint; omitted: the pinned default model.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    Optional[str], typer.Option("--json", help="Also write everything the table shows as JSON to PATH ('-': stdout).", metavar="PATH")
]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N. Default: CUDA when available, else CPU.")
]
ScaleDtypeOpt = Annotated[str, typer.Option("--scale-dtype", help="Dtype the scales are stored (and applied) in: fp16, bf16, fp32.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow custom model code from the model's repository.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickled .bin/.pt weights (can run code).")]


def _json_target(json_path: str | None) -> None:
    console.use_stderr_for_tables(json_path == "-")


def handles_errors(fn):
    """Turn ``QkitError`` into one line and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QkitError as exc:
            console.error(str(exc))
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def human_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f} B"


# --------------------------------------------------------------------------- quantize


@app.command()
@handles_errors
def quantize(
    model: ModelArg = None,
    scheme: Annotated[str, typer.Option("--scheme", "-s", help="int8-tensor, int8-row, int4-tensor, int4-row, int4-g128 (int4-gN, int8-gN), nf4.")] = "nf4",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    scale_dtype: ScaleDtypeOpt = "fp16",
    include: Annotated[list[str], typer.Option("--include", help="Also quantize tensors matching this glob (repeatable).")] = [],
    exclude: Annotated[list[str], typer.Option("--exclude", help="Never quantize tensors matching this glob (repeatable).")] = [],
    keep: Annotated[list[str], typer.Option("--keep", help="SCHEME:GLOB, e.g. int8:'*.down_proj.weight' or none:GLOB (repeatable).")] = [],
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
) -> None:
    """Write a quantized safetensors checkpoint of MODEL."""
    from qkit.api import quantize_model
    from qkit.errors import InputError

    _json_target(json_path)
    if output is None:
        raise InputError("missing -o/--output: the directory to write the quantized checkpoint to")
    with console.progress() as bar:
        result = quantize_model(
            model,
            output=output,
            scheme=scheme,
            scale_dtype=scale_dtype,
            include=include,
            exclude=exclude,
            keep=keep,
            force=force,
            device=device,
            allow_pickle=allow_pickle,
            on_start=lambda n: bar.start(f"quantizing ({scheme})", n),
            on_tensor=bar.callback(),
        )
    used = ", ".join(f"{k} x{v}" for k, v in sorted(result.schemes_used.items()))
    console.table(
        ["", ""],
        [
            ["output", str(result.output)],
            ["scheme", used],
            ["matrices quantized", f"{result.matrices:,}"],
            ["parameters quantized", f"{result.parameters:,}"],
            ["bits per weight", f"{result.bits_per_weight:.3f}"],
            ["size before", human_bytes(result.bytes_before)],
            ["size after", human_bytes(result.bytes_after)],
            ["seconds", f"{result.seconds:.1f}"],
        ],
        title=f"qkit quantize: {result.model}",
        show_header=False,
    )
    if json_path:
        console.write_json(json_path, result.to_dict())


# --------------------------------------------------------------------------- entry point


def main() -> None:
    try:
        app()
    except QkitError as exc:  # raised outside a command body (e.g. while parsing)
        console.error(str(exc))
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
