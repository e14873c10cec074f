"""Dtype and shape of every value of a graph for one concrete input signature.

ONNX shape inference (with data propagation) runs first on a copy whose inputs carry the
concrete shapes; values it leaves without a fully static shape are then found by one probe run
of the graph in ONNX Runtime with those values exposed as outputs (needed for com.microsoft ops
and shape computations that inference cannot fold).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Mapping

import numpy as np
import onnx
import onnx.numpy_helper

from graph_passes.ir.liveness import ancestor_nodes, node_io

# The error hierarchy is a leaf module shared by every package.
from graph_passes.errors import InputMismatchError, ModelLoadError
from graph_passes.ort_logging import ort_log_severity

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Element type and concrete shape of one value."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @functools.cached_property
    def nbytes(self) -> int:  # cached: the runtime asks for it on every allocation
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: exact, and no numpy call overhead

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


# One object per distinct (dtype, shape). A runner keeps every prepared signature's infos:
# thousands of values but a few dozen distinct shapes each. Every object kept alive lengthens
# each full pass of Python's garbage collector, and those passes came every ~15 new lengths,
# ~0.5 s each, on bert small under variable lengths (2,500 new TensorInfos per signature).
_CANONICAL: dict[TensorInfo, TensorInfo] = {}
_CANONICAL_LIMIT = 1 << 16  # distinct shapes remembered; past it the table starts afresh


def canonical(info: TensorInfo) -> TensorInfo:
    """The shared TensorInfo equal to ``info`` (``info`` itself the first time)."""
    found = _CANONICAL.get(info)
    if found is None:
        if len(_CANONICAL) >= _CANONICAL_LIMIT:
            _CANONICAL.clear()
        found = _CANONICAL[info] = info
    return found


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


def check_inputs(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, declared: Mapping | None = None
) -> dict[str, TensorInfo]:
    """Check feeds against the graph's declared inputs; returns their concrete infos.

    Symbolic dimensions must agree across inputs (every ``batch`` is the same size).
    ``declared`` is ``declared_inputs(model)``, for callers that check every step.
    """
    declared = declared_inputs(model) if declared is None else declared
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
    max_rounds: int = 16,
) -> dict[str, TensorInfo]:
    """TensorInfo of every input, initializer and node output for the given input shapes.

    Rounds of ONNX shape inference on a copy with concrete input shapes. Where inference stops
    (a node whose input shapes are known but whose output is not, e.g. a ``Reshape`` whose
    target shape is computed from a sequence length), the node's small integer inputs are
    computed by a probe run of just their ancestors (usually a few ``Shape``/``Gather`` nodes)
    and pinned as constants in the copy, so the next round can fold them; a node whose integer
    inputs are all pinned already has its outputs probed directly. What is still unknown after
    ``max_rounds`` comes from one probe of the whole graph.
    """
    return _infer(model, input_infos, probe_feeds=probe_feeds, max_rounds=max_rounds)[0]


class ShapeInference:
    """:func:`infer_tensor_infos` for one model at one input signature after another.

    The values inference had to have pinned at one signature (the integer inputs of the
    ``Reshape`` nodes whose target shapes are computed from a sequence length, say) are the same
    at every signature: they are probed and pinned before the first round at the next, which so
    takes one round of ONNX inference fewer. The infos are exactly :func:`infer_tensor_infos`'s
    (pinned values are probed at each signature, never carried over)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.pin_first: tuple[str, ...] = ()
        self._io = node_io(model.graph.node)  # the same at every signature (~14 ms for 2,400 nodes)
        self._pin_sessions: dict = {}  # the probe of pin_first, on the model's dynamic inputs

    def __call__(self, input_infos: Mapping[str, TensorInfo], *,
                 probe_feeds: Mapping[str, np.ndarray] | None = None) -> dict[str, TensorInfo]:
        infos, pinned = _infer(self.model, input_infos, probe_feeds=probe_feeds, pin_first=self.pin_first,
                               io=self._io, pin_sessions=self._pin_sessions)
        self.pin_first = tuple(sorted(pinned))
        return infos


