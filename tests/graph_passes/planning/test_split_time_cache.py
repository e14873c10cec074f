"""Measured micro-op times kept on disk per machine (graph_passes/planning/split/time_cache.py):
a later process charges the times an earlier one measured and makes the same split plan; a bad
or unwritable cache is ignored with a warning and costs a re-measurement, nothing else."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx.parser
import pytest

import graph_passes.planning.split.planner as split_planner
from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.cost.device_profiles import get_profile
from graph_passes.ir import shapes
from graph_passes.ir.program import lower
from graph_passes.planning.split.planner import JointPlan, JointPlanner, SplitMemo
from graph_passes.planning.split.time_cache import FILE_NAME, MeasuredTimes, machine_key, signature_digest
from split_helpers import SPLIT_CHAIN_GRAPH

INPUTS = {"x": shapes.TensorInfo(np.dtype(np.float32), (64, 64)), "r": shapes.TensorInfo(np.dtype(np.float32), (1, 64))}


def _plan(times: MeasuredTimes):
    """The split chain planned just below its need by a measuring planner over ``times``."""
    model = onnx.parser.parse_model(SPLIT_CHAIN_GRAPH)
    infos = shapes.infer_tensor_infos(model, INPUTS)

    def low(m, i):
        return lower(m, i, state_pairs={}, data_inputs=["x", "r"], fetches=["y"], max_block_nodes=1)

    planner = JointPlanner(lower=low, infer=lambda m: shapes.infer_tensor_infos(m, INPUTS),
                           cost_model=AnalyticalCostModel(get_profile("H100")), measure=True,
                           memo=SplitMemo(measured=times))
    a = infos["a"].nbytes
    plan = planner.plan(model, infos, 3 * a - a // 4)
    assert isinstance(plan, JointPlan)
    return plan, planner


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured again although the cache holds the time")


def test_a_later_process_charges_the_kept_times_and_plans_the_same(tmp_path, monkeypatch):
    first, planner = _plan(MeasuredTimes(tmp_path))
    assert planner.profiled >= 2
    document = json.loads((tmp_path / FILE_NAME).read_text())
    kept = document[machine_key()]
    assert len(kept) >= 2 and all(v is None or v > 0 for v in kept.values())
    # A new process: nothing in memory, the file on disk. Nothing is measured again.
    monkeypatch.setattr(split_planner, "measure_node_times", _no_measuring)
    again, planner = _plan(MeasuredTimes(tmp_path))
    measurable = sum(v is not None for v in kept.values())
    assert again.choices == first.choices and planner.profiled == measurable


def test_times_of_another_machine_are_kept_and_not_used(tmp_path):
    other = {"some other cpu; onnxruntime 0.0": {"f" * 32: 1.0}}
    (tmp_path / FILE_NAME).write_text(json.dumps(other))
    times = MeasuredTimes(tmp_path)
    assert len(times) == 0
    _plan(times)
    document = json.loads((tmp_path / FILE_NAME).read_text())
    assert document["some other cpu; onnxruntime 0.0"] == other["some other cpu; onnxruntime 0.0"]
    assert len(document[machine_key()]) >= 2


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"MACHINE": {"a": -1.0, "b": "fast", "c": float("nan"), "d": True}}),
])
def test_a_bad_cache_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content):
    path = tmp_path / FILE_NAME
    path.write_text(content.replace("MACHINE", machine_key()))
    with caplog.at_level(logging.WARNING, logger="graph_passes.planning.split.time_cache"):
        times = MeasuredTimes(tmp_path)
        assert len(times) == 0
        _plan(times)
    assert any("ignoring" in r.getMessage() for r in caplog.records)
    kept = json.loads(path.read_text())[machine_key()]
    assert len(kept) >= 2 and all(v is None or (isinstance(v, float) and v > 0) for v in kept.values())


def test_an_unwritable_cache_costs_a_warning_only(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory would be
    with caplog.at_level(logging.WARNING, logger="graph_passes.planning.split.time_cache"):
        plan, _ = _plan(MeasuredTimes(blocked / "cache"))
    assert plan.choices and any("could not keep" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.glob("**/*.tmp*"))


def test_only_times_are_kept():
    times = MeasuredTimes("/nonexistent")
    for bad in (0.0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError):
            times[("Add",)] = bad
    times[("Add",)] = None  # not measurable alone
    assert ("Add",) in times and times[("Add",)] is None
    assert signature_digest(("Add", (1, 2))) == signature_digest(("Add", (1, 2))) != signature_digest(("Add", (2, 1)))
