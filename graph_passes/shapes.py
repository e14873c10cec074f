"""Dtype and shape of every value of a graph for one concrete input signature.

ONNX shape inference (with data propagation) runs first on a copy whose inputs carry the
concrete shapes; values it leaves without a fully static shape are then found by one probe run
of the graph in ONNX Runtime with those values exposed as outputs (needed for com.microsoft ops
and shape computations that inference cannot fold).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

import numpy as np
import onnx

# The error hierarchy is a leaf module shared by every package.
from ort_offload.errors import InputMismatchError, ModelLoadError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Element type and concrete shape of one value."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


def _elem_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def declared_inputs(model: onnx.ModelProto) -> dict[str, tuple[np.dtype, tuple[int | str | None, ...] | None]]:
    """Declared dtype and (possibly symbolic) shape of every graph input; shape None when the
    input declares none (any rank)."""
    initializers = {t.name for t in model.graph.initializer}
    declared = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dims = None
        if tensor_type.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
            )
        declared[value.name] = (_elem_dtype(tensor_type.elem_type), dims)
    return declared


def check_inputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, TensorInfo]:
    """Check feeds against the graph's declared inputs; returns their concrete infos.

    Symbolic dimensions must agree across inputs (every ``batch`` is the same size).
    """
    declared = declared_inputs(model)
    missing = [n for n in declared if n not in feeds]
    if missing:
        raise InputMismatchError(f"missing graph inputs: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    unknown = [n for n in feeds if n not in declared]
    if unknown:
        raise InputMismatchError(f"unknown inputs {', '.join(unknown[:5])}: the graph takes {', '.join(list(declared)[:8])}")
    symbols: dict[str, tuple[int, str]] = {}
    infos = {}
    for name, (dtype, dims) in declared.items():
        array = feeds[name]
        if np.dtype(array.dtype) != dtype:
            raise InputMismatchError(f"input {name!r} has dtype {array.dtype}, the graph expects {dtype}")
        if dims is None:
            dims = ()
        elif len(array.shape) != len(dims):
            raise InputMismatchError(f"input {name!r} has shape {list(array.shape)}, the graph expects rank {len(dims)} {list(dims)}")
        for axis, (size, dim) in enumerate(zip(array.shape, dims)):
            if isinstance(dim, int) and dim > 0 and size != dim:
                raise InputMismatchError(
                    f"input {name!r} has shape {list(array.shape)}, the graph expects {list(dims)} (axis {axis})"
                )
            if isinstance(dim, str):
                seen = symbols.setdefault(dim, (size, name))
                if seen[0] != size:
                    raise InputMismatchError(
                        f"dimension {dim!r} is {size} in input {name!r} but {seen[0]} in input {seen[1]!r}"
                    )
        infos[name] = TensorInfo(np.dtype(array.dtype), tuple(int(s) for s in array.shape))
    return infos


def infer_tensor_infos(
    model: onnx.ModelProto,
    input_infos: Mapping[str, TensorInfo],
    *,
    probe_feeds: Mapping[str, np.ndarray] | None = None,
) -> dict[str, TensorInfo]:
    """TensorInfo of every input, initializer and node output for the given input shapes."""
    concrete = onnx.ModelProto()
    concrete.CopyFrom(model)
    for value in concrete.graph.input:
        if value.name in input_infos:
            info = input_infos[value.name]
            value.type.tensor_type.ClearField("shape")
            value.type.tensor_type.shape.SetInParent()
            for size in info.shape:
                value.type.tensor_type.shape.dim.add().dim_value = size
    del concrete.graph.value_info[:]
    for out in concrete.graph.output:
        out.type.tensor_type.ClearField("shape")
    infos: dict[str, TensorInfo] = dict(input_infos)
    for init in model.graph.initializer:
        infos[init.name] = TensorInfo(_elem_dtype(init.data_type), tuple(init.dims))
    try:
        inferred = onnx.shape_inference.infer_shapes(concrete, check_type=False, strict_mode=False, data_prop=True)
        for value in list(inferred.graph.value_info) + list(inferred.graph.output):
            info = _static_info(value)
            if info is not None:
                infos.setdefault(value.name, info)
    except Exception as e:  # inference is an optimisation; the probe below is exact
        logger.debug("ONNX shape inference failed (%s); probing every value", e)
    missing = [out for node in model.graph.node for out in node.output if out and out not in infos]
    if missing:
        infos.update(_probe(model, input_infos, missing, probe_feeds))
    return infos


def _static_info(value: onnx.ValueInfoProto) -> TensorInfo | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.elem_type or not tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tensor_type.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return TensorInfo(_elem_dtype(tensor_type.elem_type), tuple(dims))


def _probe(model, input_infos, names, probe_feeds) -> dict[str, TensorInfo]:
    """One run of the whole graph with ``names`` exposed as outputs; returns their infos."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.add().name = name
    if probe_feeds is None:
        rng = np.random.default_rng(0)
        probe_feeds = {n: _random(rng, info) for n, info in input_infos.items()}
    logger.info("probing shapes of %d values with one run", len(names))
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        results = session.run(list(names), dict(probe_feeds))
    except Exception as e:
        raise ModelLoadError(f"cannot determine tensor shapes: the probe run failed ({str(e).splitlines()[0]})") from e
    return {n: TensorInfo(np.dtype(r.dtype), tuple(r.shape)) for n, r in zip(names, results)}


def _random(rng: np.random.Generator, info: TensorInfo) -> np.ndarray:
    if np.issubdtype(info.dtype, np.integer):
        return np.zeros(info.shape, dtype=info.dtype)
    if info.dtype == np.bool_:
        return np.zeros(info.shape, dtype=np.bool_)
    return rng.standard_normal(info.shape).astype(info.dtype)
