"""compressed-tensors ``int-quantized`` W8A8: int8 per-channel weights, dynamic per-token int8 activations.

The layout vLLM serves with its int8 W8A8 kernels (``CompressedTensorsW8A8Int8``) and llm-compressor
writes for its W8A8 recipe. Matched against compressed-tensors 0.20.1 (``compressors/naive_quantized``:
``IntQuantizationCompressor`` stores the quantized weight unpacked; ``quantization/quant_args.py``).
Per quantized linear ``M`` with weight ``[out, in]``, for qkit's ``int8-row`` codes ``q`` and scales:

* ``M.weight`` int8 ``[out, in]``: the codes themselves (qkit's ``qweight``, no offset, no packing);
* ``M.weight_scale`` ``[out, 1]`` in the weights' dtype (as the ``pack-quantized`` exporter: the library
  allocates the scale in the dtype of the weight it replaces; a scale dtype that dtype cannot hold exactly
  is refused).

Config: one group, ``targets: ["Linear"]``, ``weights = {num_bits: 8, type: int, symmetric: true,
strategy: channel, dynamic: false}``, ``input_activations = {num_bits: 8, type: int, symmetric: true,
strategy: token, dynamic: true}``, ``format: int-quantized``; ``ignore`` = the linears left unquantized
(the LM head) and a mixture-of-experts model's routers (``compressed_tensors_moe``: each expert is stored as
a linear). Only ``int8-row`` targets can be written (``quantize_model(..., scheme="int8-row",
format="compressed-tensors", activations="int8-token")``), typically after ``--method smoothquant``.

What runs where. vLLM computes ``s_x = max|x_token| / 127`` per token on the GPU and runs an int8 GEMM
(this is what qkit's ``act-int8-token`` simulation models: ``qkit eval --schemes smoothquant-w8a8``).
transformers on CPU does not run an int8 GEMM: compressed-tensors 0.20.1 decompresses the weight to
``q · weight_scale`` and wraps each quantized linear's forward with a fake-quantization of its input
(``quantization/lifecycle/forward.py`` ``forward_quantize`` -> ``compute_dynamic_scales_and_zp``): per
token ``s = max|x| / 127.5`` (``calculate_qparams``: the symmetric range is ``(127 - (-128)) / 2``),
``x̂ = clamp(round(x / s), -128, 127) · s``, then an fp32 matmul. ``library_fake_quant`` below is that
rule, so ``qkit verify`` can check the library's logits against qkit's weights plus that rule at fp32
tolerance, and report separately how far they are from qkit's own ``act-int8-token`` simulation (the
two grids differ by ``127.5 / 127``: at most one step per activation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from qkit.errors import ExportError, InputError
from qkit.export import compressed_tensors_moe as moe
from qkit.export.common import ModelLayout, SafetensorsFormat, check_scale_in_weight_dtype
from qkit.granularity import PerRow
from qkit.schemes import AbsmaxScheme, QuantizedTensor, Scheme, get_scheme

NAME = "compressed-tensors"
FORMAT_NAME = "int-quantized"
STORED = ("weight", "weight_scale")
INT8_TOKEN = "int8-token"
ACTIVATIONS = (INT8_TOKEN,)

_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
            "dynamic": False}
_INPUT = {INT8_TOKEN: {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
                       "dynamic": True}}


def check_activations(activations: str) -> str:
    key = activations.strip().lower()
    if key not in ACTIVATIONS:
        raise InputError(f"unknown --activations {activations!r}; exports can declare {', '.join(ACTIVATIONS)} "
                         "(dynamic per-token int8, the W8A8 layout vLLM serves)")
    return key


def is_w8a8(quantization_config: dict) -> bool:
    """A compressed-tensors config written by this module (or any single-group int-quantized W8A8)."""
    return quantization_config.get("quant_method") == NAME and quantization_config.get("format") == FORMAT_NAME


def activations_of(quantization_config: dict) -> str | None:
    """``int8-token`` when the config's (single) group quantizes inputs dynamically per token to int8."""
    for g in (quantization_config.get("config_groups") or {}).values():
        a = g.get("input_activations") or {}
        if (a.get("type"), a.get("num_bits"), a.get("strategy"), a.get("dynamic"), a.get("symmetric", True)) == (
                "int", 8, "token", True, True):
            return INT8_TOKEN
    return None


