"""Checks that a file is a training-step graph the runtime can execute.

Run before any planning: the ONNX checker, then every op against the schemas onnx knows, the
model's local functions and the ops this onnxruntime build has kernels for. Errors name the
first offending op and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from graph_passes.errors import ModelLoadError, UnsupportedGraphError

# Domains whose ops are executed by ONNX Runtime kernels rather than by ONNX schemas alone.
_RUNTIME_DOMAINS = {"com.microsoft", "com.microsoft.nchwc", "ai.onnx.contrib"}


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load and check an ONNX file; a missing, unreadable or non-ONNX file is a ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such file: {path}")
    try:
        model = onnx.load(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path} is not an ONNX model ({type(e).__name__}); pass a .onnx file") from e
    if not model.graph.node:
        raise ModelLoadError(f"{path} holds no graph nodes; is it an ONNX model?")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ModelLoadError(f"{path} is not valid ONNX: {str(e).strip().splitlines()[0]}") from e
    return model


def check_supported_ops(model: onnx.ModelProto, *, runtime_ops: set[tuple[str, str]] | None = None) -> None:
    """Raise UnsupportedGraphError for the first op nothing can execute.

    Standard ops must have an ONNX schema at the model's opset; ops of other domains need a
    local function in the model or must be in ``runtime_ops`` ((domain, op_type) pairs known to
    the runtime); com.microsoft ops are left to ONNX Runtime, which reports a missing kernel
    when the block session is created.
    """
    functions = {(f.domain, f.name) for f in model.functions}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for node in _all_nodes(model.graph):
        domain = node.domain or ""
        if domain in ("", "ai.onnx"):
            version = opsets.get("", opsets.get("ai.onnx", 1))
            if not onnx.defs.has(node.op_type, "") or _schema_missing(node.op_type, version):
                raise UnsupportedGraphError(
                    f"op {node.op_type!r} (node {node.name!r}) is not a standard ONNX op at opset {version}; "
                    "re-export the model with standard ops"
                )
        elif (domain, node.op_type) in functions or domain in _RUNTIME_DOMAINS:
            continue
        elif runtime_ops is not None and (domain, node.op_type) in runtime_ops:
            continue
        else:
            raise UnsupportedGraphError(
                f"op {domain}::{node.op_type} (node {node.name!r}) has no kernel or function body; "
                "the graph needs a custom op ort_offload does not provide"
            )


def _schema_missing(op_type: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, version, "")
        return False
    except onnx.defs.SchemaError:
        return True


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _all_nodes(attr.g)
            for sub in attr.graphs:
                yield from _all_nodes(sub)


def check_training_step(graph) -> None:
    """Reject a graph that trains nothing: no state inputs and no gradient outputs.

    ``graph`` is a :class:`graph_passes.ir.training_graph.TrainingGraph`. An inference or eval
    graph passes every other check and would "train" by computing its outputs; say so instead.
    """
    from graph_passes.ir.training_graph import Role

    if not graph.state_inputs and not graph.names_with_role(Role.GRAD):
        raise ModelLoadError(
            f"{graph.name} has no parameters or gradients (an inference or eval graph?): pass a training step, "
            "e.g. from `ort-offload export` or the training_model.onnx of ORT's generate_artifacts"
        )
