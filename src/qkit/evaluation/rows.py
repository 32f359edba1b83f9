"""The named eval rows and presets: every name ``qkit eval --schemes`` knows besides a scheme's.

Layer 6 (``evaluation``): rows are values (``RowSpec``), registered here into ``specs.ROWS`` and
``specs.PRESETS``; adding a row adds an entry, never an ``if`` in the runner. The simulations they name
are registered in ``qkit.simulate`` (layer 5, below), the methods in ``qkit.methods``.

Rows for the run-time simulations, and the ``activations`` preset:

=====================  ==============  ===========  =================================================
row                    weights         method       run time
=====================  ==============  ===========  =================================================
``w8a8-tensor``        int8-row        rtn          int8 activations, one dynamic scale per forward
``w8a8-token``         int8-row        rtn          int8 activations, one dynamic scale per token
``w8a8-static``        int8-row        rtn          int8 activations, one static scale per linear
``llm-int8``           int8-row        rtn          LLM.int8: outlier columns (|x| >= 6) in 16-bit
``smoothquant-w8a8``   int8-row        smoothquant  int8 activations per token, after folding
``kv-int8``            full precision  -            KV cache int8, keys and values per token
``kv-int8-channel``    full precision  -            KV cache int8, keys per channel (KIVI), values per token
``kv-int4``            full precision  -            KV cache int4, keys per channel (KIVI), values per token
``kv-int4-token``      full precision  -            KV cache int4, keys and values per token
=====================  ==============  ===========  =================================================

(``kv-int8-token`` and ``kv-int4-channel`` name the same rows as ``kv-int8`` and ``kv-int4``.) Why
``kv-int8`` is per token and ``kv-int4`` is KIVI's layout: at 8 bits a per-token scale is the simple
layout serving stacks use; at 4 bits KIVI (arXiv:2402.02750) shows keys need per-channel scales because
a few key channels are consistently large, so each name gets its layout's better-known form and the
other form is one suffix away.

A row's method is validated when the row runs (``smoothquant`` comes from ``qkit.methods.smoothquant``),
so registering it never fails when a method is missing.

Presets: ``activations`` (above) and ``shipped``: the format each ecosystem actually ships at about 4
bits, plus 8-bit, on the same tokens: llama.cpp's Q4_K_M and Q8_0, bitsandbytes' NF4, GPTQ int4 groups
of 64 as vLLM serves them through compressed-tensors (groups of 128 do not divide the default model's
576-wide matrices, which vLLM's kernels and llm-compressor refuse), the two FP4 formats (MXFP4, NVFP4),
and int8 per-row weights. A preset's names are resolved when it is used, so a member that names nothing
registered is refused then, in one line.
"""

from __future__ import annotations

from qkit.evaluation.specs import RowSpec, register_preset, register_row

INT8_ROW = "int8-row"

SIMULATION_ROWS: dict[str, tuple[RowSpec, str]] = {
    "w8a8-tensor": (RowSpec(INT8_ROW, simulation=("act-int8-tensor",)), "int8-row weights, int8 activations with one dynamic scale per forward"),
    "w8a8-token": (RowSpec(INT8_ROW, simulation=("act-int8-token",)), "int8-row weights, int8 activations with one dynamic scale per token"),
    "w8a8-static": (RowSpec(INT8_ROW, simulation=("act-int8-static",)), "int8-row weights, int8 activations with one calibrated scale per linear"),
    "llm-int8": (RowSpec(INT8_ROW, simulation=("llm-int8",)), "LLM.int8: int8-row weights, int8 per-token activations, outlier columns in 16-bit"),
    "smoothquant-w8a8": (RowSpec(INT8_ROW, "smoothquant", ("act-int8-token",)), "SmoothQuant folding, int8-row weights, int8 per-token activations"),
    "kv-int8": (RowSpec(None, simulation=("kv-int8-token",)), "full-precision weights, int8 KV cache, one scale per token and head"),
    "kv-int8-channel": (RowSpec(None, simulation=("kv-int8-channel",)), "full-precision weights, int8 KV cache, keys per channel (KIVI), values per token"),
    "kv-int4": (RowSpec(None, simulation=("kv-int4-channel",)), "full-precision weights, int4 KV cache, keys per channel (KIVI), values per token"),
    "kv-int4-token": (RowSpec(None, simulation=("kv-int4-token",)), "full-precision weights, int4 KV cache, one scale per token and head"),
    "kv-int8-token": (RowSpec(None, simulation=("kv-int8-token",)), "the same as kv-int8"),
    "kv-int4-channel": (RowSpec(None, simulation=("kv-int4-channel",)), "the same as kv-int4"),
}

