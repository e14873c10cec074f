"""ONNX translations for ATen backward ops that torch's ONNX exporter lacks.

torch's dynamo ONNX exporter (``torch.onnx.export(..., dynamo=True)``) has no translation for
``aten.convolution_backward``, ``aten.avg_pool{2,3}d_backward`` and
``aten._adaptive_avg_pool2d_backward``, and torch ships no decomposition for them, so a joint
forward+backward graph of a CNN (``torch.export.experimental._export_forward_backward``) cannot be
exported without help. This module provides trace-only translations (plain Python functions that
record standard ONNX ops while the exporter traces them) and exposes them as
:data:`CUSTOM_TRANSLATION_TABLE`, to be passed as ``custom_translation_table=`` to
``torch.onnx.export``.

Formulations (N spatial dims, 1-D/2-D/3-D):

* convolution, grad_input: ``ConvTranspose(grad_output, weight)`` with the forward's stride,
  dilation and groups; begin pads = forward padding, end pads / output_padding chosen from the
  static shapes so the result has exactly the input's spatial shape (when the spatial dims are
  symbolic, a generous output_padding and a ``Slice`` to ``Shape(input)`` are used instead).
  For a transposed convolution the roles flip: grad_input is a plain ``Conv``.
* convolution, grad_weight: ``Conv`` of the input with batch and channel axes swapped (the batch
  becomes the reduction/channel axis) by the swapped grad_output used as the kernel; stride and
  dilation swap roles; the result is cropped to the kernel size and transposed back. groups > 1
  (depthwise included) use a grouped ``Conv`` after regrouping the input channels, so no work is
  wasted on cross-group pairs.
* convolution, grad_bias: ``ReduceSum`` over batch and spatial axes.
* avg_pool backward: grad_output is scaled by the (separable, statically computed) reciprocal
  divisor map, which honours padding, ``ceil_mode``, ``count_include_pad`` and
  ``divisor_override`` exactly as ATen does, then scattered back with a depthwise
  ``ConvTranspose`` by a ones kernel.
* adaptive avg_pool2d backward: when the output size divides the input size it is an avg_pool
  backward with kernel = stride = input/output; otherwise two ``MatMul`` with constant
  (input x output) averaging matrices.

Two forward translations of torch_lib are replaced because they are wrong for training graphs:

* ``aten._native_batch_norm_legit_functional`` (BatchNorm in training mode after
  functionalisation): torch_lib always normalises with the running statistics and returns them
  unchanged; ours uses the batch statistics and returns the updated running mean/variance
  (unbiased), as torch's decomposition does. Statistics are computed in the input's dtype.
* ``aten.avg_pool{2,3}d`` with ``divisor_override``: torch_lib ignores the override; ours uses a
  depthwise ones-kernel ``Conv`` (window sums) divided by it. Without an override the call is
  delegated to torch_lib's translation (ONNX ``AveragePool``).

Only the batch axis may be symbolic for the pooling ops (spatial and channel sizes must be
static); the convolution translations also accept symbolic spatial dims. Entries of
``convolution_backward`` not requested by ``output_mask`` are returned as an unused scalar
constant (the exporter cannot carry ``None`` outputs); nothing reads them and the exporter's
optimizer removes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

import numpy as np
import onnx_ir as ir
import torch
from onnxscript.onnx_opset import opset18 as op
from onnxscript.onnx_types import TensorType

from ort_offload.errors import ExportError

__all__ = [
    "CUSTOM_TRANSLATION_TABLE",
    "adaptive_avg_pool2d_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "avg_pool3d",
    "avg_pool3d_backward",
    "convolution_backward",
    "empty_permuted",
    "native_batch_norm_legit_functional",
]


# --------------------------------------------------------------------------- helpers


def _expand(value, n: int, name: str) -> list[int]:
    """Normalise an ATen int-or-list argument to a list of ``n`` ints."""
    if value is None:
        raise ValueError(f"{name} must not be None")
    if isinstance(value, int):
        return [value] * n
    value = [int(v) for v in value]
    if len(value) == 1:
        return value * n
    if len(value) != n:
        raise ValueError(f"{name}={value} does not match {n} spatial dims")
    return value


def _static_dims(value: ir.Value, start: int) -> Optional[list[int]]:
    """Static sizes of ``value``'s dims from ``start`` on, or None if any is symbolic/unknown."""
    shape = value.shape
    if shape is None:
        return None
    dims = list(shape)[start:]
    if all(isinstance(d, int) for d in dims):
        return dims
    return None


