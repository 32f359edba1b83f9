"""``qkit plan``: the best mix of types for a byte budget, from measured per-tensor sensitivity."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from qkit import console
from qkit.api import plan_model
from qkit.cli.common import (
    CalibrationOpt,
    DeviceOpt,
    ExecutorOpt,
    ForceOpt,
    JsonOpt,
    MaxMemoryOpt,
    ModelArg,
    PickleOpt,
    RayAddressOpt,
    ScaleDtypeOpt,
    ThreadsOpt,
    TrustOpt,
    check_words,
    handles_errors,
    human_bytes,
    parse_list,
    reads,
    start,
)
from qkit.errors import InputError
from qkit.executors import executor_options
from qkit.export.gguf.tensor_types import is_tensor_type_file, types_by_kind
from qkit.memory import gib
from qkit.memory import parse_size
from qkit.methods import RTN
from qkit.outputs import check_output_path
from qkit.pinned_models import titled
from qkit.plan import (
    Plan,
    PlanOptions,
    base_type,
    is_plan_file,
    plan_formats,
    upgrades,
)
from qkit.dtypes import LOAD_DTYPES
from qkit.plan.planfile import lossless_types
from qkit.plan.options import DEFAULT_CHECK_WINDOWS, DEFAULT_DTYPE, DEFAULT_SAMPLES, DEFAULT_SEQLEN
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE
from qkit.texts import joined_sources
from qkit.threads import check_threads

PlanOutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="The plan to write (JSON): per tensor its type, exact bytes and predicted KL.", metavar="PLAN.json")]
TargetBitsOpt = Annotated[Optional[float], typer.Option("--target-bits", help="Budget in bits per weight over the planned tensors (the block projections), scales included.", metavar="B")]
TargetSizeOpt = Annotated[Optional[str], typer.Option("--target-size", help="Budget in bytes of the whole file's tensors (the tensors outside the plan, kept as they are, count against it): 105454208, 100MB, 1GiB.", metavar="SIZE")]
TargetSchemeOpt = Annotated[Optional[str], typer.Option("--target-scheme", help="Budget: the tensor bytes of the file this scheme writes in --format (a recipe such as q4_k_m: its whole file, whose token_embd/output the plan then chooses for too; or a type).", metavar="SCHEME")]
PlanFormatOpt = Annotated[str, typer.Option("--format", help=f"What the plan is written as, which decides its candidates and byte counts: {', '.join(plan_formats())}.")]
CandidatesOpt = Annotated[Optional[str], typer.Option("--candidates", help="Only these types (comma-separated; default: the format's whole ladder; 'none' keeps a tensor unquantized).", metavar="LIST")]
PlanMethodOpt = Annotated[str, typer.Option("--method", help="rtn; imatrix (collect the importance matrix and measure llama.cpp's types through their weighted searches); or gptq (price every candidate for the codes --method gptq writes; quantize the plan with --method gptq).")]
PlanImatrixOpt = Annotated[Optional[str], typer.Option("--imatrix", help="An importance matrix file (qkit imatrix, llama-imatrix) that llama.cpp's types are measured and written with.", metavar="FILE")]
PlanEmitOpt = Annotated[Optional[str], typer.Option("--emit-tensor-types", help="With --format gguf: also write the --tensor-type-file with which llama-quantize writes every planned tensor's type.", metavar="FILE")]
SamplesOpt = Annotated[int, typer.Option("--calibration-samples", help="Calibration windows the Fisher is measured on.", metavar="N")]
SeqlenOpt = Annotated[Optional[int], typer.Option("--calibration-seqlen", help=f"Tokens per calibration window [default: {DEFAULT_SEQLEN}, or the model's context where shorter].", metavar="N", show_default=False)]
CheckOpt = Annotated[Optional[int], typer.Option("--check-windows", help=f"Calibration windows the chosen mix's KL is measured on, beside the prediction [default: {DEFAULT_CHECK_WINDOWS}, or --calibration-samples where fewer].", metavar="N", show_default=False)]
IncludePlanOpt = Annotated[list[str], typer.Option("--include", help="Also plan tensors matching this glob (repeatable).")]
ExcludePlanOpt = Annotated[list[str], typer.Option("--exclude", help="Never plan (nor quantize) tensors matching this glob (repeatable).")]
PlanDtypeOpt = Annotated[str, typer.Option("--dtype", help=f"The dtype the model is loaded in for the Fisher ({', '.join(LOAD_DTYPES)}; bf16 halves the model's memory; the Fisher is float32 either way).")]


@handles_errors
def plan(
    model: ModelArg = None,
    target_bits: TargetBitsOpt = None,
    target_size: TargetSizeOpt = None,
    target_scheme: TargetSchemeOpt = None,
    fmt: PlanFormatOpt = "qkit",
    output: PlanOutOpt = None,
    candidates: CandidatesOpt = None,
    method: PlanMethodOpt = RTN,
    imatrix: PlanImatrixOpt = None,
    emit_tensor_types: PlanEmitOpt = None,
    include: IncludePlanOpt = [],
    exclude: ExcludePlanOpt = [],
    calibration: CalibrationOpt = None,
    calibration_samples: SamplesOpt = DEFAULT_SAMPLES,
    calibration_seqlen: SeqlenOpt = None,
    check_windows: CheckOpt = None,
    dtype: PlanDtypeOpt = DEFAULT_DTYPE,
    max_memory: MaxMemoryOpt = None,
    scale_dtype: ScaleDtypeOpt = DEFAULT_SCALE_DTYPE,
    device: DeviceOpt = None,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
    trust_remote_code: TrustOpt = False,
    allow_pickle: PickleOpt = False,
    threads: ThreadsOpt = None,
    executor: ExecutorOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Choose each tensor's type for a byte budget: measured sensitivity, an exact solve, a measured check."""
    run = start(json_path, force, threads, reads(model, ("the calibration text", calibration), ("the importance matrix", imatrix)),
                writes=[("-o", output), ("--emit-tensor-types", emit_tensor_types)])
    if output is None:
        raise InputError("missing -o/--output: the plan file to write (e.g. plan.json)")
    for path, option, owned, what in ((output, "-o", is_plan_file, "a plan qkit wrote"), (emit_tensor_types,
                                      "--emit-tensor-types", is_tensor_type_file, "a tensor-type file qkit wrote")):
        if path is not None:
            check_output_path(path, kind="file", force=force, inputs=run.inputs, what=option, describe=what, owned=owned)
    options = PlanOptions(format=fmt, target_bits=target_bits,
                          target_size=parse_size(target_size, "--target-size") if target_size is not None else None,
                          target_scheme=target_scheme,
                          candidates=parse_list(candidates, "--candidates", what="type", where="e.g. q4_k,q6_k,none",
                                                spaces=True) or (),
                          include=tuple(check_words(include, "--include", what="glob", where="e.g. '*.mlp.*'")),
                          exclude=tuple(check_words(exclude, "--exclude", what="glob", where="e.g. '*.layers.0.*'")),
                          scale_dtype=scale_dtype, calibration=joined_sources(calibration),
                          samples=calibration_samples, seqlen=calibration_seqlen, check_windows=check_windows,
                          dtype=dtype.lower(),
                          max_memory=parse_size(max_memory, "--max-memory") if max_memory is not None else None,
                          method=method, imatrix=imatrix, emit_tensor_types=emit_tensor_types, device=device,
                          trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, force=force,
                          executor=executor_options(executor, ray_address))
    options.check()  # before any work: the executor too (Ray installed, an address answering)
    check_threads(threads)
    run.use_threads()
    with console.progress() as bar:
        stage = [None, 0]

        def progress(name: str, done: int, total: int) -> None:
            if stage[0] != name:
                bar.start({"fisher": f"sensitivity: Fisher, {total} forward and backward passes",
                           "candidates": f"sensitivity: every candidate of {total} tensors",
                           "gptq": f"sensitivity: GPTQ's output error for every candidate of {total} tensors"}[name], total)
                stage[0], stage[1] = name, 0
            bar.advance(done - stage[1])
            stage[1] = done

        r = plan_model(model, options=options, output=output, progress=progress)
    render_plan(r.plan)
    if r.tensor_types is not None:
        console.note(f"wrote {r.tensor_types}: llama-quantize --tensor-type-file {r.tensor_types} gives every planned "
                     "tensor the type it has in this plan")
    run.write_json(r.to_dict)


