"""Methods: how the integers and scales of a scheme are chosen.

A scheme names the stored format (``int4-g64``, ``nf4``, ``q4_k``); a method decides which codes and
scales go into it. ``rtn`` (round to nearest, today's path) needs nothing but the weight and streams one
tensor at a time. Calibrated methods (``gptq``, ``awq``) and scale-folding transforms (``smoothquant``)
need calibration activations and see the whole model (``imatrix`` collects llama.cpp's importance matrix
and quantizes llama.cpp's block types through their weighted searches); each returns the same ``QuantizedTensor`` objects
RTN returns, so every writer and exporter takes their output unchanged.

A method is registered in ``METHODS`` (``qkit.registry.Registry``) under one name, as a factory of an
object with::

    name: str
    calibrated: bool                       # needs calibration text (recorded in the manifest)
    options_type: type                     # its frozen options dataclass (defaults defined once there)
    check(scheme) -> None                  # raise SchemeError/InputError: it cannot serve this scheme
    memory(model, targets, options)        # {part: bytes} it holds beside the process (qkit.methods.memory)
    run(ref, targets, options, *, device, on_block) -> MethodResult

``run`` gets the resolved model (``qkit.models.ModelRef``), ``targets`` ``{tensor name: scheme}``
(the same plan RTN would quantize), the method's options and a callback ``on_block(done, total)``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qkit.dtypes import load_dtype
from qkit.errors import InputError
from qkit.methods.calibration import DEFAULT_SAMPLES, DEFAULT_SEED, DEFAULT_SEQLEN, CalibrationOptions, fit_seqlen
from qkit.registry import Registry
from qkit.schemes import QuantizedTensor, Scheme

if TYPE_CHECKING:  # annotation only: qkit.models pulls in transformers, which ``import qkit.methods`` need not
    from qkit.methods.calibration import ModelConfig
    from qkit.methods.memory import Model
    from qkit.models import ModelRef

RTN = "rtn"


@dataclass
class MethodResult:
    """What a method produced for one model.

    ``quantized``: every target tensor's ``QuantizedTensor``. ``replaced``: full-precision tensors the
    method changed (AWQ / SmoothQuant fold per-channel scales into a preceding norm or linear); the
    writer stores them instead of the source's. ``record``: JSON-able facts for the manifest and
    ``--json`` (options, calibration text and its sha256, per-layer seconds and errors). ``checked``: see
    below; every quantized tensor is checked once before it is written (``check_written``).
    """

    quantized: dict[str, QuantizedTensor]
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    # tensor -> its relative error against the weight the method quantized (``qkit.schemes.fidelity``),
    # for the tensors the method checked itself: a folded weight (AWQ, SmoothQuant) is not the file's, and
    # a solver has its decoded weights at hand (GPTQ). The writer checks every other against the file's.
    checked: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CalibratedOptions:
    """The calibration fields of every calibrated method's options dataclass (gptq, awq, smoothquant
    extend it): which calibration tokens, as ``CalibrationOptions``' source, samples, seqlen and seed;
    ``dtype``, what the model runs in while it is calibrated (``--dtype``: fp32, bf16, fp16; the weights a
    method quantizes are read from the file in their stored dtype either way); and, for a mixture-of-experts
    model, ``calibrate_all_experts``: every expert computes on every token for its statistics, while each
    layer's output still combines only the router's choice (``qkit.methods.experts``)."""

    calibration: str | None = None  # None: the default mix (catalog.DEFAULT_MIX); a UTF-8 file; hf:DATASET
    calibration_samples: int = DEFAULT_SAMPLES
    # None: DEFAULT_SEQLEN, or the model's context where that is shorter (``fitted``, ``fit_seqlen``)
    calibration_seqlen: int | None = None
    calibration_seed: int = DEFAULT_SEED
    dtype: str = "fp32"
    calibrate_all_experts: bool = False

    def calibration_options(self, config: ModelConfig | None = None) -> CalibrationOptions:
        """The calibration tokens' options (every method's ``check`` calls this: ``dtype`` and
        ``calibrate_all_experts`` are checked here too), with the default window fitted to ``config``'s
        context when a config is given."""
        load_dtype(self.dtype)
        if not isinstance(self.calibrate_all_experts, bool):
            raise InputError(f"calibrate_all_experts must be true or false, got {self.calibrate_all_experts!r}")
        options = CalibrationOptions(self.calibration, self.calibration_samples, self.calibration_seqlen,
                                     self.calibration_seed)
        return options if config is None else options.fitted(config)

    def fitted(self, config: ModelConfig | None) -> CalibratedOptions:
        """These options with the default window fitted to the model (``fit_seqlen``): what a method runs with."""
        return dataclasses.replace(self, calibration_seqlen=fit_seqlen(self.calibration_seqlen, config))

    @property
    def seqlen(self) -> int:
        """Tokens per calibration window: as given or fitted, else ``DEFAULT_SEQLEN`` (memory estimates)."""
        return DEFAULT_SEQLEN if self.calibration_seqlen is None else self.calibration_seqlen

    @property
    def load_dtype(self) -> torch.dtype:
        return load_dtype(self.dtype)

    def fp32_only(self, method: str) -> None:
        """Refuse ``--dtype`` for a method whose search qkit runs in fp32 only."""
        if self.dtype != "fp32":
            raise InputError(f"--dtype {self.dtype}: {method} runs the model in fp32 only (gptq and imatrix take "
                             "--dtype bf16 or fp16); drop --dtype")


class Method(Protocol):
    name: str
    calibrated: bool
    options_type: type

    def check(self, scheme: Scheme) -> None: ...

    def memory(self, model: Model, targets: Mapping[str, Scheme], options: Any) -> dict[str, int]: ...

    def run(
        self,
        ref: ModelRef,
        targets: dict[str, Scheme],
        options: Any,
        *,
        device: torch.device,
        on_block: Callable[[int, int], None] | None = None,
    ) -> MethodResult: ...


def _lazy(module: str) -> Callable[[], Method]:
    """A factory that imports ``module`` on first use (torch-heavy code: ``import qkit`` stays light)."""
    return lambda: importlib.import_module(module).METHOD


# name -> factory; ``rtn``'s factory gives None (the streaming path needs no method object).
METHODS: Registry[Callable[[], Method | None]] = Registry("method", error=InputError)
METHODS.register(RTN, lambda: None)
METHODS.register("gptq", _lazy("qkit.methods.gptq"))
METHODS.register("awq", _lazy("qkit.methods.awq"))
METHODS.register("smoothquant", _lazy("qkit.methods.smoothquant"))
METHODS.register("imatrix", _lazy("qkit.methods.imatrix.method"))


def method_names() -> list[str]:
    """Every method name, ``rtn`` first, in registration order (what help texts list)."""
    return METHODS.names()


def get_method(name: str) -> Method | None:
    """The method called ``name``; ``None`` for ``rtn`` (the streaming path needs no method object)."""
    return METHODS.get(name)()  # an unknown name: the registry's words


def make_options(method: Method, given: Mapping[str, object] | None) -> CalibratedOptions:
    """The method's options dataclass from ``given`` (keys it does not know are refused in one line)."""
    given = dict(given or {})
    known = {f.name for f in dataclasses.fields(method.options_type)}
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise InputError(
            f"method {method.name} takes no option {', '.join(unknown)}; its options are {', '.join(sorted(known))}"
        )
    return method.options_type(**given)


__all__ = ["METHODS", "RTN", "Method", "MethodResult", "get_method", "make_options", "method_names"]
