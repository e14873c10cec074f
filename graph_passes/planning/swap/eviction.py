"""Eviction placement: issue each ``SwapOut`` right after the tensor's last use before it, so
its device→host copy runs under the compute that follows and its arena bytes are free by the
time memory gets tight (DeepUM's pre-eviction; SwapAdvisor issues a swap-out as soon as its
tensor's last reader before the gap is done).

The swap planner evicts lazily: a tensor leaves right before the step whose allocations no
longer fit. On a device with a copy link, that puts the copies where memory is tightest, and
the block that needs the memory waits for them. :func:`issue_swap_outs_early` moves every
``SwapOut`` up the program, one step at a time, while the step it moves across

- does not touch the tensor (a block reading, producing or freeing it, its own ``Load``,
  ``SwapIn`` or ``Fetch``), and
- is not a ``Commit`` (state renames there).

Moving a swap-out earlier only shortens the span in which the tensor occupies the arena, so
live bytes never rise at any step: the program's least budget
(:func:`graph_passes.ir.memory.simulate_program`'s ``min_budget_bytes``) does not go up.
Swap-outs are moved in program order; one whose tensor was last used earlier may pass another
one, so the device→host stream (FIFO) takes tensors in the order they became evictable.
"""

from __future__ import annotations

import dataclasses

from graph_passes.ir.program import Fetch, Load, Program, RunBlock, SwapIn, SwapOut


def issue_swap_outs_early(program: Program) -> Program:
    """``program`` with each ``SwapOut`` right after the last step before it that touches its
    tensor (see the module docstring). Only ``SwapOut`` positions change.

    One pass, the result of the step-by-step moves: each swap-out ends right after its last
    barrier in the program as given (a step touching its tensor, an earlier swap-out of it, a
    ``Commit``); swap-outs ending after the same step are in the reverse of their order (each
    moved later passed the ones already there)."""
    steps = program.steps
    behind: dict[int, list[int]] = {}  # a step's position -> the swap-outs moved right behind it, in move order
    touched: dict[str, int] = {}  # a tensor -> the last step so far that touches it
    barrier = -1  # the last Commit (or a step kind this pass does not know) so far
    for position, step in enumerate(steps):
        if isinstance(step, SwapOut):
            behind.setdefault(max(touched.get(step.name, -1), barrier), []).append(position)
            touched[step.name] = position
        elif isinstance(step, RunBlock):
            for name in (*program.blocks[step.block].inputs, *step.allocates, *step.frees):
                touched[name] = position
        elif isinstance(step, (Load, SwapIn, Fetch)):
            touched[step.name] = position
        else:
            barrier = position
    order: list[int] = []
    for anchor in [-1] + [p for p, step in enumerate(steps) if not isinstance(step, SwapOut)]:
        stack = [anchor]
        while stack:  # the anchor, then what is behind it, the last moved first (each with its own behind it)
            position = stack.pop()
            if position >= 0:
                order.append(position)
            stack.extend(behind.get(position, ()))
    return dataclasses.replace(program, steps=tuple(steps[p] for p in order))


__all__ = ["issue_swap_outs_early"]
