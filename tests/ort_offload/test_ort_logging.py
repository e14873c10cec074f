"""ONNX Runtime's own log follows ours: a failing kernel prints one line (our error), and its
own coloured log line shows only when the ``onnxruntime`` logger asks for INFO (``-v``)."""

from __future__ import annotations

import logging

import onnx
import onnx.helper as oh
import pytest

from ort_offload.cli import main
from graph_passes.ort_logging import ORT_LOGGER_NAME, ort_log_severity


@pytest.fixture
def failing_graph(tmp_path):
    """A training-step graph whose Reshape fails in ONNX Runtime (5 elements into shape [3])."""
    nodes = [
        oh.make_node("Constant", [], ["shape"], value=oh.make_tensor("shape", onnx.TensorProto.INT64, [1], [3])),
        oh.make_node("Reshape", ["x", "shape"], ["r"]),
        oh.make_node("ReduceSum", ["r"], ["a"], keepdims=0),
        oh.make_node("ReduceSum", ["w"], ["b"], keepdims=0),
        oh.make_node("Add", ["a", "b"], ["loss"]),
        oh.make_node("Mul", ["w", "w"], ["w.updated"]),
    ]
    graph = oh.make_graph(nodes, "reshape_fails", [oh.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [2]),
                                                   oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5])],
                          [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []),
                           oh.make_tensor_value_info("w.updated", onnx.TensorProto.FLOAT, [2])])
    path = tmp_path / "fails.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=10), path)
    return path


@pytest.fixture
def ort_logger_level():
    logger = logging.getLogger(ORT_LOGGER_NAME)
    old = logger.level
    yield logger
    logger.setLevel(old)


def test_an_onnxruntime_failure_prints_one_line(failing_graph, capfd, ort_logger_level):
    ort_logger_level.setLevel(logging.WARNING)
    assert main(["run", str(failing_graph), "--steps", "1", "--quiet"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ort-offload: error:") and "Reshape" in err


def test_verbose_shows_onnxruntime_own_log(failing_graph, capfd, ort_logger_level):
    ort_logger_level.setLevel(logging.INFO)
    assert main(["run", str(failing_graph), "--steps", "1", "--quiet"]) == 2
    err = capfd.readouterr().err
    assert "[E:onnxruntime" in err and "ort-offload: error:" in err


def test_severity_follows_the_logger_level(ort_logger_level):
    for level, severity in ((logging.DEBUG, 1), (logging.INFO, 2), (logging.WARNING, 4), (logging.ERROR, 4)):
        ort_logger_level.setLevel(level)
        assert ort_log_severity() == severity


def test_error_summary_drops_status_prefixes_and_source_locations():
    from graph_passes.ort_logging import ort_error_summary

    raw = ("[ONNXRuntimeError] : 1 : FAIL : Error in execution: Non-zero status code returned while running Reshape "
           "node. Name:'' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:91 "
           "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, bool) input_shape_size == "
           "requested_shape_size was false.\nsecond line")
    assert ort_error_summary(RuntimeError(raw)) == (
        "Non-zero status code returned while running Reshape node. Name:'' Status Message: input_shape_size == "
        "requested_shape_size was false.")
    assert ort_error_summary(RuntimeError("")) == "RuntimeError"
