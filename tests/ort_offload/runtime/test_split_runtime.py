"""Split views in the runtime (issue 5): a split-pass Split on a contiguous leading axis runs no
kernel; its input is allocated as the pieces back to back and each piece is freed at its own
last use, so the arena replay and the measured peak show the split's saving, and the outputs
are the unsplit graph's."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

from graph_passes.ir import shapes
from graph_passes.ir.allocator import BestFitAllocator
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import RunBlock, lower, split_views
from graph_passes.planning.split.graph_pass import Cut, SplitPlan, SplitRun, write_split_plan
from graph_passes.planning.split.rules import CONCAT, SplitAxis
from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload.device import set_offload_device
from ort_offload.runtime.runner import GraphRunner, Runtime
from split_helpers import SPLIT_CHAIN_GRAPH


def _graph(model: onnx.ModelProto) -> TrainingGraph:
    roles = {"x": Role.INPUT, "r": Role.INPUT, "y": Role.LOSS}
    for node in model.graph.node:
        for out in node.output:
            roles.setdefault(out, Role.ACTIVATION)
    return TrainingGraph(model, roles, {}, name="g")


def _split_add(model, infos, parts, axis=0, cut=Cut.SPLIT):
    add = next(i for i, n in enumerate(model.graph.node) if n.op_type == "Add")
    return write_split_plan(model, SplitPlan((SplitRun((add,), (SplitAxis(CONCAT, axis),), parts),)), infos, cut=cut)[0]


def _feeds(x):
    return {"x": x, "r": np.linspace(-1, 1, 64, dtype=np.float32)[None]}


def _infos(model, x):
    return shapes.infer_tensor_infos(model, shapes.check_inputs(model, _feeds(x)))


def _run(model, x, budget=None):
    runtime = Runtime(set_offload_device("cpu", max_block_nodes=1, budget=budget))
    runner = GraphRunner(runtime, _graph(model), fetches=["y"])
    prepared = runner.prepare(shapes.check_inputs(model, _feeds(x)))
    runtime.place_state({}, prepared.program.state_inputs, runner.capacity_for(prepared))
    out = runner.run(_feeds(x), prepared)["y"]
    return out, prepared, runtime.stats.peak_device_bytes


def test_partition_tiles_a_placement_and_frees_pieces_alone():
    allocator = BestFitAllocator(alignment=64)
    allocator.allocate("w", 256)
    allocator.partition("w", [("w0", 128), ("w1", 100)])
    assert "w" not in allocator and allocator.placement("w1").offset == 128 and allocator.in_use == 256
    allocator.free("w0")
    assert allocator.in_use == 128
    with pytest.raises(ValueError):
        allocator.allocate("v", 256)
        allocator.partition("v", [("v0", 100), ("v1", 156)])  # a boundary off the alignment


@pytest.mark.parametrize("parts", [2, 4])
def test_a_split_view_saves_in_the_replay_and_in_the_measured_peak(parts):
    model = onnx.parser.parse_model(SPLIT_CHAIN_GRAPH)
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    infos = _infos(model, x)
    split = _split_add(model, infos, parts)
    split_infos = _infos(split, x)
    views = split_views(split, split_infos, list(range(len(split.graph.node))))
    assert sorted(whole for whole, _ in views.values()) == ["a", "b"]
    expected, base, base_peak = _run(model, x)
    got, prepared, peak = _run(split, x)
    np.testing.assert_array_equal(got, expected)  # Concat merges: exact
    program = prepared.program
    assert {w for w, _ in program.views} == {"a", "b"}
    # The view Splits run no kernel; their inputs' producers allocate the pieces.
    split_nodes = {i for i, n in enumerate(split.graph.node) if n.op_type == "Split"}
    assert not split_nodes & {i for b in program.blocks for i in b.node_indices}
    allocated = [n for s in program.steps if isinstance(s, RunBlock) for n in s.allocates]
    assert "a" not in allocated and all(p in allocated for _, pieces in program.views for p in pieces)
    # Measured == replayed, and below the unsplit program: at the Add, a and b go piece by
    # piece and z arrives piece by piece (3A -> 2A + A/p; the Concat holds 2A).
    assert peak == prepared.trace.peak_device_bytes
    assert base_peak == base.trace.peak_device_bytes
    size = infos["a"].nbytes
    assert base.trace.min_budget_bytes - prepared.trace.min_budget_bytes == (parts - 1) * size // parts


def test_the_split_runs_under_a_budget_the_unsplit_graph_cannot():
    model = onnx.parser.parse_model(SPLIT_CHAIN_GRAPH)
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    infos = _infos(model, x)
    split = _split_add(model, infos, 4)
    expected, base, _ = _run(model, x)
    _, prepared, _ = _run(split, x)
    budget = prepared.trace.min_budget_bytes
    assert budget < base.trace.min_budget_bytes
    got, planned, peak = _run(split, x, budget=budget)
    assert peak <= budget
    # The arena replay under the budget (compacting where the runtime compacts) is the measurement.
    assert simulate_program(planned.program, planned.infos, budget=budget).peak_device_bytes == peak
    np.testing.assert_array_equal(got, expected)


def test_splits_that_cannot_be_views_are_copies():
    model = onnx.parser.parse_model(SPLIT_CHAIN_GRAPH)
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    infos = _infos(model, x)
    for split in (_split_add(model, infos, 4, axis=1), _split_add(model, infos, 4, cut=Cut.SLICE)):
        split_infos = _infos(split, x)
        assert not split_views(split, split_infos, list(range(len(split.graph.node))))
        expected = ort.InferenceSession(model.SerializeToString()).run(None, _feeds(x))[0]
        got, prepared, peak = _run(split, x)
        assert not prepared.program.views and peak == prepared.trace.peak_device_bytes
        np.testing.assert_array_equal(got, expected)
    # Pieces of 16 rows of 64 floats (4 KiB): views at a 64-byte alignment, copies at 8 KiB.
    split = _split_add(model, infos, 4)
    split_infos = _infos(split, x)
    order = list(range(len(split.graph.node)))
    assert split_views(split, split_infos, order, 64) and not split_views(split, split_infos, order, 8192)
