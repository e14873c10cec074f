"""The joint split planner and split cost (issue 5, items 3-4): TSPLIT Eqs. 5-6, Alg. 2's walk to
the bottleneck op and its cheapest fitting split, the checked plan, and the acceptance runs:
gpt/cnn tiny trained with ``--passes auto`` below the least budget swap and recompute alone can
plan."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
import onnx.parser
import pytest

from graph_passes.ir import shapes
from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.cost.device_profiles import get_profile
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import lower
from graph_passes.planning.split.cost import measure_node_times, split_memory_saving
from graph_passes.planning.split.graph_pass import Cut, SplitPlan, SplitRun, write_split_plan
from graph_passes.planning.split import planner as split_planner
from graph_passes.planning.split.planner import Bottleneck, JointPlan, JointPlanner, split_node_count
from graph_passes.planning.split.rules import CONCAT, SUM, SplitAxis
from graph_passes.planning.swap.planner import required_bytes
from graph_passes.ir.allocator import align_up
from helpers import train_ort
from ort_offload.errors import BudgetTooSmallError
from ort_offload.trainer import resolve_passes
from split_helpers import SPLIT_CHAIN_GRAPH, run as run_graph


def _small(text=SPLIT_CHAIN_GRAPH):
    """A graph of x[64, 64] and r[1, 64] with its infos, lowering and split planner."""
    model = onnx.parser.parse_model(text)
    inputs = {"x": shapes.TensorInfo(np.dtype(np.float32), (64, 64)), "r": shapes.TensorInfo(np.dtype(np.float32), (1, 64))}
    infos = shapes.infer_tensor_infos(model, inputs)

    def low(m, i):
        return lower(m, i, state_pairs={}, data_inputs=["x", "r"], fetches=["y"], max_block_nodes=1)

    planner = JointPlanner(lower=low, infer=lambda m: shapes.infer_tensor_infos(m, inputs),
                           cost_model=AnalyticalCostModel(get_profile("H100")))
    return model, infos, low, planner


def _least(program, infos):
    return required_bytes(program, {n: align_up(i.nbytes) for n, i in infos.items()})


def test_eq5_saving():
    assert split_memory_saving(4096, 1024, 4) == 768
    assert split_memory_saving(1000, 1000, 1) == 0
    with pytest.raises(ValueError):
        split_memory_saving(1, 1, 0)


def test_the_planner_splits_the_bottleneck_op_cheapest_first_and_checks_the_plan():
    model, infos, low, planner = _small()
    unsplit = _least(low(model, infos), infos)  # the Add: a, b and z
    a = infos["a"].nbytes
    assert unsplit == 3 * a
    budget = unsplit - a // 4
    plan = planner.plan(model, infos, budget)
    assert isinstance(plan, JointPlan) and dataclasses.is_dataclass(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget = 0
    (choice,) = plan.choices
    assert choice.node == "z"  # the unnamed Add, by its output
    # The fewest parts that fit; measured on the lowered program: with swapping, each micro-op
    # needs its pieces only (3A/2) and the Concat merge 2A.
    assert choice.parts == 2 and choice.needed_after == 2 * a <= budget
    assert choice.added_time_s > 0  # a launch per micro-op more than the op
    # Without swapping, the same split saves Eq. 5 in the arena replay (inputs 2A, output A).
    rewritten, _ = write_split_plan(model, plan.split, infos, cut=Cut.SPLIT)
    new_infos = planner.infer(rewritten)
    replayed = simulate_program(low(rewritten, new_infos), new_infos).min_budget_bytes
    assert simulate_program(low(model, infos), infos).min_budget_bytes - replayed == split_memory_saving(2 * a, a, 2)
    assert plan.checked_peak_bytes <= budget and plan.required_bytes == choice.needed_after
    assert _least(low(rewritten, new_infos), new_infos) <= budget
    assert split_node_count(rewritten) > 0 and split_node_count(model) == 0


# Two ops in a row that a budget below 3A splits: the Add's output is read by the Mul alone.
_CHAIN_OF_TWO = """
<ir_version: 9, opset_import: ["" : 20]>
g (float[64, 64] x, float[1, 64] r) => (float y) {
    shape = Constant<value = int64[2] {64, 64}>()
    b = Expand(r, shape)
    z = Add(x, b)
    t = Mul(z, b)
    y = ReduceSum<keepdims = 0>(t)
}
"""


def test_split_ops_in_a_row_become_one_run_whose_pieces_flow_from_op_to_op():
    """Add and Mul, each split two ways alone, become one run: the Mul reads the Add's
    micro-outputs, ``z`` is never merged (no Concat, no second Split), the split graph has
    fewer nodes and needs no more than the two runs apart, and it computes the unsplit
    graph's ``y`` exactly."""
    model, infos, low, planner = _small(_CHAIN_OF_TWO)
    a = infos["z"].nbytes
    plan = planner.plan(model, infos, 5 * a // 2)
    assert isinstance(plan, JointPlan) and [c.node for c in plan.choices] == ["z", "t"]
    (run,) = plan.split.runs
    assert run.nodes == (2, 3) and run.parts == 2
    chained, _ = write_split_plan(model, plan.split, infos, cut=Cut.SPLIT)
    apart = SplitPlan(tuple(SplitRun((i,), (axis,), run.parts) for i, axis in zip(run.nodes, run.axes)))
    separate, _ = write_split_plan(model, apart, infos, cut=Cut.SPLIT)
    # Apart, the Mul's run reads the Add's micro-tensors too (the split pass shares a merged
    # value's pieces with a run cutting it the same way): z is not made whole either way.
    for graph in (chained, separate):
        assert "z" not in {o for n in graph.graph.node for o in n.output}
    chained_infos, separate_infos = planner.infer(chained), planner.infer(separate)
    assert _least(low(chained, chained_infos), chained_infos) <= _least(low(separate, separate_infos), separate_infos)
    assert len(chained.graph.node) <= len(separate.graph.node)
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32),
             "r": np.random.default_rng(1).standard_normal((1, 64), dtype=np.float32)}
    assert np.array_equal(run_graph(chained, feeds)["y"], run_graph(model, feeds)["y"])


