"""ProtoMirror writes an edited ``onnx_ir`` graph back to protobuf serializing only the nodes the
edits touched: whatever the edit, the result is byte for byte ``ir.to_proto`` of the edited graph
(on a graph that ``onnx_ir`` wrote, as the exporter's are)."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from graph_passes.ir.proto_mirror import ProtoMirror
from helpers import step_graph_and_feeds


def _source() -> onnx.ModelProto:
    graph, _, _ = step_graph_and_feeds("gpt")
    return ir.to_proto(ir.from_proto(graph.model))


def _nodes(mirror: ProtoMirror) -> list[ir.Node]:
    return list(mirror.model.graph)


def _rewire(m):
    a, b = _nodes(m)[40], _nodes(m)[12]
    a.replace_input_with(0, b.outputs[0])


def _insert_clone(m):
    node = _nodes(m)[30]
    clone = ir.Node(node.domain, node.op_type, list(node.inputs), dict(node.attributes), name="clone",
                    num_outputs=len(node.outputs))
    clone.outputs[0].name = "clone_out"
    clone.outputs[0].shape, clone.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    clone.metadata_props["ort_offload.pass"] = "recompute"
    m.model.graph.insert_after(node, clone)


def _remove_a_node(m):
    node = next(n for n in _nodes(m) if len(n.outputs) == 1 and n.inputs and n.inputs[0] is not None
                and not n.outputs[0].is_graph_output())
    ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
    m.model.graph.remove(node, safe=True)


def _rename_a_value(m):
    _nodes(m)[20].outputs[0].name = "renamed"


def _new_attribute(m):
    node = next(n for n in _nodes(m) if n.attributes)
    name = next(iter(node.attributes))
    node.attributes[name] = ir.Attr(name, node.attributes[name].type, node.attributes[name].value)
    node.attributes["extra"] = ir.AttrInt64("extra", 3)


def _metadata(m):
    _nodes(m)[5].metadata_props["ort_offload.pass"] = "swap"


def _output_shape(m):
    value = next(v for n in _nodes(m) for v in n.outputs if v.shape is not None and len(v.shape) > 0
                 and not v.is_graph_output())
    value.shape = ir.Shape([7] + list(value.shape.dims[1:]))


def _graph_output(m):
    m.model.graph.outputs.append(_nodes(m)[10].outputs[0])


def _reorder(m):
    nodes = _nodes(m)
    last = nodes[-1]
    m.model.graph.remove(last)
    m.model.graph.insert_before(nodes[-2], last) if not any(v in nodes[-2].outputs for v in last.inputs) \
        else m.model.graph.append(last)


EDITS = {f.__name__.lstrip("_"): f for f in (_rewire, _insert_clone, _remove_a_node, _rename_a_value, _new_attribute,
                                                 _metadata, _output_shape, _graph_output, _reorder)}


@pytest.fixture(scope="module")
def source():
    return _source()


def test_an_unedited_graph_is_the_source(source):
    mirror = ProtoMirror(source)
    assert mirror.to_proto().SerializeToString() == source.SerializeToString()
    assert all(mirror.unchanged(n) for n in mirror.model.graph)


@pytest.mark.parametrize("edit", list(EDITS))
def test_every_kind_of_edit_is_written_as_a_full_conversion_writes_it(source, edit):
    mirror = ProtoMirror(source)
    EDITS[edit](mirror)
    got = mirror.to_proto()
    assert got.SerializeToString() == ir.to_proto(mirror.model).SerializeToString()
    assert source.SerializeToString() == _source().SerializeToString()  # the source is left as it was


def test_all_edits_at_once(source):
    mirror = ProtoMirror(source)
    for edit in EDITS.values():
        edit(mirror)
    assert mirror.to_proto().SerializeToString() == ir.to_proto(mirror.model).SerializeToString()
