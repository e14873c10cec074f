"""The split pass (TSPLIT): writes a :class:`SplitPlan` into the graph.

A plan is a tuple of :class:`SplitRun` s. A run names consecutive nodes of the dataflow (graph
node indices, producer first), the split of each (:class:`~graph_passes.planning.split.rules.SplitAxis`,
from :mod:`graph_passes.planning.split.rules`) and the number of micro-ops ``p``. The pass replaces the
run by

- for each input read from outside the run, its ``p`` pieces as separate graph values (sizes
  as ``numpy.array_split``): a ``Slice`` right before each micro-op, or one ``Split`` before
  the first (:class:`Cut`);
- ``p`` rounds of micro-ops, round ``i`` running every node of the run on piece ``i`` (each
  later node reads the previous node's micro-output directly: a run is split once at its start
  and merged once at its end, with no merge in between), so each input piece dies right after
  its micro-op under the liveness-based lowering;
- the merges: ``Concat`` for concat splits, emitted only where the output is read outside the
  run or is a graph output; a running ``Add`` after each micro-op for sum splits (then ``Mul``
  by the scale for means); for chain splits the last micro-op writes the output itself; for
  staged reductions a ``Concat`` of the small partial reductions, a ``ReduceSum`` over it
  (then ``Div`` by the count for means).

Merged outputs keep their names, so consumers and graph outputs are untouched. The new nodes
stand where the run's last node stood, and the graph is then re-sorted stably (a node that read
an early run output before the run ended moves behind the merge). Every inserted node carries
``ort_offload.pass`` = ``split``; micro-ops also ``ort_offload.splits`` = the original node,
the others ``ort_offload.reason``.

Piece bounds and per-micro-op shapes are constants: the rewritten graph is specialized to the
input signature ``infos`` describe (plans are made per signature, as Mimose's are per input size).

The pass edits an ``onnx_ir`` model in place (:func:`split_in_place`); :func:`write_split_plan`
is the split planner's protobuf form of it.

``requires``: every run node has a split rule with the requested axis; ``p`` fits the split
dimension; runs are disjoint and each later node of a run reads an earlier one's output only
as micro-tensors (Concat axis of the producer = slice axis of the consumer). ``ensures``: the
graph is topologically sorted, every graph output is produced, and no original run node is left.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes

from graph_passes.ir.editing import (
    available_values, carries, check_topological, copy_attribute, copy_node, output_names, read_names, set_order,
    stable_topological, take_over,
)
from graph_passes.ir.proto_mirror import ProtoMirror
from graph_passes.ir.provenance import PASS_KEY, REASON_KEY, SPLIT_PASS, SPLIT_SOURCE_KEY
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.split.rules import (
    CHAIN, CONCAT, STAGED, SUM, AxesInput, Carry, Merge, MicroShape, NodeInfo, SliceOn, SplitAxis, SplitOption,
    UnsplittableOpError, Whole, chunk_sizes, find_option,
)

logger = logging.getLogger(__name__)

PASS_NAME = SPLIT_PASS
SOURCE_KEY = SPLIT_SOURCE_KEY


class Cut(enum.Enum):
    """How an input read from outside a run is cut. ``SLICE``: one ``Slice`` right before each
    micro-op; the input lives until the last one, each piece only for its micro-op (peak about
    A·(1 + 2/p) for an input of A bytes and a same-size output under liveness). ``SPLIT``: one
    ``Split`` before the first micro-op; the input dies there, but input and pieces are live
    together at the Split (2A) unless the runtime makes it a view."""

    SLICE = "slice"
    SPLIT = "split"


DEFAULT_CUT = Cut.SLICE


@dataclasses.dataclass(frozen=True)
class SplitRun:
    """Consecutive nodes (graph indices, producer first) split ``parts`` ways, node ``k`` as
    ``axes[k]``."""

    nodes: tuple[int, ...]
    axes: tuple[SplitAxis, ...]
    parts: int

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.axes) or not self.nodes:
            raise ValueError("a split run needs one axis per node and at least one node")


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Which runs of nodes are split; :class:`SplitPass` applies it."""

    runs: tuple[SplitRun, ...]

    @property
    def split_nodes(self) -> int:
        return sum(len(r.nodes) for r in self.runs)


@dataclasses.dataclass(frozen=True)
class _Resolved:
    run: SplitRun
    options: tuple[SplitOption, ...]
    sizes: tuple[int, ...]


