"""How a swap plan was searched: the grid (:mod:`graph_passes.planning.swap.search`), then, where copies
overlap compute, the genetic search (:mod:`graph_passes.planning.swap.ga`) seeded with the grid's best.

The step planner calls :func:`refine_swap_plan` on the grid's choice; it returns the plan to use
and a :class:`PlanSearch` record that reports and the benchmark read.
"""

from __future__ import annotations

import dataclasses
import time

from graph_passes.planning.swap.ga import GAConfig, GeneticSwapSearch, SearchSpace
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def refine_swap_plan(layouts, choice, seconds: float, infos, budget: int, model):
    """``choice`` (the grid's :class:`~graph_passes.planning.choice.ProgramChoice`) improved by
    the GA within the target's plan time; returns (choice, seconds, PlanSearch)."""
    target = layouts.target
    if target.plan_time <= 0:
        return choice, seconds, PlanSearch(GRID, seconds, seconds, 0.0)
    seed = SwapCandidate(choice.base, choice.swap_plan, choice.program, choice.trace, "grid", seconds)
    space = SearchSpace(
        model=model, infos=infos, budget=budget, alignment=target.alignment,
        lower=lambda schedule, cuts: layouts.lower_with_cuts(model, infos, list(schedule), cuts),
        evaluate=lambda p: layouts.simulated_time(p, infos, model, budget),
    )
    started = time.perf_counter()
    result = GeneticSwapSearch(GAConfig(time_limit_s=target.plan_time, seed=target.plan_seed)).search(seed, space)
    best = result.best
    record = PlanSearch(GA, seconds, best.step_time_s, time.perf_counter() - started, result.generations,
                        result.evaluations, result.stopped)
    if not result.improved:
        return choice, seconds, record
    improved = dataclasses.replace(choice, program=best.program, trace=best.trace, base_program=best.base_program,
                                   swap_plan=best.plan)
    return improved, best.step_time_s, record


__all__ = ["GA", "GRID", "PlanSearch", "refine_swap_plan"]
