"""One execution block as an ONNX Runtime session bound to arena memory.

A block is a run of consecutive nodes cut out of the step graph into a model of its own
(the initializers it reads go with it). Its inputs and outputs are declared with element types
only, so one session serves every input signature. Each run binds inputs and outputs by pointer
into the arena (IOBinding), so kernels read from and write to arena buffers directly.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from graph_passes.ir.liveness import consumed_names
from graph_passes.ir.program import Block
from graph_passes.ir.shapes import TensorInfo
from ort_offload.errors import UnsupportedGraphError
from ort_offload.runtime.host_slots import HostSlots
from graph_passes.ort_logging import ort_error_summary, ort_log_severity

logger = logging.getLogger(__name__)


def block_model(model: onnx.ModelProto, block: Block, elem_types: Mapping[str, int]) -> onnx.ModelProto:
    """A standalone model of the block's nodes.

    Inputs, outputs and internal values keep the (possibly symbolic) shapes the step graph
    declares: ONNX Runtime's fusions need them, and symbolic dims keep the session valid for
    every input signature.
    """
    nodes = [model.graph.node[i] for i in block.node_indices]
    needed = {n for node in nodes for n in consumed_names(node)}
    initializers = [t for t in model.graph.initializer if t.name in needed]
    declared = {v.name: v for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}

    def value_info(name: str) -> onnx.ValueInfoProto:
        known = declared.get(name)
        if known is not None and known.type.tensor_type.elem_type == elem_types[name]:
            return known
        return onnx.helper.make_tensor_value_info(name, elem_types[name], None)

    boundary = set(block.inputs) | set(block.outputs)
    internal = [declared[o] for node in nodes for o in node.output if o in declared and o not in boundary]
    graph = onnx.helper.make_graph(
        nodes,
        f"{model.graph.name}_block{block.index}",
        [value_info(n) for n in block.inputs],
        [value_info(n) for n in block.outputs],
        initializer=initializers,
        value_info=internal,
    )
    sub = onnx.helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=model.ir_version, functions=list(model.functions)
    )
    return sub


def block_content_key(sub: onnx.ModelProto) -> bytes:
    """A digest of a :func:`block_model` that two blocks share exactly when their sessions are
    interchangeable: the same nodes, boundary names, element types and declared shapes. The
    graph's name (which carries the block's index) is left out."""
    name = sub.graph.name
    sub.graph.name = ""
    try:
        return hashlib.sha256(sub.SerializeToString(deterministic=True)).digest()
    finally:
        sub.graph.name = name


# IOBindings a session variant keeps, one per arena layout its block has run at (the pointers
# and shapes of its inputs and outputs). Updated state lands in fresh tensors every step, so a
# block's layout alternates between a few: one binding per layout binds nothing on the next
# step, where one rebound binding would rebind every tensor that moved (most of them).
BINDINGS_PER_VARIANT = 4


class BindingLayout(tuple):
    """``(pointers, shapes)`` of a block's bound tensors, equal to that tuple, with its hash
    computed once (a caller that runs the same layout every other step keeps one)."""

    def __new__(cls, pointers: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]) -> "BindingLayout":
        layout = super().__new__(cls, (pointers, shapes))
        layout._hash = tuple.__hash__(layout)
        return layout

    def __hash__(self) -> int:
        return self._hash


class _Variant:
    """One ORT session of a block (with one set of folded values) and its bindings."""

    def __init__(self, model: onnx.ModelProto, block: Block, options, providers) -> None:
        try:
            self.session = ort.InferenceSession(
                model.SerializeToString(), sess_options=options, providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as e:
            raise UnsupportedGraphError(
                f"ONNX Runtime cannot run block {block.index} ({ort_error_summary(e)}); "
                "the graph uses an op this onnxruntime build has no kernel for"
            ) from e
        # layout (pointers, shapes) -> the binding holding exactly those; oldest first
        self.bindings: dict[tuple, ort.IOBinding] = {}

    def spare_binding(self) -> tuple[ort.IOBinding, tuple | None]:
        """A binding for a layout not kept: a new one (previous layout None) while fewer than
        BINDINGS_PER_VARIANT are kept, else the oldest, taken over, with the layout it holds.
        The caller binds what differs and files it under its layout in :attr:`bindings`."""
        if len(self.bindings) < BINDINGS_PER_VARIANT:
            return self.session.io_binding(), None
        previous = next(iter(self.bindings))
        return self.bindings.pop(previous), previous


class BlockSession:
    """An ``InferenceSession`` over one block, run with pointer bindings into the arena.

    With ``fold_host_inputs`` (a device whose kernels read shapes from host memory), the
    block's host-slot values are computed on the host from :attr:`host_inputs` (passed to
    :meth:`run` as values) and folded in (:mod:`ort_offload.runtime.host_slots`): one session per
    distinct set of values."""

    def __init__(
        self,
        model: onnx.ModelProto,
        block: Block,
        elem_types: Mapping[str, int],
        *,
        session_options: ort.SessionOptions | None = None,
        providers: list | None = None,
        sub: onnx.ModelProto | None = None,
        fold_host_inputs: bool = False,
    ) -> None:
        """``sub``: the block's :func:`block_model`, where the caller has built it already."""
        self.block = block
        self.names: tuple[str, ...] = tuple(block.inputs) + tuple(block.outputs)  # bound, in this order
        # The element type each of names is bound with: the block model declares it, so every
        # signature the session serves binds the same one. As ONNX element types and as numpy
        # dtypes (what every ONNX Runtime takes; _binds_take_elem_types says which to use).
        self.elem_types: tuple[int, ...] = tuple(int(elem_types[n]) for n in self.names)
        self.dtypes: tuple[np.dtype, ...] = tuple(
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t)) for t in self.elem_types)
        self._sub = sub if sub is not None else block_model(model, block, elem_types)
        self._options, self._providers = session_options, providers
        self._slots = HostSlots(self._sub, block.inputs) if fold_host_inputs else None
        if self._slots is not None and not self._slots.active:
            self._slots = None
        self._variants: dict[bytes, _Variant] = {}
        self._single: _Variant | None = None  # the only variant, where nothing is folded
        if self._slots is None:
            self._variants[b""] = self._single = _Variant(self._sub, block, session_options, providers)

    @property
    def host_inputs(self) -> frozenset[str]:
        """Block inputs whose values :meth:`run` needs on the host (to compute host slots)."""
        return self._slots.inputs if self._slots is not None else frozenset()

    @property
    def variant_count(self) -> int:
        """ORT sessions this block holds (one per distinct set of folded host-slot values)."""
        return len(self._variants)

    @property
    def session(self) -> ort.InferenceSession:
        """The (first) ORT session of this block."""
        return next(iter(self._variants.values())).session

    def _variant(self, host_values: Mapping[str, np.ndarray], infos: Mapping[str, TensorInfo]) -> _Variant:
        slots = self._slots
        key = b"" if slots is None else slots.key(host_values, infos)
        variant = self._variants.get(key)
        if variant is None:
            folded = slots.fold(slots.compute(host_values, infos))
            variant = self._variants[key] = _Variant(folded, self.block, self._options, self._providers)
        return variant

    def run(self, pointers: Mapping[str, int], infos: Mapping[str, TensorInfo], backend=None,
            host_values: Mapping[str, np.ndarray] | None = None) -> None:
        """Run the block reading inputs at and writing outputs to the given arena pointers
        (in the memory of ``backend``, a :class:`~ort_offload.runtime.device_backend.DeviceBackend`;
        None: host memory). ``host_values``: the values of :attr:`host_inputs`. On a device
        the run is queued on its compute stream and returns without waiting for it."""
        names = self.names
        self.run_at(tuple(pointers[n] for n in names), tuple(infos[n].shape for n in names), infos, backend, host_values)

    def run_at(self, pointers: tuple[int, ...], shapes: tuple[tuple[int, ...], ...], infos: Mapping[str, TensorInfo],
               backend=None, host_values: Mapping[str, np.ndarray] | None = None, *,
               layout: "BindingLayout | None" = None) -> None:
        """:meth:`run` with the pointers and shapes of :attr:`names`, in that order (the
        runner's per-step path: nothing is bound where this layout was bound before).
        ``layout``: ``BindingLayout(pointers, shapes)``, where the caller keeps one."""
        variant = self._single or self._variant(host_values or {}, infos)
        if layout is None:
            layout = (pointers, shapes)
        binding = variant.bindings.get(layout)
        if binding is None:
            binding, previous = variant.spare_binding()
            self._bind(binding, previous, pointers, shapes, backend)
            variant.bindings[layout] = binding
        variant.session.run_with_iobinding(binding, None if backend is None else backend.run_options)

    def _bind(self, binding: ort.IOBinding, previous: tuple | None, pointers, shapes, backend) -> None:
        """Bind into ``binding`` every name whose pointer or shape differs from ``previous``
        (the layout it holds; None: a fresh binding)."""
        bind_input, bind_output, device = _binders(binding, backend)
        names, inputs = self.names, len(self.block.inputs)
        dtypes = self.elem_types if device is not None and _binds_take_elem_types() else self.dtypes
        old_pointers, old_shapes = previous if previous is not None else ((), ())
        for i, pointer in enumerate(pointers):
            shape = shapes[i]
            if old_pointers and old_pointers[i] == pointer and old_shapes[i] == shape:
                continue
            (bind_input if i < inputs else bind_output)(names[i], device, dtypes[i], shape, pointer)


