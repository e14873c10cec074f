"""Block sessions run their nodes in the block's order (the plan's schedule): ONNX Runtime's
default order would run a recompute clone as soon as its inputs exist."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ort_offload.runtime.block_session import default_session_options


def _late_clone_model() -> onnx.ModelProto:
    """x -> a -> ... -> a5 (a long chain), then a clone of the chain's first node, consumed last:
    the schedule puts the clone right before its reader."""
    nodes = [helper.make_node("Relu", ["x"], ["a0"], name="a0")]
    nodes += [helper.make_node("Neg", [f"a{i}"], [f"a{i + 1}"], name=f"a{i + 1}") for i in range(5)]
    nodes.append(helper.make_node("Relu", ["x"], ["clone"], name="clone"))
    nodes.append(helper.make_node("Add", ["a5", "clone"], ["y"], name="y"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _kernel_order(model: onnx.ModelProto, options: ort.SessionOptions, tmp_path) -> list[str]:
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones(4, np.float32)})
    events = json.loads(open(session.end_profiling()).read())
    return [e["name"].removesuffix("_kernel_time") for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def test_block_sessions_run_nodes_in_the_blocks_order(tmp_path):
    model = _late_clone_model()
    order = _kernel_order(model, default_session_options(), tmp_path)
    assert order == [n.name for n in model.graph.node]
