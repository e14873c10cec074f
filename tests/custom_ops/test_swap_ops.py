"""SwapOut/SwapIn: registration, node helpers, attach_functions, and stock-ORT equivalence."""

import numpy as np
import onnx
import onnx.helper as oh
import onnx.parser
import onnxruntime as ort
import pytest

from custom_ops import (DOMAIN, OPSET_VERSION, OpRegistry, attach_functions, default_registry, make_swap_in,
                        make_swap_out)
from custom_ops.swap import PASS_KEY, REASON_KEY, SWAP_IN, SWAP_OUT, register_swap_ops

# x -> Relu -> a; a is used by Mul, then not until the final Add: the gap a swap pass targets.
PLAIN = """
<ir_version: 10, opset_import: ["" : {opset}]>
g (float[4, 8] x, float[8, 8] w) => (float[4, 8] out) {{
    a = Relu(x)
    b = Mul(a, x)
    c = MatMul(b, w)
    d = Tanh(c)
    e = MatMul(d, w)
    out = Add(e, a)
}}
"""


def plain_model(opset: int = 20) -> onnx.ModelProto:
    return onnx.parser.parse_model(PLAIN.format(opset=opset))


def swapped_model(opset: int = 20) -> onnx.ModelProto:
    """``a`` swapped out after Mul, swapped back in once ``d`` (the Tanh) exists, used by Add."""
    model = plain_model(opset)
    nodes = list(model.graph.node)
    swap_out = make_swap_out("a", out_name="a_host", provenance="test_swap", reason="gap between Mul and Add")
    swap_in = make_swap_in("a_host", after="d", out_name="a_dev", provenance="test_swap")
    add = nodes[-1]
    add.input[1] = "a_dev"
    rewritten = nodes[:2] + [swap_out] + nodes[2:4] + [swap_in] + nodes[4:]
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    attach_functions(model)
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 8), dtype=np.float32),
            "w": rng.standard_normal((8, 8), dtype=np.float32)}


def test_registry_contains_swap_ops_with_identity_bodies():
    assert SWAP_OUT in default_registry and SWAP_IN in default_registry
    for name, arity in ((SWAP_OUT, 1), (SWAP_IN, 2)):
        op = default_registry.get(name)
        assert op.runtime_handler is None  # the runtime registers the meaning
        assert op.function.domain == DOMAIN and op.function.name == name
        assert len(op.function.input) == arity and len(op.function.output) == 1
        assert [n.op_type for n in op.function.node] == ["Identity"]
        assert {(o.domain, o.version) for o in op.function.opset_import} == {("", 20)}


def test_register_swap_ops_into_a_fresh_registry_is_repeatable():
    registry = OpRegistry()
    register_swap_ops(registry)
    register_swap_ops(registry)
    assert registry.names() == [SWAP_OUT, SWAP_IN]


def test_helpers_set_domain_inputs_and_provenance():
    out = make_swap_out("a", out_name="a_host", provenance="swap", reason="why")
    assert (out.op_type, out.domain, list(out.input), list(out.output)) == (SWAP_OUT, DOMAIN, ["a"],
                                                                            ["a_host"])
    assert {p.key: p.value for p in out.metadata_props} == {PASS_KEY: "swap", REASON_KEY: "why"}
    inn = make_swap_in("a_host", after="d", out_name="a_dev", provenance="swap")
    assert (inn.op_type, inn.domain, list(inn.input), list(inn.output)) == (SWAP_IN, DOMAIN, ["a_host", "d"],
                                                                            ["a_dev"])
    meta = {p.key: p.value for p in inn.metadata_props}
    assert meta[PASS_KEY] == "swap" and meta[REASON_KEY]
    assert out.name != inn.name
    with pytest.raises(ValueError, match="ordering token"):
        make_swap_in("a_host", after="", out_name="a_dev", provenance="swap")
    with pytest.raises(ValueError, match="provenance"):
        make_swap_out("a", out_name="a_host", provenance="")


