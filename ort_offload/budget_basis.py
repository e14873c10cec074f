"""What a fraction budget (``"0.5x"``) is a fraction of: the unplanned peak of one input signature.

A trainer whose inputs change shape resolves the fraction once, against the largest signature
it is told about (``max_shapes``), else the first batch; every later signature is planned under
those bytes. A graph that ``ort-offload transform`` planned carries the original step's peak in
its metadata, so a fraction of it means what it meant for the original graph.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np
import onnx

from ort_offload.errors import InputMismatchError, ModelLoadError

__all__ = ["BASIS_KEY", "BudgetBasis", "FIRST_BATCH", "MAX_SHAPES", "RECORDED", "basis_for", "max_batch",
           "recorded_basis", "record_basis"]

BASIS_KEY = "ort_offload.budget_basis"  # model metadata: the original step's peak, written by transform
FIRST_BATCH = "first batch"
MAX_SHAPES = "max_shapes"
RECORDED = "recorded by transform"  # the original graph's peak, read from a planned graph's metadata


@dataclasses.dataclass(frozen=True)
class BudgetBasis:
    """The unplanned peak a fraction budget resolves against, the batch shapes it was measured
    at, and where those shapes came from (:data:`FIRST_BATCH`, :data:`MAX_SHAPES`, :data:`RECORDED`)."""

    peak_bytes: int
    source: str
    shapes: Mapping[str, tuple[int, ...]]

    def as_report(self) -> dict[str, Any]:
        """The report's ``budget_resolved_against`` value."""
        return {"source": self.source, "shapes": {n: list(s) for n, s in self.shapes.items()},
                "peak_bytes": self.peak_bytes}

    def describe_shapes(self) -> str:
        return " ".join(f"{n}={'x'.join(map(str, s))}" for n, s in self.shapes.items())


def record_basis(model: onnx.ModelProto, basis: BudgetBasis) -> None:
    """Write ``basis`` (peak and shapes) into ``model``'s metadata, replacing any there."""
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != BASIS_KEY]
    del model.metadata_props[:]
    for key, value in kept:
        model.metadata_props.add(key=key, value=value)
    value = json.dumps({"peak_bytes": basis.peak_bytes, "shapes": {n: list(s) for n, s in basis.shapes.items()}},
                       sort_keys=True)
    model.metadata_props.add(key=BASIS_KEY, value=value)


def recorded_basis(model: onnx.ModelProto) -> BudgetBasis | None:
    """The original step's peak a planned graph carries, or None for a graph never transformed."""
    text = next((p.value for p in model.metadata_props if p.key == BASIS_KEY), None)
    if text is None:
        return None
    try:
        data = json.loads(text)
        peak, shapes = data["peak_bytes"], data["shapes"]
        if not (isinstance(peak, int) and peak > 0 and isinstance(shapes, dict)):
            raise ValueError("not a positive peak and a mapping of shapes")
        shapes = {str(n): tuple(int(d) for d in s) for n, s in shapes.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"the graph's {BASIS_KEY} metadata is corrupt ({e}): transform the original graph again")
    return BudgetBasis(peak, RECORDED, shapes)


def basis_for(model: onnx.ModelProto, name: str, shapes: Mapping[str, tuple[int, ...]], *, fraction: bool
              ) -> BudgetBasis | None:
    """The original step's peak a planned graph records, where it was recorded at batch
    ``shapes``; None for a graph never transformed, or (a budget in bytes) other shapes. A
    ``fraction`` budget at other shapes has no peak to be a fraction of: InputMismatchError."""
    basis = recorded_basis(model)
    if basis is None:
        return None
    given = {n: tuple(s) for n, s in shapes.items() if n in basis.shapes}
    if given == dict(basis.shapes):
        return basis
    if fraction:
        raise InputMismatchError(
            f"{name} was planned by ort-offload transform for {basis.describe_shapes()}, and a fraction budget is a "
            f"fraction of the original step's peak at those shapes: use those shapes (--input), give the budget in "
            "bytes, or transform the original graph again for these shapes")
    return None


def max_batch(example: Mapping[str, np.ndarray], declared: Mapping[str, tuple], max_shapes: Mapping[str, Any]
              ) -> dict[str, np.ndarray]:
    """A batch of the largest shapes ``max_shapes`` names, with the example's values repeated.

    ``max_shapes`` maps batch input names to shapes (``{"ids": (8, 512)}``) and/or dynamic axis
    names to sizes (``{"seq": 512}``); an input it does not name takes the sizes of the axes it
    shares with those that are named, and the example's for the rest."""
    shapes, sizes = _named_shapes(example, max_shapes, declared)
    batch = {}
    for name, array in example.items():
        if name in shapes:
            shape = shapes[name]
        else:
            dims = declared.get(name, (None, None))[1] or ()
            shape = tuple(sizes.get(d, s) if isinstance(d, str) else s for d, s in zip(dims, array.shape)) \
                if len(dims) == array.ndim else array.shape
        batch[name] = np.resize(array, shape) if array.size else np.zeros(shape, array.dtype)
    return batch


def _named_shapes(example, max_shapes, declared) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """The shapes ``max_shapes`` gives per input, and the size of every dynamic axis it fixes."""
    symbols = {d for name in example for d in (declared.get(name, (None, None))[1] or ()) if isinstance(d, str)}
    shapes, sizes = {}, {}
    for key, value in max_shapes.items():
        if key in example:
            shape = _shape(key, value)
            if len(shape) != example[key].ndim:
                raise InputMismatchError(f"max_shapes[{key!r}] = {list(shape)} has rank {len(shape)}; "
                                         f"{key!r} has rank {example[key].ndim}")
            shapes[key] = shape
            dims = declared.get(key, (None, None))[1] or ()
            sizes.update({d: s for d, s in zip(dims, shape) if isinstance(d, str)})
        elif key in symbols:
            sizes[key] = _shape(key, (value,))[0]
        else:
            known = ", ".join(sorted(example) + sorted(symbols))
            raise InputMismatchError(f"max_shapes names {key!r}, neither a batch input nor a dynamic axis: use {known}")
    return shapes, sizes


def _shape(key: str, value) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        shape = None
    if shape is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise InputMismatchError(f"max_shapes[{key!r}] = {value!r}: give whole sizes of at least 1")
    return tuple(int(d) for d in shape)
