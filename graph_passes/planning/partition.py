"""Memory-aware block partition: blocks as large as the budget allows, small only where memory
is tight.

Cutting a step into execution blocks of N nodes everywhere (``lower(max_block_nodes=N)``) makes
every block as small as the tightest point of the step needs, and each cut costs time (one more
ONNX Runtime session call, fusions lost across it). :func:`fit_blocks` starts from one block
and halves only the blocks at which the memory replay (:func:`graph_passes.ir.memory.simulate_program`)
exceeds the budget — live arena bytes plus the block's own outputs and workspace — until every
block fits or the ones that do not are single nodes. Splitting a block lowers its own
requirement (fewer outputs allocated at its start, a smaller workspace), so each round makes
progress. :func:`refine_blocks` is the same refinement for any notion of "over": the swap
planner uses it to find the largest blocks each of which alone fits
(:func:`graph_passes.planning.swap.planner.blocks_over`).
"""

from __future__ import annotations

from typing import Callable, Mapping

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT
from graph_passes.ir.memory import MemoryTrace, simulate_program
from graph_passes.ir.program import Program
from graph_passes.ir.shapes import TensorInfo

MAX_ROUNDS = 24


def fit_blocks(
    lower_with_cuts: Callable[[tuple[int, ...]], Program],
    infos: Mapping[str, TensorInfo],
    *,
    budget: int,
    position_of: Mapping[int, int],
    alignment: int = DEFAULT_ALIGNMENT,
    max_blocks: int | None = None,
) -> tuple[Program, MemoryTrace] | None:
    """The program (and its replay) this refinement finds that fits ``budget``; None if a
    single node alone does not fit (or the rounds run out), or if it would take more than
    ``max_blocks`` blocks.

    ``lower_with_cuts(cuts)`` lowers the graph with block boundaries at those schedule
    positions (on top of the ones the lowering makes itself); ``position_of`` maps a node index
    to its schedule position."""

    def over_budget(program: Program) -> tuple[set[int], MemoryTrace]:
        trace = simulate_program(program, infos, alignment=alignment)
        over = {int(p.label.split()[1]) for p in trace.timeline
                if p.label.startswith("block ") and p.in_use + p.workspace > budget}
        return (over if trace.min_budget_bytes > budget else set()), trace

    return refine_blocks(lower_with_cuts, over_budget, position_of=position_of, max_blocks=max_blocks)


def refine_blocks(
    lower_with_cuts: Callable[[tuple[int, ...]], Program],
    over_budget: Callable[[Program], tuple[set[int], object]],
    *,
    position_of: Mapping[int, int],
    max_blocks: int | None = None,
):
    """Halve the blocks ``over_budget`` names until it names none; returns (program, what
    ``over_budget`` returned with it), or None when only single nodes are over or the
    program has grown past ``max_blocks`` blocks (rounds only add cuts, so a caller that
    cannot use more blocks stops there without checking the rest)."""
    cuts: set[int] = set()
    for _ in range(MAX_ROUNDS):
        program = lower_with_cuts(tuple(sorted(cuts)))
        if max_blocks is not None and len(program.blocks) > max_blocks:
            return None
        over, detail = over_budget(program)
        if not over:
            return program, detail
        added = False
        for index in sorted(over):
            block = program.blocks[index]
            if len(block.node_indices) > 1:
                positions = sorted(position_of[i] for i in block.node_indices)
                cuts.add(positions[len(positions) // 2])
                added = True
        if not added:
            return None
    return None


__all__ = ["fit_blocks", "refine_blocks"]
