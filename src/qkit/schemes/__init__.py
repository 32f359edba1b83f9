"""The numerical core: tensors in, tensors out. No I/O, no printing, no device defaults.

Layer 2. ``base`` says what a scheme is (the ``Scheme`` protocol and its optional capabilities);
``registry`` holds the registered ones; one module per family defines and registers its schemes. They
are imported here in the order ``scheme_names()`` lists them (the quality table's first).
"""

from qkit.schemes.base import GGMLCodable, Recipe, Scheme
from qkit.schemes.quantized import QuantizedTensor, dequantize, quantize_tensor
from qkit.schemes.registry import DEFAULT_SCHEMES, get_scheme, register, scheme_names
from qkit.schemes.absmax import AbsmaxScheme  # registers int8-tensor ... int4-g128, int{4,8}-gN
from qkit.schemes.nf4 import NF4Scheme  # registers nf4
from qkit.schemes.fp4 import is_fp4  # registers mxfp4, nvfp4
from qkit.schemes.ggml import GGMLScheme, is_llama_type  # registers q8_0 ... q5_1
from qkit.schemes import kquants as _kquants  # noqa: F401  q4_k, q5_k, q6_k
from qkit.schemes import ggml_weighted as _ggml_weighted  # noqa: F401  q4_0 ... q5_1 with an importance matrix
from qkit.schemes import kquants_low as _kquants_low  # noqa: F401  q2_k, q3_k
from qkit.schemes import iquants as _iquants  # noqa: F401  iq4_nl, iq4_xs
from qkit.schemes import iquants3 as _iquants3  # noqa: F401  iq3_xxs, iq3_s
from qkit.schemes import iquants2 as _iquants2  # noqa: F401  iq2_xxs, iq2_xs, iq2_s
from qkit.schemes import iquants1 as _iquants1  # noqa: F401  iq1_s, iq1_m
from qkit.schemes import tquants as _tquants  # noqa: F401  tq1_0, tq2_0
from qkit.schemes import recipes as _recipes  # noqa: F401  q4_k_m and llama.cpp's other recipes
from qkit.schemes import ggml_observer as _ggml_observer  # noqa: F401  the GPTQ observer of the llama.cpp types

__all__ = [
    "GGMLScheme",
    "DEFAULT_SCHEMES",
    "AbsmaxScheme",
    "GGMLCodable",
    "NF4Scheme",
    "QuantizedTensor",
    "Recipe",
    "Scheme",
    "dequantize",
    "get_scheme",
    "is_fp4",
    "is_llama_type",
    "quantize_tensor",
    "register",
    "scheme_names",
]
