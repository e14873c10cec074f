"""Prefetch placement: move each ``SwapIn`` as early in the program as memory allows, so its
copy runs under the compute of the blocks it moves across (SwapAdvisor §3: "prefetch as early as
possible").

The swap planner places swap-ins just in time, right before the step that needs them; the
runtime (and :mod:`graph_passes.cost.simulator`) issues a swap-in when it reaches it in the program,
so a copy placed before block ``j`` overlaps block ``j-1`` at best. :func:`hoist_swap_ins` moves
each swap-in up, one step at a time, while

- the step it moves across does not touch the tensor (a block reading, producing or freeing it,
  its ``SwapOut``, a ``Fetch`` of it) and is not a ``Commit``;
- the step is not another ``SwapIn`` or a ``Load``: copies to the device stay in the order the
  program needs them, since the host→device stream is FIFO;
- memory allows: at the step it moves across, live arena bytes plus that step's block workspace
  plus the hoisted tensor stay within ``budget`` (the accounting of
  :func:`graph_passes.ir.memory.simulate_program`, sizes aligned with
  :func:`~graph_passes.ir.memory.align_up`);
- at most ``lookahead_blocks`` blocks are crossed, when given.

Where a swap-in stops, it goes after the ``SwapOut``/``Fetch`` steps it crossed there (between
the same two blocks): they release memory the swap-in's allocation may wait for, and the runtime
issues them without waiting, so evictions still come first (SwapAdvisor's SwapOut → SwapIn
edge).

Swap-ins are hoisted in program order, so the ones needed first get first claim on free memory.
Last, every run of consecutive copies to the device (``Load``, ``SwapIn``) is put in the order
the blocks after it read them (:func:`in_order_of_need`): the lowering loads the whole batch
first, and a schedule that starts with nodes not reading it (the optimizer's scalars) would
otherwise wait behind the batch on the FIFO host→device stream for the state they read.
The result has the same steps, only ``SwapIn`` positions differ, and its
``simulate_program(...).min_budget_bytes`` stays within ``budget`` (and never above the input
program's own, if that was already above ``budget``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.program import Commit, Fetch, Load, Program, RunBlock, Step, SwapIn, SwapOut
from graph_passes.ir.shapes import TensorInfo


def _profile(program: Program, steps: Sequence[Step], sizes: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """Per step: live arena bytes before it runs, and its measured point (live bytes after its
    allocations plus its block's workspace; for steps that allocate nothing, the bytes before)."""
    live = sum(sizes[n] for n in program.state_inputs)
    resident = set(program.state_inputs)
    before, point = [], []
    for step in steps:
        before.append(live)
        if isinstance(step, (Load, SwapIn)):
            live += sizes[step.name]
            resident.add(step.name)
            point.append(live)
        elif isinstance(step, RunBlock):
            live += sum(sizes[n] for n in step.allocates)
            resident.update(step.allocates)
            point.append(live + program.blocks[step.block].workspace_bytes)
            for name in step.frees:
                live -= sizes[name]
                resident.discard(name)
        elif isinstance(step, SwapOut):
            point.append(live)
            live -= sizes[step.name]
            resident.discard(step.name)
        elif isinstance(step, Fetch):
            point.append(live)
            if step.free:
                live -= sizes[step.name]
                resident.discard(step.name)
        elif isinstance(step, Commit):
            point.append(live)
            for updated, state in step.renames:
                if state in resident:
                    live -= sizes[state]
                    resident.discard(state)
                if updated in resident:
                    resident.discard(updated)
                    resident.add(state)
        else:
            raise TypeError(f"unknown program step {step!r}")
    return before, point


def _touched(program: Program, step: Step) -> frozenset[str] | None:
    """The tensors ``step`` is a hoisting barrier for (its block's inputs, allocations and
    frees; a ``SwapOut``'s or ``Fetch``'s tensor); None where it is one for every tensor (a
    ``SwapIn``, ``Load`` or ``Commit``, or a step kind this pass does not know)."""
    if isinstance(step, (SwapOut, Fetch)):
        return frozenset((step.name,))
    if isinstance(step, RunBlock):
        return frozenset(program.blocks[step.block].inputs) | frozenset(step.allocates) | frozenset(step.frees)
    return None


def hoist_swap_ins(
    program: Program,
    infos: Mapping[str, TensorInfo],
    *,
    budget: int,
    lookahead_blocks: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    evaluate: Callable[[Program], float] | None = None,
) -> Program:
    """``program`` with every ``SwapIn`` moved as early as memory and its dependences allow
    (see the module docstring). ``lookahead_blocks`` bounds how many blocks one swap-in may
    move across (``None``: no bound).

    ``evaluate`` (e.g. the simulated step time, ``lambda p: simulate_time(p, ...).step_time_s``)
    guards against slowdowns: an early copy shares the duplex link with swap-outs and holds
    memory a block may then wait for. With it, the fully hoisted program is kept if it is not
    slower; otherwise swap-ins are hoisted one at a time, each move kept only if the program
    does not get slower (one evaluation per swap-in)."""
    program = in_order_of_need(program)
    hoisted = in_order_of_need(_hoist(program, infos, budget, lookahead_blocks, alignment, only=None))
    if evaluate is None or hoisted.steps == program.steps:
        return hoisted
    baseline = evaluate(program)
    if evaluate(hoisted) <= baseline:
        return hoisted
    current = program
    for k in range(sum(isinstance(s, SwapIn) for s in program.steps)):
        candidate = _hoist(current, infos, budget, lookahead_blocks, alignment, only=k)
        if candidate.steps == current.steps:
            continue
        seconds = evaluate(candidate)
        if seconds <= baseline:
            current, baseline = candidate, seconds
    return in_order_of_need(current)


def in_order_of_need(program: Program) -> Program:
    """``program`` with each run of consecutive ``Load``/``SwapIn`` steps ordered by the first
    later block that reads the tensor (ties, and tensors no block reads, keep their order).
    Within such a run nothing is freed, so the live bytes at its end, and at every step of it at
    most those, do not change: only which copy the FIFO host→device stream serves first."""
    steps = list(program.steps)
    need: dict[int, int] = {}
    next_read: dict[str, int] = {}
    for index in range(len(steps) - 1, -1, -1):
        step = steps[index]
        if isinstance(step, RunBlock):
            next_read.update((name, index) for name in program.blocks[step.block].inputs)
        elif isinstance(step, (Load, SwapIn)):
            need[index] = next_read.get(step.name, len(steps))
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and isinstance(steps[end], (Load, SwapIn)):
            end += 1
        if end - start > 1:
            steps[start:end] = [steps[k] for k in sorted(range(start, end), key=lambda k: (need[k], k))]
        start = end + 1
    return dataclasses.replace(program, steps=tuple(steps))


def _hoist(program, infos, budget, lookahead_blocks, alignment, only: int | None) -> Program:
    """Hoist every swap-in, or only the ``only``-th (counting swap-ins in program order). The
    steps' barrier sets (:func:`_touched`) and memory points are computed once per call and
    move with their steps."""
    sizes = {n: align_up(i.nbytes, alignment) for n, i in infos.items()}
    steps = list(program.steps)
    before, point = _profile(program, steps, sizes)
    # Placed before step j, a tensor is live at j's point and at its own (the bytes before j).
    peak = [max(b, p) for b, p in zip(before, point)]
    touched = [_touched(program, step) for step in steps]
    is_block = [isinstance(step, RunBlock) for step in steps]
    position, seen = 0, -1
    while position < len(steps):
        step = steps[position]
        if not isinstance(step, SwapIn):
            position += 1
            continue
        seen += 1
        if only is not None and seen != only:
            position += 1
            continue
        size = sizes[step.name]
        target = _hoist_target(step.name, size, position, touched, is_block, peak, budget, lookahead_blocks)
        # Where it stops, it comes after the swap-outs and fetches it crossed there: they
        # release memory it may be waiting for, and issuing them first costs no time.
        while target < position and isinstance(steps[target], (SwapOut, Fetch)):
            target += 1
        if target < position:
            # Steps target..position-1 shift down one and carry the tensor; the swap-in's own
            # point is the bytes before `target` plus itself.
            moved_before = before[target]
            for seq in (before, point, peak):
                seq[target:position] = [v + size for v in seq[target:position]]
            for seq in (steps, before, point, peak, touched, is_block):
                seq.insert(target, seq.pop(position))
            before[target] = moved_before
            point[target] = peak[target] = moved_before + size
        position += 1
    return dataclasses.replace(program, steps=tuple(steps))


def _hoist_target(name: str, size: int, position: int, touched, is_block, peak, budget: int,
                  lookahead_blocks: int | None) -> int:
    """The earliest position the swap-in of ``name`` at ``position`` can move to: above no
    barrier for it, no step where it would not fit, at most ``lookahead_blocks`` blocks."""
    target, crossed = position, 0
    while target > 0:
        j = target - 1
        names = touched[j]
        if names is None or name in names:
            break
        if is_block[j] and lookahead_blocks is not None and crossed >= lookahead_blocks:
            break
        if peak[j] + size > budget:
            break
        crossed += is_block[j]
        target = j
    return target


__all__ = ["hoist_swap_ins", "in_order_of_need"]
