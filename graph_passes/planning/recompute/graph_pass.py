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

The pass edits an ``onnx_ir`` model in place (:func:`recompute_in_place`);
:func:`write_recompute_plan` is the planner's protobuf form of it.

``requires``: the plan's segments are forward nodes of this graph. ``ensures``: the graph is
topologically sorted and no backward node reads a recomputed original.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import onnx
import onnx_ir as ir
import onnx_ir.passes

from graph_passes.ir.editing import ancestor_indices, carries, check_topological, copy_node, read_names
from graph_passes.ir.proto_mirror import ProtoMirror
from graph_passes.ir.provenance import PASS_KEY, RECOMPUTE_PASS, RECOMPUTE_SOURCE_KEY
from graph_passes.planning.recompute.planner import RANDOM_OPS, RecomputePlan, Segment, segment_closure
from graph_passes.ir.shapes import TensorInfo

PASS_NAME = RECOMPUTE_PASS
SOURCE_KEY = RECOMPUTE_SOURCE_KEY


def clone_name(name: str, segment: int) -> str:
    return f"{name}__rc{segment}"


def write_recompute_plan(model: onnx.ModelProto, plan: RecomputePlan, *, loss_name: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the plan's clones; returns it and the number of clone nodes."""
    return RecomputeWriter(model, loss_name=loss_name).write(plan)


class RecomputeWriter:
    """Writes recompute plans into one protobuf graph, one after another (the planner's graphs:
    its target with each key's segments recomputed). The graph is converted to ``onnx_ir``
    once; each plan is written in place (:func:`recompute_in_place`), the result written back
    with only the clones and rewired readers serialized (:class:`ProtoMirror`), and the plan
    taken out again."""

    def __init__(self, model: onnx.ModelProto, *, loss_name: str) -> None:
        self.mirror = ProtoMirror(model)
        self.model = self.mirror.model
        self.loss_name = loss_name

    def write(self, plan: RecomputePlan) -> tuple[onnx.ModelProto, int]:
        """The graph with ``plan`` written in, and the number of clone nodes."""
        edits = recompute_in_place(self.model.graph, plan, loss_name=self.loss_name)
        try:
            return self.mirror.to_proto(), len(edits.clones)
        finally:
            edits.undo()


@dataclasses.dataclass
class RecomputeEdits:
    """What :func:`recompute_in_place` changed: the clones it inserted and the backward inputs
    it pointed at them (node, input index, the original read before)."""

    graph: ir.Graph
    clones: list[ir.Node]
    rewired: list[tuple[ir.Node, int, ir.Value]]

    def undo(self) -> None:
        """The graph as it was before."""
        for node, index, original in self.rewired:
            node.replace_input_with(index, original)
        self.graph.remove(self.clones, safe=True)


def forward_indices(nodes: list[ir.Node], loss_name: str) -> set[int]:
    """Indices of the nodes the loss depends on (:func:`~graph_passes.planning.recompute.planner.forward_nodes`
    of an ``onnx_ir`` graph)."""
    loss = next((v for node in nodes for v in node.outputs if v.name == loss_name), None)
    if loss is None:
        raise ValueError(f"no node produces the loss {loss_name!r}")
    return ancestor_indices(nodes, [loss])


def recompute_in_place(graph: ir.Graph, plan: RecomputePlan, *, loss_name: str) -> RecomputeEdits:
    """Insert the plan's clones into ``graph`` and point the backward at them."""
    nodes = list(graph)
    forward = forward_indices(nodes, loss_name)
    first_backward_reader: dict[str, int] = {}
    for index, node in enumerate(nodes):
        if index not in forward:
            for value in node.inputs:
                if value is not None:
                    first_backward_reader.setdefault(value.name, index)
    produced_in = {segment.index: {o.name: i for i in segment.nodes for o in nodes[i].outputs if o.name}
                   for segment in plan.segments}

    def needed_for(segment: Segment, name: str) -> set[int]:
        """Nodes of the segment ``name`` depends on (random ops excluded: kept)."""
        return segment_closure(name, produced_in[segment.index], nodes, reads=read_names)[0]

    # What each segment's clones read from outside it (its checkpoint): originals, kept. (Taken
    # over all its saved values: a value it does not re-create may count, and stay, needlessly.)
    checkpoint_of = {}
    for segment in plan.segments:
        cloned = set().union(*(needed_for(segment, n) for n in segment.saved))
        checkpoint_of[segment.index] = {n for i in cloned for n in read_names(nodes[i])
                                        if n not in produced_in[segment.index]}
    writer = _CloneWriter(nodes)
    for segment in plan.segments:
        kept = set().union(*(names for index, names in checkpoint_of.items() if index != segment.index))
        # Each saved value is re-created just before its own first backward reader; clones an
        # earlier one already made are shared.
        emitted: set[int] = set()
        for name in sorted((n for n in segment.saved if n in first_backward_reader and n not in kept),
                           key=first_backward_reader.get):
            batch = writer.inserts.setdefault(first_backward_reader[name], [])
            for index in sorted(needed_for(segment, name) - emitted):
                batch.append(writer.clone(index, segment.index, produced_in[segment.index]))
                emitted.add(index)
            writer.renamed[name] = writer.value(clone_name(name, segment.index))
    edits = RecomputeEdits(graph, [clone for batch in writer.inserts.values() for clone in batch], [])
    for index, node in enumerate(nodes):
        if index in writer.inserts:
            graph.insert_before(node, writer.inserts[index])
        if index not in forward:
            for k, value in enumerate(node.inputs):
                if value is not None and value.name in writer.renamed:
                    edits.rewired.append((node, k, value))
                    node.replace_input_with(k, writer.renamed[value.name])
    check_topological(graph)
    return edits


class _CloneWriter:
    """The clone nodes and their values, made once per clone name."""

    def __init__(self, nodes: list[ir.Node]) -> None:
        self.nodes = nodes
        self.values: dict[str, ir.Value] = {}
        self.inserts: dict[int, list[ir.Node]] = {}  # node index -> clones to put before it
        self.renamed: dict[str, ir.Value] = {}  # saved original -> its clone, for backward readers

    def value(self, name: str) -> ir.Value:
        if name not in self.values:
            self.values[name] = ir.Value(name=name)
        return self.values[name]

    def clone(self, index: int, segment: int, produced_here: Mapping[str, int]) -> ir.Node:
        """A clone of node ``index`` reading the segment's clones (random ops' outputs: the originals)."""
        source = self.nodes[index]
        inputs = [self.value(clone_name(v.name, segment))
                  if v is not None and v.name in produced_here and self.nodes[produced_here[v.name]].op_type not in RANDOM_OPS
                  else v for v in source.inputs]
        outputs = [self.value(clone_name(v.name, segment)) if v.name else ir.Value(name="") for v in source.outputs]
        node = copy_node(source, inputs=inputs, outputs=outputs, name=f"{source.name or source.op_type}__rc{segment}")
        node.metadata_props[PASS_KEY] = PASS_NAME
        node.metadata_props[SOURCE_KEY] = source.name or ""
        return node


def _is_clone(node: onnx.NodeProto) -> bool:
    return any(p.key == PASS_KEY and p.value == PASS_NAME for p in node.metadata_props)


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


class RecomputePass(onnx_ir.passes.InPlacePass):
    """Write ``plan`` (segments of this graph's forward) into the graph."""

    def __init__(self, plan: RecomputePlan, *, loss_name: str) -> None:
        super().__init__()
        self.plan = plan
        self.loss_name = loss_name
        self.clones = 0

    def requires(self, model: ir.Model) -> None:
        forward = forward_indices(list(model.graph), self.loss_name)
        outside = [i for s in self.plan.segments for i in s.nodes if i not in forward]
        if outside:
            raise onnx_ir.passes.PreconditionError(f"plan segments include non-forward nodes {outside[:3]}")

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        self.clones = len(recompute_in_place(model.graph, self.plan, loss_name=self.loss_name).clones)
        return onnx_ir.passes.PassResult(model, modified=self.clones > 0)

    def ensures(self, model: ir.Model) -> None:
        nodes = list(model.graph)
        forward = forward_indices(nodes, self.loss_name)
        clones = {v for node in nodes if carries(node, PASS_KEY, PASS_NAME) for v in node.outputs if v.name}
        originals = {v.name.rsplit("__rc", 1)[0] for node in nodes if not carries(node, PASS_KEY, PASS_NAME)
                     for v in node.inputs if v in clones}
        for index, node in enumerate(nodes):
            if index not in forward and not carries(node, PASS_KEY, PASS_NAME):
                bad = [v.name for v in node.inputs if v is not None and v.name in originals]
                if bad:
                    raise onnx_ir.passes.PostconditionError(f"backward node {node.name!r} still reads {bad[0]!r}")


__all__ = [
    "RecomputeEdits", "RecomputePass", "RecomputeWriter", "clone_name", "clone_sources", "forward_indices", "recompute_in_place", "recomputed_infos",
    "recreated_values", "write_recompute_plan",
]
