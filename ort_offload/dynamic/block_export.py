"""Export of one block's vector-Jacobian step and its split into a forward and a backward part.

:func:`export_block_step` traces ``(x, params, buffers, dy) -> (y, dx, dparams)`` of a block at
one input signature and exports it as one ONNX graph (cached on disk by the block's structure and
signature, not its identity); :func:`split_step` cuts that graph into the nodes that do not depend
on any ``dy`` (the forward part) and the rest. Running the parts and chaining them through torch
autograd is :mod:`ort_offload.dynamic.blockwise`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import onnx
import onnx_ir as ir
import torch

from graph_passes.ir.liveness import consumed_names
from ort_offload.errors import ExportError, InputMismatchError
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
    """Trace ``block``'s vector-Jacobian step at ``args`` and export it under the names of :class:`VJPStep`."""
    named_params = list(block.named_parameters())
    named_buffers = list(block.named_buffers())
    param_names = [n for n, _ in named_params]
    buffer_names = [n for n, _ in named_buffers]
    grad_params = tuple(i for i, (_, p) in enumerate(named_params) if p.requires_grad)
    dx_args = tuple(i for i, a in enumerate(args) if a.is_floating_point())
    tuple_output, outputs = _probe_outputs(block, args)
    vjp = _vjp_function(block, len(args), param_names, buffer_names, dx_args, grad_params)
    flat = (
        tuple(a.detach() for a in args)
        + tuple(p.detach() for _, p in named_params)
        + tuple(b.detach() for _, b in named_buffers)
        + tuple(torch.zeros_like(o) for o in outputs)
    )
    ir_model = _onnx_export(_trace(block, vjp, flat), flat, tuple(None for _ in flat))
    names = dict(
        arg_inputs=tuple(f"x{i}" for i in range(len(args))),
        param_inputs=tuple(f"param.{n}" for n in param_names),
        buffer_inputs=tuple(f"buffer.{n}" for n in buffer_names),
        dy_inputs=tuple(f"dy{j}" for j in range(len(outputs))),
        y_outputs=tuple(f"y{j}" for j in range(len(outputs))),
        dx_outputs=tuple(f"dx{i}" for i in dx_args),
        grad_outputs=tuple(f"grad.{param_names[i]}" for i in grad_params),
    )
    in_names = names["arg_inputs"] + names["param_inputs"] + names["buffer_inputs"] + names["dy_inputs"]
    out_names = names["y_outputs"] + names["dx_outputs"] + names["grad_outputs"]
    model = _step_model(ir_model, in_names, out_names, type(block).__name__)
    step = VJPStep(model=model, dx_args=dx_args, grad_params=grad_params, tuple_output=tuple_output,
                   cache_key=key, cache_hit=False, export_time_s=0.0, **names)
    onnx.helper.set_model_props(model, {_METADATA_KEY: json.dumps(step.metadata())})
    return step


def _probe_outputs(block: torch.nn.Module, args: tuple) -> tuple[bool, tuple[torch.Tensor, ...]]:
    """Whether ``block`` returns a tuple, and its outputs at ``args`` (each a floating tensor)."""
    with torch.no_grad(), _export_context():
        probe = block(*args)
    tuple_output = isinstance(probe, tuple)
    outputs = probe if tuple_output else (probe,)
    if not outputs or not all(isinstance(o, torch.Tensor) and o.is_floating_point() for o in outputs):
        raise ExportError(f"{type(block).__name__} must return a floating tensor or a tuple of them")
    return tuple_output, outputs


def _vjp_function(block, n_args: int, param_names, buffer_names, dx_args, grad_params) -> Callable:
    """``(x..., params..., buffers..., dy...) -> (y..., dx..., dparams...)`` of ``block`` as one
    function of flat tensors, for ``make_fx`` to trace."""
    n_params, n_buffers = len(param_names), len(buffer_names)

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

    return vjp


