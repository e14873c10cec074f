"""Liveness of values over a schedule of nodes.

A value is born at its producer's position (graph inputs and state before position 0) and dies
after its last consumer; graph outputs live to the end of the step. Positions are indices into
the schedule (a topological order of the graph's nodes).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import onnx

INPUT_POSITION = -1


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """``birth``: producer position (-1 for inputs); ``last_use``: last consumer position
    (``len(schedule)`` for graph outputs, ``birth`` for values nobody reads)."""

    name: str
    birth: int
    last_use: int


class NodeIO(NamedTuple):
    """A node's value names, read once from its proto: ``inputs`` (its own, non-empty),
    ``reads`` (those plus what its subgraphs read, see :func:`consumed_names`), ``outputs``
    (non-empty). A lowering walks every node several times; protobuf field access per walk
    cost more than the walks themselves."""

    inputs: tuple[str, ...]
    reads: tuple[str, ...]
    outputs: tuple[str, ...]


def node_io(nodes: Sequence[onnx.NodeProto]) -> list[NodeIO]:
    """:class:`NodeIO` of each node, in the same order."""
    table = []
    for node in nodes:
        inputs = tuple(n for n in node.input if n)
        reads = tuple(_consumed(node)) if len(node.attribute) and _has_subgraph(node) else inputs
        table.append(NodeIO(inputs, reads, tuple(o for o in node.output if o)))
    return table


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.HasField("g") or len(attr.graphs) for attr in node.attribute)


def check_topological(nodes: Sequence[onnx.NodeProto], available: set[str], io: Sequence[NodeIO] | None = None) -> None:
    """Raise ValueError when a node reads a value produced later (or never). ``io``: the
    nodes' :func:`node_io`, when the caller has it."""
    seen = set(available)
    for index, entry in enumerate(io if io is not None else node_io(nodes)):
        for name in entry.inputs:
            if name not in seen:
                node = nodes[index]
                raise ValueError(f"node {index} ({node.op_type} {node.name!r}) reads {name!r} before it is produced")
        seen.update(entry.outputs)


def lifetimes(graph: onnx.GraphProto, schedule: Sequence[int] | None = None,
              io: Sequence[NodeIO] | None = None) -> dict[str, Lifetime]:
    """Lifetime of every graph input and node output (initializers excluded). ``io``: the
    graph's nodes' :func:`node_io` (same indices), when the caller has it."""
    birth, last = positions(graph, schedule, io)
    return {n: Lifetime(n, b, last[n]) for n, b in birth.items()}


def positions(graph: onnx.GraphProto, schedule: Sequence[int] | None = None,
              io: Sequence[NodeIO] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`lifetimes` as two dicts, value -> birth and value -> last use (no objects made:
    for callers that lower a graph many times)."""
    if io is None:
        io = node_io(graph.node)
    order = list(range(len(io))) if schedule is None else list(schedule)
    initializers = {t.name for t in graph.initializer}
    birth: dict[str, int] = {v.name: INPUT_POSITION for v in graph.input if v.name not in initializers}
    last: dict[str, int] = dict(birth)
    for position, node_index in enumerate(order):
        entry = io[node_index]
        for name in entry.reads:
            if name in birth:
                last[name] = position
        for name in entry.outputs:
            birth[name] = position
            last.setdefault(name, position)
    end = len(order)
    for out in graph.output:
        if out.name in birth:
            last[out.name] = end
    for name, b in birth.items():
        if last[name] < b:
            last[name] = b
    return birth, last


def _consumed(node: onnx.NodeProto) -> list[str]:
    """Inputs of a node, including values captured by its subgraphs (If/Loop/Scan bodies)."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for sub in list(attr.g.node if attr.HasField("g") else []) + [n for g in attr.graphs for n in g.node]:
            names.extend(_consumed(sub))
    return names


def consumed_names(node: onnx.NodeProto) -> list[str]:
    return _consumed(node)


def ancestor_nodes(nodes: Sequence[onnx.NodeProto], names, producer: dict[str, int] | None = None,
                   io: Sequence[NodeIO] | None = None) -> set[int]:
    """Indices of the nodes among ``nodes`` that the values ``names`` depend on (their producers,
    transitively). ``producer``: value name -> node index, and ``io``: the nodes'
    :func:`node_io`, when the caller has them already."""
    if producer is None:
        producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    found: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        index = stack.pop()
        if index in found:
            continue
        found.add(index)
        reads = io[index].reads if io is not None else consumed_names(nodes[index])
        stack.extend(producer[n] for n in reads if n in producer)
    return found
