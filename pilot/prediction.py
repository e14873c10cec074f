"""What a path predictor hands the block-wise runtime: :class:`PathPrediction` and the
:class:`PathPredictor` protocol, plus the two predictors that need no learned model.

A dynamic model (``models.dynamic_common``) runs a sequence of block invocations per batch, its
*path*: indices into ``model.blocks()``. Before the batch runs, a predictor guesses that path and
groups it into *execution blocks* (DyNN-Offload §IV-B), the unit of prefetch: while execution
block ``i`` computes, the runtime moves what ``i + 1`` needs into the migration half of the
arena. The runtime trusts the prediction only for prefetching; what actually runs is the
model's own control flow, so a wrong prediction costs tensor faults, never wrong numbers.

Predictors:

- :class:`OraclePredictor`: the true path (``model.path(*inputs)``), grouped by a given
  partitioner; the upper bound of what a pilot can achieve.
- :class:`NoPredictor`: predicts nothing, so every block's tensors arrive by tensor fault (the
  on-demand, unified-memory-like baseline).
- ``pilot.Pilot`` (the learned pilot model) implements the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["NoPredictor", "OraclePredictor", "PathPrediction", "PathPredictor", "WrongPredictor", "even_groups"]


@dataclass(frozen=True)
class PathPrediction:
    """A predicted path and its execution blocks.

    ``path``: predicted block invocations, indices into ``model.blocks()`` in call order.
    ``execution_blocks``: half-open ``(start, end)`` ranges over positions of ``path`` that
    tile it in order (empty when ``path`` is empty).
    ``key``: the predictor's raw output, hashable (the pilot's rounded to whole block units); the
    misprediction cache is keyed by it with ``path`` (equal keys mean the predictor said the same
    thing, so the corrected path of an earlier miss applies).
    ``inference_us`` / ``mapping_us``: time spent producing the raw output and mapping it back
    to a path (0 for predictors without those stages).
    """

    path: tuple[int, ...]
    execution_blocks: tuple[tuple[int, int], ...]
    key: tuple = ()
    inference_us: float = 0.0
    mapping_us: float = 0.0

    def __post_init__(self) -> None:
        position = 0
        for start, end in self.execution_blocks:
            if start != position or end <= start:
                raise ValueError(f"execution blocks {self.execution_blocks} do not tile a path of {len(self.path)}")
            position = end
        if position != len(self.path):
            raise ValueError(f"execution blocks {self.execution_blocks} do not tile a path of {len(self.path)}")

    def groups(self) -> list[tuple[int, ...]]:
        """The block indices of each execution block, in order."""
        return [self.path[start:end] for start, end in self.execution_blocks]


@runtime_checkable
class PathPredictor(Protocol):
    """Anything that predicts a batch's path before it runs."""

    def predict(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction: ...


def even_groups(path: Sequence[int], size: int) -> tuple[tuple[int, int], ...]:
    """Execution blocks of ``size`` invocations each (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"execution-block size must be >= 1, got {size}")
    return tuple((start, min(start + size, len(path))) for start in range(0, len(path), size))


Partitioner = Callable[[Sequence[int]], tuple[tuple[int, int], ...]]


class OraclePredictor:
    """The true path, from ``model.path(*inputs)``, grouped by ``partition`` (default: one
    invocation per execution block)."""

    def __init__(self, partition: Partitioner | None = None) -> None:
        self.partition = partition or (lambda path: even_groups(path, 1))

    def predict(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction:
        path = tuple(int(i) for i in model.path(*inputs))
        return PathPrediction(path=path, execution_blocks=self.partition(path), key=("oracle", path))


class NoPredictor:
    """No prediction: every tensor a block needs is fetched on demand (a tensor fault)."""

    def predict(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction:
        return PathPrediction(path=(), execution_blocks=(), key=("none",))


class WrongPredictor:
    """Always wrong: the true path shifted by one block id (mod the number of blocks), so every
    position differs. For testing that mispredictions cost faults, never numbers."""

    def __init__(self, partition: Partitioner | None = None) -> None:
        self.partition = partition or (lambda path: even_groups(path, 1))

    def predict(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction:
        count = len(model.blocks())
        path = tuple((int(i) + 1) % max(count, 1) for i in model.path(*inputs))
        if count == 1:
            path = path + (0,)  # with one block only a longer path can be wrong
        return PathPrediction(path=path, execution_blocks=self.partition(path), key=("wrong", path))