# A weight gradient: w[8, 8] = a^T @ s over a batch of 8192 rows (Gemm, transA). Its rows and
# columns (Concat; a column cut of a or s is a copy) and its contracted batch axis (a Sum of
# partial products; row cuts are views) all bring it under a budget just below its need; the Sum
# split saves half the bytes, the Concats almost none, and the Sum costs less time.
_WEIGHT_GRADIENT = """
<ir_version: 9, opset_import: ["" : 20]>
g (float[8192, 8] x, float[8192, 8] h) => (float y) {
    a = Sigmoid(x)
    s = Sigmoid(h)
    w = Gemm<transA = 1>(a, s)
    y = ReduceSum<keepdims = 0>(w)
}
"""


def test_an_exact_split_wins_over_a_cheaper_sum_of_partial_products(monkeypatch):
    """Where the Gemm's rows and its contracted axis both fit, the planner splits the rows
    (a Concat: the same bits as the unsplit op) although the Sum split saves more for less time;
    ranked by cost alone it would take the Sum. The exact plan computes the unsplit ``y``
    bitwise, and a Sum split's last add is costed with its split (it carries the split's tag)."""
    import graph_passes.planning.split.planner as split_planner

    model = onnx.parser.parse_model(_WEIGHT_GRADIENT)
    inputs = {n: shapes.TensorInfo(np.dtype(np.float32), (8192, 8)) for n in ("x", "h")}
    infos = shapes.infer_tensor_infos(model, inputs)

    def low(m, i):
        return lower(m, i, state_pairs={}, data_inputs=["x", "h"], fetches=["y"], max_block_nodes=1)

    planner = JointPlanner(lower=low, infer=lambda m: shapes.infer_tensor_infos(m, inputs),
                           cost_model=AnalyticalCostModel(get_profile("H100")))
    need = _least(low(model, infos), infos)
    budget = need - 64
    plan = planner.plan(model, infos, budget)
    assert isinstance(plan, JointPlan) and plan.exact
    (choice,) = plan.choices
    assert (choice.node, choice.axis, choice.exact) == ("w", SplitAxis(CONCAT, 0), True)
    assert planner.candidates_tried == 2  # rows and columns; the Sum is not tried once an exact split fits

    monkeypatch.setattr(split_planner, "is_exact", lambda option: True)  # rank by ΔT/ΔM alone
    by_cost = JointPlanner(lower=low, infer=planner.infer, cost_model=planner.cost_model).plan(model, infos, budget)
    (cheaper,) = by_cost.choices
    assert cheaper.axis == SplitAxis(SUM, 0) and cheaper.saved_bytes > choice.saved_bytes
    assert cheaper.added_time_s / cheaper.saved_bytes < choice.added_time_s / choice.saved_bytes
    summed, _ = write_split_plan(model, by_cost.split, infos, cut=Cut.SPLIT)
    adds = [n.name for n in summed.graph.node if n.op_type == "Add"]
    assert adds and all("__sp0" in name for name in adds)  # the merge is costed with its split

    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((8192, 8), dtype=np.float32) for n in ("x", "h")}
    exact, _ = write_split_plan(model, plan.split, infos, cut=Cut.SPLIT)
    assert np.array_equal(run_graph(exact, feeds)["y"], run_graph(model, feeds)["y"])


