"""Cost of a split (TSPLIT §IV-B, Eqs. 5-6): the memory it saves and the time it adds.

- Eq. 5: splitting the input ``s_j`` of op ``j+1`` into ``p`` micro-tensors, each freed right
  after its micro-op, saves ``(p-1)/p * min(size(s_j), size(s_j+1))`` at that op
  (:func:`split_memory_saving`): the saving in the arena replay when nothing is swapped. With
  swapping, pieces can also leave the arena between micro-ops and a merge can dominate, so the
  planner (:mod:`graph_passes.planning.split.planner`) measures the saving on the lowered program.
- Eq. 6: the time a split adds is the micro-ops' time less the op's, plus the copies the
  split and merge make (:func:`split_added_time`). Split views run no kernel and cost nothing.
  Micro-ops are slower per byte than the op (a launch per micro-op, less work per kernel):
  :func:`measure_node_times` profiles the nodes in ONNX Runtime on this machine and its result
  feeds :class:`graph_passes.cost.cost_model.ProfiledCostModel` (``node_times``), so the planner and
  the time simulator charge measured micro-op times.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Mapping

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

from graph_passes.cost.cost_model import CostModel
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.split.rules import constant_values
from graph_passes.ort_logging import ort_log_severity


def split_memory_saving(input_bytes: int, output_bytes: int, parts: int) -> int:
    """Eq. 5: bytes a ``parts``-way split of an op saves at that op."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return (parts - 1) * min(input_bytes, output_bytes) // parts


def split_added_time(
    original: onnx.NodeProto, infos: Mapping[str, TensorInfo], new_nodes: Iterable[onnx.NodeProto],
    new_infos: Mapping[str, TensorInfo], cost_model: CostModel, *, views: Iterable[str] = (),
) -> float:
    """Eq. 6: seconds the nodes replacing ``original`` take (micro-ops, copy Splits/Slices,
    merges) less ``original``'s own; nodes named in ``views`` (split views) cost nothing."""
    skipped = set(views)
    added = sum(cost_model.node_time(n, new_infos) for n in new_nodes if n.name not in skipped)
    return added - cost_model.node_time(original, infos)


def measure_node_times(
    model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto], infos: Mapping[str, TensorInfo], *,
    repeats: int = 5, seed: int = 0,
) -> dict[str, float]:
    """Median seconds of each node run alone in ONNX Runtime (one thread, no graph
    optimizations) on inputs of its shapes: constants where the graph has them, random floats,
    zeros for integers (valid indices). Keyed by node name, for ``ProfiledCostModel(node_times=)``;
    a node that fails on such inputs (a Reshape whose target shape another node computes) is
    left out, for the caller's cost model."""
    import onnxruntime as ort

    constants = constant_values(model)
    rng = np.random.default_rng(seed)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = ort_log_severity()
    times: dict[str, float] = {}
    for node in nodes:
        if node.op_type == "Constant" or not node.name:
            continue
        feeds, inputs, initializers = {}, [], []
        for name in dict.fromkeys(n for n in node.input if n):
            if name in constants:
                initializers.append(onnx.numpy_helper.from_array(np.asarray(constants[name]), name))
                continue
            info = infos[name]
            value = (rng.standard_normal(info.shape).astype(info.dtype) if np.issubdtype(info.dtype, np.floating)
                     else np.zeros(info.shape, info.dtype))
            feeds[name] = value
            inputs.append(onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(info.dtype),
                                                             info.shape))
        outputs = [onnx.helper.make_tensor_value_info(o, onnx.helper.np_dtype_to_tensor_dtype(infos[o].dtype), None)
                   for o in node.output if o]
        graph = onnx.helper.make_graph([node], "micro", inputs, outputs, initializer=initializers)
        single = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        try:
            session = ort.InferenceSession(single.SerializeToString(), options, providers=["CPUExecutionProvider"])
            session.run(None, feeds)  # warm-up
        except Exception:  # needs more context than one node: a custom domain, a shape input made elsewhere
            continue
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(None, feeds)
            samples.append(time.perf_counter() - start)
        times[node.name] = statistics.median(samples)
    return times


__all__ = ["measure_node_times", "split_added_time", "split_memory_saving"]
