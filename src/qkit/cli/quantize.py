"""``qkit quantize`` (write a checkpoint) and ``qkit verify`` (check an exported one with its library)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from qkit import console
from qkit.cli.common import (
    DeviceOpt,
    JsonOpt,
    ModelArg,
    PickleOpt,
    ScaleDtypeOpt,
    ThreadsOpt,
    TrustOpt,
    handles_errors,
    human_bytes,
    json_target,
    parse_size,
    use_threads,
)
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, DEFAULT_SCHEME

SchemeOpt = Annotated[str, typer.Option("--scheme", "-s", help="int8-tensor, int8-row, int4-tensor, int4-row, int4-g128 (int4-gN, int8-gN), nf4.")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")]
IncludeOpt = Annotated[list[str], typer.Option("--include", help="Also quantize tensors matching this glob (repeatable).")]
ExcludeOpt = Annotated[list[str], typer.Option("--exclude", help="Never quantize tensors matching this glob (repeatable).")]
KeepOpt = Annotated[list[str], typer.Option("--keep", help="SCHEME:GLOB, e.g. int8:'*.down_proj.weight' or none:GLOB (repeatable).")]
FormatOpt = Annotated[str, typer.Option("--format", help="qkit; compressed-tensors (int4-gN, int8-gN, int4-row, int8-row: vLLM, transformers); bitsandbytes (nf4: transformers); gguf (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q6_k: llama.cpp; -o FILE.gguf, or a directory for model.gguf).")]
MaxShardOpt = Annotated[Optional[str], typer.Option("--max-shard-size", help="Largest output shard, e.g. 500MB or 2GB (default 2GiB); bounds peak memory.", metavar="SIZE")]


@handles_errors
def quantize(
    model: ModelArg = None,
    scheme: SchemeOpt = DEFAULT_SCHEME,
    output: OutputOpt = None,
    force: ForceOpt = False,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    include: IncludeOpt = [],
    exclude: ExcludeOpt = [],
    keep: KeepOpt = [],
    fmt: FormatOpt = "qkit",
    max_shard_size: MaxShardOpt = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Write a quantized safetensors checkpoint of MODEL (qkit's format, or one vLLM/transformers load)."""
    from qkit.api import quantize_model
    from qkit.checkpoint import remove_stale_siblings
    from qkit.errors import InputError
    from qkit.export import QKIT, get_format
    from qkit.threads import check_threads

    json_target(json_path)
    # Every check that needs no model comes first; quantize_model itself checks the output, scheme, rules
    # and device before it reads the model.
    if output is None:
        raise InputError("missing -o/--output: the directory to write the quantized checkpoint to")
    if fmt != QKIT:
        get_format(fmt)
    shard = {"max_shard_bytes": parse_size(max_shard_size)} if max_shard_size else {}
    check_threads(threads)
    removed = remove_stale_siblings(output)
    if removed:
        console.status(f"removed {len(removed)} temporary director{'ies' if len(removed) > 1 else 'y'} of killed "
                       f"runs (their writer process is gone): {', '.join(str(p) for p in removed)}")
    use_threads(threads)
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
            format=fmt,
            **shard,
            allow_pickle=allow_pickle,
            on_start=lambda n: bar.start(f"quantizing ({scheme})", n),
            on_tensor=bar.callback(),
        )
    render_quantize(result)
    if json_path:
        console.write_json(json_path, result.to_dict())


def render_quantize(result) -> None:
    used = ", ".join(f"{k} x{v}" for k, v in sorted(result.schemes_used.items()))
    console.table(
        ["", ""],
        [
            ["output", str(result.output)],
            ["format", result.format],
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


# --------------------------------------------------------------------------- verify (export conformance)


@handles_errors
def verify(
    checkpoint: Annotated[Path, typer.Argument(help="A directory written by qkit quantize --format compressed-tensors|bitsandbytes, or a .gguf file (or directory) of --format gguf.", show_default=False)],
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Load an exported CHECKPOINT with its target library and compare it with qkit, weight by weight and on logits."""
    from qkit.export.verify import verify_checkpoint

    json_target(json_path)
    use_threads(threads)
    r = verify_checkpoint(checkpoint, device=device)
    render_verify(r)
    if json_path:
        console.write_json(json_path, r.to_dict())
    if not r.passed:
        raise typer.Exit(1)


def render_verify(r) -> None:
    rows = [[scheme, f"{v['tensors']}", f"{v['match_export']}", f"{v['identical']}", f"{v['within_tolerance']}",
             f"{v['max_abs_diff']:.3g}"] for scheme, v in r.by_scheme().items()]
    console.table(["scheme", "tensors", "decode = written", "bit-identical", "within rule", "max |diff|"], rows,
                  title=f"qkit verify: {r.checkpoint} ({r.format}, read by {r.library}, {r.dtype} on {r.device})")
    console.note(f"weights: {r.weight_rule} required: {'ok' if r.weights_ok else 'FAILED'}")
    console.note(f"logits on a fixed {r.prompt_tokens}-token prompt: max |diff| {r.logits_max_abs_diff:.3g} "
                 f"(tolerance {r.logits_tolerance:.3g}, max |logit| {r.logits_scale:.3g}): {'ok' if r.logits_ok else 'FAILED'}")
    console.note("verified" if r.passed else "NOT verified", style="bold green" if r.passed else "bold red")
