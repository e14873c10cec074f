"""ORT training artifacts (onnxruntime-training-cpu 1.19.2): load, transform under half the
unplanned peak, run, and compare with the artifact graph in a plain InferenceSession.

Runs in ``.venv-compat`` only (``make compat-test``; see ``conftest.py``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload import set_offload_device
from ort_offload.runtime.block_session import default_session_options
from ort_offload.cli import main
from ort_offload.errors import ModelLoadError, UnsupportedGraphError
from ort_offload.export.ort_artifacts import (
    ACCUMULATION_BUFFER_SUFFIX, LAZY_RESET_INPUT, load_training_artifact, training_graph_from_artifact,
)
from ort_offload.trainer import OrtTrainer
from ort_offload.transform import transform

STEPS = 2


def _batches(graph: TrainingGraph, shapes, classes: int, *, steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    """Real batches: float features, integers (token ids, labels) below ``classes``."""
    from graph_passes.ir.shapes import declared_inputs

    rng = np.random.default_rng(1)
    declared = declared_inputs(graph.model)
    batches = []
    for _ in range(steps):
        batch = {}
        for name in graph.data_inputs:
            dtype, dims = declared[name]
            shape = shapes.get(name) or tuple(dims)
            if np.issubdtype(dtype, np.floating):
                batch[name] = rng.standard_normal(shape).astype(dtype)
            else:
                batch[name] = rng.integers(0, classes, size=shape).astype(dtype)
        batches.append(batch)
    return batches


def _reference(graph: TrainingGraph, state, batch) -> dict[str, np.ndarray]:
    """Loss and gradients of the unplanned artifact graph in one plain InferenceSession."""
    session = ort.InferenceSession(graph.model.SerializeToString(), default_session_options(),
                                   providers=["CPUExecutionProvider"])
    names = graph.step_fetches
    return dict(zip(names, session.run(names, {**state, **batch})))


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_artifact_loads_with_roles(artifacts, name):
    path, _, _ = artifacts[name]
    raw = onnx.load(str(path))
    graph, values = load_training_artifact(path)
    params = [v.name[: -len(ACCUMULATION_BUFFER_SUFFIX)] for v in raw.graph.input
              if v.name.endswith(ACCUMULATION_BUFFER_SUFFIX)]
    assert params and values is not None and sorted(values) == sorted(params)
    assert not any(n.op_type == "InPlaceAccumulatorV2" for n in graph.graph.node)
    assert not any(n.endswith(ACCUMULATION_BUFFER_SUFFIX) or n == LAZY_RESET_INPUT for n in graph.input_names)
    assert graph.state_inputs == params and all(graph.roles[p] == Role.PARAM for p in params)
    assert sorted(graph.names_with_role(Role.GRAD)) == sorted(f"{p}_grad" for p in params)
    assert graph.loss_name == raw.graph.output[0].name
    assert graph.data_inputs == (["x", "labels"] if name == "mlp" else ["ids", "labels"])
    assert any(n.domain == "com.microsoft" for n in graph.graph.node)  # ORT's gradient ops stay


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_artifact_transformed_at_half_peak_runs_bitwise_equal(artifacts, name, tmp_path):
    path, shapes, classes = artifacts[name]
    graph, values = load_training_artifact(path)
    batches = _batches(graph, shapes, classes)

    planned = transform(graph, set_offload_device("cpu", budget="0.5x"), shapes, ("swap",))
    report = planned.report
    assert report["budget_bytes"] == int(0.5 * report["baseline_peak_bytes"])
    assert report["planned_peak_bytes"] <= report["budget_bytes"] < report["baseline_peak_bytes"]
    assert report["swaps"] and report["passes"] == ["swap"]
    out = planned.graph.save(tmp_path / f"{name}_planned.onnx")

    rewritten = TrainingGraph.from_model(onnx.load(str(out)))  # roles from the file's metadata
    assert rewritten.state_inputs == graph.state_inputs and rewritten.step_fetches == graph.step_fetches
    device = set_offload_device("cpu", budget=report["budget_bytes"])
    trainer = OrtTrainer(device, rewritten, initial_state=values, example_batch=batches[0],
                         input_names=rewritten.data_inputs, target_names=[])
    for batch in batches:
        trainer.step(*(batch[n] for n in rewritten.data_inputs))
        expected = _reference(graph, values, batch)
        assert sorted(trainer.last_outputs) == sorted(expected)
        for key, value in expected.items():
            assert np.array_equal(trainer.last_outputs[key], value), key
    result = trainer.report()
    assert result["within_budget"] and result["peak_device_bytes"] <= report["budget_bytes"]
    assert result["faults"] == 0


def test_cli_transform_and_run_artifact(artifacts, tmp_path, capsys):
    path, _, _ = artifacts["mlp"]
    out = tmp_path / "mlp_planned.onnx"
    shapes = ["--input", "x=4x16", "--input", "labels=4"]
    assert main(["transform", str(path), "-o", str(out), "--budget", "0.5x", *shapes]) == 0
    assert "swaps" in capsys.readouterr().out and out.is_file()
    report = tmp_path / "run.json"
    assert main(["run", str(path), "--budget", "0.5x", "--steps", "2", "--quiet", "--json", str(report), *shapes]) == 0
    import json

    data = json.loads(report.read_text())
    assert data["within_budget"] and data["peak_device_bytes"] <= data["budget_bytes"] and len(data["losses"]) == 2


def test_bad_artifact_inputs_fail_in_one_line(artifacts, tmp_path, capsys):
    path, _, _ = artifacts["mlp"]
    out = tmp_path / "never.onnx"
    args = ["--budget", "0.5x", "--input", "x=4x16", "--input", "labels=4"]
    # The optimizer graph of the same artifacts is not a training step.
    assert main(["transform", str(path.parent / "optimizer_model.onnx"), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "not an ORT training graph" in err and len(err.splitlines()) == 1 and not out.exists()

    # The eval graph of the same artifacts: an inference graph with the loss, nothing to train.
    assert main(["transform", str(path.parent / "eval_model.onnx"), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "no parameters or gradients" in err and len(err.splitlines()) == 1 and not out.exists()

    # An op this build has no kernel for.
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "ReluGrad")
    node.op_type = "ReluGradUnknown"
    bad = tmp_path / "training_model.onnx"
    onnx.save(model, bad)
    assert main(["transform", str(bad), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "ReluGradUnknown" in err and "onnxruntime-training-cpu" in err and len(err.splitlines()) == 1
    assert not out.exists()
    with pytest.raises(UnsupportedGraphError):
        load_training_artifact(bad, checkpoint=path.parent / "checkpoint")
    with pytest.raises(ModelLoadError):
        training_graph_from_artifact(onnx.load(str(path.parent / "eval_model.onnx")), name="eval_model")