def _four_d():
    """The split chain on [2, 8, 8, 8] values: the graph, its inputs and infos, its lowering,
    and a budget that splits the Add (axis 0 may be a view; axes 1-3 split alike)."""
    text = SPLIT_CHAIN_GRAPH.replace("float[64, 64] x, float[1, 64] r", "float[2, 8, 8, 8] x, float[1, 8, 8, 8] r")
    text = text.replace("int64[2] {64, 64}", "int64[4] {2, 8, 8, 8}")
    model = onnx.parser.parse_model(text)
    f32 = np.dtype(np.float32)
    inputs = {"x": shapes.TensorInfo(f32, (2, 8, 8, 8)), "r": shapes.TensorInfo(f32, (1, 8, 8, 8))}
    infos = shapes.infer_tensor_infos(model, inputs)

    def low(m, i):
        return lower(m, i, state_pairs={}, data_inputs=["x", "r"], fetches=["y"], max_block_nodes=1)

    return model, inputs, infos, low, 3 * infos["a"].nbytes - infos["a"].nbytes // 4


def test_options_that_only_differ_in_a_non_leading_axis_are_rewritten_once(monkeypatch):
    # An Add of two [2, 8, 8, 8] values: axis 0 may be a view, axes 1-3 write the same nodes
    # on other axes (same bytes, same roofline times): one of them is rewritten, and the plan
    # is the one trying every option gives.
    model, inputs, infos, low, budget = _four_d()

    def planner():
        return JointPlanner(lower=low, infer=lambda m: shapes.infer_tensor_infos(m, inputs),
                            cost_model=AnalyticalCostModel(get_profile("H100")))

    fewer = planner()
    plan = fewer.plan(model, infos, budget)
    monkeypatch.setattr(split_planner, "_cost_class", lambda *args: None)
    every = planner()
    assert plan == every.plan(model, infos, budget) and isinstance(plan, JointPlan)
    assert fewer.candidates_skipped == 2 and fewer.candidates_tried == every.candidates_tried - 2
    # A planner measuring times on this machine tries every axis (measured times differ by axis).
    monkeypatch.undo()
    measuring = JointPlanner(lower=low, infer=fewer.infer, cost_model=fewer.cost_model, measure=True)
    measuring.plan(model, infos, budget)
    assert measuring.candidates_skipped == 0


