"""State updates scheduled right after their gradients (graph_passes.planning.schedule.updates_early) and
the swap planning that tries that schedule on profiles whose copies overlap compute."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

from graph_passes.ir import shapes
from graph_passes.ir.liveness import check_topological
from graph_passes.ir.program import order_dependent_last
from graph_passes.ir.memory import simulate_program
from graph_passes.planning.schedule import training_spine, updates_early, updates_start
from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload.device import set_offload_device
from ort_offload.runtime.runner import GraphRunner, Runtime


def layered_step(layers=4, batch=8192, width=32, update_ops=24, scatter=False):
    """A training step shaped like a network's: a forward of ``layers`` MatMul+Relu layers, a
    backward that reads each layer's saved activations in reverse (each layer's weight gradient
    has role ``grad``), then an optimizer tail of ``update_ops`` elementwise nodes per layer
    (reading its gradient and a moment). With ``scatter``, the last layer's gradient also goes
    through an order-dependent ScatterElements (reduction add)."""
    p = lambda i: f"float[{width}, {width}] w{i}, float[{width}, {width}] m{i}"
    ins = ", ".join([f"float[{batch}, {width}] x"] + [p(i) for i in range(1, layers + 1)])
    outs = ", ".join(["float loss"] + [f"float[{width}, {width}] w{i}_new, float[{width}, {width}] m{i}_new"
                                       for i in range(1, layers + 1)])
    lines = [" h0 = Identity(x)"]
    for i in range(1, layers + 1):
        lines += [f" z{i} = MatMul(h{i - 1}, w{i})", f" h{i} = Relu(z{i})"]
    lines += [f" loss = ReduceSum<keepdims = 0>(h{layers})", f" d{layers} = Sigmoid(h{layers})"]
    for i in range(layers, 0, -1):
        lines += [f" dz{i} = Mul(d{i}, h{i})", f" t{i} = Transpose(h{i - 1})", f" graw{i} = MatMul(t{i}, dz{i})"]
        if scatter and i == layers:
            lines += [" idx = Constant<value = int64[1, 1] {0}>()", f" row = Slice(graw{i}, zero, one)",
                      f" g{i} = ScatterElements<reduction = \"add\">(graw{i}, idx, row)"]
        else:
            lines += [f" g{i} = Identity(graw{i})"]
        if i > 1:
            lines += [f" wt{i} = Transpose(w{i})", f" d{i - 1} = MatMul(dz{i}, wt{i})"]
    if scatter:
        lines[:0] = [" zero = Constant<value = int64[1] {0}>()", " one = Constant<value = int64[1] {1}>()"]
    lines += [" c = Constant<value = float {0.5}>()"]
    for i in range(1, layers + 1):
        lines += [f" mm{i} = Mul(m{i}, c)", f" m{i}_new = Add(mm{i}, g{i})", f" u{i}_0 = Mul(m{i}_new, c)"]
        for k in range(1, update_ops):
            lines += [f" u{i}_{k} = {'Add' if k % 2 else 'Mul'}(u{i}_{k - 1}, c)"]
        lines += [f" w{i}_new = Sub(w{i}, u{i}_{update_ops - 1})"]
    text = '<ir_version: 9, opset_import: ["" : 20]>\n' f"step ({ins}) => ({outs}) {{\n" + "\n".join(lines) + "\n}"
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    roles = {"x": Role.INPUT, "loss": Role.LOSS}
    pairs = {}
    for i in range(1, layers + 1):
        roles.update({f"w{i}": Role.PARAM, f"w{i}_new": Role.PARAM, f"m{i}": Role.OPTIMIZER_STATE,
                      f"m{i}_new": Role.OPTIMIZER_STATE, f"g{i}": Role.GRAD})
        pairs.update({f"w{i}": f"w{i}_new", f"m{i}": f"m{i}_new"})
    return TrainingGraph(model, roles, pairs, name="layered")


def feeds_for(graph, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for value in graph.model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out[value.name] = (rng.standard_normal(shape) * (1.0 if value.name == "x" else 0.05)).astype(np.float32)
    return out


def producer_positions(model, order):
    nodes = list(model.graph.node)
    return {o: position for position, i in enumerate(order) for o in nodes[i].output if o}


def spine_of(graph):
    return training_spine(graph.roles, graph.state_pairs, [o.name for o in graph.model.graph.output])


@pytest.mark.parametrize("scatter", [False, True])
def test_updates_run_right_after_their_gradient_and_the_rest_keeps_its_order(scatter):
    graph = layered_step(scatter=scatter)
    model = graph.model
    nodes = list(model.graph.node)
    base = order_dependent_last(model) or list(range(len(nodes)))
    early = updates_early(model, spine_of(graph), base)
    assert early is not None and sorted(early) == list(range(len(nodes)))
    initializers = {t.name for t in model.graph.initializer}
    check_topological([nodes[i] for i in early], {v.name for v in model.graph.input} | initializers)
    at = producer_positions(model, early)
    layers = 4
    for i in range(1, layers):
        # The update of layer i comes before the backward of the layers below it ends.
        assert at[f"w{i + 1}_new"] < at[f"g{i}"] or (scatter and i + 1 == layers)
    # Nodes the loss and the gradients depend on keep their relative order.
    spine_nodes = [i for i in base if not any(o.endswith("_new") or o.startswith(("u", "mm", "c"))
                                              for o in nodes[i].output)]
    assert [i for i in early if i in set(spine_nodes)] == spine_nodes
    if scatter:
        # The order-dependent scatter and what reads it stay at the end, after everything else.
        assert at[f"g{layers}"] > at["g1"] and at[f"w{layers}_new"] > at["g1"]


def test_a_graph_without_gradient_roles_has_no_spine():
    graph = layered_step()
    roles = {n: (Role.ACTIVATION if r == Role.GRAD else r) for n, r in graph.roles.items()}
    assert training_spine(roles, graph.state_pairs, [o.name for o in graph.model.graph.output]) is None
    assert training_spine(graph.roles, graph.state_pairs, ["loss", "w1_new"]) == ["loss", "g1", "g2", "g3", "g4"]


@pytest.mark.parametrize("scatter", [False, True])
def test_the_updates_start_after_the_last_node_the_loss_and_gradients_need(scatter):
    """In the exported order the optimizer tail starts right after the backward: everything
    before the position is something the loss or a gradient depends on, every new state is
    made from there on; the order-dependent tail (the scatter and what reads it) does not
    count. With the updates interleaved (updates_early), there is no such position."""
    graph = layered_step(scatter=scatter)
    model = graph.model
    nodes = list(model.graph.node)
    base = order_dependent_last(model) or list(range(len(nodes)))
    start = updates_start(model, spine_of(graph), graph.state_pairs.values(), base)
    assert start is not None
    at = producer_positions(model, base)
    assert at["loss"] < start and all(at[f"g{i}"] < start for i in range(1, 4))
    assert all(at[new] >= start for new in graph.state_pairs.values())
    assert at["g1"] == start - 1  # the backward's last node
    if scatter:  # the scattered gradient and its layer's updates: after the rest
        assert at["g4"] > at["w1_new"] and at["w4_new"] > at["g4"]
    early = updates_early(model, spine_of(graph), base)
    assert updates_start(model, spine_of(graph), graph.state_pairs.values(), early) is None


def test_a_budget_met_by_cutting_off_the_updates_runs_without_swaps_and_bitwise_equal():
    """In one block, a step's new state is allocated when the block starts, next to every
    activation; with the updates in a block of their own it comes after the backward. A
    budget that only this fits is met by that one cut: no swap, the same numbers."""
    graph = layered_step(width=64)
    feeds = feeds_for(graph)
    ref_losses, ref_state, ref_runtime, ref_prepared = _run(graph, feeds, None)
    runner = GraphRunner(ref_runtime, graph, fetches=["loss"], passes=("swap",))
    apart = runner.planner.layouts.lower_updates_apart(runner.model, ref_prepared.infos, runner.schedule)
    apart_need = simulate_program(apart, ref_prepared.infos, alignment=ref_runtime.device.alignment).min_budget_bytes
    assert apart_need < ref_prepared.trace.min_budget_bytes  # the new state no longer meets the activations
    losses, state, runtime, prepared = _run(graph, feeds, apart_need)
    assert len(prepared.program.blocks) == len(ref_prepared.program.blocks) + 1
    assert prepared.swap_plan is None and runtime.stats.swap_out_bytes == 0
    assert losses == ref_losses
    assert all(state[k].tobytes() == ref_state[k].tobytes() for k in ref_state)
    assert runtime.stats.peak_device_bytes <= apart_need


def _plan(graph, feeds, budget, profile):
    runtime = Runtime(set_offload_device("cpu", budget=budget, planning_profile=profile))
    runner = GraphRunner(runtime, graph, fetches=["loss"], passes=("swap",))
    prepared = runner.prepare(shapes.check_inputs(graph.model, feeds))
    return runtime, runner, prepared


def _run(graph, feeds, budget, profile=None, steps=3):
    runtime, runner, prepared = _plan(graph, feeds, budget, profile)
    runtime.place_state({n: v for n, v in feeds.items() if n != "x"}, prepared.program.state_inputs,
                        runner.capacity_for(prepared), host=prepared.program.host_state)
    losses = [float(runner.run({"x": feeds["x"]}, prepared)["loss"]) for _ in range(steps)]
    state = {n: runtime.read(n) for n in graph.state_pairs}
    return losses, state, runtime, prepared


def test_a_gpu_plan_takes_updates_early_when_faster_and_runs_bitwise_equal():
    """On the V100 profile the backward's swap-ins are bound by the link, and the optimizer tail
    (launch-bound elementwise nodes) sits idle at the end: planned with updates right after
    their gradients, the step is faster than the best plan of the exported order, and it runs
    with the same numbers."""
    graph = layered_step()
    feeds = feeds_for(graph)
    ref_losses, ref_state, ref_runtime, ref_prepared = _run(graph, feeds, None)
    budget = ref_prepared.trace.min_budget_bytes // 2
    runtime, runner, prepared = _plan(graph, feeds, budget, "V100-16GB-PCIe3")
    assert prepared.swap_plan is not None
    # The plan of the exported order alone, as the search made it before.
    layouts = runner.planner.layouts
    programs = list(layouts.lowerings(runner.model, prepared.infos, runner.schedule))
    default, _ = runner.planner._plan_swaps_for(programs, prepared.infos, budget, runner.model, runner.schedule)
    chosen_s = layouts.simulated_time(prepared.program, prepared.infos, runner.model, budget)
    assert default is not None and chosen_s < default[1]
    # The chosen program runs an update before the backward is over.
    order = [i for block in prepared.program.blocks for i in block.node_indices]
    at = producer_positions(graph.model, order)
    assert at["w4_new"] < at["g1"]

    losses, state, runtime, prepared = _run(graph, feeds, budget, "V100-16GB-PCIe3")
    assert losses == ref_losses
    assert all(state[k].tobytes() == ref_state[k].tobytes() for k in ref_state)
    assert runtime.stats.peak_device_bytes <= budget and runtime.stats.faults == 0
    assert runtime.stats.swap_out_bytes > 0


def test_a_transformed_graph_with_updates_early_runs_identically(tmp_path):
    """``ort-offload transform --device-profile``: the rewritten graph carries the chosen order
    (updates inside the backward) with its swap nodes; stock ONNX Runtime without graph
    optimizations gives the same outputs as the original graph (with them, this graph's
    updates differ in the last bits, with or without the reordering: the swap nodes change
    what gets folded), and our runtime, reading the swap nodes back, the same numbers as the
    unplanned run."""
    import onnxruntime as ort

    from ort_offload.transform import transform

    graph = layered_step()
    feeds = feeds_for(graph)
    ref_losses, ref_state, _, ref_prepared = _run(graph, feeds, None)
    budget = ref_prepared.trace.min_budget_bytes // 2
    device = set_offload_device("cpu", budget=budget, planning_profile="V100-16GB-PCIe3")
    result = transform(graph, device, {"x": feeds["x"].shape}, ("swap",))
    model = result.graph.model
    onnx.checker.check_model(model)
    position = {o: k for k, node in enumerate(model.graph.node) for o in node.output if o}
    assert position["w4_new"] < position["g1"]  # written in the chosen order
    assert any(node.domain == "ai.ort_offload" for node in model.graph.node)

    def outputs(m):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(m.SerializeToString(), options).run(None, feeds)

    for before, after in zip(outputs(graph.model), outputs(model)):
        np.testing.assert_array_equal(before, after)
    losses, state, runtime, _ = _run(result.graph, feeds, budget)
    assert losses == ref_losses
    assert all(state[k].tobytes() == ref_state[k].tobytes() for k in ref_state)
    assert runtime.stats.peak_device_bytes <= budget
