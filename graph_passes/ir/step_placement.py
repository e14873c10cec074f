"""One step of a program placed ahead of time: a static memory plan from the arena's state.

The runtime's arena places every tensor with best fit (:class:`BestFitAllocator`), so where a
step puts its tensors is a function of the arena's state when the step starts. Replaying the
program's allocations and frees through a copy of that state (as
:func:`graph_passes.ir.memory.simulate_program` does) gives every offset, the step's peak and
the state it ends in: a step that starts from a state seen before can run from that table
without allocating, freeing or binding anything new (:mod:`ort_offload.runtime.placed_steps`).

Best fit alone seldom returns to a state (updated state lands somewhere new every step).
Two steps placed by :func:`place_step` alternate for good: one that *leaves* a state (best
fit, except that each update keeps off the places the other step will put updates in while
its own state still lives there), and one that *returns* to it (``home``): each update where
its state was, every other tensor best fit around those places, never over one that its
update takes while the tensor is still live.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from graph_passes.ir.allocator import BestFitAllocator, OutOfArenaMemory
from graph_passes.ir.memory import allocation_units
from graph_passes.ir.program import Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut
from graph_passes.ir.shapes import TensorInfo


@dataclasses.dataclass(frozen=True)
class PlacedStep:
    """Where one step of a program puts everything, from one arena state.

    ``offsets[i]`` is, for program step ``i`` (a ``Load``, ``RunBlock`` or ``Fetch``), the
    offset of every tensor live when it runs (a block: after its outputs are allocated); None
    for other steps. ``peak_bytes`` is the most of arena extent plus the running block's
    workspace, as the runtime measures it (from the extent the step starts at); ``end`` the
    allocator after the step."""

    offsets: tuple[Mapping[str, int] | None, ...]
    peak_bytes: int
    extent: int  # highest end of any tensor during the step
    end: BestFitAllocator


def place_step(program: Program, infos: Mapping[str, TensorInfo], start: BestFitAllocator, *,
               budget: int | None = None, home: BestFitAllocator | None = None,
               leave: bool = False) -> PlacedStep | None:
    """Place one step of ``program`` from allocator state ``start`` (not changed), as the runtime
    would: with ``budget`` (bytes for tensors) the arena is capped at it less the running
    block's workspace; without, it grows (``start``'s capacity is ignored).

    With ``home`` (an earlier state holding the same state tensors), the updates go to their
    state's place in ``home`` and the step ends in ``home``'s layout; with ``leave``, the step
    is placed so that a step with ``home=start`` can follow it. None where no table can stand
    for the step: it swaps, it would compact (bytes move), or ``home`` cannot be reached."""
    if any(isinstance(step, (SwapIn, SwapOut)) for step in program.steps) or program.host_state:
        return None
    allocator = start.clone()
    allocator.capacity = budget
    if home is not None:
        allocate = _homing(program, infos, allocator, home)
    elif leave:
        allocate = _leaving(program, infos, allocator, start)
    else:
        allocate = _best_fit(allocator)
    if allocate is None:
        return None
    try:
        placed = _walk(program, infos, allocator, budget, allocate)
    except (OutOfArenaMemory, ValueError, _Moved):
        return None
    if home is not None and (allocator.layout() != home.layout() or allocator.high_water_live() != home.high_water_live()):
        return None
    return placed


class _Moved(Exception):
    """The step would compact the arena: its tensors would move."""


def _best_fit(allocator: BestFitAllocator):
    def allocate(name: str, nbytes: int, event: int) -> None:
        if allocator.allocate_or_compact(name, nbytes):
            raise _Moved(name)
    return allocate


def _cap(allocator: BestFitAllocator, budget: int | None, workspace: int) -> None:
    if budget is not None and allocator.limit(budget - workspace):
        raise _Moved("<limit>")


def _walk(program: Program, infos, allocator: BestFitAllocator, budget, allocate) -> PlacedStep:
    """Apply every step's allocations and frees to ``allocator``; record offsets and the peak."""
    offsets: list[dict[str, int] | None] = []
    peak = allocator.high_water_live()
    extent = peak
    event = 0
    for step in program.steps:
        record = None
        if isinstance(step, Load):
            _cap(allocator, budget, 0)
            allocate(step.name, infos[step.name].nbytes, event)
            event += 1
            record = _offsets(allocator)
            peak = max(peak, allocator.high_water_live())
        elif isinstance(step, RunBlock):
            workspace = program.blocks[step.block].workspace_bytes
            _cap(allocator, budget, workspace)
            for name, pieces in allocation_units(program, step.allocates):
                allocate(name, infos[name].nbytes, event)
                event += 1
                if pieces:
                    allocator.partition(name, [(p, infos[p].nbytes) for p in pieces])
            record = _offsets(allocator)
            peak = max(peak, allocator.high_water_live() + workspace)
            extent = max(extent, allocator.high_water_live())
            for name in step.frees:
                allocator.free(name)
        elif isinstance(step, Fetch):
            record = _offsets(allocator)
            if step.free:
                allocator.free(step.name)
        elif isinstance(step, Commit):
            for updated, state in step.renames:
                if state in allocator:
                    allocator.free(state)
                if updated in allocator:
                    allocator.rename(updated, state)
        extent = max(extent, allocator.high_water_live())
        offsets.append(record)
    return PlacedStep(tuple(offsets), peak, extent, allocator)


