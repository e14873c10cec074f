"""``torch.optim`` objects for the in-graph trainer: optimizers read into graph configs, LR
schedulers stepped per update, and the trainer's state in torch's ``state_dict`` layout.

The in-graph trainer computes Adam, AdamW and SGD as ONNX ops, so it can take a
``torch.optim`` object only where its hyper-parameters are ones the graph implements; anything
else is an :class:`InvalidArgumentError` that points to :func:`ort_offload.offload`, where the
user's own optimizer runs in torch.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ort_offload.export import optimizers
from ort_offload.errors import CheckpointError, InvalidArgumentError

USE_OFFLOAD = "use ort_offload.offload(model, device, ...) to keep this optimizer in your own torch loop"
# Options every supported optimizer must leave at these values (they change the update).
_FIXED = {"amsgrad": (False,), "maximize": (False,), "capturable": (False,), "differentiable": (False,),
          "dampening": (0,), "fused": (None, False)}
# Options that only pick an implementation of the same update.
# Scheduler bookkeeping (OneCycleLR, CyclicLR, ...) lives in the param group too.
_IGNORED = {"foreach", "decoupled_weight_decay", "params", "initial_lr", "max_lr", "min_lr",
            "base_momentum", "max_momentum", "base_lr"}


def _refuse(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{message}; {USE_OFFLOAD}")


def config_from_torch(optimizer: torch.optim.Optimizer) -> optimizers.OptimizerConfig:
    """The graph optimizer that computes what ``optimizer`` (AdamW, Adam or SGD, one param group) does."""
    kinds = {torch.optim.AdamW: optimizers.AdamW, torch.optim.Adam: optimizers.Adam, torch.optim.SGD: optimizers.SGD}
    cls = kinds.get(type(optimizer))
    if cls is None:
        raise _refuse(f"the in-graph trainer computes AdamW, Adam and SGD, not {type(optimizer).__name__}")
    if len(optimizer.param_groups) != 1:
        raise _refuse(f"the in-graph trainer takes one param group, the optimizer has {len(optimizer.param_groups)}")
    group = optimizer.param_groups[0]
    if cls is optimizers.Adam and group.get("decoupled_weight_decay"):
        cls = optimizers.AdamW  # Adam(decoupled_weight_decay=True) is AdamW
    for option, value in _FIXED.items():
        if option in group and group[option] not in value:
            raise _refuse(f"{type(optimizer).__name__}({option}={group[option]!r}) is not computed in the graph")
    fields = {f.name for f in dataclasses.fields(cls)}
    known = fields | set(_FIXED) | _IGNORED
    unknown = sorted(k for k in group if k not in known)
    if unknown:
        raise _refuse(f"{type(optimizer).__name__} option {unknown[0]!r} is not computed in the graph")
    values = {k: _plain(group[k]) for k in fields if k in group}
    return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    """The names of ``optimizer``'s parameters in its order (the indices of its state_dict)."""
    by_id = {}
    for name, param in model.named_parameters():
        by_id.setdefault(id(param), name)
    names = [by_id.get(id(p)) for p in optimizer.param_groups[0]["params"]]
    if None in names:
        raise InvalidArgumentError("the optimizer holds tensors that are not parameters of the model: "
                                   "build it from model.parameters()")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in names]
    if missing:
        raise InvalidArgumentError(f"the optimizer must hold every trainable parameter; missing {', '.join(missing[:3])}"
                                   " (set requires_grad=False on parameters you freeze)")
    return names


def default_param_names(model: torch.nn.Module) -> list[str]:
    """The order ``torch.optim.X(model.parameters())`` gives (tied parameters once)."""
    return [n for n, _ in model.named_parameters()]


