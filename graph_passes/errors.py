"""The base of ort_offload's one error hierarchy, and the errors the graph passes raise.

Every error a user can trigger derives from :class:`OffloadError`; messages are one line that
says what went wrong and what to do. These classes sit at the bottom of the project (standard
library only) so that the IR, the planners and the runtime raise the same types;
:mod:`ort_offload.errors` re-exports them with the rest of the hierarchy.
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


class ModelLoadError(OffloadError):
    """A file that is missing, not ONNX, or not a training-step graph ort_offload can run."""


class UnsupportedGraphError(OffloadError):
    """A graph that uses an op or construct the runtime cannot execute."""


class InputMismatchError(OffloadError, ValueError):
    """Inputs whose names, dtypes or shapes do not match what the graph expects."""


class ArenaStateError(OffloadError):
    """The arena was asked about a tensor it does not hold (a runtime bug, not a budget problem)."""
