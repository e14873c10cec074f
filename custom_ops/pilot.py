"""The ``pilot_model_inference`` op of the ``ai.ort_offload`` domain (v1).

``pilot_model_inference(features, network_type, mean, std, w0_cnn, b0_cnn, w1_cnn, b1_cnn,
w2_cnn, b2_cnn, <same for lstm>, <same for transformer>) -> raw``

Runtime meaning: the first step of every sample's program (DyNN-Offload §IV-E). The runtime
runs the pilot on the sample's features, maps ``raw`` back to the sample's path and execution
blocks and schedules prefetches from them. It registers that meaning itself
(``runtime_handler=None`` here; this module does not import the runtime).

Reference body (an ONNX function, so stock ONNX Runtime runs it and gives the pilot's numbers):
standardize ``x = (features - mean) / std``; three parallel MLPs, one per network type (cnn,
lstm, transformer), each ``Gemm → LeakyRelu → Gemm → LeakyRelu → Gemm`` (weights ``[in, out]``);
``raw = sum_t network_type[:, t] * mlp_t(x)``. The paper's one-hot *selects* the MLP that runs;
a function body without control flow computes all three and masks, which for MLPs this small
costs less than an ``If``. The trained weights are not part of the op: they are initializers of
the graph that calls it (:func:`make_pilot_graph`), so one registered body serves any trained
pilot of any width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from custom_ops.registry import DOMAIN, OPSET_VERSION, OpDefinition, OpRegistry, default_registry

__all__ = ["PILOT_MODEL_INFERENCE", "PILOT_NETWORK_TYPES", "PILOT_DEFINITION", "make_pilot_graph", "pilot_input_names"]

PILOT_MODEL_INFERENCE = "pilot_model_inference"
PILOT_NETWORK_TYPES = ("cnn", "lstm", "transformer")
LEAKY_RELU_SLOPE = 0.01
REFERENCE_ONNX_OPSET = 20
_LAYERS = 3


def pilot_input_names() -> list[str]:
    names = ["features", "network_type", "mean", "std"]
    for t in PILOT_NETWORK_TYPES:
        for layer in range(_LAYERS):
            names += [f"w{layer}_{t}", f"b{layer}_{t}"]
    return names


def _body() -> onnx.FunctionProto:
    nodes = [
        oh.make_node("Sub", ["features", "mean"], ["centered"]),
        oh.make_node("Div", ["centered", "std"], ["x"]),
        oh.make_node("Split", ["network_type"], [f"select_{t}" for t in PILOT_NETWORK_TYPES], axis=1,
                     num_outputs=len(PILOT_NETWORK_TYPES)),
    ]
    masked = []
    for t in PILOT_NETWORK_TYPES:
        h = "x"
        for layer in range(_LAYERS):
            out = f"z{layer}_{t}"
            nodes.append(oh.make_node("Gemm", [h, f"w{layer}_{t}", f"b{layer}_{t}"], [out]))
            if layer < _LAYERS - 1:
                nodes.append(oh.make_node("LeakyRelu", [out], [f"h{layer}_{t}"], alpha=LEAKY_RELU_SLOPE))
                h = f"h{layer}_{t}"
            else:
                h = out
        nodes.append(oh.make_node("Mul", [h, f"select_{t}"], [f"masked_{t}"]))
        masked.append(f"masked_{t}")
    nodes.append(oh.make_node("Sum", masked, ["raw"]))
    function = oh.make_function(DOMAIN, PILOT_MODEL_INFERENCE, pilot_input_names(), ["raw"], nodes,
                                [oh.make_opsetid("", REFERENCE_ONNX_OPSET)])
    function.doc_string = (
        "Pilot model: three parallel LeakyReLU MLPs over standardized features, the one of the "
        "sample's network type (one-hot) gives the raw output (execution-block encoding)."
    )
    return function


PILOT_DEFINITION = OpDefinition(PILOT_MODEL_INFERENCE, _body(), runtime_handler=None, doc=_body().doc_string)


def register_pilot_op(registry: OpRegistry) -> None:
    """Register ``pilot_model_inference`` in ``registry`` (unless already there)."""
    if PILOT_MODEL_INFERENCE not in registry:
        registry.register(PILOT_DEFINITION)


register_pilot_op(default_registry)


def make_pilot_graph(
    weights: Mapping[str, np.ndarray], *, feature_size: int, output_size: int, metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """A standalone model ``(features[1, F], network_type[1, 3]) -> raw[1, O]`` made of one
    ``pilot_model_inference`` node, the trained ``weights`` (names of :func:`pilot_input_names`
    after the first two) as initializers and the op's reference body as a local function."""
    names = pilot_input_names()
    missing = [n for n in names[2:] if n not in weights]
    if missing:
        raise ValueError(f"pilot weights missing: {', '.join(missing)}")
    graph = oh.make_graph(
        [oh.make_node(PILOT_MODEL_INFERENCE, names, ["raw"], domain=DOMAIN, name="pilot")],
        "pilot",
        [oh.make_tensor_value_info("features", onnx.TensorProto.FLOAT, [1, feature_size]),
         oh.make_tensor_value_info("network_type", onnx.TensorProto.FLOAT, [1, len(PILOT_NETWORK_TYPES)])],
        [oh.make_tensor_value_info("raw", onnx.TensorProto.FLOAT, [1, output_size])],
        initializer=[onh.from_array(np.asarray(weights[n], dtype=np.float32), n) for n in names[2:]],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", REFERENCE_ONNX_OPSET),
                                                oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                          functions=[PILOT_DEFINITION.function], producer_name="ort_offload.pilot")
    model.ir_version = 10
    if metadata:
        oh.set_model_props(model, dict(metadata))
    onnx.checker.check_model(model)
    return model