@pytest.mark.parametrize("opset", [20, 17])
def test_swapped_graph_is_bitwise_equal_in_stock_onnxruntime(opset):
    model = swapped_model(opset)
    onnx.checker.check_model(model, full_check=True)
    swap_nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in swap_nodes] == [SWAP_OUT, SWAP_IN]
    assert all({p.key for p in n.metadata_props} == {PASS_KEY, REASON_KEY} for n in swap_nodes)
    inputs = feeds()
    (expected,) = run(plain_model(opset), inputs)
    (actual,) = run(model, inputs)
    assert expected.tobytes() == actual.tobytes()
    # the metadata survives serialization
    reloaded = onnx.load_from_string(model.SerializeToString())
    reason = {p.key: p.value for p in reloaded.graph.node[2].metadata_props}[REASON_KEY]
    assert reason == "gap between Mul and Add"


def test_ordering_token_may_have_another_type_than_the_swapped_tensor():
    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (int64[3] x, float[2, 2] f) => (int64[3] y) {
        h = Relu(f)
        y = Add(x, x)
    }
    """)
    nodes = list(model.graph.node)
    nodes[1].input[1] = "x_dev"
    del model.graph.node[:]
    model.graph.node.extend([
        make_swap_out("x", out_name="x_host", provenance="t"),
        nodes[0],
        make_swap_in("x_host", after="h", out_name="x_dev", provenance="t"),
        nodes[1],
    ])
    attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    x = np.array([1, -2, 3], dtype=np.int64)
    (y,) = run(model, {"x": x, "f": np.ones((2, 2), np.float32)})
    np.testing.assert_array_equal(y, 2 * x)


def test_attach_functions_is_idempotent_and_only_adds_used_ops():
    model = swapped_model()
    once = model.SerializeToString(deterministic=True)
    attach_functions(model)
    assert model.SerializeToString(deterministic=True) == once
    assert sorted(f.name for f in model.functions) == [SWAP_IN, SWAP_OUT]
    assert [(o.domain, o.version) for o in model.opset_import].count((DOMAIN, OPSET_VERSION)) == 1

    plain = plain_model()
    before = plain.SerializeToString(deterministic=True)
    attach_functions(plain)
    assert plain.SerializeToString(deterministic=True) == before

    only_out = plain_model()
    only_out.graph.node.append(make_swap_out("out", out_name="out_host", provenance="t"))
    attach_functions(only_out)
    assert [f.name for f in only_out.functions] == [SWAP_OUT]


def test_attach_functions_rejects_unknown_ops_and_other_versions():
    model = plain_model()
    model.graph.node.append(oh.make_node("Mystery", ["out"], ["m"], domain=DOMAIN))
    with pytest.raises(ValueError, match="Mystery"):
        attach_functions(model)

    model = plain_model()
    model.graph.node.append(make_swap_out("out", out_name="out_host", provenance="t"))
    model.opset_import.append(oh.make_opsetid(DOMAIN, OPSET_VERSION + 1))
    with pytest.raises(ValueError, match="version"):
        attach_functions(model)


def test_attach_functions_on_an_onnx_ir_model_attaches_what_it_attaches_on_a_proto():
    import onnx_ir as ir

    from custom_ops.swap import attach_functions_ir

    for opset in (18, 20):
        unattached = swapped_model(opset)
        del unattached.functions[:]
        del unattached.opset_import[1:]
        model = ir.from_proto(unattached)
        attach_functions_ir(model)
        attach_functions_ir(model)  # idempotent
        attached = ir.to_proto(model)
        expected = swapped_model(opset)
        assert [(o.domain, o.version) for o in attached.opset_import] == [(o.domain, o.version) for o in expected.opset_import]
        assert [f.SerializeToString() for f in attached.functions] == [f.SerializeToString() for f in expected.functions]
    old = ir.from_proto(swapped_model())
    old.ir_version = 7
    with pytest.raises(ValueError, match="no local functions"):
        attach_functions_ir(old)
