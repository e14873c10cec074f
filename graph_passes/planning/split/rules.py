"""Split rules (TSPLIT): for each ONNX op type, the ways one node can be split into ``p``
micro-ops on micro-tensors, and how their outputs merge back.

A rule looks at a concrete node (:class:`NodeInfo`: op type, attributes, input and output
shapes, the values of constant inputs) and returns its :class:`SplitOption` s. An option says

- what is split (:class:`SplitAxis`): ``concat`` splits are named by the axis of output 0 they
  cut; ``sum`` and ``chain`` splits by the axis of the first input they slice (the contracted
  axis of a MatMul, the batch axis of a weight-gradient Conv, a reduced axis);
- for every input, how micro-op ``i`` of ``p`` sees it: a slice along an axis
  (:class:`SliceOn`; sizes as ``numpy.array_split``, so uneven splits work), the whole tensor
  (:class:`Whole`: weights, broadcast operands, axes inputs), a per-micro-op shape constant
  (:class:`MicroShape`: the target shape of a Reshape/Expand with the split dim shrunk), or the
  previous micro-op's output (:class:`Carry`: the accumulator of a ScatterND with add);
- for every output, how the micro-outputs merge (:class:`Merge`): Concat along an axis, Sum of
  partial sums (optionally scaled, for means computed as micro-sums), ``chain`` (the last
  micro-op's output is the result), or ``staged`` (a reduction whose micro-ops keep the split
  axis: Concat of the small partial reductions, then the reduction over them);
- micro-op overrides: another op type (ReduceMean over a split reduced axis becomes ReduceSum)
  or attributes (a mean loss becomes a sum loss).

:data:`SPLIT_RULES` maps op type to rule; :data:`UNSPLITTABLE` names the op types the exported
training graphs contain that are never split, with the reason. An op type in neither is not
split either (:func:`split_options` raises :class:`UnsplittableOpError`).
:mod:`graph_passes.planning.split.graph_pass` applies a choice.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir

from graph_passes.ir.shapes import TensorInfo
from graph_passes.errors import UnsupportedGraphError

CONCAT = "concat"
SUM = "sum"
CHAIN = "chain"
STAGED = "staged"


class UnsplittableOpError(UnsupportedGraphError):
    """A node that has no split rule, or no split on the requested axis."""


# --- what an option says ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SliceOn:
    """Micro-op ``i`` reads piece ``i`` of this input along ``axis``."""

    axis: int


@dataclasses.dataclass(frozen=True)
class Whole:
    """Every micro-op reads the whole input (weights, broadcast operands, axes, absent inputs)."""


@dataclasses.dataclass(frozen=True)
class MicroShape:
    """An int64 shape input replaced per micro-op: ``shape`` with ``shape[axis]`` = piece size."""

    shape: tuple[int, ...]
    axis: int


@dataclasses.dataclass(frozen=True)
class Carry:
    """Micro-op ``i > 0`` reads output ``output`` of micro-op ``i - 1``; micro-op 0 the input."""

    output: int


@dataclasses.dataclass(frozen=True)
class AxesInput:
    """An int64 axes input replaced, for every micro-op, by ``axes``."""

    axes: tuple[int, ...]


Part = SliceOn | Whole | MicroShape | Carry | AxesInput


@dataclasses.dataclass(frozen=True)
class Merge:
    """How the micro-outputs of one output become the output: ``concat`` along ``axis``;
    ``sum`` (times ``scale`` when given); ``chain`` (the last micro-output is the output);
    ``staged``: Concat along ``axis``, then ReduceSum over ``reduce_axes`` (``keepdims``),
    divided by ``divisor`` when given (a mean)."""

    kind: str
    axis: int | None = None
    scale: float | None = None
    reduce_axes: tuple[int, ...] = ()
    keepdims: int = 1
    divisor: int | None = None


@dataclasses.dataclass(frozen=True)
class SplitAxis:
    """Names one way of splitting a node: ``merge`` kind and axis (see the module docstring)."""

    merge: str
    axis: int

    def __str__(self) -> str:
        return f"{self.merge}@{self.axis}"


@dataclasses.dataclass(frozen=True)
class SplitOption:
    """One way of splitting a node: ``extent`` is the size of the dimension cut into pieces."""

    key: SplitAxis
    extent: int
    inputs: tuple[Part, ...]
    outputs: tuple[Merge, ...]
    op_type: str | None = None  # micro-op type when it differs from the node's
    attributes: tuple[tuple[str, Any], ...] = ()  # micro-op attribute overrides


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a rule needs to know about one node. Absent optional inputs have shape ``None``."""

    op_type: str
    attributes: Mapping[str, Any]
    input_shapes: tuple[tuple[int, ...] | None, ...]
    output_shapes: tuple[tuple[int, ...] | None, ...]
    constants: Mapping[int, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, node: onnx.NodeProto, infos: Mapping[str, TensorInfo],
           constants: Mapping[str, np.ndarray] | None = None) -> "NodeInfo":
        constants = constants or {}
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attributes = {k: v.decode() if isinstance(v, bytes) else v for k, v in attributes.items()}

        def shape(name: str):
            return infos[name].shape if name and name in infos else None

        return cls(
            op_type=node.op_type,
            attributes=attributes,
            input_shapes=tuple(shape(n) for n in node.input),
            output_shapes=tuple(shape(n) for n in node.output),
            constants={k: constants[n] for k, n in enumerate(node.input) if n and n in constants},
        )

    @classmethod
    def of_ir(cls, node: ir.Node, infos: Mapping[str, TensorInfo]) -> "NodeInfo":
        """:meth:`of` for an ``onnx_ir`` node (its constants: initializers and Constant nodes'
        outputs it reads). Attribute values as :meth:`of` gives them (lists, not tuples)."""
        attributes = {}
        for name, attr in node.attributes.items():
            value = attr.value
            if attr.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS):
                value = list(value)
            elif attr.type == ir.AttributeType.STRINGS:
                value = [v.encode() for v in value]
            attributes[name] = value

        def shape(value: ir.Value | None):
            return infos[value.name].shape if value is not None and value.name in infos else None

        constants = {k: c for k, c in ((k, ir_constant(v)) for k, v in enumerate(node.inputs)) if c is not None}
        return cls(
            op_type=node.op_type,
            attributes=attributes,
            input_shapes=tuple(shape(v) for v in node.inputs),
            output_shapes=tuple(shape(v if v.name else None) for v in node.outputs),
            constants=constants,
        )

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attributes.get(name, default)

    def shape(self, index: int) -> tuple[int, ...] | None:
        return self.input_shapes[index] if index < len(self.input_shapes) else None

    def has_input(self, index: int) -> bool:
        return self.shape(index) is not None

    def has_output(self, index: int) -> bool:
        return index < len(self.output_shapes) and self.output_shapes[index] is not None

    def ints(self, index: int) -> list[int] | None:
        """A constant integer input as a list (None when absent or not constant)."""
        value = self.constants.get(index)
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def chunk_sizes(extent: int, parts: int) -> tuple[int, ...]:
    """Piece sizes of a dimension of ``extent`` cut into ``parts`` (as numpy.array_split)."""
    if not 2 <= parts <= extent:
        raise UnsplittableOpError(f"cannot cut a dimension of {extent} into {parts} pieces: use 2 <= p <= {extent}")
    base, extra = divmod(extent, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


# --- rules ------------------------------------------------------------------------------------

class SplitRule(abc.ABC):
    """Base of the rules: ``options(node)`` lists the node's splits (possibly none)."""

    @abc.abstractmethod
    def options(self, node: NodeInfo) -> tuple[SplitOption, ...]:
        """Every way this node can be split, for its concrete shapes and attributes."""


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _broadcast_part(shape: tuple[int, ...] | None, out_shape: tuple[int, ...], out_axis: int) -> Part:
    """Slice of an operand broadcast (numpy rules) to ``out_shape``, for a split of ``out_axis``."""
    if shape is None:
        return Whole()
    axis = out_axis - (len(out_shape) - len(shape))
    if axis < 0 or shape[axis] == 1 and out_shape[out_axis] != 1:
        return Whole()
    return SliceOn(axis)


def _concat(axis: int, extent: int, inputs, outputs=None, count: int = 1, **kw) -> SplitOption:
    outputs = outputs if outputs is not None else tuple(Merge(CONCAT, axis) for _ in range(count))
    return SplitOption(SplitAxis(CONCAT, axis), extent, tuple(inputs), tuple(outputs), **kw)


def _outputs_count(node: NodeInfo) -> int:
    return len(node.output_shapes)


@dataclasses.dataclass(frozen=True)
class ElementwiseRule(SplitRule):
    """Any n-ary op with numpy broadcasting, one output of the broadcast shape: every output
    axis; operands broadcast along it are passed whole. Merge: Concat."""

    def options(self, node):
        out = node.output_shapes[0]
        return tuple(
            _concat(j, out[j], (_broadcast_part(s, out, j) for s in node.input_shapes))
            for j in range(len(out))
        )


@dataclasses.dataclass(frozen=True)
class NormalizedAxisRule(SplitRule):
    """Softmax/LogSoftmax/Hardmax (normalize along ``axis``): every other axis. Concat."""

    default_axis: int = -1

    def options(self, node):
        out = node.output_shapes[0]
        axis = _norm(node.attr("axis", self.default_axis), len(out))
        return tuple(_concat(j, out[j], [SliceOn(j)]) for j in range(len(out)) if j != axis)


@dataclasses.dataclass(frozen=True)
class LayerNormRule(SplitRule):
    """LayerNormalization: the axes before ``axis`` (rows); Scale and B whole. Y, Mean and
    InvStdDev all Concat on that axis."""

    def options(self, node):
        x = node.shape(0)
        axis = _norm(node.attr("axis", -1), len(x))
        rest = [Whole()] * (len(node.input_shapes) - 1)
        return tuple(_concat(j, x[j], [SliceOn(j)] + rest, count=_outputs_count(node)) for j in range(axis))


@dataclasses.dataclass(frozen=True)
class BatchNormRule(SplitRule):
    """BatchNormalization. Training mode (batch statistics): channels only, every per-channel
    input sliced too; Y Concat(1), running mean/var Concat(0). Inference mode: also the batch
    and spatial axes, per-channel inputs whole."""

    def options(self, node):
        x = node.shape(0)
        channel = _concat(1, x[1], [SliceOn(1)] + [SliceOn(0)] * 4,
                          [Merge(CONCAT, 1)] + [Merge(CONCAT, 0)] * (_outputs_count(node) - 1))
        if node.attr("training_mode", 0):
            return (channel,)
        others = tuple(_concat(j, x[j], [SliceOn(j)] + [Whole()] * 4) for j in range(len(x)) if j != 1)
        return (channel,) + others


@dataclasses.dataclass(frozen=True)
class MatMulRule(SplitRule):
    """MatMul (numpy semantics, 1-D operands included): batch axes (an operand broadcast along
    one is whole), rows of A, columns of B — Concat; the contracted axis K (A's last, B's
    second-to-last) — Sum of partial products (how weight gradients split over the batch)."""

    def options(self, node):
        a, b = node.shape(0), node.shape(1)
        out = node.output_shapes[0]
        ra, rb = len(a), len(b)
        batch_rank = len(out) - (ra >= 2) - (rb >= 2)
        options = []
        for j in range(batch_rank):
            parts = []
            for shape, rank in ((a, ra), (b, rb)):
                if rank <= 2:
                    parts.append(Whole())
                else:
                    axis = j - (batch_rank - (rank - 2))
                    parts.append(Whole() if axis < 0 or shape[axis] == 1 else SliceOn(axis))
            options.append(_concat(j, out[j], parts))
        if ra >= 2:
            options.append(_concat(batch_rank, out[batch_rank], [SliceOn(ra - 2), Whole()]))
        if rb >= 2:
            options.append(_concat(len(out) - 1, out[-1], [Whole(), SliceOn(rb - 1)]))
        k_b = rb - 2 if rb >= 2 else 0
        options.append(SplitOption(SplitAxis(SUM, ra - 1), a[-1], (SliceOn(ra - 1), SliceOn(k_b)), (Merge(SUM),)))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class GemmRule(SplitRule):
    """Gemm: rows M (A sliced, C as broadcast), columns N (B sliced) — Concat; the contracted
    axis K — Sum, only without C (it would be added p times)."""

    def options(self, node):
        out = node.output_shapes[0]
        trans_a, trans_b = node.attr("transA", 0), node.attr("transB", 0)
        c = node.shape(2)
        slots = len(node.input_shapes) - 2  # 1 when C is named (possibly empty), else 0
        options = [
            _concat(0, out[0], [SliceOn(1 if trans_a else 0), Whole()] + [_broadcast_part(c, out, 0)] * slots),
            _concat(1, out[1], [Whole(), SliceOn(0 if trans_b else 1)] + [_broadcast_part(c, out, 1)] * slots),
        ]
        if c is None:
            k_a = 0 if trans_a else 1
            options.append(SplitOption(SplitAxis(SUM, k_a), node.shape(0)[k_a],
                                       (SliceOn(k_a), SliceOn(1 if trans_b else 0)) + (Whole(),) * slots, (Merge(SUM),)))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ConvRule(SplitRule):
    """Conv: batch — Concat(0); output channels (W and B sliced, group 1) — Concat(1); input
    channels (X and W sliced, group 1, no bias) — Sum. The weight-gradient Conv of torch's
    export (over transposed input and gradient) has the batch as its input channels: Sum."""

    def options(self, node):
        x = node.shape(0)
        out = node.output_shapes[0]
        has_bias = node.has_input(2)
        rest = [Whole()] * (len(node.input_shapes) - 1)
        options = [_concat(0, out[0], [SliceOn(0)] + rest)]
        if node.attr("group", 1) == 1:
            options.append(_concat(1, out[1], [Whole(), SliceOn(0)] + ([SliceOn(0)] if len(node.input_shapes) > 2 else [])))
            if not has_bias:
                options.append(SplitOption(SplitAxis(SUM, 1), x[1], (SliceOn(1), SliceOn(1))
                                           + (Whole(),) * (len(node.input_shapes) - 2), (Merge(SUM),)))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ConvTransposeRule(SplitRule):
    """ConvTranspose (torch's input gradient of a Conv): batch — Concat(0); output channels
    (W axis 1 and B sliced, group 1) — Concat(1); input channels (X axis 1, W axis 0, group 1,
    no bias) — Sum. A full-rank ``output_shape`` attribute disables channel and batch splits."""

    def options(self, node):
        x = node.shape(0)
        out = node.output_shapes[0]
        if len(node.attr("output_shape", ())) == len(x):
            return ()
        rest = [Whole()] * (len(node.input_shapes) - 1)
        options = [_concat(0, out[0], [SliceOn(0)] + rest)]
        if node.attr("group", 1) == 1:
            options.append(_concat(1, out[1], [Whole(), SliceOn(1)] + ([SliceOn(0)] if len(node.input_shapes) > 2 else [])))
            if not node.has_input(2):
                options.append(SplitOption(SplitAxis(SUM, 1), x[1], (SliceOn(1), SliceOn(0))
                                           + (Whole(),) * (len(node.input_shapes) - 2), (Merge(SUM),)))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class PoolRule(SplitRule):
    """Pooling (windowed or global): batch and channels — Concat. Spatial axes would need a
    halo and are not split; MaxPool's Indices output (flat positions) refuses any split."""

    def options(self, node):
        if node.has_output(1):
            return ()
        out = node.output_shapes[0]
        return tuple(_concat(j, out[j], [SliceOn(j)]) for j in (0, 1))


@dataclasses.dataclass(frozen=True)
class GatherRule(SplitRule):
    """Gather (embedding lookup): output axes from the indices slice the indices (table
    whole); the others slice the table. Concat."""

    def options(self, node):
        data, indices = node.shape(0), node.shape(1)
        out = node.output_shapes[0]
        axis = _norm(node.attr("axis", 0), len(data))
        ri = len(indices)
        options = []
        for j in range(len(out)):
            if j < axis:
                parts = [SliceOn(j), Whole()]
            elif j < axis + ri:
                parts = [Whole(), SliceOn(j - axis)]
            else:
                parts = [SliceOn(j - ri + 1), Whole()]
            options.append(_concat(j, out[j], parts))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class GatherElementsRule(SplitRule):
    """GatherElements (the loss's pick of the target log-probability): every output axis
    slices the indices; the data too where its dim matches (on ``axis`` it stays whole). Concat."""

    def options(self, node):
        data, indices = node.shape(0), node.shape(1)
        axis = _norm(node.attr("axis", 0), len(data))
        options = []
        for j, size in enumerate(indices):
            if j == axis:
                options.append(_concat(j, size, [Whole(), SliceOn(j)]))
            elif data[j] == size:
                options.append(_concat(j, size, [SliceOn(j), SliceOn(j)]))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ScatterElementsRule(SplitRule):
    """ScatterElements (the loss's backward writes into zeros): axes other than ``axis`` where
    data, indices and updates agree — Concat; the indices along ``axis`` as a chain of
    micro-scatters into the previous result (same update order as the unsplit op)."""

    def options(self, node):
        data, indices = node.shape(0), node.shape(1)
        axis = _norm(node.attr("axis", 0), len(data))
        options = [
            _concat(j, data[j], [SliceOn(j)] * 3) for j in range(len(data)) if j != axis and data[j] == indices[j]
        ]
        # Along ``axis`` the indices hold the positions; along the others a slice would move
        # the rows it writes, so only ``axis`` chains.
        options.append(SplitOption(SplitAxis(CHAIN, axis), indices[axis], (Carry(0), SliceOn(axis), SliceOn(axis)),
                                   (Merge(CHAIN),)))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ScatterNDRule(SplitRule):
    """ScatterND (torch's embedding backward, ``reduction=add`` into zeros): the indices' batch
    axes as a chain of micro-scatters accumulating into the previous result; the data's
    trailing (non-indexed) axes — Concat, indices whole."""

    def options(self, node):
        data, indices = node.shape(0), node.shape(1)
        ri, depth = len(indices), indices[-1]
        options = [
            _concat(j, data[j], [SliceOn(j), Whole(), SliceOn(ri - 1 + j - depth)]) for j in range(depth, len(data))
        ]
        options += [SplitOption(SplitAxis(CHAIN, j), indices[j], (Carry(0), SliceOn(j), SliceOn(j)), (Merge(CHAIN),))
                    for j in range(ri - 1)]
        return tuple(options)


def _reduce_axes(node: NodeInfo, rank: int) -> list[int] | None:
    """Normalized reduced axes of a Reduce* node (attribute or constant input); None: unknown."""
    if "axes" in node.attributes:
        axes = list(node.attr("axes"))
    elif len(node.input_shapes) > 1 and node.has_input(1):
        axes = node.ints(1)
        if axes is None:
            return None
    else:
        axes = []
    if not axes:
        return None if node.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(_norm(a, rank) for a in axes)


@dataclasses.dataclass(frozen=True)
class ReduceRule(SplitRule):
    """Reduce*: kept axes — Concat on the matching output axis. A reduced axis, for ReduceSum —
    Sum; for ReduceMean — micro ReduceSum, Sum, times 1/(reduced elements). With ``staged``
    (ReduceSum, ReduceMean) and more than one reduced axis, also: micro-ops that reduce the other
    axes and keep the split one, merged by Concat (small) and one ReduceSum over it (divided by
    the count for a mean). A kernel that sums rows first and then the rows' sums in order gives
    its own bits this way; whether ONNX Runtime's does is probed, not assumed
    (:mod:`graph_passes.planning.split.reduction_order`)."""

    sum_merge: bool = False
    mean: bool = False
    staged: bool = False

    def options(self, node):
        x = node.shape(0)
        axes = _reduce_axes(node, len(x))
        if axes is None:
            return ()
        keep = node.attr("keepdims", 1)
        rest = [Whole()] * (len(node.input_shapes) - 1)
        options = []
        for i in range(len(x)):
            if i not in axes:
                j = i if keep else i - sum(1 for a in axes if a < i)
                options.append(_concat(j, x[i], [SliceOn(i)] + rest))
            elif self.sum_merge or self.mean:
                count = int(np.prod([x[a] for a in axes]))
                merge = Merge(SUM, scale=1.0 / count) if self.mean else Merge(SUM)
                options.append(SplitOption(SplitAxis(SUM, i), x[i], tuple([SliceOn(i)] + rest), (merge,),
                                           op_type="ReduceSum" if self.mean else None))
        if self.staged and len(axes) > 1 and node.ints(1) is not None:  # axes as an input (opset 18)
            options += [self._staged(node, x, axes, keep, i) for i in axes]
        return tuple(options)

    def _staged(self, node: NodeInfo, x: tuple[int, ...], axes: list[int], keep: int, i: int) -> SplitOption:
        """Split on reduced axis ``i``: micro ReduceSum over ``axes`` but ``i`` (an axes input,
        as opset 18 has it), keepdims."""
        others = tuple(a for a in axes if a != i)
        inputs = (SliceOn(i), AxesInput(others)) + (Whole(),) * (len(node.input_shapes) - 2)
        divisor = int(np.prod([x[a] for a in axes])) if self.mean else None
        merge = Merge(STAGED, axis=i, reduce_axes=tuple(axes), keepdims=keep, divisor=divisor)
        return SplitOption(SplitAxis(STAGED, i), x[i], inputs, (merge,), op_type="ReduceSum",
                           attributes=(("keepdims", 1),))


@dataclasses.dataclass(frozen=True)
class TransposeRule(SplitRule):
    """Transpose: output axis j is input axis perm[j]. Concat."""

    def options(self, node):
        x = node.shape(0)
        perm = node.attr("perm", list(reversed(range(len(x)))))
        out = node.output_shapes[0]
        return tuple(_concat(j, out[j], [SliceOn(perm[j])]) for j in range(len(out)))


@dataclasses.dataclass(frozen=True)
class ReshapeRule(SplitRule):
    """Reshape: an output axis whose size and whose prefix product equal an input axis's is that
    axis (the reshape acts on what is before and after it); the target shape becomes a
    per-micro-op constant. Concat."""

    def options(self, node):
        x, out = node.shape(0), node.output_shapes[0]
        options = []
        for j in range(len(out)):
            prefix = int(np.prod(out[:j]))
            for i in range(len(x)):
                if x[i] == out[j] and int(np.prod(x[:i])) == prefix and x[i] > 1:
                    options.append(_concat(j, out[j], [SliceOn(i), MicroShape(tuple(out), j)]))
                    break
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ExpandRule(SplitRule):
    """Expand: the input as a broadcast operand of the output; the shape becomes a per-micro-op
    constant. Concat."""

    def options(self, node):
        out = node.output_shapes[0]
        return tuple(_concat(j, out[j], [_broadcast_part(node.shape(0), out, j), MicroShape(tuple(out), j)])
                     for j in range(len(out)))


@dataclasses.dataclass(frozen=True)
class SqueezeRule(SplitRule):
    """Squeeze/Unsqueeze (axes constant): an axis that is neither removed nor inserted maps
    through. Concat."""

    unsqueeze: bool = False

    def options(self, node):
        x, out = node.shape(0), node.output_shapes[0]
        if "axes" in node.attributes:
            axes = list(node.attr("axes"))
        elif node.has_input(1):
            axes = node.ints(1)
            if axes is None:
                return ()
        else:
            axes = [] if self.unsqueeze else [i for i, s in enumerate(x) if s == 1]
        rank = len(out) if self.unsqueeze else len(x)
        axes = {_norm(a, rank) for a in axes}
        kept = [i for i in range(rank) if i not in axes]  # axes of the bigger side that map through
        rest = [Whole()] * (len(node.input_shapes) - 1)
        options = []
        for small, big in enumerate(kept):
            in_axis, out_axis = (small, big) if self.unsqueeze else (big, small)
            options.append(_concat(out_axis, out[out_axis], [SliceOn(in_axis)] + rest))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class FlattenRule(SplitRule):
    """Flatten: output axis 0 is input axis 0 when ``axis`` is 1; output axis 1 is the last
    input axis when ``axis`` is the last. Concat."""

    def options(self, node):
        x, out = node.shape(0), node.output_shapes[0]
        axis = _norm(node.attr("axis", 1), len(x))
        options = []
        if axis == 1:
            options.append(_concat(0, out[0], [SliceOn(0)]))
        if axis == len(x) - 1 and axis > 0:
            options.append(_concat(1, out[1], [SliceOn(axis)]))
        return tuple(options)


@dataclasses.dataclass(frozen=True)
class ConcatRule(SplitRule):
    """Concat: every axis but the concatenated one, all inputs sliced. Concat."""

    def options(self, node):
        out = node.output_shapes[0]
        axis = _norm(node.attr("axis"), len(out))
        return tuple(_concat(j, out[j], [SliceOn(j)] * len(node.input_shapes)) for j in range(len(out)) if j != axis)


@dataclasses.dataclass(frozen=True)
class SliceRule(SplitRule):
    """Slice (constant axes): the axes it does not slice. Concat."""

    def options(self, node):
        x, out = node.shape(0), node.output_shapes[0]
        starts = node.ints(1)
        if starts is None:
            return ()
        axes = node.ints(3) if node.has_input(3) and len(node.input_shapes) > 3 else list(range(len(starts)))
        if axes is None:
            return ()
        sliced = {_norm(a, len(x)) for a in axes}
        rest = [Whole()] * (len(node.input_shapes) - 1)
        return tuple(_concat(j, out[j], [SliceOn(j)] + rest) for j in range(len(out)) if j not in sliced)


@dataclasses.dataclass(frozen=True)
class LossRule(SplitRule):
    """SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss over scores (N, C, d...): the batch
    and the d axes. ``none`` — Concat; ``sum`` — Sum; ``mean`` (no weights, no ignore_index) —
    micro-ops with ``sum``, Sum, times 1/(N·∏d). The optional log_prob output Concats."""

    def options(self, node):
        scores = node.shape(0)
        reduction = node.attr("reduction", "mean")
        if reduction == "mean" and (node.has_input(2) or "ignore_index" in node.attributes):
            return ()  # the mean divides by the weight of the non-ignored targets
        rest = [Whole()] * (len(node.input_shapes) - 2)
        options = []
        for axis in [0] + list(range(2, len(scores))):
            target_axis = 0 if axis == 0 else axis - 1
            parts = [SliceOn(axis), SliceOn(target_axis)] + rest
            extra = [Merge(CONCAT, axis)] * (_outputs_count(node) - 1)
            if reduction == "none":
                options.append(_concat(target_axis, scores[axis], parts, [Merge(CONCAT, target_axis)] + extra))
            elif reduction == "sum":
                options.append(SplitOption(SplitAxis(SUM, axis), scores[axis], tuple(parts), (Merge(SUM), *extra)))
            else:
                count = int(np.prod([scores[0]] + list(scores[2:])))
                options.append(SplitOption(SplitAxis(SUM, axis), scores[axis], tuple(parts),
                                           (Merge(SUM, scale=1.0 / count), *extra), attributes=(("reduction", "sum"),)))
        return tuple(options)


ELEMENTWISE_OPS = (
    # arithmetic and comparisons (broadcasting)
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "Where",
    # unary math, activations and their backward building blocks
    "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Sign", "Floor", "Ceil", "Round",
    "Sin", "Cos", "Tanh", "Sigmoid", "HardSigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Gelu",
    "Softplus", "Softsign", "HardSwish", "Mish", "PRelu", "Clip", "Cast", "Identity", "IsNaN", "IsInf",
)

SPLIT_RULES: dict[str, SplitRule] = {op: ElementwiseRule() for op in ELEMENTWISE_OPS}
SPLIT_RULES.update({
    "Softmax": NormalizedAxisRule(), "LogSoftmax": NormalizedAxisRule(), "Hardmax": NormalizedAxisRule(),
    "LayerNormalization": LayerNormRule(),
    "BatchNormalization": BatchNormRule(),
    "MatMul": MatMulRule(),
    "Gemm": GemmRule(),
    "Conv": ConvRule(),
    "ConvTranspose": ConvTransposeRule(),
    **{op: PoolRule() for op in ("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")},
    "Gather": GatherRule(),
    "GatherElements": GatherElementsRule(),
    "ScatterElements": ScatterElementsRule(),
    "ScatterND": ScatterNDRule(),
    "ReduceSum": ReduceRule(sum_merge=True, staged=True),
    "ReduceMean": ReduceRule(mean=True, staged=True),
    "ReduceMax": ReduceRule(), "ReduceMin": ReduceRule(), "ReduceProd": ReduceRule(),
    "Transpose": TransposeRule(),
    "Reshape": ReshapeRule(),
    "Expand": ExpandRule(),
    "Squeeze": SqueezeRule(), "Unsqueeze": SqueezeRule(unsqueeze=True),
    "Flatten": FlattenRule(),
    "Concat": ConcatRule(),
    "Slice": SliceRule(),
    "SoftmaxCrossEntropyLoss": LossRule(), "NegativeLogLikelihoodLoss": LossRule(),
})

# Op types of the exported training graphs that are never split, and why.
UNSPLITTABLE: dict[str, str] = {
    "Constant": "no input to split",
    "ConstantOfShape": "its input is a shape",
    "Shape": "reads only the shape; its output is a small shape vector",
    "Size": "reads only the shape; its output is a scalar",
    "Range": "scalar inputs",
    "Dropout": "random: micro-ops would draw a different mask",
    "RandomNormal": "random", "RandomNormalLike": "random", "RandomUniform": "random",
    "RandomUniformLike": "random", "Bernoulli": "random", "Multinomial": "random",
    "If": "control flow", "Loop": "control flow", "Scan": "control flow",
    "TopK": "selection over a whole axis",
    "NonZero": "data-dependent output shape",
}


def is_exact(option: SplitOption) -> bool:
    """No output of ``option`` is a sum of partial results: its micro-ops and merges compute
    the op's own bits (a Sum adds in another order than the op's kernel and rounds differently).
    A ``staged`` reduction is exact only where the kernel's order was probed to be the same
    (:func:`graph_passes.planning.split.reduction_order.staged_matches`), so not by itself."""
    return all(merge.kind not in (SUM, STAGED) for merge in option.outputs)


def split_options(node: NodeInfo) -> tuple[SplitOption, ...]:
    """The node's split options; raises :class:`UnsplittableOpError` for an op without a rule."""
    rule = SPLIT_RULES.get(node.op_type)
    if rule is None:
        reason = UNSPLITTABLE.get(node.op_type, "no split rule for this op type")
        raise UnsplittableOpError(f"{node.op_type} nodes are never split ({reason})")
    if any(s is None for s in node.output_shapes[:1]) or node.shape(0) is None:
        raise UnsplittableOpError(f"{node.op_type}: shapes of its first input and output are needed to split it")
    return rule.options(node)


def find_option(node: NodeInfo, key: SplitAxis) -> SplitOption:
    """The option named ``key``; raises :class:`UnsplittableOpError` listing the ones there are."""
    options = split_options(node)
    for option in options:
        if option.key == key:
            return option
    available = ", ".join(str(o.key) for o in options) or "none"
    raise UnsplittableOpError(f"{node.op_type} cannot be split as {key} (its splits: {available})")


def constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Values of initializers and Constant-node outputs (tensor-valued ``value`` attribute)."""
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = onnx.numpy_helper.to_array(attr.t)
                elif attr.name in ("value_int", "value_ints"):
                    values[node.output[0]] = np.asarray(onnx.helper.get_attribute_value(attr), dtype=np.int64)
    return values


def ir_constant(value: ir.Value | None) -> np.ndarray | None:
    """:func:`constant_values`' entry for one ``onnx_ir`` value: an initializer's or a Constant
    node's value (``value``, ``value_int``, ``value_ints``), else None."""
    if value is None:
        return None
    if value.is_initializer() and value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain != "":
        return None
    for attr in producer.attributes.values():
        if attr.name == "value":
            return attr.value.numpy()
        if attr.name in ("value_int", "value_ints"):
            return np.asarray(attr.value, dtype=np.int64)
    return None


__all__ = [
    "CHAIN", "CONCAT", "STAGED", "SUM", "SPLIT_RULES", "AxesInput", "UNSPLITTABLE", "Carry", "Merge", "MicroShape", "NodeInfo", "is_exact",
    "SliceOn", "SplitAxis", "SplitOption", "SplitRule", "UnsplittableOpError", "Whole", "chunk_sizes",
    "constant_values", "find_option", "ir_constant", "split_options",
]
