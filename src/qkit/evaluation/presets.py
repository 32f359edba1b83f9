"""Presets for ``qkit eval --schemes``: the comparisons users bring.

``shipped``: the format each ecosystem actually ships at about 4 bits, plus 8-bit, on the same tokens:
llama.cpp's Q4_K_M and Q8_0, bitsandbytes' NF4, GPTQ int4 groups of 64 as vLLM serves them through
compressed-tensors (groups of 128 do not divide the default model's 576-wide matrices, which vLLM's
kernels and llm-compressor refuse), the two FP4 formats (MXFP4, NVFP4), and int8 per-row weights.
Names that are not registered in this qkit (a format whose module is absent) are refused when used.
"""

from __future__ import annotations

from qkit.evaluation.specs import register_preset

SHIPPED = ("int8-row", "q8_0", "q4_k_m", "nf4", "int4-g64+gptq", "mxfp4", "nvfp4")

register_preset(
    "shipped",
    SHIPPED,
    "what each ecosystem ships: llama.cpp Q8_0 / Q4_K_M, bitsandbytes NF4, GPTQ int4-g64 (vLLM), MXFP4, NVFP4, int8-row",
)
