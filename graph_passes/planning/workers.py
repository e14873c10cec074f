"""Forked worker processes for planning work that is pure Python and independent item by item:
the genetic search's genomes (:mod:`graph_passes.planning.swap.evaluation`) and the split
walk's candidate rewrites (:mod:`graph_passes.planning.split.planner`).

Workers are forked once per use from the planning process and inherit its state as it is
(graphs, infos, memoised lowerings), so only the items go to them and only each item's result
comes back. Where the work is deterministic, the result is the same with any number of workers.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from typing import Callable, Generic, Sequence, TypeVar

MAX_DEFAULT_WORKERS = 4  # more rarely pays: a GA generation holds 6 children, a split walk's op 2-4 options

Item = TypeVar("Item")
Result = TypeVar("Result")

# The function a forked worker inherits (set in the parent right before the fork).
_function_in_worker: Callable | None = None


def default_workers() -> int:
    """Processes planning may use side by side: this process's usable cores, at most
    :data:`MAX_DEFAULT_WORKERS`; 1 where workers cannot be forked (no fork start method, or
    inside a daemonic process, which may not have children)."""
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


def _call_in_worker(item):
    return _function_in_worker(item)


class ForkedMap(Generic[Item, Result]):
    """``function`` over items, ``workers`` processes at a time (a context manager: the workers
    end with it). With one worker, or one item, it runs in this process. The processes are
    forked at the first :meth:`map` that needs them, so they see the state of that moment."""

    def __init__(self, function: Callable[[Item], Result], workers: int) -> None:
        self.function = function
        self.workers = max(1, workers)
        self._pool = None

    def __enter__(self) -> "ForkedMap[Item, Result]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def map(self, items: Sequence[Item]) -> list[Result]:
        """Each item's result, in order (an exception in a worker is raised here)."""
        if self.workers == 1 or len(items) <= 1:
            return [self.function(item) for item in items]
        return self._workers().map(_call_in_worker, items, chunksize=1)

    def _workers(self):
        global _function_in_worker
        if self._pool is None:
            _function_in_worker = self.function  # inherited by the forks below
            # What exists now is frozen out of the workers' garbage collection: a cycle holding
            # an ONNX Runtime session, collected in a fork, waits forever on a thread of the
            # parent's that the fork does not have (seen: pthread_cond_destroy in a worker).
            gc.freeze()
            try:
                self._pool = multiprocessing.get_context("fork").Pool(self.workers)
            finally:
                gc.unfreeze()
        return self._pool

    def close(self) -> None:
        global _function_in_worker
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
            _function_in_worker = None


__all__ = ["ForkedMap", "MAX_DEFAULT_WORKERS", "default_workers"]
