"""What a transform expects of the plan it wrote, on its planning profile: the simulated step
time, the same graph's with unlimited memory, the lower bound (:mod:`graph_passes.cost.step_bound`)
and how the plan was searched (:mod:`graph_passes.planning.swap.plan_search`)."""

from __future__ import annotations

from graph_passes.cost.simulator import simulate_time, unlimited_time
from graph_passes.cost.step_bound import step_time_bound


def expected_step(planner, plan, budget: int) -> dict:
    """Report keys ``simulated_step_time_s``, ``simulated_unlimited_step_time_s``,
    ``step_time_lower_bound_s`` (with its arithmetic) and ``plan_search``, for ``plan`` made by
    ``planner`` (:class:`graph_passes.planning.driver.StepPlanner`)."""
    target, layouts = planner.target, planner.layouts
    profile = target.profile()
    trace = simulate_time(plan.choice.program, plan.infos, model=plan.model, profile=profile, budget=budget,
                          alignment=target.alignment)
    nodes = len(target.model.graph.node)
    whole = layouts.lower_program(target.model, plan.infos, target.schedule, max_block_nodes=nodes)
    finest = layouts.lower_program(target.model, plan.infos, target.schedule, max_block_nodes=1)
    bound = step_time_bound(finest, plan.infos, model=target.model, profile=profile, budget=budget,
                            alignment=target.alignment)
    search = planner.last_plan_search
    return {
        "simulated_step_time_s": trace.step_time_s,
        "simulated_unlimited_step_time_s": unlimited_time(whole, plan.infos, model=target.model, profile=profile),
        "step_time_lower_bound_s": bound.seconds,
        "step_time_lower_bound": bound.describe(),
        "plan_search": search.to_json() if search is not None else None,
    }
