"""Offline transformation of a training-step ONNX file: plan for a budget and write the plan
into the graph (``ort-offload transform``), and a summary of a graph (``ort-offload inspect``).

Planning is the runtime's own step planner (:mod:`graph_passes.planning.driver`, on the target
:func:`ort_offload.runtime.planning.planning_target` gives), run without a runtime: the file
written here holds exactly the swaps a training run under the same budget would make.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping

from custom_ops.registry import DOMAIN
from graph_passes.ir.shapes import check_inputs
from graph_passes.planning.recompute.graph_pass import PASS_KEY as PROVENANCE_KEY
from graph_passes.planning.recompute.graph_pass import PASS_NAME as RECOMPUTE_PASS
from graph_passes.planning.apply import apply_plan
from graph_passes.planning.swap.nodes import canonicalize, has_swap_nodes
from graph_passes.ir.program import SwapOut
from graph_passes.ir.training_graph import Role, TrainingGraph, role_counts
from ort_offload.budget import format_bytes
from ort_offload.budget_basis import FIRST_BATCH, BudgetBasis, basis_for, record_basis
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.export.graph_inputs import random_batch, random_state
from graph_passes.planning.driver import StepPlan, StepPlanner
from ort_offload.runtime.planning import plan_or_raise, planning_target


@dataclasses.dataclass(frozen=True)
class TransformResult:
    graph: TrainingGraph
    plan: StepPlan
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PlannedGraph:
    """A graph planned for one input signature on a device: the planner (its baseline and
    search records), the plan, and the budget in bytes (None: unlimited)."""

    planner: StepPlanner
    plan: StepPlan
    budget_bytes: int | None
    basis: BudgetBasis  # the unplanned peak a fraction budget resolves against (a planned graph's: recorded)


def plan_graph(graph: TrainingGraph, device: OffloadDevice, shapes: Mapping[str, tuple[int, ...]],
               passes: tuple[str, ...]) -> PlannedGraph:
    """Plan ``graph`` for its input signature on ``device`` (the runtime's planning, without a
    runtime). Without split: a graph that carries swap nodes is lowered without split views
    (its Splits would run as copies), so a split plan written into it would not keep the
    budget it was checked for."""
    passes = tuple(p for p in passes if p != "split")
    batch = random_batch(graph, shapes)
    feeds = {**random_state(graph), **batch}
    planner = StepPlanner(planning_target(graph, device, fetches=graph.step_fetches, passes=passes))
    batch_shapes = {n: tuple(a.shape) for n, a in batch.items()}
    recorded = basis_for(graph.model, graph.name, batch_shapes,
                         fraction=device.budget is not None and device.budget.is_fraction)
    bases: list[BudgetBasis] = []
    budget: list[int | None] = []

    def resolve_budget(peak: int) -> int | None:
        if not bases:
            bases.append(recorded or BudgetBasis(peak, FIRST_BATCH, batch_shapes))
        budget.append(None if device.budget is None else device.budget.resolve(bases[0].peak_bytes))
        return budget[-1]

    plan = plan_or_raise(planner, check_inputs(graph.model, feeds), probe_feeds=feeds, resolve_budget=resolve_budget)
    return PlannedGraph(planner, plan, budget[-1], bases[0])


def transform(graph: TrainingGraph, device: OffloadDevice, shapes: Mapping[str, tuple[int, ...]],
              passes: tuple[str, ...]) -> TransformResult:
    """The graph rewritten with the plan for ``device``'s budget, and a report of what changed.
    A graph planned before (swap nodes) is planned anew from its standard-op form, the original
    graph; a fraction budget is a fraction of the original's peak, recorded in its metadata."""
    graph = _without_swaps(graph)
    planned = plan_graph(graph, device, shapes, passes)
    plan, budget = planned.plan, planned.budget_bytes
    choice = plan.choice
    # The plan's rewrites (recompute's clones) and swaps in one pass manager run.
    applied = apply_plan(planned.planner.target.model, plan, budget=budget)
    model = applied.model
    swaps = [] if applied.swap_plan is None else _swap_rows(graph, plan, applied.swap_plan)
    roles = dict(graph.roles)
    for node in model.graph.node:
        if any(p.key == PROVENANCE_KEY and p.value == RECOMPUTE_PASS for p in node.metadata_props):
            roles.update({o: Role.ACTIVATION for o in node.output if o})
    for node in model.graph.node:  # host and device copies take the role of what they copy
        if node.domain == DOMAIN:
            source = node.input[0]
            for out in node.output:
                roles.setdefault(out, roles.get(source.split("__")[0], Role.ACTIVATION))
    record_basis(model, planned.basis)  # run/transform of the output resolve fractions against it
    rewritten = TrainingGraph(model, roles, dict(graph.state_pairs), name=graph.name)
    profile = planned.planner.target.profile()
    report = {
        "model": graph.name,
        "budget_bytes": budget,
        "baseline_peak_bytes": planned.basis.peak_bytes,
        "planned_peak_bytes": choice.trace.peak_device_bytes,
        "planning_profile": profile.name if choice.swap_plan is not None else None,
        "blocks": len(choice.program.blocks),
        "passes": list(choice.passes),
        "recomputed_nodes": plan.recomputed_nodes,
        "swap_out_bytes_per_step": sum(s["bytes"] for s in swaps if s["op"] == "swap_out" and s["copy"]),
        "swap_in_bytes_per_step": sum(s["bytes"] for s in swaps if s["op"] == "swap_in"),
        "host_state": list(choice.program.host_state),  # state kept on the host between steps
        "swaps": swaps,
        "nodes_before": len(graph.graph.node),
        "nodes_after": len(model.graph.node),
    }
    if choice.swap_plan is not None and profile.copies_overlap_compute:
        from ort_offload.plan_expectations import expected_step

        report.update(expected_step(planned.planner, plan, budget))
    return TransformResult(rewritten, plan, report)


