"""Editing an ``onnx_ir`` graph in place: what the rewrite passes share.

The passes rewrite an :class:`onnx_ir.Model` node by node (no protobuf inside them); these are
the graph-wide pieces they all need: what a node reads (subgraphs included, as
:func:`graph_passes.ir.liveness.consumed_names` reads a proto), the check that the node order is
topological, a stable topological order, putting the graph's nodes in a given order, and copies
of nodes' attributes and values' types.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator, Sequence

import onnx_ir as ir

_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def read_values(node: ir.Node) -> list[ir.Value]:
    """The node's inputs and what the nodes of its subgraphs (If/Loop/Scan bodies) read."""
    values = [v for v in node.inputs if v is not None]
    for graph in _subgraphs(node):
        for sub in graph:
            values.extend(read_values(sub))
    return values


def read_names(node: ir.Node) -> list[str]:
    """Names of :func:`read_values` (empty names skipped)."""
    return [v.name for v in read_values(node) if v.name]


def output_names(node: ir.Node) -> list[str]:
    return [v.name for v in node.outputs if v.name]


def available_values(graph: ir.Graph) -> set[ir.Value]:
    """What every node may read without a producer: the graph's inputs and initializers."""
    return set(graph.inputs) | set(graph.initializers.values())


def ancestor_indices(nodes: Sequence[ir.Node], values: Iterable[ir.Value]) -> set[int]:
    """Indices of the nodes among ``nodes`` that ``values`` depend on (their producers, transitively)."""
    position = {node: k for k, node in enumerate(nodes)}
    found: set[int] = set()
    stack = [position[v.producer()] for v in values if v.producer() in position]
    while stack:
        index = stack.pop()
        if index in found:
            continue
        found.add(index)
        stack.extend(position[v.producer()] for v in read_values(nodes[index]) if v.producer() in position)
    return found


def check_topological(graph: ir.Graph) -> None:
    """Raise ValueError when a node reads a value produced later in the graph (or never)."""
    seen = available_values(graph)
    for index, node in enumerate(graph):
        for value in node.inputs:
            if value is not None and value not in seen:
                raise ValueError(f"node {index} ({node.op_type} {node.name!r}) reads {value.name!r} before it is produced")
        seen.update(node.outputs)


def stable_topological(nodes: Sequence[ir.Node], available: set[ir.Value]) -> list[ir.Node] | None:
    """A topological order of ``nodes`` that keeps the given order wherever it is already valid
    (of the nodes ready, the earliest goes first); None where they form a cycle."""
    position = {node: k for k, node in enumerate(nodes)}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = {}
    for k, node in enumerate(nodes):
        for value in set(read_values(node)):
            producer = value.producer()
            source = position.get(producer) if producer is not None else None
            if source is not None and value not in available and source != k:
                waiting[k] += 1
                dependents.setdefault(source, []).append(k)
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
    return order if len(order) == len(nodes) else None


def set_order(graph: ir.Graph, nodes: Iterable[ir.Node]) -> None:
    """Make ``nodes`` (the graph's own, and new ones) the graph's nodes, in this order. Nodes
    left out are dropped; their inputs still list them as users (callers leave out none)."""
    graph.remove(list(graph))
    graph.extend(nodes)


def copy_attribute(attr: ir.Attr) -> ir.Attr:
    """An attribute for another node: subgraphs are cloned (a graph belongs to one node) and
    keep reading the outer values they read; other values are shared (immutable)."""
    value = attr.value
    if attr.type == ir.AttributeType.GRAPH:
        value = value.clone(allow_outer_scope_values=True)
    elif attr.type == ir.AttributeType.GRAPHS:
        value = [g.clone(allow_outer_scope_values=True) for g in value]
    return ir.Attr(attr.name, attr.type, value, attr.ref_attr_name, doc_string=attr.doc_string)


def copy_node(source: ir.Node, *, inputs: Sequence[ir.Value | None], outputs: Sequence[ir.Value], name: str,
              op_type: str | None = None, attributes: Sequence[ir.Attr] | None = None) -> ir.Node:
    """A new node doing what ``source`` does (domain, attributes, metadata, doc string) on other
    values; ``op_type``/``attributes``: replacements."""
    return ir.Node(
        source.domain, op_type or source.op_type, inputs,
        [copy_attribute(a) for a in source.attributes.values()] if attributes is None else attributes,
        overload=source.overload, outputs=outputs, version=source.version, name=name,
        doc_string=source.doc_string, metadata_props=dict(source.metadata_props),
    )


def move_annotations(source: ir.Value, target: ir.Value) -> None:
    """``target`` gets ``source``'s type, shape, doc string and metadata (what a value info or
    graph output holds), and ``source`` none (so it gets no value info of its own)."""
    target.type, target.shape, target.doc_string = source.type, source.shape, source.doc_string
    target.metadata_props.update(source.metadata_props)
    source.type = source.shape = source.doc_string = None
    source.metadata_props.clear()


def take_over(original: ir.Value, replacement: ir.Value) -> None:
    """``replacement`` becomes ``original``: its readers, its graph-output places, and its
    annotations (the graph's value infos hold them under the same name)."""
    move_annotations(original, replacement)
    original.replace_all_uses_with(replacement, replace_graph_outputs=True)


def carries(node: ir.Node, key: str, value: str) -> bool:
    """Whether the node's metadata has ``key`` = ``value`` (a pass's provenance mark)."""
    return node.metadata_props.get(key) == value


__all__ = [
    "ancestor_indices", "available_values", "carries", "check_topological", "copy_attribute", "copy_node",
    "move_annotations", "output_names", "read_names", "read_values", "set_order", "stable_topological", "take_over",
]
