"""Staged reductions and readers taken into the split runs (issue 25, cnn small at its minimum):
a ReduceSum/ReduceMean over several axes split on one of them as micro ReduceSums that keep
it, a small Concat and one ReduceSum; exact only where ONNX Runtime's CPU kernel is probed to
sum in that order; and the readers of a run's output split as the run cuts it, so the output
is never merged whole."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

from graph_passes.planning.split import reduction_order
from graph_passes.planning.split.absorb import absorb_readers
from graph_passes.planning.split.graph_pass import SplitPlan, SplitRun
from graph_passes.planning.split.planner import staged_exact
from graph_passes.planning.split.rules import CONCAT, STAGED, SUM, NodeInfo, SplitAxis, constant_values, is_exact, \
    split_options
from helpers import train_ort
from ort_offload.errors import BudgetTooSmallError
from split_helpers import infos_for, split_model

RNG = np.random.default_rng(7)

BN_STATS = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[32, 8, 16, 16] x) => (float[1, 8, 1, 1] s, float[8] m) {
    axes = Constant<value = int64[3] {0, 2, 3}>()
    s = ReduceSum<keepdims = 1>(x, axes)
    m = ReduceMean<keepdims = 0>(x, axes)
}
"""


@pytest.fixture
def one_thread(monkeypatch):
    """The probe at one thread only, as these tests' sessions run."""
    monkeypatch.setattr(reduction_order, "PROBE_THREADS", (1,))
    reduction_order.staged_matches.cache_clear()
    yield
    reduction_order.staged_matches.cache_clear()


def _one_thread(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    """The model's outputs from a session set up as the probe's one-thread session."""
    session = reduction_order._session(model, 1)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds)))


def _options(model, infos, index=0):
    node = model.graph.node[index]
    return node, {o.key: o for o in split_options(NodeInfo.of(node, infos, constant_values(model)))}


def test_a_staged_reduction_is_offered_on_each_reduced_axis_and_is_not_exact_by_itself():
    model = onnx.parser.parse_model(BN_STATS)
    feeds = {"x": RNG.standard_normal((32, 8, 16, 16)).astype(np.float32)}
    infos = infos_for(model, feeds)
    node, options = _options(model, infos, 1)
    assert {SplitAxis(STAGED, a) for a in (0, 2, 3)} <= set(options)
    staged = options[SplitAxis(STAGED, 0)]
    assert staged.op_type == "ReduceSum" and staged.outputs[0].reduce_axes == (0, 2, 3)
    assert not is_exact(staged) and is_exact(options[SplitAxis(CONCAT, 1)]) and not is_exact(options[SplitAxis(SUM, 0)])


@pytest.mark.parametrize("parts", [2, 4])
def test_staged_on_the_batch_gives_the_unsplit_bits_where_the_probe_says_it_does(parts, one_thread):
    """The BatchNorm statistics' shapes: the probe finds ORT's CPU kernel sums rows then rows'
    sums in order, and the split graph's sum and mean are the unsplit graph's bits."""
    model = onnx.parser.parse_model(BN_STATS)
    feeds = {"x": (RNG.standard_normal((32, 8, 16, 16)) * 30 + 2).astype(np.float32)}
    infos = infos_for(model, feeds)
    expected = _one_thread(model, feeds)
    for index in (1, 2):
        node, options = _options(model, infos, index)
        option = options[SplitAxis(STAGED, 0)]
        assert staged_exact(node, infos, option, (parts,), threads=1)
        rewritten = split_model(model, SplitPlan((SplitRun((index,), (option.key,), parts),)), infos)
        assert [n.op_type for n in rewritten.graph.node].count("ReduceSum") == parts + 1 + (index == 2)
        got = _one_thread(rewritten, feeds)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name}, node {index}")


def test_the_probe_refuses_a_split_the_kernel_sums_otherwise(one_thread):
    """A reduced axis that is not the outermost one: the kernel sums each (n, c) row's H*W
    elements first, so per-H partial sums round otherwise; and the probe says so."""
    model = onnx.parser.parse_model(BN_STATS)
    feeds = {"x": (RNG.standard_normal((32, 8, 16, 16)) * 30 + 2).astype(np.float32)}
    infos = infos_for(model, feeds)
    node, options = _options(model, infos, 1)
    option = options[SplitAxis(STAGED, 2)]
    assert not staged_exact(node, infos, option, (2,), threads=1)
    rewritten = split_model(model, SplitPlan((SplitRun((1,), (option.key,), 2),)), infos)
    assert not np.array_equal(_one_thread(rewritten, feeds)["s"], _one_thread(model, feeds)["s"])
    # Integers sum exactly in any order; a staged split of an integer sum needs no probe.
    assert reduction_order.staged_matches("ReduceSum", (4, 4), "<i8", (0, 1), 1, 0, (2,))


def _staged_ok(node, option) -> bool:
    """The planner's view where the probe admits every staged split."""
    return is_exact(option) or option.key.merge == STAGED


