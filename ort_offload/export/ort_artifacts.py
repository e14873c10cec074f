"""ONNX Runtime training artifacts as training-step graphs: detection, loading, generation.

ORT's ``onnxruntime.training.artifacts.generate_artifacts`` writes a ``training_model.onnx``
whose backward uses ORT's own gradient ops (domain ``com.microsoft``: ``ReluGrad``,
``SoftmaxCrossEntropyLossGrad``, ``GatherGrad``, ...) and accumulates every gradient into a
``<param>_grad.accumulation.buffer`` input with an ``InPlaceAccumulatorV2`` node (reset by the
``lazy_reset_grad`` input). This module owns turning such a file into a :class:`TrainingGraph`:
the accumulator nodes, their buffers and ``lazy_reset_grad`` are removed so the graph outputs
plain ``<param>_grad`` gradients, and every value gets its role (parameters PARAM, gradients
GRAD, the loss LOSS, batch tensors INPUT). It also reads parameter values from the artifact's
``checkpoint`` and wraps ``generate_artifacts`` with the fix-ups its exporter input needs.

Those ops have kernels only in the ``onnxruntime-training-cpu==1.19.2`` build, which installs as
the ``onnxruntime`` module and so lives in its own virtual environment (``make compat``). In
any other build, loading an artifact graph fails with one clear :class:`UnsupportedGraphError`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx

from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload.errors import ModelLoadError, UnsupportedGraphError
from graph_passes.ort_logging import ort_log_severity

logger = logging.getLogger(__name__)

ORT_DOMAIN = "com.microsoft"
ACCUMULATOR_OPS = frozenset({"InPlaceAccumulatorV2", "InPlaceAccumulator"})
ACCUMULATION_BUFFER_SUFFIX = "_grad.accumulation.buffer"
LAZY_RESET_INPUT = "lazy_reset_grad"
GRAD_SUFFIX = "_grad"
CHECKPOINT_FILE = "checkpoint"  # generate_artifacts writes it beside training_model.onnx
# Ops of the other two artifact graphs: a file holding them is not the training model.
OPTIMIZER_OPS = frozenset({"AdamWOptimizer", "AdamOptimizer", "SGDOptimizerV2", "SGDOptimizer"})
TRAINING_BUILD = "onnxruntime-training-cpu==1.19.2"
# LayerNormalization's optional outputs (mean, inverse standard deviation) that ORT's gradient
# builder reads; torch's exporter leaves them out.
LAYER_NORM_OUTPUTS = 3


def is_artifact_graph(model: onnx.ModelProto) -> bool:
    """Whether ``model`` looks like a graph written by ORT's ``generate_artifacts``: ORT
    accumulator or optimizer ops, or the accumulation-buffer / lazy-reset inputs."""
    for node in model.graph.node:
        if node.domain == ORT_DOMAIN and (node.op_type in ACCUMULATOR_OPS or node.op_type in OPTIMIZER_OPS):
            return True
    return any(v.name.endswith(ACCUMULATION_BUFFER_SUFFIX) or v.name == LAZY_RESET_INPUT for v in model.graph.input)


def training_graph_from_artifact(
    model: onnx.ModelProto, *, name: str = "graph", frozen_params: Iterable[str] = ()
) -> TrainingGraph:
    """The training step of an artifact ``training_model.onnx``, with plain gradient outputs.

    ``frozen_params``: inputs that are parameters without a gradient (from the checkpoint); they
    get the PARAM role, every other input that is not a trainable parameter is a batch tensor.
    Raises :class:`ModelLoadError` for an artifact file that is not the training model (the
    eval or optimizer model) or whose accumulators do not read gradients of graph inputs.
    """
    accumulation = _read_accumulators(model.graph, name)
    out = _without_accumulators(model, accumulation)
    loss = next((v.name for v in model.graph.output if v.name not in accumulation.removed_outputs), None)
    roles = _artifact_roles(out.graph, accumulation.grads, set(frozen_params), loss, name)
    logger.info(
        "loaded ORT training artifact %s: %d parameters with gradients, %d accumulators removed, batch inputs %s",
        name, len(accumulation.grads), accumulation.count,
        ", ".join(n for n in dict.fromkeys(v.name for v in model.graph.input) if roles.get(n) == Role.INPUT),
    )
    return TrainingGraph(model=out, roles=roles, state_pairs={}, name=name)


@dataclasses.dataclass(frozen=True)
class _Accumulation:
    """What the artifact's gradient accumulators read and write."""

    grads: dict[str, str]  # parameter -> its gradient value
    removed_inputs: frozenset[str]  # accumulation buffers, and lazy_reset_grad if only they read it
    removed_outputs: frozenset[str]  # the accumulators' outputs
    count: int  # accumulator nodes


