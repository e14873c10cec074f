"""Block-wise training of dynamic networks (docs/design.md, "Dynamic networks (DyNN-Offload)").

Owns the export of one block's vector-Jacobian step (:func:`export_block_step`), its split into
a forward part and a backward part (:func:`split_step`), the ONNX Runtime sessions of both parts
(:class:`CompiledStep`), the cache of compiled steps (:class:`BlockStepCache`), the
``torch.autograd.Function`` that chains the parts through torch autograd, the wrapping of a
model's blocks (:func:`wrap_blocks` / :func:`unwrap_blocks`) and the unbudgeted executor
(:class:`HostExecutor`). The trainer is :mod:`ort_offload.dynamic.trainer`; the budgeted executor
:mod:`ort_offload.dynamic.runtime`.

How values flow. A wrapped block's forward calls the autograd Function with the block's
arguments, then its parameters and buffers, as the Function's inputs. The Function's forward
runs the forward part in ONNX Runtime and returns ``y`` as torch tensors; the backward part's
saved activations stay with that invocation's autograd node (numpy arrays owned by ``ctx``), so
a block called many times in one forward (an LSTM step) keeps one set per call. Its backward
runs the backward part with ``dy`` and returns ``dx`` and ``dparam`` as the gradients of the
Function's inputs, so torch autograd itself accumulates ``dparam`` into ``param.grad`` (summed
over every invocation of the block) and carries ``dx`` on through the model's own Python code.

Randomness. The step is traced in the block's current mode. A block that draws random numbers
(Dropout with ``p > 0`` in training mode) gets them from ONNX Runtime's random ops, seeded per
node: forward and backward of one invocation share the mask (it is a saved activation), but the
draws differ from torch's. Gradient-equivalence with torch needs dropout off (the zoo's tiny
configs have ``dropout = 0``). Buffer mutations inside a block (BatchNorm running statistics in
training mode) are not carried back to the module.

Caching. A step is keyed by the block's structure (class code, ``repr``, parameter and buffer
names/shapes/dtypes, training mode) and its input signature (dtype and shape of every
argument), not by the block's identity: blocks of the same structure (the layers of an encoder)
share one export and one pair of sessions, since parameters are inputs of the graph. Exported
graphs are also cached on disk next to the whole-step exports (:func:`ort_offload.export.training_step.
default_cache_dir`), so a later process skips torch entirely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from graph_passes.ir.liveness import consumed_names
from ort_offload.runtime.block_session import default_session_options
from ort_offload.errors import ExportError, InputMismatchError, UnsupportedGraphError
from ort_offload.export.training_step import (
    _export_context,
    _onnx_export,
    _rename_signature,
    _seed_random_ops,
    _structure_fingerprint,
    default_cache_dir,
)
from ort_offload.export.cache import read_entry, write_entry
from ort_offload.files import atomic_write_bytes

logger = logging.getLogger(__name__)

BLOCK_EXPORTER_VERSION = "1"  # bump when the VJP graph's layout changes: invalidates caches
_METADATA_KEY = "ort_offload.block_step"

__all__ = [
    "BlockStepCache",
    "HostExecutor",
    "CompiledStep",
    "SplitStep",
    "VJPStep",
    "default_blocks",
    "export_block_step",
    "split_step",
    "unwrap_blocks",
    "wrap_blocks",
]


# --------------------------------------------------------------------------------------------
# Export of one block's vector-Jacobian step
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VJPStep:
    """One block's vector-Jacobian step as one ONNX graph.

    Inputs, in order: ``x{i}`` per argument, ``param.{fqn}`` per parameter, ``buffer.{fqn}`` per
    buffer, ``dy{j}`` per output. Outputs: ``y{j}`` per output, ``dx{i}`` per floating
    argument (``dx_args`` lists their argument indices), ``grad.{fqn}`` per parameter that
    requires grad (``grad_params``).
    """

    model: onnx.ModelProto
    arg_inputs: tuple[str, ...]
    param_inputs: tuple[str, ...]
    buffer_inputs: tuple[str, ...]
    dy_inputs: tuple[str, ...]
    y_outputs: tuple[str, ...]
    dx_outputs: tuple[str, ...]
    dx_args: tuple[int, ...]
    grad_outputs: tuple[str, ...]
    grad_params: tuple[int, ...]  # indices into the block's parameters
    tuple_output: bool  # the block returns a tuple (even of one tensor)
    cache_key: str
    cache_hit: bool
    export_time_s: float

    def metadata(self) -> dict:
        fields = ("arg_inputs", "param_inputs", "buffer_inputs", "dy_inputs", "y_outputs", "dx_outputs",
                  "dx_args", "grad_outputs", "grad_params", "tuple_output")
        return {f: getattr(self, f) for f in fields}


def _signature_of(args: Sequence[torch.Tensor]) -> tuple:
    return tuple((str(t.dtype), tuple(int(d) for d in t.shape)) for t in args)


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any] | None, what: str) -> None:
    if kwargs:
        raise ExportError(
            f"{what} was called with keyword arguments ({', '.join(kwargs)}); blocks take tensors positionally"
        )
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise ExportError(f"argument {i} of {what} is a {type(a).__name__}; blocks take tensor arguments only")
        if a.device.type != "cpu":
            raise InputMismatchError(f"argument {i} of {what} is on {a.device}; block-wise training takes CPU tensors")


def block_cache_key(block: torch.nn.Module, args: Sequence[torch.Tensor]) -> str:
    """Key of a block's step: structure (not identity) and input signature."""
    payload = {
        "kind": "block-vjp",
        "exporter": BLOCK_EXPORTER_VERSION,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "structure": _structure_fingerprint(block, None),
        "signature": _signature_of(args),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _original_forward(block: torch.nn.Module):
    """Run ``block`` with its class's forward while it is wrapped (tracing must not recurse)."""
    wrapped = "forward" in block.__dict__
    saved = block.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if wrapped:
            block.__dict__["forward"] = saved


def export_block_step(
    block: torch.nn.Module,
    example_args: Sequence[torch.Tensor],
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    key: str | None = None,
) -> VJPStep:
    """Export ``block``'s vector-Jacobian step at the signature of ``example_args`` as one graph.

    The step is ``(x, params, buffers, dy) -> (y, dx, dparams)`` with ``y = block(*x)`` and
    ``dx, dparams`` the products of ``dy`` with the Jacobians of ``y``. It is traced with
    ``make_fx`` over ``torch.func.functional_call`` and ``torch.autograd.grad`` (core ATen
    decompositions, math attention) and re-exported with our ONNX exporter; shapes are static.
    Raises :class:`ExportError` on non-tensor arguments, non-floating outputs or export failures.
    """
    args = tuple(example_args)
    _check_args(args, None, type(block).__name__)
    key = key or block_cache_key(block, args)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / f"block-{type(block).__name__}-{key}.onnx"
    start = time.perf_counter()
    model = read_entry(path) if use_cache else None  # verified against its content hash
    if model is not None:
        try:
            meta = json.loads({p.key: p.value for p in model.metadata_props}[_METADATA_KEY])
            elapsed = time.perf_counter() - start
            logger.info("block step cache hit for %s in %.3f s", type(block).__name__, elapsed)
            return VJPStep(model=model, cache_key=key, cache_hit=True, export_time_s=elapsed,
                           **{k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()})
        except Exception as e:  # a corrupt cache entry is re-exported, not fatal
            logger.warning("ignoring unreadable block step cache entry %s: %s", path, e)
    with _original_forward(block):
        step = _trace_and_export(block, args, key)
    elapsed = time.perf_counter() - start
    step = dataclasses.replace(step, export_time_s=elapsed)
    logger.info("exported the step of %s %s: %d nodes in %.2f s", type(block).__name__,
                [list(a.shape) for a in args], len(step.model.graph.node), elapsed)
    if use_cache:
        write_entry(path, lambda target: atomic_write_bytes(target, step.model.SerializeToString()))
    return step


def _trace_and_export(block: torch.nn.Module, args: tuple, key: str) -> VJPStep:
    from torch.fx.experimental.proxy_tensor import make_fx

    named_params = list(block.named_parameters())
    named_buffers = list(block.named_buffers())
    param_names = [n for n, _ in named_params]
    buffer_names = [n for n, _ in named_buffers]
    grad_params = tuple(i for i, (_, p) in enumerate(named_params) if p.requires_grad)
    dx_args = tuple(i for i, a in enumerate(args) if a.is_floating_point())

    with torch.no_grad(), _export_context():
        probe = block(*args)
    tuple_output = isinstance(probe, tuple)
    outputs = probe if tuple_output else (probe,)
    if not outputs or not all(isinstance(o, torch.Tensor) and o.is_floating_point() for o in outputs):
        raise ExportError(f"{type(block).__name__} must return a floating tensor or a tuple of them")
    dys = tuple(torch.zeros_like(o) for o in outputs)

    n_args, n_params, n_buffers = len(args), len(named_params), len(named_buffers)

    def vjp(*flat):
        x = list(flat[:n_args])
        p = list(flat[n_args : n_args + n_params])
        b = list(flat[n_args + n_params : n_args + n_params + n_buffers])
        dy = flat[n_args + n_params + n_buffers :]
        for i in dx_args:
            x[i] = x[i].requires_grad_(True)
        for i in grad_params:
            p[i] = p[i].requires_grad_(True)
        state = dict(zip(param_names, p)) | dict(zip(buffer_names, b))
        y = torch.func.functional_call(block, state, tuple(x))
        ys = y if isinstance(y, tuple) else (y,)
        wrt = [x[i] for i in dx_args] + [p[i] for i in grad_params]
        pairs = [(o, g) for o, g in zip(ys, dy) if o.requires_grad]
        grads = [None] * len(wrt)
        if pairs and wrt:
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        return tuple(o.detach() for o in ys) + tuple(grads)

    flat = (
        tuple(a.detach() for a in args)
        + tuple(p.detach() for _, p in named_params)
        + tuple(b.detach() for _, b in named_buffers)
        + dys
    )
    try:
        with _export_context():
            traced = make_fx(vjp, decomposition_table=torch._decomp.core_aten_decompositions())(
                *[t.detach().clone() for t in flat]
            )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"could not trace the step of {type(block).__name__} ({type(e).__name__}: {first})") from e
    ir_model = _onnx_export(traced, flat, tuple(None for _ in flat))

    arg_inputs = tuple(f"x{i}" for i in range(n_args))
    param_inputs = tuple(f"param.{n}" for n in param_names)
    buffer_inputs = tuple(f"buffer.{n}" for n in buffer_names)
    dy_inputs = tuple(f"dy{j}" for j in range(len(outputs)))
    y_outputs = tuple(f"y{j}" for j in range(len(outputs)))
    dx_outputs = tuple(f"dx{i}" for i in dx_args)
    grad_outputs = tuple(f"grad.{param_names[i]}" for i in grad_params)
    in_names = arg_inputs + param_inputs + buffer_inputs + dy_inputs
    out_names = y_outputs + dx_outputs + grad_outputs
    graph = ir_model.graph
    _rename_signature(graph, in_names, out_names, what=f"the step of {type(block).__name__}")
    model = ir.to_proto(ir_model)
    model.graph.name = f"{type(block).__name__}_vjp"
    _seed_random_ops(model)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        onnx.checker.check_model(model)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ExportError(f"the step graph of {type(block).__name__} is not valid ONNX: {first}") from e
    step = VJPStep(
        model=model, arg_inputs=arg_inputs, param_inputs=param_inputs, buffer_inputs=buffer_inputs,
        dy_inputs=dy_inputs, y_outputs=y_outputs, dx_outputs=dx_outputs, dx_args=dx_args,
        grad_outputs=grad_outputs, grad_params=grad_params, tuple_output=tuple_output,
        cache_key=key, cache_hit=False, export_time_s=0.0,
    )
    onnx.helper.set_model_props(model, {_METADATA_KEY: json.dumps(step.metadata())})
    return step