def render_plan(p: Plan) -> None:
    """The plan's summary: budget, bytes, predicted and measured KL; types by tensor; the upgrades and why."""
    t, chk, sol = p.target, p.check, p.solver
    target = (f"{t['bits']} bits/w" if "bits" in t else f"the bytes of {t['scheme']}" if "scheme" in t
              else human_bytes(t["size"]))
    measured = chk.get("measured_kl")
    rows = [
        ["target", f"{target}: {t['budget_bytes']:,} bytes over {len(p.tensors)} tensors ({t['weights']:,} weights)"
                   + (f", the file's {t['file_bytes']:,} less {t['outside_bytes']:,} for {t['outside_tensors']} tensors "
                      "outside the plan" if t.get("file_bytes") is not None else "")],
        ["planned", f"{p.nbytes:,} bytes, {p.bits_per_weight:.3f} bits/w ({p.format})"],
        ["predicted KL", f"{p.predicted_kl:.5f} nats/token (diagonal Fisher"
                         + (" x GPTQ's held-out output-error ratio" if p.method == "gptq" else "") + ", sum over tensors)"],
        ["measured KL", "-" if measured is None else
         f"{measured:.5f} ± {chk['measured_kl_se']:.5f} on {chk['positions']:,} calibration positions "
         f"(predicted/measured {chk['ratio']:.2f})" if chk.get("ratio") else f"{measured:.5f}"],
        *([["measured with", f"GPTQ's weights, solved on {solved['windows']} window{'s' * (solved['windows'] != 1)} "
                             + ("the check does not measure" if solved["held_out"] else "the check measures too (no others)")]]
          if (solved := chk.get("gptq_solved_on")) else []),
        ["solver", f"{'exact' if sol.get('exact') else 'rounded to ' + str(sol.get('unit')) + ' bytes'}: "
                   f"{sol.get('states', 0):,} states of {sol.get('unit')} bytes, {sol.get('seconds', 0) * 1000:.0f} ms"
                   + (f"; {len(sol['tied'])} fused vLLM layers (q/k/v, gate/up) take one type each" if sol.get("tied") else "")],
        ["sensitivity", f"{p.sensitivity.get('positions', 0):,} positions of {p.sensitivity.get('calibration', {}).get('name')}, "
                        + ", ".join(f"{k} {v:.1f} s" for k, v in (p.sensitivity.get('seconds') or {}).items())],
        *([["importance matrix", f"{p.imatrix.get('file')} (sha256 {str(p.imatrix.get('sha256'))[:12]}...)"]] if p.imatrix else []),
        *([["memory", memory_line(p.sensitivity["memory"])]] if isinstance(p.sensitivity.get("memory"), dict) else []),
    ]
    console.table(["", ""], rows, title=f"qkit plan: {p.model}", show_header=False)
    kinds = types_by_kind({n: x.type for n, x in p.tensors.items()})
    names = sorted({ty for per in kinds.values() for ty in per})
    console.table(["tensor", *names], [[k, *(str(per.get(ty, "")) for ty in names)] for k, per in kinds.items()],
                  title="types planned, by tensor (count of layers)")
    ups = upgrades(p)
    if ups:
        base = base_type(p)
        top = sorted(ups, key=lambda u: -u["kl_at_base"])[:12]
        console.table(["tensor", "type", "+bytes", f"KL at {base}", "KL", "KL saved per MB"],
                      [[u["tensor"], u["type"], f"{u['extra_bytes']:,}", f"{u['kl_at_base']:.2e}", f"{u['kl']:.2e}",
                        f"{u['kl_saved_per_mb']:.2e}"] for u in top],
                      title=f"{len(ups)} tensors got more bytes than {base} would take (the {len(top)} most sensitive at {base})")
    for note in (lossless_note(p), experts_note(p)):
        if note:
            console.note(note)