def _is_accumulator(node: onnx.NodeProto) -> bool:
    return node.domain == ORT_DOMAIN and node.op_type in ACCUMULATOR_OPS


def _read_accumulators(graph: onnx.GraphProto, name: str) -> _Accumulation:
    """The gradients the accumulators read and the values that go with them; raises
    :class:`ModelLoadError` for a graph without accumulators (eval or optimizer model) or with
    one whose gradient is not of a graph input."""
    accumulators = [n for n in graph.node if _is_accumulator(n)]
    if not accumulators:
        has_optimizer = any(n.domain == ORT_DOMAIN and n.op_type in OPTIMIZER_OPS for n in graph.node)
        what = "an optimizer graph" if has_optimizer else "no gradient accumulators (an eval or inference graph)"
        raise ModelLoadError(
            f"{name} is {what}, not an ORT training graph: pass the training_model.onnx that "
            "generate_artifacts wrote"
        )
    inputs = {v.name for v in graph.input}
    grads: dict[str, str] = {}
    removed_inputs: set[str] = set()
    removed_outputs: set[str] = set()
    for node in accumulators:
        if len(node.input) < 2:
            raise ModelLoadError(f"{name}: {node.op_type} node {node.name!r} has no gradient input")
        buffer, grad = node.input[0], node.input[1]
        param = _param_of(buffer, grad)
        if param not in inputs:
            raise ModelLoadError(
                f"{name}: gradient {grad!r} accumulates into {buffer!r} but {param!r} is not a graph input; "
                "regenerate the artifacts with the parameters in requires_grad"
            )
        grads[param] = grad
        removed_inputs.add(buffer)
        removed_inputs.update(n for n in node.input[2:] if n)
        removed_outputs.update(o for o in node.output if o)
    consumers: dict[str, int] = {}
    for node in graph.node:
        for value in node.input:
            consumers[value] = consumers.get(value, 0) + 1
    for value in sorted(removed_inputs):  # lazy_reset_grad etc. only when nothing else reads it
        if consumers.get(value, 0) > sum(value in n.input for n in accumulators):
            removed_inputs.discard(value)
    return _Accumulation(grads, frozenset(removed_inputs), frozenset(removed_outputs), len(accumulators))