def _without_swaps(graph: TrainingGraph) -> TrainingGraph:
    """``graph`` without the swap nodes an earlier transform wrote (the values keep their names)."""
    if not has_swap_nodes(graph.model):
        return graph
    model, _ = canonicalize(graph.model)
    names = {v for n in model.graph.node for v in (*n.input, *n.output)} | {v.name for v in model.graph.input}
    roles = {n: r for n, r in graph.roles.items() if n in names}
    return TrainingGraph(model, roles, dict(graph.state_pairs), name=graph.name)


def _swap_rows(graph: TrainingGraph, plan: StepPlan, placed) -> list[dict]:
    """One report row per swap the written graph carries: what, where, and why."""
    rows = []
    for index, batch in placed.before:
        for swap in batch:
            kind = "swap_out" if isinstance(swap, SwapOut) else "swap_in"
            rows.append({
                "tensor": swap.name, "op": kind, "bytes": plan.infos[swap.name].nbytes,
                "before_step": index, "copy": getattr(swap, "copy", True),
                "role": graph.roles.get(swap.name, Role.ACTIVATION).value,
                "why": "evicted (Belady: used furthest in the future), issued right after its last use"
                if kind == "swap_out" else "needed by a later step; issued as early as memory allows",
            })
    return rows


def inspect_graph(graph: TrainingGraph, device: OffloadDevice, shapes: Mapping[str, tuple[int, ...]] | None) -> dict:
    """Roles, sizes, op mix and (with concrete shapes) the unplanned peak and largest ops."""
    from graph_passes.ir.shapes import declared_inputs

    declared = declared_inputs(graph.model)
    summary: dict[str, Any] = {
        "model": graph.name,
        "nodes": len(graph.graph.node),
        "opset": {o.domain or "ai.onnx": o.version for o in graph.model.opset_import},
        "roles": role_counts(graph.roles),
        "batch_inputs": {n: [d for d in (declared[n][1] or ())] for n in graph.data_inputs},
        "state_inputs": len(graph.state_inputs),
        "op_types": dict(collections.Counter(n.op_type for n in graph.graph.node).most_common(12)),
    }
    symbolic = any(not isinstance(d, int) or d <= 0 for n in graph.data_inputs for d in (declared[n][1] or ()))
    if shapes is None and symbolic:
        summary["note"] = "pass --input NAME=DIMS for every symbolic batch input to get sizes and the unplanned peak"
        return summary
    planned = plan_graph(graph, device, shapes or {}, ())
    infos = planned.plan.infos
    state_bytes = {role: 0 for role in ("param", "optimizer_state", "buffer")}
    for name in graph.state_inputs:
        role = graph.roles[name].value
        if role in state_bytes:
            state_bytes[role] += infos[name].nbytes
    largest = sorted(
        ((sum(infos[o].nbytes for o in n.output if o in infos), n.op_type, n.name) for n in graph.graph.node),
        reverse=True,
    )[:8]
    summary.update({
        "state_bytes": state_bytes,
        "baseline_peak_bytes": planned.planner.baseline_trace.peak_device_bytes,
        "largest_ops": [{"op": op, "node": name, "output_bytes": size, "output": format_bytes(size)} for size, op, name in largest],
    })
    return summary

