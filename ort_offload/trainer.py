"""The trainer users hold: ``create_ort_trainer(device, model, ...)`` → :class:`OrtTrainer`.

It exports the model's training step once (cached), places parameters, optimizer state and
buffers in the device's arena, checks the budget before the first step, and runs steps through
the runtime. State never leaves the runtime except through ``state_dict()`` (torch's layout),
``flat_state()`` (by graph name), ``save()`` and ``copy_to()``; checkpoints are written
atomically and validated before anything is changed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from graph_passes.ir.shapes import check_inputs
from graph_passes.ir.training_graph import Role, TrainingGraph
from graph_passes.planning.strategies import PASSES
from ort_offload import torch_checkpoint
from ort_offload.export import loop_graphs, optimizers, torch_optim
from ort_offload.checkpoint import CHECKPOINT_FORMAT  # noqa: F401  (public: the format name, as before)
from ort_offload.checkpoint import Checkpoint, check_state, read_checkpoint, write_checkpoint
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.errors import (
    CheckpointError, InputMismatchError, NonFiniteError, OffloadError,
)
from ort_offload.export.training_step import export_forward
from ort_offload.export.graph_inputs import check_batch, gather_index_limits
from ort_offload.budget_basis import FIRST_BATCH, MAX_SHAPES, basis_for, max_batch
from ort_offload.report import REPORT_KEYS
from ort_offload.runtime.runner import GraphRunner, Runtime
from ort_offload.validation import check_learning_rate

logger = logging.getLogger(__name__)

AVAILABLE_PASSES: tuple[str, ...] = tuple(PASSES)  # the planning registry's pass names
# What "auto" uses: swap; split (TSPLIT) only where swap alone cannot plan the budget.
AUTO_PASSES: tuple[str, ...] = ("swap", "split")
PASS_CHOICES = ("auto", "none")


def resolve_passes(passes: str | Sequence[str]) -> list[str]:
    """The passes to apply: "auto" (whatever the budget needs), "none", or explicit names."""
    if isinstance(passes, str):
        if passes == "none":
            return []
        if passes == "auto":
            return list(AUTO_PASSES)  # each is used only when the budget needs it
        passes = [p.strip() for p in passes.split(",") if p.strip()]
    unknown = [p for p in passes if p not in AVAILABLE_PASSES]
    if unknown:
        choices = ", ".join(PASS_CHOICES + AVAILABLE_PASSES)
        raise OffloadError(f"unknown pass {unknown[0]!r}: choose from {choices}")
    return list(passes)


def as_numpy(value) -> np.ndarray:
    """A C-contiguous numpy array of a tensor or array-like (0-d stays 0-d)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().numpy()
    array = np.asarray(value)  # not ascontiguousarray: it turns 0-d arrays into 1-d ones
    return array if array.flags.c_contiguous else array.copy(order="C")


