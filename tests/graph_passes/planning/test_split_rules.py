"""Split rules (issue 5, item 1), one op at a time: every split a rule offers for a small node,
applied p = 2, 3, 4 ways by the split pass and run in stock ONNX Runtime, equals the unsplit op
(bitwise for Concat merges, within 1e-6 relative for Sum and chain merges and for the ops whose
ORT kernels are not bitwise invariant to the tensor size, :data:`NOT_BITWISE_OPS`). Dimensions
are chosen so that most splits are uneven (sizes as numpy.array_split)."""

from __future__ import annotations

import numpy as np
import pytest

from graph_passes.planning.split.rules import (
    CHAIN, CONCAT, ELEMENTWISE_OPS, SPLIT_RULES, STAGED, SUM, UNSPLITTABLE, NodeInfo, SliceOn, SplitAxis, UnsplittableOpError, Whole,
    chunk_sizes, constant_values, split_options,
)
from split_helpers import assert_split_matches, infos_for, keys_of, single_op_model

RNG = np.random.default_rng(0)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def pos(*shape):
    return (np.abs(RNG.standard_normal(shape)) + 0.5).astype(np.float32)


def ints(high, *shape):
    return RNG.integers(0, high, size=shape).astype(np.int64)


def i64(*values):
    return np.asarray(values, dtype=np.int64)


