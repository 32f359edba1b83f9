"""qkit: quantize the weights of language models and measure, honestly, what it cost.

Library first: every CLI command is a plain function here, called with keyword arguments.
"""

from qkit.schemes import (
    QuantizedTensor,
    dequantize,
    get_scheme,
    quantize_tensor,
    scheme_names,
)
from qkit.version import __version__


def __getattr__(name: str):
    # ``load`` and ``quantize_model`` pull in transformers (seconds to import); import them on first use
    # so that ``qkit --help`` and the numerical core stay fast.
    if name in ("load", "quantize_model"):
        from qkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'qkit' has no attribute {name!r}")

__all__ = [
    "QuantizedTensor",
    "__version__",
    "dequantize",
    "get_scheme",
    "load",
    "quantize_model",
    "quantize_tensor",
    "scheme_names",
]