def _infer(model, input_infos, *, probe_feeds, max_rounds: int = 16, pin_first=(),
           io=None, pin_sessions: dict | None = None) -> tuple[dict[str, TensorInfo], set[str]]:
    """(infos, the values pinned): :func:`infer_tensor_infos`, with ``pin_first`` (values
    pinned at another signature) probed and pinned before the first round. ``io``: the model's
    :func:`node_io`, when the caller has it; ``pin_sessions``: a cache of the ``pin_first`` probe
    across signatures (the probe reads ``model``, whose inputs keep their dynamic axes)."""
    concrete = onnx.ModelProto()
    concrete.CopyFrom(model)
    for value in concrete.graph.input:
        if value.name in input_infos:
            _set_shape(value, input_infos[value.name])
    del concrete.graph.value_info[:]
    for out in concrete.graph.output:
        out.type.tensor_type.ClearField("shape")
    infos: dict[str, TensorInfo] = dict(input_infos)
    infos.update(infos_of_initializers(model))
    if io is None:
        io = node_io(model.graph.node)
    pinned: set[str] = set()
    if pin_first:
        probed = _probe_values(model, input_infos, list(pin_first), probe_feeds, pin_sessions)
        values = {name: array for name, array in probed.items()
                  if np.issubdtype(array.dtype, np.integer) and array.size <= _SMALL_INT_ELEMENTS}
        _pin_constants(concrete, values)
        pinned.update(values)
    for _ in range(max_rounds):
        try:
            inferred = onnx.shape_inference.infer_shapes(concrete, check_type=False, strict_mode=False, data_prop=True)
        except Exception as e:  # inference is an optimisation; the probe is exact
            logger.debug("ONNX shape inference failed (%s); probing", e)
            break
        for value in list(inferred.graph.value_info) + list(inferred.graph.output):
            if value.name not in infos:
                info = _static_info(value)
                if info is not None:
                    infos[value.name] = info
        frontier = [
            entry for entry in io
            if any(o not in infos for o in entry.outputs) and all(n in infos for n in entry.inputs)
        ]
        if not frontier:
            break
        to_pin = sorted({
            name for entry in frontier for name in entry.inputs
            if name not in pinned and name in infos and _is_small_int(infos[name])
            and name not in input_infos
        })
        if to_pin:
            values = _probe_values(concrete, input_infos, to_pin, probe_feeds)
            _pin_constants(concrete, values)
            pinned.update(values)
        else:
            outputs = [o for entry in frontier for o in entry.outputs if o not in infos]
            values = _probe_values(concrete, input_infos, outputs, probe_feeds)
            for name, array in values.items():
                infos[name] = TensorInfo(np.dtype(array.dtype), tuple(array.shape))
                _set_shape(concrete.graph.value_info.add(name=name), infos[name])
    missing = [out for entry in io for out in entry.outputs if out not in infos]
    if missing:
        infos.update(_probe(model, input_infos, missing, probe_feeds))
    names = set(input_infos) | set(infos_of_initializers(model)) | {o for entry in io for o in entry.outputs}
    return {n: canonical(i) for n, i in infos.items() if n in names}, pinned  # not the pinned copies


_SMALL_INT_ELEMENTS = 64


def _is_small_int(info: TensorInfo) -> bool:
    return np.issubdtype(info.dtype, np.integer) and int(np.prod(info.shape, dtype=np.int64)) <= _SMALL_INT_ELEMENTS


