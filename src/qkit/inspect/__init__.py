"""``qkit inspect``: what quantization throws away (weights), where the outliers sit (activations),
which matrices' errors move the output (sensitivity), and the next-token distribution (soft labels).

Every analysis is a plain function; ``qkit.cli`` renders its report.
"""

from qkit.inspect.errors import ErrorsReport, MatrixReport, inspect_matrix, top_matrices, weight_errors
from qkit.inspect.matrix_stats import MatrixStats
from qkit.inspect.nexttoken import NextTokenReport, next_token
from qkit.inspect.outliers import OutliersReport, analyse_hidden, residual_outliers
from qkit.inspect.sensitivity import SensitivityReport, rank_sensitivity

__all__ = [
    "ErrorsReport",
    "MatrixReport",
    "MatrixStats",
    "NextTokenReport",
    "OutliersReport",
    "SensitivityReport",
    "analyse_hidden",
    "inspect_matrix",
    "next_token",
    "rank_sensitivity",
    "residual_outliers",
    "top_matrices",
    "weight_errors",
]