def resolve_plan(graph: ir.Graph, plan: SplitPlan, infos: Mapping[str, TensorInfo]) -> tuple[_Resolved, ...]:
    """Each run with its nodes' split options; raises :class:`UnsplittableOpError` when the
    plan does not fit the graph (see the module docstring)."""
    nodes = list(graph)
    seen: set[int] = set()
    resolved = []
    for run in plan.runs:
        if seen & set(run.nodes) or len(set(run.nodes)) != len(run.nodes):
            raise UnsplittableOpError(f"split runs overlap at nodes {sorted(seen & set(run.nodes)) or run.nodes}")
        seen.update(run.nodes)
        if any(not 0 <= i < len(nodes) for i in run.nodes):
            raise UnsplittableOpError(f"split run names nodes {run.nodes} outside the graph")
        options = []
        run_outputs = {o for i in run.nodes for o in output_names(nodes[i])}
        produced: dict[str, Merge] = {}  # run output -> how it merges
        extent = None
        for position, (index, key) in enumerate(zip(run.nodes, run.axes)):
            node = nodes[index]
            option = find_option(NodeInfo.of_ir(node, infos), key)
            extent = option.extent if extent is None else extent
            if option.extent != extent:
                raise UnsplittableOpError(
                    f"run node {_label(node, index)} splits a dimension of {option.extent}, the run's first {extent}")
            _check_extents(node, index, option, infos)
            chained = False
            for name, part in zip(_names(node.inputs), option.inputs):
                if name in run_outputs and name not in produced:
                    raise UnsplittableOpError(
                        f"run node {_label(node, index)} reads {name!r} of a later run node: list a run producer first")
                if name in produced:
                    merge = produced[name]
                    if not (merge.kind == CONCAT and isinstance(part, SliceOn) and part.axis == merge.axis):
                        raise UnsplittableOpError(
                            f"run node {_label(node, index)} reads {name!r} whole or on another axis: split the run "
                            "where the axes differ")
                    chained = True
            if position and not chained:
                raise UnsplittableOpError(f"run node {_label(node, index)} reads no micro-tensor of the run before it")
            for name, merge in zip(_names(node.outputs), option.outputs):
                if name:
                    produced[name] = merge
            options.append(option)
        resolved.append(_Resolved(run, tuple(options), chunk_sizes(extent, run.parts)))
    return tuple(resolved)


def _names(values) -> list[str]:
    """Value names as a proto node lists them ('' for an absent input)."""
    return [v.name if v is not None else "" for v in values]


def _label(node: ir.Node, index: int) -> str:
    return f"#{index} ({node.op_type} {node.name!r})"


def _check_extents(node: ir.Node, index: int, option: SplitOption, infos: Mapping[str, TensorInfo]) -> None:
    """Every sliced input and concatenated output has the split extent on its axis."""
    pairs = [(n, p.axis) for n, p in zip(_names(node.inputs), option.inputs) if isinstance(p, SliceOn)]
    pairs += [(n, m.axis) for n, m in zip(_names(node.outputs), option.outputs) if n and m.kind == CONCAT]
    for name, axis in pairs:
        if infos[name].shape[axis] != option.extent:
            raise UnsplittableOpError(
                f"{_label(node, index)}: {name!r} has {infos[name].shape[axis]} on axis {axis}, the split {option.extent}")