def _offsets(allocator: BestFitAllocator) -> dict[str, int]:
    return {name: allocator.placement(name).offset for name in allocator.names()}


def _homing(program: Program, infos, allocator: BestFitAllocator, home: BestFitAllocator):
    """The allocation rule of a step that ends in ``home``: each update at its state's place
    there; everything else best fit, avoiding the place of every update allocated while it lives."""
    commits = [s for s in program.steps if isinstance(s, Commit)]
    renames = {u: s for c in commits for u, s in c.renames}
    if any(s not in home for s in renames.values()):
        return None
    births, deaths = _lifetimes(program, infos)
    target = {u: (home.placement(s).offset, home.placement(s).nbytes) for u, s in renames.items()}
    if any(u not in births for u in target):
        return None  # an update that is not one allocation of its own (e.g. a view's piece)

    def allocate(name: str, nbytes: int, event: int) -> None:
        if name in target:
            allocator.place_at(name, nbytes, target[name][0])
            return
        death = deaths.get(name, math.inf)
        avoid = [span for u, span in target.items() if event < births[u] < death]
        allocator.place_at(name, nbytes, allocator.fit_avoiding(nbytes, avoid))
    return allocate


def _leaving(program: Program, infos, allocator: BestFitAllocator, start: BestFitAllocator):
    """The allocation rule of a step that a step homing to ``start`` can follow: in that step
    each state tensor stays where this step puts its update until it dies, so an update keeps
    off the place (in ``start``) of every update that step allocates before then."""
    renames = {u: s for step in program.steps if isinstance(step, Commit) for u, s in step.renames}
    if any(s not in start for s in renames.values()):
        return None
    births, deaths = _lifetimes(program, infos)
    homes = {u: (start.placement(s).offset, start.placement(s).nbytes) for u, s in renames.items()}
    if any(u not in births for u in homes):
        return None

    def allocate(name: str, nbytes: int, event: int) -> None:
        state = renames.get(name)
        if state is None:
            allocator.place_at(name, nbytes, allocator.fit_avoiding(nbytes, ()))
            return
        death = deaths.get(state, math.inf)
        avoid = [span for u, span in homes.items() if births[u] < death]
        allocator.place_at(name, nbytes, allocator.fit_avoiding(nbytes, avoid))
    return allocate


def _lifetimes(program: Program, infos) -> tuple[dict[str, int], dict[str, float]]:
    """Per allocated name, the allocation event (in :func:`_walk`'s numbering) it is born at
    and the event count when it is freed (a view: its last piece); names never freed: absent."""
    births: dict[str, int] = {}
    deaths: dict[str, int] = {}
    whole_of: dict[str, str] = {}
    event = 0
    for step in program.steps:
        freed: tuple[str, ...] = ()
        if isinstance(step, Load):
            births[step.name] = event
            event += 1
        elif isinstance(step, RunBlock):
            for name, pieces in allocation_units(program, step.allocates):
                births[name] = event
                event += 1
                whole_of.update({p: name for p in pieces})
            freed = step.frees
        elif isinstance(step, Fetch) and step.free:
            freed = (step.name,)
        for name in freed:
            whole = whole_of.get(name, name)
            deaths[whole] = event
    return births, deaths
