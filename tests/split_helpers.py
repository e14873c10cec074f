"""Shared by the split tests: one-op ONNX graphs, running a graph in stock ONNX Runtime, and
splitting a node with the split pass and comparing the result with the unsplit graph."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort

from graph_passes.ir.shapes import TensorInfo, infer_tensor_infos
from graph_passes.planning.split.graph_pass import SplitPass, SplitPlan, SplitRun
from graph_passes.planning.split.rules import CONCAT, NodeInfo, SplitAxis, constant_values, split_options

OPSET = 20
IR_VERSION = 10  # what onnxruntime 1.31 loads

# A chain whose elementwise ops split on the leading axis (the split planner and runtime tests).
SPLIT_CHAIN_GRAPH = """
<ir_version: 9, opset_import: ["" : 20]>
g (float[64, 64] x, float[1, 64] r) => (float y) {
    a = Sigmoid(x)
    shape = Constant<value = int64[2] {64, 64}>()
    b = Expand(r, shape)
    z = Add(a, b)
    t = Tanh(z)
    y = ReduceSum<keepdims = 0>(t)
}
"""


def single_op_model(op: str, inputs: Mapping[str, np.ndarray], *, attrs=None, constants=None,
                    input_order=None, outputs: int = 1) -> onnx.ModelProto:
    """A graph of one ``op`` node. ``inputs`` become graph inputs and ``constants``
    initializers; ``input_order`` names the node's inputs ('' for an absent one)."""
    constants = constants or {}
    order = input_order or list(inputs) + list(constants)
    out_names = [f"y{k}" for k in range(outputs)]
    node = onnx.helper.make_node(op, order, out_names, name=f"{op.lower()}_node", **(attrs or {}))
    graph = onnx.helper.make_graph(
        [node], f"{op}_graph",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in inputs.items()],
        [onnx.ValueInfoProto(name=n) for n in out_names],
        initializer=[onnx.numpy_helper.from_array(np.asarray(a), n) for n, a in constants.items()],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    # Graph outputs get their types from one run (valid ONNX needs them).
    values = run(model, {n: np.asarray(a) for n, a in inputs.items()})
    for out in model.graph.output:
        value = values[out.name]
        out.CopyFrom(onnx.helper.make_tensor_value_info(
            out.name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, dict(feeds))))


def infos_for(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, TensorInfo]:
    inputs = {n: TensorInfo(np.dtype(a.dtype), tuple(a.shape)) for n, a in feeds.items()}
    return infer_tensor_infos(model, inputs, probe_feeds=feeds)


def keys_of(model: onnx.ModelProto, node_index: int, infos) -> list[SplitAxis]:
    node = model.graph.node[node_index]
    return [o.key for o in split_options(NodeInfo.of(node, infos, constant_values(model)))]


def split_model(model: onnx.ModelProto, plan: SplitPlan, infos, **options) -> onnx.ModelProto:
    result = SplitPass(plan, infos, **options)(ir.from_proto(model))
    assert result.modified
    rewritten = ir.to_proto(result.model)
    onnx.checker.check_model(rewritten)
    return rewritten


def max_relative_diff(got: np.ndarray, expected: np.ndarray) -> float:
    """max |got - expected| relative to the largest magnitude of ``expected``."""
    if expected.size == 0:
        return 0.0
    scale = max(float(np.abs(expected.astype(np.float64)).max()), 1e-30)
    return float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()) / scale


def assert_split_matches(model, feeds, node_index: int, key: SplitAxis, parts: int, *, infos=None,
                         rtol: float = 1e-6, exact_concat: bool = True) -> onnx.ModelProto:
    """Split node ``node_index`` as ``key`` into ``parts`` micro-ops; the graph's outputs must
    equal the unsplit graph's: exactly for Concat splits (unless ``exact_concat`` is off), within ``rtol`` (relative to the
    largest magnitude) for Sum and chain splits."""
    infos = infos or infos_for(model, feeds)
    rewritten = split_model(model, SplitPlan((SplitRun((node_index,), (key,), parts),)), infos)
    micro = [n for n in rewritten.graph.node if any(p.key == "ort_offload.splits" for p in n.metadata_props)]
    assert len(micro) == parts
    expected, got = run(model, feeds), run(rewritten, feeds)
    for name, value in expected.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        if key.merge == CONCAT and exact_concat:
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} split {key} x{parts}")
        else:
            diff = max_relative_diff(got[name], value)
            assert diff <= rtol, f"{name} split {key} x{parts}: relative difference {diff:.3g}"
    return rewritten
