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

from graph_passes.ir.program import Fetch, Load, Program, RunBlock, Step, SwapIn, SwapOut


def _blocks_eviction(program: Program, step: Step, name: str) -> bool:
    """Whether a ``SwapOut`` of ``name`` cannot move above ``step``."""
    if isinstance(step, (Load, SwapIn, SwapOut, Fetch)):
        return step.name == name
    if isinstance(step, RunBlock):
        block = program.blocks[step.block]
        return name in block.inputs or name in step.allocates or name in step.frees
    return True  # a Commit, or a step kind this pass does not know


def issue_swap_outs_early(program: Program) -> Program:
    """``program`` with each ``SwapOut`` right after the last step before it that touches its
    tensor (see the module docstring). Only ``SwapOut`` positions change."""
    steps = list(program.steps)
    for position in range(len(steps)):
        step = steps[position]
        if not isinstance(step, SwapOut):
            continue
        target = position
        while target > 0 and not _blocks_eviction(program, steps[target - 1], step.name):
            target -= 1
        if target < position:
            steps.insert(target, steps.pop(position))
    return dataclasses.replace(program, steps=tuple(steps))


__all__ = ["issue_swap_outs_early"]
