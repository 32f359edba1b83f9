"""qkit: quantize the weights of language models and measure, honestly, what it cost.

Library first: every CLI command is a plain function here, called with keyword arguments.
"""

from qkit.version import __version__

# Imported on first use, not here: the schemes pull in torch and ``load`` / ``quantize_model``
# transformers (seconds to import), and ``python -m qkit`` imports this package before its entry point
# can set up Ctrl-C handling (``qkit.__main__``), so ``import qkit`` imports nothing heavy.
_SCHEMES = ("QuantizedTensor", "dequantize", "get_scheme", "quantize_tensor", "scheme_names")


def __getattr__(name: str):
    if name in _SCHEMES:
        from qkit import schemes

        return getattr(schemes, name)
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
