"""Device memory of a lowered program: its replay through the arena's allocator.

:func:`simulate_program` replays a program step by step through :class:`BestFitAllocator`, so
the analysed ``baseline_peak_bytes`` and the measured ``peak_device_bytes`` come from the same
arithmetic.
"""

from __future__ import annotations

import dataclasses

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, BestFitAllocator
from graph_passes.ir.program import Commit, Fetch, Load, RunBlock, SwapIn, SwapOut

@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """Device memory at one program step: ``in_use`` arena bytes, ``extent`` (end of the
    highest live tensor: what the arena occupies), and the running block's ``workspace``."""

    label: str
    in_use: int
    workspace: int
    high_water: int
    extent: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryTrace:
    arena_high_water: int  # highest arena address used (fragmentation included)
    peak_in_use: int  # most arena bytes live at once (independent of placement)
    max_workspace: int
    timeline: tuple[MemoryPoint, ...]  # the last simulated step
    peak_device_bytes: int = 0  # max over steps of arena extent + running block's workspace
    min_budget_bytes: int = 0  # max over steps of live arena bytes + running block's workspace
    # (the arena compacts when fragmentation alone blocks an allocation, so placement never
    # raises the requirement above min_budget_bytes)


def simulate_program(
    program,
    infos,
    *,
    steps: int = 2,
    budget: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> MemoryTrace:
    """Replay ``program`` (a :class:`graph_passes.ir.program.Program`) for ``steps`` steps through
    the arena's allocator, the state placed first in input order as the runtime places it.

    Several steps, because updated state lands wherever the allocator puts it and the next
    step starts from that layout. With a ``budget``, the arena is capped as the runtime caps
    it (the budget less the running block's workspace) and compacts when it must.
    """
    allocator = _allocator_at_step_start(program, infos, alignment)
    timeline: list[MemoryPoint] = []
    peak = need = 0
    for _ in range(steps):
        timeline = []
        _replay_one_step(allocator, program, infos, timeline, budget)
        peak = max([peak] + [p.extent + p.workspace for p in timeline])
        need = max([need] + [p.in_use + p.workspace for p in timeline])
    return MemoryTrace(
        allocator.high_water, allocator.peak_in_use, program.max_workspace_bytes, tuple(timeline), peak, need
    )


def least_budget_bytes(program, infos, *, budget: int | None = None, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """``simulate_program(program, infos, budget=budget).min_budget_bytes``, replaying a second
    step only where it can differ: the live bytes at every step depend on which tensors are
    live, not on where they are, so a step that ends holding what it started with repeats
    them. A search checks thousands of plans against the budget this way; the one it keeps gets
    the full replay."""
    allocator = _allocator_at_step_start(program, infos, alignment)
    start = set(allocator.names())
    need = 0
    for _ in range(2):
        timeline: list[MemoryPoint] = []
        _replay_one_step(allocator, program, infos, timeline, budget)
        need = max([need] + [p.in_use + p.workspace for p in timeline])
        if set(allocator.names()) == start:
            break
    return need


def _allocator_at_step_start(program, infos, alignment: int) -> BestFitAllocator:
    """The arena when a step starts: the state placed first, in input order, as the runtime places it."""
    allocator = BestFitAllocator(alignment=alignment)
    for name in program.state_inputs:
        allocator.allocate(name, infos[name].nbytes)
    return allocator


def allocation_units(program, allocates):
    """A block's allocations in order as (name, pieces): a split view's pieces are one
    allocation of the whole value (``pieces`` then names them), everything else alone (())."""
    first = {pieces[0]: (whole, pieces) for whole, pieces in getattr(program, "views", ())}
    units, taken = [], set()
    for name in allocates:
        if name in taken:
            continue
        if name in first and set(first[name][1]) <= set(allocates):
            units.append(first[name])
            taken.update(first[name][1])
        else:
            units.append((name, ()))
    return units


def _replay_one_step(allocator: BestFitAllocator, program, infos, timeline: list[MemoryPoint], budget=None) -> None:

    def cap(workspace: int) -> None:
        if budget is not None:
            allocator.limit(budget - workspace)

    for step in program.steps:
        if isinstance(step, Load):
            cap(0)
            allocator.allocate_or_compact(step.name, infos[step.name].nbytes)
            timeline.append(MemoryPoint(f"load {step.name}", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
        elif isinstance(step, RunBlock):
            workspace = program.blocks[step.block].workspace_bytes
            cap(workspace)
            for name, pieces in allocation_units(program, step.allocates):
                allocator.allocate_or_compact(name, infos[name].nbytes)
                if pieces:
                    allocator.partition(name, [(p, infos[p].nbytes) for p in pieces])
            timeline.append(MemoryPoint(f"block {step.block}", allocator.in_use, workspace, allocator.high_water, allocator.high_water_live()))
            for name in step.frees:
                allocator.free(name)
        elif isinstance(step, Fetch):
            if step.free:
                allocator.free(step.name)
        elif isinstance(step, SwapOut):
            allocator.free(step.name)
        elif isinstance(step, SwapIn):
            cap(0)
            allocator.allocate_or_compact(step.name, infos[step.name].nbytes)
            timeline.append(MemoryPoint(f"swap in {step.name}", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
        elif isinstance(step, Commit):
            for updated, state in step.renames:
                if state in allocator:
                    allocator.free(state)
                if updated in allocator:  # an update swapped out stays on the host
                    allocator.rename(updated, state)
            timeline.append(MemoryPoint("commit", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
