"""Tests for ort_offload.export.aten_translations: CNN training steps exported as one ONNX graph.

Each test builds a tiny loss module, exports forward+backward through
``torch.export`` -> ``_export_forward_backward`` -> ``torch.onnx.export(custom_translation_table=...)``,
runs the graph in onnxruntime and compares loss, every gradient and every buffer mutation with
torch eager autograd.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.export.experimental import _export_forward_backward

from ort_offload.export.aten_translations import CUSTOM_TRANSLATION_TABLE

pytestmark = pytest.mark.filterwarnings("ignore:Exporting a model while it is in training mode")

RTOL = 1e-5
ATOL = 1e-5


def _dynamic_batch():
    batch = torch.export.Dim("batch", min=1)
    return {"x": {0: batch}, "y": {0: batch}}


class _Joint(nn.Module):
    def __init__(self, gm):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return self.gm(*args)


class _Exported:
    """A loss module exported as one forward+backward ONNX graph, runnable in onnxruntime."""

    def __init__(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, dynamic=None):
        """``dynamic``: None, or a function returning fresh ``{"x": {axis: Dim}, "y": {...}}``."""
        self.module = module
        ep = torch.export.export(
            copy.deepcopy(module), (x, y), dynamic_shapes=dynamic() if dynamic else None
        )
        jep = _export_forward_backward(ep)
        self.signature = jep.graph_signature
        arg_dyn = None
        if dynamic:
            user_dyn = dynamic()
            arg_dyn = (
                tuple(
                    user_dyn[spec.arg.name] if spec.kind.name == "USER_INPUT" else None
                    for spec in self.signature.input_specs
                ),
            )
        onnx_program = torch.onnx.export(
            _Joint(jep.graph_module),
            self._args(x, y),
            dynamo=True,
            dynamic_shapes=arg_dyn,
            opset_version=20,
            custom_translation_table=CUSTOM_TRANSLATION_TABLE,
            verbose=False,
        )
        self.model = onnx_program.model_proto
        self.session = ort.InferenceSession(
            self.model.SerializeToString(), providers=["CPUExecutionProvider"]
        )

    def user_input_shapes(self) -> dict[str, list]:
        """ONNX input shapes of the user inputs (x, y), symbolic dims as strings."""
        return {
            spec.arg.name: i.shape
            for spec, i in zip(self.signature.input_specs, self.session.get_inputs())
            if spec.kind.name == "USER_INPUT"
        }

    def _args(self, x, y):
        args = []
        for spec in self.signature.input_specs:
            kind = spec.kind.name
            if kind == "PARAMETER":
                args.append(self.module.get_parameter(spec.target).detach())
            elif kind == "BUFFER":
                args.append(self.module.get_buffer(spec.target).detach())
            elif kind == "USER_INPUT":
                args.append({"x": x, "y": y}[spec.arg.name])
            else:
                raise AssertionError(f"unexpected input kind {kind}")
        return tuple(args)

    def check(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
        """Run one step in onnxruntime and compare everything with torch eager."""
        args = self._args(x, y)
        inputs = self.session.get_inputs()
        assert len(inputs) == len(args)
        outs = self.session.run(None, {i.name: a.numpy() for i, a in zip(inputs, args)})
        ref = copy.deepcopy(self.module)
        ref.zero_grad(set_to_none=True)
        loss = ref(x, y)
        loss.backward()
        specs = self.signature.output_specs
        assert len(outs) == len(specs)
        seen = set()
        for spec, out in zip(specs, outs):
            kind = spec.kind.name
            if kind == "LOSS_OUTPUT":
                expected = loss.detach().numpy()
            elif kind == "GRADIENT_TO_PARAMETER":
                grad = ref.get_parameter(spec.target).grad
                assert grad is not None, spec
                expected = grad.numpy()
            elif kind == "BUFFER_MUTATION":
                expected = ref.get_buffer(spec.target).numpy()
            else:
                raise AssertionError(f"unexpected output kind {kind}")
            assert out.shape == expected.shape, (spec, out.shape, expected.shape)
            np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL, err_msg=str(spec))
            seen.add((kind, spec.target))
        params = {("GRADIENT_TO_PARAMETER", n) for n, _ in self.module.named_parameters()}
        assert params <= seen, params - seen
        return {spec.target or "loss": out for spec, out in zip(specs, outs)}


def _count_ops(model, op_type: str) -> int:
    return sum(node.op_type == op_type for node in model.graph.node)


class _ConvLoss(nn.Module):
    """1x1 conv + tanh (so the tested conv's grad_input is needed) -> tested conv -> MSE."""

    def __init__(self, conv: nn.Module, in_channels: int):
        super().__init__()
        dims = conv.weight.dim() - 2
        pre_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.pre = pre_cls(2, in_channels, 1)
        self.conv = conv

    def forward(self, x, y):
        return ((self.conv(torch.tanh(self.pre(x))) - y) ** 2).mean()


def _conv_case(conv: nn.Module, in_channels: int, spatial: tuple[int, ...], batch: int = 2):
    torch.manual_seed(0)
    module = _ConvLoss(conv, in_channels)
    x = torch.randn(batch, 2, *spatial)
    with torch.no_grad():
        y = torch.randn_like(module.conv(torch.tanh(module.pre(x))))
    return module, x, y


CONV_CASES = {
    "k3_s1_p1_bias": (lambda: nn.Conv2d(3, 4, 3, padding=1), 3, (6, 6)),
    "k3_s2_p1_even": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), 3, (8, 8)),
    "k3_s2_p0_odd_rem_nobias": (lambda: nn.Conv2d(3, 4, 3, stride=2, bias=False), 3, (10, 9)),
    "k1_s1_p0_nobias": (lambda: nn.Conv2d(3, 5, 1, bias=False), 3, (5, 5)),
    "k1_s2_p0_rem": (lambda: nn.Conv2d(3, 4, 1, stride=2), 3, (8, 7)),
    "k3_dil2_p2": (lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2), 3, (7, 7)),
    "k3_s2_dil2_p1_rect": (
        lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)),
        3,
        (9, 6),
    ),
    "depthwise_s2": (lambda: nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4), 4, (7, 7)),
    "groups2_mult2": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), 4, (5, 5)),
    "conv1d_s2": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), 3, (10,)),
    "conv3d_s2": (lambda: nn.Conv3d(3, 2, 3, stride=2, padding=1), 3, (5, 6, 5)),
    "conv_transpose_s2_outpad": (
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
        3,
        (4, 5),
    ),
    "conv_transpose_groups": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=0, groups=2),
        4,
        (3, 3),
    ),
}


