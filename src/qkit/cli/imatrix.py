"""``qkit imatrix``: collect llama.cpp's importance matrix from the calibration text."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from qkit import console
from qkit.api import imatrix_model
from qkit.cli.common import (
    CalibrateAllExpertsOpt,
    CalibrationOpt,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    MaxMemoryOpt,
    ModelArg,
    PickleOpt,
    ThreadsOpt,
    TrustOpt,
    handles_errors,
    human_bytes,
    reads,
    start,
)
from qkit.errors import InputError
from qkit.memory import parse_size
from qkit.methods.imatrix import ImatrixOptions
from qkit.methods.imatrix.file import is_qkit_imatrix
from qkit.outputs import check_output_path
from qkit.texts import joined_sources
from qkit.threads import check_threads

_D = ImatrixOptions()
ImatrixOutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="The importance matrix to write: llama.cpp's GGUF imatrix format (what llama-imatrix writes and llama-quantize --imatrix reads).", metavar="FILE.gguf")]
ChunksOpt = Annotated[int, typer.Option("--chunks", help="Chunks of the calibration text to evaluate, from its start (llama-imatrix's --chunks).", metavar="N")]
ChunkSizeOpt = Annotated[int, typer.Option("--chunk-size", "-c", help="Tokens per chunk (llama-imatrix's -c); the first is BOS when the tokenizer adds one.", metavar="N")]
BatchOpt = Annotated[int, typer.Option("--batch", help="Chunks per forward pass (memory, not the result).", metavar="N")]
ImatrixDtypeOpt = Annotated[str, typer.Option("--dtype", help="The dtype the model runs in (fp32, bf16, fp16; bf16 halves the model's memory; the sums are accumulated in fp64 either way).")]
ProcessOutputOpt = Annotated[bool, typer.Option("--process-output", help="Also collect output.weight (llama-imatrix's --process-output; an untied head only).")]


@handles_errors
def imatrix(
    model: ModelArg = None,
    output: ImatrixOutOpt = None,
    calibration: CalibrationOpt = None,
    chunks: ChunksOpt = _D.chunks,
    chunk_size: ChunkSizeOpt = _D.chunk_size,
    batch: BatchOpt = _D.batch,
    process_output: ProcessOutputOpt = _D.process_output,
    dtype: ImatrixDtypeOpt = _D.dtype,
    calibrate_all_experts: CalibrateAllExpertsOpt = _D.calibrate_all_experts,
    device: DeviceOpt = None,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
    threads: ThreadsOpt = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Collect MODEL's importance matrix (sums of x² per input column, token counts) as llama-imatrix does."""
    run = start(json_path, force, threads, reads(model, ("the calibration text", calibration)), writes=[("-o", output)])
    if output is None:
        raise InputError("missing -o/--output: the importance matrix file to write (e.g. imatrix.gguf)")
    check_output_path(output, kind="file", force=force, inputs=run.inputs, describe="an importance matrix qkit wrote",
                 owned=is_qkit_imatrix)
    options = ImatrixOptions(source=joined_sources(calibration), chunks=chunks, chunk_size=chunk_size, batch=batch,
                             process_output=process_output, dtype=dtype.lower(), calibrate_all_experts=calibrate_all_experts)
    options.check()
    limit = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    check_threads(threads)
    run.use_threads()
    with console.progress() as bar:
        seen = [0]

        def progress(done: int, total: int) -> None:
            if seen[0] == 0:
                bar.start(f"collecting ({total} chunks of {chunk_size} tokens)", total)
            bar.advance(done - seen[0])
            seen[0] = done

        r = imatrix_model(model, output=output, options=options, device=device, trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle, force=force, progress=progress, max_memory=limit)
    cal = r.calibration
    console.table(["", ""], [
        ["output", str(r.output)],
        ["entries", f"{r.entries} weights"],
        ["tokens", f"{r.tokens:,} ({r.chunks} chunks of {r.chunk_size})"],
        ["calibration", f"{cal['name']} (sha256 {cal['sha256'][:12]}..., disjoint from {cal['disjoint_from']['name']})"],
        *([["experts", expert_row(r.expert_tokens, calibrate_all_experts)]] if r.expert_tokens else []),
        ["size", human_bytes(r.output.stat().st_size)],
        ["seconds", f"{r.seconds:.1f}"],
    ], title=f"qkit imatrix: {r.model}", show_header=False)
    run.write_json(r.to_dict)


def expert_row(expert_tokens: dict[str, list[int]], every_token: bool) -> str:
    """How the experts were reached: "4 tensors x 4 experts (one row each, as llama-imatrix); tokens per
    expert 70 to 186, 0 reached by no token"."""
    counts = [c for row in expert_tokens.values() for c in row]
    rows = len(next(iter(expert_tokens.values())))
    how = "every token sent to every expert" if every_token else f"tokens per expert {min(counts):,} to {max(counts):,}"
    return (f"{len(expert_tokens)} tensors x {rows} experts (one row each, as llama-imatrix); {how}, "
            f"{sum(c == 0 for c in counts)} rows reached by no token")

