"""The ai.ort_offload op registry: registration rules and reference bodies."""

import onnx
import onnx.helper as oh
import pytest

from custom_ops import DOMAIN, OpDefinition, OpRegistry


def identity_function(name: str, domain: str = DOMAIN) -> onnx.FunctionProto:
    return oh.make_function(domain, name, ["x"], ["y"], [oh.make_node("Identity", ["x"], ["y"])],
                            [oh.make_opsetid("", 20)])


def test_register_and_look_up():
    registry = OpRegistry()
    registry.register(OpDefinition("Probe", identity_function("Probe")))
    assert "Probe" in registry and registry.names() == ["Probe"]
    assert registry.get("Probe").function.name == "Probe"
    assert [f.name for f in registry.functions()] == ["Probe"]


def test_duplicate_and_mismatched_bodies_are_rejected():
    registry = OpRegistry()
    registry.register(OpDefinition("Probe", identity_function("Probe")))
    with pytest.raises(ValueError, match="already registered"):
        registry.register(OpDefinition("Probe", identity_function("Probe")))
    with pytest.raises(ValueError, match=DOMAIN):
        registry.register(OpDefinition("Other", identity_function("Other", domain="com.example")))
    with pytest.raises(KeyError, match="registered: Probe"):
        registry.get("Missing")


def test_a_registered_body_runs_in_stock_onnxruntime():
    import numpy as np
    import onnxruntime as ort

    registry = OpRegistry()
    registry.register(OpDefinition("Probe", identity_function("Probe")))
    graph = oh.make_graph([oh.make_node("Probe", ["x"], ["y"], domain=DOMAIN)], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20), oh.make_opsetid(DOMAIN, 1)],
                          functions=registry.functions(), ir_version=10)
    x = np.arange(3, dtype=np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_array_equal(x, y)