# --------------------------------------------------------------------------------------------
# Split into forward and backward parts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """The forward and backward parts of a :class:`VJPStep`.

    ``forward``: inputs are the step's argument/parameter/buffer inputs it reads (never a
    ``dy``), outputs ``y`` then ``saved``. ``backward``: inputs ``dy``, then ``saved``, then the
    argument/parameter/buffer inputs it reads (``backward_state_inputs``); outputs ``dx`` and
    ``grad``. ``saved`` are the activations crossing the cut (forward-part values the backward
    part reads).
    """

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    forward_inputs: tuple[str, ...]
    saved: tuple[str, ...]
    backward_state_inputs: tuple[str, ...]


def split_step(step: VJPStep) -> SplitStep:
    """Cut ``step`` into the nodes that do not depend on any ``dy`` (forward) and the rest.

    Nodes computing constants (only initializers or other constants as inputs) are copied into
    whichever part reads them rather than saved. A ``dx``/``grad`` output that does not depend
    on ``dy`` (a zero gradient) is passed through an Identity in the backward part.
    """
    model = step.model
    graph = model.graph
    types = {v.name: v for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    initializers = {t.name for t in graph.initializer}
    graph_inputs = [v.name for v in graph.input]
    backward_outputs = set(step.dx_outputs) | set(step.grad_outputs)

    # Outputs of the backward part not produced by a dy-dependent node get an Identity there.
    nodes = list(graph.node)
    tainted = set(step.dy_inputs)
    produced_by_tainted: set[str] = set()
    for node in nodes:
        if any(n in tainted for n in consumed_names(node)):
            tainted.update(o for o in node.output if o)
            produced_by_tainted.update(o for o in node.output if o)
    renamed: dict[str, str] = {}
    passthrough: list[onnx.NodeProto] = []
    for name in sorted(backward_outputs - produced_by_tainted):
        source = f"{name}.forward"
        renamed[name] = source
        passthrough.append(onnx.helper.make_node("Identity", [source], [name], name=f"split/passthrough/{name}"))
    initializer_protos = list(graph.initializer)
    if renamed:
        if any(n in renamed for n in graph_inputs):
            raise ExportError("a gradient output of the step aliases one of its inputs")
        nodes = [_rename_node_io(node, renamed) for node in nodes]
        for i, tensor in enumerate(initializer_protos):
            if tensor.name in renamed:  # a gradient folded into a constant (a zero gradient)
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                copy.name = renamed[tensor.name]
                initializer_protos[i] = copy
        initializers = {t.name for t in initializer_protos}

    constants = set(initializers)
    tainted = set(step.dy_inputs)
    kinds: list[str] = []
    for node in nodes:
        reads = [n for n in consumed_names(node) if n]
        if any(n in tainted for n in reads):
            tainted.update(o for o in node.output if o)
            kinds.append("backward")
        elif all(n in constants for n in reads):
            constants.update(o for o in node.output if o)
            kinds.append("constant")
        else:
            kinds.append("forward")
    for y in step.y_outputs:
        if y in tainted:
            raise ExportError(f"output {y} of the step depends on an incoming gradient")

    producer_kind = {o: kind for node, kind in zip(nodes, kinds) for o in node.output if o}
    forward_nodes = [n for n, k in zip(nodes, kinds) if k == "forward"]
    backward_nodes = [n for n, k in zip(nodes, kinds) if k == "backward"] + passthrough
    const_nodes = [n for n, k in zip(nodes, kinds) if k == "constant"]

    backward_reads = [n for node in backward_nodes for n in consumed_names(node) if n]
    saved = tuple(dict.fromkeys(n for n in backward_reads if producer_kind.get(n) == "forward"))
    dy_set = set(step.dy_inputs)
    state_inputs = tuple(n for n in graph_inputs if n not in dy_set and n in set(backward_reads))
    forward_reads = {n for node in forward_nodes for n in consumed_names(node) if n} | set(step.y_outputs)
    forward_inputs = tuple(n for n in graph_inputs if n not in dy_set and n in forward_reads)

    def value_info(name: str) -> onnx.ValueInfoProto:
        known = types.get(name)
        if known is None or not known.type.tensor_type.elem_type:
            raise ExportError(f"no type for value {name!r} of the step graph (shape inference did not reach it)")
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(known)
        copy.name = name
        return copy

    # Renamed pass-through sources keep the type of the output they feed.
    for name, source in renamed.items():
        types[source] = value_info(name)
        types[source].name = source

    def part(name: str, part_nodes, inputs, outputs) -> onnx.ModelProto:
        needed_consts = _constant_closure(part_nodes, const_nodes, outputs)
        body = needed_consts + list(part_nodes)
        reads = {n for node in body for n in consumed_names(node)}
        inits = [t for t in initializer_protos if t.name in reads]
        boundary = set(inputs) | set(outputs)
        internal = [types[o] for node in body for o in node.output if o in types and o not in boundary]
        g = onnx.helper.make_graph(
            body, name, [value_info(n) for n in inputs], [value_info(n) for n in outputs],
            initializer=inits, value_info=internal,
        )
        m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                   functions=list(model.functions))
        try:
            onnx.checker.check_model(m)
        except onnx.checker.ValidationError as e:
            raise ExportError(f"the {name} part of the split step is not valid ONNX: {str(e).splitlines()[0]}") from e
        return m

    forward_outputs = list(step.y_outputs) + [n for n in saved if n not in step.y_outputs]
    forward = part(f"{graph.name}_forward", forward_nodes, forward_inputs, forward_outputs)
    backward_inputs = list(step.dy_inputs) + list(saved) + list(state_inputs)
    backward = part(f"{graph.name}_backward", backward_nodes, backward_inputs,
                    list(step.dx_outputs) + list(step.grad_outputs))
    return SplitStep(forward=forward, backward=backward, forward_inputs=forward_inputs, saved=saved,
                     backward_state_inputs=state_inputs)


def _rename_node_io(node: onnx.NodeProto, renamed: Mapping[str, str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for i, name in enumerate(copy.output):
        if name in renamed:
            copy.output[i] = renamed[name]
    for i, name in enumerate(copy.input):
        if name in renamed:
            copy.input[i] = renamed[name]
    return copy


def _constant_closure(part_nodes, const_nodes, outputs) -> list[onnx.NodeProto]:
    """The constant nodes the part's nodes and outputs need (transitively), in graph order."""
    producer = {o: i for i, node in enumerate(const_nodes) for o in node.output if o}
    needed: set[int] = set()
    reads = [n for node in part_nodes for n in consumed_names(node)] + list(outputs)
    stack = [n for n in reads if n in producer]
    while stack:
        index = producer[stack.pop()]
        if index not in needed:
            needed.add(index)
            stack.extend(n for n in consumed_names(const_nodes[index]) if n in producer)
    return [const_nodes[i] for i in sorted(needed)]


