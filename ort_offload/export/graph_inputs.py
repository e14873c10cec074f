"""Inputs for running a training-step graph that came as a file, without its torch model.

``--input name=8x128`` fixes symbolic dimensions; state inputs get a deterministic start
(parameters small normal values, optimizer state zeros, ``optimizer.step`` 1, ``optimizer.lr``
1e-3); batch tensors are random: floats standard normal, integers 0 or 1 (valid as token ids
and class labels for any vocabulary), booleans False.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import numpy as np

from graph_passes.ir.shapes import declared_inputs
from graph_passes.ir.training_graph import Role, TrainingGraph
from ort_offload.export import optimizers
from ort_offload.errors import InputMismatchError

_SHAPE_RE = re.compile(r"^\s*([^=\s]+)\s*=\s*(\d+(?:\s*[x,]\s*\d+)*)?\s*$")
# The most elements one generated batch tensor may have (random values are drawn in host memory).
MAX_INPUT_ELEMENTS = 2**30


def parse_input_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Parse ``name=8x128`` (or ``name=8,128``; ``name=`` for a scalar); every dimension at
    least 1 and at most :data:`MAX_INPUT_ELEMENTS` elements in all."""
    shapes = {}
    for spec in specs:
        match = _SHAPE_RE.match(spec)
        if not match:
            raise InputMismatchError(f"cannot parse --input {spec!r}: write NAME=DIMS, e.g. ids=8x128")
        dims = match.group(2)
        shape = tuple(int(d) for d in re.split(r"\s*[x,]\s*", dims)) if dims else ()
        if any(d < 1 for d in shape):
            raise InputMismatchError(f"--input {spec!r}: every dimension must be at least 1 (a batch needs a sample)")
        if math.prod(shape) > MAX_INPUT_ELEMENTS:
            raise InputMismatchError(f"--input {spec!r}: more than {MAX_INPUT_ELEMENTS} elements; give a smaller shape")
        shapes[match.group(1)] = shape
    return shapes


def _concrete_shape(name: str, dims, given: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    shape = _shape_from(name, dims, given)
    if math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise InputMismatchError(f"input {name!r} of shape {list(shape)} has more than {MAX_INPUT_ELEMENTS} elements: "
                                 "too large to fill with generated values")
    return shape


def _shape_from(name: str, dims, given: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    if dims is None and name not in given:
        raise InputMismatchError(f"input {name!r} declares no shape: pass it, e.g. --input {name}=8x16")
    if name in given:
        if dims is None:
            return given[name]
        shape = given[name]
        if len(shape) != len(dims) or any(isinstance(d, int) and d > 0 and d != s for d, s in zip(dims, shape)):
            raise InputMismatchError(f"--input {name}={'x'.join(map(str, shape))} does not match the graph's shape {list(dims)}")
        return shape
    if any(not isinstance(d, int) or d <= 0 for d in dims):
        raise InputMismatchError(
            f"input {name!r} has symbolic shape {list(dims)}: pass its size, e.g. --input {name}="
            + "x".join(str(d) if isinstance(d, int) and d > 0 else "8" for d in dims)
        )
    return tuple(dims)


def random_state(graph: TrainingGraph, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Start values of every state input (deterministic for the seed)."""
    rng = np.random.default_rng(seed)
    declared = declared_inputs(graph.model)
    state = {}
    for name in graph.state_inputs:
        dtype, dims = declared[name]
        shape = _concrete_shape(name, dims, {})
        if name == optimizers.STEP_INPUT:
            state[name] = np.ones(shape, dtype=dtype)
        elif name == optimizers.LR_INPUT:
            state[name] = np.full(shape, 1e-3, dtype=dtype)
        elif graph.roles.get(name) == Role.PARAM and np.issubdtype(dtype, np.floating):
            state[name] = (rng.standard_normal(shape) * 0.02).astype(dtype)
        else:
            state[name] = np.zeros(shape, dtype=dtype)
    return state


def random_batch(graph: TrainingGraph, shapes: Mapping[str, tuple[int, ...]], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random batch tensors for every data input."""
    rng = np.random.default_rng(seed)
    declared = declared_inputs(graph.model)
    unknown = sorted(set(shapes) - set(graph.data_inputs))
    if unknown:
        raise InputMismatchError(f"--input {unknown[0]}: the graph's batch inputs are {', '.join(graph.data_inputs)}")
    batch = {}
    for name in graph.data_inputs:
        dtype, dims = declared[name]
        shape = _concrete_shape(name, dims, shapes)
        if np.issubdtype(dtype, np.floating):
            batch[name] = rng.standard_normal(shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            batch[name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            batch[name] = np.zeros(shape, dtype=dtype)
    return batch


# Ops that pass integer indices through unchanged (a batch input may reach a Gather through them).
_INDEX_PASSTHROUGH = {"Cast", "Reshape", "Flatten", "Unsqueeze", "Squeeze", "Identity"}


def gather_index_limits(model, table_shapes: Mapping[str, Sequence[int]],
                        batch_names: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Batch inputs that index a table: name -> (rows of the table, the table's name).

    A batch input (or a value it passes through unchanged: Cast, Reshape...) used as the
    indices of a ``Gather`` whose data is a state tensor or an initializer (an embedding) must hold ids in
    ``0 .. rows - 1``; torch raises on anything else, ONNX Runtime would wrap negative ones.
    """
    source = {n: n for n in batch_names}
    table_shapes = {**{t.name: tuple(t.dims) for t in model.graph.initializer}, **table_shapes}
    limits: dict[str, tuple[int, str]] = {}
    for node in model.graph.node:
        if node.op_type in _INDEX_PASSTHROUGH and node.input and node.input[0] in source:
            for out in node.output:
                source[out] = source[node.input[0]]
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in source:
            table = node.input[0]
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            shape = table_shapes.get(table)
            if shape is not None and -len(shape) <= axis < len(shape):
                rows = int(shape[axis])
                name = source[node.input[1]]
                limits[name] = min(limits.get(name, (rows, table)), (rows, table))
    return limits


def check_batch(feeds: Mapping[str, np.ndarray], index_limits: Mapping[str, tuple[int, str]]) -> dict[str, np.ndarray]:
    """``feeds`` if no tensor is empty and every index input is within its table; else
    :class:`InputMismatchError` naming the tensor."""
    for name, array in feeds.items():
        if array.size == 0:
            raise InputMismatchError(f"batch tensor {name!r} has no elements (shape {list(array.shape)}): "
                                     "a step needs at least one sample")
        if name in index_limits and np.issubdtype(array.dtype, np.integer):
            rows, table = index_limits[name]
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise InputMismatchError(f"{name!r} holds {bad}, outside 0..{rows - 1}: {table} has {rows} rows "
                                         "(token ids must be below the vocabulary size and not negative)")
    return dict(feeds)
