"""Liveness of values over a schedule of nodes.

A value is born at its producer's position (graph inputs and state before position 0) and dies
after its last consumer; graph outputs live to the end of the step. Positions are indices into
the schedule (a topological order of the graph's nodes).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import onnx

INPUT_POSITION = -1


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """``birth``: producer position (-1 for inputs); ``last_use``: last consumer position
    (``len(schedule)`` for graph outputs, ``birth`` for values nobody reads)."""

    name: str
    birth: int
    last_use: int


def check_topological(nodes: Sequence[onnx.NodeProto], available: set[str]) -> None:
    """Raise ValueError when a node reads a value produced later (or never)."""
    seen = set(available)
    for index, node in enumerate(nodes):
        for name in node.input:
            if name and name not in seen:
                raise ValueError(f"node {index} ({node.op_type} {node.name!r}) reads {name!r} before it is produced")
        seen.update(o for o in node.output if o)


def lifetimes(graph: onnx.GraphProto, schedule: Sequence[int] | None = None) -> dict[str, Lifetime]:
    """Lifetime of every graph input and node output (initializers excluded)."""
    nodes = list(graph.node)
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    initializers = {t.name for t in graph.initializer}
    birth: dict[str, int] = {v.name: INPUT_POSITION for v in graph.input if v.name not in initializers}
    last: dict[str, int] = dict(birth)
    for position, node_index in enumerate(order):
        node = nodes[node_index]
        for name in _consumed(node):
            if name in birth:
                last[name] = position
        for name in node.output:
            if name:
                birth[name] = position
                last.setdefault(name, position)
    end = len(order)
    for out in graph.output:
        if out.name in birth:
            last[out.name] = end
    return {n: Lifetime(n, birth[n], max(last[n], birth[n])) for n in birth}


def _consumed(node: onnx.NodeProto) -> list[str]:
    """Inputs of a node, including values captured by its subgraphs (If/Loop/Scan bodies)."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for sub in list(attr.g.node if attr.HasField("g") else []) + [n for g in attr.graphs for n in g.node]:
            names.extend(_consumed(sub))
    return names


def consumed_names(node: onnx.NodeProto) -> list[str]:
    return _consumed(node)


def ancestor_nodes(nodes: Sequence[onnx.NodeProto], names, producer: dict[str, int] | None = None) -> set[int]:
    """Indices of the nodes among ``nodes`` that the values ``names`` depend on (their producers,
    transitively). ``producer``: value name -> node index, when the caller has it already."""
    if producer is None:
        producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    found: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        index = stack.pop()
        if index in found:
            continue
        found.add(index)
        stack.extend(producer[n] for n in consumed_names(nodes[index]) if n in producer)
    return found
