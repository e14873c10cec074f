"""Writing a step plan into its graph: the plan's rewrites (recompute or split) and then its
swaps, each group an ``onnx_ir`` pass manager run over the same model (between them, a check
that the rewrites gave the graph the swaps were planned on).

The planner hands its rewritten graphs around as protobuf (it infers their shapes and lowers
them); a plan also carries the passes that made them (:attr:`StepPlan.rewrites`), so writing it
out starts again from the planner's own graph: one conversion to ``onnx_ir``, every pass in
place with its ``requires``/``ensures`` (the swap pass's re-checks the budget in the memory
simulator), one conversion back.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx_ir as ir
import onnx_ir.passes

from graph_passes.planning.driver import StepPlan
from graph_passes.planning.swap.graph_pass import SwapPass
from graph_passes.planning.swap.planner import SwapPlan, placed_plan


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """The graph with the plan written in, and the swaps it holds (placed where the runtime
    issues them: early swap-outs, hoisted swap-ins), None where the plan swaps nothing."""

    model: onnx.ModelProto
    swap_plan: SwapPlan | None


def plan_passes(plan: StepPlan, *, budget: int | None) -> tuple[list[onnx_ir.passes.PassBase], SwapPlan | None]:
    """The passes that write ``plan`` into the planner's graph, in order, and the placed swap
    plan the last of them writes (None: no swaps)."""
    passes = list(plan.rewrites)
    placed = None
    if plan.choice.swap_plan is not None:
        placed = placed_plan(plan.choice.swap_plan, plan.choice.program)
        passes.append(SwapPass(plan.choice.base, placed, plan.infos, budget=budget))
    return passes, placed


def apply_plan(model: onnx.ModelProto, plan: StepPlan, *, budget: int | None) -> AppliedPlan:
    """``model`` (the graph ``plan`` was made for: the planning target's) with the plan written
    in. Where the plan neither rewrites nor swaps, its own graph (a copy)."""
    passes, placed = plan_passes(plan, budget=budget)
    if not passes:
        copy = onnx.ModelProto()
        copy.CopyFrom(plan.model)
        return AppliedPlan(copy, None)
    model_ir = ir.from_proto(model)
    rewrites = len(plan.rewrites)
    if rewrites:
        model_ir = onnx_ir.passes.PassManager(passes[:rewrites])(model_ir).model
        _check_rewritten(model_ir, plan.model)
    if rewrites < len(passes):
        model_ir = onnx_ir.passes.PassManager(passes[rewrites:])(model_ir).model
    return AppliedPlan(ir.to_proto(model_ir), placed)


def _check_rewritten(model: ir.Model, planned: onnx.ModelProto) -> None:
    """The plan's rewrites must give the graph its swaps were planned on, node for node (op and
    outputs): a plan missing one of its rewrites would place swaps on the wrong values."""
    written = [(node.op_type, tuple(v.name if v is not None else "" for v in node.outputs)) for node in model.graph]
    expected = [(node.op_type, tuple(node.output)) for node in planned.graph.node]
    if written != expected:
        raise ValueError(f"the plan's rewrites give {len(written)} nodes where it was planned on {len(expected)} "
                         "(or other nodes): the plan does not describe its own graph; report this as a bug")


__all__ = ["AppliedPlan", "apply_plan", "plan_passes"]
