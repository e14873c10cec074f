"""Whether ONNX Runtime's CPU kernels give a staged reduction the unsplit reduction's bits.

A ReduceSum or ReduceMean over several axes, split on one of them, can be written as micro
ReduceSums over the other axes that keep the split one, a Concat of those small partial
results and one ReduceSum over them (:class:`~graph_passes.planning.split.rules.ReduceRule`,
``staged``). That is exact where the kernel itself sums each row first and then the rows' sums
in order. ONNX Runtime's CPU kernel does so for a BatchNorm's statistics over (N, H, W) at any
thread count measured, but not everywhere (a 7x5x3x3 tensor on 8 threads sums in another order)
and it promises nothing. So :func:`staged_matches` runs both forms on random inputs of the
node's shape, at every thread count a block session may get, and a staged split counts as
exact only where they agree bit for bit. The order a kernel sums in depends on shapes and
threads, not on the values, so one shape's answer holds for every input of that shape.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

from graph_passes.ort_logging import ort_log_severity
from graph_passes.planning.split.rules import chunk_sizes

logger = logging.getLogger(__name__)

# Intra-op thread counts probed: one, what small and large hosts get (0: ONNX Runtime's own
# default, the physical cores, which block sessions use unless the device sets a count).
PROBE_THREADS = (1, 2, 4, 8, 16, 32, 0)
PROBE_TRIALS = 2
_OPSET = 18  # axes as an input for ReduceSum and ReduceMean


@functools.cache
def staged_matches(op_type: str, shape: tuple[int, ...], dtype: str, axes: tuple[int, ...], keepdims: int,
                   axis: int, parts: tuple[int, ...], threads: int = 0) -> bool:
    """Whether ``op_type`` (ReduceSum or ReduceMean) over ``axes`` of a ``shape`` tensor of
    ``dtype``, split on ``axis`` into each count of ``parts``, gives the same bits staged as
    whole, on ONNX Runtime's CPU kernels at ``threads`` intra-op threads and every count of
    :data:`PROBE_THREADS` (a plan written to a file may run elsewhere). Integer sums are exact
    in any order."""
    if not np.issubdtype(np.dtype(dtype), np.floating):
        return True
    parts = tuple(p for p in parts if 2 <= p <= shape[axis])
    if not parts:
        return False
    model = _probe_model(op_type, shape, dtype, axes, keepdims, axis, parts)
    rng = np.random.default_rng(0)
    inputs = [(rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3) + rng.uniform(-4, 4)).astype(dtype)
              for _ in range(PROBE_TRIALS)]
    for count in dict.fromkeys((threads, *PROBE_THREADS)):
        session = _session(model, count)
        for x in inputs:
            whole, *staged = session.run(None, {"x": x})
            if not all(np.array_equal(whole, s) for s in staged):
                logger.info("staged %s over %s of %s split on %s: other bits at %d threads", op_type, axes, shape,
                            axis, count)
                return False
    return True


def _probe_model(op_type: str, shape, dtype: str, axes, keepdims: int, axis: int, parts) -> onnx.ModelProto:
    """One model: the reduction whole (output 0), then staged into each count of ``parts``."""
    helper = onnx.helper
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def const(name: str, array) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(array), name))

    others = [a for a in axes if a != axis]
    count = int(np.prod([shape[a] for a in axes]))
    nodes = [const("axes", np.asarray(axes, np.int64)), const("others", np.asarray(others, np.int64)),
             const("count", np.asarray(count, dtype)),
             helper.make_node(op_type, ["x", "axes"], ["whole"], keepdims=keepdims)]
    outputs = ["whole"]
    for p in parts:
        sizes = chunk_sizes(shape[axis], p)
        pieces = [f"x{p}_{i}" for i in range(p)]
        nodes.append(const(f"sizes{p}", np.asarray(sizes, np.int64)))
        nodes.append(helper.make_node("Split", ["x", f"sizes{p}"], pieces, axis=axis))
        nodes += [helper.make_node("ReduceSum", [piece, "others"], [f"{piece}_r"], keepdims=1) for piece in pieces]
        nodes.append(helper.make_node("Concat", [f"{piece}_r" for piece in pieces], [f"rows{p}"], axis=axis))
        reduced = f"staged{p}" if op_type == "ReduceSum" else f"sum{p}"
        nodes.append(helper.make_node("ReduceSum", [f"rows{p}", "axes"], [reduced], keepdims=keepdims))
        if op_type == "ReduceMean":
            nodes.append(helper.make_node("Div", [reduced, "count"], [f"staged{p}"]))
        outputs.append(f"staged{p}")
    graph = helper.make_graph(nodes, "staged_reduction_probe", [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=9)


def _session(model: onnx.ModelProto, threads: int):
    """A CPU session set up as the runtime's block sessions are, where the order of sums matters
    (no graph optimizations, deterministic compute, ``threads`` intra-op threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.use_deterministic_compute = True
    options.intra_op_num_threads = threads
    options.log_severity_level = ort_log_severity()
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


__all__ = ["PROBE_THREADS", "staged_matches"]
