"""The recompute pass: writes a :class:`~graph_passes.planning.recompute.planner.RecomputePlan` into the graph.

For each recomputed segment, the forward nodes that its saved values depend on (inside the
segment) are cloned; every backward read of a saved value reads the clone instead. Each saved
value is re-created right before its own first backward reader, in graph order (clones an
earlier one already made are shared), so the originals die at their last forward use and the
clones live only from there to their backward uses (the lowering frees every value after its
last reader). Clones read what the segment read — its
checkpoint (the value at the cut), parameters, constants — and the kept outputs of random ops,
so recomputation gives bitwise the same values. Each clone carries provenance metadata
(``ort_offload.pass`` = ``recompute``, ``ort_offload.recomputes`` = the original node).

A saved value that another recomputed segment reads (a layer's output: the next segment's
checkpoint) is not re-created: that segment's clones read the original, which so stays in
memory until the backward anyway, and re-creating it would cost the layer's last product
(bert small at length 256, every segment: 211 clones instead of 233, the same least budget).

``requires``: the plan's segments are forward nodes of this graph. ``ensures``: the graph is
topologically sorted and no backward node reads a recomputed original.
"""

from __future__ import annotations

from typing import Mapping

import onnx
import onnx_ir as ir
import onnx_ir.passes

from graph_passes.ir.liveness import check_topological, consumed_names
from graph_passes.ir.provenance import PASS_KEY, RECOMPUTE_PASS, RECOMPUTE_SOURCE_KEY
from graph_passes.planning.recompute.planner import RANDOM_OPS, RecomputePlan, Segment, forward_nodes, segment_closure
from graph_passes.ir.shapes import TensorInfo

PASS_NAME = RECOMPUTE_PASS
SOURCE_KEY = RECOMPUTE_SOURCE_KEY


def clone_name(name: str, segment: int) -> str:
    return f"{name}__rc{segment}"


