"""Hand-built chain graphs for the swap planner, the simulator and the swap search tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser

from graph_passes.ir import shapes
from graph_passes.ir.allocator import align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import lower
from graph_passes.ir.training_graph import Role, TrainingGraph
from graph_passes.planning.swap.planner import SwapPlanner, apply_swap_plan, required_bytes
from helpers import chain_body
from ort_offload.device import set_offload_device
from ort_offload.runtime.runner import GraphRunner, Runtime

OPS = ["MatMul", "Relu", "MatMul", "Sigmoid", "Add", "MatMul", "Exp", "Concat", "Relu"]

def chain_graph(ops, width=16):
    """A training-step-like chain: x through ops with a parameter w, w updated at the end."""
    lines, last = chain_body(ops)
    text = (
        "<ir_version: 9, opset_import: [\"\" : 20]>\n"
        f"g (float[8, {width}] x, float[{width}, {width}] w, float[{2 * width}, {width}] w2)"
        f" => (float loss, float[{width}, {width}] w_new) {{\n"
        + "\n".join(lines)
        # loss, and an update of w that reads an early activation (x) and the last one
        + f"\n loss = ReduceSum<keepdims = 0>({last})\n s = Sigmoid({last})\n xt = Transpose(x)"
        "\n g = MatMul(xt, s)\n w_new = Sub(w, g)\n}"
    )
    model = onnx.parser.parse_model(text)
    roles = {"x": Role.INPUT, "w": Role.PARAM, "w2": Role.PARAM, "loss": Role.LOSS, "w_new": Role.PARAM}
    return TrainingGraph(model, roles, {"w": "w_new"}, name="chain")


def chain_feeds(width=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((8, width)).astype(np.float32),
            "w": rng.standard_normal((width, width)).astype(np.float32) * 0.1,
            "w2": rng.standard_normal((2 * width, width)).astype(np.float32) * 0.1}


def run_chain(graph, feeds, budget, steps=2):
    runtime = Runtime(set_offload_device("cpu", budget=budget))
    runner = GraphRunner(runtime, graph, fetches=["loss"], passes=("swap",))
    prepared = runner.prepare(shapes.check_inputs(graph.model, feeds))
    runtime.place_state(feeds, prepared.program.state_inputs, runner.capacity_for(prepared),
                        host=prepared.program.host_state)
    losses = [float(runner.run({"x": feeds["x"]}, prepared)["loss"]) for _ in range(steps)]
    return losses, {n: runtime.read(n) for n in ("w", "w2")}, runtime, prepared


def planned_chain(width, where, ops=OPS):
    """(graph, infos, unplanned program, planned program, budget): ``where`` in [0, 1] places the
    budget between the least any plan needs and the unplanned peak."""
    graph = chain_graph(ops, width=width)
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, chain_feeds(width)))
    program = lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"],
                    max_block_nodes=1)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    least, top = required_bytes(program, sizes), simulate_program(program, infos).min_budget_bytes
    budget = int(least + where * (top - least))
    planned = apply_swap_plan(program, SwapPlanner().plan(program, sizes, budget))
    return graph, infos, program, planned, budget
