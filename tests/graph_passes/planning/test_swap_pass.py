"""The swap pass writes a plan into the graph; stock ONNX Runtime runs the result unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from custom_ops.registry import DOMAIN
from graph_passes.ir.allocator import align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import SwapIn, SwapOut, lower
from graph_passes.planning.swap.graph_pass import SwapPass
from graph_passes.planning.swap.planner import SwapPlanner, required_bytes
from helpers import step_graph_and_feeds, train_ort


@pytest.mark.parametrize("name, block_nodes", [("mlp", 4), ("gpt", 16)])
def test_rewritten_step_runs_in_stock_onnxruntime_with_the_same_numbers(name, block_nodes):
    graph, feeds, infos = step_graph_and_feeds(name)
    program = lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=graph.data_inputs,
                    fetches=["loss"], max_block_nodes=block_nodes)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    unplanned = simulate_program(program, infos).min_budget_bytes
    budget = max(required_bytes(program, sizes), unplanned // 3)
    plan = SwapPlanner().plan(program, sizes, budget)
    assert plan.swap_count > 0

    result = SwapPass(program, plan, infos, budget=budget)(ir.from_proto(graph.model))
    assert result.modified
    rewritten = ir.to_proto(result.model)
    onnx.checker.check_model(rewritten)
    swap_nodes = [n for n in rewritten.graph.node if n.domain == DOMAIN]
    assert {n.op_type for n in swap_nodes} == {"SwapOut", "SwapIn"}
    assert all({p.key for p in n.metadata_props} >= {"ort_offload.pass", "ort_offload.reason"} for n in swap_nodes)
    assert [o.name for o in rewritten.graph.output] == graph.output_names

    def run_session(model):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))

    expected, got = run_session(graph.model), run_session(rewritten)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value)


def test_the_runtime_executes_a_rewritten_graph_with_real_swaps():
    """`ort-offload transform` output run by our runtime: the swap nodes become swap steps."""
    from graph_passes.ir.training_graph import TrainingGraph
    from ort_offload.device import set_offload_device
    from ort_offload.export.graph_inputs import random_batch, random_state
    from ort_offload.trainer import OrtTrainer
    from ort_offload.transform import transform

    run = train_ort("gpt", optimizer="adamw", steps=1)
    graph = TrainingGraph.from_model(run.trainer.graph.with_metadata())
    shapes_ = {"ids": (8, 16), "targets": (8, 16)}
    result = transform(graph, set_offload_device("cpu", budget="0.3x"), shapes_, ("swap",))
    budget = result.report["budget_bytes"]
    state = random_state(graph)
    data = [random_batch(graph, shapes_, seed=s) for s in range(3)]

    def train(g, device):
        trainer = OrtTrainer(device, g, initial_state=state, example_batch=data[0],
                             input_names=g.data_inputs, target_names=[])
        losses = [trainer.step(*(b[n] for n in g.data_inputs)) for b in data]
        return trainer, losses, trainer.flat_state()

    _, expected_losses, expected_state = train(graph, set_offload_device("cpu"))
    trainer, losses, state_after = train(result.graph, set_offload_device("cpu", budget=budget))
    report = trainer.report()
    assert report["swap_out_bytes"] > 0 and report["swap_in_bytes"] > 0 and report["faults"] == 0
    assert report["peak_device_bytes"] <= budget
    # The graph holds the swaps where the runtime placed them: reading it back gives the same
    # swaps in the same order (block boundaries are the runtime's choice again).
    def swaps(program):
        return [(type(s).__name__, s.name.split("__")[0]) for s in program.steps if isinstance(s, (SwapIn, SwapOut))]

    assert swaps(trainer.runner.last_prepared.program) == swaps(result.plan.choice.program)
    assert trainer.runner.last_trace.min_budget_bytes <= budget
    assert losses == expected_losses
    assert all(state_after[k].tobytes() == v.tobytes() for k, v in expected_state.items())