class W8A8Format(SafetensorsFormat):
    """A ``qkit.export.common.Format`` for ``int-quantized`` W8A8 (see the module docstring): not registered
    under a name of its own, it is what ``--format compressed-tensors`` becomes with ``--activations``."""

    name = NAME
    library = "compressed-tensors"
    help = "int8-row weights with int8 per-token activations (W8A8): vLLM"

    def __init__(self, activations: str = INT8_TOKEN) -> None:
        self.activations = check_activations(activations)

    def check(self, layout: ModelLayout) -> None:
        moe.check(layout, NAME)  # the linears, and a mixture-of-experts model's experts and routers
        for tensor, s in sorted(layout.targets.items()):
            if not (isinstance(s, AbsmaxScheme) and s.bits == 8 and isinstance(s.granularity, PerRow)):
                raise ExportError(
                    f"a W8A8 (--activations {self.activations}) export stores int8 per-channel weights, not "
                    f"{s.name} ({tensor}); quantize with --scheme int8-row (after --method smoothquant for accuracy)"
                )
            check_scale_in_weight_dtype(layout, tensor, s.scale_dtype)

    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        rows, cols = qt.shape
        module = name.removesuffix(".weight")
        return {f"{module}.weight": qt.qweight.reshape(rows, cols).to(torch.int8).contiguous(),
                f"{module}.weight_scale": qt.scales.reshape(rows, 1).to(qt.dtype)}

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        if not isinstance(scheme, AbsmaxScheme) or scheme.bits != 8:
            raise ExportError(f"an int-quantized W8A8 module cannot hold {scheme.name}; re-export the checkpoint")
        w = tensors["weight"]
        if w.dtype != torch.int8 or w.dim() != 2:
            raise ExportError(f"an int-quantized weight must be int8 [out, in], got {w.dtype} {list(w.shape)}; re-export")
        stored = tensors["weight_scale"]
        scales = stored.to(scheme.scale_dtype)
        if not torch.equal(scales.to(stored.dtype), stored):
            raise ExportError(f"weight_scale ({stored.dtype}) does not fit {scheme.scale_dtype} exactly; the checkpoint "
                              "was changed after export")
        return QuantizedTensor(scheme, w.contiguous(), scales.reshape(w.shape[0], 1), tuple(w.shape), dtype)

    def infer_scheme(self, quantization_config: dict, module: str, tensors: dict[str, torch.Tensor]) -> Scheme:
        groups = quantization_config.get("config_groups") or {}
        w = (next(iter(groups.values())).get("weights") or {}) if len(groups) == 1 else {}
        if (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("symmetric", True)) != ("int", 8, "channel", True):
            raise ExportError(f"qkit reads int-quantized checkpoints with int8 per-channel symmetric weights, not {w}")
        return get_scheme("int8-row", tensors["weight_scale"].dtype)

    def quantization_config(self, layout: ModelLayout) -> dict:
        return {
            "quant_method": NAME,
            "format": FORMAT_NAME,
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(_WEIGHTS),
                                          "input_activations": dict(_INPUT[self.activations]),
                                          "output_activations": None, "format": FORMAT_NAME}},
            "ignore": moe.ignore(layout),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    # ---- reading a checkpoint back (``qkit verify``)
    def reader(self, quantization_config: dict) -> SafetensorsFormat | None:
        return FORMAT if is_w8a8(quantization_config) else None

    def stored_parts(self, keys: list[str]) -> dict[str, str]:
        """Stored key -> module, for the keys of quantized modules (those with a ``weight_scale``)."""
        modules = {k.removesuffix(".weight_scale") for k in keys if k.endswith(".weight_scale")}
        out = {}
        for k in keys:
            module, _, part = k.rpartition(".")
            if part in STORED and module in modules:
                out[k] = module
        return out

    def activations_of(self, quantization_config: dict) -> str | None:
        return activations_of(quantization_config)

    def library_rule(self, model: torch.nn.Module, modules: list[str]) -> contextlib.AbstractContextManager[None]:
        return library_rule(model, modules)


# --------------------------------------------------------------------------- what the library computes


def library_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors 0.20.1's dynamic per-token symmetric int8 input quantization (see the module doc):
    per row of the last dimension ``s = max|x| / 127.5`` (``0`` -> ``eps``), ``clamp(round(x / s), -128, 127) · s``,
    in ``x``'s dtype."""
    a = x.abs().amax(dim=-1, keepdim=True)
    s = a / torch.tensor(127.5, dtype=x.dtype)
    s = torch.where(s == 0, torch.tensor(torch.finfo(s.dtype).eps, dtype=s.dtype), s)
    return torch.round(x / s).clamp(-128, 127) * s


class LibraryActivations:
    """Install ``library_fake_quant`` on the inputs of the given linears (forward pre-hooks); ``remove()``."""

    def __init__(self, model: torch.nn.Module, modules: list[str]) -> None:
        self.handles = [model.get_submodule(m).register_forward_pre_hook(
            lambda _m, args: (library_fake_quant(args[0]), *args[1:])) for m in modules]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def library_rule(model: torch.nn.Module, modules: list[str]) -> Iterator[None]:
    """``model`` with compressed-tensors' input rule (``library_fake_quant``) on ``modules`` for the block."""
    handle = LibraryActivations(model, modules)
    try:
        yield
    finally:
        handle.remove()


FORMAT = W8A8Format()

__all__ = ["ACTIVATIONS", "FORMAT", "FORMAT_NAME", "INT8_TOKEN", "LibraryActivations", "W8A8Format", "activations_of",
           "check_activations", "is_w8a8", "library_fake_quant", "library_rule"]
