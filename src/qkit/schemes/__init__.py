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