def _trace(block: torch.nn.Module, vjp: Callable, flat: tuple) -> torch.fx.GraphModule:
    """``vjp`` traced by ``make_fx`` into core ATen ops (the ONNX exporter's input)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with _export_context():
            return make_fx(vjp, decomposition_table=torch._decomp.core_aten_decompositions())(
                *[t.detach().clone() for t in flat]
            )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"could not trace the step of {type(block).__name__} ({type(e).__name__}: {first})") from e


def _step_model(ir_model: ir.Model, in_names, out_names, block_name: str) -> onnx.ModelProto:
    """The exported step under its signature's names, random ops seeded, shapes inferred and checked."""
    _rename_signature(ir_model.graph, in_names, out_names, what=f"the step of {block_name}")
    model = ir.to_proto(ir_model)
    model.graph.name = f"{block_name}_vjp"
    _seed_random_ops(model)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        onnx.checker.check_model(model)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ExportError(f"the step graph of {block_name} is not valid ONNX: {first}") from e
    return model


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
    graph = step.model.graph
    types = {v.name: v for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    graph_inputs = [v.name for v in graph.input]
    through = _pass_through_gradients(step, graph_inputs)
    kinds = _node_kinds(through.nodes, {t.name for t in through.initializers}, step)
    producer_kind = {o: kind for node, kind in zip(through.nodes, kinds) for o in node.output if o}
    forward_nodes = [n for n, k in zip(through.nodes, kinds) if k == "forward"]
    backward_nodes = [n for n, k in zip(through.nodes, kinds) if k == "backward"] + through.identities
    const_nodes = [n for n, k in zip(through.nodes, kinds) if k == "constant"]

    backward_reads = [n for node in backward_nodes for n in consumed_names(node) if n]
    saved = tuple(dict.fromkeys(n for n in backward_reads if producer_kind.get(n) == "forward"))
    dy_set = set(step.dy_inputs)
    state_inputs = tuple(n for n in graph_inputs if n not in dy_set and n in set(backward_reads))
    forward_reads = {n for node in forward_nodes for n in consumed_names(node) if n} | set(step.y_outputs)
    forward_inputs = tuple(n for n in graph_inputs if n not in dy_set and n in forward_reads)
    for name, source in through.renamed.items():  # renamed sources keep the type of the output they feed
        types[source] = _value_info(types, name)
        types[source].name = source

    def part(name: str, part_nodes, inputs, outputs) -> onnx.ModelProto:
        return _part_model(step.model, name, _constant_closure(part_nodes, const_nodes, outputs) + list(part_nodes),
                           inputs, outputs, through.initializers, types)

    forward_outputs = list(step.y_outputs) + [n for n in saved if n not in step.y_outputs]
    forward = part(f"{graph.name}_forward", forward_nodes, forward_inputs, forward_outputs)
    backward_inputs = list(step.dy_inputs) + list(saved) + list(state_inputs)
    backward = part(f"{graph.name}_backward", backward_nodes, backward_inputs,
                    list(step.dx_outputs) + list(step.grad_outputs))
    return SplitStep(forward=forward, backward=backward, forward_inputs=forward_inputs, saved=saved,
                     backward_state_inputs=state_inputs)


@dataclasses.dataclass(frozen=True)
class _PassThrough:
    """The step's nodes and initializers with each ``dy``-independent gradient output renamed to
    ``<name>.forward`` (``renamed``), and the Identity nodes that restore the names in the backward part."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    renamed: dict[str, str]
    identities: list[onnx.NodeProto]


def _pass_through_gradients(step: VJPStep, graph_inputs: Sequence[str]) -> _PassThrough:
    """Outputs of the backward part that no ``dy``-dependent node produces get an Identity there."""
    graph = step.model.graph
    nodes = list(graph.node)
    tainted = set(step.dy_inputs)
    produced_by_tainted: set[str] = set()
    for node in nodes:
        if any(n in tainted for n in consumed_names(node)):
            tainted.update(o for o in node.output if o)
            produced_by_tainted.update(o for o in node.output if o)
    renamed: dict[str, str] = {}
    identities: list[onnx.NodeProto] = []
    for name in sorted((set(step.dx_outputs) | set(step.grad_outputs)) - produced_by_tainted):
        renamed[name] = f"{name}.forward"
        identities.append(onnx.helper.make_node("Identity", [renamed[name]], [name], name=f"split/passthrough/{name}"))
    initializers = list(graph.initializer)
    if renamed:
        if any(n in renamed for n in graph_inputs):
            raise ExportError("a gradient output of the step aliases one of its inputs")
        nodes = [_rename_node_io(node, renamed) for node in nodes]
        for i, tensor in enumerate(initializers):
            if tensor.name in renamed:  # a gradient folded into a constant (a zero gradient)
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                copy.name = renamed[tensor.name]
                initializers[i] = copy
    return _PassThrough(nodes, initializers, renamed, identities)


def _node_kinds(nodes: Sequence[onnx.NodeProto], initializers: set[str], step: VJPStep) -> list[str]:
    """Per node: ``backward`` (reads a ``dy``, transitively), ``constant`` (reads only constants)
    or ``forward``."""
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
    return kinds


def _value_info(types: Mapping[str, onnx.ValueInfoProto], name: str) -> onnx.ValueInfoProto:
    known = types.get(name)
    if known is None or not known.type.tensor_type.elem_type:
        raise ExportError(f"no type for value {name!r} of the step graph (shape inference did not reach it)")
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(known)
    copy.name = name
    return copy


def _part_model(model: onnx.ModelProto, name: str, body, inputs, outputs, initializers,
                types: Mapping[str, onnx.ValueInfoProto]) -> onnx.ModelProto:
    """One part of the split step as a checked model: ``body`` with the initializers it reads."""
    reads = {n for node in body for n in consumed_names(node)}
    boundary = set(inputs) | set(outputs)
    internal = [types[o] for node in body for o in node.output if o in types and o not in boundary]
    g = onnx.helper.make_graph(
        body, name, [_value_info(types, n) for n in inputs], [_value_info(types, n) for n in outputs],
        initializer=[t for t in initializers if t.name in reads], value_info=internal,
    )
    m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                               functions=list(model.functions))
    try:
        onnx.checker.check_model(m)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the {name} part of the split step is not valid ONNX: {str(e).splitlines()[0]}") from e
    return m


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