FAN_OUT = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[16, 4, 8, 8] x) => (float[1, 4, 1, 1] s, int64 n, float[16, 4, 8, 8] t) {
    h = Relu(x)
    axes = Constant<value = int64[3] {0, 2, 3}>()
    s = ReduceSum<keepdims = 1>(h, axes)
    n = Size(h)
    t = Tanh(x)
}
"""


def test_readers_of_a_run_output_are_taken_into_the_runs_and_the_output_is_never_merged():
    """h = Relu(x), split on the batch, is read by a reduction (staged, small output) and a
    Size (folded into a constant): both taken care of, nothing reads h whole, so no Concat of
    h is left. The outputs are the unsplit graph's."""
    model = onnx.parser.parse_model(FAN_OUT)
    feeds = {"x": RNG.standard_normal((16, 4, 8, 8)).astype(np.float32)}
    infos = infos_for(model, feeds)
    constants = constant_values(model)
    relu = SplitPlan((SplitRun((0,), (SplitAxis(CONCAT, 0),), 2),))
    absorbed = absorb_readers(model, infos, constants, relu, _staged_ok)
    assert absorbed.runs == relu.runs + (SplitRun((2,), (SplitAxis(STAGED, 0),), 2),)
    rewritten = split_model(model, absorbed, infos)
    assert not [n for n in rewritten.graph.node if n.op_type == "Concat" and n.output[0] == "h"]
    assert not [n for n in rewritten.graph.node if n.op_type == "Size"]
    expected, got = _one_thread(model, feeds), _one_thread(rewritten, feeds)
    assert got["n"] == expected["n"] and np.array_equal(got["t"], expected["t"])
    np.testing.assert_allclose(got["s"], expected["s"], rtol=1e-6)
    # Without an exact option for the reduction, nothing is taken in.
    assert absorb_readers(model, infos, constants, relu, lambda node, option: is_exact(option)) == relu


def test_a_reader_with_a_large_output_is_taken_in_only_with_its_own_readers():
    """Relu -> Exp -> ReduceSum: Exp's output is as large as what it reads, so Exp is taken in
    only because its sole reader, the reduction, can be too; where Exp's output goes on to a
    MatMul whose large output the graph returns (a merge that must stay), nothing is."""
    text = """
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[16, 4, 8, 8] x, float[8, 8] w) => (float[1, 4, 1, 1] s) {
        h = Relu(x)
        e = Exp(h)
        axes = Constant<value = int64[3] {0, 2, 3}>()
        s = ReduceSum<keepdims = 1>(e, axes)
    }
    """
    model = onnx.parser.parse_model(text)
    feeds = {"x": RNG.standard_normal((16, 4, 8, 8)).astype(np.float32)}
    infos = infos_for(model, feeds)
    relu = SplitPlan((SplitRun((0,), (SplitAxis(CONCAT, 0),), 2),))
    absorbed = absorb_readers(model, infos, constant_values(model), relu, _staged_ok)
    assert [run.nodes for run in absorbed.runs] == [(0,), (1,), (3,)]
    blocked = onnx.parser.parse_model(text.replace("s = ReduceSum<keepdims = 1>(e, axes)", "s = MatMul(e, w)")
                                      .replace("float[1, 4, 1, 1] s", "float[16, 4, 8, 8] s"))
    feeds["w"] = RNG.standard_normal((8, 8)).astype(np.float32)
    infos = infos_for(blocked, feeds)
    assert absorb_readers(blocked, infos, constant_values(blocked), relu, _staged_ok) == relu


def test_cnn_at_a_split_budget_takes_staged_reductions_and_keeps_the_unplanned_bits(one_thread):
    """cnn tiny on one thread, below the least budget swap and recompute reach: the probe (one
    thread only, as the device runs) admits staged BatchNorm statistics, readers are taken into
    the runs, and five AdamW steps give the unplanned run's bits. Planned on the V100 profile
    (a roofline): split choices measured on this CPU vary with its load."""
    unplanned = train_ort("cnn", steps=5, optimizer="adamw", intra_op_threads=1)
    with pytest.raises(BudgetTooSmallError) as refused:
        train_ort("cnn", steps=1, budget=1, passes=("recompute", "swap"), optimizer="adamw", intra_op_threads=1)
    budget = refused.value.needed_bytes * 4 // 5
    run = train_ort("cnn", steps=5, budget=budget, passes="auto", optimizer="adamw", intra_op_threads=1,
                    planning_profile="V100-16GB-PCIe3")
    prepared = run.trainer.runner.last_prepared
    staged = [n for n in prepared.model.graph.node if n.name.endswith("_reduce") and "__sp" in n.name]
    assert staged, "no staged reduction in the plan"
    assert run.trainer.report()["within_budget"] and prepared.split_plan.exact
    assert run.losses == unplanned.losses
    for key, value in unplanned.state.items():
        np.testing.assert_array_equal(run.state[key], value, err_msg=key)


def test_the_probe_sessions_are_set_up_as_block_sessions_where_the_order_of_sums_matters():
    session = reduction_order._session(onnx.parser.parse_model(BN_STATS), 3)
    options = session.get_session_options()
    assert options.intra_op_num_threads == 3 and options.use_deterministic_compute
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