def _cases(cases: dict, fast: set[str]) -> list:
    """Every case, those outside ``fast`` (a representative of each kind) marked slow."""
    return [c if c in fast else pytest.param(c, marks=pytest.mark.slow) for c in sorted(cases)]


FAST_CONV_CASES = {"k3_s2_p0_odd_rem_nobias", "k3_s2_dil2_p1_rect", "depthwise_s2", "conv_transpose_groups", "conv1d_s2"}
FAST_POOL_CASES = {"avg_ceil_mode_pad_exclude", "avg_divisor_override_ceil", "adaptive_uneven", "avg3d"}


@pytest.mark.parametrize("case", _cases(CONV_CASES, FAST_CONV_CASES))
def test_convolution_backward(case):
    make_conv, in_channels, spatial = CONV_CASES[case]
    module, x, y = _conv_case(make_conv(), in_channels, spatial)
    exported = _Exported(module, x, y)
    if not isinstance(module.conv, nn.ConvTranspose2d):
        # output_mask honoured: only the tested conv's grad_input is computed (not pre's).
        assert _count_ops(exported.model, "ConvTranspose") == 1
    exported.check(x, y)


class _PoolLoss(nn.Module):
    def __init__(self, pool: nn.Module, dims: int, channels: int = 3):
        super().__init__()
        self.pre = {2: nn.Conv2d, 3: nn.Conv3d}[dims](2, channels, 1)
        self.pool = pool

    def forward(self, x, y):
        return ((self.pool(self.pre(x)) - y) ** 2).mean()


POOL_CASES = {
    "avg_k2_s2": (lambda: nn.AvgPool2d(2), (8, 8)),
    "avg_k3_s2_p1_odd": (lambda: nn.AvgPool2d(3, stride=2, padding=1), (7, 8)),
    "avg_k3_s2_p1_exclude_pad": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
        (7, 6),
    ),
    "avg_k3_s1_rect": (lambda: nn.AvgPool2d((3, 2), stride=(1, 2)), (6, 7)),
    "avg_ceil_mode": (lambda: nn.AvgPool2d(2, stride=2, ceil_mode=True), (5, 7)),
    "avg_ceil_mode_pad_exclude": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        (6, 6),
    ),
    "avg_divisor_override": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, divisor_override=5),
        (7, 7),
    ),
    "avg_divisor_override_ceil": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, divisor_override=4),
        (6, 8),
    ),
    "avg3d": (lambda: nn.AvgPool3d(2, stride=(1, 2, 2), padding=(0, 1, 0)), (4, 5, 6)),
    "adaptive_divisible": (lambda: nn.AdaptiveAvgPool2d((2, 3)), (6, 6)),
    "adaptive_uneven": (lambda: nn.AdaptiveAvgPool2d((3, 2)), (5, 7)),
    "adaptive_global": (lambda: nn.AdaptiveAvgPool2d(1), (4, 5)),
}


