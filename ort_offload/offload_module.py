"""The offloaded module: ``m = ort_offload.offload(model, device, example_inputs=...)`` keeps the
user's own torch loop (any optimizer, scheduler, clipping, accumulation).

In training mode, when a gradient is wanted (grad mode on, a parameter that requires grad),
``m(*inputs, *targets)`` runs the planned forward *and* backward graph (one program: the
activations crossing between them are what the planner keeps, swaps or recomputes under the
budget) and returns the loss as a torch tensor; ``loss.backward()`` then hands the gradients the
program computed to autograd, which writes ``param.grad`` (summing over several backward calls,
as torch does; times the incoming gradient, e.g. ``(loss / k).backward()``). When no gradient is
wanted (``torch.no_grad()``, frozen parameters) it runs the planned forward part of that program
only: the loss and the buffer updates. In eval mode (``m.eval()``) it runs the forward-only plan
of the eval-mode model and returns its outputs (or ``loss_fn(outputs, *targets)`` when targets
are given). Parameters stay the model's own tensors, read into the device arena at each call;
the optimizer and its state live wherever torch puts them, outside the budget."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from graph_passes.ir.training_graph import Role
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.errors import InputMismatchError
from ort_offload.export.training_step import export_training_step, initial_state
from ort_offload.runtime.runner import GraphRunner
from ort_offload.trainer import OrtTrainer, as_numpy, resolve_passes

logger = logging.getLogger(__name__)

GRAD_SUFFIX = ".grad"


class _ProgramGradients(torch.autograd.Function):
    """The loss of a forward/backward program whose gradients are already computed: backward
    returns them (times the incoming gradient) for the parameters passed to ``apply``."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, grads: Sequence[torch.Tensor | None], *params: torch.Tensor):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grads is None:  # handed over already (they are not kept: they are a model's size)
            raise RuntimeError("backward through an offloaded module's loss a second time (retain_graph): "
                               "call the module again for another backward")
        scale = None if bool(grad_output == 1) else grad_output  # 1: hand over the program's tensors as they are
        grads = [g if g is None or scale is None else g * scale.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (None, None, *grads)


class OffloadedModule(torch.nn.Module):
    """A module whose training forward/backward runs as one planned program under a budget."""

    def __init__(self, model: torch.nn.Module, trainer: OrtTrainer, num_inputs: int,
                 loss_fn: Callable | None) -> None:
        super().__init__()
        self.model = model
        self.trainer = trainer
        self.num_inputs = num_inputs
        self.loss_fn = loss_fn
        graph = trainer.graph
        own = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        self._synced = [(n, own[n]) for n in graph.state_inputs if n in own]  # torch tensors the program reads
        fetched = graph.step_fetches or []
        trained = [n[: -len(GRAD_SUFFIX)] for n in fetched if graph.roles.get(n) == Role.GRAD]
        self._trained = [(n, own[n]) for n in trained]
        self._updated_buffers = [(n, own[n]) for n, r in graph.roles.items() if r == Role.BUFFER and n in graph.state_pairs]
        self._forward_part: GraphRunner | None = None  # the loss without the backward, made at first use

    def forward(self, *batch):
        self._sync_in()
        if not self.training:
            return self._forward_only(batch)
        wants_grad = torch.is_grad_enabled() and any(p.requires_grad for _, p in self._trained)
        if wants_grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in batch):
            raise InputMismatchError("an input of the offloaded module requires grad, but it gives gradients of its "
                                     "parameters only: detach the input, or offload the model it comes from too")
        if not wants_grad:  # torch.no_grad() or frozen parameters: the forward part alone
            return self._loss_without_backward(batch)
        self.trainer.step(*batch)
        outputs = self.trainer.last_outputs
        self._copy_buffers_out()
        value = torch.from_numpy(np.array(outputs[self.trainer.graph.loss_name]).reshape(()))
        grads = [torch.from_numpy(outputs[name + GRAD_SUFFIX]).view_as(p) if p.requires_grad else None
                 for name, p in self._trained]
        return _ProgramGradients.apply(value, grads, *(p for _, p in self._trained))

    def _loss_without_backward(self, batch) -> torch.Tensor:
        """The training-mode loss from the planned forward part only (no gradients computed)."""
        trainer = self.trainer
        if self._forward_part is None:
            self._forward_part = GraphRunner(trainer.runtime, trainer.graph.forward_part(), passes=trainer.passes)
        outputs = trainer.run_graph(self._forward_part, batch, trainer.batch_names)
        self._copy_buffers_out()
        return torch.from_numpy(np.array(outputs[trainer.graph.loss_name]).reshape(()))

    def _copy_buffers_out(self) -> None:
        """BatchNorm running statistics the program updated, into the model's buffers."""
        with torch.no_grad():
            for name, buffer in self._updated_buffers:
                buffer.copy_(torch.from_numpy(self.trainer.runtime.read(name)))

    def _forward_only(self, batch):
        inputs, targets = batch[: self.num_inputs], batch[self.num_inputs:]
        outputs = self.trainer.eval(*inputs)
        if targets and self.loss_fn is not None:
            return self.loss_fn(outputs, *targets)
        return outputs

    def _sync_in(self) -> None:
        """Copy the current parameters and buffers (the optimizer changed them) into the arena."""
        for name, tensor in self._synced:
            self.trainer.runtime.write(name, as_numpy(tensor))

    def state_dict(self, *args, **kwargs):
        """The wrapped module's ``state_dict`` (same keys as without offloading)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load into the wrapped module; the next forward reads the new values."""
        if assign:
            raise InputMismatchError("load_state_dict(assign=True) would replace the parameters the optimizer holds")
        return self.model.load_state_dict(state_dict, strict=strict)

    def report(self) -> dict[str, Any]:
        """The run report (:data:`ort_offload.report.REPORT_KEYS`) of the forward/backward program."""
        return self.trainer.report()


