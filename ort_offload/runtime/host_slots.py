"""Host-slot values of a block on a device: shapes and axes its kernels read from host memory.

ONNX Runtime's CUDA kernels read some inputs from host memory (a Reshape's target shape, a
Slice's starts, a reduction's axes: :data:`HOST_INPUT_SLOTS`). In a whole-graph session the
values feeding them are computed from ``Shape`` outputs and initializers, which ORT keeps on the
host. Cut into blocks, such a value is computed from block inputs that live in device memory,
and the kernel refuses it ("Shape must be on CPU"); folding those block inputs in as
initializers is not enough (ORT then runs the small integer ops on the device too).

:class:`HostSlots` therefore computes each host-slot value of a block on the host — from the
block's integer inputs (read from the arena by the caller), initializers and the shapes of the
tensors its ``Shape`` nodes read — and folds the values into the block as initializers the
kernels read directly, as they do for any constant shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from graph_passes.ir.shapes import TensorInfo

HOST_INPUT_SLOTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,), "Pad": (1, 2, 3), "Split": (1,),
    "Resize": (1, 2, 3), "Upsample": (1,), "TopK": (1,), "OneHot": (1,), "Trilu": (1,), "CumSum": (1,),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
}
SHAPE_OPS = ("Shape", "Size")  # read only their input's shape
_INTEGER_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
HOST_SUFFIX = "__host"


def signature_values(model: onnx.ModelProto) -> frozenset[str]:
    """Values that depend on the input shapes alone (computed from Shape/Size outputs,
    constants and initializers): equal in every step of one input signature."""
    known = {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # topological
        if node.op_type in SHAPE_OPS or node.op_type == "Constant" or (
            node.input and all(not i or i in known for i in node.input) and not node.op_type.startswith("Random")
        ):
            known.update(o for o in node.output if o)
    return frozenset(known)


@dataclasses.dataclass(frozen=True)
class _Chain:
    """The nodes of a block that compute its host-slot values, and what they start from."""

    slots: tuple[str, ...]  # values read in host slots, in first-use order
    nodes: tuple[onnx.NodeProto, ...]  # their in-block ancestors (topological), Shape/Size included
    inputs: frozenset[str]  # integer block inputs the nodes read
    shaped: frozenset[str]  # values whose shape only is read (by Shape/Size), given by stand-ins


def _chain(sub: onnx.ModelProto, block_inputs) -> _Chain | None:
    """The host-slot computation of ``sub``, or None where it has none, reads no block input's
    data (shapes and constants only), or reads a block input's data that is not an integer
    (left on the device as it is)."""
    nodes = list(sub.graph.node)
    block_inputs = set(block_inputs)
    initializers = {t.name for t in sub.graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type for v in sub.graph.input}
    producer = {o: i for i, node in enumerate(nodes) for o in node.output}
    slots = [node.input[i] for node in nodes for i in HOST_INPUT_SLOTS.get(node.op_type, ())
             if i < len(node.input) and node.input[i] and node.input[i] not in initializers]
    if not slots:
        return None
    needed, inputs, shaped, stack = set(), set(), set(), list(dict.fromkeys(slots))
    while stack:
        name = stack.pop()
        if name in block_inputs:
            if types.get(name) not in _INTEGER_TYPES:
                return None
            inputs.add(name)
        elif name in producer and producer[name] not in needed:
            index = producer[name]
            needed.add(index)
            node = nodes[index]
            if node.op_type in SHAPE_OPS:  # its input's shape is known: no need to compute it
                shaped.update(i for i in node.input[:1] if i and i not in initializers)
            else:
                stack.extend(i for i in node.input if i)
    if not inputs:
        # Computed from shapes and constants alone: ORT computes it on the host itself, as in a
        # whole-graph session; folding it would make one session per input shape.
        return None
    return _Chain(tuple(dict.fromkeys(slots)), tuple(nodes[i] for i in sorted(needed)), frozenset(inputs),
                  frozenset(shaped - inputs))  # an input read whole gives its own shape


class HostSlots:
    """Computes a block's host-slot values on the host and folds them into the block."""

    def __init__(self, sub: onnx.ModelProto, block_inputs) -> None:
        self._sub = sub
        self._chain = _chain(sub, block_inputs)
        self._sessions: dict[bytes, ort.InferenceSession] = {}

    @property
    def active(self) -> bool:
        return self._chain is not None

    @property
    def inputs(self) -> frozenset[str]:
        """Integer block inputs whose values the computation needs (read from the arena)."""
        return self._chain.inputs if self._chain else frozenset()

    def key(self, values: Mapping[str, np.ndarray], infos: Mapping[str, TensorInfo]) -> bytes:
        """What the folded values depend on: the inputs' values and the shaped inputs' shapes."""
        digest = hashlib.sha256()
        for name in sorted(values):
            value = np.ascontiguousarray(values[name])
            digest.update(f"{name}|{value.dtype}|{value.shape}|".encode() + value.tobytes())
        for name in sorted(self._chain.shaped if self._chain else ()):
            digest.update(f"{name}|{tuple(infos[name].shape)}".encode())
        return digest.digest()

    def compute(self, values: Mapping[str, np.ndarray], infos: Mapping[str, TensorInfo]) -> dict[str, np.ndarray]:
        """The host-slot values, from the block inputs' ``values`` and shapes in ``infos``."""
        chain = self._chain
        shaped = {name: np.zeros(infos[name].shape, dtype=np.uint8) for name in chain.shaped}  # shape only
        model = self._chain_model(values, shaped)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {**{n: np.asarray(v) for n, v in values.items()}, **shaped}
        return dict(zip(chain.slots, session.run(list(chain.slots), feeds)))

    def _chain_model(self, values, shaped) -> onnx.ModelProto:
        chain = self._chain
        graph_inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype),
                                                           np.shape(v)) for n, v in values.items()]
        graph_inputs += [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UINT8, a.shape) for n, a in shaped.items()]
        nodes = list(chain.nodes)
        used = {i for node in nodes for i in node.input}
        graph = onnx.helper.make_graph(
            nodes, "host_slots", graph_inputs, [onnx.helper.make_empty_tensor_value_info(n) for n in chain.slots],
            initializer=[t for t in self._sub.graph.initializer if t.name in used],
        )
        return onnx.helper.make_model(graph, opset_imports=list(self._sub.opset_import), ir_version=self._sub.ir_version,
                                      functions=list(self._sub.functions))

    def fold(self, slot_values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The block with each host slot reading an initializer holding its value."""
        folded = onnx.ModelProto()
        folded.CopyFrom(self._sub)
        for node in folded.graph.node:
            for i in HOST_INPUT_SLOTS.get(node.op_type, ()):
                if i < len(node.input) and node.input[i] in slot_values:
                    node.input[i] = node.input[i] + HOST_SUFFIX
        folded.graph.initializer.extend(
            onnx.numpy_helper.from_array(np.asarray(value), name + HOST_SUFFIX) for name, value in slot_values.items()
        )
        return folded

