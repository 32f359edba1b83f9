"""The numerical core: tensors in, tensors out. No I/O, no printing, no device defaults."""

from qkit.schemes.quantized import QuantizedTensor, dequantize, quantize_tensor
from qkit.schemes.registry import (
    DEFAULT_SCHEMES,
    AbsmaxScheme,
    NF4Scheme,
    Scheme,
    get_scheme,
    register,
    scheme_names,
)
from qkit.schemes import fp4 as _fp4  # noqa: E402,F401  registers mxfp4, nvfp4
from qkit.schemes import ggml as _ggml, kquants as _kquants  # noqa: E402,F401  registers q8_0 ... q6_k, q4_k_m

__all__ = [
    "DEFAULT_SCHEMES",
    "AbsmaxScheme",
    "NF4Scheme",
    "QuantizedTensor",
    "Scheme",
    "dequantize",
    "get_scheme",
    "quantize_tensor",
    "register",
    "scheme_names",
]
