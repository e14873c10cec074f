"""Gradient buckets of a data-parallel step: which gradients are reduced while the backward still runs.

A bucket is the gradients one block makes: once the block has run they are handed to a
communication thread, which reduces them over their own arena memory (no bucket buffer: they cost the budget
nothing beyond the gradients themselves), and every collective is waited for before the first
block that reads a gradient. Every rank issues the gradients in one order (their producers'
order in the step graph, the same on every rank), each as soon as it and all before it are
made, so ranks whose plans cut the backward differently still issue matching collectives. A
gradient the plan swaps, or that the backward itself reads, is reduced at the cut instead
(with every gradient after it in that order). :class:`InFlight` measures how much of the
communication ran under compute.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable, Mapping

from graph_passes.ir.program import Program, SwapIn, SwapOut


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """Where a program's gradients are reduced."""

    first: int | None  # the first block that reads a gradient: every reduction is done before it
    names: tuple[str, ...]  # every gradient the program makes, in issue order
    ready_after: Mapping[int, int]  # block -> how many of ``names`` (a prefix) may be issued once it ran


def reduce_plan(program: Program, order: Mapping[str, int]) -> ReducePlan:
    """The buckets of ``program`` for the gradients ``order`` ranks (gradient -> position of its
    producer in the step graph)."""
    made_in: dict[str, int] = {}
    for block in program.blocks:
        for name in block.outputs:
            if name in order:
                made_in.setdefault(name, block.index)
    first = next((b.index for b in program.blocks if any(n in order for n in b.inputs)), None)
    names = tuple(sorted(made_in, key=lambda n: (order[n], n)))
    ready_after: dict[int, int] = {}
    if first is not None:
        moved = {s.name for s in program.steps if isinstance(s, (SwapOut, SwapIn))}
        read_early = {n for b in program.blocks[:first] for n in b.inputs}
        made_by = -1  # the block by which every gradient of the prefix is made
        for count, name in enumerate(names, start=1):
            if name in moved or name in read_early or made_in[name] >= first:
                break
            made_by = max(made_by, made_in[name])
            ready_after[made_by] = count
    return ReducePlan(first, names, ready_after)


class InFlight:
    """One step's gradient collectives, run in issue order, one at a time, on a thread of their
    own while the step computes (docs/decisions.md: several outstanding gloo collectives once
    mismatched); when each ran, and how long the step waited for them."""

    def __init__(self, run: Callable[..., None]) -> None:
        """``run(*item)`` performs one collective (synchronously, on the thread)."""
        self._run = run
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._spans: list[tuple[float, float]] = []  # (started, finished) per collective
        self._error: BaseException | None = None
        self.blocked_s = 0.0
        self.issued = 0  # gradients issued so far (a prefix of the plan's names)

    def add(self, *item) -> None:
        """Queue one collective (``run``'s arguments); it starts once those before it are done."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gradient-reduction", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:  # the rest are skipped: wait() raises the first error
                continue
            started = time.perf_counter()
            try:
                self._run(*item)
            except BaseException as error:  # noqa: BLE001 (handed to the step's thread by wait())
                self._error = error
            self._spans.append((started, time.perf_counter()))

    def wait(self) -> None:
        """Wait for every collective queued (the time counts as exposed communication); raises
        the first one's error."""
        if self._thread is not None:
            started = time.perf_counter()
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            self.blocked_s += time.perf_counter() - started
        if self._error is not None:
            raise self._error

    def times(self) -> tuple[float, float]:
        """(seconds some collective was running, seconds of those the step did not wait)."""
        total, end = 0.0, float("-inf")
        for start, finish in sorted(self._spans):  # the union of the intervals
            if finish > end:
                total += finish - max(start, end)
                end = finish
        return total, max(0.0, total - self.blocked_s)


__all__ = ["InFlight", "ReducePlan", "reduce_plan"]
