"""Training-step graphs for gradient accumulation and global-norm clipping.

One graph, built from the forward/backward graph that ``export_training_step(optimizer=None)``
gives (loss and one ``<param>.grad`` output per trained parameter): it adds each gradient to a
``<param>.grad_acc`` state tensor and divides the sums by k, measures the global gradient norm
(output ``grad_norm``), scales the gradients by ``min(1, max_norm / (norm + 1e-6))`` as
``torch.nn.utils.clip_grad_norm_`` does and appends the optimizer update
(:mod:`ort_offload.export.optimizers`). With k > 1 a scalar state input ``optimizer.apply`` selects
(``Where``) between the update (accumulators back to zero) and keeping parameters and optimizer
state while the accumulators keep the sums: one graph and one memory plan for every
micro-batch, at the price of computing the (elementwise) update on each of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload.export import optimizers
from ort_offload.export.training_step import append_optimizer, checked_training_graph
from ort_offload.errors import ExportError, InvalidArgumentError

ACC_STATE = "grad_acc"
GRAD_NORM_OUTPUT = "grad_norm"
GRAD_SUFFIX = ".grad"
APPLY_INPUT = optimizers.APPLY_INPUT
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclasses.dataclass(frozen=True)
class LoopGraphs:
    """The step graph of a trainer that accumulates or clips, and its options."""

    update: TrainingGraph
    accumulation_steps: int
    grad_clip_norm: float | None


def check_loop_options(accumulation_steps: int, grad_clip_norm: float | None) -> bool:
    """Check the options; True when they need the loop graphs (accumulation or clipping)."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise InvalidArgumentError(f"accumulation_steps must be a whole number at least 1, got {accumulation_steps!r}")
    if grad_clip_norm is not None and (isinstance(grad_clip_norm, bool) or not isinstance(grad_clip_norm, (int, float))
                                       or not (grad_clip_norm > 0 and np.isfinite(grad_clip_norm))):
        raise InvalidArgumentError(f"grad_clip_norm must be a finite number above 0, got {grad_clip_norm!r}")
    return accumulation_steps > 1 or grad_clip_norm is not None


def build_loop_graphs(base: TrainingGraph, config: optimizers.OptimizerConfig, *, accumulation_steps: int = 1,
                      grad_clip_norm: float | None = None) -> LoopGraphs:
    """The step graph of ``base`` (a graph with gradient outputs, no optimizer)."""
    check_loop_options(accumulation_steps, grad_clip_norm)
    if not [n for n in base.output_names if base.roles.get(n) == Role.GRAD]:
        raise ExportError(f"{base.name}: the graph has no gradient outputs to accumulate or clip")
    update = _update_graph(base, config, accumulation_steps, grad_clip_norm)
    return LoopGraphs(update, accumulation_steps, None if grad_clip_norm is None else float(grad_clip_norm))


def _start(base: TrainingGraph):
    """An editable copy of ``base``: (ir model, roles, state pairs, {param: grad output value})."""
    model = ir.serde.deserialize_model(base.model)
    grads = {v.name[: -len(GRAD_SUFFIX)]: v for v in model.graph.outputs
             if base.roles.get(v.name) == Role.GRAD and v.name.endswith(GRAD_SUFFIX)}
    return model, dict(base.roles), dict(base.state_pairs), grads


def _add_accumulators(graph: ir.Graph, grads: dict, roles: dict) -> dict[str, tuple[ir.Value, ir.Value]]:
    """One ``<param>.grad_acc`` state input per gradient; returns {param: (accumulator, acc + grad)}."""
    b = optimizers._Builder(graph, "loop/accumulate")
    sums = {}
    for param, grad in grads.items():
        acc = ir.Value(name=optimizers.state_input_name(param, ACC_STATE), type=grad.type, shape=grad.shape)
        graph.inputs.append(acc)
        roles[acc.name] = Role.OPTIMIZER_STATE
        total = b.op("Add", acc, grad)
        total.dtype, total.shape = grad.dtype, grad.shape
        sums[param] = (acc, total)
    return sums