def offload(
    model: torch.nn.Module,
    device: OffloadDevice,
    *,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor] = (),
    loss_fn: Callable | None = None,
    input_names: Sequence[str] | None = None,
    target_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    passes: str | Sequence[str] = "auto",
    name: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> OffloadedModule:
    """``model`` as a module whose training forward and backward run planned under ``device``'s budget.

    ``m(*inputs, *targets)`` returns ``loss_fn(model(*inputs), *targets)`` (without ``loss_fn``
    the model's forward returns the loss); ``loss.backward()`` writes ``param.grad``.
    Raises :class:`BudgetTooSmallError` here if the budget cannot hold the program.
    """
    if not isinstance(device, OffloadDevice):
        raise TypeError("device must come from ort_offload.set_offload_device(...)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    example_inputs, example_targets = tuple(example_inputs), tuple(example_targets)
    input_names = list(input_names or [f"input{i}" for i in range(len(example_inputs))])
    target_names = list(target_names or [f"target{i}" for i in range(len(example_targets))])
    name = name or type(model).__name__.lower()
    result = export_training_step(
        model, example_inputs=example_inputs, example_targets=example_targets, loss_fn=loss_fn, optimizer=None,
        input_names=input_names, target_names=target_names, dynamic_axes=dynamic_axes, name=name, cache_dir=cache_dir,
    )
    batch = {n: as_numpy(t) for n, t in zip(input_names + target_names, example_inputs + example_targets)}
    trainer = OrtTrainer(
        device, result.graph, initial_state=initial_state(result.graph, model, lr=0.0), example_batch=batch,
        input_names=input_names, target_names=target_names, passes=resolve_passes(passes), model=model,
        dynamic_axes=dynamic_axes, cache_dir=cache_dir,
    )
    return OffloadedModule(model, trainer, len(example_inputs), loss_fn)
