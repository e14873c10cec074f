"""Scatter-adds as one-hot matrix products: the same sums (within float rounding) for any
indices, repeated and negative ones included; scatters it cannot rewrite are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graph_passes.ir.deterministic import scatter_adds_as_matmuls


def _scatter_model(data_shape, indices_shape, updates_shape, reduction="add", dtype=TensorProto.FLOAT):
    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction=reduction)
    graph = helper.make_graph([node], "scatter", [
        helper.make_tensor_value_info("data", dtype, data_shape),
        helper.make_tensor_value_info("indices", TensorProto.INT64, indices_shape),
        helper.make_tensor_value_info("updates", dtype, updates_shape),
    ], [helper.make_tensor_value_info("out", dtype, data_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scatter_add_and_its_one_hot_product_agree_on_any_indices(seed):
    rng = np.random.default_rng(seed)
    model = _scatter_model([11, 2, 3], ["batch", 6, 1], ["batch", 6, 2, 3])
    rewrite = scatter_adds_as_matmuls(model)
    assert rewrite.rewritten == 1
    assert [n.op_type for n in rewrite.model.graph.node].count("ScatterND") == 0
    onnx.checker.check_model(rewrite.model, full_check=True)
    feeds = {
        "data": rng.standard_normal((11, 2, 3)).astype(np.float32),
        "indices": rng.integers(-11, 11, (4, 6, 1)),  # repeats, and negatives counted from the end
        "updates": rng.standard_normal((4, 6, 2, 3)).astype(np.float32),
    }
    np.testing.assert_allclose(_run(rewrite.model, feeds), _run(model, feeds), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", [
    _scatter_model([5, 3], [4, 1], [4, 3], reduction="none"),  # an assignment, not a sum
    _scatter_model(["rows", 3], [4, 1], [4, 3]),  # rows unknown: no one-hot depth
    _scatter_model([5, 3], [4, 2], [4]),  # indices reach past the first axis
    _scatter_model([5, 3], [4, 1], [4, 3], dtype=TensorProto.INT64),  # integer sums do not race
], ids=["no-reduction", "unknown-rows", "two-axis-indices", "integers"])
def test_scatters_it_cannot_rewrite_are_left_alone(model):
    rewrite = scatter_adds_as_matmuls(model)
    assert rewrite.rewritten == 0 and rewrite.model is model
