"""``qkit verify`` of a GGUF file (``FILE.gguf``, or the OUT directory holding ``model.gguf``).

qkit reads each quantized tensor's block bytes, undoes llama.cpp's q/k row permutation and checks them
against the sha256 of the file's ``qkit.export`` record; each tensor is then dequantized by qkit's scheme,
by the ``gguf`` package (``gguf.quants.dequantize``) and by transformers' loader (``gguf_file=``): all
three must be bit-identical in fp32, and the two models' logits agree within the fp32 rule.
"""

from __future__ import annotations

import copy
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch

from qkit.errors import ExportError, InputError, ModelLoadError, QkitError
from qkit.export import gguf as gg
from qkit.export.common import check_export_record, fingerprint
from qkit.models import parse_device
from qkit.verify.result import LOGITS_RTOL, PROMPT, TensorCheck, VerifyResult
from qkit.verify.result import load_weights, no_init, quiet, within  # the rules and loading helpers


def verify_gguf(checkpoint: str | Path, *, device: str | None = None, fast_cpu_kernel: bool = False,
                trust_remote_code: bool = False) -> VerifyResult:
    """``qkit verify`` for a GGUF file (see ``qkit.verify``); ``checkpoint``: the file or its OUT directory.

    ``fast_cpu_kernel`` does not apply (the comparison runs in fp32 through transformers' own GGUF loader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only a verification loads transformers

    path = gg.gguf_path(Path(checkpoint))
    dev = parse_device(device)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise InputError(f"{path} is not a readable GGUF file ({str(exc).splitlines()[0][:160]}); re-export it") from exc
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else None
    if arch not in gg.ARCHITECTURES:
        raise InputError(f"{path} is a GGUF of architecture {arch!r}; qkit verify reads the llama and qwen2 files qkit's "
                         "own GGUF writer writes (a file written through llama.cpp's converter, such as a mixture-of-"
                         "experts model's, is not verified)")
    experts = reader.fields.get(f"{arch}.expert_count")
    if experts is not None and int(experts.parts[-1][0]) > 1:  # mixtral: llama.cpp converts it as a llama model
        raise InputError(f"{path} is a {arch} GGUF with {int(experts.parts[-1][0])} experts per layer (a mixture-of-"
                         "experts model, written through llama.cpp's converter); transformers' GGUF loader builds a "
                         "dense llama from it, so qkit verify cannot compare it")
    where = f"the qkit.export record of {path}"
    try:
        record = gg.read_record(path, reader)
    except (ValueError, UnicodeDecodeError, RecursionError, IndexError, TypeError) as exc:
        raise ExportError(f"{where} is not valid JSON ({' '.join(str(exc).split())[:120]}); "
                          "re-export it with qkit quantize --format gguf") from exc
    entries = {} if record is None else check_export_record(record, where, gg.NAME)
    library = f"gguf {version('gguf')} + transformers {version('transformers')}"
    T = gguf.GGMLQuantizationType
    with quiet():
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
        with no_init():
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
        load_weights(ours, state, dev,
                     lambda missing: f"{path} lacks tensors of its architecture (missing {missing[:3]}); re-export it")
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
                d1, bad1, same1 = within(reference[name], dense[name])
                d2, bad2, same2 = within(lib, dense[name])
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


__all__ = ["verify_gguf"]
