"""The light model-zoo graphs shipped with onnx: weights folded, reference outputs, and our
ONNX-to-torch converter checked against ONNX Runtime with random weights and against torch
autograd after export."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
import torch
from onnx import numpy_helper

from models.onnx_zoo import (
    LIGHT_MODELS,
    SUPPORTED_OPS,
    OnnxGraphModule,
    UnsupportedOnnxOpError,
    build_light_model,
    check_reference,
    light_model_path,
    materialize,
)

# Together these use every op type the converter translates (checked below).
CONVERTER_MODELS = ("alexnet", "squeezenet", "shufflenet", "inception_v1", "inception_v2")


# The same check on each graph; the three with the largest weights (about 250-550 MB of folded
# initializers, 7-25 s each here) run in `make test-all` only.
LARGE_WEIGHT_MODELS = ("alexnet", "vgg19", "zfnet512")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in LARGE_WEIGHT_MODELS else [])
                                  for name in sorted(LIGHT_MODELS)])
def test_materialized_graph_reproduces_the_stored_reference_output(name):
    model = materialize(onnx.load(light_model_path(name)))
    assert not any(n.op_type == "ConstantOfShape" for n in model.graph.node)
    assert [v.name for v in model.graph.input] == [v.name for v in model.graph.input[:1]]  # the data input only
    onnx.checker.check_model(model)
    assert check_reference(name) <= 1e-5


def _random_weights(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """``model`` with every float initializer redrawn (positive where it is a BatchNorm variance)."""
    rng = np.random.default_rng(seed)
    variances = {n.input[4] for n in model.graph.node if n.op_type == "BatchNormalization"}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, tensor in enumerate(out.graph.initializer):
        value = numpy_helper.to_array(tensor)
        if value.dtype != np.float32:
            continue
        fan_in = int(np.prod(value.shape[1:])) if value.ndim > 1 else 1
        drawn = rng.normal(0.0, np.sqrt(2.0 / fan_in), value.shape)
        if tensor.name in variances:
            drawn = rng.uniform(0.5, 1.5, value.shape)
        out.graph.initializer[i].CopyFrom(numpy_helper.from_array(drawn.astype(np.float32), tensor.name))
    return out


def test_converter_models_cover_every_supported_op():
    used = {n.op_type for name in CONVERTER_MODELS for n in onnx.load(light_model_path(name)).graph.node}
    assert SUPPORTED_OPS <= used


@pytest.mark.parametrize("name", CONVERTER_MODELS)
def test_converter_matches_onnxruntime_with_random_weights(name):
    import onnxruntime as ort

    model = _random_weights(materialize(onnx.load(light_model_path(name))), seed=1)
    x = np.random.default_rng(2).standard_normal((2, 3, 224, 224)).astype(np.float32)
    module = OnnxGraphModule(model, logits_only=False).eval()
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    # The graphs fix batch 1: run ONNX Runtime per sample.
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = np.concatenate([session.run(None, {model.graph.input[0].name: x[i:i + 1]})[0] for i in range(2)])
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_unsupported_op_is_named():
    graph = oh.make_graph([oh.make_node("Tanh", ["x"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])])
    with pytest.raises(UnsupportedOnnxOpError, match="Tanh"):
        OnnxGraphModule(oh.make_model(graph))


@pytest.mark.slow  # the fast suite trains a light zoo graph end to end in tests/ort_offload/test_zoo.py
def test_exported_light_model_trains_like_torch():
    """shufflenet (BatchNorm in training mode, grouped convs, channel shuffle): one SGD step in
    ort_offload equals the same step in torch."""
    import ort_offload
    from models.registry import classification_loss
    from ort_offload.export.optimizers import SGD

    light = build_light_model("shufflenet", batch=2)
    reference = build_light_model("shufflenet", batch=2).module
    inputs, targets = light.make_batch(seed=3)
    device = ort_offload.set_offload_device("cpu")
    trainer = ort_offload.create_ort_trainer(
        device, light.module, loss_fn=classification_loss, example_inputs=inputs, example_targets=targets,
        input_names=light.input_names, target_names=light.target_names, optimizer=SGD(lr=0.1), name="shufflenet",
    )
    loss = trainer.step(*inputs, *targets)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference.train()
    expected = classification_loss(reference(*inputs), *targets)
    optimizer.zero_grad()
    expected.backward()
    optimizer.step()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    # 49 BatchNorms over batch statistics amplify rounding (and a conv bias before a BatchNorm
    # has a true gradient of zero, so its update is pure rounding): compare the update of all
    # state (new - initial value) as one vector, normwise.
    state = trainer.flat_state()
    initial = build_light_model("shufflenet", batch=2).module.state_dict()
    names = sorted(initial)
    ours = np.concatenate([(state[n] - initial[n].numpy()).ravel() for n in names])
    theirs = np.concatenate([(reference.state_dict()[n] - initial[n]).numpy().ravel() for n in names])
    assert np.linalg.norm(ours - theirs) <= 1e-3 * np.linalg.norm(theirs)  # measured: 2.5e-4
