"""Idiom table of ONNX op types and the 9-element operator signature (DyNN-Offload §IV-A).

Owns :data:`IDIOMS`, :data:`IDIOM_TABLE` (ONNX op type → how many times each of the six idioms
occurs in the op's loop nest, with the reasoning), :func:`idiom_counts` and
:func:`op_signature`.

The six idioms, as 2-D patterns (paper's examples):

- transpose  ``A[i,j] = B[j,i]``      (any re-indexing of the same elements: transpose,
  reshape, unsqueeze, squeeze; the paper counts ``unsqueeze`` as a transpose)
- gather     ``A[i,j] = B[C[i,j]]``   (indirect or strided read: Gather, Slice, Split, Expand)
- scatter    ``B[C[i,j]] = A[i,j]``   (indirect or offset write: ScatterND, Concat, Pad)
- reduction  ``a = a + A[i,j]``       (a loop whose result drops an axis: Reduce*, the k-loop of
  MatMul/Gemm/Conv, softmax's max and sum, normalization statistics)
- stream     ``A[i,j] = A[i,j] + B[i,j]`` (element-wise map over aligned elements)
- stencil    ``A[i,j] = A[i-1,j] + A[i+1,j]`` (each output reads a window of neighbours:
  convolution, pooling, prefix sums, recurrences)

Counts are *static occurrences* of a pattern in the op's reference loop nest, not trip counts
(the paper's matmul example: unsqueeze → 1 transpose, multiply → 1 stream, sum → 1 reduction).
The table was written by hand from each op's ONNX definition (the paper's LLVM idiom finder is
not available); the reason column says which loops were counted. Ops with the same idioms and
shapes (Relu and Sigmoid) are deliberately indistinguishable, as in the paper.

Operator signature: ``[#transpose, #gather, #scatter, #reduction, #stream, #stencil, d0, d1,
d2]`` where ``d_k`` is the sum over the op's inputs of the size of axis ``k`` (0 when the input
has no axis ``k`` or its size is symbolic); the paper's ``(ar + br, ac + bc, 0)`` for a matmul.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "IDIOMS",
    "IDIOM_TABLE",
    "SIGNATURE_SIZE",
    "IdiomEntry",
    "UnknownOpError",
    "idiom_counts",
    "op_signature",
]

IDIOMS = ("transpose", "gather", "scatter", "reduction", "stream", "stencil")
DIM_AXES = 3
"""Axes whose sizes (summed over inputs) end the signature."""
SIGNATURE_SIZE = len(IDIOMS) + DIM_AXES


class UnknownOpError(KeyError):
    """An op type has no entry in :data:`IDIOM_TABLE`; add one (counts and reason)."""


@dataclass(frozen=True)
class IdiomEntry:
    """Idiom counts of one op type, in :data:`IDIOMS` order, and why."""

    counts: tuple[int, int, int, int, int, int]
    reason: str


def _e(transpose=0, gather=0, scatter=0, reduction=0, stream=0, stencil=0, *, why: str) -> IdiomEntry:
    return IdiomEntry((transpose, gather, scatter, reduction, stream, stencil), why)


_ELEMENTWISE = "one element-wise loop over aligned (broadcast) elements"
_UNARY = [
    "Abs", "Ceil", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "Identity", "IsInf",
    "IsNaN", "LeakyRelu", "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid",
    "Sign", "Sin", "Softplus", "Sqrt", "Tanh", "Cast", "CastLike", "Dropout", "Clip", "Mish", "HardSwish",
]
_BINARY = [
    "Add", "And", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Mean",
    "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Sum", "Where", "Xor", "BitShift",
]

IDIOM_TABLE: Mapping[str, IdiomEntry] = {
    **{op: _e(stream=1, why=_ELEMENTWISE) for op in _UNARY + _BINARY},
    # Re-indexing of the same elements.
    "Transpose": _e(transpose=1, why="A[perm(i)] = B[i]: one permuted copy"),
    "Reshape": _e(transpose=1, why="same elements under a new index map (counted like the paper's unsqueeze)"),
    "Flatten": _e(transpose=1, why="same elements under a new index map"),
    "Squeeze": _e(transpose=1, why="drops unit axes: an index re-map"),
    "Unsqueeze": _e(transpose=1, why="adds unit axes: the paper's example of a transpose"),
    "DepthToSpace": _e(transpose=1, why="block re-arrangement of elements"),
    "SpaceToDepth": _e(transpose=1, why="block re-arrangement of elements"),
    # Reads through an index or a stride.
    "Gather": _e(gather=1, why="A[i] = B[C[i]]"),
    "GatherElements": _e(gather=1, why="A[i,j] = B[C[i,j], j]"),
    "GatherND": _e(gather=1, why="A[i] = B[C[i,:]]"),
    "Slice": _e(gather=1, why="strided read A[i] = B[start + step*i]"),
    "Split": _e(gather=1, why="each output reads an offset window of the input"),
    "Expand": _e(gather=1, why="broadcast read A[i,j] = B[0,j]"),
    "Tile": _e(gather=1, why="periodic read A[i] = B[i mod n]"),
    "Resize": _e(gather=1, stream=1, why="reads interpolation neighbours by computed index, then weights them"),
    "Compress": _e(gather=1, reduction=1, why="prefix count of the condition, then indexed read"),
    # Writes through an index or an offset.
    "ScatterND": _e(scatter=1, why="B[C[i,:]] = A[i]"),
    "ScatterElements": _e(scatter=1, why="B[C[i,j], j] = A[i,j]"),
    "Concat": _e(scatter=1, why="each input is written at an offset of the output"),
    "Pad": _e(scatter=1, stream=1, why="fill, then write the input at an offset"),
    "OneHot": _e(scatter=1, stream=1, why="fill with off-value, then B[i, C[i]] = on"),
    # Reductions.
    "ReduceSum": _e(reduction=1, why="a = a + A[i]"),
    "ReduceMean": _e(reduction=1, stream=1, why="sum, then scale"),
    "ReduceMax": _e(reduction=1, why="a = max(a, A[i])"),
    "ReduceMin": _e(reduction=1, why="a = min(a, A[i])"),
    "ReduceProd": _e(reduction=1, why="a = a * A[i]"),
    "ReduceL1": _e(reduction=1, stream=1, why="abs map, then sum"),
    "ReduceL2": _e(reduction=1, stream=2, why="square map, sum, sqrt"),
    "ReduceLogSumExp": _e(reduction=2, stream=2, why="max, exp map, sum, log"),
    "ReduceSumSquare": _e(reduction=1, stream=1, why="square map, then sum"),
    "ArgMax": _e(reduction=1, why="running arg-max over one axis"),
    "ArgMin": _e(reduction=1, why="running arg-min over one axis"),
    "TopK": _e(reduction=1, gather=1, why="selection over one axis, then indexed read of values"),
    "Softmax": _e(reduction=2, stream=2, why="max and sum reductions; exp(x - max) and divide maps"),
    "LogSoftmax": _e(reduction=2, stream=2, why="max and sum reductions; x - max - log(sum) maps"),
    "LayerNormalization": _e(reduction=2, stream=2, why="mean and variance reductions; normalize and affine maps"),
    "InstanceNormalization": _e(reduction=2, stream=2, why="per-channel mean and variance; normalize and affine"),
    "GroupNormalization": _e(reduction=2, stream=2, transpose=1, why="regroup channels; mean, variance; normalize, affine"),
    "BatchNormalization": _e(reduction=2, stream=2, why="batch mean and variance (training mode); normalize, affine"),
    "GlobalAveragePool": _e(reduction=1, stream=1, why="sum over spatial axes, then scale"),
    "GlobalMaxPool": _e(reduction=1, why="max over spatial axes"),
    # Contractions: the paper's matmul = unsqueeze (transpose) + multiply (stream) + sum (reduction).
    "MatMul": _e(transpose=1, reduction=1, stream=1, why="paper Fig. 3: unsqueeze, multiply, sum over k"),
    "Gemm": _e(transpose=1, reduction=1, stream=2,
               why="matmul (transpose, stream, reduction) plus alpha*AB + beta*C (stream); transA/transB add transposes"),
    "Einsum": _e(transpose=1, reduction=1, stream=1, why="broadcast re-index, multiply, contract"),
    # Windows of neighbours.
    "Conv": _e(stencil=1, reduction=1, stream=1, why="window read (stencil), multiply-accumulate over window and channels, bias add"),
    "ConvTranspose": _e(stencil=1, scatter=1, reduction=1, stream=1,
                        why="each input scatters a weighted window into the output; channel sum; bias"),
    "MaxPool": _e(stencil=1, reduction=1, why="window read, max over the window"),
    "AveragePool": _e(stencil=1, reduction=1, stream=1, why="window read, sum, scale"),
    "LpPool": _e(stencil=1, reduction=1, stream=2, why="window read, power map, sum, root"),
    "CumSum": _e(stencil=1, why="A[i] = A[i-1] + B[i]: a one-sided recurrence"),
    "LSTM": _e(stencil=1, transpose=1, reduction=1, stream=2,
               why="recurrence over time (stencil), gate matmuls (transpose, reduction), gate maps"),
    "GRU": _e(stencil=1, transpose=1, reduction=1, stream=2, why="as LSTM"),
    "RNN": _e(stencil=1, transpose=1, reduction=1, stream=1, why="as LSTM with one gate map"),
    "Trilu": _e(stream=1, why="masked element-wise copy"),
    # Producers of constants and shapes: no loop over a data tensor.
    "Constant": _e(why="no loop: a value baked into the graph"),
    "Shape": _e(why="reads metadata only"),
    "Size": _e(why="reads metadata only"),
    "ConstantOfShape": _e(stream=1, why="one fill loop"),
    "Range": _e(stream=1, why="one fill loop A[i] = start + i*delta"),
    "EyeLike": _e(stream=1, why="one fill loop"),
    "RandomNormalLike": _e(stream=1, why="one fill loop"),
    "RandomUniformLike": _e(stream=1, why="one fill loop"),
    "Bernoulli": _e(stream=1, why="one element-wise draw"),
}


def idiom_counts(op_type: str, attributes: Mapping[str, object] | None = None) -> np.ndarray:
    """Six idiom counts of ``op_type`` (float64). ``Gemm`` adds one transpose per set
    ``transA``/``transB`` attribute. Raises :class:`UnknownOpError` for a missing op type."""
    try:
        entry = IDIOM_TABLE[op_type]
    except KeyError:
        raise UnknownOpError(
            f"op type {op_type!r} has no idiom entry; add it to pilot.idioms.IDIOM_TABLE with counts and a reason"
        ) from None
    counts = np.asarray(entry.counts, dtype=np.float64)
    if op_type == "Gemm" and attributes:
        counts[0] += int(bool(attributes.get("transA", 0))) + int(bool(attributes.get("transB", 0)))
    return counts


def op_signature(
    op_type: str,
    input_shapes: Sequence[Sequence[int | None] | None],
    attributes: Mapping[str, object] | None = None,
) -> np.ndarray:
    """9-element signature of one op: idiom counts, then per-axis sizes summed over inputs.

    ``input_shapes``: one entry per input (None for an absent/unknown shape; ``None`` or a
    non-positive entry for a symbolic axis, which counts 0)."""
    dims = np.zeros(DIM_AXES, dtype=np.float64)
    for shape in input_shapes:
        for axis, size in enumerate(list(shape or ())[:DIM_AXES]):
            if isinstance(size, int) and size > 0:
                dims[axis] += size
    return np.concatenate([idiom_counts(op_type, attributes), dims])
