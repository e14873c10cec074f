"""What a transform expects of the plan it wrote, on its planning profile: the simulated step
time, the same graph's with unlimited memory, the lower bound (:mod:`graph_passes.cost.step_bound`)
and how the plan was searched (:mod:`graph_passes.planning.swap.plan_search`)."""

from __future__ import annotations

from graph_passes.cost.simulator import simulate_time, unlimited_time
from graph_passes.cost.step_bound import step_time_bound


def expected_step(runner, prepared, budget: int) -> dict:
    """Report keys ``simulated_step_time_s``, ``simulated_unlimited_step_time_s``,
    ``step_time_lower_bound_s`` (with its arithmetic) and ``plan_search``."""
    profile = runner.runtime.planning_profile()
    model = prepared.model if prepared.model is not None else runner.model
    trace = simulate_time(prepared.program, prepared.infos, model=model, profile=profile, budget=budget,
                          alignment=runner.runtime.device.alignment)
    layouts = runner.planner.layouts
    whole = layouts.lower_program(runner.model, prepared.infos, runner.schedule,
                                  max_block_nodes=len(runner.model.graph.node))
    finest = layouts.lower_program(runner.model, prepared.infos, runner.schedule, max_block_nodes=1)
    bound = step_time_bound(finest, prepared.infos, model=runner.model, profile=profile, budget=budget,
                            alignment=runner.runtime.device.alignment)
    search = runner.last_plan_search
    return {
        "simulated_step_time_s": trace.step_time_s,
        "simulated_unlimited_step_time_s": unlimited_time(whole, prepared.infos, model=runner.model, profile=profile),
        "step_time_lower_bound_s": bound.seconds,
        "step_time_lower_bound": bound.describe(),
        "plan_search": search.to_json() if search is not None else None,
    }
