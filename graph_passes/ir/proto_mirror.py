"""An ``onnx_ir`` model kept beside the ``ModelProto`` it was read from, written back to protobuf
by serializing only what in-place edits touched.

The planner rewrites a graph many times (one candidate plan after another) and hands each result
to code that needs protobuf (shape inference, lowering, ONNX Runtime sessions). Serializing the
whole graph each time costs as much as the rewrite itself, so :meth:`ProtoMirror.to_proto` reuses
the source's ``NodeProto`` for every node whose fingerprint (op, name, inputs and outputs by
identity and name, attributes, metadata, output types and shapes) is the one it had when the
mirror was made, and serializes only new or changed nodes (and the graph's outputs, which passes
may hand to new values). Where the graph's inputs, initializers, functions or opsets changed, it
serializes everything (``ir.to_proto``).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir


def _value_key(value: ir.Value | None) -> tuple:
    if value is None:
        return (None,)
    shape = value.shape
    return (id(value), value.name, value.type, None if shape is None else tuple(shape.dims),
            len(value.metadata_props), value.doc_string, value.is_graph_output())


def node_fingerprint(node: ir.Node) -> tuple:
    """What the node's ``NodeProto`` and its outputs' ``value_info`` are made from."""
    return (node.op_type, node.domain, node.overload, node.name, node.doc_string,
            tuple((v.name if v is not None else "", id(v)) for v in node.inputs),
            tuple(_value_key(v) for v in node.outputs),
            tuple((name, id(attr)) for name, attr in node.attributes.items()),
            tuple(node.metadata_props.items()))


def _graph_frame(model: ir.Model) -> tuple:
    graph = model.graph
    return (tuple(id(v) for v in graph.inputs), tuple((name, id(v)) for name, v in graph.initializers.items()),
            tuple(model.functions), tuple(sorted(graph.opset_imports.items())),
            tuple(graph.metadata_props.items()), tuple(model.metadata_props.items()))


def _has_value_info(value: ir.Value) -> bool:
    """``ir.to_proto``'s rule for writing a ``ValueInfoProto`` of a node output."""
    described = value.shape is not None or value.type is not None or value.metadata_props or value.doc_string
    return bool(described and value.name)


class ProtoMirror:
    """``model`` (an ``ir.Model`` read from ``source``) for in-place edits; :meth:`to_proto`
    gives the edited graph as protobuf, equal node for node to ``ir.to_proto(model)``."""

    def __init__(self, source: onnx.ModelProto) -> None:
        self.source = source
        self.model = ir.from_proto(source)
        nodes = list(self.model.graph)
        if len(nodes) != len(source.graph.node):
            raise ValueError("the graph read from protobuf has a different number of nodes")
        self._protos = {id(node): proto for node, proto in zip(nodes, source.graph.node)}
        self._fingerprints = {id(node): node_fingerprint(node) for node in nodes}
        self._frame = _graph_frame(self.model)
        infos = {info.name: info for info in source.graph.value_info}
        made = {name for proto in source.graph.node for name in proto.output}
        self._prefix = [info for info in source.graph.value_info if info.name not in made]  # initializers'
        self._infos = {id(node): [infos[name] for name in proto.output if name in infos]
                       for node, proto in zip(nodes, source.graph.node)}

    def unchanged(self, node: ir.Node) -> bool:
        """Whether ``node`` is one of the source's nodes, exactly as it was read."""
        before = self._fingerprints.get(id(node))
        return before is not None and before == node_fingerprint(node)

    def to_proto(self) -> onnx.ModelProto:
        """The edited model as protobuf (a new message; the source is not changed), in the
        order ``ir.to_proto`` writes it: initializers' value infos, then each node's."""
        if _graph_frame(self.model) != self._frame:
            return ir.to_proto(self.model)
        nodes, infos = [], list(self._prefix)
        for node in self.model.graph:
            if self.unchanged(node):
                nodes.append(self._protos[id(node)])
                infos.extend(self._infos[id(node)])
                continue
            nodes.append(ir.serde.serialize_node(node))
            infos.extend(ir.serde.serialize_value(value) for value in node.outputs
                         if not value.is_graph_output() and _has_value_info(value))
        out = onnx.ModelProto()
        out.CopyFrom(self.source)
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        del out.graph.value_info[:]
        out.graph.value_info.extend(infos)
        del out.graph.output[:]
        out.graph.output.extend(ir.serde.serialize_value(value) for value in self.model.graph.outputs)
        return out


__all__ = ["ProtoMirror", "node_fingerprint"]