ACTIVATIONS_PRESET = (
    INT8_ROW, "w8a8-tensor", "w8a8-token", "llm-int8", "smoothquant-w8a8", "kv-int8", "kv-int8-channel", "kv-int4", "kv-int4-token",
)

SHIPPED = ("int8-row", "q8_0", "q4_k_m", "nf4", "int4-g64+gptq", "mxfp4", "nvfp4")

# llama.cpp's ladder as llama-quantize writes it (its recipes, llama_tensor_get_type), from the smallest up,
# each without and with the importance matrix (collected from the calibration text, never the eval text);
# q8_0 only without: llama.cpp's q8_0 quantizer reads no importance matrix (quantize_q8_0 ignores it).
GGUF_LADDER = ("q2_k-llama", "q3_k_s", "q3_k_m", "q3_k_l", "iq4_xs-llama", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
               "q6_k", "q8_0")
GGUF_PRESET = tuple(n for step in GGUF_LADDER for n in ((step,) if step == "q8_0" else (step, f"{step}+imatrix")))

for _name, (_spec, _description) in SIMULATION_ROWS.items():
    register_row(_name, _spec, _description)
register_preset("activations", ACTIVATIONS_PRESET,
                "weight-only int8-row, W8A8 per tensor and per token, LLM.int8, SmoothQuant W8A8, KV int8 and int4 in both layouts")
register_preset(
    "shipped",
    SHIPPED,
    "what each ecosystem ships: llama.cpp Q8_0 / Q4_K_M, bitsandbytes NF4, GPTQ int4-g64 (vLLM), MXFP4, NVFP4, int8-row",
)

register_preset(
    "gguf",
    GGUF_PRESET,
    "llama.cpp's ladder as llama-quantize writes it, q2_k to q8_0 and iq4_xs, each without and with the importance matrix "
    "(q8_0 reads none)",
)

# The frontier: each ladder step beside the planned mix at that step's own bytes (plan:gguf@STEP, paired
# against STEP's row); with the importance matrix, both sides with the same one.
FRONTIER_GGUF = tuple(n for step in GGUF_LADDER for n in (step, f"plan:gguf@{step}"))
FRONTIER_GGUF_IMATRIX = tuple(n for step in GGUF_LADDER if step != "q8_0"
                              for n in (f"{step}+imatrix", f"plan:gguf@{step}+imatrix"))
register_preset("frontier-gguf", FRONTIER_GGUF,
                "every llama.cpp ladder step beside a planned GGUF of the same bytes (qkit plan), paired against it")
register_preset("frontier-gguf-imatrix", FRONTIER_GGUF_IMATRIX,
                "the frontier with the importance matrix on both sides: each step+imatrix beside its planned mix+imatrix")
# compressed-tensors' uniform types (candidates.CT_TYPES) by their bytes, each beside the planned mix that
# gets that type's stored bytes in compressed-tensors (plan:ct@STEP, paired against STEP's row).
CT_LADDER = ("int4-row", "int4-g128", "mxfp4", "int4-g64", "nvfp4", "int4-g32", "int8-row")
FRONTIER_CT = tuple(n for step in CT_LADDER for n in (step, f"plan:ct@{step}"))
register_preset("frontier-ct", FRONTIER_CT,
                "every compressed-tensors type beside a planned compressed-tensors mix of the same stored bytes, paired against it")

__all__ = ["ACTIVATIONS_PRESET", "CT_LADDER", "FRONTIER_CT", "FRONTIER_GGUF", "FRONTIER_GGUF_IMATRIX", "GGUF_LADDER", "GGUF_PRESET", "SHIPPED",
           "SIMULATION_ROWS"]
