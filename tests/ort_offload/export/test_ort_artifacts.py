"""ORT training artifacts in the main environment: structure of the loader's output on a
hand-built artifact graph, the step running under a budget where every op is standard, and one
clear error where the graph needs ORT's training kernels (generated artifacts themselves are
tested in tests/compat, in .venv-compat)."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload import set_offload_device
from ort_offload.runtime.block_session import default_session_options
from ort_offload.cli import main
from ort_offload.errors import ModelLoadError, UnsupportedGraphError
from ort_offload.export.ort_artifacts import (
    LAZY_RESET_INPUT, add_layer_norm_outputs, is_artifact_graph, load_training_artifact, training_graph_from_artifact,
)
from ort_offload.trainer import OrtTrainer

BATCH, FEATURES, HIDDEN, CLASSES = 8, 16, 32, 4
PARAMS = {"w1": (FEATURES, HIDDEN), "w2": (HIDDEN, CLASSES)}


def _artifact_model(*, ort_relu_grad: bool) -> onnx.ModelProto:
    """A two-layer MLP's training graph shaped like generate_artifacts' output: gradients
    accumulated into ``<param>_grad.accumulation.buffer`` by InPlaceAccumulatorV2 nodes;
    the ReLU backward as ORT's ReluGrad or in standard ops."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss", "log_prob"]),
        helper.make_node("Exp", ["log_prob"], ["prob"]),
        helper.make_node("OneHot", ["labels", "depth", "onehot_values"], ["onehot"], axis=-1),
        helper.make_node("Sub", ["prob", "onehot"], ["dlogits_sum"]),
        helper.make_node("Div", ["dlogits_sum", "batch_size"], ["logits_grad"]),
        helper.make_node("Transpose", ["r"], ["r_t"]),
        helper.make_node("MatMul", ["r_t", "logits_grad"], ["w2_grad"]),
        helper.make_node("Transpose", ["w2"], ["w2_t"]),
        helper.make_node("MatMul", ["logits_grad", "w2_t"], ["r_grad"]),
    ]
    if ort_relu_grad:
        nodes.append(helper.make_node("ReluGrad", ["r_grad", "r"], ["h_grad"], domain="com.microsoft"))
    else:
        nodes += [
            helper.make_node("Greater", ["h", "zero"], ["active"]),
            helper.make_node("Cast", ["active"], ["active_f"], to=f),
            helper.make_node("Mul", ["r_grad", "active_f"], ["h_grad"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["x"], ["x_t"]),
        helper.make_node("MatMul", ["x_t", "h_grad"], ["w1_grad"]),
    ]
    for param in PARAMS:
        nodes.append(helper.make_node(
            "InPlaceAccumulatorV2", [f"{param}_grad.accumulation.buffer", f"{param}_grad", LAZY_RESET_INPUT],
            [f"{param}_grad.accumulation.out"], domain="com.microsoft",
        ))
    inputs = [helper.make_tensor_value_info("x", f, ["batch", FEATURES]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])]
    inputs += [helper.make_tensor_value_info(p, f, shape) for p, shape in PARAMS.items()]
    inputs += [helper.make_tensor_value_info(f"{p}_grad.accumulation.buffer", f, shape) for p, shape in PARAMS.items()]
    inputs.append(helper.make_tensor_value_info(LAZY_RESET_INPUT, TensorProto.BOOL, [1]))
    outputs = [helper.make_tensor_value_info("loss", f, [])]
    outputs += [helper.make_tensor_value_info(f"{p}_grad.accumulation.out", TensorProto.BOOL, [1]) for p in PARAMS]
    initializers = [
        helper.make_tensor("depth", TensorProto.INT64, [], [CLASSES]),
        helper.make_tensor("onehot_values", f, [2], [0.0, 1.0]),
        helper.make_tensor("batch_size", f, [], [float(BATCH)]),
        helper.make_tensor("zero", f, [], [0.0]),
    ]
    graph = helper.make_graph(nodes, "artifact_mlp", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid("com.microsoft", 1)])


def test_loader_removes_accumulators_and_assigns_roles():
    model = _artifact_model(ort_relu_grad=True)
    assert is_artifact_graph(model)
    graph = training_graph_from_artifact(model, name="mlp")
    assert graph.input_names == ["x", "labels", "w1", "w2"]
    assert graph.output_names == ["loss", "w1_grad", "w2_grad"]
    assert not any(n.op_type == "InPlaceAccumulatorV2" for n in graph.graph.node)
    assert graph.data_inputs == ["x", "labels"] and graph.state_inputs == ["w1", "w2"]
    assert graph.roles["w1_grad"] == Role.GRAD and graph.roles["loss"] == Role.LOSS
    assert graph.roles["h"] == Role.ACTIVATION and graph.state_pairs == {}
    assert graph.step_fetches == ["loss", "w1_grad", "w2_grad"]
    grad_type = next(o for o in graph.graph.output if o.name == "w2_grad").type.tensor_type
    assert grad_type.elem_type == TensorProto.FLOAT and [d.dim_value for d in grad_type.shape.dim] == [HIDDEN, CLASSES]
    onnx.checker.check_model(graph.model)
    # A frozen parameter (named by the checkpoint) is state without a gradient.
    frozen = training_graph_from_artifact(model, name="mlp", frozen_params=["x"])
    assert frozen.roles["x"] == Role.PARAM and frozen.data_inputs == ["labels"]


