"""Genome evaluation for the genetic search, in this process or in forked worker processes
(:class:`graph_passes.planning.workers.ForkedMap`).

A genome's evaluation (lowering, a Belady plan, the copies placed, the arena and timed replays)
is pure Python and independent of every other genome's, so a generation's children can be timed
side by side. Workers are forked once per search and inherit the search space as it is, so
nothing is sent to them but the genomes, and nothing comes back but each genome's simulated
step time: the parent decodes a genome again only where it becomes the best plan. Decoding is
deterministic, so the search is the same with any number of workers; only the count of
evaluations a time limit allows grows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from graph_passes.planning.swap.search import SwapCandidate
from graph_passes.planning.workers import ForkedMap


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """A genome's simulated step time (``math.inf``: it does not fit or does not lower) and its
    plan where it was decoded in this process (None where a worker timed it)."""

    seconds: float
    candidate: SwapCandidate | None = None


def step_time_of(candidate: SwapCandidate | None) -> float:
    """A decoded plan's simulated step time; ``math.inf`` for a genome that does not fit."""
    return math.inf if candidate is None else candidate.step_time_s


class Evaluator:
    """Times genomes with ``decode``, ``workers`` at a time (a context manager: the workers
    end with it). ``batch`` is how many genomes one call of :meth:`evaluate` should get."""

    def __init__(self, decode: Callable[[object], SwapCandidate | None], workers: int) -> None:
        self.decode = decode
        self.batch = max(1, workers)
        self._timed = ForkedMap(lambda genome: step_time_of(decode(genome)), self.batch)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def evaluate(self, genomes: Sequence[object]) -> list[Evaluated]:
        """Each genome's :class:`Evaluated`, in order."""
        if self.batch == 1 or len(genomes) == 1:
            return [Evaluated(step_time_of(c), c) for c in map(self.decode, genomes)]
        return [Evaluated(seconds) for seconds in self._timed.map(genomes)]

    def close(self) -> None:
        self._timed.close()


__all__ = ["Evaluated", "Evaluator", "step_time_of"]
