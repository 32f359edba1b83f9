"""Errors qkit raises. Library code raises these; only the CLI turns them into one line and an exit code.

Every message says what went wrong *and* how to fix it, in one line.
"""

from __future__ import annotations


class QkitError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # one line, always
        return " ".join(self.message.split())


class InputError(QkitError):
    """A bad argument: unknown scheme, malformed option value, missing path."""


class SchemeError(InputError):
    """An unknown or malformed scheme name."""


class ModelLoadError(QkitError):
    """A model that cannot be resolved or loaded (malformed config, missing weights, unreachable hub)."""


class CheckpointError(QkitError):
    """A checkpoint that cannot be read (truncated or corrupt safetensors, bad manifest)."""


class OutputError(QkitError):
    """An output qkit may not or cannot write: an input, not qkit's to replace, not writable, out of space."""


class OutputExistsError(OutputError):
    """The output path exists and ``--force`` was not given."""


class AssetError(QkitError):
    """A pinned asset could not be fetched or failed its sha256 check."""


class NonFiniteWeightError(QkitError):
    """A weight tensor holds NaN or infinity; quantizing it would silently poison the checkpoint."""


class NonFiniteActivationError(QkitError):
    """The model's activations became NaN or infinite while qkit ran it (an fp16 overflow, or a broken
    model): every statistic gathered from them (a Hessian, an importance matrix, a Fisher) would be garbage."""


class DegenerateOutputError(QkitError):
    """A tensor qkit was about to write decodes to garbage: all zeros, one constant, non-finite values, or a
    relative error of 1 or more against its source. Nothing is written."""


class ExportError(QkitError):
    """A scheme that an export format cannot express."""


class ExecutorError(QkitError):
    """Work fanned out to other processes (``--executor ray``) that could not finish: a worker died, its
    node or the cluster went away. Nothing is written; the message says what died and what to do."""