def test_candidate_splits_rewritten_in_forked_workers_give_the_same_plan(tmp_path):
    """An op's candidate splits are rewritten side by side in forked processes: the same
    candidates, the same plan as in one process, and the rewrites did run elsewhere."""
    model, inputs, infos, low, budget = _four_d()
    pids = tmp_path / "pids"

    def infer(m):
        with open(pids, "a") as f:  # every process that rewrites a candidate
            f.write(f"{os.getpid()}\n")
        return shapes.infer_tensor_infos(m, inputs)

    plans, tried = {}, {}
    for workers in (1, 2):
        planner = JointPlanner(lower=low, infer=infer, cost_model=AnalyticalCostModel(get_profile("H100")),
                               workers=workers)
        plans[workers], tried[workers] = planner.plan(model, infos, budget), planner.candidates_tried
        if workers == 1:
            assert set(pids.read_text().split()) == {str(os.getpid())}
            pids.unlink()
    assert isinstance(plans[1], JointPlan) and plans[1] == plans[2] and tried[1] == tried[2] > 1
    assert set(pids.read_text().split()) - {str(os.getpid())}


def test_the_planner_names_the_bottleneck_when_no_split_fits():
    model, infos, low, planner = _small()
    a = infos["a"].nbytes
    # Below 2A the first op, Sigmoid, is the bottleneck: its input x is a graph input (loaded
    # whole, so a split of it is a copy: x and its pieces, 2A) and its merge holds 2A.
    result = planner.plan(model, infos, 2 * a - 1)
    assert isinstance(result, Bottleneck)
    assert (result.node, result.op_type, result.needed_bytes) == ("a", "Sigmoid", 2 * a)
    assert "Sigmoid" in result.reason


def test_measured_micro_ops_are_timed():
    model, infos, _, _ = _small()
    split, _ = write_split_plan(model, SplitPlan((SplitRun((3,), (SplitAxis(CONCAT, 0),), 4),)), infos, cut=Cut.SPLIT)
    split_infos = shapes.infer_tensor_infos(split, {n: infos[n] for n in ("x", "r")})
    micro = [n for n in split.graph.node if n.op_type == "Add"]
    times = measure_node_times(split, micro, split_infos, repeats=3)
    assert set(times) == {n.name for n in micro} and all(t > 0 for t in times.values())


