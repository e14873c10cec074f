"""``create_ort_trainer``: the trainer for a torch model on an offload device.

A static model is exported as one training-step graph and trained by an
:class:`~ort_offload.trainer.OrtTrainer` (one rank of a
:class:`~ort_offload.distributed.DistributedTrainer` when a process group is given or
initialised); a dynamic model gets a :class:`~ort_offload.dynamic.trainer.BlockwiseTrainer`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import torch

from ort_offload.distributed import DistributedTrainer, data_parallel_group, rank_zero_first, shard_batch
from ort_offload.dynamic.trainer import BlockwiseTrainer, is_dynamic_model
from ort_offload.errors import InputMismatchError, UnknownDeviceError, UnsupportedGraphError
from ort_offload.export import loop_graphs, optimizers, torch_optim
from ort_offload.export.training_step import export_training_step, initial_state
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.trainer import OrtTrainer, as_numpy, resolve_passes

logger = logging.getLogger(__name__)


def create_ort_trainer(
    device: OffloadDevice,
    model: torch.nn.Module,
    *,
    example_inputs: Sequence[torch.Tensor] | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    loss_fn: Callable | None = None,
    optimizer: str | optimizers.OptimizerConfig | torch.optim.Optimizer = "adamw",
    lr: float | None = None,
    input_names: Sequence[str] | None = None,
    target_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    passes: str | Sequence[str] = "auto",
    name: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    stop_on_nonfinite: bool = False,
    process_group: Any = None,
    grad_clip_norm: float | None = None,
    accumulation_steps: int = 1,
    lr_scheduler: Any = None,
    shard_optimizer_state: bool = False,
    max_shapes: Mapping[str, Any] | None = None,
    **optimizer_options,
) -> OrtTrainer:
    """A trainer for ``model`` on ``device``.

    ``example_inputs`` are the model's inputs and ``example_targets`` the extra arguments of
    ``loss_fn(outputs, *targets)``; without ``loss_fn`` the model's forward must return the
    loss. ``optimizer`` is "adamw", "sgd" or a config from :mod:`ort_offload.export.optimizers`;
    ``lr`` and other keyword options (``weight_decay``, ``betas``, ``momentum``) configure it.
    A ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` object is read for its hyper-parameters (its
    state stays empty; the graph computes the update); others are refused, pointing to
    :func:`ort_offload.offload`. ``grad_clip_norm`` clips the global gradient norm in the graph,
    ``accumulation_steps=k`` makes each ``step()`` a micro-batch and every k-th an update (the
    mean of the k gradients), ``lr_scheduler`` (any ``torch.optim.lr_scheduler`` object) sets
    each update's learning rate and steps after it. ``max_shapes`` (inputs whose dynamic axes
    vary): the largest batch, as input name -> shape and/or dynamic axis name -> size
    (``{"seq": 512}``); it is planned first and a fraction budget is a fraction of its unplanned
    peak (else of the first batch's), so every later batch up to it keeps the same bytes.
    Raises :class:`BudgetTooSmallError` before any step if the budget cannot hold the step.
    ``stop_on_nonfinite``: a step with a NaN or infinite loss or update raises
    :class:`NonFiniteError` with the state unchanged (else it is counted in the report).
    ``process_group`` (default: torch.distributed's default group, where initialised) makes the
    trainer one data-parallel rank (:mod:`ort_offload.distributed`): example and step batches
    are global, each rank trains on its shard, and gradients are averaged inside the step;
    ``shard_optimizer_state=True`` then keeps each rank's optimizer state to its 1/N of the
    parameters (ZeRO stage 1-2; without a process group one process holds it all anyway).

    A dynamic model (one with ``blocks()`` and ``path()``, docs/design.md "Dynamic networks") gets a
    :class:`~ort_offload.dynamic.trainer.BlockwiseTrainer` instead: its Python control flow runs
    as written and its blocks run block-wise under the budget; ``example_inputs`` then only
    gives the number of inputs (default 1), and ``loss_fn`` defaults to the model's output.
    """
    if not isinstance(device, OffloadDevice):
        raise TypeError("device must come from ort_offload.set_offload_device(...)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    group = data_parallel_group(process_group)
    if is_dynamic_model(model):
        _check_dynamic_options(group, optimizer, optimizer_options, max_shapes, grad_clip_norm is not None or
                               accumulation_steps != 1 or lr_scheduler is not None)
        return _blockwise_trainer(device, model, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                                  lr=lr, name=name, cache_dir=cache_dir, stop_on_nonfinite=stop_on_nonfinite)
    if example_inputs is None:
        raise InputMismatchError("create_ort_trainer needs example_inputs for a static model (the export traces them)")
    pass_list = resolve_passes(passes)
    config = _optimizer_config(optimizer, lr, optimizer_options)
    loop = _LoopOptions(loop_graphs.check_loop_options(accumulation_steps, grad_clip_norm), accumulation_steps,
                        grad_clip_norm, torch_optim.Scheduler(lr_scheduler, config) if lr_scheduler is not None else None,
                        optimizer if isinstance(optimizer, torch.optim.Optimizer) else None)
    if group is not None and (loop.graphs or loop.scheduler is not None):
        raise UnsupportedGraphError("data-parallel training does not take grad_clip_norm, accumulation_steps or "
                                    "lr_scheduler yet: build the trainer without them or without a process group")
    return _static_trainer(device, model, tuple(example_inputs), tuple(example_targets), config=config, group=group,
                           loss_fn=loss_fn, input_names=input_names, target_names=target_names,
                           dynamic_axes=dynamic_axes, passes=pass_list, name=name, cache_dir=cache_dir,
                           stop_on_nonfinite=stop_on_nonfinite, loop=loop,
                           shard_optimizer_state=bool(shard_optimizer_state), max_shapes=max_shapes)


def _check_dynamic_options(group, optimizer, optimizer_options, max_shapes, loop_options: bool) -> None:
    """Refuse what the block-wise trainer of a dynamic model does not take."""
    if group is not None:
        raise UnsupportedGraphError("dynamic networks do not train data-parallel yet: build the trainer without a process group")
    if not isinstance(optimizer, str) or optimizer_options or loop_options:
        raise InputMismatchError("dynamic models train with optimizer 'adamw' or 'sgd' and lr only")
    if max_shapes is not None:
        raise InputMismatchError("max_shapes is for static models: a dynamic model's fraction budget is of its "
                                 "first batch's no-offload peak; drop max_shapes or give the budget in bytes")


@dataclasses.dataclass(frozen=True)
class _LoopOptions:
    """What the in-graph loop adds to the step: accumulation and clipping graphs, a scheduler,
    and the torch optimizer the hyper-parameters came from (its parameter order)."""

    graphs: bool
    accumulation_steps: int
    grad_clip_norm: float | None
    scheduler: Any
    torch_optimizer: Any


def _optimizer_config(optimizer, lr: float | None, options: Mapping[str, Any]) -> optimizers.OptimizerConfig:
    """The graph optimizer: read from a ``torch.optim`` object, or made from a name and options."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if lr is not None or options:
            raise InputMismatchError("with a torch.optim optimizer, set lr and other options on it, not here")
        return torch_optim.config_from_torch(optimizer)
    return optimizers.make_optimizer(optimizer, lr=lr, **options)

def _blockwise_trainer(device: OffloadDevice, model: torch.nn.Module, *, example_inputs, loss_fn, optimizer: str,
                       lr: float | None, name: str | None, cache_dir, stop_on_nonfinite: bool) -> BlockwiseTrainer:
    """The trainer of a dynamic model: its control flow runs as written, its blocks block-wise."""
    if device.kind != "cpu":
        raise UnknownDeviceError(
            f"dynamic networks train on the CPU device only for now, not {device.name}: use set_offload_device('cpu')"
        )
    return BlockwiseTrainer(
        model, loss_fn if loss_fn is not None else (lambda output, *targets: output), device=device,
        optimizer=optimizer, lr=lr if lr is not None else 1e-3,
        num_inputs=len(example_inputs) if example_inputs is not None else 1, name=name, cache_dir=cache_dir,
        stop_on_nonfinite=stop_on_nonfinite,
    )


def _static_trainer(device: OffloadDevice, model: torch.nn.Module, example_inputs: tuple, example_targets: tuple, *,
                    config, group, loss_fn, input_names, target_names, dynamic_axes, passes, name, cache_dir,
                    stop_on_nonfinite: bool, loop: _LoopOptions, shard_optimizer_state: bool = False,
                    max_shapes=None) -> OrtTrainer:
    """Export ``model``'s training step and build its trainer (one rank's, with a process group)."""
    trainer_class, rank_options = OrtTrainer, {}
    if group is not None:  # the examples are a global batch: the graph is this rank's shard's
        rank, world_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        example_inputs = shard_batch(example_inputs, rank, world_size)
        example_targets = shard_batch(example_targets, rank, world_size)
        trainer_class = DistributedTrainer
        rank_options = {"process_group": group, "shard_optimizer_state": shard_optimizer_state}
    input_names = list(input_names or [f"input{i}" for i in range(len(example_inputs))])
    target_names = list(target_names or [f"target{i}" for i in range(len(example_targets))])
    name = name or type(model).__name__.lower()
    with rank_zero_first(group):
        result = export_training_step(
            model, example_inputs=example_inputs, example_targets=example_targets, loss_fn=loss_fn,
            optimizer=None if loop.graphs else config, input_names=input_names, target_names=target_names,
            dynamic_axes=dynamic_axes, name=name, cache_dir=cache_dir,
        )
    logger.info("training graph %s: %d nodes (cache %s)", name, len(result.graph.graph.node), "hit" if result.cache_hit else "miss")
    graphs = loop_graphs.build_loop_graphs(result.graph, config, accumulation_steps=loop.accumulation_steps,
                                           grad_clip_norm=loop.grad_clip_norm) if loop.graphs else None
    graph = graphs.update if graphs is not None else result.graph
    order = torch_optim.param_names(loop.torch_optimizer, model) if loop.torch_optimizer is not None else None
    batch = {n: as_numpy(t) for n, t in zip(input_names + target_names, example_inputs + example_targets)}
    return trainer_class(
        device,
        graph,
        initial_state=initial_state(graph, model, lr=loop.scheduler.lr if loop.scheduler else config.lr, step=1),
        example_batch=batch,
        input_names=input_names,
        target_names=target_names,
        passes=passes,
        model=model,
        optimizer_config=config,
        dynamic_axes=dynamic_axes,
        cache_dir=cache_dir,
        stop_on_nonfinite=stop_on_nonfinite,
        loop=graphs,
        scheduler=loop.scheduler,
        param_order=order,
        max_shapes=max_shapes,
        **rank_options,
    )
