"""The one error hierarchy of ort_offload.

Every error a user can trigger derives from :class:`OffloadError`; messages are one line that
says what went wrong and what to do. The CLI maps any ``OffloadError`` to exit code 2.
"""

from __future__ import annotations

from graph_passes.errors import (
    OffloadError,
    BudgetTooSmallError,
    ModelLoadError,
    UnsupportedGraphError,
    InputMismatchError,
    ArenaStateError,
)

__all__ = [
    "ArenaStateError",
    "BudgetParseError",
    "BudgetTooSmallError",
    "CheckpointError",
    "ExecutionError",
    "ExportError",
    "InputMismatchError",
    "InvalidArgumentError",
    "ModelLoadError",
    "NonFiniteError",
    "OffloadError",
    "OutputPathError",
    "UnknownDeviceError",
    "UnknownModelError",
    "UnsupportedGraphError",
]


class BudgetParseError(OffloadError, ValueError):
    """A budget string that is neither bytes, a size with a unit, nor a fraction like '0.5x'."""


class UnknownDeviceError(OffloadError, ValueError):
    """A device name ort_offload has no runtime for."""


class UnknownModelError(OffloadError, ValueError):
    """A model name that is not in the zoo registry."""


class ExportError(OffloadError):
    """torch could not export the model as a training-step graph."""


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