# id -> (op, inputs, constants, attrs, input order, outputs)
CASES = {
    "Add-broadcast": ("Add", {"a": f32(5, 6, 7), "b": f32(6, 1)}, {}, {}, None, 1),
    "Sub": ("Sub", {"a": f32(5, 7), "b": f32(7)}, {}, {}, None, 1),
    "Mul": ("Mul", {"a": f32(5, 6, 7), "b": f32(5, 6, 7)}, {}, {}, None, 1),
    "Div": ("Div", {"a": f32(5, 6), "b": pos(5, 6)}, {}, {}, None, 1),
    "Pow": ("Pow", {"a": pos(5, 6)}, {"e": np.float32(2.0)}, {}, None, 1),
    "Where": ("Where", {"c": RNG.random((5, 1, 7)) > 0.5, "x": f32(5, 6, 7)}, {"y": np.float32(0.0)}, {}, None, 1),
    "Equal": ("Equal", {"a": ints(3, 5, 6), "b": ints(3, 6)}, {}, {}, None, 1),
    "LessOrEqual": ("LessOrEqual", {"a": f32(5, 6), "b": f32(5, 1)}, {}, {}, None, 1),
    "Not": ("Not", {"a": RNG.random((5, 6)) > 0.5}, {}, {}, None, 1),
    "And": ("And", {"a": RNG.random((5, 6)) > 0.5, "b": RNG.random((5, 6)) > 0.5}, {}, {}, None, 1),
    "Relu": ("Relu", {"x": f32(5, 6, 7)}, {}, {}, None, 1),
    "Gelu": ("Gelu", {"x": f32(5, 6, 7)}, {}, {}, None, 1),
    "Erf": ("Erf", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Sqrt": ("Sqrt", {"x": pos(5, 6)}, {}, {}, None, 1),
    "Exp": ("Exp", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Neg": ("Neg", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Reciprocal": ("Reciprocal", {"x": pos(5, 6)}, {}, {}, None, 1),
    "Tanh": ("Tanh", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Sigmoid": ("Sigmoid", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Cast": ("Cast", {"x": f32(5, 6)}, {}, {"to": 11}, None, 1),
    "Clip": ("Clip", {"x": f32(5, 6)}, {"lo": np.float32(-0.5), "hi": np.float32(0.5)}, {}, None, 1),
    "Identity": ("Identity", {"x": f32(5, 6)}, {}, {}, None, 1),
    "Softmax": ("Softmax", {"x": f32(5, 6, 7)}, {}, {"axis": -1}, None, 1),
    "LogSoftmax": ("LogSoftmax", {"x": f32(5, 7)}, {}, {"axis": 1}, None, 1),
    "LayerNormalization": ("LayerNormalization", {"x": f32(5, 6, 8), "s": f32(8), "b": f32(8)}, {},
                           {"axis": -1, "epsilon": 1e-5}, None, 3),
    "BatchNormalization-training": (
        "BatchNormalization", {"x": f32(5, 6, 4, 4), "s": f32(6), "b": f32(6), "m": f32(6), "v": pos(6)}, {},
        {"training_mode": 1, "momentum": 0.9}, None, 3),
    "BatchNormalization-inference": (
        "BatchNormalization", {"x": f32(5, 6, 4, 4), "s": f32(6), "b": f32(6), "m": f32(6), "v": pos(6)}, {}, {},
        None, 1),
    "MatMul-2d": ("MatMul", {"a": f32(7, 9), "b": f32(9, 6)}, {}, {}, None, 1),
    "MatMul-3d-weight": ("MatMul", {"a": f32(5, 7, 9), "b": f32(9, 6)}, {}, {}, None, 1),
    "MatMul-broadcast-batch": ("MatMul", {"a": f32(5, 1, 7, 8), "b": f32(6, 8, 5)}, {}, {}, None, 1),
    "MatMul-vector": ("MatMul", {"a": f32(9), "b": f32(5, 9, 6)}, {}, {}, None, 1),
    "MatMul-weight-grad": ("MatMul", {"a": f32(6, 11), "b": f32(11, 7)}, {}, {}, None, 1),
    "Gemm-bias": ("Gemm", {"a": f32(7, 9), "w": f32(6, 9), "c": f32(6)}, {}, {"transB": 1, "alpha": 0.5}, None, 1),
    "Gemm-no-bias": ("Gemm", {"a": f32(9, 7), "w": f32(9, 6)}, {}, {"transA": 1}, None, 1),
    "Conv": ("Conv", {"x": f32(5, 6, 7, 7), "w": f32(8, 6, 3, 3)}, {}, {"pads": [1, 1, 1, 1]}, None, 1),
    "Conv-bias-stride": ("Conv", {"x": f32(5, 6, 7, 7), "w": f32(7, 6, 3, 3), "b": f32(7)}, {},
                         {"strides": [2, 2]}, None, 1),
    # torch's weight gradient: Conv(X^T (C, N, H, W), dY^T (M, N, H, W)), the batch N contracted.
    "Conv-weight-grad": ("Conv", {"xt": f32(6, 5, 7, 7), "dyt": f32(8, 5, 7, 7)}, {},
                         {"pads": [1, 1, 1, 1]}, None, 1),
    "ConvTranspose-input-grad": ("ConvTranspose", {"dy": f32(5, 8, 7, 7), "w": f32(8, 6, 3, 3)}, {},
                                 {"pads": [1, 1, 1, 1]}, None, 1),
    "ConvTranspose-stride-bias": ("ConvTranspose", {"dy": f32(5, 8, 4, 4), "w": f32(8, 6, 3, 3), "b": f32(6)}, {},
                                  {"strides": [2, 2], "pads": [1, 1, 0, 0], "output_padding": [1, 1]}, None, 1),
    "MaxPool": ("MaxPool", {"x": f32(5, 6, 8, 8)}, {}, {"kernel_shape": [2, 2], "strides": [2, 2]}, None, 1),
    "AveragePool": ("AveragePool", {"x": f32(5, 6, 8, 8)}, {}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
                    None, 1),
    "GlobalAveragePool": ("GlobalAveragePool", {"x": f32(5, 6, 4, 4)}, {}, {}, None, 1),
    "Gather-embedding": ("Gather", {"table": f32(10, 8), "ids": ints(10, 5, 6)}, {}, {"axis": 0}, None, 1),
    "GatherElements-loss": ("GatherElements", {"logp": f32(5, 7), "t": ints(7, 5, 1)}, {}, {"axis": 1}, None, 1),
    "ScatterElements-loss-grad": ("ScatterElements", {"z": np.zeros((5, 7), np.float32), "t": ints(7, 5, 1),
                                                      "u": f32(5, 1)}, {}, {"axis": 1}, None, 1),
    "ScatterElements-add": ("ScatterElements", {"d": f32(5, 7), "t": ints(7, 5, 6), "u": f32(5, 6)}, {},
                            {"axis": 1, "reduction": "add"}, None, 1),
    "ScatterND-embedding-grad": ("ScatterND", {"z": np.zeros((10, 8), np.float32), "i": ints(10, 5, 6, 1),
                                               "u": f32(5, 6, 8)}, {}, {"reduction": "add"}, None, 1),
    "ReduceSum-bias-grad": ("ReduceSum", {"x": f32(5, 6, 7)}, {"axes": i64(0, 2)}, {"keepdims": 0}, None, 1),
    "ReduceMean-bn-stats": ("ReduceMean", {"x": f32(5, 6, 4, 4)}, {"axes": i64(0, 2, 3)}, {"keepdims": 1}, None, 1),
    "ReduceMax": ("ReduceMax", {"x": f32(5, 6, 7)}, {"axes": i64(-1)}, {"keepdims": 1}, None, 1),
    "Transpose": ("Transpose", {"x": f32(5, 6, 7)}, {}, {"perm": [2, 0, 1]}, None, 1),
    "Reshape-merge-tail": ("Reshape", {"x": f32(5, 6, 8)}, {"shape": i64(5, 48)}, {}, None, 1),
    "Reshape-split-heads": ("Reshape", {"x": f32(5, 6, 8)}, {"shape": i64(5, 6, 2, -1)}, {}, None, 1),
    "Reshape-merge-head": ("Reshape", {"x": f32(5, 6, 8)}, {"shape": i64(30, 8)}, {}, None, 1),
    "Expand": ("Expand", {"x": f32(6, 1)}, {"shape": i64(5, 6, 7)}, {}, None, 1),
    "Unsqueeze": ("Unsqueeze", {"x": f32(5, 6)}, {"axes": i64(1, -1)}, {}, None, 1),
    "Squeeze": ("Squeeze", {"x": f32(5, 1, 6)}, {"axes": i64(1)}, {}, None, 1),
    "Flatten": ("Flatten", {"x": f32(5, 6, 2, 2)}, {}, {"axis": 1}, None, 1),
    "Concat": ("Concat", {"a": f32(5, 6), "b": f32(5, 3)}, {}, {"axis": 1}, None, 1),
    "Slice": ("Slice", {"x": f32(5, 12)}, {"st": i64(2), "en": i64(9), "ax": i64(1)}, {}, None, 1),
    "SoftmaxCrossEntropyLoss-mean": ("SoftmaxCrossEntropyLoss", {"s": f32(7, 5), "t": ints(5, 7)}, {}, {}, None, 2),
    "SoftmaxCrossEntropyLoss-sum-spatial": ("SoftmaxCrossEntropyLoss", {"s": f32(5, 4, 6), "t": ints(4, 5, 6)}, {},
                                            {"reduction": "sum"}, None, 1),
    "SoftmaxCrossEntropyLoss-none": ("SoftmaxCrossEntropyLoss", {"s": f32(7, 5), "t": ints(5, 7)}, {},
                                     {"reduction": "none"}, None, 1),
    "NegativeLogLikelihoodLoss-mean": ("NegativeLogLikelihoodLoss", {"s": f32(7, 5), "t": ints(5, 7)}, {}, {},
                                       None, 1),
}


# Every other elementwise op of the registry, with inputs in its domain.
_BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Greater", "Less", "GreaterOrEqual",
           "LessOrEqual", "Equal")
_BOOLEAN = ("And", "Or", "Xor")
_SPECIAL = {"Where", "Clip", "Cast", "Not", "PRelu", "Mod"}
for _op in ELEMENTWISE_OPS:
    if f"{_op}-elementwise" in CASES or _op in _SPECIAL:
        continue
    if _op in _BINARY:
        CASES[f"{_op}-elementwise"] = (_op, {"a": pos(5, 6, 4), "b": pos(6, 1)}, {}, {}, None, 1)
    elif _op in _BOOLEAN:
        CASES[f"{_op}-elementwise"] = (_op, {"a": RNG.random((5, 6)) > 0.5, "b": RNG.random((1, 6)) > 0.5}, {}, {},
                                       None, 1)
    else:
        CASES[f"{_op}-elementwise"] = (_op, {"x": pos(5, 6, 4) * 2}, {}, {}, None, 1)
CASES.update({
    "Mod-fmod": ("Mod", {"a": f32(5, 6), "b": pos(6)}, {}, {"fmod": 1}, None, 1),
    "PRelu": ("PRelu", {"x": f32(5, 6, 4), "slope": f32(6, 1)}, {}, {}, None, 1),
    "Sum-variadic": ("Sum", {"a": f32(5, 6), "b": f32(6), "c": f32(5, 1)}, {}, {}, None, 1),
    "Hardmax": ("Hardmax", {"x": f32(5, 6, 7)}, {}, {"axis": 1}, None, 1),
    "LpPool": ("LpPool", {"x": f32(5, 6, 6, 6)}, {}, {"kernel_shape": [2, 2], "p": 2}, None, 1),
    "GlobalMaxPool": ("GlobalMaxPool", {"x": f32(5, 6, 4, 4)}, {}, {}, None, 1),
    "GlobalLpPool": ("GlobalLpPool", {"x": f32(5, 6, 4, 4)}, {}, {}, None, 1),
    "ReduceMin": ("ReduceMin", {"x": f32(5, 6, 7)}, {"axes": i64(1)}, {"keepdims": 0}, None, 1),
    "ReduceProd": ("ReduceProd", {"x": pos(5, 6, 7)}, {"axes": i64(0)}, {"keepdims": 1}, None, 1),
})

# Ops whose ORT CPU kernels are not bitwise invariant to the tensor's size, so even a Concat
# split is held to 1e-6 relative: contractions and reductions (a micro-shape can select another
# kernel path, e.g. a GEMV for one row, or another blocking, that sums in another order), and
# transcendental functions whose SIMD body and scalar tail differ by an ulp (Log, Sin, Cos:
# where a piece's size is not a multiple of the vector width, other elements take the tail).
NOT_BITWISE_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "ReduceSum", "ReduceMean", "ReduceProd", "LpPool",
                   "GlobalLpPool", "Sum", "Mean", "Log", "Sin", "Cos"}


def _case(case_id):
    op, inputs, constants, attrs, order, outputs = CASES[case_id]
    model = single_op_model(op, inputs, attrs=attrs, constants=constants, input_order=order, outputs=outputs)
    return model, inputs


@pytest.fixture(scope="module")
def case_infos():
    cache = {}

    def get(case_id):
        if case_id not in cache:
            model, feeds = _case(case_id)
            cache[case_id] = (model, feeds, infos_for(model, feeds))
        return cache[case_id]

    return get


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("case_id", list(CASES))
def test_every_split_of_the_op_equals_the_unsplit_op_in_stock_onnxruntime(case_infos, case_id, parts):
    """Exact for Concat merges (except :data:`NOT_BITWISE_OPS`), 1e-6 relative otherwise."""
    model, feeds, infos = case_infos(case_id)
    exact = model.graph.node[0].op_type not in NOT_BITWISE_OPS
    options = split_options(NodeInfo.of(model.graph.node[0], infos, constant_values(model)))
    assert options, f"{case_id}: the rule offers no split"
    tested = 0
    for option in options:
        key = option.key
        if option.extent < parts:
            continue
        assert_split_matches(model, feeds, 0, key, parts, infos=infos, exact_concat=exact)
        tested += 1
    assert tested, f"{case_id}: no split has a dimension of {parts} or more"


def test_every_rule_of_the_registry_has_a_case():
    assert set(SPLIT_RULES) <= {case[0] for case in CASES.values()}


def _keys(case_id, infos_fn):
    model, _, infos = infos_fn(case_id)
    return set(keys_of(model, 0, infos))


def test_rules_offer_the_splits_the_paper_names(case_infos):
    """Which axes and merges the main rules offer (TSPLIT's table of split dimensions)."""
    keys = lambda case: _keys(case, case_infos)  # noqa: E731
    assert keys("MatMul-2d") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1), SplitAxis(SUM, 1)}
    assert keys("Conv") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1), SplitAxis(SUM, 1)}
    assert keys("Conv-bias-stride") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)}  # bias: no Sum split
    assert SplitAxis(SUM, 1) in keys("Conv-weight-grad")
    assert keys("BatchNormalization-training") == {SplitAxis(CONCAT, 1)}  # channels only
    assert SplitAxis(CONCAT, 0) in keys("BatchNormalization-inference")
    assert keys("Softmax") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)}
    assert keys("LayerNormalization") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)}
    assert keys("ReduceSum-bias-grad") == {SplitAxis(SUM, 0), SplitAxis(CONCAT, 0), SplitAxis(SUM, 2),
                                           SplitAxis(STAGED, 0), SplitAxis(STAGED, 2)}
    assert keys("ReduceMax") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)}  # no merge for a split max
    assert keys("ScatterND-embedding-grad") >= {SplitAxis(CHAIN, 0), SplitAxis(CHAIN, 1), SplitAxis(CONCAT, 1)}
    assert keys("MaxPool") == {SplitAxis(CONCAT, 0), SplitAxis(CONCAT, 1)}
    assert keys("Reshape-merge-head") == {SplitAxis(CONCAT, 1)}
    assert keys("SoftmaxCrossEntropyLoss-mean") == {SplitAxis(SUM, 0)}