@pytest.mark.parametrize("case", _cases(POOL_CASES, FAST_POOL_CASES))
def test_pool_backward(case):
    make_pool, spatial = POOL_CASES[case]
    torch.manual_seed(0)
    module = _PoolLoss(make_pool(), len(spatial))
    x = torch.randn(2, 2, *spatial)
    with torch.no_grad():
        y = torch.randn_like(module.pool(module.pre(x)))
    exported = _Exported(module, x, y)
    exported.check(x, y)


class _BasicBlock(nn.Module):
    """ResNet basic block (stride 2, projection shortcut) + global pool + linear head."""

    def __init__(self, cin=3, cout=8, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cout, classes)

    def forward(self, x, y):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        h = torch.relu(h + self.down(x))
        logits = self.fc(torch.flatten(self.pool(h), 1))
        return nn.functional.cross_entropy(logits, y)


@pytest.fixture(scope="module")
def resnet_block_dynamic():
    torch.manual_seed(0)
    module = _BasicBlock().train()
    x = torch.randn(2, 3, 9, 9)
    y = torch.randint(0, 4, (2,))
    return module, _Exported(module, x, y, dynamic=_dynamic_batch)


def test_resnet_block_batchnorm_training(resnet_block_dynamic):
    module, exported = resnet_block_dynamic
    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 9)
    y = torch.randint(0, 4, (2,))
    outs = exported.check(x, y)
    mutated = {s.target for s in exported.signature.output_specs if s.kind.name == "BUFFER_MUTATION"}
    assert {"bn1.running_mean", "bn1.running_var", "bn2.running_var", "down.1.running_mean"} <= mutated
    # The running stats really moved (so the comparison above is meaningful).
    assert not np.allclose(outs["bn1.running_mean"], module.bn1.running_mean.numpy())


def test_dynamic_batch(resnet_block_dynamic):
    _, exported = resnet_block_dynamic
    shapes = exported.user_input_shapes()
    assert isinstance(shapes["x"][0], str) and isinstance(shapes["y"][0], str), shapes
    assert shapes["x"][1:] == [3, 9, 9], shapes
    for batch in (3, 5):
        torch.manual_seed(batch)
        x = torch.randn(batch, 3, 9, 9)
        y = torch.randint(0, 4, (batch,))
        exported.check(x, y)


def test_dynamic_batch_depthwise_and_pool():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)
            self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
            self.pool = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)
            self.head = nn.Conv2d(4, 3, 1)

        def forward(self, x, y):
            return ((self.head(self.pool(torch.relu(self.dw(self.conv(x))))) - y) ** 2).mean()

    module = Net()
    x = torch.randn(2, 2, 11, 11)
    with torch.no_grad():
        y = torch.randn_like(module.head(module.pool(module.dw(module.conv(x)))))
    exported = _Exported(module, x, y, dynamic=_dynamic_batch)
    for batch in (3, 1):
        xb = torch.randn(batch, *x.shape[1:])
        yb = torch.randn(batch, *y.shape[1:])
        exported.check(xb, yb)


def test_dynamic_spatial_convolution():
    """Symbolic H and W: grad_input/grad_weight fall back to Slice by runtime shapes."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
            self.c2 = nn.Conv2d(4, 3, 3, stride=2)
            self.dw = nn.Conv2d(3, 3, 3, padding=1, groups=3)

        def forward(self, x, y):
            return ((self.dw(self.c2(torch.relu(self.c1(x)))).mean((2, 3)) - y) ** 2).mean()

    module = Net()
    x, y = torch.randn(2, 2, 12, 11), torch.randn(2, 3)

    def dynamic():
        batch = torch.export.Dim("batch", min=1)
        h = torch.export.Dim("h", min=10, max=64)
        w = torch.export.Dim("w", min=10, max=64)
        return {"x": {0: batch, 2: h, 3: w}, "y": {0: batch}}

    exported = _Exported(module, x, y, dynamic=dynamic)
    x_shape = exported.user_input_shapes()["x"]
    assert all(isinstance(d, str) for d in (x_shape[0], x_shape[2], x_shape[3])), x_shape
    for shape in [(2, 2, 12, 11), (3, 2, 16, 13), (1, 2, 10, 20)]:
        exported.check(torch.randn(*shape), torch.randn(shape[0], 3))
