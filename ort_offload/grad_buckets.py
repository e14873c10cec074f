"""Gradient buckets of a data-parallel step: which gradients are reduced while the backward still runs.

A bucket is the gradients one block makes: once the block has run they are issued as
asynchronous collectives over their own arena memory (no bucket buffer: they cost the budget
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
import time
from typing import Any, Mapping

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
    """One step's collectives: when each was issued and finished, and how long the step waited."""

    def __init__(self) -> None:
        self.works: list[Any] = []
        self._spans: list[list[float | None]] = []  # [issued, finished] per collective
        self.blocked_s = 0.0
        self.issued = 0  # gradients issued so far (a prefix of the plan's names)

    def add(self, work) -> None:
        span: list[float | None] = [time.perf_counter(), None]
        work.get_future().add_done_callback(lambda _future: span.__setitem__(1, time.perf_counter()))
        self.works.append(work)
        self._spans.append(span)

    def wait(self) -> None:
        """Wait for every collective issued (the time counts as exposed communication)."""
        started = time.perf_counter()
        for work in self.works:
            work.wait()
        ended = time.perf_counter()
        self.blocked_s += ended - started
        for span in self._spans:
            if span[1] is None:  # the callback may run just after wait() returns
                span[1] = ended
        self.works.clear()

    def times(self) -> tuple[float, float]:
        """(seconds some collective was in flight, seconds of those the step did not wait)."""
        spans = sorted((s[0], s[1]) for s in self._spans if s[1] is not None)
        total, end = 0.0, float("-inf")
        for start, finish in spans:  # the union of the intervals
            if finish > end:
                total += finish - max(start, end)
                end = finish
        return total, max(0.0, total - self.blocked_s)


__all__ = ["InFlight", "ReducePlan", "reduce_plan"]
