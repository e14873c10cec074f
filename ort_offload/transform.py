"""Offline transformation of a training-step ONNX file: plan for a budget and write the plan
into the graph (``ort-offload transform``), and a summary of a graph (``ort-offload inspect``).

Planning is the runtime's own (:class:`ort_offload.runtime.runner.GraphRunner.prepare`), so the file
written here holds exactly the swaps a training run under the same budget would make.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping

import onnx_ir as ir

from custom_ops.registry import DOMAIN
from graph_passes.ir.shapes import check_inputs
from graph_passes.planning.recompute.graph_pass import PASS_KEY as PROVENANCE_KEY
from graph_passes.planning.recompute.graph_pass import PASS_NAME as RECOMPUTE_PASS
from graph_passes.planning.swap.graph_pass import SwapPass
from graph_passes.planning.swap.planner import placed_plan
from graph_passes.ir.program import SwapOut
from graph_passes.ir.training_graph import Role, TrainingGraph, role_counts
from ort_offload.budget import format_bytes
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.export.graph_inputs import random_batch, random_state
from ort_offload.runtime.runner import GraphRunner, PreparedStep, Runtime


@dataclasses.dataclass(frozen=True)
class TransformResult:
    graph: TrainingGraph
    prepared: PreparedStep
    report: dict[str, Any]


def plan_graph(graph: TrainingGraph, device: OffloadDevice, shapes: Mapping[str, tuple[int, ...]],
               passes: tuple[str, ...]) -> tuple[GraphRunner, PreparedStep]:
    """Plan ``graph`` for its input signature on ``device`` (the runtime's planning). Without
    split: a graph that carries swap nodes is lowered without split views (its Splits would run
    as copies), so a split plan written into it would not keep the budget it was checked for."""
    passes = tuple(p for p in passes if p != "split")
    feeds = {**random_state(graph), **random_batch(graph, shapes)}
    runner = GraphRunner(Runtime(device), graph, fetches=graph.step_fetches, passes=passes)
    prepared = runner.prepare(check_inputs(graph.model, feeds), probe_feeds=feeds)
    return runner, prepared


def transform(graph: TrainingGraph, device: OffloadDevice, shapes: Mapping[str, tuple[int, ...]],
              passes: tuple[str, ...]) -> TransformResult:
    """The graph rewritten with the plan for ``device``'s budget, and a report of what changed."""
    runner, prepared = plan_graph(graph, device, shapes, passes)
    budget = runner.runtime.budget_bytes
    model = prepared.model if prepared.model is not None else graph.model  # with recompute's clones
    swaps = []
    if prepared.swap_plan is not None:
        # The swaps where the runtime runs them (early swap-outs, hoisted swap-ins).
        plan = placed_plan(prepared.swap_plan, prepared.program)
        result = SwapPass(prepared.base_program, plan, prepared.infos, budget=budget)(ir.from_proto(model))
        model = ir.to_proto(result.model)
        for index, batch in plan.before:
            for swap in batch:
                kind = "swap_out" if isinstance(swap, SwapOut) else "swap_in"
                swaps.append({
                    "tensor": swap.name, "op": kind, "bytes": prepared.infos[swap.name].nbytes,
                    "before_step": index, "copy": getattr(swap, "copy", True),
                    "role": graph.roles.get(swap.name, Role.ACTIVATION).value,
                    "why": "evicted (Belady: used furthest in the future), issued right after its last use"
                    if kind == "swap_out" else "needed by a later step; issued as early as memory allows",
                })
    roles = dict(graph.roles)
    for node in model.graph.node:
        if any(p.key == PROVENANCE_KEY and p.value == RECOMPUTE_PASS for p in node.metadata_props):
            roles.update({o: Role.ACTIVATION for o in node.output if o})
    for node in model.graph.node:  # host and device copies take the role of what they copy
        if node.domain == DOMAIN:
            source = node.input[0]
            for out in node.output:
                roles.setdefault(out, roles.get(source.split("__")[0], Role.ACTIVATION))
    rewritten = TrainingGraph(model, roles, dict(graph.state_pairs), name=graph.name)
    baseline = runner.baseline_trace
    report = {
        "model": graph.name,
        "budget_bytes": budget,
        "baseline_peak_bytes": baseline.peak_device_bytes,
        "planned_peak_bytes": prepared.trace.peak_device_bytes,
        "planning_profile": runner.runtime.planning_profile().name if prepared.swap_plan is not None else None,
        "blocks": len(prepared.program.blocks),
        "passes": list(prepared.passes),
        "recomputed_nodes": prepared.recomputed_nodes,
        "swap_out_bytes_per_step": sum(s["bytes"] for s in swaps if s["op"] == "swap_out" and s["copy"]),
        "swap_in_bytes_per_step": sum(s["bytes"] for s in swaps if s["op"] == "swap_in"),
        "host_state": list(prepared.program.host_state),  # state kept on the host between steps
        "swaps": swaps,
        "nodes_before": len(graph.graph.node),
        "nodes_after": len(model.graph.node),
    }
    if prepared.swap_plan is not None and runner.runtime.planning_profile().copies_overlap_compute:
        from ort_offload.plan_expectations import expected_step

        report.update(expected_step(runner, prepared, budget))
    return TransformResult(rewritten, prepared, report)


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
    runner, prepared = plan_graph(graph, device, shapes or {}, ())
    infos = prepared.infos
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
        "baseline_peak_bytes": runner.baseline_trace.peak_device_bytes,
        "largest_ops": [{"op": op, "node": name, "output_bytes": size, "output": format_bytes(size)} for size, op, name in largest],
    })
    return summary

