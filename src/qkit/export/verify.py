"""``qkit verify CHECKPOINT``: does the target library read an export exactly as qkit means it?

Two models are built from the same files:

* **qkit's side**: every quantized module's stored tensors are read back by qkit (``Format.decode``)
  into the ``QuantizedTensor`` qkit wrote, dequantized with qkit's own ``dequantize`` to the model's
  dtype, and loaded into a plain transformers model;
* **the library's side**: ``AutoModelForCausalLM.from_pretrained`` on the directory, i.e. transformers
  with compressed-tensors or with bitsandbytes, exactly as a user loads it.

First, qkit's reading must reproduce, byte for byte, the codes and scales qkit quantized (their sha256 is
recorded per tensor in ``qkit-export.json`` at export), so an encoding error cannot hide behind a decoder
that shares it. Then (1) every quantized weight is compared tensor by tensor: the library's dequantized weight
(compressed-tensors: the dense weight it decompresses on the first forward; bitsandbytes:
``bitsandbytes.functional.dequantize_4bit``) against qkit's. Both compute ``q * scale`` exactly and round
once to the model's dtype, so they must be bit-identical in fp32; in fp16/bf16 they may differ by one
rounding step (``|a - b| <= eps(dtype) * |b|``). (2) The logits of both models on a fixed prompt are
compared: ``max |a - b| <= LOGITS_RTOL * max(1, max |b|)`` (1e-4 in fp32, 2e-2 in 16-bit dtypes).

W8A8 (``int-quantized``, ``qkit.export.compressed_tensors_w8a8``): transformers on CPU decompresses the int8
weights and fake-quantizes each quantized linear's input per token (``max|x| / 127.5``, clamp ``[-128, 127]``,
compressed-tensors' dynamic rule); qkit's side applies that same rule, so the logits are held to the fp32
tolerance above. The library is also compared with qkit's own ``act-int8-token`` simulation (``max|x| / 127``,
what the ``smoothquant-w8a8`` eval row and vLLM's int8 kernels use): within twice the effect of the activation
quantization itself (``VerifyResult.activations``).

bitsandbytes on CPU: on a CPU with AVX512-BF16, ``Linear4bit.forward`` (bitsandbytes 0.50.2) repacks the
weight into a bf16 kernel layout (absmax rounded to bf16, compute in bf16, every input width a multiple
of the block size). That path depends on the machine, so ``verify`` reads through bitsandbytes' generic
CPU path (``dequantize_4bit`` + matmul, the same on every machine); ``fast_cpu_kernel=True`` keeps the
machine's path and the bf16 tolerance.

GGUF (``qkit verify FILE.gguf``, or the OUT directory holding ``model.gguf``): qkit reads each quantized
tensor's block bytes, undoes llama.cpp's q/k row permutation, and checks them against the sha256 recorded
at export (the file's ``qkit.export`` field); then every tensor is dequantized twice, by qkit's scheme and by
the ``gguf`` package (llama.cpp's reference, ``gguf.quants.dequantize``), and by transformers' loader
(``from_pretrained(..., gguf_file=)``); all three must be bit-identical in fp32. The logits of transformers'
model and of a transformers model holding qkit's weights (same config, read from the file) are compared on
the fixed prompt with the fp32 rule above.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkit.checkpoint import iter_tensors, tensor_shapes
from qkit.errors import ExportError, InputError, ModelLoadError, QkitError
from qkit.export import EXPORT_MANIFEST, get_format
from qkit.export.common import ExportEntry, Format, check_export_record, fingerprint, read_export_manifest
from qkit.models import check_remote_code, load_tokenizer, parse_device, read_config
from qkit.schemes import QuantizedTensor

PROMPT = "The capital of France is Paris. Water boils at one hundred degrees, and the quick brown fox"
LOGITS_RTOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass
class TensorCheck:
    name: str
    scheme: str
    shape: tuple[int, ...]
    max_abs_diff: float
    mismatched: int  # elements outside the tolerance
    identical: bool
    # qkit's reading of the file reproduces the codes and scales qkit wrote (sha256 in qkit-export.json);
    # None when the checkpoint has no qkit-export.json (not written by qkit).
    matches_export: bool | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "scheme": self.scheme, "shape": list(self.shape), "max_abs_diff": self.max_abs_diff,
                "mismatched": self.mismatched, "identical": self.identical, "matches_export": self.matches_export}


@dataclass
class VerifyResult:
    checkpoint: str
    format: str
    library: str  # "transformers 5.24.0 + compressed-tensors 0.20.1"
    dtype: str
    device: str
    prompt_tokens: int
    logits_max_abs_diff: float
    logits_scale: float  # max |logit| of qkit's model
    logits_tolerance: float
    weight_rule: str
    tensors: list[TensorCheck] = field(default_factory=list)
    # W8A8 exports: the library's logits against qkit's run-time simulation (compressed_tensors_w8a8)
    activations: dict | None = None

    @property
    def weights_ok(self) -> bool:
        return all(t.mismatched == 0 and t.matches_export is not False for t in self.tensors)

    @property
    def logits_ok(self) -> bool:
        return self.logits_max_abs_diff <= self.logits_tolerance

    @property
    def passed(self) -> bool:
        return bool(self.tensors) and self.weights_ok and self.logits_ok and (
            self.activations is None or bool(self.activations["ok"]))

    def by_scheme(self) -> dict[str, dict]:
        """Per scheme: tensors, how many are bit-identical, the largest weight difference."""
        out: dict[str, dict] = {}
        for t in self.tensors:
            row = out.setdefault(t.scheme, {"tensors": 0, "identical": 0, "within_tolerance": 0, "max_abs_diff": 0.0,
                                            "match_export": 0})
            row["tensors"] += 1
            row["match_export"] += t.matches_export is True
            row["identical"] += t.identical
            row["within_tolerance"] += t.mismatched == 0
            row["max_abs_diff"] = max(row["max_abs_diff"], t.max_abs_diff)
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint, "format": self.format, "library": self.library, "dtype": self.dtype,
            "device": self.device, "prompt_tokens": self.prompt_tokens, "weight_rule": self.weight_rule,
            "logits_max_abs_diff": self.logits_max_abs_diff, "logits_scale": self.logits_scale,
            "logits_tolerance": self.logits_tolerance, "weights_ok": self.weights_ok, "logits_ok": self.logits_ok,
            "passed": self.passed, "by_scheme": self.by_scheme(), "tensors": [t.to_dict() for t in self.tensors],
            **({"activations": self.activations} if self.activations is not None else {}),
        }


# --------------------------------------------------------------------------- reading an export


def checkpoint_format(directory: Path) -> tuple[str, dict]:
    """``(format name, quantization_config)`` of an exported checkpoint; ``InputError`` for anything else."""
    qc = read_config(directory).get("quantization_config") or {}
    method = qc.get("quant_method")
    from qkit.export.compressed_tensors import CT_FORMATS
    from qkit.export.compressed_tensors_w8a8 import is_w8a8

    if is_w8a8(qc):  # int-quantized W8A8 (qkit.export.compressed_tensors_w8a8)
        return "compressed-tensors", qc

    if method == "compressed-tensors" and qc.get("format") in CT_FORMATS:
        return "compressed-tensors", qc
    if method == "bitsandbytes" and qc.get("load_in_4bit") and qc.get("bnb_4bit_quant_type") == "nf4":
        return "bitsandbytes", qc
    raise InputError(
        f"{directory} is not a compressed-tensors pack-quantized or bitsandbytes nf4 checkpoint "
        f"(quant_method {method!r}); verify checks what `qkit quantize --format compressed-tensors|bitsandbytes|gguf` writes"
    )


def _stored_parts(fmt_name: str, keys: list[str]) -> dict[str, str]:
    """Stored key -> its module, for the keys that belong to quantized modules."""
    out = {}
    if fmt_name == "compressed-tensors":
        from qkit.export.compressed_tensors import STORED

        for k in keys:
            module, _, part = k.rpartition(".")
            if part in STORED:
                out[k] = module
        return out
    from qkit.export.bitsandbytes import QUANT_STATE, STORED

    modules = {k.removesuffix(f".weight.{QUANT_STATE}") for k in keys if k.endswith(f".weight.{QUANT_STATE}")}
    for k in keys:
        for part in STORED:
            module = k.removesuffix("." + part)
            if module != k and module in modules:
                out[k] = module
    return out


def iter_decoded(directory: Path, entries: dict[str, ExportEntry] | None = None
                 ) -> Iterator[tuple[str, QuantizedTensor | torch.Tensor, bool | None]]:
    """Stream an export as qkit reads it: ``(name, QuantizedTensor or tensor, matches_export)``.

    ``matches_export``: for a quantized weight, whether the decoded codes and scales have the sha256 that
    ``qkit-export.json`` recorded when qkit wrote them (None without that file, or for other tensors).
    ``entries``: that file's checked tensors (``read_export_manifest``), when the caller has read them.
    """
    directory = Path(directory)
    fmt_name, qc = checkpoint_format(directory)
    from qkit.export import compressed_tensors_w8a8 as w8a8

    fmt: Format = w8a8.FORMAT if w8a8.is_w8a8(qc) else get_format(fmt_name)
    if entries is None:
        entries = read_export_manifest(directory, fmt_name)
    keys = [k for k, _ in tensor_shapes(directory)]
    parts_of = w8a8.stored_parts(keys) if w8a8.is_w8a8(qc) else _stored_parts(fmt_name, keys)
    # compressed-tensors: int modules store 3 tensors, nvfp4 3, mxfp4 2 (count them); bitsandbytes 4.
    n_parts = Counter(parts_of.values()) if fmt_name == "compressed-tensors" else defaultdict(lambda: 4)
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
            dtype = parts["weight_scale"].dtype if fmt_name == "compressed-tensors" else getattr(
                torch, fmt.quant_state(parts)["dtype"])
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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Loading draws tqdm bars (compressed-tensors) and logs a kernel warning (bitsandbytes) on stderr.

    tqdm reads ``TQDM_DISABLE`` only when it is first imported, so stderr is captured instead; errors still
    propagate as exceptions.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


def _library_version(fmt_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    pkg = "compressed-tensors" if fmt_name == "compressed-tensors" else "bitsandbytes"
    try:
        return f"transformers {version('transformers')} + {pkg} {version(pkg)}"
    except PackageNotFoundError as exc:
        raise InputError(f"verifying a {fmt_name} checkpoint needs the {pkg} package; pip install {pkg}") from exc


def _prompt_ids(directory: Path, vocab: int, trust_remote_code: bool = False) -> torch.Tensor:
    tok = load_tokenizer(directory, trust_remote_code)
    if tok is not None:
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        if ids.numel() and int(ids.max()) < vocab:
            return ids
    return (torch.arange(24) * 7 + 3).remainder(vocab).unsqueeze(0)  # no tokenizer: fixed ids


def _within(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, bool]:
    """``(max |a-b|, elements outside the rule, bit-identical)``; the rule is in the module docstring."""
    identical = torch.equal(a, b)
    if identical:
        return 0.0, 0, True
    diff = (a.float() - b.float()).abs()
    if b.dtype == torch.float32:
        bad = int((diff > 0).sum())
    else:
        bad = int((diff > torch.finfo(b.dtype).eps * b.float().abs()).sum())
    return float(diff.max()), bad, False


def verify_checkpoint(
    checkpoint: str | Path, *, device: str | None = None, fast_cpu_kernel: bool = False,
    trust_remote_code: bool = False,
) -> VerifyResult:
    """Load ``checkpoint`` with its target library and compare it with qkit's reading (see the module doc).

    ``trust_remote_code``: allow the checkpoint's own Python (an ``auto_map`` copied from its model);
    without it such a checkpoint is refused first, and every transformers call is told ``False``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(checkpoint)
    try:
        gguf_export = _is_gguf_export(directory)
        is_dir = directory.is_dir()
    except PermissionError as exc:
        raise InputError(f"permission denied reading {exc.filename or directory}; make it readable") from exc
    if gguf_export:
        return verify_gguf(directory, device=device, trust_remote_code=trust_remote_code)
    if not is_dir:
        raise InputError(f"no such checkpoint directory: {checkpoint}; pass the -o directory of qkit quantize --format ...")
    check_remote_code(directory, str(checkpoint), trust_remote_code)
    fmt_name, qc = checkpoint_format(directory)
    entries = read_export_manifest(directory, fmt_name)  # a corrupt record is refused before any model is built
    from qkit.export import compressed_tensors_w8a8 as w8a8

    library = _library_version(fmt_name)
    dev = parse_device(device)

    with _quiet():
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
        dtype, dtype_note = getattr(get_format(fmt_name), "runtime_dtype", lambda qc, d: (d, None))(qc, dtype)
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
        with _no_init():  # every weight is loaded next; random init would cost seconds for nothing
            ours = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        missing = ours.load_state_dict(state, strict=False).missing_keys
        tied = set(getattr(ours, "_tied_weights_keys", None) or [])
        if [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]:
            raise ModelLoadError(f"{directory} does not match its config (missing {missing[:3]}); re-export it")
        ours.tie_weights()
        ours.eval().to(dev)
        # The library's side: exactly how a user loads the directory.
        try:
            theirs = AutoModelForCausalLM.from_pretrained(str(directory), device_map={"": str(dev)}, dtype=dtype,
                                                          trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers and the quantization libraries raise many types
            raise ModelLoadError(
                f"transformers could not load {directory} with {fmt_name} ({str(exc).splitlines()[0][:200]}); "
                "re-export it, or report the versions shown by `pip show transformers " + fmt_name + "`"
            ) from exc
        theirs.eval()
        if fmt_name == "bitsandbytes" and not fast_cpu_kernel:
            for m in theirs.modules():
                if hasattr(m, "support_avx512bf16_for_cpu"):
                    m.support_avx512bf16_for_cpu = False

        ids = _prompt_ids(directory, config.vocab_size, trust_remote_code).to(dev)
        checks = []
        with torch.no_grad():
            if fmt_name == "bitsandbytes":  # before a forward can repack the weights for the CPU fast path
                checks = _compare_weights(theirs, dense, schemes, matches, fmt_name)
            # W8A8: qkit's side gets the library's own activation rule (exact comparison), then the library
            # is compared with qkit's run-time simulation as well (compressed_tensors_w8a8.simulation_report).
            acts = w8a8.activations_of(qc) if w8a8.is_w8a8(qc) else None
            modules = sorted(n.removesuffix(".weight") for n in dense)
            with w8a8.library_rule(ours, modules) if acts else contextlib.nullcontext():
                ref_logits = ours(ids).logits.float()
            lib_logits = theirs(ids).logits.float()  # compressed-tensors decompresses on this first forward
            if fmt_name == "compressed-tensors":
                checks = _compare_weights(theirs, dense, schemes, matches, fmt_name)
            act_report = w8a8.simulation_report(ours, ids, lib_logits, acts) if acts else None
    scale = float(ref_logits.abs().max())
    rtol = LOGITS_RTOL.get(dtype, 2e-2)
    if fmt_name == "bitsandbytes" and fast_cpu_kernel:
        rtol = LOGITS_RTOL[torch.bfloat16]
    return VerifyResult(
        checkpoint=str(directory), format=fmt_name, library=library, dtype=str(dtype).removeprefix("torch."),
        device=str(dev), prompt_tokens=int(ids.shape[1]),
        logits_max_abs_diff=float((lib_logits - ref_logits).abs().max()), logits_scale=scale,
        logits_tolerance=rtol * max(1.0, scale),
        weight_rule=("bit-identical" if dtype == torch.float32 else f"within one rounding of {dtype}")
        + (f" ({dtype_note})" if dtype_note else ""),
        tensors=checks, activations=act_report,
    )


def _compare_weights(model, dense: dict[str, torch.Tensor], schemes: dict[str, str], matches: dict[str, bool | None],
                     fmt_name: str) -> list[TensorCheck]:
    checks = []
    for name in sorted(dense):
        got = _library_weight(model, name.removesuffix(".weight"), fmt_name).to(dense[name].device)
        diff, bad, same = _within(got, dense[name])
        checks.append(TensorCheck(name, schemes[name], tuple(dense[name].shape), diff, bad, same, matches[name]))
    return checks


def _library_weight(model, module: str, fmt_name: str) -> torch.Tensor:
    """The dense weight the target library computes for ``module``."""
    m = model.get_submodule(module)
    if fmt_name == "bitsandbytes":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state)
    w = getattr(m, "weight", None)
    if w is None or not w.is_floating_point():
        raise ExportError(f"compressed-tensors left {module} compressed after a forward pass; cannot compare it")
    return w.detach()


