"""The swap pass: writes a :class:`~graph_passes.planning.swap.planner.SwapPlan` into the ONNX graph.

For a plan made over a lowered program, every copying ``SwapOut`` becomes a
``ai.ort_offload::SwapOut`` node after the value's last use before the gap, and every
``SwapIn`` a ``SwapIn`` node (ordered by its ``after`` token behind the node that precedes it in
the plan) whose output replaces the value for its later consumers. State that starts a step on
the host is read through a ``SwapIn`` of the graph input. Graph outputs keep their names: when
an output value is swapped, its producer's output is renamed and the last copy takes the name.
The ops' reference bodies are Identity, so stock ONNX Runtime runs the rewritten graph with the
same numbers.

``requires``: the plan's program is a lowering of this graph. ``ensures``: every host copy is
read only by ``SwapIn`` nodes, every consumer sees a device copy, and the program the plan made
stays within the budget in the memory simulator.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes

from custom_ops.swap import attach_functions, make_swap_in, make_swap_out
from graph_passes.ir.liveness import check_topological
from graph_passes.ir.provenance import SWAP_PASS
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Program, RunBlock, SwapOut
from graph_passes.planning.swap.planner import SwapPlan, apply_swap_plan

PASS_NAME = SWAP_PASS
DROP_KEY = "ort_offload.drop"  # on a SwapOut whose value the host already holds: release, no copy


class SwapPass(onnx_ir.passes.FunctionalPass):
    """Write ``plan`` (made for ``program``, a lowering of the model) into the graph."""

    def __init__(self, program: Program, plan: SwapPlan, infos, *, budget: int) -> None:
        super().__init__()
        self.program = program
        self.plan = plan
        self.infos = infos
        self.budget = budget

    def requires(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        count = len(proto.graph.node)
        covered = sorted(i for b in self.program.blocks for i in b.node_indices)
        if covered != list(range(count)):
            raise onnx_ir.passes.PreconditionError("the plan's program is not a lowering of this graph")

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        proto = write_swap_plan(ir.to_proto(model), self.program, self.plan)
        return onnx_ir.passes.PassResult(ir.from_proto(proto), modified=bool(self.plan.before or self.plan.host_state))

    def ensures(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        check_swap_nodes(proto)
        trace = simulate_program(apply_swap_plan(self.program, self.plan), self.infos, budget=self.budget)
        if trace.min_budget_bytes > self.budget:
            raise onnx_ir.passes.PostconditionError(
                f"swap plan needs {trace.min_budget_bytes} bytes in simulation, over the budget {self.budget}"
            )


def write_swap_plan(model: onnx.ModelProto, program: Program, plan: SwapPlan) -> onnx.ModelProto:
    """A copy of ``model`` with the plan's swaps as ``ai.ort_offload`` nodes."""
    graph = model.graph
    nodes = list(graph.node)
    outputs = {o.name for o in graph.output}
    swaps_of: dict[str, int] = {}
    for _, swaps in plan.before:
        for swap in swaps:
            swaps_of[swap.name] = swaps_of.get(swap.name, 0) + 1
    # A swapped graph output keeps its name on its last copy; its producer gets a device name.
    renamed_outputs = {name: f"{name}__dev" for name in outputs if name in swaps_of}
    current = {name: renamed_outputs.get(name, name) for name in _all_values(graph)}
    host: dict[str, str] = {name: name for name in plan.host_state}  # graph inputs start there
    for name in plan.host_state:
        current[name] = None  # not on the device until swapped in
    written: dict[str, int] = {}
    new_nodes: list[onnx.NodeProto] = []
    token = graph.input[0].name if graph.input else None
    before = dict(plan.before)

    def fresh(name: str, kind: str) -> str:
        written[name] = written.get(name, 0) + 1
        if written[name] == swaps_of.get(name) and name in renamed_outputs:
            return name  # the last copy of a graph output carries the output's name
        return f"{name}__{kind}{written[name]}"

    def emit_swaps(index: int) -> None:
        for swap in before.get(index, ()):
            if isinstance(swap, SwapOut):
                out = fresh(swap.name, "host")
                reason = (f"evicted for the budget before step {index}" if swap.copy
                          else f"dropped before step {index}: the host copy is current")
                node = make_swap_out(current[swap.name], out_name=out, provenance=PASS_NAME, reason=reason)
                if not swap.copy:
                    node.metadata_props.add(key=DROP_KEY, value="1")
                new_nodes.append(node)
                host[swap.name] = out
                current[swap.name] = None
            else:
                out = fresh(swap.name, "in")
                new_nodes.append(make_swap_in(host[swap.name], after=token, out_name=out, provenance=PASS_NAME,
                                              reason=f"needed at step {index}"))
                current[swap.name] = out

    for index, step in enumerate(program.steps):
        emit_swaps(index)
        if isinstance(step, RunBlock):
            for node_index in program.blocks[step.block].node_indices:
                node = onnx.NodeProto()
                node.CopyFrom(nodes[node_index])
                for k, name in enumerate(node.input):
                    if name and current.get(name, name) is not None:
                        node.input[k] = current.get(name, name)
                for k, name in enumerate(node.output):
                    if name in renamed_outputs:
                        node.output[k] = renamed_outputs[name]
                new_nodes.append(node)
                token = node.output[0]
    emit_swaps(len(program.steps))
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(new_nodes)
    attach_functions(result)
    check_topological(list(result.graph.node), {i.name for i in result.graph.input} | {t.name for t in result.graph.initializer})
    return result


def _all_values(graph: onnx.GraphProto) -> list[str]:
    names = [v.name for v in graph.input]
    names += [o for n in graph.node for o in n.output if o]
    return names


def check_swap_nodes(model: onnx.ModelProto) -> None:
    """Host copies are read only by SwapIn; every graph output is produced."""
    from custom_ops.registry import DOMAIN

    host_values = {n.output[0] for n in model.graph.node if n.domain == DOMAIN and n.op_type == "SwapOut"}
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == "SwapIn":
            continue
        bad = [name for name in node.input if name in host_values]
        if bad:
            raise onnx_ir.passes.PostconditionError(f"node {node.name!r} reads host copy {bad[0]!r} without a SwapIn")
    produced = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    missing = [o.name for o in model.graph.output if o.name not in produced]
    if missing:
        raise onnx_ir.passes.PostconditionError(f"graph outputs {missing} are no longer produced")
