"""Time of nodes, blocks and swap copies on a device profile.

Two sources of time:

- **Analytical** (:class:`AnalyticalCostModel`): a roofline per node,
  ``max(flops / peak_flops, bytes / memory_bandwidth) + kernel_launch_s``, from the node's FLOPs
  and bytes computed from its op type and the :class:`~graph_passes.ir.shapes.TensorInfo` of its
  values. Used for device profiles we cannot run on (V100, A100, H100) and as the fallback.
- **Profiled** (:class:`ProfiledCostModel`): measured block times (median of a few runs, from
  :func:`profile_blocks` with a runner the runtime supplies), falling back to another model for
  blocks it has not measured.

FLOP counts (multiply and add count as two): MatMul/Gemm ``2·M·N·K`` over the batch dims (plus
one per output for a Gemm bias); Conv ``2·N·Cout·prod(out spatial)·Cin/groups·prod(kernel)``;
ConvTranspose ``2·N·Cin·prod(in spatial)·Cout/groups·prod(kernel)`` (the multiply-adds it really
does: every input element meets ``Cout/groups·prod(kernel)`` weights); elementwise ops one per
output element, :data:`TRANSCENDENTAL_FLOPS` for exp-like ones; reductions, Softmax and
normalisations a few per input element; data movement and unknown ops none (bytes only).
Bytes are the sizes of the node's distinct inputs and outputs, except that gathers and slices
read only what they write and metadata ops (Shape, Size) read nothing.

``Constant`` nodes take no time (ONNX Runtime folds them when it builds the session).
Nodes of the ``ai.ort_offload`` domain are runtime actions (swap copies, releases), not kernels:
they cost no compute time here; the simulator charges their copies with :func:`transfer_time`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, Iterable, Mapping, Sequence, Union

import onnx

from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.ir.program import Block, Program
from graph_passes.ir.shapes import TensorInfo

logger = logging.getLogger(__name__)

OFFLOAD_DOMAIN = "ai.ort_offload"  # custom_ops.registry.DOMAIN

# FLOPs per element of an exp/log/tanh/erf-like function (a polynomial after range reduction,
# or a special-function unit issue at reduced rate): a small constant, as cost models
# conventionally use.
TRANSCENDENTAL_FLOPS = 4
_T = TRANSCENDENTAL_FLOPS

# FLOPs per output element of elementwise ops.
ELEMENTWISE_FLOPS: dict[str, float] = {
    **{op: 1 for op in (
        "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "ThresholdedRelu", "Clip",
        "Floor", "Ceil", "Round", "Sign", "Reciprocal", "Sqrt", "Mod", "BitShift", "IsNaN", "IsInf",
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
        "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "ReluGrad", "BiasAdd", "Shrink",
    )},
    **{op: _T for op in (
        "Exp", "Log", "Tanh", "Erf", "Pow", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
        "Asinh", "Acosh", "Atanh", "Softsign", "Elu", "Selu", "Celu",
    )},
    "Sigmoid": _T + 2,  # 1 / (1 + exp(-x))
    "Softplus": _T + 1,  # log(1 + exp(x)): counted as one transcendental and an add
    "HardSigmoid": 3,
    "HardSwish": 4,
    "Gelu": _T + 4,  # 0.5·x·(1 + erf(x/√2))
    "FastGelu": _T + 6,
    "BiasGelu": _T + 5,
    "QuickGelu": _T + 3,
    "Mish": 2 * _T + 2,
    "SigmoidGrad": 3,  # dy·y·(1 − y)
    "TanhGrad": 3,  # dy·(1 − y²)
    "GeluGrad": 2 * _T + 6,
    "FastGeluGrad": 2 * _T + 8,
    "BiasGeluGrad_dX": 2 * _T + 7,
    "Dropout": 3,  # random draw, compare, scale
}
# Variadic elementwise ops: per output element, one op per extra input (Mean: plus the division).
VARIADIC_FLOPS = {"Sum": 0, "Max": 0, "Min": 0, "Mean": 1}

# FLOPs per *input* element of reductions.
REDUCTION_FLOPS: dict[str, float] = {
    "ReduceSum": 1, "ReduceMean": 1, "ReduceMax": 1, "ReduceMin": 1, "ReduceProd": 1,
    "ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2, "ReduceLogSum": 1, "ReduceLogSumExp": _T + 1,
    "ArgMax": 1, "ArgMin": 1, "CumSum": 1, "TopK": 1,
    "GlobalAveragePool": 1, "GlobalMaxPool": 1, "GlobalLpPool": 2,
}
# FLOPs per input element of Softmax-like ops and normalisations.
NORMALIZATION_FLOPS: dict[str, float] = {
    "Softmax": 4 + _T,  # max, subtract, exp, sum, divide
    "LogSoftmax": 4 + _T,
    "Hardmax": 2,
    "SoftmaxGrad": 4, "SoftmaxGrad_13": 4, "LogSoftmaxGrad": 4 + _T,
    "LayerNormalization": 8,  # mean, subtract, square, sum, normalise, scale, shift (+ rsqrt per row)
    "SimplifiedLayerNormalization": 5, "SkipLayerNormalization": 9, "SkipSimplifiedLayerNormalization": 6,
    "GroupNormalization": 8, "InstanceNormalization": 8, "MeanVarianceNormalization": 8,
    "LpNormalization": 3,
    "LayerNormalizationGrad": 12, "SimplifiedLayerNormalizationGrad": 9,
    "BatchNormalization": 4,  # inference: subtract, scale by rsqrt(var), scale, shift; +4 training
}
TRAINING_BATCH_NORM_EXTRA_FLOPS = 4

# Ops that only move, select or describe data: no FLOPs.
DATA_MOVEMENT_OPS = frozenset({
    "Reshape", "Transpose", "Gather", "GatherElements", "GatherND", "Concat", "Slice", "Expand", "Where",
    "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast", "CastLike", "Split", "Pad", "Tile",
    "ScatterND", "ScatterElements", "Scatter", "Shape", "Size", "Constant", "ConstantOfShape", "Range",
    "OneHot", "Trilu", "DepthToSpace", "SpaceToDepth", "Resize", "Upsample", "NonZero", "Compress",
    "ReverseSequence", "EyeLike", "GatherGrad", "SplitToSequence", "ConcatFromSequence", "SequenceAt",
    "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceLength", "Col2Im",
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
})
# Ops that launch no kernel at run time: ONNX Runtime folds them into initializers.
FREE_OPS = frozenset({"Constant"})
# Ops that read only as much of their data input as they write.
_READ_AS_WRITTEN = {"Gather": 0, "GatherElements": 0, "GatherND": 0, "Slice": 0, "Compress": 0}
# Ops that read tensor metadata, not data.
_METADATA_OPS = frozenset({"Shape", "Size"})

_MATMUL_OPS = {"MatMul", "MatMulInteger", "FusedMatMul", "QLinearMatMul", "MatMulNBits"}
_POOL_OPS = {"MaxPool", "AveragePool", "LpPool", "MaxRoiPool"}


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """Work of one node: floating-point operations and bytes moved to and from memory."""

    flops: float
    bytes: int


def _elements(info: TensorInfo | None) -> int:
    return int(math.prod(info.shape)) if info is not None else 0


def _info(infos: Mapping[str, TensorInfo], node: onnx.NodeProto, index: int, outputs: bool = False) -> TensorInfo | None:
    names = node.output if outputs else node.input
    if index >= len(names) or not names[index]:
        return None
    return infos.get(names[index])


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _has_input(node: onnx.NodeProto, index: int) -> bool:
    return index < len(node.input) and bool(node.input[index])


def is_runtime_action(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is one of our ops (a runtime action with no kernel time of its own)."""
    return node.domain == OFFLOAD_DOMAIN