def experts_note(p: Plan) -> str | None:
    """What a mixture-of-experts plan says of its experts (``sensitivity.experts``): how many matrices were
    priced, and the experts no calibration token reached, with how they were priced. None for a dense plan."""
    e = p.sensitivity.get("experts")
    if not isinstance(e, dict):
        return None
    head = (f"{e.get('matrices')} expert matrices of {e.get('experts')} experts, each priced by its own slice of its "
            "layer's fused parameter's Fisher")
    unreached = [str(x) for x in e.get("unreached") or []]
    if not unreached:
        return f"{head}; calibration tokens reached every expert."
    shown = ", ".join(unreached[:4]) + (f" and {len(unreached) - 4} more" if len(unreached) > 4 else "")
    return (f"{head}. No calibration token reached {len(unreached)} expert{'s' * (len(unreached) != 1)} ({shown}): "
            f"{e.get('unreached_priced')} (the plan lists them: sensitivity.experts.unreached).")


def memory_line(m: dict) -> str:
    """The sensitivity's memory record in one line: how the Fisher was measured (the walk down the blocks,
    passes over the windows; a plan of an older qkit: its groups), the budget and the estimated peak."""
    if "passes" in m:
        passes = m["passes"]
        how = f"the Fisher {m.get('fisher', 'walked block by block')}, {passes} pass{'es' if passes != 1 else ''}"
    else:
        groups = m.get("groups", 1)
        how = f"the Fisher in {groups} group{'s' if groups != 1 else ''}"
    return (f"{m.get('dtype', DEFAULT_DTYPE)} model, {how}: estimated peak {gib(m.get('estimated_peak_bytes', 0))} of a "
            f"{gib(m.get('budget_bytes', 0))} budget ({m.get('budget_from')})")


def lossless_note(p: Plan) -> str | None:
    """What the lossless planned tensors say, naming the grids found for this model: which planned types
    reproduce the source weights exactly and how many tensors each (``qkit.plan.planfile.lossless_types``);
    a pinned model's history (the default model's Q4_1) only for that model. None when no tensor is lossless."""
    found = lossless_types(p)
    if not found:
        return None
    n = sum(found.values())
    types = ", ".join(f"{t} ({c} tensor{'s' if c != 1 else ''})" for t, c in found.items())
    them = "that type" if len(found) == 1 else "those types"
    pinned = titled(p.model)
    history = (f" ({pinned.called} was published as {pinned.published})" if pinned is not None
               else " (the source is a GGUF file, stored in llama.cpp's types)" if p.model.lower().endswith(".gguf") else "")
    why = f"the source weights already lie on {'that type' + chr(39) + 's grid' if len(found) == 1 else 'those types' + chr(39) + ' grids'}{history}"
    return (f"{n} planned tensor{'s are' if n != 1 else ' is'} stored in a type that reproduces the source weights exactly "
            f"(predicted KL 0): {types}; {why}. Such a plan's gain is the model's history, not the method's: plan "
            f"again with --candidates without {them} to compare methods.")
