"""Inputs for running a training-step graph that came as a file, without its torch model.

``--input name=8x128`` fixes symbolic dimensions; state inputs get a deterministic start
(parameters small normal values, optimizer state zeros, ``optimizer.step`` 1, ``optimizer.lr``
1e-3); batch tensors are random: floats standard normal, integers 0 or 1 (valid as token ids
and class labels for any vocabulary), booleans False.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

from graph_passes.shapes import declared_inputs
from graph_passes.training_graph import Role, TrainingGraph
from ort_offload import optimizers
from ort_offload.errors import InputMismatchError

_SHAPE_RE = re.compile(r"^\s*([^=\s]+)\s*=\s*(\d+(?:\s*[x,]\s*\d+)*)?\s*$")


def parse_input_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Parse ``name=8x128`` (or ``name=8,128``; ``name=`` for a scalar)."""
    shapes = {}
    for spec in specs:
        match = _SHAPE_RE.match(spec)
        if not match:
            raise InputMismatchError(f"cannot parse --input {spec!r}: write NAME=DIMS, e.g. ids=8x128")
        dims = match.group(2)
        shapes[match.group(1)] = tuple(int(d) for d in re.split(r"\s*[x,]\s*", dims)) if dims else ()
    return shapes


def _concrete_shape(name: str, dims, given: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
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
