"""The swap pass writes a plan into the graph; stock ONNX Runtime runs the result unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from custom_ops.registry import DOMAIN
from graph_passes import shapes
from graph_passes.memory import align_up, simulate_program
from graph_passes.program import lower
from graph_passes.swap_pass import SwapPass
from graph_passes.swap_planner import SwapPlanner, required_bytes
from helpers import batches, train_ort
from models import get_model
from ort_offload.export import initial_state


@pytest.mark.parametrize("name, block_nodes", [("mlp", 4), ("gpt", 16)])
def test_rewritten_step_runs_in_stock_onnxruntime_with_the_same_numbers(name, block_nodes):
    run = train_ort(name, optimizer="adamw", steps=1)
    graph = run.trainer.graph
    (inputs, targets), = batches(name, 1)
    feeds = initial_state(graph, get_model(name).model, lr=1e-3)
    feeds.update({n: t.numpy() for n, t in zip(graph.data_inputs, inputs + targets)})
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, feeds))
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
