"""``PlanOptions``: what a plan plans (the format, the budget, the candidates, the calibration) and how it
is run (the method, the importance matrix, the device, the executor), every default defined once.

Apart from ``planner`` (the steps), which reads it; ``qkit.api.plan_model`` takes one value of it, as
``quantize_model`` takes one ``QuantizeOptions``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from qkit.bounds import real, show_number
from qkit.dtypes import load_dtype
from qkit.errors import InputError
from qkit.executors import SERIAL, ExecutorOptions
from qkit.memory import check_bytes
from qkit.methods import RTN, get_method
from qkit.methods.calibration import CalibrationOptions, fit_seqlen
from qkit.methods.gptq.method import GPTQMethod, GPTQOptions
from qkit.methods.imatrix.method import ImatrixMethod
from qkit.models import parse_device
from qkit.plan.candidates import check_format, parse_allowed, plan_format
from qkit.schemes import get_scheme
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE

MAX_TARGET_BITS = 64  # --target-bits: no stored type takes more bits per weight
# Defaults, defined once. 8 windows of 512 tokens: the Fisher's noise averaged over ~4k positions; the
# check measures the mix on the first 4 of them (their reference log-probabilities kept from step 3).
DEFAULT_SAMPLES = 8
DEFAULT_SEQLEN = 512
DEFAULT_CHECK_WINDOWS = 4
# The dtypes the model may be loaded in for the Fisher (--dtype); its diagonal is float32 whatever this is.
DEFAULT_DTYPE = "fp32"


@dataclass(frozen=True)
class PlanOptions:
    """What ``qkit.api.plan_model`` plans: ``format`` (gguf, compressed-tensors, qkit); exactly one of
    ``target_bits`` (bits per weight over the planned tensors), ``target_size`` (the whole file's tensor bytes)
    and ``target_scheme`` (those of the file that scheme writes; ``qkit.plan.budget``);
    ``candidates`` the types allowed (default: the format's whole ladder); ``include``/``exclude``
    which tensors (``qkit.transform.Rules``); ``calibration`` the text, ``samples`` windows of
    ``seqlen`` tokens chosen with ``seed``, ``check_windows`` of them measured for the check; ``dtype``
    the model is loaded in for the Fisher (fp32, bf16, fp16; the diagonal is float32 either way);
    ``max_memory`` the bytes the plan may peak at (None: a default from the memory available): refused
    before the model loads when one block's Fisher does not fit, and deciding how many whole-model passes
    the targets outside the blocks take, never the plan.

    How the plan is run (``qkit.api.plan_model``): ``method`` ``rtn``, ``imatrix`` (collect the importance
    matrix as ``qkit imatrix`` does; llama.cpp's types are then measured through their weighted searches)
    or ``gptq`` (the candidates priced for the codes ``--method gptq`` writes, ``qkit.plan.feedback``, with
    ``gptq_options``, default ``GPTQOptions()``); ``imatrix`` such a file instead of collecting one;
    ``emit_tensor_types`` where to write, for GGUF, the ``llama-quantize --tensor-type-file`` that gives
    every tensor its planned type; ``device`` where the model runs; ``trust_remote_code`` /
    ``allow_pickle`` what the model may run; ``force`` replace an output qkit wrote; ``executor``
    (``qkit.executors``) where the per-tensor candidate costs run. A plan made first by a quantize
    (``QuantizeOptions.plan``) takes the quantize's method, importance matrix and device instead."""

    format: str = "qkit"
    target_bits: float | None = None
    target_size: int | None = None
    target_scheme: str | None = None  # the bytes of the file this scheme (a recipe such as q4_k_m: its whole file) writes
    candidates: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    calibration: str | None = None
    samples: int = DEFAULT_SAMPLES
    seqlen: int | None = None  # None: DEFAULT_SEQLEN, or the model's context where shorter (``fitted``)
    seed: int = 0
    check_windows: int | None = None  # None: DEFAULT_CHECK_WINDOWS, or every window where there are fewer
    dtype: str = DEFAULT_DTYPE
    max_memory: int | None = None
    # how the plan is run (plan_model): every default here, once
    method: str = RTN
    imatrix: str | None = None
    emit_tensor_types: str | Path | None = None
    device: str | None = "cpu"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    force: bool = False
    gptq_options: GPTQOptions | None = None
    executor: ExecutorOptions = ExecutorOptions()

    def check(self) -> None:
        check_format(self.format)
        load_dtype(self.dtype)
        if self.max_memory is not None and not (isinstance(self.max_memory, int) and not isinstance(self.max_memory, bool)
                                                and self.max_memory > 0):
            raise InputError(f"--max-memory must be a positive number of bytes, got {self.max_memory!r}")
        if sum(t is not None for t in (self.target_bits, self.target_size, self.target_scheme)) != 1:
            raise InputError("give exactly one of --target-bits B (bits per weight), --target-size SIZE (bytes, e.g. 100MB) and "
                             "--target-scheme SCHEME (the bytes that scheme stores for the same tensors, e.g. q4_k_m)")
        if self.target_bits is not None and not (isinstance(self.target_bits, (int, float)) and math.isfinite(self.target_bits)
                                                 and self.target_bits > 0):
            raise InputError(f"--target-bits must be a positive number, got {self.target_bits!r}")
        if self.target_bits is not None:  # no format stores more than 64 bits per weight (fp32 with scales is far less)
            real(self.target_bits, "--target-bits", 0, MAX_TARGET_BITS, above=True)
        if self.target_size is not None and not (isinstance(self.target_size, int) and self.target_size > 0):
            raise InputError(f"--target-size must be a positive number of bytes, got {self.target_size!r}")
        if self.target_size is not None:
            check_bytes(self.target_size, "--target-size")
        if self.max_memory is not None:
            check_bytes(self.max_memory, "--max-memory")
        if self.target_scheme is not None:
            get_scheme(self.target_scheme)  # an unknown name: refused with "did you mean"
        self.calibration_options().check()  # the windows first: --check-windows is bounded by them
        if self.check_windows is not None and not (isinstance(self.check_windows, int)
                                                   and 0 <= self.check_windows <= self.samples):
            raise InputError(f"--check-windows must be between 0 and --calibration-samples ({show_number(self.samples)}), "
                             f"got {show_number(self.check_windows)}")
        parse_allowed(self.format, self.candidates) if self.candidates else None
        self.check_run()

    def check_run(self) -> None:
        """How the plan is run, checked before any work: the executor (Ray installed, its address answering)
        and its device, the method (rtn, imatrix or gptq), the importance matrix against the format's types,
        ``emit_tensor_types`` against the format."""
        self.executor.validate()  # an unknown executor, Ray not installed, a --ray-address nothing answers at
        if self.executor.name != SERIAL and parse_device(self.device).type != "cpu":
            raise InputError(f"--executor {self.executor.name} costs the candidates in CPU worker processes; pass --device cpu "
                             "or drop --executor")
        fmt = plan_format(self.format)  # a format that cannot mix types: refused here
        found = get_method(self.method)
        if found is not None and not self.collects and not isinstance(found, GPTQMethod):
            raise InputError(f"qkit plan measures candidates by rtn, the importance matrix (--method imatrix / --imatrix) or "
                             f"gptq; {self.method} chooses codes per type and is not planned: quantize a plan's types with it instead")
        llama = [isinstance(get_scheme(n), GGMLScheme) for n in fmt.plan_types()]  # which planned types are llama.cpp's
        if (self.imatrix is not None or self.collects) and not any(llama):
            raise InputError("the importance matrix weights llama.cpp's types; plan --format gguf or qkit with it")
        if self.imatrix is not None and self.collects:
            raise InputError("--imatrix FILE and --method imatrix both give the matrix: drop one of them")
        if self.emit_tensor_types is not None and not all(llama):
            raise InputError("--emit-tensor-types writes llama-quantize's --tensor-type-file: plan --format gguf")

    @property
    def collects(self) -> bool:
        """Whether the plan collects the importance matrix first (``method`` ``imatrix``)."""
        return isinstance(get_method(self.method), ImatrixMethod)

    @property
    def gptq(self) -> GPTQOptions | None:
        """The GPTQ options a ``gptq`` plan prices its candidates for (``gptq_options``, default
        ``GPTQOptions()``, what ``--method gptq`` uses by default); None for another method."""
        return (self.gptq_options or GPTQOptions()) if isinstance(get_method(self.method), GPTQMethod) else None

    @property
    def windows_checked(self) -> int:
        """``check_windows`` as given, else ``DEFAULT_CHECK_WINDOWS`` or all ``samples`` where fewer."""
        return min(DEFAULT_CHECK_WINDOWS, self.samples) if self.check_windows is None else self.check_windows

    @property
    def window(self) -> int:
        """Tokens per window: ``seqlen`` as given or fitted, else ``DEFAULT_SEQLEN``."""
        return DEFAULT_SEQLEN if self.seqlen is None else self.seqlen

    def fitted(self, config: Mapping[str, object] | None) -> PlanOptions:
        """These options with the default window fitted to the model's context (``fit_seqlen``)."""
        return dataclasses.replace(self, seqlen=fit_seqlen(self.seqlen, config))

    def calibration_options(self) -> CalibrationOptions:
        return CalibrationOptions(self.calibration, self.samples, self.seqlen, self.seed)

    def target(self) -> dict:
        if self.target_scheme is not None:
            return {"scheme": self.target_scheme}
        return {"bits": self.target_bits} if self.target_bits is not None else {"size": self.target_size}
