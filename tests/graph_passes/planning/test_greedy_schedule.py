"""The memory-greedy schedule (graph_passes.planning.greedy_schedule): a topological order that
runs the last reader of a value as soon as it can, and the swap planning that tries it."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.parser

import ort_offload
from graph_passes.cost import device_profiles
from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.ir import shapes
from graph_passes.ir.liveness import check_topological, node_io
from graph_passes.ir.program import order_dependent_closure
from graph_passes.planning.greedy_schedule import memory_greedy
from graph_passes.planning.schedule import state_derived_late, training_spine, updates_early
from helpers import batches
from models import get_model
from test_schedule import layered_step


def _infos(model):
    feeds = {}
    for value in model.graph.input:
        feeds[value.name] = np.zeros([d.dim_value for d in value.type.tensor_type.shape.dim], np.float32)
    return shapes.infer_tensor_infos(model, shapes.check_inputs(model, feeds))


def test_the_last_reader_of_a_value_runs_before_a_node_that_only_allocates():
    """``a`` is read by ``p`` alone; ``q`` reads only the graph input. Given a, q, p, add, the
    greedy order runs ``p`` (frees ``a``, makes as much) before ``q`` (makes, frees nothing):
    two tensors live at once instead of three."""
    model = onnx.parser.parse_model("""<ir_version: 9, opset_import: ["" : 20]>
        g (float[1024] x) => (float[1024] out) {
            a = Relu(x)
            q = Exp(x)
            p = Neg(a)
            out = Add(p, q)
        }""")
    infos = _infos(model)
    assert memory_greedy(model, infos) == [0, 2, 1, 3]
    assert memory_greedy(model, infos, [0, 2, 1, 3]) is None  # already greedy: no other order


def test_a_training_step_gets_a_topological_order_with_order_dependent_nodes_last():
    graph = layered_step(scatter=True)
    model = graph.model
    infos = _infos(model)
    nodes = list(model.graph.node)
    base = list(range(len(nodes)))
    late = order_dependent_closure(nodes, node_io(nodes), base)
    order = memory_greedy(model, infos, base)
    assert order is not None and sorted(order) == base
    graph_inputs = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    check_topological([nodes[i] for i in order], graph_inputs)
    assert late and order[-len(late):] == sorted(late)  # in the given order, after the rest


def test_a_gpu_plan_that_takes_the_greedy_order_runs_bitwise_equal_and_within_budget(monkeypatch):
    """cnn tiny at 0.25x on a V100 profile with a slow link (so that the swaps of the
    backward decide the step): the planner picks the memory-greedy order with state updates
    early and the nodes computed from state alone right before their readers, and the plan
    runs on the CPU device with the unplanned run's numbers."""
    slow = dataclasses.replace(V100_16GB_PCIE3, h2d_bandwidth=3e8, d2h_bandwidth=3e8, duplex_bandwidth=4.5e8)
    monkeypatch.setitem(device_profiles.SHIPPED_PROFILES, V100_16GB_PCIE3.name, slow)
    spec, data = get_model("cnn", "tiny"), batches("cnn", 2)

    def train(budget):
        device = ort_offload.set_offload_device("cpu", budget=budget, planning_profile=V100_16GB_PCIE3.name)
        trainer = ort_offload.create_ort_trainer(
            device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
            input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
            optimizer="adamw", name="cnn", passes=("swap",))
        return trainer, [trainer.step(*inputs, *targets) for inputs, targets in data], trainer.flat_state()

    _, ref_losses, ref_state = train(None)
    trainer, losses, state = train("0.25x")
    runner, prepared = trainer.runner, trainer.runner.last_prepared
    base = list(runner.schedule or range(len(runner.model.graph.node)))
    graph = runner.graph
    spine = training_spine(graph.roles, graph.state_pairs, [o.name for o in runner.model.graph.output])
    greedy = memory_greedy(runner.model, prepared.infos, base)
    assert greedy is not None
    chosen = [i for block in prepared.program.blocks for i in block.node_indices]
    greedy_early = updates_early(runner.model, spine, greedy) or greedy
    late = state_derived_late(runner.model, graph.state_inputs, greedy_early)
    assert late is not None and chosen == late  # the weights' transposes then run in the backward
    assert losses == ref_losses and all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    report = trainer.report()
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"]


def test_nodes_computed_from_the_state_alone_run_right_before_their_first_reader():
    """``wt`` (a weight's transpose) and ``s``/``e`` (a chain from the step count) read only
    state; given right after the weight's first use, they move down to right before the nodes
    that read them, in their order. ``n``, whose output is a graph output, stays where it is."""
    model = onnx.parser.parse_model("""<ir_version: 9, opset_import: ["" : 20]>
        g (float[8, 8] x, float[8, 8] w, float[1] t) => (float[8, 8] out, float[1] n) {
            a = MatMul(x, w)
            wt = Transpose(w)
            s = Neg(t)
            n = Neg(t)
            e = Exp(s)
            b = Relu(a)
            c = MatMul(b, wt)
            out = Mul(c, e)
        }""")
    nodes = list(model.graph.node)
    order = state_derived_late(model, ["w", "t"])
    assert [nodes[i].output[0] for i in order] == ["a", "n", "b", "wt", "c", "s", "e", "out"]
    check_topological([nodes[i] for i in order], {"x", "w", "t"})
    assert state_derived_late(model, ["w", "t"], order) is None  # already late: no other order
    assert state_derived_late(model, []) is None  # nothing is computed from state alone


def test_the_state_derived_late_order_of_a_training_step_is_topological_with_order_dependent_nodes_last():
    graph = layered_step(scatter=True)
    model = graph.model
    nodes = list(model.graph.node)
    base = list(range(len(nodes)))
    late = order_dependent_closure(nodes, node_io(nodes), base)
    order = state_derived_late(model, graph.state_inputs, base)
    assert order is not None and sorted(order) == base
    check_topological([nodes[i] for i in order], {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer})
    assert [i for i in order if i in late] == sorted(late)