def _rank(value: ir.Value) -> int:
    if value.shape is None:
        raise ValueError(f"rank of {value.name!r} is unknown at translation time")
    return len(value.shape)


def _static_dim(value: ir.Value, axis: int, what: str) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise ExportError(f"{what} must be static, got {dim!r}")
    return dim


def _np_dtype(value: ir.Value) -> np.dtype:
    dtype = value.dtype
    if dtype is None:
        return np.dtype(np.float32)
    return np.dtype(dtype.numpy())


def _const(array: np.ndarray, like: Optional[ir.Value] = None) -> ir.Value:
    """A Constant node holding ``array`` (in ``like``'s dtype when given)."""
    if like is not None:
        array = array.astype(_np_dtype(like))
    return op.Constant(value=ir.tensor(np.ascontiguousarray(array)))


def _ints_const(values: Sequence[int]) -> ir.Value:
    return op.Constant(value_ints=[int(v) for v in values])


def _spatial_shape(value: ir.Value) -> ir.Value:
    """1-D INT64 tensor with the spatial sizes of ``value`` (dims 2..)."""
    dims = _static_dims(value, 2)
    if dims is not None:
        return _ints_const(dims)
    return op.Shape(value, start=2)


def _slice_spatial(x: ir.Value, ends: ir.Value, nsp: int) -> ir.Value:
    return op.Slice(x, _ints_const([0] * nsp), ends, _ints_const(range(2, 2 + nsp)))


def _swap01(x: ir.Value, rank: int) -> ir.Value:
    return op.Transpose(x, perm=[1, 0, *range(2, rank)])


def _unused_output() -> ir.Value:
    """Placeholder for a gradient not requested by ``output_mask`` (never read)."""
    return op.Constant(value_float=0.0)


def _transpose_geometry(
    out_sizes: Optional[list[int]],
    in_sizes: Optional[list[int]],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
):
    """Pads/output_padding making ``ConvTranspose`` of an ``out``-sized tensor ``in``-sized.

    Returns ``(pads, output_padding, needs_slice)``. The uncropped scatter of output index i
    with kernel tap t lands on ``i*stride - padding + t*dilation``; it spans
    ``full = (out-1)*stride + dilation*(k-1) + 1`` positions starting at ``-padding`` and we
    keep ``[0, in)``.
    """
    nsp = len(kernel)
    if out_sizes is not None and in_sizes is not None:
        begin, end, out_pad = [], [], []
        for o, n, k, s, p, d in zip(out_sizes, in_sizes, kernel, stride, padding, dilation):
            full = (o - 1) * s + d * (k - 1) + 1
            tail = full - p - n
            begin.append(p)
            end.append(max(tail, 0))
            out_pad.append(max(-tail, 0))
        return begin + end, out_pad, False
    # Symbolic sizes: make the result at least ``in`` long, then slice.
    out_pad = [max(s - 1 - p, 0) for s, p in zip(stride, padding)]
    return list(padding) + [0] * nsp, out_pad, True


# --------------------------------------------------------------------------- convolution


