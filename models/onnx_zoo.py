"""Model-zoo ONNX files as trainable torch modules: the nine "light" zoo graphs that ship inside
the ``onnx`` package (AlexNet, DenseNet-121, Inception v1/v2, ResNet-50, ShuffleNet, SqueezeNet,
VGG-19, ZFNet-512).

Those files are inference graphs whose weights are ``ConstantOfShape`` outputs, with a stored
reference output for a fixed input. This module owns the three steps that make them training
inputs for our exporter:

* :func:`materialize` folds the ``ConstantOfShape`` weights into initializers;
* :func:`check_reference` runs the materialized graph in ONNX Runtime on the input the onnx
  backend tests use and compares it with the stored reference output;
* :class:`OnnxGraphModule` is a converter of our own for exactly the op types these graphs use
  (``SUPPORTED_OPS``): it interprets the graph with torch functions, so torch's export builds the
  backward. Weights become parameters, BatchNormalization statistics buffers; the final Softmax
  is dropped and the loss is cross-entropy on its input (the logits).

Training starts from freshly drawn weights (He-normal, seeded), not the shipped constants: every
weight of the shipped files is the same number, which makes every channel identical.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

__all__ = [
    "LIGHT_MODELS",
    "SUPPORTED_OPS",
    "LightModel",
    "OnnxGraphModule",
    "UnsupportedOnnxOpError",
    "build_light_model",
    "check_reference",
    "light_model_path",
    "materialize",
    "reference_input",
]

# Registry name -> file stem under onnx/backend/test/data/light/.
LIGHT_MODELS: dict[str, str] = {
    "alexnet": "light_bvlc_alexnet",
    "densenet121": "light_densenet121",
    "inception_v1": "light_inception_v1",
    "inception_v2": "light_inception_v2",
    "resnet50": "light_resnet50",
    "shufflenet": "light_shufflenet",
    "squeezenet": "light_squeezenet",
    "vgg19": "light_vgg19",
    "zfnet512": "light_zfnet512",
}

SUPPORTED_OPS = frozenset({
    "AveragePool", "Add", "BatchNormalization", "Concat", "Conv", "Dropout", "Gemm",
    "GlobalAveragePool", "LRN", "MaxPool", "Mul", "Relu", "Reshape", "Softmax", "Sum", "Transpose",
    "Unsqueeze",
})

REFERENCE_RTOL = 1e-3
REFERENCE_ATOL = 1e-5


class UnsupportedOnnxOpError(ValueError):
    """A graph with an op type (or attribute) the converter does not translate."""


def light_model_path(name: str) -> Path:
    """The ``.onnx`` file of light zoo model ``name`` inside the installed onnx package."""
    if name not in LIGHT_MODELS:
        raise KeyError(f"unknown light zoo model {name!r}; known: {', '.join(sorted(LIGHT_MODELS))}")
    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"{LIGHT_MODELS[name]}.onnx"


def materialize(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ``ConstantOfShape`` of a constant shape folded into an initializer.

    The folded values become initializers under the same names; graph inputs that are now
    initializers are dropped from the input list, so the graph's inputs are its data inputs.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    kept_nodes, folded = [], {}
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            value = np.zeros(1, np.float32)
            for attr in node.attribute:
                if attr.name == "value":
                    value = numpy_helper.to_array(attr.t)
            folded[node.output[0]] = np.full(shape, value.reshape(-1)[0], dtype=value.dtype)
        else:
            kept_nodes.append(node)
    # Initializers and inputs no node reads (the folded shapes, stray blobs) are dropped.
    used = {name for node in kept_nodes for name in node.input}
    new_inits = [t for t in graph.initializer if t.name in used]
    new_inits += [numpy_helper.from_array(v, name) for name, v in folded.items()]
    init_names = {t.name for t in new_inits}
    inputs = [v for v in graph.input if v.name in used and v.name not in init_names]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    del graph.initializer[:]
    graph.initializer.extend(new_inits)
    del graph.input[:]
    graph.input.extend(inputs)
    out.ir_version = max(out.ir_version, 4)  # IR 4: initializers need not be listed as inputs
    return out


def reference_input(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The input the onnx backend tests feed a light model: ``arange(n) / n`` in the input's shape."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim)
        n = int(np.prod(shape))
        feeds[value.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


def check_reference(name: str) -> float:
    """Run light model ``name`` (materialized) in ONNX Runtime on the reference input; return the
    largest absolute difference from its stored reference output. Raises ``AssertionError`` when
    the outputs differ beyond ``REFERENCE_RTOL``/``REFERENCE_ATOL``."""
    import onnxruntime as ort

    path = light_model_path(name)
    model = materialize(onnx.load(path))
    expected = numpy_helper.to_array(onnx.load_tensor(str(path).replace(".onnx", "_output_0.pb")))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, reference_input(model))[0]
    np.testing.assert_allclose(got, expected, rtol=REFERENCE_RTOL, atol=REFERENCE_ATOL,
                               err_msg=f"light model {name}: output differs from the stored reference")
    return float(np.max(np.abs(got.astype(np.float64) - expected)))


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _pads(attrs: dict, node: onnx.NodeProto) -> tuple[int, int, int, int]:
    """ONNX 2-D pads (top, left, bottom, right) as F.pad's order (left, right, top, bottom)."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise UnsupportedOnnxOpError(f"{node.op_type} {node.name!r}: auto_pad is not supported")
    top, left, bottom, right = attrs.get("pads", [0, 0, 0, 0])
    return left, right, top, bottom