def write_recompute_plan(model: onnx.ModelProto, plan: RecomputePlan, *, loss_name: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the plan's clones; returns it and the number of clone nodes."""
    nodes = list(model.graph.node)
    forward = forward_nodes(model, loss_name)
    inserts: dict[int, list[onnx.NodeProto]] = {}  # node index -> clones to put before it
    renamed: dict[str, str] = {}  # saved original -> its clone, for backward readers
    clones = 0
    first_backward_reader: dict[str, int] = {}
    for index, node in enumerate(nodes):
        if index not in forward:
            for name in node.input:
                first_backward_reader.setdefault(name, index)
    produced_in = {segment.index: {o: i for i in segment.nodes for o in nodes[i].output if o}
                   for segment in plan.segments}

    def needed_for(segment: Segment, name: str) -> set[int]:
        """Nodes of the segment ``name`` depends on (random ops excluded: kept)."""
        return segment_closure(name, produced_in[segment.index], nodes)[0]

    # What each segment's clones read from outside it (its checkpoint): originals, kept. (Taken
    # over all its saved values: a value it does not re-create may count, and stay, needlessly.)
    checkpoint_of = {}
    for segment in plan.segments:
        cloned = set().union(*(needed_for(segment, n) for n in segment.saved))
        checkpoint_of[segment.index] = {n for i in cloned for n in consumed_names(nodes[i])
                                        if n not in produced_in[segment.index]}
    for segment in plan.segments:
        produced_here = produced_in[segment.index]
        kept = set().union(*(names for index, names in checkpoint_of.items() if index != segment.index))

        # Each saved value is re-created just before its own first backward reader; clones an
        # earlier one already made are shared.
        emitted: set[int] = set()
        for name in sorted((n for n in segment.saved if n in first_backward_reader and n not in kept),
                           key=first_backward_reader.get):
            batch = inserts.setdefault(first_backward_reader[name], [])
            for index in sorted(needed_for(segment, name) - emitted):
                source = nodes[index]
                node = onnx.NodeProto()
                node.CopyFrom(source)
                node.name = f"{source.name or source.op_type}__rc{segment.index}"
                for k, value in enumerate(node.input):
                    if value in produced_here and nodes[produced_here[value]].op_type not in RANDOM_OPS:
                        node.input[k] = clone_name(value, segment.index)
                for k, value in enumerate(node.output):
                    if value:
                        node.output[k] = clone_name(value, segment.index)
                node.metadata_props.add(key=PASS_KEY, value=PASS_NAME)
                node.metadata_props.add(key=SOURCE_KEY, value=source.name)
                batch.append(node)
                emitted.add(index)
                clones += 1
            renamed[name] = clone_name(name, segment.index)

    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(nodes):
        new_nodes.extend(inserts.get(index, ()))
        if index not in forward:
            node = _with_inputs(node, renamed)
        new_nodes.append(node)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(new_nodes)
    graph_inputs = {i.name for i in result.graph.input} | {t.name for t in result.graph.initializer}
    check_topological(list(result.graph.node), graph_inputs)
    return result, clones


def _is_clone(node: onnx.NodeProto) -> bool:
    return any(p.key == PASS_KEY and p.value == PASS_NAME for p in node.metadata_props)


def _with_inputs(node: onnx.NodeProto, renamed: Mapping[str, str]) -> onnx.NodeProto:
    if not any(name in renamed for name in node.input):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for k, name in enumerate(copy.input):
        copy.input[k] = renamed.get(name, name)
    return copy


def clone_sources(model: onnx.ModelProto) -> dict[str, str]:
    """Each clone's output -> the original value it re-creates."""
    return {name: name.rsplit("__rc", 1)[0] for node in model.graph.node if _is_clone(node)
            for name in node.output if name}


def recomputed_infos(infos: Mapping[str, TensorInfo], model: onnx.ModelProto, *,
                     sources: Mapping[str, str] | None = None) -> dict[str, TensorInfo]:
    """``infos`` plus the clones' values (a clone has its original's type and shape).
    ``sources``: :func:`clone_sources` of ``model``, for a caller that has it already."""
    out = dict(infos)
    for name, original in (clone_sources(model) if sources is None else sources).items():
        out.setdefault(name, infos[original])
    return out


def recreated_values(model: onnx.ModelProto) -> set[str]:
    """The saved values the graph re-creates: those whose clones nodes other than clones read
    (the backward). A segment's saved values another recomputed segment reads as its
    checkpoint are not among them, even where a clone chain computes them on the way."""
    clones = {name for node in model.graph.node if _is_clone(node) for name in node.output if name}
    return {name.rsplit("__rc", 1)[0] for node in model.graph.node if not _is_clone(node)
            for name in node.input if name in clones}


class RecomputePass(onnx_ir.passes.FunctionalPass):
    """Write ``plan`` (segments of this graph's forward) into the graph."""

    def __init__(self, plan: RecomputePlan, *, loss_name: str) -> None:
        super().__init__()
        self.plan = plan
        self.loss_name = loss_name
        self.clones = 0

    def requires(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        forward = forward_nodes(proto, self.loss_name)
        outside = [i for s in self.plan.segments for i in s.nodes if i not in forward]
        if outside:
            raise onnx_ir.passes.PreconditionError(f"plan segments include non-forward nodes {outside[:3]}")

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        proto, self.clones = write_recompute_plan(ir.to_proto(model), self.plan, loss_name=self.loss_name)
        return onnx_ir.passes.PassResult(ir.from_proto(proto), modified=self.clones > 0)

    def ensures(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        forward = forward_nodes(proto, self.loss_name)
        originals = recreated_values(proto)
        for index, node in enumerate(proto.graph.node):
            if index not in forward and not _is_clone(node):
                bad = [n for n in node.input if n in originals]
                if bad:
                    raise onnx_ir.passes.PostconditionError(f"backward node {node.name!r} still reads {bad[0]!r}")


__all__ = ["RecomputePass", "clone_name", "clone_sources", "recomputed_infos", "recreated_values", "write_recompute_plan"]
