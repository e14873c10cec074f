"""How a swap plan was searched: the grid (:mod:`graph_passes.planning.swap.search`), then, where copies
overlap compute, the genetic search (:mod:`graph_passes.planning.swap.ga`) seeded with the grid's best.

The step planner calls :func:`refine_swap_plan` on the grid's choice; it returns the plan to use
(:class:`Refined`: where the GA recomputed tensors, on the rewritten graph its ``variant`` gives)
and a :class:`PlanSearch` record that reports and the benchmark read.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

from graph_passes.ir.memory import simulate_program
from graph_passes.planning.swap.ga import GAConfig, GeneticSwapSearch, SearchSpace, Variant
from graph_passes.planning.swap.search import SwapCandidate

GRID, GA = "grid", "ga"


@dataclasses.dataclass(frozen=True)
class PlanSearch:
    """Which search chose the plan, and what it found."""

    method: str  # GRID or GA (the GA ran; its plan may be the grid's own)
    grid_step_time_s: float
    step_time_s: float
    time_s: float  # the GA's seconds (0 for the grid alone)
    generations: int = 0
    evaluations: int = 0
    stopped: str = ""
    recomputed_tensors: int = 0  # tensors the GA chose to recompute (recompute genes)
    feasible_evaluations: int = 0  # evaluations whose plan lowered and fit the budget
    lead_evaluations: int = 0  # evaluations after the search pulling batch-independent nodes first

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Refined:
    """The plan to use, its simulated seconds, how it was searched, and the graph it runs
    where the GA recomputed tensors (None: the graph given)."""

    choice: object  # graph_passes.planning.choice.ProgramChoice
    seconds: float
    search: PlanSearch
    variant: Variant | None = None


def refine_swap_plan(layouts, choice, seconds: float, infos, budget: int, model, *,
                     recompute: Callable[[frozenset[str]], Variant] | None = None,
                     recompute_ratio: Mapping[str, float] | None = None, others=(),
                     time_left_s: float | None = None) -> Refined:
    """``choice`` (the grid's :class:`~graph_passes.planning.choice.ProgramChoice`) improved by
    the GA within the target's plan time. ``recompute``: the graph with some saved values
    recomputed (the GA's recompute genes, priced by ``recompute_ratio``); None: swap genes only.
    ``others``: more grid choices of the same graph (other schedules' best), tried in the GA's
    first generation. ``time_left_s``: what planning has left of the plan time (None: all of
    it); where nothing is left, the grid's plan stands (``stopped`` "time")."""
    target = layouts.target
    if target.plan_time <= 0:
        return Refined(choice, seconds, PlanSearch(GRID, seconds, seconds, 0.0))
    time_limit_s = target.plan_time if time_left_s is None else min(target.plan_time, time_left_s)
    if time_limit_s <= 0:
        return Refined(choice, seconds, PlanSearch(GRID, seconds, seconds, 0.0, stopped="time"))
    seed = _grid_candidate(choice, seconds)
    space = SearchSpace(
        model=model, infos=infos, budget=budget, alignment=target.alignment,
        lower=lambda schedule, cuts: layouts.lower_with_cuts(model, infos, list(schedule), cuts),
        evaluate=lambda p: layouts.simulated_time(p, infos, model, budget),
        recompute=recompute, recompute_ratio=dict(recompute_ratio or {}),
    )
    started = time.perf_counter()
    extra = tuple(_grid_candidate(other, float("inf")) for other in others)  # the GA times them itself
    result = GeneticSwapSearch(GAConfig(time_limit_s=time_limit_s, seed=target.plan_seed,
                                         max_evaluations=target.plan_evaluations,
                                         workers=target.plan_workers)).search(seed, space, extra)
    best = result.best
    recomputed = len(result.genome.recomputed) if result.genome is not None else 0
    record = PlanSearch(GA, seconds, best.step_time_s, time.perf_counter() - started, result.generations,
                        result.evaluations, result.stopped, recomputed, result.feasible, result.lead_evaluations)
    if not result.improved:
        return Refined(choice, seconds, record)
    trace = best.trace or simulate_program(best.program, result.variant.infos if result.variant is not None else infos,
                                           budget=budget, alignment=target.alignment)  # a GA genome's: not replayed yet
    if trace.min_budget_bytes > budget:  # the GA checked its need in one step where two repeat it
        raise RuntimeError(f"the GA's plan needs {trace.min_budget_bytes} bytes in the full replay, over the budget "
                           f"{budget}: a planner bug, report it with the model and budget")
    improved = dataclasses.replace(choice, program=best.program, trace=trace, base_program=best.base_program,
                                   swap_plan=best.plan)
    return Refined(improved, best.step_time_s, record, result.variant)


def _grid_candidate(choice, seconds: float) -> SwapCandidate:
    """A grid :class:`~graph_passes.planning.choice.ProgramChoice` as the GA's seed type."""
    return SwapCandidate(choice.base, choice.swap_plan, choice.program, choice.trace, "grid", seconds)


__all__ = ["GA", "GRID", "PlanSearch", "Refined", "refine_swap_plan"]
