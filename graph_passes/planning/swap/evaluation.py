"""Genome evaluation for the genetic search, in this process or in forked worker processes.

A genome's evaluation (lowering, a Belady plan, the copies placed, the arena and timed replays)
is pure Python and independent of every other genome's, so a generation's children can be timed
side by side. Workers are forked from the planning process once per search and inherit the
search space as it is (graphs, infos, memoised lowerings), so nothing is sent to them but the
genomes, and nothing comes back but each genome's simulated step time: the parent decodes a
genome again only where it becomes the best plan. Decoding is deterministic, so the search is
the same with any number of workers; only the count of evaluations a time limit allows grows.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import os
from typing import Callable, Sequence

from graph_passes.planning.swap.search import SwapCandidate

MAX_DEFAULT_WORKERS = 4  # more rarely pays: a generation holds 6 children

# The decode a forked worker inherits (set in the parent right before the fork).
_decode_in_worker: Callable[[object], SwapCandidate | None] | None = None


def default_workers() -> int:
    """Processes the search may time genomes in: this process's usable cores, at most
    :data:`MAX_DEFAULT_WORKERS`; 1 where workers cannot be forked (no fork start method, or
    inside a daemonic process, which may not have children)."""
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """A genome's simulated step time (``math.inf``: it does not fit or does not lower) and its
    plan where it was decoded in this process (None where a worker timed it)."""

    seconds: float
    candidate: SwapCandidate | None = None


def step_time_of(candidate: SwapCandidate | None) -> float:
    """A decoded plan's simulated step time; ``math.inf`` for a genome that does not fit."""
    return math.inf if candidate is None else candidate.step_time_s


def _time_in_worker(genome) -> float:
    return step_time_of(_decode_in_worker(genome))


class Evaluator:
    """Times genomes with ``decode``, ``workers`` at a time (a context manager: the workers
    end with it). ``batch`` is how many genomes one call of :meth:`evaluate` should get."""

    def __init__(self, decode: Callable[[object], SwapCandidate | None], workers: int) -> None:
        self.decode = decode
        self.batch = max(1, workers)
        self._pool = None

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def evaluate(self, genomes: Sequence[object]) -> list[Evaluated]:
        """Each genome's :class:`Evaluated`, in order."""
        if self.batch == 1 or len(genomes) == 1:
            return [Evaluated(step_time_of(c), c) for c in map(self.decode, genomes)]
        return [Evaluated(seconds) for seconds in self._workers().map(_time_in_worker, genomes, chunksize=1)]

    def _workers(self):
        global _decode_in_worker
        if self._pool is None:
            _decode_in_worker = self.decode  # inherited by the forks below
            # What exists now is frozen out of the workers' garbage collection: a cycle holding
            # an ONNX Runtime session, collected in a fork, waits forever on a thread of the
            # parent's that the fork does not have (seen: pthread_cond_destroy in a worker).
            gc.freeze()
            try:
                self._pool = multiprocessing.get_context("fork").Pool(self.batch)
            finally:
                gc.unfreeze()
        return self._pool

    def close(self) -> None:
        global _decode_in_worker
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
            _decode_in_worker = None


__all__ = ["Evaluated", "Evaluator", "default_workers", "step_time_of"]