def _probe_values(model, input_infos, names, probe_feeds, sessions: dict | None = None) -> dict[str, np.ndarray]:
    """Values of ``names`` from a run of only their ancestors. ``sessions``: probe sessions by
    names, reused at the next call (only for a ``model`` whose inputs keep their dynamic axes)."""
    key = tuple(names)
    if sessions is not None and key in sessions:
        session, inputs = sessions[key]
    else:
        session, inputs = _probe_session(model, names)
        if sessions is not None:
            sessions[key] = (session, inputs)
    feeds = _feeds_for(inputs, input_infos, probe_feeds)
    try:
        return dict(zip(names, session.run(list(names), feeds)))
    except Exception as e:
        raise ModelLoadError(f"cannot determine tensor shapes: a probe run failed ({str(e).splitlines()[0]})") from e


def _probe_session(model, names):
    """(session computing ``names`` from the model's inputs, the input names it reads)."""
    import onnxruntime as ort

    keep = ancestor_nodes(model.graph.node, names)
    sub = onnx.ModelProto()
    sub.CopyFrom(model)
    del sub.graph.node[:]
    sub.graph.node.extend(n for i, n in enumerate(model.graph.node) if i in keep)
    used = {name for n in sub.graph.node for name in n.input} | set(names)
    inputs = [v for v in model.graph.input if v.name in used]
    del sub.graph.input[:]
    sub.graph.input.extend(inputs)
    del sub.graph.output[:]
    del sub.graph.value_info[:]
    for name in names:
        sub.graph.output.add().name = name
    try:
        session = ort.InferenceSession(sub.SerializeToString(), _quiet_options(), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ModelLoadError(f"cannot determine tensor shapes: a probe run failed ({str(e).splitlines()[0]})") from e
    return session, [v.name for v in inputs]


def _pin_constants(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Make consumers of each value read a Constant holding it (inference folds constants)."""
    renames = {name: f"{name}__pinned" for name in values}
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in renames:
                node.input[k] = renames[name]
    for name, array in values.items():
        model.graph.node.insert(0, onnx.helper.make_node(
            "Constant", [], [renames[name]], value=onnx.numpy_helper.from_array(np.asarray(array), renames[name])
        ))


def _feeds_for(names, input_infos, probe_feeds) -> dict[str, np.ndarray]:
    if probe_feeds is not None:
        return {n: probe_feeds[n] for n in names}
    rng = np.random.default_rng(0)
    return {n: _random(rng, input_infos[n]) for n in names}


def infos_of_initializers(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    return {t.name: TensorInfo(_elem_dtype(t.data_type), tuple(t.dims)) for t in model.graph.initializer}


def _set_shape(value: onnx.ValueInfoProto, info: TensorInfo) -> None:
    tensor_type = value.type.tensor_type
    tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(info.dtype)
    tensor_type.ClearField("shape")
    tensor_type.shape.SetInParent()
    for size in info.shape:
        tensor_type.shape.dim.add().dim_value = size


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
    del probe.graph.output[:]
    for name in names:
        probe.graph.output.add().name = name
    feeds = _feeds_for([v.name for v in model.graph.input if v.name in input_infos], input_infos, probe_feeds)
    logger.info("probing shapes of %d values with one run of the whole graph", len(names))
    try:
        session = ort.InferenceSession(probe.SerializeToString(), _quiet_options(), providers=["CPUExecutionProvider"])
        results = session.run(list(names), feeds)
    except Exception as e:
        raise ModelLoadError(f"cannot determine tensor shapes: the probe run failed ({str(e).splitlines()[0]})") from e
    return {n: TensorInfo(np.dtype(r.dtype), tuple(r.shape)) for n, r in zip(names, results)}


def _quiet_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = ort_log_severity()
    return options


def _random(rng: np.random.Generator, info: TensorInfo) -> np.ndarray:
    if np.issubdtype(info.dtype, np.integer):
        return np.zeros(info.shape, dtype=info.dtype)
    if info.dtype == np.bool_:
        return np.zeros(info.shape, dtype=np.bool_)
    return rng.standard_normal(info.shape).astype(info.dtype)