def _without_accumulators(model: onnx.ModelProto, accumulation: _Accumulation) -> onnx.ModelProto:
    """A copy of ``model`` without the accumulators and their inputs and outputs, with each
    gradient an output (its parameter's type and shape)."""
    inputs = {v.name: v for v in model.graph.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    kept_nodes = [n for n in g.node if not _is_accumulator(n)]
    del g.node[:]
    g.node.extend(kept_nodes)
    kept_inputs = [v for v in g.input if v.name not in accumulation.removed_inputs]
    del g.input[:]
    g.input.extend(kept_inputs)
    kept_outputs = [v for v in g.output if v.name not in accumulation.removed_outputs]
    del g.output[:]
    g.output.extend(kept_outputs)
    for param, grad in accumulation.grads.items():
        value = g.output.add()
        value.CopyFrom(inputs[param])
        value.name = grad
    drop_info = accumulation.removed_outputs | accumulation.removed_inputs
    kept_info = [v for v in g.value_info if v.name not in drop_info and v.name not in accumulation.grads.values()]
    del g.value_info[:]
    g.value_info.extend(kept_info)
    return out


def _artifact_roles(g: onnx.GraphProto, grads: dict[str, str], frozen: set[str], loss: str | None,
                    name: str) -> dict[str, Role]:
    """Parameters (trainable or ``frozen``) PARAM, other inputs INPUT, gradients GRAD, the
    first remaining output LOSS, the rest ACTIVATION."""
    roles: dict[str, Role] = {}
    for value in g.input:
        roles[value.name] = Role.PARAM if value.name in grads or value.name in frozen else Role.INPUT
    for node in g.node:
        for value in node.output:
            if value:
                roles.setdefault(value, Role.ACTIVATION)
    for grad in grads.values():
        roles[grad] = Role.GRAD
    if loss is None:
        raise ModelLoadError(f"{name}: the training graph has no loss output")
    roles[loss] = Role.LOSS
    return roles


def _param_of(buffer: str, grad: str) -> str:
    if buffer.endswith(ACCUMULATION_BUFFER_SUFFIX):
        return buffer[: -len(ACCUMULATION_BUFFER_SUFFIX)]
    if grad.endswith(GRAD_SUFFIX):
        return grad[: -len(GRAD_SUFFIX)]
    return grad


def check_runnable(graph: TrainingGraph) -> None:
    """Raise :class:`UnsupportedGraphError` unless this onnxruntime build has a kernel for
    every op of ``graph`` (ORT's gradient ops exist only in the training build)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = ort_log_severity()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedGraphError(
            f"onnxruntime {ort.__version__} cannot run {graph.name} ({first}); ORT training artifacts "
            f"need {TRAINING_BUILD}: run in .venv-compat (make compat)"
        ) from e


def read_checkpoint(path: str | os.PathLike) -> dict[str, tuple[np.ndarray, bool]]:
    """Parameters of an artifact ``checkpoint``: name -> (value, requires_grad)."""
    try:
        from onnxruntime.training.api import CheckpointState
    except ImportError as e:
        raise ModelLoadError(
            f"reading {path} needs {TRAINING_BUILD} (onnxruntime.training): run in .venv-compat (make compat)"
        ) from e
    try:
        state = CheckpointState.load_checkpoint(str(path))
        return {name: (np.array(p.data), bool(p.requires_grad)) for name, p in state.parameters}
    except Exception as e:
        raise ModelLoadError(f"cannot read checkpoint {path} ({str(e).strip().splitlines()[0]})") from e


def load_training_artifact(
    path: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None, model: onnx.ModelProto | None = None
) -> tuple[TrainingGraph, dict[str, np.ndarray] | None]:
    """Load an artifact ``training_model.onnx`` as a runnable training graph.

    ``checkpoint``: the artifact's checkpoint (default: ``checkpoint`` beside the file, when it
    exists and this build can read it); it supplies parameter values and names the frozen
    parameters. Returns the graph and the parameter values (None without a checkpoint).
    ``model``: the file's contents, if already loaded.
    """
    from graph_passes.ir.validate import load_model

    path = Path(path)
    model = load_model(path) if model is None else model
    params = None
    if checkpoint is None and (path.parent / CHECKPOINT_FILE).is_file() and _has_training_api():
        checkpoint = path.parent / CHECKPOINT_FILE
    if checkpoint is not None:
        params = read_checkpoint(checkpoint)
    frozen = [n for n, (_, trainable) in (params or {}).items() if not trainable]
    graph = training_graph_from_artifact(model, name=path.stem, frozen_params=frozen)
    check_runnable(graph)
    values = None
    if params is not None:
        values = {n: v for n, (v, _) in params.items() if graph.roles.get(n) == Role.PARAM}
        missing = [n for n in graph.state_inputs if n not in values]
        if missing:
            raise ModelLoadError(f"checkpoint {checkpoint} has no value for parameter {missing[0]!r}")
    return graph, values


def _has_training_api() -> bool:
    try:
        import onnxruntime.training.api  # noqa: F401
    except ImportError:
        return False
    return True


# ---- generation (the training build's onnxruntime.training) ------------------------------


def add_layer_norm_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose LayerNormalization nodes name their optional mean and
    inverse-std outputs (ORT's gradient builder needs them; torch's exporter omits them)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for index, node in enumerate(out.graph.node):
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < LAYER_NORM_OUTPUTS:
                node.output.append(f"{node.name or f'layer_norm{index}'}_saved{len(node.output)}")
    return out


def generate_training_artifacts(
    model: onnx.ModelProto, *, requires_grad: Sequence[str], directory: str | os.PathLike,
    frozen_params: Sequence[str] = (),
) -> Path:
    """Run ORT's ``generate_artifacts`` (cross-entropy loss, AdamW) on a forward ``model``
    after :func:`add_layer_norm_outputs`; returns the path of ``training_model.onnx``."""
    try:
        from onnxruntime.training import artifacts
    except ImportError as e:
        raise ModelLoadError(f"generating ORT training artifacts needs {TRAINING_BUILD}: run in .venv-compat") from e
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    initializers = {t.name for t in model.graph.initializer}
    missing = [n for n in requires_grad if n not in initializers]
    if missing:
        raise ModelLoadError(
            f"parameter {missing[0]!r} is not an initializer of the exported model (the exporter merged or "
            "folded it: give parameters distinct values and export without constant folding)"
        )
    artifacts.generate_artifacts(
        add_layer_norm_outputs(model), requires_grad=list(requires_grad), frozen_params=list(frozen_params),
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(directory),
    )
    return directory / "training_model.onnx"