def node_flops(node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
    """Floating-point operations of ``node`` for the shapes in ``infos`` (0 when unknown)."""
    if is_runtime_action(node):
        return 0.0
    op = node.op_type
    y = _info(infos, node, 0, outputs=True)
    x = _info(infos, node, 0)
    try:
        if op in _MATMUL_OPS:
            return _matmul_flops(node, infos, y)
        if op == "Gemm":
            a = x
            if a is None or y is None or len(a.shape) != 2:
                return 0.0
            k = a.shape[0] if _attr(node, "transA", 0) else a.shape[1]
            return 2.0 * _elements(y) * k + (_elements(y) if _has_input(node, 2) else 0)
        if op in ("Conv", "ConvInteger", "QLinearConv"):
            w = _info(infos, node, 3 if op == "QLinearConv" else 1)
            if w is None or y is None:
                return 0.0
            bias = _has_input(node, 8 if op == "QLinearConv" else 2)
            return 2.0 * _elements(y) * math.prod(w.shape[1:]) + (_elements(y) if bias else 0)
        if op == "ConvTranspose":
            w = _info(infos, node, 1)
            if w is None or x is None:
                return 0.0
            return 2.0 * _elements(x) * math.prod(w.shape[1:]) + (_elements(y) if _has_input(node, 2) else 0)
        if op == "ConvGrad":  # com.microsoft: (dY, X, W) -> (dX, dW, dB)
            dy, w = x, _info(infos, node, 2)
            if dy is None or w is None:
                return 0.0
            per_grad = 2.0 * _elements(dy) * math.prod(w.shape[1:])
            present = [i < len(node.output) and bool(node.output[i]) for i in range(3)]
            return per_grad * (present[0] + present[1]) + (_elements(dy) if present[2] else 0)
        if op in _POOL_OPS:
            kernel = _attr(node, "kernel_shape") or _attr(node, "pooled_shape") or ()
            return float(_elements(y) * math.prod(kernel))
        if op in ("LSTM", "GRU", "RNN"):
            return _rnn_flops(node, infos)
        if op == "Einsum":
            return _einsum_flops(node, infos, y)
        if op in ELEMENTWISE_FLOPS:
            return float(ELEMENTWISE_FLOPS[op] * _elements(y))
        if op in VARIADIC_FLOPS:
            inputs = sum(1 for n in node.input if n)
            return float((max(1, inputs - 1) + VARIADIC_FLOPS[op]) * _elements(y))
        if op in REDUCTION_FLOPS:
            return float(REDUCTION_FLOPS[op] * _elements(x))
        if op in NORMALIZATION_FLOPS:
            per = NORMALIZATION_FLOPS[op]
            if op == "BatchNormalization" and (_attr(node, "training_mode", 0) or sum(1 for o in node.output if o) > 1):
                per += TRAINING_BATCH_NORM_EXTRA_FLOPS
            return float(per * _elements(x))
    except (TypeError, ValueError, IndexError) as e:  # malformed attributes or ranks: count bytes only
        logger.debug("no FLOP count for %s %r (%s)", op, node.name, e)
        return 0.0
    return 0.0  # data movement and unknown ops


def _matmul_flops(node: onnx.NodeProto, infos: Mapping[str, TensorInfo], y: TensorInfo | None) -> float:
    a = _info(infos, node, 0)
    if a is None or y is None or not a.shape:
        return 0.0
    if node.op_type == "FusedMatMul" and _attr(node, "transA", 0) and len(a.shape) >= 2:
        k = a.shape[-2]
    else:
        k = a.shape[-1]
    return 2.0 * _elements(y) * k


def _rnn_flops(node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
    """Gate matmuls over input and hidden state, plus the gate activations, per step."""
    x, w = _info(infos, node, 0), _info(infos, node, 1)
    if x is None or w is None or len(x.shape) != 3 or len(w.shape) != 3:
        return 0.0
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[node.op_type]
    hidden = _attr(node, "hidden_size") or w.shape[1] // gates
    seq, batch = (x.shape[1], x.shape[0]) if _attr(node, "layout", 0) else (x.shape[0], x.shape[1])
    directions, input_size = w.shape[0], w.shape[2]
    per_step = 2.0 * batch * gates * hidden * (input_size + hidden) + batch * gates * hidden * (_T + 2)
    return per_step * seq * directions


def _einsum_flops(node: onnx.NodeProto, infos: Mapping[str, TensorInfo], y: TensorInfo | None) -> float:
    equation = _attr(node, "equation", b"")
    equation = (equation.decode() if isinstance(equation, bytes) else str(equation)).replace(" ", "")
    operands = [infos.get(n) for n in node.input if n]
    if y is None or not operands or any(o is None for o in operands):
        return 0.0
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        return 0.0
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    for term, info in zip(terms, operands):
        left, _, right = term.partition("...")
        for i, c in enumerate(left):
            sizes[c] = info.shape[i]
        for i, c in enumerate(right):
            sizes[c] = info.shape[len(info.shape) - len(right) + i]
        for c in left + right:
            counts[c] = counts.get(c, 0) + 1
    out_letters = set(rhs.replace("...", "")) if "->" in equation else {c for c, n in counts.items() if n == 1}
    contracted = math.prod(sizes[c] for c in sizes if c not in out_letters)
    if len(operands) == 1:
        return float(_elements(operands[0]))
    return float(len(operands) * _elements(y) * contracted) if contracted > 1 else float((len(operands) - 1) * _elements(y))


def node_bytes(node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> int:
    """Bytes ``node`` reads and writes: its distinct inputs and outputs (0 for unknown values)."""
    if is_runtime_action(node):
        return 0
    outputs = list(dict.fromkeys(o for o in node.output if o))
    written = sum(infos[o].nbytes for o in outputs if o in infos)
    if node.op_type in _METADATA_OPS:
        return written
    inputs = list(dict.fromkeys(n for n in node.input if n))
    read = 0
    data_index = _READ_AS_WRITTEN.get(node.op_type)
    for name in inputs:
        if name not in infos:
            continue
        if data_index is not None and data_index < len(node.input) and name == node.input[data_index]:
            read += min(infos[name].nbytes, written)
        else:
            read += infos[name].nbytes
    return read + written


def node_cost(node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> NodeCost:
    return NodeCost(node_flops(node, infos), node_bytes(node, infos))


def roofline_time(flops: float, nbytes: float, profile: DeviceProfile) -> float:
    """Seconds of one kernel: compute- or memory-bound, whichever is slower, plus the launch."""
    return max(flops / profile.peak_flops, nbytes / profile.memory_bandwidth) + profile.kernel_launch_s


def is_compute_bound(flops: float, nbytes: float, profile: DeviceProfile) -> bool:
    """Whether the kernel's arithmetic intensity is above the profile's ridge point."""
    return flops / profile.peak_flops > nbytes / profile.memory_bandwidth


DIRECTIONS = ("h2d", "d2h")


def transfer_time(nbytes: float, profile: DeviceProfile, direction: str, concurrent: bool = False) -> float:
    """Seconds to copy ``nbytes`` over the host link: ``"h2d"`` (swap in) or ``"d2h"`` (swap out).

    With ``concurrent`` (the other direction copies at the same time) each direction gets half
    of the duplex bandwidth, never more than its one-way rate.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"transfer direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if nbytes <= 0:
        return 0.0
    bandwidth = profile.h2d_bandwidth if direction == "h2d" else profile.d2h_bandwidth
    if concurrent:
        bandwidth = min(bandwidth, profile.duplex_bandwidth / 2)
    return nbytes / bandwidth


class CostModel(abc.ABC):
    """Time of nodes and blocks (seconds) for one input signature's ``infos``."""

    @abc.abstractmethod
    def node_time(self, node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
        """Seconds ``node`` takes."""

    def block_time(self, model: onnx.ModelProto, block: Block, infos: Mapping[str, TensorInfo]) -> float:
        """Seconds ``block`` takes: by default, the sum of its nodes' times."""
        nodes = model.graph.node
        return sum(self.node_time(nodes[i], infos) for i in block.node_indices)

    def program_time(self, model: onnx.ModelProto, program: Program, infos: Mapping[str, TensorInfo]) -> float:
        """Compute time of every block of ``program``, run one after another (no copies)."""
        return sum(self.block_time(model, block, infos) for block in program.blocks)


class AnalyticalCostModel(CostModel):
    """Roofline per node on ``profile``."""

    def __init__(self, profile: DeviceProfile) -> None:
        self.profile = profile

    def node_cost(self, node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> NodeCost:
        return node_cost(node, infos)

    def node_time(self, node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
        if is_runtime_action(node) or node.op_type in FREE_OPS:
            return 0.0
        cost = node_cost(node, infos)
        return roofline_time(cost.flops, cost.bytes, self.profile)

    def __repr__(self) -> str:
        return f"AnalyticalCostModel({self.profile.name!r})"


class NodeTimesOnce(CostModel):
    """``inner``'s times for one model and one set of shapes, each node's worked out once: a
    search times thousands of blockings of the same graph, and every block time is a sum of the
    same node times (added in the same order as :meth:`CostModel.block_time`, so the same
    float). Another model or infos goes to ``inner``."""

    def __init__(self, inner: CostModel, model: onnx.ModelProto, infos: Mapping[str, TensorInfo]) -> None:
        if type(inner).block_time is not CostModel.block_time:
            raise TypeError(f"{type(inner).__name__} times blocks its own way; its node times cannot stand for them")
        self.inner, self.model, self.infos = inner, model, infos
        self.times: list[float | None] = [None] * len(model.graph.node)

    def node_time(self, node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
        return self.inner.node_time(node, infos)

    def block_time(self, model: onnx.ModelProto, block: Block, infos: Mapping[str, TensorInfo]) -> float:
        if model is not self.model or infos is not self.infos:
            return self.inner.block_time(model, block, infos)
        nodes, times, total = model.graph.node, self.times, 0
        for i in block.node_indices:
            seconds = times[i]
            if seconds is None:
                seconds = times[i] = self.inner.node_time(nodes[i], infos)
            total = total + seconds
        return total

    def __repr__(self) -> str:
        return f"NodeTimesOnce({self.inner!r})"


BlockKey = tuple[int, ...]


def block_key(block: Union[Block, Sequence[int]]) -> BlockKey:
    """The key of a block's measurement: its node indices, in order."""
    return tuple(block.node_indices if isinstance(block, Block) else block)


class ProfiledCostModel(CostModel):
    """Measured block times (keyed by the block's node indices), falling back to ``fallback``
    (a cost model, or a profile for an analytical one) for blocks not measured.

    ``node_times`` (by node name) optionally gives measured single-node times.
    """

    def __init__(
        self,
        block_times: Mapping[Sequence[int], float],
        fallback: Union[CostModel, DeviceProfile],
        *,
        node_times: Mapping[str, float] | None = None,
    ) -> None:
        self.block_times: dict[BlockKey, float] = {block_key(k): float(v) for k, v in block_times.items()}
        for key, seconds in self.block_times.items():
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"measured time of block {list(key)[:4]}... must be a finite number >= 0, got {seconds!r}")
        self.fallback = AnalyticalCostModel(fallback) if isinstance(fallback, DeviceProfile) else fallback
        self.node_times = dict(node_times or {})

    def is_measured(self, block: Union[Block, Sequence[int]]) -> bool:
        return block_key(block) in self.block_times

    def node_time(self, node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> float:
        if node.name and node.name in self.node_times:
            return self.node_times[node.name]
        return self.fallback.node_time(node, infos)

    def block_time(self, model: onnx.ModelProto, block: Block, infos: Mapping[str, TensorInfo]) -> float:
        measured = self.block_times.get(block_key(block))
        if measured is not None:
            return measured
        return self.fallback.block_time(model, block, infos)


def profile_blocks(
    blocks: Union[Program, Iterable[Block]],
    run_block: Callable[[Block], None],
    *,
    repeats: int = 3,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[BlockKey, float]:
    """Median seconds of ``repeats`` calls of ``run_block(block)`` for every block, after
    ``warmup`` untimed calls. The runtime supplies ``run_block`` (a session run with its inputs
    bound); the result feeds :class:`ProfiledCostModel`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    block_list = blocks.blocks if isinstance(blocks, Program) else tuple(blocks)
    times: dict[BlockKey, float] = {}
    for block in block_list:
        for _ in range(max(0, warmup)):
            run_block(block)
        samples = []
        for _ in range(repeats):
            start = clock()
            run_block(block)
            samples.append(clock() - start)
        times[block_key(block)] = statistics.median(samples)
    return times


__all__ = [
    "AnalyticalCostModel", "CostModel", "DATA_MOVEMENT_OPS", "FREE_OPS", "NodeCost", "NodeTimesOnce", "ProfiledCostModel",
    "TRANSCENDENTAL_FLOPS", "block_key", "is_compute_bound", "node_bytes", "node_cost", "node_flops",
    "profile_blocks", "roofline_time", "transfer_time",
]