# --------------------------------------------------------------------------- GGUF


def _is_gguf_export(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "model.gguf").is_file())


def verify_gguf(checkpoint: str | Path, *, device: str | None = None, trust_remote_code: bool = False) -> VerifyResult:
    """``qkit verify`` for a GGUF file (see the module docstring); ``checkpoint``: the file or its OUT directory."""
    from importlib.metadata import version

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qkit.export import gguf as gg

    path = gg.gguf_path(Path(checkpoint))
    dev = parse_device(device)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise InputError(f"{path} is not a readable GGUF file ({str(exc).splitlines()[0][:160]}); re-export it") from exc
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else None
    if arch not in gg.ARCHITECTURES:
        raise InputError(f"{path} is a GGUF of architecture {arch!r}; qkit verify reads the llama and qwen2 files qkit writes")
    where = f"the qkit.export record of {path}"
    try:
        record = gg.read_record(path, reader)
    except (ValueError, UnicodeDecodeError, RecursionError, IndexError, TypeError) as exc:
        raise ExportError(f"{where} is not valid JSON ({' '.join(str(exc).split())[:120]}); "
                          "re-export it with qkit quantize --format gguf") from exc
    entries = {} if record is None else check_export_record(record, where, gg.NAME)
    library = f"gguf {version('gguf')} + transformers {version('transformers')}"
    T = gguf.GGMLQuantizationType
    with _quiet():
        # The library's side first: exactly how a user loads the file. Its config (read from the file) is
        # the one qkit's model is built with, so the two differ in their weights only.
        try:
            theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                          trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises many types for GGUF files it cannot read
            raise ModelLoadError(
                f"transformers could not load {path} ({str(exc).splitlines()[0][:200]}); "
                "check `pip show transformers gguf` against the versions qkit was tested with"
            ) from exc
        theirs.eval().to(dev)
        config = copy.deepcopy(theirs.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        cfg = config.to_dict()
        with _no_init():
            ours = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        hf_names = list(ours.state_dict())
        by_gguf = {v: k for k, v in gg.tensor_names(arch, config.num_hidden_layers, hf_names,
                                                     bool(getattr(config, "tie_word_embeddings", False))).items() if v}
        state, dense, reference, schemes, matches = {}, {}, {}, {}, {}
        for t in reader.tensors:
            hf = by_gguf.get(t.name)
            if hf is None:
                continue  # rope_freqs: a llama.cpp runtime table, not a weight of the model
            heads = gg.permutation_heads(arch, cfg, hf)
            rows = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
            inv = gg.inverse_permutation(rows, heads) if heads else None
            ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            ref = ref.reshape([int(d) for d in reversed(t.shape)])
            if inv is not None:
                ref = ref[inv]
            if t.tensor_type in (T.F32, T.F16, T.BF16):
                state[hf] = ref
                continue
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            if inv is not None:
                raw = raw[inv]
            entry = entries.get(hf)
            if entry is not None:
                scheme, dtype = entry.scheme, entry.dtype
            else:
                scheme, dtype = gg.scheme_for_type(t.tensor_type), torch.float32
            try:
                qt = gg.FORMAT.decode({"qweight": raw}, scheme, dtype)
            except QkitError:
                raise
            except (ValueError, RuntimeError, TypeError, IndexError) as exc:  # a record naming another type
                raise ExportError(f"{where}: {hf} is stored as {t.tensor_type.name}, which does not decode as "
                                  f"{scheme.name} ({' '.join(str(exc).split())[:120]}); re-export it") from exc
            matches[hf] = None if entry is None or entry.sha256 is None else fingerprint(qt) == entry.sha256
            dense[hf] = qt.dequantize(torch.float32)
            reference[hf] = ref
            schemes[hf] = scheme.name
            state[hf] = dense[hf]
        if not dense:
            raise InputError(f"{path} holds no quantized tensor; verify checks quantized exports")
        missing = ours.load_state_dict(state, strict=False).missing_keys
        tied = set(getattr(ours, "_tied_weights_keys", None) or [])
        if [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]:
            raise ModelLoadError(f"{path} lacks tensors of its architecture (missing {missing[:3]}); re-export it")
        ours.tie_weights()
        ours.eval().to(dev)
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code)
            ids = tok(PROMPT, return_tensors="pt")["input_ids"]
            if not ids.numel() or int(ids.max()) >= config.vocab_size:
                raise ValueError("prompt ids outside the vocabulary")
        except Exception:  # no usable tokenizer in the file: fixed ids, as for the other formats
            ids = (torch.arange(24) * 7 + 3).remainder(config.vocab_size).unsqueeze(0)
        ids = ids.to(dev)
        checks = []
        with torch.no_grad():
            for name in sorted(dense):
                lib = theirs.get_parameter(name).detach().float().cpu()
                d1, bad1, same1 = _within(reference[name], dense[name])
                d2, bad2, same2 = _within(lib, dense[name])
                checks.append(TensorCheck(name, schemes[name], tuple(dense[name].shape), max(d1, d2), bad1 + bad2,
                                          same1 and same2, matches[name]))
            ref_logits = ours(ids).logits.float()
            lib_logits = theirs(ids).logits.float()
    scale = float(ref_logits.abs().max())
    rtol = LOGITS_RTOL[torch.float32]
    return VerifyResult(
        checkpoint=str(path), format="gguf", library=library, dtype="float32", device=str(dev),
        prompt_tokens=int(ids.shape[1]), logits_max_abs_diff=float((lib_logits - ref_logits).abs().max()),
        logits_scale=scale, logits_tolerance=rtol * max(1.0, scale),
        weight_rule="bit-identical (qkit, gguf and transformers)", tensors=checks,
    )
