"""The planning target of a graph on a device: what the step planner needs, without a runtime.

The runner plans through it before it runs anything; ``ort-offload transform`` plans through
it alone, so the file it writes holds the plan a training run under the same budget makes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from graph_passes.cost.device_profiles import DeviceProfile, get_profile
from graph_passes.formatting import format_bytes
from graph_passes.ir.deterministic import scatter_adds_as_matmuls
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import order_dependent_last
from graph_passes.ir.training_graph import TrainingGraph
from graph_passes.planning.blocks import PlanningTarget
from graph_passes.planning.choice import Infeasible
from graph_passes.planning.driver import StepPlan, StepPlanner, describe_infeasible
from graph_passes.planning.swap.nodes import canonicalize, has_swap_nodes
from ort_offload.errors import BudgetTooSmallError
from ort_offload.runtime.offload_device import OffloadDevice


def planning_target(graph: TrainingGraph, device: OffloadDevice, *, fetches: Sequence[str] | None,
                    passes: Sequence[str], profile: Callable[[], DeviceProfile] | None = None,
                    session_bytes: int = 0, scatters_as_matmuls: bool = False) -> PlanningTarget:
    """``graph`` as the runtime runs it on ``device``. A graph that already carries swap nodes
    (from ``ort-offload transform``) runs its own swaps: its standard-op form is planned with
    the swaps fixed and no passes. Order-dependent nodes are scheduled last, in blocks of their
    own. ``profile``: the device profile plans are timed on (default: the device's planning
    profile, else the CPU's). ``scatters_as_matmuls``: scatter-adds become one-hot products,
    for a device whose scatter kernels add in a varying order (CUDA)."""
    model, swap_points, passes = graph.model, None, tuple(passes)
    if has_swap_nodes(graph.model):
        model, swap_points = canonicalize(graph.model)
        passes = ()
    if scatters_as_matmuls:  # a device whose scatter-add kernels race (graph_passes.ir.deterministic)
        model = scatter_adds_as_matmuls(model).model
    if profile is None:
        profile = functools.cache(lambda: get_profile(device.planning_profile or "cpu"))
    return PlanningTarget(
        graph=graph, model=model, profile=profile, schedule=None if swap_points else order_dependent_last(model),
        swap_points=swap_points, fetches=fetches, passes=passes, alignment=device.alignment,
        max_block_nodes=device.max_block_nodes, measure_splits=device.kind == "cpu" and device.planning_profile is None,
        cpu_kernels=device.kind == "cpu", intra_op_threads=device.intra_op_threads,
        recompute_policy=device.recompute_policy, selective_recompute=device.selective_recompute,
        plan_time=device.plan_time, plan_seed=device.plan_seed,
        plan_evaluations=device.plan_evaluations, plan_workers=device.plan_workers, session_bytes=session_bytes,
    )


def plan_or_raise(planner: StepPlanner, input_infos, *, probe_feeds, resolve_budget,
                  session_bytes: int = 0) -> StepPlan:
    """The planner's plan for these shapes, or the budget error that says what would fit.

    ``session_bytes``: device memory each block's session holds for as long as it exists
    (the CUDA EP's library handles). A plan of N blocks needs N of them beside its tensors;
    one that does not leave that room is planned again with it set aside."""
    reserve, name = 0, planner.target.graph.name
    for _ in range(_RESERVE_ROUNDS):
        plan = planner.plan(input_infos, probe_feeds=probe_feeds,
                            resolve_budget=functools.partial(_less, resolve_budget, reserve))
        if isinstance(plan, Infeasible):
            if not reserve:
                raise BudgetTooSmallError(describe_infeasible(plan, name, fixed_plan=planner.target.swap_points is not None),
                                          needed_bytes=plan.needed_bytes,
                                          budget_bytes=plan.budget_bytes)
            needed = plan.needed_bytes + reserve
            raise BudgetTooSmallError(
                f"budget {format_bytes(plan.budget_bytes + reserve)} leaves {format_bytes(plan.budget_bytes)} for "
                f"{name}'s tensors once its block sessions hold their own {format_bytes(reserve)}, and it needs "
                f"{format_bytes(plan.needed_bytes)}; raise the budget to at least {format_bytes(needed)} ({needed} bytes)",
                needed_bytes=needed, budget_bytes=plan.budget_bytes + reserve)
        sessions = len(plan.choice.program.blocks) * session_bytes
        budget = resolve_budget(planner.baseline_peak_bytes or 0)
        if budget is None or _tensor_need(planner, plan) + sessions <= budget:
            return plan
        reserve = max(sessions, reserve + session_bytes)
    raise BudgetTooSmallError(
        f"{name}: no plan leaves room for its block sessions' own memory ({format_bytes(session_bytes)} each) "
        "within the budget; raise the budget", needed_bytes=_tensor_need(planner, plan) + sessions,
        budget_bytes=budget)


_RESERVE_ROUNDS = 4


def _tensor_need(planner: StepPlanner, plan: StepPlan) -> int:
    """The least arena budget ``plan``'s program runs in (replayed again: planners' own traces
    may already count the sessions)."""
    return simulate_program(plan.choice.program, plan.infos, alignment=planner.target.alignment).min_budget_bytes


def _less(resolve_budget, reserve: int, baseline_peak_bytes: int) -> int | None:
    """The budget left for tensors once ``reserve`` bytes are set aside."""
    budget = resolve_budget(baseline_peak_bytes)
    return None if budget is None else budget - reserve