def _safe(name: str) -> str:
    return name.replace(".", "_").replace("/", "_")


class OnnxGraphModule(nn.Module):
    """A torch module that computes an ONNX graph of ``SUPPORTED_OPS`` with torch functions.

    Float initializers become parameters, except BatchNormalization's mean and variance, which
    become buffers (updated in training mode, as ``nn.BatchNorm2d`` does); integer initializers
    (Reshape shapes) are constants. ``logits_only`` drops a Softmax that produces the graph output
    and flattens the result to ``[batch, classes]``. A Reshape whose target keeps the graph's batch
    size in front keeps the batch size of the actual input instead.
    """

    def __init__(self, model: onnx.ModelProto, *, logits_only: bool = True) -> None:
        super().__init__()
        graph = model.graph
        unsupported = sorted({n.op_type for n in graph.node} - SUPPORTED_OPS)
        if unsupported:
            raise UnsupportedOnnxOpError(f"graph {graph.name!r} uses op types the converter has no translation for: "
                                         f"{', '.join(unsupported)}")
        if len(graph.output) != 1:
            raise UnsupportedOnnxOpError(f"graph {graph.name!r} has {len(graph.output)} outputs; expected one")
        self.graph_digest = hashlib.sha256(model.SerializeToString()).hexdigest()[:16]
        self.nodes = [(n.op_type, list(n.input), list(n.output), _attrs(n), n.name) for n in graph.node]
        inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.input_names = [v.name for v in graph.input if v.name not in inits]
        self.graph_batch = graph.input[[v.name for v in graph.input].index(self.input_names[0])] \
            .type.tensor_type.shape.dim[0].dim_value
        stats = {n.input[i] for n in graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
        self.param_of: dict[str, str] = {}  # ONNX initializer name -> attribute name
        self.constants: dict[str, list[int]] = {}
        for name, value in inits.items():
            attr = _safe(name)
            if value.dtype.kind == "f":
                tensor = torch.from_numpy(np.array(value, copy=True))
                if name in stats:
                    self.register_buffer(attr, tensor)
                else:
                    self.register_parameter(attr, nn.Parameter(tensor))
                self.param_of[name] = attr
            else:
                self.constants[name] = [int(v) for v in value.reshape(-1)]
        self.output_name = graph.output[0].name
        producer = {o: n for n in graph.node for o in n.output}
        last = producer.get(self.output_name)
        self.drop_final_softmax = logits_only and last is not None and last.op_type == "Softmax"
        self.logits_name = last.input[0] if self.drop_final_softmax else self.output_name
        self.logits_only = logits_only

    def extra_repr(self) -> str:  # part of the export cache key: the graph itself
        return f"graph={self.graph_digest}, nodes={len(self.nodes)}"

    def reinitialize(self, *, seed: int) -> None:
        """Draw fresh weights: He-normal for weights, 1 for scales, 0 for biases and means, 1 for variances."""
        consumers: dict[str, list[tuple[str, int]]] = {}
        for op, inputs, outputs, _, _ in self.nodes:
            for i, name in enumerate(inputs):
                consumers.setdefault(name, []).append((op, i))
        unsqueezed = {inputs[0]: outputs[0] for op, inputs, outputs, _, _ in self.nodes if op == "Unsqueeze"}
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, attr in self.param_of.items():
                tensor = getattr(self, attr)
                uses = consumers.get(unsqueezed.get(name, name), [])
                if tensor.dim() >= 2:
                    fan_in = math.prod(tensor.shape[1:])
                    transposed = any(op == "Gemm" and i == 1 for op, i in uses) and not self._gemm_trans_b(name)
                    if transposed:
                        fan_in = tensor.shape[0]
                    tensor.normal_(0.0, math.sqrt(2.0 / fan_in), generator=generator)
                elif any((op == "BatchNormalization" and i in (1, 4)) or op == "Mul" for op, i in uses):
                    tensor.fill_(1.0)
                else:
                    tensor.zero_()

    def _gemm_trans_b(self, weight: str) -> bool:
        return any(op == "Gemm" and inputs[1] == weight and attrs.get("transB", 0)
                   for op, inputs, _, attrs, _ in self.nodes)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        values: dict[str, torch.Tensor] = dict(zip(self.input_names, inputs))
        for name, attr in self.param_of.items():
            values[name] = getattr(self, attr)
        batch = inputs[0].shape[0]
        for op, names, outputs, attrs, node_name in self.nodes:
            if self.drop_final_softmax and outputs[0] == self.output_name:
                break
            args = [values[n] if n in values else None for n in names]
            result = self._apply(op, names, args, attrs, node_name, batch)
            values[outputs[0]] = result
        logits = values[self.logits_name]
        return logits.flatten(1) if self.logits_only else logits

    def _apply(self, op, names, args, attrs, node_name, batch):
        if op == "Conv":
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else None
            left, right, top, bottom = _pads(attrs, _Named(op, node_name))
            if (left, top) != (right, bottom):
                x, padding = F.pad(x, (left, right, top, bottom)), 0
            else:
                padding = (top, left)
            return F.conv2d(x, w, bias, stride=tuple(attrs.get("strides", [1, 1])), padding=padding,
                            dilation=tuple(attrs.get("dilations", [1, 1])), groups=attrs.get("group", 1))
        if op == "Relu":
            return F.relu(args[0])
        if op == "MaxPool":
            pads = _pads(attrs, _Named(op, node_name))
            x = F.pad(args[0], pads, value=float("-inf")) if any(pads) else args[0]
            return F.max_pool2d(x, tuple(attrs["kernel_shape"]), tuple(attrs.get("strides", [1, 1])))
        if op == "AveragePool":
            return self._average_pool(args[0], attrs, node_name)
        if op == "GlobalAveragePool":
            return args[0].mean(dim=(2, 3), keepdim=True)
        if op == "LRN":
            return _local_response_norm(args[0], size=attrs["size"], alpha=attrs.get("alpha", 1e-4),
                                        beta=attrs.get("beta", 0.75), bias=attrs.get("bias", 1.0))
        if op == "BatchNormalization":
            x, scale, bias, mean, var = args
            return F.batch_norm(x, mean, var, scale, bias, training=self.training,
                                momentum=1.0 - attrs.get("momentum", 0.9), eps=attrs.get("epsilon", 1e-5))
        if op == "Gemm":
            a, b = args[0], args[1]
            a = a.t() if attrs.get("transA", 0) else a
            b = b.t() if attrs.get("transB", 0) else b
            out = attrs.get("alpha", 1.0) * (a @ b)
            if len(args) > 2 and args[2] is not None:
                out = out + attrs.get("beta", 1.0) * args[2]
            return out
        if op == "Reshape":
            shape = list(self.constants[names[1]])
            if shape and shape[0] == self.graph_batch:
                shape[0] = batch
            shape = [args[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
            return args[0].reshape(shape)
        if op == "Softmax":
            axis = attrs.get("axis", 1)
            x = args[0]
            return F.softmax(x.flatten(axis), dim=-1).reshape(x.shape)
        if op == "Dropout":
            return F.dropout(args[0], p=attrs.get("ratio", 0.5), training=self.training)
        if op == "Unsqueeze":
            x = args[0]
            for axis in sorted(attrs["axes"]):
                x = x.unsqueeze(axis)
            return x
        if op == "Mul":
            return args[0] * args[1]
        if op == "Add":
            return args[0] + args[1]
        if op == "Sum":
            out = args[0]
            for other in args[1:]:
                out = out + other
            return out
        if op == "Concat":
            return torch.cat(args, dim=attrs["axis"])
        if op == "Transpose":
            return args[0].permute(*attrs["perm"])
        raise UnsupportedOnnxOpError(f"no translation for {op} ({node_name!r})")

    @staticmethod
    def _average_pool(x, attrs, node_name):
        kernel = tuple(attrs["kernel_shape"])
        strides = tuple(attrs.get("strides", [1, 1]))
        pads = _pads(attrs, _Named("AveragePool", node_name))
        if not any(pads):
            return F.avg_pool2d(x, kernel, strides)
        if attrs.get("count_include_pad", 0):
            return F.avg_pool2d(F.pad(x, pads), kernel, strides)
        # Excluded padding: sum over the window divided by how many real elements it covers.
        ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype)
        counts = F.avg_pool2d(F.pad(ones, pads), kernel, strides)
        return F.avg_pool2d(F.pad(x, pads), kernel, strides) / counts


@dataclasses.dataclass(frozen=True)
class _Named:
    op_type: str
    name: str


def _local_response_norm(x: torch.Tensor, *, size: int, alpha: float, beta: float, bias: float) -> torch.Tensor:
    """ONNX LRN across channels: ``x / (bias + alpha / size * sum of squares over the window) ** beta``.

    The window sum is a sum of shifted channel slices (standard ops with plain backwards), not
    torch's pooling-based ``local_response_norm``, whose 3-D pooling backward has no ONNX translation.
    """
    squares = x * x
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = F.pad(squares, (0, 0, 0, 0, before, after))
    channels = x.shape[1]
    window = padded[:, 0:channels]
    for shift in range(1, size):
        window = window + padded[:, shift:shift + channels]
    return x / (bias + (alpha / size) * window) ** beta


@dataclasses.dataclass(frozen=True)
class LightModel:
    """A light zoo model ready for the exporter: module, example batch, loss."""

    name: str
    module: OnnxGraphModule
    example_inputs: tuple[torch.Tensor, ...]
    example_targets: tuple[torch.Tensor, ...]
    classes: int
    input_names: tuple[str, ...] = ("x",)
    target_names: tuple[str, ...] = ("y",)

    def make_batch(self, *, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """A synthetic batch of the example's shapes: normal images, uniform class labels."""
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(self.example_inputs[0].shape, generator=generator)
        y = torch.randint(0, self.classes, self.example_targets[0].shape, generator=generator)
        return (x,), (y,)


def build_light_model(name: str, *, seed: int = 0, batch: int | None = None) -> LightModel:
    """Light zoo model ``name`` as a trainable module (fresh seeded weights, training mode)."""
    path = light_model_path(name)
    model = materialize(onnx.load(path))
    module = OnnxGraphModule(model)
    module.reinitialize(seed=seed)
    batch = (module.graph_batch or 1) if batch is None else batch
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = torch.zeros((batch, *shape[1:]))
    with torch.no_grad():
        classes = int(module.eval()(x).shape[1])
    module.train()
    generator = torch.Generator().manual_seed(seed)
    example = (torch.randn(x.shape, generator=generator),), (torch.randint(0, classes, (batch,), generator=generator),)
    return LightModel(name, module, *example, classes)
