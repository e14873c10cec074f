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
  by the scale for means); for chain splits the last micro-op writes the output itself.

Merged outputs keep their names, so consumers and graph outputs are untouched. The new nodes
stand where the run's last node stood, and the graph is then re-sorted stably (a node that read
an early run output before the run ended moves behind the merge). Every inserted node carries
``ort_offload.pass`` = ``split``; micro-ops also ``ort_offload.splits`` = the original node,
the others ``ort_offload.reason``.

Piece bounds and per-micro-op shapes are constants: the rewritten graph is specialized to the
input signature ``infos`` describe (plans are made per signature, as Mimose's are per input size).

``requires``: every run node has a split rule with the requested axis; ``p`` fits the split
dimension; runs are disjoint and each later node of a run reads an earlier one's output only
as micro-tensors (Concat axis of the producer = slice axis of the consumer). ``ensures``: the
graph is topologically sorted, every graph output is produced, and no original run node is left.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import logging
from typing import Mapping

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx_ir as ir
import onnx_ir.passes

from graph_passes.ir.liveness import check_topological, consumed_names
from graph_passes.ir.provenance import PASS_KEY, REASON_KEY, SPLIT_PASS, SPLIT_SOURCE_KEY
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.split.rules import (
    CHAIN, CONCAT, SUM, Carry, Merge, MicroShape, NodeInfo, SliceOn, SplitAxis, SplitOption, UnsplittableOpError, Whole,
    chunk_sizes, constant_values, find_option,
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


def resolve_plan(model: onnx.ModelProto, plan: SplitPlan, infos: Mapping[str, TensorInfo]) -> tuple[_Resolved, ...]:
    """Each run with its nodes' split options; raises :class:`UnsplittableOpError` when the
    plan does not fit the graph (see the module docstring)."""
    nodes = list(model.graph.node)
    constants = constant_values(model)
    seen: set[int] = set()
    resolved = []
    for run in plan.runs:
        if seen & set(run.nodes) or len(set(run.nodes)) != len(run.nodes):
            raise UnsplittableOpError(f"split runs overlap at nodes {sorted(seen & set(run.nodes)) or run.nodes}")
        seen.update(run.nodes)
        if any(not 0 <= i < len(nodes) for i in run.nodes):
            raise UnsplittableOpError(f"split run names nodes {run.nodes} outside the graph")
        options = []
        run_outputs = {o for i in run.nodes for o in nodes[i].output if o}
        produced: dict[str, Merge] = {}  # run output -> how it merges
        extent = None
        for position, (index, key) in enumerate(zip(run.nodes, run.axes)):
            node = nodes[index]
            option = find_option(NodeInfo.of(node, infos, constants), key)
            extent = option.extent if extent is None else extent
            if option.extent != extent:
                raise UnsplittableOpError(
                    f"run node {_label(node, index)} splits a dimension of {option.extent}, the run's first {extent}")
            _check_extents(node, index, option, infos)
            chained = False
            for name, part in zip(node.input, option.inputs):
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
            for name, merge in zip(node.output, option.outputs):
                if name:
                    produced[name] = merge
            options.append(option)
        resolved.append(_Resolved(run, tuple(options), chunk_sizes(extent, run.parts)))
    return tuple(resolved)


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"#{index} ({node.op_type} {node.name!r})"


def _check_extents(node: onnx.NodeProto, index: int, option: SplitOption, infos: Mapping[str, TensorInfo]) -> None:
    """Every sliced input and concatenated output has the split extent on its axis."""
    pairs = [(n, p.axis) for n, p in zip(node.input, option.inputs) if isinstance(p, SliceOn)]
    pairs += [(n, m.axis) for n, m in zip(node.output, option.outputs) if n and m.kind == CONCAT]
    for name, axis in pairs:
        if infos[name].shape[axis] != option.extent:
            raise UnsplittableOpError(
                f"{_label(node, index)}: {name!r} has {infos[name].shape[axis]} on axis {axis}, the split {option.extent}")


def write_split_plan(model: onnx.ModelProto, plan: SplitPlan, infos: Mapping[str, TensorInfo], *,
                     cut: Cut = DEFAULT_CUT) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the plan applied; returns it and the number of micro-ops."""
    resolved = resolve_plan(model, plan, infos)
    nodes = list(model.graph.node)
    graph_outputs = {o.name for o in model.graph.output}
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(nodes):
        for name in consumed_names(node):
            readers.setdefault(name, set()).add(index)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # last run node -> the run's new nodes
    removed: set[int] = set()
    micro_ops = 0
    for number, item in enumerate(resolved):
        group = _GroupWriter(number, item, nodes, infos, graph_outputs, readers, cut=cut)
        replaced[item.run.nodes[-1]] = group.write()
        removed.update(item.run.nodes)
        micro_ops += item.run.parts * len(item.run.nodes)
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(nodes):
        if index in replaced:
            new_nodes.extend(replaced[index])
        elif index not in removed:
            new_nodes.append(node)
    available = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    new_nodes = _stable_topological(new_nodes, available)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(new_nodes)
    check_topological(list(result.graph.node), available)
    logger.info("split %d nodes into %d micro-ops", plan.split_nodes, micro_ops)
    return result, micro_ops


class _GroupWriter:
    """The nodes replacing one run."""

    def __init__(self, number, item: _Resolved, nodes, infos, graph_outputs, readers, *, cut: Cut) -> None:
        self.tag = f"__sp{number}"
        self.item = item
        self.nodes = nodes
        self.infos = infos
        self.graph_outputs = graph_outputs
        self.readers = readers
        self.out: list[onnx.NodeProto] = []
        self.cut = cut
        self.pieces: dict[tuple[str, int], dict[int, str]] = {}  # (value, axis) -> piece names
        self.constants: dict[tuple, object] = {}
        self.sizes_name = None

    def _add(self, node: onnx.NodeProto, reason: str) -> None:
        node.metadata_props.add(key=PASS_KEY, value=PASS_NAME)
        node.metadata_props.add(key=REASON_KEY, value=reason)
        self.out.append(node)

    def _constant(self, name: str, array: np.ndarray, reason: str) -> str:
        self._add(onnx.helper.make_node("Constant", [], [name], name=name,
                                        value=onnx.numpy_helper.from_array(array, name)), reason)
        return name

    def _piece(self, name: str, axis: int, i: int) -> str:
        """Piece ``i`` of an input read from outside the run, cut on first request."""
        key = (name, axis)
        pieces = self.pieces.setdefault(key, {})
        if i in pieces:
            return pieces[i]
        parts, sizes = self.item.run.parts, self.item.sizes
        if self.cut is Cut.SPLIT:
            if self.sizes_name is None:
                self.sizes_name = self._constant(f"split_sizes{self.tag}", np.asarray(sizes, np.int64),
                                                 "piece sizes of the split")
            names = [f"{name}{self.tag}_a{axis}_{k}" for k in range(parts)]
            self._add(onnx.helper.make_node("Split", [name, self.sizes_name], names, name=f"{name}{self.tag}_split",
                                            axis=axis), f"cut {name} into {parts} pieces on axis {axis}")
            pieces.update(enumerate(names))
            return pieces[i]
        bounds = self._bounds(i)
        if (axis, "axes") not in self.constants:
            self.constants[(axis, "axes")] = self._constant(f"axis{self.tag}_a{axis}", np.asarray([axis], np.int64),
                                                            "axis of the split")
        axes = self.constants[(axis, "axes")]
        pieces[i] = f"{name}{self.tag}_a{axis}_{i}"
        self._add(onnx.helper.make_node("Slice", [name, *bounds, axes], [pieces[i]], name=f"{pieces[i]}_slice"),
                  f"piece {i} of {parts} of {name} on axis {axis}")
        return pieces[i]

    def _bounds(self, i: int) -> tuple[str, str]:
        """Constants holding the start and end of piece ``i`` (shared by every sliced input)."""
        if ("bounds", i) not in self.constants:
            start = sum(self.item.sizes[:i])
            self.constants[("bounds", i)] = (
                self._constant(f"start{self.tag}_{i}", np.asarray([start], np.int64), f"start of piece {i}"),
                self._constant(f"end{self.tag}_{i}", np.asarray([start + self.item.sizes[i]], np.int64),
                               f"end of piece {i}"),
            )
        return self.constants[("bounds", i)]

    def write(self) -> list[onnx.NodeProto]:
        run, parts, sizes = self.item.run, self.item.run.parts, self.item.sizes
        in_run = set(run.nodes)
        micro: dict[tuple[int, str], list[str]] = {}  # (run position, output) -> micro-outputs
        accumulators: dict[str, str] = {}
        for i in range(parts):
            for position, (index, option) in enumerate(zip(run.nodes, self.item.options)):
                source = self.nodes[index]
                node = onnx.NodeProto()
                node.CopyFrom(source)
                node.name = f"{source.name or f'{source.op_type}{index}'}{self.tag}_{i}"
                if option.op_type:
                    node.op_type = option.op_type
                for attr_name, value in option.attributes:
                    kept = [a for a in node.attribute if a.name != attr_name]
                    del node.attribute[:]
                    node.attribute.extend(kept)
                    node.attribute.append(onnx.helper.make_attribute(attr_name, value))
                for k, (name, part) in enumerate(zip(source.input, option.inputs)):
                    if not name or isinstance(part, Whole):
                        continue
                    if isinstance(part, SliceOn):
                        produced = next((micro[(p, name)] for p in range(position) if (p, name) in micro), None)
                        node.input[k] = produced[i] if produced else self._piece(name, part.axis, i)
                    elif isinstance(part, MicroShape):
                        shape = list(part.shape)
                        shape[part.axis] = sizes[i]
                        node.input[k] = self._constant(f"{name}{self.tag}_p{position}_{i}", np.asarray(shape, np.int64),
                                                       f"shape of micro-op {i}")
                    elif isinstance(part, Carry):
                        if i:
                            node.input[k] = micro[(position, source.output[part.output])][i - 1]
                for k, (name, merge) in enumerate(zip(source.output, option.outputs)):
                    if not name:
                        continue
                    micro_name = name if merge.kind == CHAIN and i == parts - 1 else f"{name}{self.tag}_{i}"
                    node.output[k] = micro_name
                    micro.setdefault((position, name), []).append(micro_name)
                node.metadata_props.add(key=PASS_KEY, value=PASS_NAME)
                node.metadata_props.add(key=SOURCE_KEY, value=source.name or f"#{index}")
                self.out.append(node)
                for name, merge in zip(source.output, option.outputs):
                    if name and merge.kind == SUM and i:
                        self._accumulate(name, merge, micro[(position, name)], i, accumulators)
        for position, (index, option) in enumerate(zip(run.nodes, self.item.options)):
            for name, merge in zip(self.nodes[index].output, option.outputs):
                if name and merge.kind == CONCAT and self._needed_outside(name, in_run):
                    self._add(onnx.helper.make_node("Concat", micro[(position, name)], [name],
                                                    name=f"{name}{self.tag}_concat", axis=merge.axis),
                              f"merge {parts} micro-tensors of {name} on axis {merge.axis}")
        return self.out

    def _accumulate(self, name: str, merge: Merge, micros: list[str], i: int, accumulators: dict[str, str]) -> None:
        """Add micro-output ``i`` to the running sum of ``name`` (micro-output 0 starts it)."""
        last = i == self.item.run.parts - 1
        previous = accumulators.get(name, micros[0])
        target = name if last and merge.scale is None else f"{name}{self.tag}_acc{i}"
        self._add(onnx.helper.make_node("Add", [previous, micros[i]], [target], name=f"{target}_add"),
                  f"sum the partial results of {name}")
        accumulators[name] = target
        if last and merge.scale is not None:
            dtype = self.infos[name].dtype
            scale = self._constant(f"{name}{self.tag}_scale", np.asarray(merge.scale, dtype), f"mean of {name}")
            self._add(onnx.helper.make_node("Mul", [target, scale], [name], name=f"{name}{self.tag}_mean"),
                      f"scale the sum of {name} to a mean")

    def _needed_outside(self, name: str, in_run: set[int]) -> bool:
        return name in self.graph_outputs or bool(self.readers.get(name, set()) - in_run)


def _stable_topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """A topological order that keeps the given order wherever it is already valid."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in set(consumed_names(node)):
            if name in producer and name not in available and producer[name] != k:
                waiting[k] += 1
                dependents.setdefault(producer[name], []).append(k)
    ready = [k for k in range(len(nodes)) if not waiting[k]]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for d in dependents.get(k, ()):
            waiting[d] -= 1
            if not waiting[d]:
                heapq.heappush(ready, d)
    if len(order) != len(nodes):
        raise UnsplittableOpError("the split left a cycle in the graph")
    return order


def _is_split_node(node: onnx.NodeProto) -> bool:
    return any(p.key == PASS_KEY and p.value == PASS_NAME for p in node.metadata_props)


class SplitPass(onnx_ir.passes.FunctionalPass):
    """Write ``plan`` (runs of this graph's nodes) into the graph; ``infos`` are the shapes."""

    def __init__(self, plan: SplitPlan, infos: Mapping[str, TensorInfo], *, cut: Cut = DEFAULT_CUT) -> None:
        super().__init__()
        self.plan = plan
        self.infos = infos
        self.cut = cut
        self.micro_ops = 0
        self._originals: list[str] = []

    def requires(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        try:
            resolve_plan(proto, self.plan, self.infos)
        except UnsplittableOpError as e:
            raise onnx_ir.passes.PreconditionError(str(e)) from e
        self._originals = [o for r in self.plan.runs for i in r.nodes for o in proto.graph.node[i].output if o]

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        proto, self.micro_ops = write_split_plan(ir.to_proto(model), self.plan, self.infos, cut=self.cut)
        return onnx_ir.passes.PassResult(ir.from_proto(proto), modified=self.micro_ops > 0)

    def ensures(self, model: ir.Model) -> None:
        proto = ir.to_proto(model)
        available = {i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer}
        try:
            check_topological(list(proto.graph.node), available)
        except ValueError as e:
            raise onnx_ir.passes.PostconditionError(str(e)) from e
        produced = available | {o for n in proto.graph.node for o in n.output}
        missing = [o.name for o in proto.graph.output if o.name not in produced]
        if missing:
            raise onnx_ir.passes.PostconditionError(f"graph outputs {missing} are no longer produced")
        originals = set(self._originals)
        left = [n.name for n in proto.graph.node if not _is_split_node(n) and originals & set(n.output)]
        if left:
            raise onnx_ir.passes.PostconditionError(f"split nodes {left[:3]} are still in the graph")


__all__ = ["Cut", "DEFAULT_CUT", "SplitPass", "SplitPlan", "SplitRun", "resolve_plan", "write_split_plan"]
