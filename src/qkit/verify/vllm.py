"""``qkit verify --runtime vllm``: does a serving engine compute what qkit means by a compressed-tensors export?

qkit's side is ``qkit verify``'s (``qkit.verify``): every quantized module's stored tensors read back by
qkit (``Format.decode``), checked against the sha256 recorded at export, dequantized by qkit into a plain
transformers model in the checkpoint's dtype; for a W8A8 export, qkit's ``act-int8-token`` simulation on its
inputs (``max|x| / 127`` per token: the rule of vLLM's int8 kernels). The engine's side is the engine
loading the directory as a user serves it and scoring the same fixed prompt.

vLLM returns the top ``k`` log-probabilities per position (``prompt_logprobs``), not logits, so what is
compared is log-probabilities at the engine's own top-``k`` ids, position by position::

    max_abs_diff = max_t,j |lp_engine(t, id_tj) - lp_qkit(t, id_tj)|      (j < k: the engine's top-k ids)

Rules. Weight-only exports (and the unquantized weights): ``max_abs_diff <= 2 * LOGITS_RTOL[dtype] *
max(1, max |logit|)``: the logits rule of ``qkit verify`` (a log-softmax moves by at most twice the largest
logit difference). W8A8: the engine and qkit round the same activations on the same grid, but an activation
that lands within an accumulation error of a rounding boundary rounds the other way; the bound is then the one
``qkit verify`` states for a library against qkit's simulation: ``SIMULATION_FACTOR`` x the effect of the
activation quantization itself (``max |lp(simulated W8A8) - lp(W8A16)|`` at the same ids). The top-1 token at
every position is reported beside (a near-tie may differ without either side being wrong).

``verify_in_vllm`` runs vLLM through its eval engine (``qkit.evaluation.engines.vllm``: the same worker
subprocess ``qkit eval --runtime vllm`` scores rows in); ``verify_engine`` takes the engine as a ``score``
function, so any engine (or a test's stand-in) is compared by the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkit.errors import InputError, ModelLoadError
from qkit.evaluation.engines.base import EngineJob, EngineOptions
from qkit.evaluation.engines.vllm import ENGINE, check_readable
from qkit.export.common import read_export_manifest
from qkit.models import check_remote_code
from qkit.schemes import QuantizedTensor
from qkit.simulate import apply_simulation
from qkit.verify.activations import SIMULATION, SIMULATION_FACTOR
from qkit.verify.result import LOGITS_RTOL, load_weights, no_init, quiet
from qkit.verify.safetensors import _prompt_ids, iter_decoded, read_format


@dataclass
class EngineLogprobs:
    """What the engine measured on the prompt ``ids`` (``[n]``): int64 / float32 ``[n-1, k]`` top ids and
    their log-probabilities at positions predicting tokens 1..n-1, int64 ``[n-1]`` argmax; its version."""

    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    argmax: torch.Tensor
    version: str = ""
    notes: list[str] = field(default_factory=list)


Score = Callable[[Path, torch.Tensor], EngineLogprobs]


@dataclass
class EngineVerifyResult:
    checkpoint: str
    format: str
    engine: str  # "vLLM 0.32.0"
    dtype: str
    prompt_tokens: int
    top_k: int
    max_abs_diff: float  # over every position and the engine's top-k ids
    tolerance: float
    rule: str
    top1_same: int  # positions where the engine's argmax is qkit's
    positions: int
    activations: str | None = None  # the W8A8 rule compared against ("act-int8-token"), or None
    activation_effect: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "format": self.format, "engine": self.engine, "dtype": self.dtype,
                "prompt_tokens": self.prompt_tokens, "top_k": self.top_k, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance, "rule": self.rule, "top1_same": self.top1_same,
                "positions": self.positions, "activations": self.activations,
                "activation_effect": self.activation_effect, "notes": list(self.notes), "passed": self.passed}


def _qkit_model(directory: Path, trust_remote_code: bool):
    """qkit's reading of the export: a transformers model holding qkit's dequantized weights, its dtype."""
    from transformers import (  # heavy: only verification loads it
        AutoConfig,
        AutoModelForCausalLM,
    )

    fmt, qc = read_format(directory)
    entries = read_export_manifest(directory, fmt.name)
    with quiet():
        try:
            config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises many types
            raise ModelLoadError(f"transformers cannot read the config of {directory} "
                                 f"({' '.join(str(exc).split())[:200]}); re-export it") from exc
        del config.quantization_config
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state, mismatched = {}, []
        for name, value, match in iter_decoded(directory, entries):
            if isinstance(value, QuantizedTensor):
                if match is False:
                    mismatched.append(name)
                value = value.dequantize(dtype)
            state[name] = value
        if mismatched:
            raise InputError(f"{directory}: {mismatched[0]} does not decode to what qkit wrote (sha256 in the export "
                             "record); run qkit verify without --runtime for the details")
        with no_init():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        load_weights(model, state, torch.device("cpu"),
                     lambda missing: f"{directory} does not match its config (missing {missing[:3]}); re-export it")
    return model.eval(), fmt, qc, dtype, config


def verify_engine(checkpoint: str | Path, score: Score, *, engine: str = "vLLM",
                  trust_remote_code: bool = False) -> EngineVerifyResult:
    """Score the fixed prompt with ``score(directory, ids)`` (the engine) and with qkit's reading of the
    export; compare as the module docstring says. ``InputError`` for a directory that is not an export."""
    directory = Path(checkpoint)
    check_remote_code(directory, str(checkpoint), trust_remote_code)
    model, fmt, qc, dtype, config = _qkit_model(directory, trust_remote_code)
    ids = _prompt_ids(directory, config.vocab_size, trust_remote_code)[0]
    measured = score(directory, ids)  # refusals (EngineRefused) go up to the caller as they are
    acts = fmt.activations_of(qc)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
        if acts:
            with apply_simulation(model, [SIMULATION[acts]]):
                simulated = model(ids[None]).logits[0, :-1].float()
    lp_weights = torch.log_softmax(logits.double(), -1)
    lp = torch.log_softmax(simulated.double(), -1) if acts else lp_weights
    top_ids = measured.top_ids.long()
    if top_ids.shape[0] != lp.shape[0]:
        raise InputError(f"the engine scored {top_ids.shape[0]} positions of the {ids.numel()}-token prompt; "
                         f"qkit {lp.shape[0]}")
    ours = lp.gather(1, top_ids)
    diff = float((measured.top_logprobs.double() - ours).abs().max())
    scale = float(logits.abs().max())
    rtol = LOGITS_RTOL.get(dtype, 2e-2)
    effect = None
    if acts:
        effect = float((lp.gather(1, top_ids) - lp_weights.gather(1, top_ids)).abs().max())
        tolerance = max(SIMULATION_FACTOR * effect, 2 * rtol * max(1.0, scale))
        rule = (f"W8A8: within {SIMULATION_FACTOR:g} x the activation quantization's own effect on these "
                f"log-probabilities ({effect:.3g}), against qkit's {SIMULATION[acts]}")
    else:
        tolerance = 2 * rtol * max(1.0, scale)
        rule = f"within 2 x {rtol:g} x max(1, max |logit| = {scale:.3g})"
    same = int((measured.argmax.long() == lp.argmax(-1)).sum())
    return EngineVerifyResult(
        checkpoint=str(directory), format=fmt.name, engine=f"{engine} {measured.version}".strip(),
        dtype=str(dtype).removeprefix("torch."), prompt_tokens=int(ids.numel()), top_k=int(top_ids.shape[1]),
        max_abs_diff=diff, tolerance=tolerance, rule=rule, top1_same=same, positions=int(lp.shape[0]),
        activations=SIMULATION[acts] if acts else None, activation_effect=effect, notes=list(measured.notes),
    )


def verify_in_vllm(checkpoint: str | Path, options: EngineOptions | None = None, *,
                   trust_remote_code: bool = False) -> EngineVerifyResult:
    """``qkit verify --runtime vllm CHECKPOINT``: vLLM scores the fixed prompt from the export directory and
    ``verify_engine`` compares it with qkit's reading of the same files. Refused in one line before anything
    loads: vLLM not installed, more devices than exist, a directory vLLM cannot read; ``EngineRefused`` for
    what vLLM itself refuses."""
    options = options or EngineOptions()
    options.validate()
    ENGINE.check_available(options)
    check_readable(Path(checkpoint))

    def score(directory: Path, ids: torch.Tensor) -> EngineLogprobs:
        job = EngineJob(windows=[ids], battery_prompts=[], battery_tokens=1, repetition_penalty=1.0,
                        agreement_inputs=[], agreement_n=0)
        s = ENGINE.run(directory, job, options)
        return EngineLogprobs(s.top_ids[0], s.top_logprobs[0], s.argmax[0], s.version, s.notes)

    return verify_engine(checkpoint, score, engine="vLLM", trust_remote_code=trust_remote_code)


__all__ = ["EngineLogprobs", "EngineVerifyResult", "Score", "verify_engine", "verify_in_vllm"]
