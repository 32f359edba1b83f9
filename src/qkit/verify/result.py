"""What ``qkit verify`` reports, and the rules it holds both sides to (shared by every container's reader).

Weights: ``within(a, b)``: bit-identical in fp32; in fp16/bf16 one rounding step, ``|a - b| <= eps(dtype) * |b|``.
Logits: ``max |a - b| <= LOGITS_RTOL[dtype] * max(1, max |b|)``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from qkit.errors import ModelLoadError

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
    # mixture-of-experts exports: how many of ``tensors`` are expert matrices, each compared with its rows of
    # the library's fused experts (``qkit.verify.experts``)
    experts: int = 0

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

    def failed(self) -> list[str]:
        """The tensors outside the weight rule or whose decode is not what qkit wrote, in name order."""
        return [t.name for t in self.tensors if t.mismatched or t.matches_export is False]

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint, "format": self.format, "library": self.library, "dtype": self.dtype,
            "device": self.device, "prompt_tokens": self.prompt_tokens, "weight_rule": self.weight_rule,
            "logits_max_abs_diff": self.logits_max_abs_diff, "logits_scale": self.logits_scale,
            "logits_tolerance": self.logits_tolerance, "weights_ok": self.weights_ok, "logits_ok": self.logits_ok,
            "passed": self.passed, "by_scheme": self.by_scheme(), "tensors": [t.to_dict() for t in self.tensors],
            **({"activations": self.activations} if self.activations is not None else {}),
            **({"experts": self.experts} if self.experts else {}),
        }


def within(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, bool]:
    """``(max |a-b|, elements outside the rule, bit-identical)`` of tensors of one shape; the rule is in the module
    docstring (``b``'s dtype chooses it)."""
    identical = torch.equal(a, b)
    if identical:
        return 0.0, 0, True
    diff = (a.float() - b.float()).abs()
    if b.dtype == torch.float32:
        bad = int((diff > 0).sum())
    else:
        bad = int((diff > torch.finfo(b.dtype).eps * b.float().abs()).sum())
    return float(diff.max()), bad, False


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device,
                 refusal: Callable[[list[str]], str]) -> None:
    """Load ``state`` into ``model`` (tied weights re-tied), put it in eval mode on ``device``.

    A weight the state lacks, other than a tied one or the LM head (re-tied to the embedding), is a
    ``ModelLoadError`` whose line is ``refusal(missing keys)``."""
    missing = model.load_state_dict(state, strict=False).missing_keys
    tied = set(getattr(model, "_tied_weights_keys", None) or [])  # transformers' attribute, absent on some classes
    if [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]:
        raise ModelLoadError(refusal(missing))
    model.tie_weights()
    model.eval().to(device)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Loading draws tqdm bars (compressed-tensors) and logs a kernel warning (bitsandbytes) on stderr.

    tqdm reads ``TQDM_DISABLE`` only when it is first imported, so stderr is captured instead; errors still
    propagate as exceptions.
    """
    from transformers.utils import logging as hf_logging  # heavy: only a verification loads transformers

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def no_init() -> contextlib.AbstractContextManager:
    """Skip the random initialisation of a model whose every weight is loaded next (it would cost seconds)."""
    try:
        from transformers.initialization import no_init_weights  # heavy, as above
    except ImportError:  # older transformers: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


__all__ = ["LOGITS_RTOL", "PROMPT", "TensorCheck", "VerifyResult", "load_weights", "no_init", "quiet", "within"]