def _binders(binding: ort.IOBinding, backend):
    """``binding``'s (bind_input, bind_output, device), each bind called as
    ``bind(name, device, dtype, shape, pointer)``: ONNX Runtime's C++ binding calls where its
    Python wrapper exposes them (the wrapper makes an OrtDevice per call: ~12 of ~15 µs a
    bind, and a step binds hundreds of tensors), else the wrapper's."""
    device, device_id = ("cpu", 0) if backend is None else (backend.memory.ort_device, backend.memory.device_id)
    raw = getattr(binding, "_iobinding", None)
    if raw is not None:
        return raw.bind_input, raw.bind_output, _c_device(device, device_id)
    return (lambda name, _, dtype, shape, ptr: binding.bind_input(name, device, device_id, dtype, list(shape), ptr),
            lambda name, _, dtype, shape, ptr: binding.bind_output(name, device, device_id, dtype, list(shape), ptr),
            None)


@functools.cache
def _binds_take_elem_types() -> bool:
    """Whether this onnxruntime's C++ binding calls take ONNX element types as integers (a
    quarter of a bind's cost less than a numpy dtype; onnxruntime 1.19 takes dtypes only).
    Asked once, of a one-node session."""
    value = onnx.helper.make_tensor_value_info
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
                               [value("x", onnx.TensorProto.FLOAT, [1])], [value("y", onnx.TensorProto.FLOAT, [1])]),
        opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    array = np.zeros(1, dtype=np.float32)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        session.io_binding()._iobinding.bind_input("x", _c_device("cpu", 0), onnx.TensorProto.FLOAT, (1,), array.ctypes.data)
    except Exception:  # e.g. "Not a valid numpy type"
        return False
    return True


