"""The one error hierarchy of ort_offload.

Every error a user can trigger derives from :class:`OffloadError`; messages are one line that
says what went wrong and what to do. The CLI maps any ``OffloadError`` to exit code 2.
"""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error ort_offload raises on bad input or an impossible request."""


class BudgetTooSmallError(OffloadError):
    """No plan fits the budget; ``needed_bytes`` is the smallest budget that would."""

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = int(needed_bytes)
        self.budget_bytes = int(budget_bytes)


class BudgetParseError(OffloadError, ValueError):
    """A budget string that is neither bytes, a size with a unit, nor a fraction like '0.5x'."""


class UnknownDeviceError(OffloadError, ValueError):
    """A device name ort_offload has no runtime for."""


class UnknownModelError(OffloadError, ValueError):
    """A model name that is not in the zoo registry."""


class ModelLoadError(OffloadError):
    """A file that is missing, not ONNX, or not a training-step graph ort_offload can run."""


class UnsupportedGraphError(OffloadError):
    """A graph that uses an op or construct the runtime cannot execute."""


class InputMismatchError(OffloadError, ValueError):
    """Inputs whose names, dtypes or shapes do not match what the graph expects."""


class ExportError(OffloadError):
    """torch could not export the model as a training-step graph."""


class ArenaStateError(OffloadError):
    """The arena was asked about a tensor it does not hold (a runtime bug, not a budget problem)."""


class ExecutionError(OffloadError):
    """ONNX Runtime failed while running a block (e.g. an index out of range in the batch)."""


class CheckpointError(OffloadError):
    """A checkpoint that is missing, corrupt, or does not match the trainer's state."""


class InvalidArgumentError(OffloadError, ValueError):
    """A count, seed or learning rate out of its range (e.g. ``--block-nodes -1``, ``--lr nan``)."""


class OutputPathError(OffloadError):
    """An output path that cannot be written, names a directory, or would overwrite an input."""


class NonFiniteError(OffloadError):
    """A step gave a non-finite loss or state (with ``stop_on_nonfinite``); the state is unchanged."""


class DistributedError(OffloadError):
    """Data-parallel ranks that disagree at start, or a collective that failed (a peer died or timed out)."""
