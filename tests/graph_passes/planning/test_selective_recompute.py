"""Selective recomputation (graph_passes.planning.recompute.selective): which saved values are cheap
units, the rewritten graph checked in stock ONNX Runtime against the graph before it, and
input-aware training that starts its plans from the units (fewer nodes recomputed than whole
segments alone, bitwise equal to the unplanned run, within the budget)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.planning.recompute.planner import RecomputePlan, TRIVIAL_BYTES, forward_nodes, forward_segments
from graph_passes.planning.recompute.graph_pass import PASS_KEY, recreated_values, write_recompute_plan
from graph_passes.planning.recompute.selective import MAX_COST_SHARE, selective_units
from helpers import step_graph_and_feeds, train_ort
from models import get_model
from ort_offload.runtime.block_session import default_session_options

# A CPU-like profile (this machine's measured one is close): ~8 FLOP per byte of bandwidth.
CPU_LIKE = DeviceProfile("cpu-like", peak_flops=2e11, memory_bandwidth=2.4e10, h2d_bandwidth=1.2e10,
                         d2h_bandwidth=1.2e10, duplex_bandwidth=1.6e10, device_memory_bytes=2**34,
                         kernel_launch_s=1e-6, copies_overlap_compute=False)
MATRIX_OPS = {"MatMul", "Gemm", "Conv", "Einsum"}


def _is_clone(node) -> bool:
    return any(p.key == PASS_KEY for p in node.metadata_props)


def _bert_units():
    # bert small (d_model 256): at bert tiny's width the products cost too little per byte
    # for the activation and the norms to be a third as cheap
    graph, feeds, infos = step_graph_and_feeds("bert", "small")
    segments = forward_segments(graph.model, infos, loss_name=graph.loss_name)
    cost_model = AnalyticalCostModel(CPU_LIKE)
    units = selective_units(segments, graph.model, infos, cost_model=cost_model, first_index=len(segments))
    return graph, feeds, infos, segments, units, cost_model


@pytest.mark.slow  # plans every segment of bert small (~50 s); the units' numbers are checked fast below
def test_units_are_the_cheap_saved_values_of_their_segment():
    graph, _, infos, segments, units, cost_model = _bert_units()
    nodes = graph.model.graph.node
    assert units and [u.index for u in units] == list(range(len(segments), len(segments) + len(units)))
    for unit in units:
        segment = segments[unit.within]
        assert set(unit.saved) <= set(segment.saved) and set(unit.nodes) <= set(segment.nodes)
        assert unit.saved_bytes == sum(infos[v].nbytes for v in unit.saved) > 0
        assert not {nodes[i].op_type for i in unit.nodes} & MATRIX_OPS  # no product is cheap per byte
        unit_time = sum(cost_model.node_time(nodes[i], infos) for i in unit.nodes)
        segment_time = sum(cost_model.node_time(nodes[i], infos) for i in segment.nodes)
        assert unit_time / unit.saved_bytes <= MAX_COST_SHARE * segment_time / segment.saved_bytes
        substantial = {v for v in segment.saved if infos[v].nbytes > TRIVIAL_BYTES}
        assert not substantial <= set(unit.saved)  # never the whole segment
    ops = {nodes[i].op_type for u in units for i in u.nodes}
    assert {"Gelu", "LayerNormalization"} <= ops  # the feed-forward activation, the norms
    # what the query/key products and the feed-forward matrices produce stays with the segments
    producers = {o: nodes[i] for i in range(len(nodes)) for o in nodes[i].output}
    for segment in segments:
        for value in segment.saved:
            if producers[value].op_type in MATRIX_OPS:
                assert all(value not in u.saved for u in units)


def test_a_graph_recomputing_the_units_runs_in_stock_onnxruntime_with_the_same_numbers():
    graph, feeds, infos, segments, units, _ = _bert_units()
    rewritten, clones = write_recompute_plan(graph.model, RecomputePlan(tuple(units)), loss_name=graph.loss_name)
    assert clones == sum(len(u.nodes) for u in units)  # each unit clones its own closure, nothing more
    forward = forward_nodes(rewritten, graph.loss_name)
    recomputed = recreated_values(rewritten)
    assert recomputed == {v for u in units for v in u.saved}  # units read no other unit's values
    for i, node in enumerate(rewritten.graph.node):
        if i not in forward and not _is_clone(node):
            assert not recomputed & set(node.input), node.name

    def outputs(model):
        # Stock ORT with the runtime's options (no graph optimizations, deterministic compute)
        # on one thread, as the runtime runs order-dependent nodes: on two, bert small's
        # embedding-gradient scatter-add sums in varying order (two runs of the graph before
        # the pass differ).
        session = ort.InferenceSession(model.SerializeToString(), default_session_options(intra_op_threads=1),
                                       providers=["CPUExecutionProvider"])
        return session.run(None, feeds)

    for before, after in zip(outputs(graph.model), outputs(rewritten)):
        np.testing.assert_array_equal(before, after)


@pytest.mark.slow
def test_input_aware_plans_start_from_the_units_and_recompute_less():
    """bert small, budget 0.33 of the 256-long unplanned peak: at length 130 the plan holds
    units and fewer whole segments than the plan of whole segments alone, and its clones cost
    less on the cost model; both within the budget and bitwise equal to the unplanned run."""
    spec = get_model("bert", "small")
    data = [spec.make_batch(seq=n, seed=k) for k, n in enumerate([256, 130])]
    reference = train_ort("bert", config="small", optimizer="adamw", steps=len(data), data=data)
    budget = int(0.33 * reference.trainer.report()["peak_device_bytes"])
    runs = {selective: train_ort("bert", config="small", optimizer="adamw", steps=len(data), data=data,
                                 budget=budget, passes="recompute", selective_recompute=selective)
            for selective in (True, False)}
    layers = len(runs[True].trainer.runner.recompute.segments(runs[True].trainer.runner.last_prepared.infos))
    cost_model = AnalyticalCostModel(CPU_LIKE)

    def cloned(selective: bool):
        """(segments whole, units, clone seconds on the cost model) of the plan at 130."""
        prepared = runs[selective].trainer.runner.last_prepared
        clones = [n for n in prepared.model.graph.node if _is_clone(n)]
        owners = {int(n.name.rsplit("__rc", 1)[1]) for n in clones}
        return (len([k for k in owners if k < layers]), len([k for k in owners if k >= layers]),
                sum(cost_model.node_time(n, prepared.infos) for n in clones))

    (whole_with_units, units, seconds), (whole_alone, no_units, seconds_alone) = cloned(True), cloned(False)
    assert units > 0 and no_units == 0
    assert whole_with_units < whole_alone and seconds < seconds_alone
    assert not runs[False].trainer.runner.recompute.units(runs[False].trainer.runner.last_prepared.infos)
    for run in runs.values():
        assert run.trainer.report()["peak_device_bytes"] <= budget
        assert run.losses == reference.losses
        assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())
