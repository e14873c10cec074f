"""Reading swap nodes back: a graph that carries ``ai.ort_offload`` ``SwapOut``/``SwapIn``
nodes (written by :mod:`graph_passes.planning.swap.graph_pass`, e.g. by ``ort-offload transform``) becomes a
graph of standard ops plus the positions where the runtime must swap.

Every chain ``x -> SwapOut -> host -> SwapIn -> x'`` names one value; the standard nodes are
rewritten to use one canonical name per value (a graph output's own name where the chain ends
in one), and each swap node becomes a ``SwapOut``/``SwapIn`` program step at its position in
the node order. A ``SwapIn`` of a graph input that no ``SwapOut`` preceded marks state that
starts the step on the host.
"""

from __future__ import annotations

import dataclasses

import onnx

from custom_ops.registry import DOMAIN
from graph_passes.ir.program import SwapIn, SwapOut


@dataclasses.dataclass(frozen=True)
class SwapPoints:
    """Swap steps to run before canonical node ``position`` (``len(nodes)``: at the end)."""

    before: tuple[tuple[int, tuple[SwapOut | SwapIn, ...]], ...]
    host_state: tuple[str, ...]


def has_swap_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN and n.op_type in ("SwapOut", "SwapIn") for n in model.graph.node)


def canonicalize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, SwapPoints]:
    """The model without swap nodes, names made canonical, and where the swaps go."""
    graph = model.graph
    parent: dict[str, str] = {}  # alias -> the name it copies

    def root(name: str) -> str:
        while name in parent:
            name = parent[name]
        return name

    for node in graph.node:
        if node.domain == DOMAIN and node.op_type in ("SwapOut", "SwapIn"):
            parent[node.output[0]] = node.input[0]
    # A chain that ends in a graph output is named after that output (state pairs and fetches
    # refer to it); any other chain after the value it starts from.
    canonical: dict[str, str] = {}
    for out in graph.output:
        if out.name in parent:
            canonical[root(out.name)] = out.name

    def name_of(name: str) -> str:
        if not name:
            return name
        base = root(name)
        return canonical.get(base, base)

    inputs = {v.name for v in graph.input}
    nodes: list[onnx.NodeProto] = []
    before: dict[int, list] = {}
    swapped_out: set[str] = set()
    host_state: list[str] = []
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type in ("SwapOut", "SwapIn"):
            value = name_of(node.input[0])
            if node.op_type == "SwapOut":
                drop = any(p.key == "ort_offload.drop" and p.value == "1" for p in node.metadata_props)
                step = SwapOut(value, copy=not drop)
                swapped_out.add(value)
            else:
                step = SwapIn(value)
                if value in inputs and value not in swapped_out and value not in host_state:
                    host_state.append(value)
            before.setdefault(len(nodes), []).append(step)
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for k, name in enumerate(copy.input):
            copy.input[k] = name_of(name)
        for k, name in enumerate(copy.output):
            copy.output[k] = name_of(name)
        nodes.append(copy)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    del result.graph.value_info[:]
    used = {n.domain for n in nodes}
    if DOMAIN not in used:  # the op set and its function bodies are not needed any more
        kept = [o for o in result.opset_import if o.domain != DOMAIN]
        del result.opset_import[:]
        result.opset_import.extend(kept)
        kept_functions = [f for f in result.functions if f.domain != DOMAIN]
        del result.functions[:]
        result.functions.extend(kept_functions)
    points = SwapPoints(tuple((k, tuple(v)) for k, v in sorted(before.items())), tuple(host_state))
    return result, points
