"""The split pass (issue 5, item 2): runs of ops split once and merged once, the graph it
writes (Split / micro-ops / Concat or Add), refusals, liveness of the micro-tensors, and real
exported training steps split and run in stock ONNX Runtime with the same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes
import pytest
from hypothesis import given, settings, strategies as st

from graph_passes.ir.liveness import lifetimes
from graph_passes.planning.split.graph_pass import PASS_KEY, SOURCE_KEY, Cut, SplitPass, SplitPlan, SplitRun, write_split_plan
from graph_passes.planning.split.rules import CHAIN, CONCAT, SUM, NodeInfo, SplitAxis, UnsplittableOpError, split_options
from split_helpers import (
    IR_VERSION, OPSET, assert_split_matches, infos_for, max_relative_diff, run, single_op_model, split_model,
)

RNG = np.random.default_rng(1)


def parse(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f'<ir_version: {IR_VERSION}, opset_import: ["" : {OPSET}]>\n' + text)
    onnx.checker.check_model(model)
    return model


RUN_GRAPH = """
agraph (float[8, 6] x, float[8, 6] res, float s) => (float[8, 6] y, float[8, 6] h)
{
    a = Mul(x, s)
    h = Relu(a)
    side = Neg(res)
    b = Add(h, res)
    c = Add(b, side)
    y = Tanh(c)
}
"""


def _feeds():
    return {"x": RNG.standard_normal((8, 6)).astype(np.float32),
            "res": RNG.standard_normal((8, 6)).astype(np.float32), "s": np.array(1.5, np.float32)}


def _ops(model, op_type):
    return [n for n in model.graph.node if n.op_type == op_type]


def _micro_ops(model):
    return [n for n in model.graph.node if any(p.key == SOURCE_KEY for p in n.metadata_props)]


@pytest.mark.parametrize("cut", list(Cut))
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_run_of_elementwise_ops_is_split_once_and_merged_once(parts, axis, cut):
    model, feeds = parse(RUN_GRAPH), _feeds()
    infos = infos_for(model, feeds)
    # Mul -> Relu -> Add(res) -> Add(side) -> Tanh, with Neg(res) between them in graph order.
    run_nodes = (0, 1, 3, 4, 5)
    plan = SplitPlan((SplitRun(run_nodes, (SplitAxis(CONCAT, axis),) * 5, parts),))
    rewritten = split_model(model, plan, infos, cut=cut)
    assert len(_micro_ops(rewritten)) == parts * len(run_nodes)
    # Cut once at the start: x, res and side are read from outside (s, a scalar, is read whole).
    if cut is Cut.SPLIT:
        assert sorted(n.input[0] for n in _ops(rewritten, "Split")) == ["res", "side", "x"]
    else:
        assert not _ops(rewritten, "Split")
        assert sorted(n.input[0] for n in _ops(rewritten, "Slice")) == sorted(["res", "side", "x"] * parts)
    # Merged only where read outside the run: h and y (graph outputs); a, b and c never.
    assert sorted(n.output[0] for n in _ops(rewritten, "Concat")) == ["h", "y"]
    assert all(n.attribute[0].i == axis for n in _ops(rewritten, "Concat"))
    # Micro-ops run depth first: micro-op 0 through the whole run before micro-op 1 starts.
    rounds = [n.name.rsplit("_", 1)[1] for n in _micro_ops(rewritten)]
    assert rounds == [str(i) for i in range(parts) for _ in run_nodes]
    assert all(any(p.key == PASS_KEY and p.value == "split" for p in n.metadata_props)
               for n in rewritten.graph.node if n.op_type in ("Split", "Slice", "Concat"))
    expected, got = run(model, feeds), run(rewritten, feeds)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


def test_a_run_maps_the_split_axis_through_a_transpose_and_a_reshape():
    model = parse("""
    agraph (float[5, 6, 8] x) => (float[6, 40] y)
    {
        t = Transpose<perm = [1, 0, 2]>(x)
        r = Relu(t)
        shape = Constant<value = int64[2] {6, 40}>()
        y = Reshape(r, shape)
    }
    """)
    feeds = {"x": RNG.standard_normal((5, 6, 8)).astype(np.float32)}
    infos = infos_for(model, feeds)
    keys = (SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 0))  # x's axis 1 is t's axis 0
    for parts in (2, 3, 4):
        rewritten = split_model(model, SplitPlan((SplitRun((0, 1, 3), keys, parts),)), infos)
        assert [n.input[0] for n in _ops(rewritten, "Slice")] == ["x"] * parts  # on x's axis 1
        assert all(n.input[3] == _ops(rewritten, "Slice")[0].input[3] for n in _ops(rewritten, "Slice"))
        assert len(_ops(rewritten, "Concat")) == 1
        np.testing.assert_array_equal(run(rewritten, feeds)["y"], run(model, feeds)["y"])


def _liveness_peak(model: onnx.ModelProto, infos) -> int:
    """Largest sum of live value bytes at any node (values freed after their last reader)."""
    spans = lifetimes(model.graph)
    peak = 0
    for position in range(len(model.graph.node)):
        live = sum(infos[n].nbytes for n, s in spans.items() if s.birth <= position <= s.last_use and n in infos)
        peak = max(peak, live)
    return peak


def test_micro_tensors_are_separate_values_so_liveness_frees_each_after_its_micro_op():
    """x -> Exp -> ReduceSum over the batch: unsplit, x and exp(x) are live together (2A).
    Split p ways with Slice cuts and a Sum merge, piece i and its exp die at micro-op i: about
    A (1 + 2/p). A Split cut holds x and all its pieces at once (2A) unless made a view."""
    model = parse("""
    agraph (float[64, 256] x) => (float[256] y)
    {
        e = Exp(x)
        axes = Constant<value = int64[1] {0}>()
        y = ReduceSum<keepdims = 0>(e, axes)
    }
    """)
    feeds = {"x": RNG.standard_normal((64, 256)).astype(np.float32)}
    infos = infos_for(model, feeds)
    whole = infos["x"].nbytes
    assert _liveness_peak(model, infos) >= 2 * whole
    small = 3 * 256 * 4  # partial sums
    for parts in (2, 4, 8):
        plan = SplitPlan((SplitRun((0, 2), (SplitAxis(CONCAT, 0), SplitAxis(SUM, 0)), parts),))
        rewritten = split_model(model, plan, infos)
        assert not _ops(rewritten, "Concat") and len(_ops(rewritten, "Add")) == parts - 1
        after = _liveness_peak(rewritten, infos_for(rewritten, feeds))
        assert after <= whole * (1 + 2 / parts) + small, (parts, after / whole)
        assert max_relative_diff(run(rewritten, feeds)["y"], run(model, feeds)["y"]) <= 1e-6
    with_split = split_model(model, plan, infos, cut=Cut.SPLIT)
    assert _liveness_peak(with_split, infos_for(with_split, feeds)) >= 2 * whole


def test_an_op_without_a_rule_is_refused_with_the_reason():
    model = parse("""
    agraph (float[6, 5] x) => (float[6, 2] v, int64[6, 2] i)
    {
        k = Constant<value = int64[1] {2}>()
        v, i = TopK<axis = 1>(x, k)
    }
    """)
    infos = infos_for(model, {"x": RNG.standard_normal((6, 5)).astype(np.float32)})
    plan = SplitPlan((SplitRun((1,), (SplitAxis(CONCAT, 0),), 2),))
    with pytest.raises(onnx_ir.passes.PreconditionError, match="TopK nodes are never split"):
        SplitPass(plan, infos)(ir.from_proto(model))
    with pytest.raises(UnsplittableOpError, match="never split"):
        write_split_plan(model, plan, infos)


def test_plans_that_do_not_fit_the_graph_are_refused():
    model, feeds = parse(RUN_GRAPH), _feeds()
    infos = infos_for(model, feeds)

    def refused(plan, match):
        with pytest.raises(UnsplittableOpError, match=match):
            write_split_plan(model, plan, infos)

    refused(SplitPlan((SplitRun((0,), (SplitAxis(SUM, 0),), 2),)), r"cannot be split as sum@0 \(its splits: concat@0, concat@1\)")
    refused(SplitPlan((SplitRun((0,), (SplitAxis(CONCAT, 1),), 7),)), "cannot cut a dimension of 6 into 7")
    # The consumer reads the micro-tensors on another axis: not one run.
    refused(SplitPlan((SplitRun((0, 1), (SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)), 2),)), "a dimension of 6")
    refused(SplitPlan((SplitRun((1, 5), (SplitAxis(CONCAT, 0),) * 2, 2),)), "reads no micro-tensor")
    refused(SplitPlan((SplitRun((1, 0), (SplitAxis(CONCAT, 0),) * 2, 2),)), "list a run producer first")
    refused(SplitPlan((SplitRun((0,), (SplitAxis(CONCAT, 0),), 2), SplitRun((0, 1), (SplitAxis(CONCAT, 0),) * 2, 2))),
            "overlap")
    with pytest.raises(ValueError):
        SplitRun((0, 1), (SplitAxis(CONCAT, 0),), 2)


FAN_OUT_GRAPH = """
agraph (float[8, 6] x, float[8, 6] r) => (float[8, 6] y, float[8, 6] z)
{
    h = Relu(x)
    y = Tanh(h)
    z = Add(h, r)
}
"""


@pytest.mark.parametrize("cut", list(Cut))
def test_a_merged_value_whose_readers_cut_it_the_same_way_is_never_made_whole(cut):
    """``h`` (a run's output, read by two other runs): each reads ``h``'s micro-tensors where it
    cuts ``h`` on the same axis into the same pieces, and then nothing reads ``h`` whole: no
    Concat and no cut of it. A reader cutting it otherwise, or reading it whole, keeps the merge."""
    model, feeds = parse(FAN_OUT_GRAPH), {"x": RNG.standard_normal((8, 6)).astype(np.float32),
                                          "r": RNG.standard_normal((8, 6)).astype(np.float32)}
    infos = infos_for(model, feeds)
    expected = run(model, feeds)

    def rewrite(*runs):
        rewritten = split_model(model, SplitPlan(runs), infos, cut=cut)
        got = run(rewritten, feeds)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
        cuts = [n for n in rewritten.graph.node if n.op_type in ("Split", "Slice") and n.input[0] == "h"]
        return [n.output[0] for n in _ops(rewritten, "Concat")], cuts

    relu, tanh, add = (SplitRun((k,), (SplitAxis(CONCAT, 0),), 2) for k in range(3))
    concats, cuts = rewrite(add, tanh, relu)  # in any order in the plan
    assert sorted(concats) == ["y", "z"] and not cuts
    concats, cuts = rewrite(relu, tanh, SplitRun((2,), (SplitAxis(CONCAT, 0),), 4))  # four pieces: cut again
    assert "h" in concats and cuts
    concats, cuts = rewrite(relu, tanh)  # the Add reads h whole
    assert "h" in concats and not cuts


def test_sum_and_concat_runs_on_the_same_micro_tensors_square_matmul():
    """A run whose nodes read the same sliced input but merge differently (MatMul on rows then
    a weight-gradient-like MatMul over the same rows, Sum): both from one Split of x."""
    model = parse("""
    agraph (float[9, 4] x, float[4, 5] w, float[9, 5] g) => (float[9, 5] y, float[4, 5] dw)
    {
        y = MatMul(x, w)
        xt = Transpose<perm = [1, 0]>(x)
        dw = MatMul(xt, g)
    }
    """)
    feeds = {"x": RNG.standard_normal((9, 4)).astype(np.float32), "w": RNG.standard_normal((4, 5)).astype(np.float32),
             "g": RNG.standard_normal((9, 5)).astype(np.float32)}
    infos = infos_for(model, feeds)
    for parts in (2, 3, 4):
        plan = SplitPlan((SplitRun((1, 2), (SplitAxis(CONCAT, 1), SplitAxis(SUM, 1)), parts),))
        rewritten = split_model(model, plan, infos)
        assert sorted(n.input[0] for n in _ops(rewritten, "Slice")) == sorted(["x", "g"] * parts)
        expected, got = run(model, feeds), run(rewritten, feeds)
        np.testing.assert_array_equal(got["y"], expected["y"])
        assert max_relative_diff(got["dw"], expected["dw"]) <= 1e-6


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), data=st.data())
def test_random_elementwise_broadcasts_split_on_any_axis_are_exact(shape, data):
    axis = data.draw(st.sampled_from([j for j, s in enumerate(shape) if s >= 2] or [None]))
    if axis is None:
        return
    parts = data.draw(st.integers(2, shape[axis]))
    # the second operand drops leading axes and has some axes broadcast
    drop = data.draw(st.integers(0, len(shape) - 1))
    other = [1 if data.draw(st.booleans()) else s for s in shape[drop:]]
    feeds = {"a": RNG.standard_normal(shape).astype(np.float32), "b": RNG.standard_normal(other).astype(np.float32)}
    model = single_op_model("Mul", feeds)
    assert_split_matches(model, feeds, 0, SplitAxis(CONCAT, axis), parts)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 9), k=st.integers(2, 9), n=st.integers(2, 9), batch=st.integers(1, 3), data=st.data())
def test_random_matmuls_split_on_any_axis_match(m, k, n, batch, data):
    feeds = {"a": RNG.standard_normal((batch, m, k)).astype(np.float32),
             "b": RNG.standard_normal((k, n)).astype(np.float32)}
    model = single_op_model("MatMul", feeds)
    infos = infos_for(model, feeds)
    options = [o for o in split_options(NodeInfo.of(model.graph.node[0], infos)) if o.extent >= 2]
    option = data.draw(st.sampled_from(options))
    parts = data.draw(st.integers(2, option.extent))
    assert_split_matches(model, feeds, 0, option.key, parts, infos=infos, exact_concat=False)


# --- real exported training steps ------------------------------------------------------------

def _node_index(model, predicate) -> int:
    return next(i for i, n in enumerate(model.graph.node) if predicate(n))


STEP_RTOL = 1e-5


def _assert_same_step(model, rewritten, feeds, *, exact: bool):
    expected, got = run(model, feeds), run(rewritten, feeds)
    assert set(got) == set(expected)
    for name, value in expected.items():
        if exact or not np.issubdtype(value.dtype, np.floating):
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        else:
            # DESIGN's contract for split: reordered reductions, 1e-5 relative over a whole step
            # (a reordered sum early in the step reaches every gradient; Adam squares them).
            assert max_relative_diff(got[name], value) <= STEP_RTOL, name


@pytest.fixture(scope="module")
def gpt_step():
    from helpers import step_graph_and_feeds

    return step_graph_and_feeds("gpt")


@pytest.fixture(scope="module")
def cnn_step():
    from helpers import step_graph_and_feeds

    return step_graph_and_feeds("cnn")


def test_gpt_step_with_split_nodes_gives_the_same_outputs_in_stock_onnxruntime(gpt_step):
    graph, feeds, infos = gpt_step
    model = graph.model
    gelu = _node_index(model, lambda n: n.op_type == "Gelu")
    log_softmax = _node_index(model, lambda n: n.op_type == "LogSoftmax")
    # A Concat split of the forward: Gelu on rows (exact), and the loss's LogSoftmax on the batch.
    plan = SplitPlan((SplitRun((gelu,), (SplitAxis(CONCAT, 0),), 3),
                      SplitRun((log_softmax,), (SplitAxis(CONCAT, 0),), 4)))
    rewritten = split_model(model, plan, infos)
    assert len(_micro_ops(rewritten)) == 7
    _assert_same_step(model, rewritten, feeds, exact=True)
    # A Sum split of the backward: a weight gradient MatMul over the contracted rows, and the
    # embedding gradient (ScatterND with add) as a chain over the batch.
    weight_grad = _node_index(model, lambda n: n.op_type == "MatMul" and n.output[0].endswith("weight.grad"))
    embedding_grad = _node_index(model, lambda n: n.op_type == "ScatterND")
    k = infos[model.graph.node[weight_grad].input[0]].shape
    plan = SplitPlan((SplitRun((weight_grad,), (SplitAxis(SUM, len(k) - 1),), 4),
                      SplitRun((embedding_grad,), (SplitAxis(CHAIN, 0),), 2)))
    rewritten = split_model(model, plan, infos)
    assert len(_micro_ops(rewritten)) == 6
    _assert_same_step(model, rewritten, feeds, exact=False)


def test_cnn_step_with_split_convolutions_gives_the_same_outputs_in_stock_onnxruntime(cnn_step):
    graph, feeds, infos = cnn_step
    model = graph.model
    conv_transpose = _node_index(model, lambda n: n.op_type == "ConvTranspose")
    convs = [i for i, n in enumerate(model.graph.node) if n.op_type == "Conv"]
    forward_conv, weight_grad_conv = convs[0], convs[-1]  # the last Conv is a weight gradient
    assert infos[model.graph.node[weight_grad_conv].input[0]].shape[1] == infos["x"].shape[0]  # batch = in-channels
    # A run: the first Conv on the batch, chained into the batch-norm mean over (N, H, W) that
    # reads it (Sum merge, scaled): Conv merged only for its other readers.
    batch_mean = _node_index(model, lambda n: n.op_type == "ReduceMean"
                             and n.input[0] == model.graph.node[forward_conv].output[0])
    plan = SplitPlan((SplitRun((forward_conv, batch_mean), (SplitAxis(CONCAT, 0), SplitAxis(SUM, 0)), 2),
                      SplitRun((conv_transpose,), (SplitAxis(CONCAT, 0),), 3),
                      SplitRun((weight_grad_conv,), (SplitAxis(SUM, 1),), 2)))
    rewritten = split_model(model, plan, infos)
    assert len(_micro_ops(rewritten)) == 9
    _assert_same_step(model, rewritten, feeds, exact=False)