class OrtTrainer:
    """Trains one model on an :class:`OffloadDevice` under its budget."""

    def __init__(
        self,
        device: OffloadDevice,
        graph: TrainingGraph,
        *,
        initial_state: Mapping[str, np.ndarray],
        example_batch: Mapping[str, np.ndarray],
        input_names: Sequence[str],
        target_names: Sequence[str],
        passes: Sequence[str] = (),
        model: torch.nn.Module | None = None,
        optimizer_config: optimizers.OptimizerConfig | None = None,
        dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
        cache_dir: str | os.PathLike | None = None,
        stop_on_nonfinite: bool = False,
        loop: loop_graphs.LoopGraphs | None = None,
        scheduler: torch_optim.Scheduler | None = None,
        param_order: Sequence[str] | None = None,
        max_shapes: Mapping[str, Any] | None = None,
    ) -> None:
        """Place ``initial_state`` on the device and check the budget for ``example_batch``.

        Use :func:`create_ort_trainer` for a torch model; this constructor also serves graphs
        that come as ONNX files (no ``model``: ``eval()`` and ``copy_to()`` are unavailable).
        ``stop_on_nonfinite``: a step whose loss or updated state is NaN or infinite raises
        :class:`NonFiniteError` and leaves the state as it was (each step then keeps a host copy
        of the state it updates); otherwise such steps are counted in ``report()``.
        ``loop``: how ``graph`` (``loop.update``) accumulates and clips; ``scheduler`` sets the
        learning rate of each update; ``param_order``: parameter names in the optimizer's order
        (the torch-format checkpoint's indices). ``max_shapes``: the largest batch shapes
        (input name -> shape, or dynamic axis name -> size; :func:`~ort_offload.budget_basis.max_batch`):
        planned first, and a fraction budget is resolved against their unplanned peak instead of
        ``example_batch``'s. A graph ``ort-offload transform`` planned resolves it against the
        original graph's peak recorded in its metadata.
        """
        self.device = device
        self.graph = graph
        self.model = model
        self.optimizer_config = optimizer_config
        self.name = graph.name
        self.passes = list(passes)
        self.input_names = list(input_names)
        self.target_names = list(target_names)
        self.dynamic_axes = dict(dynamic_axes or {})
        self._example_inputs = tuple(example_batch[n] for n in self.input_names)
        self._cache_dir = cache_dir
        self.losses: list[float] = []
        self.stop_on_nonfinite = bool(stop_on_nonfinite)
        self.nonfinite_steps: list[int] = []  # numbers (1-based) of steps with a non-finite loss or state
        # Updated state the model itself uses (not optimizer moments): what every step checks.
        self._model_state = [n for n in graph.state_pairs if graph.roles.get(n) in (Role.PARAM, Role.BUFFER)]
        # Read off the graph once (each is a walk over its inputs or outputs)
        self._loss_name = graph.loss_name
        self._counts_steps = optimizers.STEP_INPUT in graph.state_inputs
        self.last_outputs: dict[str, np.ndarray] = {}
        self.runtime = Runtime(device)
        self.runner = self._make_runner(graph)
        self._eval_runner: GraphRunner | None = None
        self._step_count = 0
        self.loop = loop
        self.scheduler = scheduler
        self.param_order = list(param_order) if param_order is not None else None
        self.grad_norms: list[float] = []  # the global gradient norm of each update (before clipping)
        self._micro = 0  # micro-batches done of the update in progress
        # (runner, batch signature) -> its checked program, at state version _prepare_cache_version
        self._prepare_cache: dict[tuple, Any] = {}
        self._prepare_cache_version = -1
        prepared = self._plan_first(initial_state, example_batch, max_shapes)
        self.runtime.place_state(
            initial_state, prepared.program.state_inputs, self.runner.capacity_for(prepared),
            host=prepared.program.host_state,
        )
        # Batch inputs that index a table (token ids into an embedding): their valid range.
        self._index_limits = gather_index_limits(graph.model, {n: self.runtime.info(n).shape for n in graph.state_inputs},
                                                 self.batch_names)

    def _plan_first(self, initial_state, example_batch: Mapping[str, np.ndarray], max_shapes):
        """Plan the largest shapes (where given: a fraction budget resolves against their peak),
        then the example batch; the example's program."""
        check_batch(example_batch, {})
        self._fix_recorded_basis(example_batch)
        model = self.graph.model
        source = FIRST_BATCH
        if max_shapes:
            largest = max_batch(example_batch, self.runner.declared_inputs, max_shapes)
            source = MAX_SHAPES
            if any(largest[n].shape != a.shape for n, a in example_batch.items()):
                largest_feeds = {**initial_state, **check_batch(largest, {})}
                self.runner.prepare(check_inputs(model, largest_feeds), probe_feeds=largest_feeds, basis_source=source)
        feeds = {**initial_state, **example_batch}
        return self.runner.prepare(check_inputs(model, feeds), probe_feeds=feeds, basis_source=source)

    def _fix_recorded_basis(self, example_batch: Mapping[str, np.ndarray]) -> None:
        """A planned graph's fraction budget resolves against the original step's recorded peak."""
        shapes = {n: a.shape for n, a in example_batch.items()}
        basis = basis_for(self.graph.model, self.name, shapes, fraction=self.device.budget is not None
                          and self.device.budget.is_fraction)
        if basis is not None:
            self.runtime.fix_budget_basis(basis)

    def _make_runner(self, graph: TrainingGraph) -> GraphRunner:
        """The runner of the training step (data-parallel training runs its own)."""
        return GraphRunner(self.runtime, graph, fetches=graph.step_fetches, passes=self.passes)

    # ---- properties -------------------------------------------------------------------------

    @property
    def batch_names(self) -> list[str]:
        return self.input_names + self.target_names

    @property
    def lr(self) -> float:
        return float(self.runtime.read(optimizers.LR_INPUT))

    @lr.setter
    def lr(self, value: float) -> None:
        self.runtime.write(optimizers.LR_INPUT, np.array(check_learning_rate(value, name="lr"), dtype=np.float32))

    @property
    def steps_done(self) -> int:
        return self._step_count

    # ---- training ---------------------------------------------------------------------------

    def _feeds(self, batch: Sequence[Any], names: Sequence[str]) -> dict[str, np.ndarray]:
        if len(batch) != len(names):
            raise InputMismatchError(f"step takes {len(names)} tensors ({', '.join(names)}), got {len(batch)}")
        return check_batch({n: as_numpy(t) for n, t in zip(names, batch)}, self._index_limits)

    def _prepare(self, runner: GraphRunner, feeds: Mapping[str, np.ndarray]):
        """Check the batch against the graph (state as resident) and get the step's program.

        Both depend only on the batch's names, dtypes and shapes and on the state's (which
        change only with ``runtime.state_version``): a batch like an earlier one reuses its result."""
        runtime = self.runtime
        key = (runner, tuple([(n, a.dtype.str, a.shape) for n, a in feeds.items()]))
        if self._prepare_cache_version != runtime.state_version:
            self._prepare_cache.clear()
            self._prepare_cache_version = runtime.state_version
        prepared = self._prepare_cache.get(key)
        if prepared is not None:
            return runner.prepared_again(prepared)
        prepared = self._check_and_prepare(runner, feeds)
        self._prepare_cache[key] = prepared
        return prepared

    def _check_and_prepare(self, runner: GraphRunner, feeds: Mapping[str, np.ndarray]):
        runtime = self.runtime
        resident = {n: _Shaped(runtime.info(n)) for n in runner.graph.state_inputs}
        infos = check_inputs(runner.graph.model, {**resident, **feeds}, declared=runner.declared_inputs)
        # Real values for any shape probe: data-dependent shapes must see the actual batch.
        return runner.prepare(infos, probe_feeds=lambda: {**{n: runtime.view(n) for n in runner.graph.state_inputs}, **feeds})

    @property
    def accumulation_steps(self) -> int:
        return 1 if self.loop is None else self.loop.accumulation_steps

    def step(self, *batch) -> float:
        """One training step on ``batch`` (model inputs, then targets); returns the loss.

        With ``accumulation_steps=k`` each call is one micro-batch and every k-th call updates."""
        feeds = self._feeds(batch, self.batch_names)
        prepared = self._prepare(self.runner, feeds)  # a new shape's budget error comes before any state changes
        last = self._micro + 1 >= self.accumulation_steps
        if last and self.scheduler is not None:
            self.lr = self.scheduler.lr
        if self.accumulation_steps > 1:
            self.runtime.write(loop_graphs.APPLY_INPUT, np.array(float(last), dtype=np.float32))
        before = {n: self.runtime.read(n) for n in self.graph.state_pairs} if self.stop_on_nonfinite else None
        outputs = self.runner.run(feeds, prepared)
        self.last_outputs = outputs  # what the step fetched: the loss, and gradients a graph outputs
        loss = float(outputs[self._loss_name]) if self._loss_name is not None else None
        self._check_finite(loss, before)
        if not last:
            self._micro += 1
            self.losses.append(loss)
            return loss
        self._micro = 0
        if loop_graphs.GRAD_NORM_OUTPUT in outputs:
            self.grad_norms.append(float(outputs[loop_graphs.GRAD_NORM_OUTPUT]))
        if self.scheduler is not None:
            update_losses = self.losses[max(0, len(self.losses) - self.accumulation_steps + 1):] + [loss]
            self.scheduler.step(statistics.fmean(update_losses))
        self._step_count += 1
        if self._counts_steps:  # the number of the next step (Adam's t)
            self.runtime.write(optimizers.STEP_INPUT, np.array(self._step_count + 1, dtype=np.float32))
        if loss is None:
            return float("nan")
        self.losses.append(loss)
        return loss

    def _check_finite(self, loss: float | None, before: Mapping[str, np.ndarray] | None) -> None:
        """Count a step whose loss or updated state is not finite; with ``before`` (the state
        it updated, as it was) restore that state and raise :class:`NonFiniteError`.

        Without ``before`` only parameters and buffers are looked at: a non-finite optimizer
        moment makes its parameter non-finite in the same update, at a third of the reads."""
        names = before if before is not None else self._model_state
        where = "the loss" if loss is not None and not math.isfinite(loss) else self.runtime.first_nonfinite(names)
        if where is None:
            return
        step = self._step_count + 1
        self.nonfinite_steps.append(step)
        if before is not None:
            for name, array in before.items():
                self.runtime.write(name, array)
            raise NonFiniteError(f"step {step} gave non-finite values in {where}; the state is as before the step: "
                                 "lower the learning rate or check the batch for NaN/inf")
        if len(self.nonfinite_steps) == 1:
            logger.warning("step %d of %s gave non-finite values in %s; later ones are counted in "
                           "report()['nonfinite_steps']", step, self.name, where)

    def eval(self, *inputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model's outputs (eval mode: BatchNorm running stats, no dropout) with the current weights."""
        if self.model is None:
            raise OffloadError("eval() needs the torch model; this trainer was built from an ONNX graph")
        if self._eval_runner is None:
            result = export_forward(
                self.model, example_inputs=[torch.from_numpy(a) for a in self._example_inputs], input_names=self.input_names,
                dynamic_axes=self.dynamic_axes, name=self.name, cache_dir=self._cache_dir,
            )
            self._eval_runner = GraphRunner(self.runtime, result.graph, passes=self.passes)
        runner = self._eval_runner
        outputs = self.run_graph(runner, inputs, self.input_names)
        values = [torch.from_numpy(outputs[n]) for n in runner.graph.output_names]
        return values[0] if len(values) == 1 else tuple(values)

    def run_graph(self, runner: GraphRunner, batch: Sequence[Any], names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run another graph on this trainer's state (``runner`` on :attr:`runtime`: the eval
        forward, a forward part) with ``batch`` fed as ``names``; returns what it fetches. Its
        state updates (e.g. BatchNorm statistics) are committed as a step's are."""
        feeds = self._feeds(batch, names)
        return runner.run(feeds, self._prepare(runner, feeds))

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's layout: ``{"model": module state_dict, "optimizer": torch.optim
        state_dict, "step": updates done}`` (torch tensors), loadable by plain torch and by
        :meth:`load_state_dict`. Needs the torch model and optimizer (:func:`create_ort_trainer`);
        :meth:`flat_state` serves every trainer."""
        return torch_checkpoint.torch_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s layout (from this trainer or plain torch); every key,
        dtype, shape and value is checked before anything changes (:class:`CheckpointError`)."""
        torch_checkpoint.load_torch_state_dict(self, state)

    def flat_state(self) -> dict[str, np.ndarray]:
        """Host copies of every persistent tensor by graph name: parameters, buffers, optimizer
        state (``<param>.exp_avg``, ``optimizer.lr``...); what ``.npz`` checkpoints hold."""
        return {n: self.runtime.read(n) for n in self.graph.state_inputs}

    def load_flat_state(self, state: Mapping[str, Any]) -> None:
        """Replace the state from :meth:`flat_state`'s layout; checks every name, dtype, shape and
        value before writing any."""
        arrays = self._checked_state(state)
        for name in self.graph.state_inputs:
            self.runtime.write(name, arrays[name])
        self._micro = 0
        if optimizers.STEP_INPUT in arrays:  # it holds the number of the next step
            self._step_count = _step_number(arrays[optimizers.STEP_INPUT]) - 1

    def _checked_state(self, state: Any) -> dict[str, np.ndarray]:
        """``state`` as arrays that fit this trainer (:func:`check_state`), its step number whole and positive."""
        infos = {n: self.runtime.info(n) for n in self.graph.state_inputs}
        arrays = check_state(state, {n: (i.dtype, i.shape) for n, i in infos.items()})
        step = arrays.get(optimizers.STEP_INPUT)
        if step is not None and (step.size != 1 or float(step.reshape(-1)[0]) < 1 or float(step.reshape(-1)[0]) % 1):
            raise CheckpointError(f"{optimizers.STEP_INPUT} must be a whole number at least 1, got {step.tolist()}")
        lr = arrays.get(optimizers.LR_INPUT)
        if lr is not None and (lr < 0).any():
            raise CheckpointError(f"{optimizers.LR_INPUT} must be at least 0, got {lr.tolist()}")
        return arrays

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint atomically (a temporary file renamed into place): torch's layout
        (:meth:`state_dict`, ``torch.save``) for a ``.pt``/``.pth`` path, else ``.npz`` (:meth:`flat_state`).

        Raises :class:`CheckpointError`, with nothing written, when the state is not finite or
        the file cannot be written; a temporary file a killed save left is swept first."""
        if self._micro:
            raise CheckpointError(f"{self._micro} of {self.accumulation_steps} micro-batches of an update are done: "
                                  "save after the update")
        if torch_checkpoint.is_torch_path(path):
            return torch_checkpoint.save(path, self.state_dict())
        return write_checkpoint(path, Checkpoint(model=self.name, steps=self._step_count, losses=list(self.losses),
                                                 state=self.flat_state()))

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by :meth:`save`; the trainer is unchanged if it is bad.

        The file, its metadata and every tensor are checked before anything is written."""
        if torch_checkpoint.is_torch_checkpoint(path):
            self.load_state_dict(torch_checkpoint.load(path))
            return
        checkpoint = read_checkpoint(path)
        arrays = self._checked_state(checkpoint.state)
        step = arrays.get(optimizers.STEP_INPUT)
        if step is not None and _step_number(step) - 1 != checkpoint.steps:
            raise CheckpointError(f"checkpoint {str(path)!r} says {checkpoint.steps} steps but its "
                                  f"{optimizers.STEP_INPUT} is {_step_number(step)}: the file was edited or mixed up")
        self.load_flat_state(arrays)
        self._step_count = checkpoint.steps
        self.losses = list(checkpoint.losses)
        self._micro = 0

    def copy_to(self, module: torch.nn.Module | None = None) -> torch.nn.Module:
        """Copy trained parameters and buffers into ``module`` (default: the trainer's model)."""
        module = self.model if module is None else module
        if module is None:
            raise OffloadError("copy_to() needs a torch module to copy into")
        own = {**dict(module.named_buffers()), **module.state_dict()}  # non-persistent buffers too
        with torch.no_grad():
            for name in self.graph.state_inputs:
                if name in own:
                    own[name].copy_(torch.from_numpy(self.runtime.read(name)))
        return module

    # ---- report ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The run report (keys: :data:`ort_offload.report.REPORT_KEYS`)."""
        stats = self.runtime.stats
        train_times = self.runner.step_times_s
        budget = self.runtime.budget_bytes
        # The device's own counter where it has one (CUDA), else the arena's accounting (with
        # what the block sessions hold for themselves on a device where they hold any).
        session_bytes = self.runtime.backend.session_bytes
        accounted = stats.peak_device_bytes + self.runner.session_count * session_bytes if train_times else None
        peak = stats.measured_device_bytes if stats.measured_device_bytes is not None else accounted
        overhead = self.runtime.backend.overhead_bytes if self.runtime.backend.used_bytes is not None else None
        recompute = self.runner.recompute.summary()
        basis = self.runtime.budget_basis  # the peak a fraction budget was resolved against
        fraction = self.device.budget is not None and self.device.budget.is_fraction
        report = {
            "model": self.name,
            "device": self.device.kind,
            "budget_bytes": budget,
            "baseline_peak_bytes": basis.peak_bytes if basis is not None else self.runner.baseline_peak_bytes,
            "peak_device_bytes": peak,
            "within_budget": None if peak is None else (budget is None or peak <= budget),
            "steps": self._step_count,
            "losses": list(self.losses),
            "swap_out_bytes": stats.swap_out_bytes,
            "swap_in_bytes": stats.swap_in_bytes,
            "recomputed_nodes": max((p.recomputed_nodes for p in self.runner.prepared_steps()), default=0),
            "split_nodes": max((p.split_nodes for p in self.runner.prepared_steps()), default=0),
            "faults": stats.faults,
            "prefetch_hits": stats.prefetch_hits,
            "step_time_s_median": statistics.median(train_times) if train_times else None,
            "plan_time_s": stats.plan_time_s,
            "passes": sorted({p for prepared in self.runner.prepared_steps() for p in prepared.passes}),
            "stall_time_s": stats.swap_time_s,
            "plans_made": stats.plans_made,
            "plan_cache_hits": stats.plan_cache_hits,
            "recompute_plans": recompute["recompute_plans"],
            "recompute_plan_reuses": recompute["recompute_plan_reuses"],
            "recompute_plan_time_s_median": recompute["plan_time_s_median"],
            "nonfinite_steps": len(self.nonfinite_steps),
            "accounted_peak_bytes": accounted,
            "device_overhead_bytes": overhead,
            "budget_resolved_against": basis.as_report() if fraction and basis is not None else None,
            "split_exact": self._split_exact(),
        }
        assert tuple(report) == REPORT_KEYS
        if overhead is not None:  # extension: what each block session holds (CUDA library handles)
            report["block_sessions"] = self.runner.session_count
            report["device_session_bytes"] = session_bytes
        if self.loop is not None:  # extension: the global gradient norm of each update
            report["grad_norms"] = list(self.grad_norms)
        return report

    def _split_exact(self) -> bool | None:
        """Whether every split plan run so far is exact (Concat merges only); None: none split."""
        plans = [p.split_plan for p in self.runner.prepared_steps() if p.split_plan is not None]
        return all(plan.exact for plan in plans) if plans else None


def _step_number(array: np.ndarray) -> int:
    """The whole number a one-element ``optimizer.step`` tensor holds."""
    return int(round(float(array.reshape(-1)[0])))


@dataclasses.dataclass(frozen=True)
class _Shaped:
    """Stands in for a resident tensor in input checks (dtype and shape only)."""

    info: Any

    @property
    def dtype(self):
        return self.info.dtype

    @property
    def shape(self):
        return self.info.shape
