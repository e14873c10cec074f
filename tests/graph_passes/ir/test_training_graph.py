"""TrainingGraph.forward_part: the loss's and the buffer updates' nodes, nothing of the backward."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from graph_passes.ir.training_graph import Role, TrainingGraph


def _step() -> TrainingGraph:
    """x @ w summed is the loss; b + 1 the updated buffer; w.grad a backward-only node."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        helper.make_node("Add", ["b", "one"], ["b.updated"]),
        helper.make_node("Mul", ["x", "two"], ["w.grad"]),
    ]
    graph = helper.make_graph(
        nodes, "step",
        [helper.make_tensor_value_info(n, f, [2, 2]) for n in ("x", "w", "b")],
        [helper.make_tensor_value_info("loss", f, []), helper.make_tensor_value_info("b.updated", f, [2, 2]),
         helper.make_tensor_value_info("w.grad", f, [2, 2])],
        [helper.make_tensor("one", f, [], [1.0]), helper.make_tensor("two", f, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    roles = {"x": Role.INPUT, "w": Role.PARAM, "b": Role.BUFFER, "y": Role.ACTIVATION, "loss": Role.LOSS,
             "b.updated": Role.BUFFER, "w.grad": Role.GRAD}
    return TrainingGraph(model=model, roles=roles, state_pairs={"b": "b.updated"}, name="step")


def test_forward_part_keeps_the_loss_and_buffer_updates_only():
    step = _step()
    part = step.forward_part()
    onnx.checker.check_model(part.model)
    assert [n.op_type for n in part.model.graph.node] == ["MatMul", "ReduceSum", "Add"]
    assert part.output_names == ["loss", "b.updated"] and part.input_names == step.input_names
    assert part.state_pairs == {"b": "b.updated"} and Role.GRAD not in part.roles.values()
    assert part.step_fetches == ["loss"] and len(step.model.graph.node) == 4  # the step is untouched


def test_a_graph_without_a_loss_has_no_forward_part():
    step = _step()
    step.roles["loss"] = Role.ACTIVATION
    with pytest.raises(ValueError, match="without a loss"):
        step.forward_part()
