"""Parsing and formatting of device-memory budgets.

A budget is written as plain bytes (``"1048576"``), a size with a binary or decimal unit
(``"64MiB"``, ``"1.5GiB"``, ``"200MB"``), or a fraction of the unplanned peak (``"0.25x"``).
Fractions stay symbolic (:class:`Budget` with ``fraction`` set) until the unplanned peak of a
concrete graph is known; :meth:`Budget.resolve` turns them into bytes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from graph_passes.formatting import format_bytes
from ort_offload.errors import BudgetParseError

__all__ = ["Budget", "format_bytes", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_FRACTION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*x\s*$", re.IGNORECASE)

# Larger than any device: a bigger budget is a typo (1e400) or means "unlimited" (omit it).
MAX_BUDGET_BYTES = 2**60
_HELP = "write bytes (1048576), a size (64MiB, 1.5GiB, 200MB) or a fraction of the unplanned peak (0.5x)"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A device-memory budget: either absolute ``nbytes`` or a ``fraction`` of the unplanned peak."""

    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise BudgetParseError("a budget is either bytes or a fraction of the unplanned peak, not both")

    @property
    def is_fraction(self) -> bool:
        return self.fraction is not None

    def resolve(self, baseline_peak_bytes: int) -> int:
        """Bytes of this budget for a graph whose unplanned peak is ``baseline_peak_bytes``."""
        if self.nbytes is not None:
            return self.nbytes
        return int(math.floor(self.fraction * baseline_peak_bytes))

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g}x"
        return format_bytes(self.nbytes)


def parse_budget(text: str | int | float | Budget | None) -> Budget | None:
    """Parse a user-written budget; ``None`` means unlimited.

    Refuses (:class:`BudgetParseError`) anything not finite and positive, and byte counts over
    :data:`MAX_BUDGET_BYTES`, so that no later step meets an infinite or overflowing budget.
    """
    if text is None or isinstance(text, Budget):
        return text
    if isinstance(text, bool):
        raise BudgetParseError(f"budget {text!r} is not a size: {_HELP}")
    if isinstance(text, numbers.Real):
        return Budget(nbytes=_checked_bytes(float(text) if isinstance(text, float) else text, text))
    if not isinstance(text, str):
        raise BudgetParseError(f"budget {text!r} is a {type(text).__name__}, not a size: {_HELP}")
    match = _FRACTION_RE.match(text)
    if match:
        fraction = float(match.group(1))
        if not (math.isfinite(fraction) and fraction > 0):
            raise BudgetParseError(f"budget fraction must be positive and finite, got {text!r}: {_HELP}")
        return Budget(fraction=fraction)
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetParseError(f"cannot parse budget {text!r}: {_HELP}")
    return Budget(nbytes=_checked_bytes(float(match.group(1)) * _UNITS[match.group(2).lower()], text))


def _checked_bytes(value: int | float, text) -> int:
    """``value`` as whole bytes if it is finite, at least one byte and at most the maximum."""
    if isinstance(value, float) and not math.isfinite(value):
        raise BudgetParseError(f"budget must be finite, got {text!r}: {_HELP}")
    if value > MAX_BUDGET_BYTES:
        raise BudgetParseError(f"budget {text!r} is over 1 EiB: omit it for an unlimited budget")
    nbytes = int(value)
    if nbytes <= 0:
        raise BudgetParseError(f"budget must be at least one byte, got {text!r}: {_HELP}")
    return nbytes
