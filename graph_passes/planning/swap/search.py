"""Overlap-aware swap planning: choose, by simulated step time, how a program is cut into
blocks and which state lives on the host between steps, for a swap plan under a budget.

The Belady planner (:mod:`graph_passes.planning.swap.planner`) decides *what* leaves the arena for one
program. How much of the copying hides under compute depends on choices it does not make
(SwapAdvisor §4 searches them jointly with a simulator in the loop; we search a small,
structured space exhaustively):

- **Block size.** A tensor can leave only after the block that last reads it ends, and a
  block's outputs are all allocated when it starts; smaller blocks let copies start sooner and
  spread allocations out, at a per-block cost (``DeviceProfile.block_overhead_s``).
- **State placement.** Optimizer state is first read at the end of the step: kept on the
  device, it sits in the arena through the memory peak of forward and backward and has to be
  copied out *then*, when the link is busiest. Kept on the host between steps, it comes in
  for the update and its new value goes back right after. Candidates: none on the host
  (Belady's own steady state), the state first read after the program's memory peak, and all
  state.

Each candidate is planned, its swap-outs issued early (:mod:`graph_passes.planning.swap.eviction`), its
swap-ins hoisted (:mod:`graph_passes.planning.swap.prefetch`), checked against the budget with the arena
replay (:func:`graph_passes.ir.memory.simulate_program`), and timed by the caller's ``evaluate``
(normally :func:`graph_passes.cost.simulator.simulate_time` on the target's profile). The fastest
wins; ties go to the larger blocks and then to fewer state tensors on the host.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Sequence

from graph_passes.planning.swap.eviction import issue_swap_outs_early
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.memory import MemoryTrace, simulate_program
from graph_passes.planning.swap.prefetch import hoist_swap_ins
from graph_passes.ir.program import Program, RunBlock
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.swap.planner import (
    EVICT_BELADY, EVICTION_ORDERS, Infeasible, SwapPlan, SwapPlanner, apply_swap_plan,
)

logger = logging.getLogger(__name__)

# How many block sizes, from the largest that plans downwards, are tried (each the previous
# one's half, as lowered by the caller).
DEFAULT_MAX_BLOCK_SIZES = 5

STATE_NONE, STATE_AFTER_PEAK, STATE_ALL = "none", "after_peak", "all"
STATE_PLACEMENTS = (STATE_NONE, STATE_AFTER_PEAK, STATE_ALL)


@dataclasses.dataclass(frozen=True)
class SwapCandidate:
    """One planned program the search considered."""

    base_program: Program  # the lowered program before swaps
    plan: SwapPlan
    program: Program  # with swaps placed
    trace: MemoryTrace | None  # None: checked against the budget only (a GA genome's), not replayed in full
    state_placement: str
    step_time_s: float


@dataclasses.dataclass(frozen=True)
class SwapSearchResult:
    best: SwapCandidate
    # (blocks, placement with "+clean_first" where that order planned it, seconds or None if over budget)
    considered: tuple[tuple[int, str, float | None], ...]


def state_first_read_after_peak(program: Program, infos: Mapping[str, TensorInfo], *, alignment: int) -> frozenset[str]:
    """State inputs no block reads before the block at which the unplanned program's live
    bytes peak: they only take room there."""
    trace = simulate_program(program, infos, alignment=alignment, steps=1)
    peak_label = max(trace.timeline, key=lambda p: p.in_use + p.workspace).label
    peak_position = next(
        (i for i, s in enumerate(program.steps) if isinstance(s, RunBlock) and f"block {s.block}" == peak_label),
        len(program.steps),
    )
    first_read: dict[str, int] = {}
    for position, step in enumerate(program.steps):
        if isinstance(step, RunBlock):
            for name in program.blocks[step.block].inputs:
                first_read.setdefault(name, position)
    return frozenset(n for n in program.state_inputs if first_read.get(n, len(program.steps)) > peak_position)


class SwapSearch:
    """Exhaustive search over block size × state placement (see the module docstring)."""

    def __init__(
        self,
        *,
        planner: SwapPlanner | None = None,
        max_block_sizes: int = DEFAULT_MAX_BLOCK_SIZES,
        state_placements: Sequence[str] = STATE_PLACEMENTS,
        early_swap_outs: bool = True,
        while_improving: bool = False,
        eviction_orders: Sequence[str] = (EVICT_BELADY,),
    ) -> None:
        unknown = set(state_placements) - set(STATE_PLACEMENTS)
        if unknown:
            raise ValueError(f"unknown state placements {sorted(unknown)}: use {', '.join(STATE_PLACEMENTS)}")
        if not eviction_orders or set(eviction_orders) - set(EVICTION_ORDERS):
            raise ValueError(f"eviction orders {list(eviction_orders)}: use some of {', '.join(EVICTION_ORDERS)}")
        self.planner = planner or SwapPlanner()
        self.max_block_sizes = max_block_sizes
        self.state_placements = tuple(state_placements)
        # Issuing swap-outs early pays where copies overlap compute (a GPU's copy engines).
        self.early_swap_outs = early_swap_outs
        # Go on past `max_block_sizes` while the last block size tried was the fastest so far
        # (the trend has not turned yet), down to the smallest lowering given.
        self.while_improving = while_improving
        # The planner's victim orders tried per placement (a grid dimension).
        self.eviction_orders = tuple(eviction_orders)

    def search(
        self,
        programs: Sequence[Program],
        infos: Mapping[str, TensorInfo],
        *,
        budget: int,
        evaluate: Callable[[Program], float],
        alignment: int = DEFAULT_ALIGNMENT,
        session_bytes: int = 0,
    ) -> SwapSearchResult | None:
        """The fastest plan within ``budget`` over ``programs`` (the same graph lowered with
        decreasing block sizes, largest first); ``None`` if none plans. ``session_bytes``:
        what each block's session holds apart from its tensors (taken from the budget per block,
        so that smaller blocks stop paying off once their sessions cost the memory they free)."""
        total_budget = budget
        sizes = {n: align_up(i.nbytes, alignment) for n, i in infos.items()}
        best: SwapCandidate | None = None
        last_planned: Program | None = None
        considered = []
        tried = 0
        for program in programs:
            if tried >= self.max_block_sizes and not (self.while_improving and best is not None
                                                      and best.base_program is last_planned):
                break
            budget = total_budget - len(program.blocks) * session_bytes
            if budget <= 0:
                break  # smaller blocks only mean more sessions
            planned_any = False
            for label, host_state in self._placements(program, infos, alignment):
                timed: dict[SwapPlan, SwapCandidate | MemoryTrace] = {}
                for order in self.eviction_orders:
                    found = self._candidate(program, infos, sizes, budget, alignment, evaluate, host_state, order,
                                            timed)
                    if found is None:
                        break  # infeasible: the same for every placement and order of this program
                    planned_any = True
                    seconds = found.step_time_s if isinstance(found, SwapCandidate) else None
                    considered.append((len(program.blocks), _label(label, order), seconds))
                    if seconds is not None and (best is None or seconds < best.step_time_s):
                        best = dataclasses.replace(found, state_placement=label)
                if not planned_any:
                    break
            if planned_any:
                tried += 1
                last_planned = program
        if best is None:
            return None
        logger.info(
            "swap search: %d candidates, chose %d blocks with state placement %r, %s victims (%.3g s simulated)",
            len(considered), len(best.base_program.blocks), best.state_placement, best.plan.eviction, best.step_time_s,
        )
        return SwapSearchResult(best, tuple(considered))

    def _candidate(self, program: Program, infos, sizes, budget: int, alignment: int, evaluate, host_state,
                   order: str, timed: dict) -> SwapCandidate | MemoryTrace | None:
        """One placement and victim order planned, placed and timed; the arena trace alone
        where the placed program does not fit ``budget``; None where no plan fits. ``timed``:
        the results by plan (victim order aside) of this placement's other orders, which often
        plan alike: such a plan is not placed and timed again."""
        plan = self.planner.plan(program, sizes, budget, host_state=host_state, eviction=order)
        if isinstance(plan, Infeasible):
            return None
        key = dataclasses.replace(plan, eviction=EVICT_BELADY)
        if key in timed:
            return timed[key]
        timed[key] = self._placed(program, plan, infos, budget, alignment, evaluate)
        return timed[key]

    def _placed(self, program: Program, plan: SwapPlan, infos, budget: int, alignment: int,
                evaluate) -> SwapCandidate | MemoryTrace:
        """``plan`` applied, its copies placed, replayed and timed (the trace alone if over ``budget``)."""
        applied = apply_swap_plan(program, plan)
        if self.early_swap_outs:
            applied = issue_swap_outs_early(applied)
        placed = hoist_swap_ins(applied, infos, budget=budget, alignment=alignment)
        trace = simulate_program(placed, infos, budget=budget, alignment=alignment)
        if trace.min_budget_bytes > budget:
            return trace
        return SwapCandidate(program, plan, placed, trace, "", evaluate(placed))

    def _placements(self, program: Program, infos, alignment: int) -> list[tuple[str, frozenset[str] | None]]:
        options: list[tuple[str, frozenset[str] | None]] = []
        seen: set[frozenset[str]] = set()
        for label in self.state_placements:
            if label == STATE_NONE:
                options.append((label, None))  # Belady's own steady state
                continue
            chosen = (state_first_read_after_peak(program, infos, alignment=alignment) if label == STATE_AFTER_PEAK
                      else frozenset(program.state_inputs))
            if chosen and chosen not in seen:
                seen.add(chosen)
                options.append((label, chosen))
        return options


def _label(placement: str, order: str) -> str:
    return placement if order == EVICT_BELADY else f"{placement}+{order}"


__all__ = [
    "STATE_PLACEMENTS", "SwapCandidate", "SwapSearch", "SwapSearchResult", "state_first_read_after_peak",
]