def _conv_grad_input(
    grad_output: ir.Value,
    input: ir.Value,
    weight: ir.Value,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> ir.Value:
    nsp = len(kernel)
    pads, out_pad, needs_slice = _transpose_geometry(
        _static_dims(grad_output, 2),
        _static_dims(input, 2),
        kernel,
        stride,
        padding,
        dilation,
    )
    result = op.ConvTranspose(
        grad_output,
        weight,
        strides=stride,
        pads=pads,
        dilations=dilation,
        group=groups,
        output_padding=out_pad,
        kernel_shape=kernel,
    )
    if needs_slice:
        result = _slice_spatial(result, op.Shape(input, start=2), nsp)
    return result


def _conv_grad_weight(
    input: ir.Value,
    grad_output: ir.Value,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> ir.Value:
    """dW[o, i, t] = sum_{n, j} grad_output[n, o, j] * input[n, i, j*stride - padding + t*dilation].

    Returns a tensor of shape ``(C_out, C_in // groups, *kernel)`` where C_in/C_out are the
    channel counts of ``input``/``grad_output``.
    """
    nsp = len(kernel)
    rank = nsp + 2
    in_channels = _static_dim(input, 1, "input channel count")
    x = _swap01(input, rank)  # (C_in, N, *sp)
    if groups > 1:
        cig = in_channels // groups
        if cig == 1:
            x = op.Reshape(x, op.Concat(_ints_const([1, -1]), _spatial_shape(input), axis=0))
        else:
            sp = _spatial_shape(input)
            x = op.Reshape(x, op.Concat(_ints_const([groups, cig, -1]), sp, axis=0))
            x = op.Transpose(x, perm=[1, 0, *range(2, rank + 1)])  # (cig, g, N, *sp)
            x = op.Reshape(x, op.Concat(_ints_const([cig, -1]), sp, axis=0))
        # x: (C_in/g, g*N, *sp), channel index = group*N + n
    g = _swap01(grad_output, rank)  # (C_out, N, *osp)
    result = op.Conv(
        x,
        g,
        strides=dilation,
        dilations=stride,
        pads=list(padding) * 2,
        group=groups,
    )
    # result: (C_in/g, C_out, k'...) with k' >= kernel; crop the excess taps.
    in_sizes = _static_dims(input, 2)
    out_sizes = _static_dims(grad_output, 2)
    if in_sizes is not None and out_sizes is not None:
        got = [
            (n + 2 * p - s * (o - 1) - 1) // d + 1
            for n, o, p, s, d in zip(in_sizes, out_sizes, padding, stride, dilation)
        ]
        crop = got != list(kernel)
    else:
        crop = True
    if crop:
        result = _slice_spatial(result, _ints_const(kernel), nsp)
    return _swap01(result, rank)


@dataclasses.dataclass(frozen=True)
class _ConvGeometry:
    """A convolution's static geometry, one entry per spatial dim."""

    rank: int  # of the weight (and the batched input)
    kernel: list[int]
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int

    @property
    def nsp(self) -> int:
        return self.rank - 2


def _conv_geometry(input, weight, stride, padding, dilation, groups) -> _ConvGeometry:
    """Check and normalise convolution_backward's geometry arguments."""
    rank = _rank(weight)
    nsp = rank - 2
    if nsp < 1:
        raise ExportError(f"convolution_backward: weight of rank {rank} is not supported")
    if _rank(input) != rank:
        raise ExportError(
            "convolution_backward: unbatched input is not supported (add a batch axis)"
        )
    kernel = _static_dims(weight, 2)
    if kernel is None:
        raise ExportError("convolution_backward: kernel size must be static")
    stride = _expand(stride, nsp, "stride")
    padding = _expand(padding, nsp, "padding")
    dilation = _expand(dilation, nsp, "dilation")
    groups = int(groups)
    if groups < 1:
        raise ValueError(f"convolution_backward: groups={groups}")
    return _ConvGeometry(rank, kernel, stride, padding, dilation, groups)


def _conv_transpose_grad_input(grad_output, input, weight, geo: _ConvGeometry):
    """y = ConvTranspose(x, w)  =>  dx = Conv(dy, w) (exactly the adjoint geometry), cropped to
    the input's spatial size."""
    grad_input = op.Conv(
        grad_output,
        weight,
        strides=geo.stride,
        pads=geo.padding * 2,
        dilations=geo.dilation,
        group=geo.groups,
        kernel_shape=geo.kernel,
    )
    want = _static_dims(input, 2)
    got = _static_dims(grad_output, 2)
    if want is None or got is None:
        return _slice_spatial(grad_input, op.Shape(input, start=2), geo.nsp)
    got = [
        (o + 2 * p - d * (k - 1) - 1) // s + 1
        for o, p, d, k, s in zip(got, geo.padding, geo.dilation, geo.kernel, geo.stride)
    ]
    if got != want:
        grad_input = _slice_spatial(grad_input, _ints_const(want), geo.nsp)
    return grad_input


def convolution_backward(
    grad_output: TensorType,
    input: TensorType,
    weight: TensorType,
    bias_sizes: Optional[Sequence[int]],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
):
    """convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, int[] stride, SymInt[] padding, int[] dilation, bool transposed, SymInt[] output_padding, int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"""
    geo = _conv_geometry(input, weight, stride, padding, dilation, groups)
    kernel, stride, padding, dilation, groups = geo.kernel, geo.stride, geo.padding, geo.dilation, geo.groups
    mask = [bool(m) for m in output_mask]

    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        if transposed:
            grad_input = _conv_transpose_grad_input(grad_output, input, weight, geo)
        else:
            grad_input = _conv_grad_input(
                grad_output, input, weight, kernel, stride, padding, dilation, groups
            )
    if mask[1]:
        if transposed:
            # The transposed conv is the adjoint of Conv(dy-shaped, w) -> x-shaped, so its
            # weight gradient is that conv's weight gradient with input=dy, grad_output=x.
            grad_weight = _conv_grad_weight(
                grad_output, input, kernel, stride, padding, dilation, groups
            )
        else:
            grad_weight = _conv_grad_weight(
                input, grad_output, kernel, stride, padding, dilation, groups
            )
    if mask[2]:
        grad_bias = op.ReduceSum(
            grad_output, _ints_const([0, *range(2, geo.rank)]), keepdims=0
        )
    return (
        grad_input if grad_input is not None else _unused_output(),
        grad_weight if grad_weight is not None else _unused_output(),
        grad_bias if grad_bias is not None else _unused_output(),
    )


# --------------------------------------------------------------------------- pooling


def _avg_pool_scales(
    out_sizes: list[int],
    in_sizes: list[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    count_include_pad: bool,
) -> list[np.ndarray]:
    """Per-dim window sizes as ATen's avg_pool backward counts them (the divisor factors)."""
    factors = []
    for o_n, n, k, s, p in zip(out_sizes, in_sizes, kernel, stride, padding):
        sizes = np.empty(o_n, dtype=np.float64)
        for i in range(o_n):
            start = i * s - p
            end = min(start + k, n + p)
            pool = end - start
            valid = min(end, n) - max(start, 0)
            sizes[i] = pool if count_include_pad else valid
        factors.append(sizes)
    return factors


def _scatter_windows(
    scaled: ir.Value,
    channels: int,
    out_sizes: list[int],
    in_sizes: list[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
) -> ir.Value:
    """Add every output gradient to all input positions of its window (depthwise ones kernel)."""
    pads, out_pad, _ = _transpose_geometry(
        out_sizes, in_sizes, kernel, stride, padding, [1] * len(kernel)
    )
    ones = _const(np.ones([channels, 1, *kernel]), like=scaled)
    return op.ConvTranspose(
        scaled,
        ones,
        strides=stride,
        pads=pads,
        group=channels,
        output_padding=out_pad,
        kernel_shape=kernel,
    )


def _avg_pool_backward(
    grad_output: ir.Value,
    input: ir.Value,
    nsp: int,
    kernel_size,
    stride,
    padding,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Optional[int],
) -> ir.Value:
    del ceil_mode  # grad_output's static shape already carries its effect
    rank = _rank(input)
    if rank != nsp + 2:
        raise ExportError(
            f"avg_pool{nsp}d_backward: unbatched input (rank {rank}) is not supported"
        )
    kernel = _expand(kernel_size, nsp, "kernel_size")
    stride = kernel if stride is None or len(stride) == 0 else _expand(stride, nsp, "stride")
    padding = _expand(padding, nsp, "padding")
    in_sizes = _static_dims(input, 2)
    out_sizes = _static_dims(grad_output, 2)
    if in_sizes is None or out_sizes is None:
        raise ExportError(
            f"avg_pool{nsp}d_backward: spatial sizes must be static "
            f"(input {input.shape}, grad_output {grad_output.shape})"
        )
    channels = _static_dim(input, 1, f"avg_pool{nsp}d_backward channel count")
    if divisor_override:
        scaled = op.Div(grad_output, _const(np.array(float(divisor_override)), like=grad_output))
    else:
        factors = _avg_pool_scales(
            out_sizes, in_sizes, kernel, stride, padding, bool(count_include_pad)
        )
        divisor = factors[0]
        for f in factors[1:]:
            divisor = np.multiply.outer(divisor, f)
        if np.all(divisor == divisor.flat[0]):
            divisor = np.array(divisor.flat[0])
        scaled = op.Div(grad_output, _const(divisor, like=grad_output))
    return _scatter_windows(
        scaled, channels, out_sizes, in_sizes, kernel, stride, padding
    )


def avg_pool2d_backward(
    grad_output: TensorType,
    input: TensorType,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Optional[int] = None,
):
    """avg_pool2d_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor"""
    return _avg_pool_backward(
        grad_output,
        input,
        2,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


def avg_pool3d_backward(
    grad_output: TensorType,
    input: TensorType,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Optional[int] = None,
):
    """avg_pool3d_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride, int[3] padding, bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor"""
    return _avg_pool_backward(
        grad_output,
        input,
        3,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


def _pool_out_size(n: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """ATen's pooling output size (``pooling_output_shape``, dilation 1)."""
    out = (n + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _avg_pool_forward(
    self: ir.Value,
    nsp: int,
    kernel_size,
    stride,
    padding,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Optional[int],
) -> ir.Value:
    if not divisor_override:
        # torch_lib's translation (ONNX AveragePool) is right without divisor_override.
        from onnxscript.function_libs.torch_lib.ops import nn as torch_lib_nn

        fn = torch_lib_nn.aten_avg_pool2d if nsp == 2 else torch_lib_nn.aten_avg_pool3d
        return fn(self, kernel_size, stride, padding, ceil_mode, count_include_pad)
    # With divisor_override: window sums (depthwise Conv by ones) / divisor_override.
    kernel = _expand(kernel_size, nsp, "kernel_size")
    stride = kernel if stride is None or len(stride) == 0 else _expand(stride, nsp, "stride")
    padding = _expand(padding, nsp, "padding")
    if _rank(self) != nsp + 2:
        raise ExportError(f"avg_pool{nsp}d: unbatched input is not supported")
    in_sizes = _static_dims(self, 2)
    if in_sizes is None:
        raise ExportError(
            f"avg_pool{nsp}d with divisor_override: spatial sizes must be static ({self.shape})"
        )
    channels = _static_dim(self, 1, f"avg_pool{nsp}d channel count")
    end_pads = []
    for n, k, s, p in zip(in_sizes, kernel, stride, padding):
        out = _pool_out_size(n, k, s, p, bool(ceil_mode))
        end_pads.append(max((out - 1) * s + k - n - p, 0))
    sums = op.Conv(
        self,
        _const(np.ones([channels, 1, *kernel]), like=self),
        strides=stride,
        pads=[*padding, *end_pads],
        group=channels,
        kernel_shape=kernel,
    )
    return op.Div(sums, _const(np.array(float(divisor_override)), like=self))


def avg_pool2d(
    self: TensorType,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0, 0),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Optional[int] = None,
):
    """avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor

    Same as torch_lib's translation, plus ``divisor_override`` (which torch_lib ignores).
    """
    return _avg_pool_forward(
        self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def avg_pool3d(
    self: TensorType,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0, 0, 0),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Optional[int] = None,
):
    """avg_pool3d(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor

    Same as torch_lib's translation, plus ``divisor_override`` (which torch_lib ignores).
    """
    return _avg_pool_forward(
        self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_in, n_out) matrix A with A[h, i] = 1/len(window i) for h in ATen's adaptive window i."""
    a = np.zeros((n_in, n_out), dtype=np.float64)
    for i in range(n_out):
        start = (i * n_in) // n_out
        end = -((-(i + 1) * n_in) // n_out)  # ceil
        a[start:end, i] = 1.0 / (end - start)
    return a


def adaptive_avg_pool2d_backward(grad_output: TensorType, input: TensorType):
    """_adaptive_avg_pool2d_backward(Tensor grad_output, Tensor self) -> Tensor"""
    rank = _rank(input)
    if rank != 4:
        raise ExportError(
            f"_adaptive_avg_pool2d_backward: unbatched input (rank {rank}) is not supported"
        )
    in_sizes = _static_dims(input, 2)
    out_sizes = _static_dims(grad_output, 2)
    if in_sizes is None or out_sizes is None:
        raise ExportError(
            "_adaptive_avg_pool2d_backward: spatial sizes must be static "
            f"(input {input.shape}, grad_output {grad_output.shape})"
        )
    if all(n % o == 0 for n, o in zip(in_sizes, out_sizes)):
        kernel = [n // o for n, o in zip(in_sizes, out_sizes)]
        channels = _static_dim(input, 1, "_adaptive_avg_pool2d_backward channel count")
        scaled = op.Div(grad_output, _const(np.array(float(math.prod(kernel))), like=grad_output))
        return _scatter_windows(
            scaled, channels, out_sizes, in_sizes, kernel, kernel, [0, 0]
        )
    # Overlapping/uneven windows: dx = A_h @ dy @ A_w^T with constant averaging matrices.
    a_h = _const(_adaptive_matrix(in_sizes[0], out_sizes[0]), like=grad_output)
    a_w_t = _const(_adaptive_matrix(in_sizes[1], out_sizes[1]).T, like=grad_output)
    return op.MatMul(op.MatMul(a_h, grad_output), a_w_t)


# --------------------------------------------------------------------------- batch norm


def native_batch_norm_legit_functional(
    input: TensorType,
    weight: Optional[TensorType],
    bias: Optional[TensorType],
    running_mean: TensorType,
    running_var: TensorType,
    training: bool,
    momentum: float,
    eps: float,
):
    """_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)

    Replaces torch_lib's translation, which always normalises with the running statistics and
    returns them unchanged (wrong in training mode). Follows torch's decomposition
    (``native_batch_norm_helper``): batch statistics, biased variance for normalisation,
    unbiased variance for the running-variance update, saved mean/rstd of shape (C,).
    """
    rank = _rank(input)
    axes = _ints_const([0, *range(2, rank)])
    per_channel = [-1] + [1] * (rank - 2)

    def _bcast(v):
        return op.Reshape(v, _ints_const(per_channel))

    m = float(momentum)
    if training:
        mean_k = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean_k)
        var_k = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
        rstd_k = op.Reciprocal(op.Sqrt(op.Add(var_k, op.CastLike(float(eps), input))))
        out = op.Mul(centered, rstd_k)
        save_mean = op.Squeeze(mean_k, axes)
        save_rstd = op.Squeeze(rstd_k, axes)
        count = op.Div(
            op.Cast(op.Size(input), to=ir.DataType.FLOAT),
            op.Cast(op.Shape(input, start=1, end=2), to=ir.DataType.FLOAT),
        )
        correction = op.CastLike(op.Div(count, op.Sub(count, 1.0)), input)
        unbiased = op.Mul(op.Squeeze(var_k, axes), correction)
        keep = op.CastLike(1.0 - m, running_mean)
        new_mean = op.Add(
            op.Mul(op.CastLike(m, running_mean), op.CastLike(save_mean, running_mean)),
            op.Mul(keep, running_mean),
        )
        new_var = op.Add(
            op.Mul(op.CastLike(m, running_var), op.CastLike(unbiased, running_var)),
            op.Mul(op.CastLike(1.0 - m, running_var), running_var),
        )
    else:
        rstd = op.Reciprocal(op.Sqrt(op.Add(running_var, op.CastLike(float(eps), running_var))))
        out = op.Mul(
            op.Sub(input, op.CastLike(_bcast(running_mean), input)),
            op.CastLike(_bcast(rstd), input),
        )
        empty = _const(np.zeros((0,)), like=input)
        save_mean, save_rstd = empty, op.Identity(empty)
        new_mean, new_var = op.Identity(running_mean), op.Identity(running_var)
    if weight is not None:
        out = op.Mul(out, _bcast(weight))
    if bias is not None:
        out = op.Add(out, _bcast(bias))
    return out, save_mean, save_rstd, new_mean, new_var


# --------------------------------------------------------------------------- allocation


def empty_permuted(
    size: Sequence[int],
    physical_layout: Sequence[int],
    dtype: int = -1,
    layout: str = "",
    device: str = "",
    pin_memory: bool = False,
):
    """empty_permuted(SymInt[] size, int[] physical_layout, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor

    An uninitialised tensor of shape ``size`` whose memory is laid out in ``physical_layout``
    order (SiLU's and other pointwise backwards allocate with it). ONNX values have no strides,
    so it is torch_lib's ``aten.empty`` of the logical shape (zeros).
    """
    from onnxscript.function_libs.torch_lib.ops.core import aten_empty

    return aten_empty(size, dtype=ir.DataType.FLOAT if dtype in (-1, None) else dtype)


CUSTOM_TRANSLATION_TABLE: dict = {
    torch.ops.aten.empty_permuted.default: empty_permuted,
    torch.ops.aten._native_batch_norm_legit_functional.default: native_batch_norm_legit_functional,
    torch.ops.aten.convolution_backward.default: convolution_backward,
    torch.ops.aten.avg_pool2d.default: avg_pool2d,
    torch.ops.aten.avg_pool3d.default: avg_pool3d,
    torch.ops.aten.avg_pool2d_backward.default: avg_pool2d_backward,
    torch.ops.aten.avg_pool3d_backward.default: avg_pool3d_backward,
    torch.ops.aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
}
"""Pass as ``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``."""
