"""Optimizers written as ONNX ops inside the training-step graph.

Each optimizer appends, for every parameter with a gradient, the nodes that compute the updated
parameter and optimizer state from the parameter, its gradient and the state, matching
``torch.optim.AdamW`` / ``torch.optim.Adam`` / ``torch.optim.SGD`` (single-tensor semantics). The learning rate and
the step count are graph inputs (``optimizer.lr``, ``optimizer.step``) so schedules need no
re-export; the other hyper-parameters are constants of the graph.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np
import onnx_ir as ir

from ort_offload.errors import InvalidArgumentError
from ort_offload.validation import check_learning_rate

LR_INPUT = "optimizer.lr"
STEP_INPUT = "optimizer.step"
APPLY_INPUT = "optimizer.apply"  # gradient accumulation: above 0 on the micro-batch that updates
UPDATED_SUFFIX = ".updated"


@dataclasses.dataclass(frozen=True)
class AdamW:
    """``torch.optim.AdamW`` (decoupled weight decay, no amsgrad)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self) -> None:
        _check_hyperparameters(self.lr, weight_decay=self.weight_decay, eps=self.eps)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise InvalidArgumentError(f"betas must be two numbers in [0, 1), got {self.betas!r}")

    def torch_optimizer(self, params):
        import torch

        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=False
        )


@dataclasses.dataclass(frozen=True)
class Adam(AdamW):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient, no amsgrad)."""

    weight_decay: float = 0.0

    def torch_optimizer(self, params):
        import torch

        return torch.optim.Adam(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=False
        )


@dataclasses.dataclass(frozen=True)
class SGD:
    """``torch.optim.SGD`` with optional momentum and Nesterov momentum (no dampening)."""

    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_hyperparameters(self.lr, weight_decay=self.weight_decay, momentum=self.momentum)
        if self.nesterov and not self.momentum:
            raise InvalidArgumentError("nesterov needs a momentum above 0")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def torch_optimizer(self, params):
        import torch

        return torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, nesterov=self.nesterov,
            foreach=False,
        )


OptimizerConfig = Union[AdamW, Adam, SGD]


def _check_hyperparameters(lr, **others) -> None:
    """A finite, non-negative learning rate and finite, non-negative other hyper-parameters."""
    check_learning_rate(lr, name="lr")
    for name, value in others.items():
        check_learning_rate(value, name=name)


def make_optimizer(name: str | OptimizerConfig, *, lr: float | None = None, **kwargs) -> OptimizerConfig:
    """An optimizer config from a name ('adamw', 'adam', 'sgd') or a config instance."""
    if isinstance(name, (AdamW, SGD)):
        return dataclasses.replace(name, **({"lr": lr} if lr is not None else {}), **kwargs)
    classes = {"adamw": AdamW, "adam": Adam, "sgd": SGD}
    try:
        cls = classes[name.lower()]
    except (KeyError, AttributeError):
        raise InvalidArgumentError(f"unknown optimizer {name!r}: use one of {', '.join(classes)}") from None
    if lr is not None:
        kwargs["lr"] = lr
    return cls(**kwargs)


def state_input_name(param: str, state: str) -> str:
    return f"{param}.{state}"


def updated_name(name: str) -> str:
    return name + UPDATED_SUFFIX


class _Builder:
    """Appends nodes to a graph with unique names and scalar constants of a given dtype."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self.count = 0

    def op(self, op_type: str, *inputs: ir.Value, name: str | None = None, **attrs) -> ir.Value:
        self.count += 1
        node = ir.node(op_type, list(inputs), attrs or None, name=f"{self.prefix}/{op_type}_{self.count}")
        node.outputs[0].name = name or f"{self.prefix}/{op_type}_{self.count}_out"
        self.graph.append(node)
        return node.outputs[0]

    def const(self, value: float, dtype: ir.DataType) -> ir.Value:
        array = np.array(value, dtype=dtype.numpy())
        return self.op("Constant", value=ir.tensor(array))


