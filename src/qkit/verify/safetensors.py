"""``qkit verify`` of a safetensors export directory (compressed-tensors, its W8A8 variant, bitsandbytes).

qkit's side reads each quantized module's stored tensors back (``Format.decode``), checks them against
the sha256 recorded at export and dequantizes them into a plain transformers model; the library's side is
``AutoModelForCausalLM.from_pretrained`` on the directory. Everything that differs between formats (which
keys a module stores, how the library's dense weight is read, its run-time dtype, its activation rule) is
asked of the format (``common.SafetensorsFormat``); see ``qkit.verify`` for the rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import ExportError, InputError, ModelLoadError, QkitError
from qkit.export import REGISTRY
from qkit.export.common import EXPORT_MANIFEST, ExportEntry, SafetensorsFormat, fingerprint, read_export_manifest
from qkit.methods.experts import ExpertLayout
from qkit.models import check_remote_code, load_tokenizer, parse_device, read_config
from qkit.schemes import QuantizedTensor
from qkit.verify import experts
from qkit.verify.activations import simulation_report
from qkit.verify.result import LOGITS_RTOL, PROMPT, TensorCheck, VerifyResult
from qkit.verify.result import load_weights, no_init, quiet, within  # the rules and loading helpers

# --------------------------------------------------------------------------- reading an export


def read_format(directory: Path) -> tuple[SafetensorsFormat, dict]:
    """``(the format that reads it, its quantization_config)`` for an exported directory; ``InputError`` else."""
    qc = read_config(directory).get("quantization_config") or {}
    for _, fmt in REGISTRY.items():
        reader = fmt.reader(qc) if isinstance(fmt, SafetensorsFormat) else None
        if reader is not None:
            return reader, qc
    raise InputError(
        f"{directory} is not a compressed-tensors pack-quantized or bitsandbytes nf4 checkpoint "
        f"(quant_method {qc.get('quant_method')!r}); verify checks what "
        "`qkit quantize --format compressed-tensors|bitsandbytes|gguf` writes"
    )


def iter_decoded(directory: Path, entries: dict[str, ExportEntry] | None = None
                 ) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor, bool | None]]:
    """Stream an export as qkit reads it: ``(name, QuantizedTensor or tensor, matches_export)``.

    ``matches_export``: for a quantized weight, whether the decoded codes and scales have the sha256 that
    ``qkit-export.json`` recorded when qkit wrote them (None without that file, or for other tensors).
    ``entries``: that file's checked tensors (``read_export_manifest``), when the caller has read them.
    """
    directory = Path(directory)
    fmt, qc = read_format(directory)
    if entries is None:
        entries = read_export_manifest(directory, fmt.name)
    parts_of = fmt.stored_parts([k for k, _ in tensor_shapes(directory)])
    n_parts = fmt.parts_per_module(parts_of)
    held: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in iter_tensors(directory):
        module = parts_of.get(key)
        if module is None:
            yield key, t, None
            continue
        parts = held.setdefault(module, {})
        parts[key.removeprefix(module + ".")] = t
        if len(parts) < n_parts[module]:
            continue
        del held[module]
        name = f"{module}.weight"
        if entries is not None:
            if name not in entries:
                raise ExportError(f"{name} is quantized in the weights but not in {EXPORT_MANIFEST}; re-export")
            scheme, dtype = entries[name].scheme, entries[name].dtype
        else:
            scheme = fmt.infer_scheme(qc, module, parts)
            dtype = fmt.stored_dtype(parts)
        try:
            qt = fmt.decode(parts, scheme, dtype)
        except QkitError:
            raise
        except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as exc:  # stored parts that do not fit the scheme
            raise ExportError(f"{directory}: the stored tensors of {name} do not decode as {scheme.name} "
                              f"({' '.join(str(exc).split())[:160]}); re-export the checkpoint") from exc
        recorded = entries[name].sha256 if entries is not None else None
        yield name, qt, (None if recorded is None else fingerprint(qt) == recorded)
    if held:
        raise ExportError(f"{directory}: {', '.join(sorted(held))} lack some of their stored tensors; re-export")


# --------------------------------------------------------------------------- the comparison


def _library_version(fmt: SafetensorsFormat) -> str:
    try:
        return f"transformers {version('transformers')} + {fmt.library} {version(fmt.library)}"
    except PackageNotFoundError as exc:
        raise InputError(f"verifying a {fmt.name} checkpoint needs the {fmt.library} package; "
                         f"pip install {fmt.library}") from exc


def _prompt_ids(directory: Path, vocab: int, trust_remote_code: bool = False) -> torch.Tensor:
    tok = load_tokenizer(directory, trust_remote_code)
    if tok is not None:
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        if ids.numel() and int(ids.max()) < vocab:
            return ids
    return (torch.arange(24) * 7 + 3).remainder(vocab).unsqueeze(0)  # no tokenizer: fixed ids


def verify_safetensors(
    checkpoint: str | Path, *, device: str | None = None, fast_cpu_kernel: bool = False,
    trust_remote_code: bool = False,
) -> VerifyResult:
    """``qkit verify`` of an export directory (see ``qkit.verify``); ``InputError`` for a directory
    that is not one."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: only a verification loads transformers

    directory = Path(checkpoint)
    check_remote_code(directory, str(checkpoint), trust_remote_code)
    fmt, qc = read_format(directory)
    entries = read_export_manifest(directory, fmt.name)  # a corrupt record is refused before any model is built
    library = _library_version(fmt)
    dev = parse_device(device)

    with quiet():
        try:
            config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises many types (a trusted auto_map whose code is absent: OSError)
            raise ModelLoadError(f"transformers cannot read the config of {directory} "
                                 f"({' '.join(str(exc).split())[:200]}); re-export it") from exc
        del config.quantization_config
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        # FP4 (compressed-tensors) runs only in bf16 on CPU: both sides are then built in bf16 (note says why).
        dtype, dtype_note = fmt.runtime_dtype(qc, dtype)
        # qkit's side: its own reading of the exported bytes, dequantized by qkit.
        state, schemes, dense, matches = {}, {}, {}, {}
        for name, value, match in iter_decoded(directory, entries):
            if isinstance(value, QuantizedTensor):
                dense[name] = value.dequantize(dtype)
                schemes[name] = value.scheme.name
                matches[name] = match
                state[name] = dense[name]
            else:
                state[name] = value
        # A mixture-of-experts export stores one matrix per expert; transformers holds them fused (verify.experts).
        lay = experts.layout(config.to_dict(), list(state))
        with no_init():  # every weight is loaded next; random init would cost seconds for nothing
            ours = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        load_weights(ours, state if lay is None else experts.fuse(state, config.to_dict(), lay), dev,
                     lambda missing: f"{directory} does not match its config (missing {missing[:3]}); re-export it")
        # The library's side: exactly how a user loads the directory.
        try:
            theirs = AutoModelForCausalLM.from_pretrained(str(directory), device_map={"": str(dev)}, dtype=dtype,
                                                          trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers and the quantization libraries raise many types
            if lay is not None:  # W8A8 experts (transformers 5.25): its loader finds no expert weight to fuse
                cause = str(exc).splitlines()[0].split(" For details")[0]  # its report went to the captured stderr
                raise ModelLoadError(
                    f"{library} could not load {directory}, a mixture-of-experts {fmt.name} checkpoint ({cause[:200]}); "
                    "it fuses the per-expert matrices on load, and qkit verify checks a file against the library's "
                    "own reading, so this one is not verified") from exc
            raise ModelLoadError(
                f"transformers could not load {directory} with {fmt.name} ({str(exc).splitlines()[0][:200]}); "
                "re-export it, or report the versions shown by `pip show transformers " + fmt.name + "`"
            ) from exc
        theirs.eval()
        rtol_dtype = fmt.library_setup(theirs, fast_cpu_kernel) or dtype

        ids = _prompt_ids(directory, config.vocab_size, trust_remote_code).to(dev)
        checks = []
        with torch.no_grad():
            if fmt.compares_before_forward:  # before a forward can repack the weights (bitsandbytes on CPU)
                checks = _compare_weights(fmt, theirs, dense, schemes, matches, lay)
            # W8A8: qkit's side gets the library's own activation rule (exact comparison), then the library
            # is compared with qkit's run-time simulation as well (verify.activations.simulation_report).
            acts = fmt.activations_of(qc)
            # (the linears only: transformers runs a layer's experts fused, not as modules the rule could hook)
            modules = sorted(n.removesuffix(".weight") for n in dense if lay is None or experts.site(n, lay) is None)
            with fmt.library_rule(ours, modules) if acts else contextlib.nullcontext():
                ref_logits = ours(ids).logits.float()
            lib_logits = theirs(ids).logits.float()  # compressed-tensors decompresses on this first forward
            if not fmt.compares_before_forward:
                checks = _compare_weights(fmt, theirs, dense, schemes, matches, lay)
            act_report = simulation_report(ours, ids, lib_logits, acts) if acts else None
    scale = float(ref_logits.abs().max())
    rtol = LOGITS_RTOL.get(rtol_dtype, 2e-2)
    return VerifyResult(
        checkpoint=str(directory), format=fmt.name, library=library, dtype=str(dtype).removeprefix("torch."),
        device=str(dev), prompt_tokens=int(ids.shape[1]),
        logits_max_abs_diff=float((lib_logits - ref_logits).abs().max()), logits_scale=scale,
        logits_tolerance=rtol * max(1.0, scale),
        weight_rule=("bit-identical" if dtype == torch.float32 else f"within one rounding of {dtype}")
        + (f" ({dtype_note})" if dtype_note else ""),
        tensors=checks, activations=act_report,
        experts=0 if lay is None else sum(experts.site(n, lay) is not None for n in dense),
    )


def _compare_weights(fmt: SafetensorsFormat, model: torch.nn.Module, dense: dict[str, torch.Tensor],
                     schemes: dict[str, str], matches: dict[str, bool | None],
                     lay: ExpertLayout | None) -> list[TensorCheck]:
    """Each quantized weight as the library computes it against qkit's; an expert's is read from the library's
    fused parameters (``experts.library_expert``)."""
    checks = []
    for name in sorted(dense):
        where = None if lay is None else experts.site(name, lay)
        got = (fmt.library_weight(model, name.removesuffix(".weight")) if where is None
               else experts.library_expert(model, where)).to(dense[name].device)
        diff, bad, same = within(got, dense[name])
        checks.append(TensorCheck(name, schemes[name], tuple(dense[name].shape), diff, bad, same, matches[name]))
    return checks


__all__ = ["iter_decoded", "read_format", "verify_safetensors"]