def test_the_micro_ops_of_a_weight_operand_read_it_whole():
    model, feeds = _case("MatMul-3d-weight")
    infos = infos_for(model, feeds)
    options = {o.key: o for o in split_options(NodeInfo.of(model.graph.node[0], infos))}
    assert options[SplitAxis(CONCAT, 0)].inputs == (SliceOn(0), Whole())
    assert options[SplitAxis(CONCAT, 2)].inputs == (Whole(), SliceOn(1))
    assert options[SplitAxis(SUM, 2)].inputs == (SliceOn(2), SliceOn(0))


def test_ops_without_a_rule_and_unmergeable_outputs_are_never_split():
    with pytest.raises(UnsplittableOpError, match="random"):
        split_options(NodeInfo("Dropout", {}, ((4, 4),), ((4, 4),)))
    with pytest.raises(UnsplittableOpError, match="no split rule"):
        split_options(NodeInfo("NoSuchOp", {}, ((4, 4),), ((4, 4),)))
    # MaxPool's Indices are flat positions: a split would change them.
    assert split_options(NodeInfo("MaxPool", {"kernel_shape": [2, 2]}, ((4, 4, 4, 4),), ((4, 4, 2, 2), (4, 4, 2, 2)))) == ()
    # A mean loss with ignore_index divides by a count only the whole batch knows.
    assert split_options(NodeInfo("SoftmaxCrossEntropyLoss", {"ignore_index": -1}, ((4, 5), (4,)), ((),))) == ()
    assert not set(UNSPLITTABLE) & set(SPLIT_RULES)


