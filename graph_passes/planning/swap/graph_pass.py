"""The swap pass: writes a :class:`~graph_passes.planning.swap.planner.SwapPlan` into the ONNX graph.

For a plan made over a lowered program, every copying ``SwapOut`` becomes a
``ai.ort_offload::SwapOut`` node after the value's last use before the gap, and every
``SwapIn`` a ``SwapIn`` node (ordered by its ``after`` token behind the node that precedes it in
the plan) whose output replaces the value for its later consumers. State that starts a step on
the host is read through a ``SwapIn`` of the graph input. Graph outputs keep their names: when
an output value is swapped, its producer's output is renamed and the last copy takes the name.
The ops' reference bodies are Identity, so stock ONNX Runtime runs the rewritten graph with the
same numbers. The pass edits an ``onnx_ir`` model in place (:func:`swap_in_place`).

``requires``: the plan's program is a lowering of this graph. ``ensures``: every host copy is
read only by ``SwapIn`` nodes, every consumer sees a device copy, and the program the plan made
stays within the budget in the memory simulator.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes

from custom_ops.registry import DOMAIN
from custom_ops.swap import PASS_KEY, REASON_KEY, SWAP_IN, SWAP_OUT, attach_functions_ir, swap_node_name
from graph_passes.ir.editing import available_values, check_topological, move_annotations, set_order
from graph_passes.ir.provenance import SWAP_PASS
from graph_passes.ir.allocator import OutOfArenaMemory
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Program, RunBlock, SwapOut
from graph_passes.planning.swap.planner import SwapPlan, apply_swap_plan

PASS_NAME = SWAP_PASS
DROP_KEY = "ort_offload.drop"  # on a SwapOut whose value the host already holds: release, no copy


class SwapPass(onnx_ir.passes.InPlacePass):
    """Write ``plan`` (made for ``program``, a lowering of the model) into the graph."""

    def __init__(self, program: Program, plan: SwapPlan, infos, *, budget: int) -> None:
        super().__init__()
        self.program = program
        self.plan = plan
        self.infos = infos
        self.budget = budget

    def requires(self, model: ir.Model) -> None:
        count = len(model.graph)
        covered = sorted(i for b in self.program.blocks for i in b.node_indices)
        if covered != list(range(count)):
            raise onnx_ir.passes.PreconditionError("the plan's program is not a lowering of this graph")

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        swap_in_place(model, self.program, self.plan)
        return onnx_ir.passes.PassResult(model, modified=bool(self.plan.before or self.plan.host_state))

    def ensures(self, model: ir.Model) -> None:
        check_swap_nodes(model.graph)
        try:
            trace = simulate_program(apply_swap_plan(self.program, self.plan), self.infos, budget=self.budget)
        except OutOfArenaMemory as e:
            raise onnx_ir.passes.PostconditionError(f"swap plan does not fit the budget {self.budget} in simulation: {e}") from e
        if trace.min_budget_bytes > self.budget:
            raise onnx_ir.passes.PostconditionError(
                f"swap plan needs {trace.min_budget_bytes} bytes in simulation, over the budget {self.budget}"
            )


def swap_in_place(model: ir.Model, program: Program, plan: SwapPlan) -> None:
    """Put the plan's swaps into ``model`` as ``ai.ort_offload`` nodes, the nodes in the
    program's order, and attach the ops' reference bodies."""
    graph = model.graph
    nodes = list(graph)
    swaps_of: dict[str, int] = {}
    for _, swaps in plan.before:
        for swap in swaps:
            swaps_of[swap.name] = swaps_of.get(swap.name, 0) + 1
    writer = _SwapWriter(graph, swaps_of, plan.host_state)
    before = dict(plan.before)
    new_nodes: list[ir.Node] = []
    for index, step in enumerate(program.steps):
        new_nodes.extend(writer.swaps(before.get(index, ()), index))
        if isinstance(step, RunBlock):
            for node_index in program.blocks[step.block].node_indices:
                new_nodes.append(writer.rewire(nodes[node_index]))
    new_nodes.extend(writer.swaps(before.get(len(program.steps), ()), len(program.steps)))
    set_order(graph, new_nodes)
    writer.restore_outputs()
    attach_functions_ir(model)
    check_topological(graph)


class _SwapWriter:
    """The swap nodes and which copy of each value is current: on the device, and on the host."""

    def __init__(self, graph: ir.Graph, swaps_of: dict[str, int], host_state) -> None:
        self.graph = graph
        self.swaps_of = swaps_of
        self.values = {v.name: v for v in graph.inputs} | {v.name: v for n in graph for v in n.outputs if v.name}
        # A swapped graph output keeps its name on its last copy; its producer gets a device name.
        self.outputs = {v.name: v for v in graph.outputs if v.name in swaps_of}
        self.current: dict[ir.Value, ir.Value | None] = {}  # original -> its device copy (None: on the host)
        self.host: dict[str, ir.Value] = {}
        for name in host_state:  # graph inputs start on the host
            self.host[name] = self.values[name]
            self.current[self.values[name]] = None  # not on the device until swapped in
        for name, value in self.outputs.items():
            value.name = f"{name}__dev"
        self.written: dict[str, int] = {}
        self.token = graph.inputs[0] if graph.inputs else None

    def _fresh(self, name: str, kind: str) -> ir.Value:
        self.written[name] = self.written.get(name, 0) + 1
        if self.written[name] == self.swaps_of.get(name) and name in self.outputs:
            return ir.Value(name=name)  # the last copy of a graph output carries the output's name
        return ir.Value(name=f"{name}__{kind}{self.written[name]}")

    def _node(self, op_type: str, inputs: list[ir.Value | None], out: ir.Value, reason: str) -> ir.Node:
        if op_type == SWAP_IN and (self.token is None or not self.token.name):
            raise ValueError("SwapIn needs an ordering token: 'after' names a tensor the copy waits for")
        return ir.Node(DOMAIN, op_type, inputs, outputs=[out], name=swap_node_name(op_type, out.name),
                       metadata_props={PASS_KEY: PASS_NAME, REASON_KEY: reason})

    def swaps(self, batch, index: int) -> list[ir.Node]:
        """The swap nodes of one step's batch."""
        made = []
        for swap in batch:
            original = self.values[swap.name]
            if isinstance(swap, SwapOut):
                out = self._fresh(swap.name, "host")
                reason = (f"evicted for the budget before step {index}" if swap.copy
                          else f"dropped before step {index}: the host copy is current")
                made.append(self._node(SWAP_OUT, [self.current.get(original, original)], out, reason))
                if not swap.copy:
                    made[-1].metadata_props[DROP_KEY] = "1"
                self.host[swap.name] = out
                self.current[original] = None
            else:
                out = self._fresh(swap.name, "in")
                made.append(self._node(SWAP_IN, [self.host[swap.name], self.token], out, f"needed at step {index}"))
                self.current[original] = out
        return made

    def rewire(self, node: ir.Node) -> ir.Node:
        """``node`` reading the current device copies; its first output orders the next SwapIn."""
        for k, value in enumerate(node.inputs):
            copy = self.current.get(value, value) if value is not None else None
            if copy is not None and copy is not value:
                node.replace_input_with(k, copy)
        self.token = node.outputs[0]
        return node

    def restore_outputs(self) -> None:
        """Each swapped graph output becomes the copy that took its name (its type moves along)."""
        last = {n.outputs[0].name: n.outputs[0] for n in self.graph if n.domain == DOMAIN}
        renamed = {value: name for name, value in self.outputs.items()}
        for k, value in enumerate(self.graph.outputs):
            copy = last.get(renamed.get(value))
            if copy is not None:
                move_annotations(value, copy)
                self.graph.outputs[k] = copy


def check_swap_nodes(graph: ir.Graph) -> None:
    """Host copies are read only by SwapIn; every graph output is produced."""
    host_values = {n.outputs[0] for n in graph if n.domain == DOMAIN and n.op_type == SWAP_OUT}
    for node in graph:
        if node.domain == DOMAIN and node.op_type == SWAP_IN:
            continue
        bad = [v.name for v in node.inputs if v in host_values]
        if bad:
            raise onnx_ir.passes.PostconditionError(f"node {node.name!r} reads host copy {bad[0]!r} without a SwapIn")
    produced = available_values(graph) | {v for n in graph for v in n.outputs}
    missing = [v.name for v in graph.outputs if v not in produced]
    if missing:
        raise onnx_ir.passes.PostconditionError(f"graph outputs {missing} are no longer produced")