def write_split_plan(model: onnx.ModelProto, plan: SplitPlan, infos: Mapping[str, TensorInfo], *,
                     cut: Cut = DEFAULT_CUT) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the plan applied; returns it and the number of micro-ops. For
    the split planner, which infers shapes and lowers protos: one conversion to ``onnx_ir``
    around :func:`split_in_place`, and back only for the nodes it changed (:class:`ProtoMirror`)."""
    mirror = ProtoMirror(model)
    micro_ops = split_in_place(mirror.model.graph, plan, infos, cut=cut)
    return mirror.to_proto(), micro_ops


def split_in_place(graph: ir.Graph, plan: SplitPlan, infos: Mapping[str, TensorInfo], *,
                   cut: Cut = DEFAULT_CUT) -> int:
    """Replace the plan's runs in ``graph`` by their micro-ops and merges; returns the number of
    micro-ops. Raises :class:`UnsplittableOpError` where the plan does not fit the graph."""
    resolved = resolve_plan(graph, plan, infos)
    nodes = list(graph)
    graph_outputs = {v.name for v in graph.outputs}
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(nodes):
        for name in read_names(node):
            readers.setdefault(name, set()).add(index)
    replaced: dict[int, list[ir.Node]] = {}  # last run node -> the run's new nodes
    removed: set[int] = set()
    merged: dict[str, ir.Value] = {}  # run output read after the run -> the new value of its name
    shared = _MergedPieces()
    micro_ops = 0
    # In the order the runs end, so a run that makes a value is written before the runs reading it.
    for number, item in sorted(enumerate(resolved), key=lambda entry: entry[1].run.nodes[-1]):
        group = _GroupWriter(number, item, nodes, infos, graph_outputs, readers, cut=cut, shared=shared)
        replaced[item.run.nodes[-1]] = group.write()
        merged.update(group.merged)
        removed.update(item.run.nodes)
        micro_ops += item.run.parts * len(item.run.nodes)
    new_nodes: list[ir.Node] = []
    for index, node in enumerate(nodes):
        if index in replaced:
            new_nodes.extend(replaced[index])
        elif index not in removed:
            new_nodes.append(node)
    new_nodes = shared.fold_shape_readers(new_nodes, infos)
    new_nodes = shared.drop_unread_merges(new_nodes, merged, graph_outputs)
    order = stable_topological(new_nodes, available_values(graph))
    if order is None:
        raise UnsplittableOpError("the split left a cycle in the graph")
    _replace_runs(graph, [nodes[i] for i in sorted(removed)], merged)
    set_order(graph, order)
    check_topological(graph)
    logger.info("split %d nodes into %d micro-ops", plan.split_nodes, micro_ops)
    return micro_ops


def _replace_runs(graph: ir.Graph, run_nodes: list[ir.Node], merged: Mapping[str, ir.Value]) -> None:
    """Drop the run nodes; the merges take over their outputs' readers, graph-output places and
    types (raises ValueError where another output of theirs is still read)."""
    for node in run_nodes:
        for k in range(len(node.inputs)):
            node.replace_input_with(k, None)
    for node in run_nodes:
        for value in node.outputs:
            if value.name in merged:
                take_over(value, merged[value.name])
    graph.remove(run_nodes, safe=True)


class _MergedPieces:
    """The micro-tensors of each run output merged by ``Concat``, by (name, axis), so that a
    later run cutting that value the same way reads them instead (TSPLIT's micro-tensors
    flowing from run to run where a value has several readers, which :func:`chain_runs`
    leaves merged). A merge that no node reads any more is dropped: the value then never
    exists whole (at a budget barely above an op's need, a merge and a cut each take the whole
    budget and send every other live value out and back)."""

    def __init__(self) -> None:
        self.pieces: dict[tuple[str, int], tuple[tuple[int, ...], list[ir.Value]]] = {}
        self.concats: dict[str, ir.Node] = {}  # merged name -> its Concat

    def add(self, name: str, axis: int, sizes: tuple[int, ...], micros: list[ir.Value], concat: ir.Node) -> None:
        self.pieces[(name, axis)] = (sizes, micros)
        self.concats[name] = concat

    def get(self, name: str, axis: int, sizes: tuple[int, ...]) -> list[ir.Value] | None:
        """The micro-tensors of ``name`` cut on ``axis`` into ``sizes``, where a run made them."""
        found = self.pieces.get((name, axis))
        return found[1] if found is not None and found[0] == sizes else None

    def fold_shape_readers(self, nodes: list[ir.Node], infos: Mapping[str, TensorInfo]) -> list[ir.Node]:
        """``nodes`` with each ``Shape`` or ``Size`` of a merged value replaced by a Constant of
        what it computes (the split graph is specialized to its signature), so that such a
        reader (a BatchNorm's element count) does not keep the merge."""
        folded = []
        for node in nodes:
            name = node.inputs[0].name if node.inputs and node.inputs[0] is not None else None
            if node.domain != "" or node.op_type not in ("Shape", "Size") or name not in self.concats:
                folded.append(node)
                continue
            shape = np.asarray(infos[name].shape, np.int64)
            if node.op_type == "Size":
                value = np.asarray(np.prod(shape), np.int64)
            else:
                start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", None)
                value = shape[start:end]
            constant = ir.Value(name=node.outputs[0].name)
            attr = ir.Attr("value", ir.AttributeType.TENSOR, ir.tensor(value, name=constant.name))
            replacement = ir.Node("", "Constant", [], [attr], outputs=[constant], name=f"{node.name}__folded")
            replacement.metadata_props[PASS_KEY] = PASS_NAME
            replacement.metadata_props[REASON_KEY] = f"{node.op_type} of {name}, fixed for this signature"
            take_over(node.outputs[0], constant)
            node.replace_input_with(0, None)
            folded.append(replacement)
        return folded

    def drop_unread_merges(self, nodes: list[ir.Node], merged: dict[str, ir.Value], graph_outputs) -> list[ir.Node]:
        """``nodes`` without the merges whose value no other node reads (nor the graph
        outputs); their names leave ``merged`` too."""
        read = {name for node in nodes for name in read_names(node)}
        unread = [name for name in self.concats if name not in read and name not in graph_outputs]
        for name in unread:
            merged.pop(name, None)
        dropped = {id(self.concats[name]) for name in unread}
        return [node for node in nodes if id(node) not in dropped]


class _GroupWriter:
    """The nodes replacing one run."""

    def __init__(self, number, item: _Resolved, nodes: list[ir.Node], infos, graph_outputs, readers, *,
                 cut: Cut, shared: _MergedPieces) -> None:
        self.tag = f"__sp{number}"
        self.item = item
        self.nodes = nodes
        self.infos = infos
        self.graph_outputs = graph_outputs
        self.readers = readers
        self.out: list[ir.Node] = []
        self.cut = cut
        self.pieces: dict[tuple[str, int], dict[int, ir.Value]] = {}  # (value, axis) -> pieces
        self.constants: dict[tuple, object] = {}
        self.sizes = None  # the Split's sizes input, once made
        self.merged: dict[str, ir.Value] = {}  # run output -> the new value taking its name
        self.shared = shared  # every run's merged micro-tensors, for the runs written after it

    def _add(self, node: ir.Node, reason: str) -> ir.Node:
        node.metadata_props[PASS_KEY] = PASS_NAME
        node.metadata_props[REASON_KEY] = reason
        self.out.append(node)
        return node

    def _node(self, op_type: str, inputs, outputs: list[str], name: str, reason: str, **attributes) -> list[ir.Value]:
        """A new standard-op node (its outputs named ``outputs``); returns its output values."""
        values = [ir.Value(name=n) for n in outputs]
        attrs = [ir.convenience.convert_attribute(k, v) for k, v in sorted(attributes.items())]
        self._add(ir.Node("", op_type, inputs, attrs, outputs=values, name=name), reason)
        return values

    def _constant(self, name: str, array: np.ndarray, reason: str) -> ir.Value:
        value = ir.Value(name=name)
        attr = ir.Attr("value", ir.AttributeType.TENSOR, ir.tensor(array, name=name))
        self._add(ir.Node("", "Constant", [], [attr], outputs=[value], name=name), reason)
        return value

    def _piece(self, value: ir.Value, axis: int, i: int) -> ir.Value:
        """Piece ``i`` of an input read from outside the run, cut on first request."""
        name = value.name
        pieces = self.pieces.setdefault((name, axis), {})
        if i in pieces:
            return pieces[i]
        parts, sizes = self.item.run.parts, self.item.sizes
        made = self.shared.get(name, axis, tuple(sizes))
        if made is not None:  # an earlier run's micro-tensors, cut as this run cuts them
            pieces.update(enumerate(made))
            return pieces[i]
        if self.cut is Cut.SPLIT:
            if self.sizes is None:
                self.sizes = self._constant(f"split_sizes{self.tag}", np.asarray(sizes, np.int64),
                                            "piece sizes of the split")
            names = [f"{name}{self.tag}_a{axis}_{k}" for k in range(parts)]
            pieces.update(enumerate(self._node("Split", [value, self.sizes], names, f"{name}{self.tag}_split",
                                               f"cut {name} into {parts} pieces on axis {axis}", axis=axis)))
            return pieces[i]
        start, end = self._bounds(i)
        if (axis, "axes") not in self.constants:
            self.constants[(axis, "axes")] = self._constant(f"axis{self.tag}_a{axis}", np.asarray([axis], np.int64),
                                                            "axis of the split")
        axes = self.constants[(axis, "axes")]
        piece = f"{name}{self.tag}_a{axis}_{i}"
        pieces[i], = self._node("Slice", [value, start, end, axes], [piece], f"{piece}_slice",
                                f"piece {i} of {parts} of {name} on axis {axis}")
        return pieces[i]

    def _bounds(self, i: int) -> tuple[ir.Value, ir.Value]:
        """Constants holding the start and end of piece ``i`` (shared by every sliced input)."""
        if ("bounds", i) not in self.constants:
            start = sum(self.item.sizes[:i])
            self.constants[("bounds", i)] = (
                self._constant(f"start{self.tag}_{i}", np.asarray([start], np.int64), f"start of piece {i}"),
                self._constant(f"end{self.tag}_{i}", np.asarray([start + self.item.sizes[i]], np.int64),
                               f"end of piece {i}"),
            )
        return self.constants[("bounds", i)]

    def write(self) -> list[ir.Node]:
        run, parts = self.item.run, self.item.run.parts
        in_run = set(run.nodes)
        micro: dict[tuple[int, str], list[ir.Value]] = {}  # (run position, output) -> micro-outputs
        accumulators: dict[str, ir.Value] = {}
        for i in range(parts):
            for position, (index, option) in enumerate(zip(run.nodes, self.item.options)):
                source = self.nodes[index]
                self.out.append(self._micro_op(index, position, option, i, micro))
                for name, merge in zip(_names(source.outputs), option.outputs):
                    if name and merge.kind == SUM and i:
                        self._accumulate(name, merge, micro[(position, name)], i, accumulators)
        for position, (index, option) in enumerate(zip(run.nodes, self.item.options)):
            for name, merge in zip(_names(self.nodes[index].outputs), option.outputs):
                if name and merge.kind == CONCAT and self._needed_outside(name, in_run):
                    self.merged[name], = self._node("Concat", micro[(position, name)], [name], f"{name}{self.tag}_concat",
                                                    f"merge {parts} micro-tensors of {name} on axis {merge.axis}",
                                                    axis=merge.axis)
                    self.shared.add(name, merge.axis, tuple(self.item.sizes), micro[(position, name)], self.out[-1])
                elif name and merge.kind == STAGED and self._needed_outside(name, in_run):
                    self._reduce_stages(name, merge, micro[(position, name)])
        return self.out

    def _reduce_stages(self, name: str, merge: Merge, micros: list[ir.Value]) -> None:
        """The second stage of a staged reduction: the partial reductions (the split axis
        kept, every other reduced axis 1) concatenated, then summed over the op's axes."""
        rows, = self._node("Concat", micros, [f"{name}{self.tag}_rows"], f"{name}{self.tag}_rows",
                           f"merge the partial reductions of {name} on axis {merge.axis}", axis=merge.axis)
        axes = self._constant(f"{name}{self.tag}_axes", np.asarray(merge.reduce_axes, np.int64), f"axes of {name}")
        target = name if merge.divisor is None else f"{name}{self.tag}_sum"
        self.merged[name], = self._node("ReduceSum", [rows, axes], [target], f"{name}{self.tag}_reduce",
                                        f"reduce the partial reductions of {name}", keepdims=merge.keepdims)
        if merge.divisor is not None:
            count = self._constant(f"{name}{self.tag}_count", np.asarray(merge.divisor, self.infos[name].dtype),
                                   f"elements averaged in {name}")
            self.merged[name], = self._node("Div", [self.merged[name], count], [name], f"{name}{self.tag}_mean",
                                            f"divide the sum of {name} by the count")

    def _micro_op(self, index: int, position: int, option: SplitOption, i: int, micro) -> ir.Node:
        """Micro-op ``i`` of run node ``index`` (its pieces and shape constants made first)."""
        source, sizes, parts = self.nodes[index], self.item.sizes, self.item.run.parts
        attributes = {name: copy_attribute(a) for name, a in source.attributes.items()}
        for attr_name, value in option.attributes:
            attributes.pop(attr_name, None)
            attributes[attr_name] = ir.convenience.convert_attribute(attr_name, value)
        inputs = list(source.inputs)
        for k, (value, part) in enumerate(zip(source.inputs, option.inputs)):
            if value is None or isinstance(part, Whole):
                continue
            name = value.name
            if isinstance(part, SliceOn):
                produced = next((micro[(p, name)] for p in range(position) if (p, name) in micro), None)
                inputs[k] = produced[i] if produced else self._piece(value, part.axis, i)
            elif isinstance(part, MicroShape):
                shape = list(part.shape)
                shape[part.axis] = sizes[i]
                inputs[k] = self._constant(f"{name}{self.tag}_p{position}_{i}", np.asarray(shape, np.int64),
                                           f"shape of micro-op {i}")
            elif isinstance(part, Carry) and i:
                inputs[k] = micro[(position, source.outputs[part.output].name)][i - 1]
            elif isinstance(part, AxesInput):
                if ("axes", position) not in self.constants:
                    self.constants[("axes", position)] = self._constant(
                        f"{name}{self.tag}_p{position}_axes", np.asarray(part.axes, np.int64), "axes of the micro-ops")
                inputs[k] = self.constants[("axes", position)]
        outputs = [ir.Value(name=v.name) for v in source.outputs]  # (beyond the option's outputs: as they were)
        for k, (value, merge) in enumerate(zip(source.outputs, option.outputs)):
            if value.name:
                micro_name = value.name if merge.kind == CHAIN and i == parts - 1 else f"{value.name}{self.tag}_{i}"
                outputs[k] = ir.Value(name=micro_name)
                micro.setdefault((position, value.name), []).append(outputs[k])
                if micro_name == value.name:
                    self.merged[value.name] = outputs[k]
        node = copy_node(source, inputs=inputs, outputs=outputs, name=f"{source.name or f'{source.op_type}{index}'}{self.tag}_{i}",
                         op_type=option.op_type, attributes=list(attributes.values()))
        node.metadata_props[PASS_KEY] = PASS_NAME
        node.metadata_props[SOURCE_KEY] = source.name or f"#{index}"
        return node

    def _accumulate(self, name: str, merge: Merge, micros: list[ir.Value], i: int,
                    accumulators: dict[str, ir.Value]) -> None:
        """Add micro-output ``i`` to the running sum of ``name`` (micro-output 0 starts it)."""
        last = i == self.item.run.parts - 1
        previous = accumulators.get(name, micros[0])
        target = name if last and merge.scale is None else f"{name}{self.tag}_acc{i}"
        accumulators[name], = self._node("Add", [previous, micros[i]], [target], f"{name}{self.tag}_add{i}",
                                         f"sum the partial results of {name}")
        if target == name:
            self.merged[name] = accumulators[name]
        if last and merge.scale is not None:
            dtype = self.infos[name].dtype
            scale = self._constant(f"{name}{self.tag}_scale", np.asarray(merge.scale, dtype), f"mean of {name}")
            self.merged[name], = self._node("Mul", [accumulators[name], scale], [name], f"{name}{self.tag}_mean",
                                            f"scale the sum of {name} to a mean")

    def _needed_outside(self, name: str, in_run: set[int]) -> bool:
        return name in self.graph_outputs or bool(self.readers.get(name, set()) - in_run)


class SplitPass(onnx_ir.passes.InPlacePass):
    """Write ``plan`` (runs of this graph's nodes) into the graph; ``infos`` are the shapes."""

    def __init__(self, plan: SplitPlan, infos: Mapping[str, TensorInfo], *, cut: Cut = DEFAULT_CUT) -> None:
        super().__init__()
        self.plan = plan
        self.infos = infos
        self.cut = cut
        self.micro_ops = 0
        self._originals: list[str] = []

    def requires(self, model: ir.Model) -> None:
        try:
            resolve_plan(model.graph, self.plan, self.infos)
        except UnsplittableOpError as e:
            raise onnx_ir.passes.PreconditionError(str(e)) from e
        nodes = list(model.graph)
        self._originals = [o for r in self.plan.runs for i in r.nodes for o in output_names(nodes[i])]

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        self.micro_ops = split_in_place(model.graph, self.plan, self.infos, cut=self.cut)
        return onnx_ir.passes.PassResult(model, modified=self.micro_ops > 0)

    def ensures(self, model: ir.Model) -> None:
        graph = model.graph
        try:
            check_topological(graph)
        except ValueError as e:
            raise onnx_ir.passes.PostconditionError(str(e)) from e
        produced = available_values(graph) | {v for node in graph for v in node.outputs}
        missing = [v.name for v in graph.outputs if v not in produced]
        if missing:
            raise onnx_ir.passes.PostconditionError(f"graph outputs {missing} are no longer produced")
        originals = set(self._originals)
        left = [n.name for n in graph if not carries(n, PASS_KEY, PASS_NAME) and originals & set(output_names(n))]
        if left:
            raise onnx_ir.passes.PostconditionError(f"split nodes {left[:3]} are still in the graph")


__all__ = ["Cut", "DEFAULT_CUT", "SplitPass", "SplitPlan", "SplitRun", "resolve_plan", "split_in_place", "write_split_plan"]
