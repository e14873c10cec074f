"""The planning target of a graph on a device: what the step planner needs, without a runtime.

The runner plans through it before it runs anything; ``ort-offload transform`` plans through
it alone, so the file it writes holds the plan a training run under the same budget makes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from graph_passes.cost.device_profiles import DeviceProfile, get_profile
from graph_passes.ir.program import order_dependent_last
from graph_passes.ir.training_graph import TrainingGraph
from graph_passes.planning.blocks import PlanningTarget
from graph_passes.planning.choice import Infeasible
from graph_passes.planning.driver import StepPlan, StepPlanner, describe_infeasible
from graph_passes.planning.swap.nodes import canonicalize, has_swap_nodes
from ort_offload.errors import BudgetTooSmallError
from ort_offload.runtime.offload_device import OffloadDevice


def planning_target(graph: TrainingGraph, device: OffloadDevice, *, fetches: Sequence[str] | None,
                    passes: Sequence[str], profile: Callable[[], DeviceProfile] | None = None) -> PlanningTarget:
    """``graph`` as the runtime runs it on ``device``. A graph that already carries swap nodes
    (from ``ort-offload transform``) runs its own swaps: its standard-op form is planned with
    the swaps fixed and no passes. Order-dependent nodes are scheduled last, in blocks of their
    own. ``profile``: the device profile plans are timed on (default: the device's planning
    profile, else the CPU's)."""
    model, swap_points, passes = graph.model, None, tuple(passes)
    if has_swap_nodes(graph.model):
        model, swap_points = canonicalize(graph.model)
        passes = ()
    if profile is None:
        profile = functools.cache(lambda: get_profile(device.planning_profile or "cpu"))
    return PlanningTarget(
        graph=graph, model=model, profile=profile, schedule=None if swap_points else order_dependent_last(model),
        swap_points=swap_points, fetches=fetches, passes=passes, alignment=device.alignment,
        max_block_nodes=device.max_block_nodes, measure_splits=device.kind == "cpu" and device.planning_profile is None,
        recompute_policy=device.recompute_policy, selective_recompute=device.selective_recompute,
        plan_time=device.plan_time, plan_seed=device.plan_seed,
    )


def plan_or_raise(planner: StepPlanner, input_infos, *, probe_feeds, resolve_budget) -> StepPlan:
    """The planner's plan for these shapes, or the budget error that says what would fit."""
    plan = planner.plan(input_infos, probe_feeds=probe_feeds, resolve_budget=resolve_budget)
    if isinstance(plan, Infeasible):
        raise BudgetTooSmallError(describe_infeasible(plan, planner.target.graph.name),
                                  needed_bytes=plan.needed_bytes, budget_bytes=plan.budget_bytes)
    return plan
