"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv:2210.17323): integers and scales chosen against calibration activations.

Per linear ``W [rows, cols]`` with calibration inputs ``X``: ``H = X Xᵀ`` (fp32), dampened, dead columns
zeroed, ``U`` the upper Cholesky factor of ``H⁻¹``; each column in turn rounded onto the scheme's grid and
its error spread over the columns not yet quantized, in lazy blocks. The result is a ``QuantizedTensor``
of the *same* scheme RTN writes, so every writer and exporter takes it unchanged.

In llm-compressor's split:

* ``solver``: the maths (Hessian, dampening with retries, dead columns, Cholesky factor of the inverse,
  the lazy-block update), tensors in, tensors out;
* ``method``: the lifecycle (calibration, the block walk, one solve per linear, the record), with
  ``errors``: the output errors it records and what rtn would write instead;
* the grids and scale rules are observers of the schemes layer (``qkit.schemes.observers``), which RTN
  can drive too.

The derivation and every numerical choice: docs/gptq.md.
"""

from qkit.methods.gptq.errors import output_error, output_errors, rtn_dequantized
from qkit.methods.gptq.method import METHOD, SCALE_RULES, GPTQMethod, GPTQOptions
from qkit.methods.gptq.solver import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DAMPENING,
    PreparedHessian,
    SolveResult,
    accumulate_gram,
    gptq_solve,
    inverse_hessian_factor,
    prepare_hessian,
    symmetrize,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_DAMPENING", "GPTQMethod", "GPTQOptions", "METHOD", "PreparedHessian",
           "SCALE_RULES", "SolveResult", "accumulate_gram", "gptq_solve", "inverse_hessian_factor", "output_error",
           "output_errors", "prepare_hessian", "rtn_dequantized", "symmetrize"]