def test_loader_rejects_graphs_that_are_not_the_training_model():
    plain = _artifact_model(ort_relu_grad=False)
    accumulators = [n for n in plain.graph.node if n.op_type == "InPlaceAccumulatorV2"]
    for node in accumulators:
        plain.graph.node.remove(node)
    with pytest.raises(ModelLoadError, match="not an ORT training graph"):
        training_graph_from_artifact(plain, name="eval_model")
    assert is_artifact_graph(plain)  # the buffer inputs still say where it came from
    optimizer = helper.make_model(helper.make_graph(
        [helper.make_node("AdamWOptimizer", ["lr", "step"], ["updated"], domain="com.microsoft")], "opt",
        [helper.make_tensor_value_info("lr", TensorProto.FLOAT, []), helper.make_tensor_value_info("step", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("updated", TensorProto.BOOL, [])]))
    assert is_artifact_graph(optimizer)
    with pytest.raises(ModelLoadError, match="optimizer graph"):
        training_graph_from_artifact(optimizer, name="optimizer_model")


def test_layer_norm_fixup_names_the_optional_outputs():
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], name="ln")
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    fixed = add_layer_norm_outputs(model)
    assert list(fixed.graph.node[0].output) == ["y", "ln_saved1", "ln_saved2"] and list(node.output) == ["y"]


def test_artifact_with_standard_ops_runs_at_half_peak_bitwise(tmp_path):
    """Loader, planner and runtime on an artifact graph this build can run: 0.5x of the
    unplanned peak, gradients (outputs swapped out and back) equal to a plain session."""
    path = tmp_path / "training_model.onnx"
    onnx.save(_artifact_model(ort_relu_grad=False), path)
    graph, values = load_training_artifact(path)
    assert values is None  # no checkpoint beside it
    rng = np.random.default_rng(0)
    state = {p: (rng.standard_normal(s) * 0.3).astype(np.float32) for p, s in PARAMS.items()}
    batches = [{"x": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
                "labels": rng.integers(0, CLASSES, BATCH).astype(np.int64)} for _ in range(2)]
    trainer = OrtTrainer(set_offload_device("cpu", budget="0.5x"), graph, initial_state=state,
                         example_batch=batches[0], input_names=graph.data_inputs, target_names=[], passes=["swap"])
    session = ort.InferenceSession(graph.model.SerializeToString(), default_session_options(),
                                   providers=["CPUExecutionProvider"])
    for batch in batches:
        trainer.step(batch["x"], batch["labels"])
        expected = dict(zip(graph.step_fetches, session.run(graph.step_fetches, {**state, **batch})))
        for name, value in expected.items():
            assert np.array_equal(trainer.last_outputs[name], value), name
    report = trainer.report()
    assert report["budget_bytes"] == report["baseline_peak_bytes"] // 2
    assert report["peak_device_bytes"] <= report["budget_bytes"] and report["passes"] == ["swap"]

    # Transformed (swap nodes written into the file) and read back: same numbers, same budget.
    out = tmp_path / "planned.onnx"
    assert main(["transform", str(path), "-o", str(out), "--budget", str(report["budget_bytes"]),
                 "--input", f"x={BATCH}x{FEATURES}", "--input", f"labels={BATCH}"]) == 0
    rewritten = TrainingGraph.from_model(onnx.load(str(out)))
    replay = OrtTrainer(set_offload_device("cpu", budget=report["budget_bytes"]), rewritten, initial_state=state,
                        example_batch=batches[0], input_names=rewritten.data_inputs, target_names=[])
    replay.step(batches[-1]["x"], batches[-1]["labels"])
    for name in graph.step_fetches:
        assert np.array_equal(replay.last_outputs[name], trainer.last_outputs[name]), name
    assert replay.report()["peak_device_bytes"] <= report["budget_bytes"]


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime.training") is not None,
                    reason="this build has ORT's training kernels")
def test_cli_names_the_training_build_when_kernels_are_missing(tmp_path, capsys):
    path = tmp_path / "training_model.onnx"
    onnx.save(_artifact_model(ort_relu_grad=True), path)
    out = tmp_path / "planned.onnx"
    code = main(["transform", str(path), "-o", str(out), "--budget", "0.5x",
                 "--input", f"x={BATCH}x{FEATURES}", "--input", f"labels={BATCH}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists() and len(err.splitlines()) == 1
    assert "ReluGrad" in err and "onnxruntime-training-cpu==1.19.2" in err
    with pytest.raises(UnsupportedGraphError):
        load_training_artifact(path)