@functools.cache
def _c_device(device: str, device_id: int):
    """ONNX Runtime's C++ device object for ``device`` (made once: binds reuse it)."""
    from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

    return OrtDevice.make(device, device_id)._get_c_device()


def default_session_options(*, intra_op_threads: int = 0, spinning: bool = False) -> ort.SessionOptions:
    options = ort.SessionOptions()
    # No graph optimizations: every node computes the same in any block, so plans are bitwise
    # equal to the unplanned run by construction (fusions differ where a block cuts a pattern;
    # docs/decisions.md has the measurements behind these options).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Nodes run in the block's own order (the plan's schedule), not ORT's default reverse-DFS
    # order: that one ran recompute clones as soon as their inputs existed, keeping what they
    # recompute alive (on an H200 a 2.4 GB recompute block took 7.8 GB), and reordered 175 of a
    # gpt tiny block's 726 kernels. Kahn's order with node index as priority keeps ours.
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.intra_op_num_threads = intra_op_threads
    options.log_severity_level = ort_log_severity()
    # Bitwise-reproducible steps: without it, multi-threaded reductions (e.g. the embedding
    # gradient's scatter-add) sum in varying order and two identical runs drift apart.
    options.use_deterministic_compute = True
    # Every block is its own session with its own intra-op pool. A pool that spins while its
    # block runs saves a wake-up per parallel node; one that goes on spinning after its block
    # returns steals the cores the next block needs: force_spinning_stop ends it when Run returns.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    # No memory patterns: ORT records one per input-shape set and allocates it as one block on
    # that shape's second run, so with dynamic shapes every new length pays an arena extension
    # once more; fixed shapes gain nothing from them.
    options.enable_mem_pattern = False
    # One CPU arena for every block session in the process, not one per session: only one
    # block runs at a time, so the memory ORT holds for block-internal values is the largest
    # block's, as the budget's workspace term assumes, not the sum over every cached session.
    # Each new session's first run then reuses pages earlier blocks touched instead of
    # faulting in fresh ones.
    if shared_cpu_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


@functools.cache
def shared_cpu_arena() -> bool:
    """Register one arena allocator for CPU memory with ORT's environment (once per process);
    False where this onnxruntime cannot, and sessions keep an arena each."""
    try:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # -1: ORT's defaults (extend strategy, initial chunk, dead bytes per chunk); 0: no cap
        # (the budget is enforced on our arena and each block's planned workspace, not here)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
    except Exception as e:  # e.g. an older onnxruntime build; correct either way, just more memory
        logger.debug("no shared ORT CPU arena (%s): each block session keeps its own", e)
        return False
    return True


def numpy_elem_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
