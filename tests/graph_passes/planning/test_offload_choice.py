"""Recompute or swap by cost (issue 4, item 5): segments priced both ways on a profile, and the
runtime's choice among whole plans by simulated step time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.planning.offload_choice import SegmentCost, recompute_first, segment_costs
from graph_passes.planning.recompute.planner import Segment
from graph_passes.ir.shapes import TensorInfo
from helpers import train_ort

F32 = np.dtype("float32")


def _model_and_infos():
    """x[n, n] -> Relu (cheap, big output) ; MatMul with w[n, n] (n³ FLOPs, same output)."""
    n = 512
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["m"], name="matmul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph)
    infos = {name: TensorInfo(F32, (n, n)) for name in ("x", "w", "r", "m")}
    return model, infos, n


def test_cheap_elementwise_segments_recompute_and_heavy_matmuls_swap():
    model, infos, n = _model_and_infos()
    saved = n * n * 4
    segments = [Segment(0, (0,), ("r",), saved), Segment(1, (1,), ("m",), saved), Segment(2, (), (), 0)]
    # a slow link and fast compute: re-running a Relu beats copying its output out and back;
    # a fast link and slow compute: copying the MatMul output beats its n³ FLOPs
    fast_compute = dataclasses.replace(V100_16GB_PCIE3, name="fast-compute", peak_flops=1e15,
                                       memory_bandwidth=1e13, kernel_launch_s=0.0)
    costs = segment_costs(segments, model, infos, cost_model=AnalyticalCostModel(fast_compute), profile=fast_compute)
    assert [c.cheaper for c in costs[:2]] == ["recompute", "recompute"]
    assert costs[0].swap_s == pytest.approx(saved / 12e9 * 2)
    slow_compute = dataclasses.replace(V100_16GB_PCIE3, name="slow-compute", peak_flops=1e9, kernel_launch_s=0.0,
                                       h2d_bandwidth=1e12, d2h_bandwidth=1e12, duplex_bandwidth=2e12)
    costs = segment_costs(segments, model, infos, cost_model=AnalyticalCostModel(slow_compute), profile=slow_compute)
    assert costs[1].cheaper == "swap" and costs[1].recompute_s == pytest.approx(2 * n**3 / 1e9, rel=0.01)
    assert recompute_first(costs) == tuple(c.index for c in costs if c.saved_bytes and c.cheaper == "recompute")
    assert 2 not in recompute_first([SegmentCost(2, 0, 0.0, 1.0)])  # saves nothing: never chosen


@pytest.fixture(scope="module")
def unplanned_cnn():
    return train_ort("cnn", optimizer="adamw", steps=3)


@pytest.mark.parametrize("profile", [None, "V100-16GB-PCIe3"])
def test_runtime_takes_the_fastest_simulated_candidate_and_stays_bitwise(profile, unplanned_cnn):
    reference = unplanned_cnn
    run = train_ort("cnn", optimizer="adamw", steps=3, budget="0.25x", passes="recompute,swap",
                    planning_profile=profile)
    runner = run.trainer.runner
    choice = dict(runner.last_choice)
    assert "swap" in choice and len(choice) >= 2 and all(t > 0 for t in choice.values())
    assert len(runner.last_segment_costs) == len(runner.recompute.segments(runner.last_prepared.infos))
    fastest = min(choice, key=choice.get)
    report = run.trainer.report()
    expected = {"swap": ["swap"], "recompute": ["recompute"]}.get(fastest, ["recompute", "swap"])
    assert report["passes"] == expected
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())