def _update_graph(base: TrainingGraph, config, accumulation_steps: int, clip: float | None) -> TrainingGraph:
    model, roles, pairs, grads = _start(base)
    graph = model.graph
    b = optimizers._Builder(graph, "loop/update")
    dtypes = {g.dtype for g in grads.values()}
    if len(dtypes) != 1:
        raise ExportError(f"{base.name}: gradients of several dtypes cannot share one global norm")
    dtype = dtypes.pop()
    final = {p: g for p, g in grads.items()}
    sums = _add_accumulators(graph, grads, roles) if accumulation_steps > 1 else {}
    for param, (acc, total) in sums.items():
        final[param] = b.op("Div", total, b.const(float(accumulation_steps), dtype))
    squares = [b.op("ReduceSumSquare", g, keepdims=0) for g in final.values()]
    norm = b.op("Sqrt", b.op("Sum", *squares), name=GRAD_NORM_OUTPUT)
    norm.dtype, norm.shape = dtype, ir.Shape([])
    roles[norm.name] = Role.ACTIVATION
    if clip is not None:
        coef = b.op("Min", b.op("Div", b.const(clip, dtype), b.op("Add", norm, b.const(CLIP_EPS, dtype))),
                    b.const(1.0, dtype))
        final = {p: b.op("Mul", g, coef) for p, g in final.items()}
    grad_of = _swap_grad_outputs(graph, grads, final, roles)
    trained = dict(pairs)
    append_optimizer(graph, config, grad_of, roles, pairs)
    graph.outputs.append(norm)
    if sums:
        _gate_updates(graph, b, {s: u for s, u in pairs.items() if s not in trained}, sums, roles, pairs)
    return _finish(model, roles, pairs, base.name)


def _gate_updates(graph: ir.Graph, b, updates: dict[str, str], sums: dict, roles: dict, pairs: dict) -> None:
    """Apply ``updates`` (state input -> updated output) only where ``optimizer.apply`` is
    above 0; the accumulators then restart at zero, else they keep the sums."""
    apply = ir.Value(name=APPLY_INPUT, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    graph.inputs.append(apply)
    roles[APPLY_INPUT] = Role.OPTIMIZER_STATE
    condition = b.op("Greater", apply, b.const(0.0, ir.DataType.FLOAT))
    inputs = {v.name: v for v in graph.inputs}
    positions = {v.name: i for i, v in enumerate(graph.outputs)}
    for source, updated in updates.items():
        value = graph.outputs[positions[updated]]
        value.name = f"{updated}.candidate"
        gated = b.op("Where", condition, value, inputs[source], name=updated)
        gated.dtype, gated.shape = value.dtype, value.shape
        graph.outputs[positions[updated]] = gated
        roles[value.name] = Role.ACTIVATION
    for param, (acc, total) in sums.items():
        zeros = b.op("ConstantOfShape", b.op("Shape", acc), value=ir.tensor(np.zeros(1, acc.dtype.numpy())))
        gated = b.op("Where", condition, zeros, total, name=optimizers.updated_name(acc.name))
        gated.dtype, gated.shape = acc.dtype, acc.shape
        roles[gated.name] = Role.OPTIMIZER_STATE
        pairs[acc.name] = gated.name
        graph.outputs.append(gated)


def _swap_grad_outputs(graph: ir.Graph, grads: dict, final: dict, roles: dict) -> dict[str, str]:
    """Make each final (accumulated, clipped) gradient the ``<param>.grad`` output the optimizer
    reads; the raw one keeps its gradient role as ``<param>.grad.raw``. Returns {grad: param}."""
    positions = {id(v): i for i, v in enumerate(graph.outputs)}
    grad_of = {}
    for param, raw in grads.items():
        name = raw.name
        value = final[param]
        if value is not raw:
            raw.name = f"{name}.raw"
            roles[raw.name] = Role.GRAD
            value.name = name
            value.dtype, value.shape = raw.dtype, raw.shape
            graph.outputs[positions[id(raw)]] = value
        grad_of[name] = param
    return grad_of


def _finish(model: ir.Model, roles: dict, pairs: dict, name: str) -> TrainingGraph:
    return checked_training_graph(ir.to_proto(model), roles, pairs, name,
                                  what=f"the accumulate/clip graph of {name}")