@dataclasses.dataclass
class Scheduler:
    """A ``torch.optim.lr_scheduler`` driving the graph's learning rate, one step per update.

    The graph's other hyper-parameters are constants, so a scheduler that changes them (e.g.
    OneCycleLR's momentum cycling) is refused at the update where it does."""

    scheduler: Any
    config: optimizers.OptimizerConfig

    def __post_init__(self) -> None:
        if len(self.scheduler.optimizer.param_groups) != 1:
            raise _refuse("the in-graph trainer schedules one param group")
        if getattr(self.scheduler, "cycle_momentum", False):
            raise _refuse(f"{type(self.scheduler).__name__} cycles momentum; the in-graph trainer schedules lr only "
                          "(pass cycle_momentum=False)")
        self._check()

    @property
    def lr(self) -> float:
        return float(self.scheduler.optimizer.param_groups[0]["lr"])

    def step(self, loss: float) -> None:
        """Advance the schedule after an update (torch warns that its optimizer did not step:
        the graph did); ``ReduceLROnPlateau`` gets the update's mean micro-batch ``loss``."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(loss)
            else:
                self.scheduler.step()
        self._check()

    def _check(self) -> None:
        group = self.scheduler.optimizer.param_groups[0]
        for field in dataclasses.fields(self.config):
            if field.name != "lr" and field.name in group and _plain(group[field.name]) != getattr(self.config, field.name):
                raise _refuse(f"the scheduler sets {field.name}={_plain(group[field.name])!r}; the in-graph trainer "
                              f"schedules lr only (OneCycleLR/CyclicLR: pass cycle_momentum=False)")


def torch_optimizer_state(config: optimizers.OptimizerConfig, names: Sequence[str], read, held, step: int,
                          lr: float) -> dict[str, Any]:
    """``torch.optim`` ``state_dict()`` of ``config`` over parameters ``names`` (index order)
    after ``step`` updates; ``read(name)`` gives a host copy of a graph state tensor and
    ``held`` names those the graph has (a parameter without them has no torch state)."""
    group = dict(config.torch_optimizer([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0])
    group.update(lr=lr, params=list(range(len(names))))
    state = {}
    for index, name in enumerate(names):
        slots = [optimizers.state_input_name(name, slot) for slot in config.state_names]
        if step == 0 or not all(s in held for s in slots):
            continue
        entry = {"step": torch.tensor(float(step))} if isinstance(config, optimizers.AdamW) else {}
        entry.update({slot: torch.from_numpy(read(s)) for slot, s in zip(config.state_names, slots)})
        if entry:
            state[index] = entry
    return {"state": state, "param_groups": [group]}


def graph_optimizer_state(config: optimizers.OptimizerConfig, names: Sequence[str], state: Any,
                          zeros: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int | None, float]:
    """The graph's optimizer tensors (``zeros``: each one's name and a zero array of its shape),
    the updates its entries count (None when none says) and the lr, from a ``torch.optim``
    ``state_dict`` over ``names``; :class:`CheckpointError` on any misfit."""
    if not isinstance(state, Mapping) or set(state) != {"state", "param_groups"}:
        raise CheckpointError("optimizer state must be a torch.optim state_dict (keys state, param_groups)")
    groups = state["param_groups"]
    if len(groups) != 1 or list(groups[0].get("params", [])) != list(range(len(names))):
        raise CheckpointError(f"optimizer state must have one param group over parameters 0..{len(names) - 1}")
    lr = groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
        raise CheckpointError(f"optimizer lr must be a number at least 0, got {lr!r}")
    per_param = state["state"]
    if not isinstance(per_param, Mapping) or any(k not in range(len(names)) for k in per_param):
        raise CheckpointError("optimizer state is keyed by parameter index")
    steps = {float(e["step"]) for e in per_param.values() if isinstance(e, Mapping) and "step" in e}
    if len(steps) > 1:
        raise CheckpointError("optimizer state has parameters at different steps: resume from one saved together")
    arrays = dict(zeros)
    for index, name in enumerate(names):
        entry = per_param.get(index, {})
        for slot in config.state_names:
            key = optimizers.state_input_name(name, slot)
            if key in zeros and isinstance(entry, Mapping) and entry.get(slot) is not None:
                arrays[key] = entry[slot]
    return arrays, (int(steps.pop()) if steps else None), float(lr)