def test_a_node_that_fails_on_made_up_inputs_is_left_to_the_cost_model():
    # The target shape is made by another node: measured alone it gets zeros, [0, 0, 0], which a
    # rank-2 input cannot take (dims copied from positions it does not have).
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 6] x, int64[3] s) => (float[4, 2, 3] y) { y = Reshape(x, s) }""")
    model.graph.node[0].name = "reshape"
    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    infos = {"x": shapes.TensorInfo(f32, (4, 6)), "s": shapes.TensorInfo(i64, (3,)), "y": shapes.TensorInfo(f32, (4, 2, 3))}
    assert measure_node_times(model, model.graph.node, infos, repeats=1) == {}
    shape = onnx.numpy_helper.from_array(np.array([4, 2, 3], dtype=np.int64), "s")
    model.graph.initializer.append(shape)  # now a constant: measured
    assert set(measure_node_times(model, model.graph.node, infos, repeats=1)) == {"reshape"}


def test_a_measuring_planner_charges_profiled_micro_ops():
    model, infos, low, planner = _small()
    measuring = JointPlanner(lower=low, infer=planner.infer, cost_model=planner.cost_model, measure=True)
    budget = 3 * infos["a"].nbytes - infos["a"].nbytes // 4
    plan = measuring.plan(model, infos, budget)
    assert isinstance(plan, JointPlan) and measuring.profiled >= 2  # the Add and its micro-op
    # Measured on this CPU, not the H100 roofline the other planner charges.
    assert plan.choices[0].added_time_s != planner.plan(model, infos, budget).choices[0].added_time_s


def test_split_is_a_pass_name():
    assert "split" in resolve_passes("auto") and resolve_passes("swap,split") == ["swap", "split"]


@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow), "cnn"])
def test_auto_trains_below_the_least_budget_swap_and_recompute_can_plan(name):
    # The least budget swap + recompute alone can plan (what planning reports when refusing).
    with pytest.raises(BudgetTooSmallError) as refused:
        train_ort(name, steps=1, budget=1, passes=("recompute", "swap"), optimizer="adamw")
    least = refused.value.needed_bytes
    budget = least * 4 // 5
    with pytest.raises(BudgetTooSmallError):
        train_ort(name, steps=1, budget=budget, passes=("recompute", "swap"), optimizer="adamw")
    unplanned = train_ort(name, steps=5, optimizer="adamw")
    run = train_ort(name, steps=5, budget=budget, passes="auto", optimizer="adamw")
    report = run.trainer.report()
    assert report["peak_device_bytes"] <= budget and report["within_budget"]
    assert "split" in report["passes"] and report["split_nodes"] > 0
    assert report["steps"] == 5
    # The measured peak is the plan's arena replay. Which axis each op is cut on is chosen from
    # kernels timed on this machine (near ties between batch and channel), so it varies from run
    # to run: a batch (leading-axis) cut is lowered as a view, a channel cut as a copying Split.
    prepared = run.trainer.runner.last_prepared
    assert prepared.split_plan.checked_peak_bytes <= budget
    if any(choice.axis.axis == 0 for choice in prepared.split_plan.choices):
        assert prepared.program.views
    for whole, pieces in prepared.program.views:  # pieces back to back make up the whole value
        assert len(pieces) >= 2 and whole not in pieces
    assert report["peak_device_bytes"] == prepared.trace.peak_device_bytes
    # Every op here has an exact split (Concat merges) that fits, and exact splits come first:
    # five AdamW steps (which magnify any rounding change) give the unplanned run's bits.
    assert prepared.split_plan.exact and report["split_exact"] is True
    assert run.losses == unplanned.losses
    for key, value in unplanned.state.items():
        np.testing.assert_array_equal(run.state[key], value, err_msg=key)


@pytest.mark.slow  # a minimum search with split (~20 s)
def test_a_budget_no_split_reaches_names_the_bottleneck_and_a_minimum_that_plans():
    with pytest.raises(BudgetTooSmallError) as refused:
        train_ort("gpt", steps=1, budget=1, passes=("swap",), optimizer="adamw")
    least = refused.value.needed_bytes
    # A third of the swap minimum: below a whole activation and its copy, which a merge holds.
    with pytest.raises(BudgetTooSmallError) as refused:
        train_ort("gpt", steps=1, budget=least // 3, passes="auto", optimizer="adamw")
    assert "splitting stops at" in str(refused.value)
    # The least budget stated is the one a split plan needs (searched): below the swap minimum.
    assert least // 3 < refused.value.needed_bytes < least


def test_program_order_puts_back_the_view_splits_so_the_order_lowers_again():
    """A batch split lowers its Split as a view that no block runs: the blocks' node order
    alone lacks it (its pieces' readers then read what nothing makes), program_order puts it
    back, and lowering that order gives the same blocks."""
    from graph_passes.ir.program import program_order

    model, infos, low, planner = _small()
    batch_split = SplitPlan((SplitRun((3,), (SplitAxis(CONCAT, 0),), 2),))  # the Add z, on its rows
    rewritten, _ = write_split_plan(model, batch_split, infos, cut=Cut.SPLIT)
    new_infos = planner.infer(rewritten)
    program = low(rewritten, new_infos)
    assert program.views
    in_blocks = [i for block in program.blocks for i in block.node_indices]
    assert len(in_blocks) < len(rewritten.graph.node)
    with pytest.raises(ValueError, match="before it is produced"):
        lower(rewritten, new_infos, state_pairs={}, data_inputs=["x", "r"], fetches=["y"], max_block_nodes=1,
              schedule=in_blocks)
    order = program_order(rewritten, program)
    assert sorted(order) == list(range(len(rewritten.graph.node)))
    again = lower(rewritten, new_infos, state_pairs={}, data_inputs=["x", "r"], fetches=["y"], max_block_nodes=1,
                  schedule=order)
    assert [b.node_indices for b in again.blocks] == [b.node_indices for b in program.blocks]
