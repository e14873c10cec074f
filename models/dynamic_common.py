"""Shared pieces of the dynamic zoo: the batch type, :class:`MixedPathError`, :func:`shared_path`.

Every dynamic model (``models.var_bert``, ``models.moe``, ``models.tree_lstm``,
``models.var_lstm``, ``models.recycle_former``) follows one protocol:

- ``forward(*inputs)`` keeps Python control flow and calls only the modules of ``blocks()``
  (plus a fixed stem and head that every path runs);
- ``blocks() -> list[nn.Module]``: the static sub-modules the control flow chooses between;
- ``path(*inputs) -> tuple[int, ...]``: the indices into ``blocks()`` of the block invocations
  the forward makes, in call order, computed from the inputs without running any block.

A batch shares one path: each generator draws one path per batch, and ``path`` raises
:class:`MixedPathError` when the rows of a batch would take different paths (callers with mixed
data call ``path`` per row, ``inputs[i : i + 1]``, and bucket rows by path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

__all__ = ["Batch", "MixedPathError", "shared_path"]

Batch = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]

T = TypeVar("T")


class MixedPathError(ValueError):
    """The rows of one batch would take different paths; split the batch by path."""


def shared_path(per_row: Sequence[T], *, what: str) -> T:
    """The common value of ``per_row`` (one entry per batch row); raise :class:`MixedPathError`
    naming ``what`` and the first disagreeing row when rows differ."""
    if not per_row:
        raise ValueError("a batch needs at least one row")
    first = per_row[0]
    for row, value in enumerate(per_row):
        if value != first:
            raise MixedPathError(
                f"batch rows take different paths ({what}: row 0 {first!r}, row {row} {value!r}); "
                "a batch must share one path, so bucket rows by model.path(inputs[i:i+1])"
            )
    return first