def test_op_types_of_the_exported_training_graphs_all_have_a_rule_or_a_reason():
    """Every op type of the exported GPT and CNN steps (as of the export this was written
    against) is in the registry or in UNSPLITTABLE."""
    exported = {
        "Mul", "Constant", "Sub", "Add", "Div", "Reshape", "Pow", "Sqrt", "Transpose", "ReduceSum", "MatMul",
        "Concat", "Not", "Squeeze", "Gemm", "Where", "Unsqueeze", "Shape", "Slice", "Equal", "Cast",
        "LayerNormalization", "And", "Expand", "Exp", "Gather", "Softmax", "ReduceMax", "Gelu", "Erf",
        "GreaterOrEqual", "Less", "Clip", "ScatterND", "Range", "LessOrEqual", "LogSoftmax", "GatherElements",
        "Neg", "ConstantOfShape", "ScatterElements", "ReduceMean", "Conv", "Reciprocal", "Size", "Relu",
        "ConvTranspose", "Identity",
    }
    assert exported <= set(SPLIT_RULES) | set(UNSPLITTABLE)


@pytest.mark.parametrize("extent, parts", [(8, 3), (5, 2), (7, 4), (4, 4), (10, 3)])
def test_chunk_sizes_are_numpy_array_split_sizes(extent, parts):
    assert list(chunk_sizes(extent, parts)) == [len(c) for c in np.array_split(np.arange(extent), parts)]


@pytest.mark.parametrize("extent, parts", [(3, 4), (5, 1)])
def test_chunk_sizes_refuse_impossible_splits(extent, parts):
    with pytest.raises(UnsplittableOpError):
        chunk_sizes(extent, parts)
