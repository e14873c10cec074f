"""``transform`` writes a plan by its passes: they rebuild, from the original graph, the graph
the planner planned on."""

from __future__ import annotations

from graph_passes.planning.apply import apply_plan
from helpers import step_graph_and_feeds
from ort_offload.device import set_offload_device
from ort_offload.transform import plan_graph


def test_a_recompute_plans_passes_rebuild_the_graph_it_was_planned_on():
    graph, feeds, _ = step_graph_and_feeds("gpt")
    shapes = {n: feeds[n].shape for n in graph.data_inputs}
    planned = plan_graph(graph, set_offload_device("cpu", budget="0.75x"), shapes, ("recompute",))
    plan = planned.plan
    assert [type(p).__name__ for p in plan.rewrites] == ["RecomputePass"] and plan.recomputed_nodes > 0
    applied = apply_plan(planned.planner.target.model, plan, budget=planned.budget_bytes)
    assert applied.swap_plan is None
    assert len(applied.model.graph.node) == len(graph.model.graph.node) + plan.recomputed_nodes
    assert applied.model.SerializeToString() == plan.model.SerializeToString()