def append_update(
    graph: ir.Graph,
    config: OptimizerConfig,
    *,
    param: ir.Value,
    grad: ir.Value,
    states: dict[str, ir.Value],
    lr: ir.Value,
    step: ir.Value,
) -> dict[str, ir.Value]:
    """Append the update of one parameter; returns {param or state input name: updated value}."""
    b = _Builder(graph, f"optimizer/{param.name}")
    dtype = param.dtype
    if lr.dtype != dtype:
        lr = b.op("Cast", lr, to=dtype)
        step = b.op("Cast", step, to=dtype)
    if isinstance(config, AdamW):
        return _adamw(b, config, param, grad, states, lr, step, dtype)
    return _sgd(b, config, param, grad, states, lr, dtype)


def _adamw(b, config: AdamW, param, grad, states, lr, step, dtype):
    beta1, beta2 = config.betas
    one = b.const(1.0, dtype)
    decayed = param
    if isinstance(config, Adam):  # Adam's L2 decay: g += wd * p
        if config.weight_decay:
            grad = b.op("Add", grad, b.op("Mul", param, b.const(config.weight_decay, dtype)))
    elif config.weight_decay:  # AdamW's decoupled decay first, as torch does: p *= 1 - lr * wd
        decay = b.op("Sub", one, b.op("Mul", lr, b.const(config.weight_decay, dtype)))
        decayed = b.op("Mul", param, decay)
    m, v = states["exp_avg"], states["exp_avg_sq"]
    # The same arithmetic as torch's single-tensor Adam: exp_avg.lerp_(grad, 1 - beta1) ...
    m_new = b.op("Add", m, b.op("Mul", b.op("Sub", grad, m), b.const(1.0 - beta1, dtype)), name=updated_name(m.name))
    # ... exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) ...
    v_new = b.op(
        "Add",
        b.op("Mul", v, b.const(beta2, dtype)),
        b.op("Mul", b.op("Mul", grad, b.const(1.0 - beta2, dtype)), grad),
        name=updated_name(v.name),
    )
    # ... and bias corrections in double precision: 1 - beta2**t cancels catastrophically in float32.
    f64 = ir.DataType.DOUBLE
    step64 = b.op("Cast", step, to=f64)
    one64 = b.const(1.0, f64)
    bias_correction1 = b.op("Cast", b.op("Sub", one64, b.op("Pow", b.const(beta1, f64), step64)), to=dtype)
    bias_correction2_sqrt = b.op("Cast", b.op("Sqrt", b.op("Sub", one64, b.op("Pow", b.const(beta2, f64), step64))),
                                 to=dtype)
    step_size = b.op("Div", lr, bias_correction1)
    denom = b.op("Add", b.op("Div", b.op("Sqrt", v_new), bias_correction2_sqrt), b.const(config.eps, dtype))
    p_new = b.op(
        "Sub", decayed, b.op("Mul", step_size, b.op("Div", m_new, denom)), name=updated_name(param.name)
    )
    return {param.name: p_new, m.name: m_new, v.name: v_new}


def _sgd(b, config: SGD, param, grad, states, lr, dtype):
    decayed_grad = grad
    if config.weight_decay:
        decayed_grad = b.op("Add", grad, b.op("Mul", param, b.const(config.weight_decay, dtype)))
    direction = decayed_grad
    updates = {}
    if config.momentum:
        # A zero-initialised buffer gives torch's first-step `buf = grad` exactly: mu*0 + g.
        buf = states["momentum_buffer"]
        direction = b.op(
            "Add", b.op("Mul", buf, b.const(config.momentum, dtype)), decayed_grad, name=updated_name(buf.name)
        )
        updates[buf.name] = direction
        if config.nesterov:  # torch: g + momentum * buf
            direction = b.op("Add", decayed_grad, b.op("Mul", direction, b.const(config.momentum, dtype)))
    p_new = b.op("Sub", param, b.op("Mul", lr, direction), name=updated_name(param.name))
    updates[param.name] = p_new
    return updates