# --------------------------------------------------------------------------------------------
# Sessions and the autograd Function
# --------------------------------------------------------------------------------------------


def _session(model: onnx.ModelProto, what: str) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(model.SerializeToString(), sess_options=default_session_options(),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        raise UnsupportedGraphError(f"ONNX Runtime cannot run the {what} ({str(e).splitlines()[0]})") from e


class CompiledStep:
    """A block step's two parts as ONNX Runtime sessions (CPU EP, :func:`default_session_options`)."""

    def __init__(self, step: VJPStep) -> None:
        self.step = step
        self.split = split_step(step)
        name = step.model.graph.name
        self.forward_session = _session(self.split.forward, f"forward part of {name}")
        self.backward_session = _session(self.split.backward, f"backward part of {name}")
        self.n_args = len(step.arg_inputs)
        self.state_inputs = step.arg_inputs + step.param_inputs + step.buffer_inputs  # Function input order
        position = {n: i for i, n in enumerate(self.state_inputs)}
        self.forward_positions = [position[n] for n in self.split.forward_inputs]
        self.backward_positions = [position[n] for n in self.split.backward_state_inputs]
        self.forward_outputs = [o.name for o in self.split.forward.graph.output]  # y, then saved not in y
        self.backward_outputs = list(step.dx_outputs) + list(step.grad_outputs)
        # Where each backward output goes among the Function's inputs.
        self.grad_positions = list(step.dx_args) + [self.n_args + i for i in step.grad_params]

    def run_forward(self, values: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        feeds = {n: values[i] for n, i in zip(self.split.forward_inputs, self.forward_positions)}
        out = dict(zip(self.forward_outputs, self.forward_session.run(self.forward_outputs, feeds)))
        return [out[n] for n in self.step.y_outputs], [out[n] for n in self.split.saved]

    def run_backward(self, dys: Sequence[np.ndarray], saved: Sequence[np.ndarray],
                     state: Sequence[np.ndarray]) -> list[np.ndarray]:
        feeds = dict(zip(self.step.dy_inputs, dys))
        feeds.update(zip(self.split.saved, saved))
        feeds.update(zip(self.split.backward_state_inputs, state))
        return self.backward_session.run(self.backward_outputs, feeds)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


class HostExecutor:
    """Runs block parts on host arrays with no budget: the arguments and parameters are fed to
    ONNX Runtime as they are and the saved activations stay with the invocation (numpy arrays).

    An executor gives a block invocation its meaning. ``forward(compiled, block_id, inputs)``
    returns ``(ys, handle, to_save)``: the outputs as torch tensors, what the backward needs
    (opaque to the caller) and the torch inputs to keep with ``save_for_backward`` (torch then
    checks they were not modified in place before the backward). ``backward(compiled, handle,
    dys, saved_tensors)`` returns the backward part's outputs (``dx`` then ``grad``) as numpy
    arrays. The budgeted executor is :class:`ort_offload.dynamic.runtime.BlockRuntime`.
    """

    def forward(self, compiled: "CompiledStep", block_id: int, inputs: Sequence[torch.Tensor]):
        ys, saved = compiled.run_forward([_to_numpy(t) for t in inputs])
        to_save = [inputs[i] for i in compiled.backward_positions]
        return [torch.from_numpy(y) for y in ys], saved, to_save

    def backward(self, compiled: "CompiledStep", handle, dys: Sequence[torch.Tensor],
                 saved_tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        state = [_to_numpy(t) for t in saved_tensors]
        return compiled.run_backward([_to_numpy(d) for d in dys], handle, state)


class _BlockFunction(torch.autograd.Function):
    """``apply(executor, compiled, block_id, *args, *params, *buffers) -> y tuple``; backward
    gives dx and dparams.

    Parameters are inputs of the Function, so autograd accumulates ``dparam`` into ``.grad``.
    What the backward part needs is the executor's ``handle`` (one per invocation, so a block
    called many times in one forward keeps one set of saved activations per call).
    """

    @staticmethod
    def forward(ctx, executor, compiled: CompiledStep, block_id: int, *inputs):
        ys, handle, to_save = executor.forward(compiled, block_id, inputs)
        ctx.executor = executor
        ctx.compiled = compiled
        ctx.handle = handle
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(*to_save)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        compiled: CompiledStep = ctx.compiled
        grads = ctx.executor.backward(compiled, ctx.handle, dys, ctx.saved_tensors)
        ctx.handle = None  # activations are dead once their backward ran
        result: list[torch.Tensor | None] = [None] * ctx.n_inputs
        for position, grad in zip(compiled.grad_positions, grads):
            result[position] = torch.from_numpy(grad)
        return (None, None, None, *result)


# --------------------------------------------------------------------------------------------
# Cache and wrapping
# --------------------------------------------------------------------------------------------


class BlockStepCache:
    """Compiled steps by (block structure, input signature), with counters.

    ``exports``: steps traced by torch; ``disk_hits``: steps loaded from the disk cache;
    ``memory_hits``: calls served by an already compiled step; ``export_times_s``: seconds per
    compiled step (trace + ONNX export, or disk load).
    """

    def __init__(self, *, cache_dir: str | os.PathLike | None = None, use_disk: bool = True) -> None:
        self.cache_dir = cache_dir
        self.use_disk = use_disk
        self.steps: dict[str, CompiledStep] = {}
        self.exports = 0
        self.disk_hits = 0
        self.memory_hits = 0
        self.export_times_s: list[float] = []
        # Structure hash per live block and training mode (weak: a freed block's id may be reused).
        self._structure: weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, str]] = weakref.WeakKeyDictionary()

    @property
    def compiled(self) -> int:
        """Steps compiled so far (exported or loaded from disk)."""
        return len(self.steps)

    def get(self, block: torch.nn.Module, args: Sequence[torch.Tensor]) -> CompiledStep:
        per_mode = self._structure.setdefault(block, {})
        struct = per_mode.get(block.training)
        if struct is None:
            struct = hashlib.sha256(
                json.dumps(_structure_fingerprint(block, None), sort_keys=True, default=str).encode()
            ).hexdigest()
            per_mode[block.training] = struct
        key = hashlib.sha256(json.dumps([struct, _signature_of(args)]).encode()).hexdigest()[:24]
        compiled = self.steps.get(key)
        if compiled is not None:
            self.memory_hits += 1
            return compiled
        step = export_block_step(block, args, cache_dir=self.cache_dir, use_cache=self.use_disk,
                                 key=block_cache_key(block, args))
        if step.cache_hit:
            self.disk_hits += 1
        else:
            self.exports += 1
        self.export_times_s.append(step.export_time_s)
        compiled = CompiledStep(step)
        self.steps[key] = compiled
        return compiled


_WRAPPED_ATTR = "_ort_blockwise_cache"


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.blocks()`` when the model has it, else the children of every ``nn.ModuleList``
    (containers themselves excluded; a block inside another block is left to its outer block)."""
    blocks_fn = getattr(model, "blocks", None)
    if callable(blocks_fn):
        return list(blocks_fn())
    candidates = [
        child
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        for child in module.children()
        if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
    ]
    inner = {id(m) for c in candidates for m in c.modules() if m is not c}
    return [c for c in candidates if id(c) not in inner]


def wrap_blocks(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module] | None = None,
    *,
    cache: BlockStepCache | None = None,
    cache_dir: str | os.PathLike | None = None,
    executor=None,
) -> BlockStepCache:
    """Make each block's forward run its step's forward part in ONNX Runtime, its backward the
    backward part; the model's own forward (Python control flow) runs unchanged.

    ``blocks`` defaults to :func:`default_blocks`; a block's id is its position in that list
    (the index ``model.path`` uses). ``executor`` runs the parts (default :class:`HostExecutor`:
    host arrays, no budget). Returns the :class:`BlockStepCache` the blocks share (``cache``
    when given). :func:`unwrap_blocks` restores the original forwards.
    """
    blocks = default_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise InputMismatchError(f"{type(model).__name__} has no blocks to wrap (no blocks() and no nn.ModuleList)")
    cache = cache if cache is not None else BlockStepCache(cache_dir=cache_dir)
    executor = executor if executor is not None else HostExecutor()
    seen: set[int] = set()
    for block_id, block in enumerate(blocks):
        if not isinstance(block, torch.nn.Module):
            raise InputMismatchError(f"blocks must be nn.Modules, got a {type(block).__name__}")
        if id(block) in seen:
            continue
        seen.add(id(block))
        if hasattr(block, _WRAPPED_ATTR):
            raise InputMismatchError(f"{type(block).__name__} is already wrapped; unwrap_blocks first")
        block.__dict__["forward"] = _make_forward(block, block_id, cache, executor)
        object.__setattr__(block, _WRAPPED_ATTR, cache)
    model.__dict__["_ort_blockwise_blocks"] = [b for b in blocks]
    return cache


def unwrap_blocks(model: torch.nn.Module) -> None:
    """Restore the original forward of every block :func:`wrap_blocks` wrapped in ``model``."""
    for block in model.__dict__.pop("_ort_blockwise_blocks", []):
        block.__dict__.pop("forward", None)
        block.__dict__.pop(_WRAPPED_ATTR, None)


def _make_forward(block: torch.nn.Module, block_id: int, cache: BlockStepCache, executor) -> Callable:
    def forward(*args, **kwargs):
        _check_args(args, kwargs, type(block).__name__)
        compiled = cache.get(block, args)
        params = [p for _, p in block.named_parameters()]
        buffers = [b for _, b in block.named_buffers()]
        ys = _BlockFunction.apply(executor, compiled, block_id, *args, *params, *buffers)
        return tuple(ys) if compiled.step.tuple_output else ys[0]

    return forward
