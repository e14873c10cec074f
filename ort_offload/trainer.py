"""The trainer users hold: ``create_ort_trainer(device, model, ...)`` → :class:`OrtTrainer`.

It exports the model's training step once (cached), places parameters, optimizer state and
buffers in the device's arena, checks the budget before the first step, and runs steps through
the runtime. State never leaves the runtime except through ``state_dict()``, ``save()`` and
``copy_to()``; checkpoints are written atomically and validated before anything is changed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from graph_passes.shapes import check_inputs
from graph_passes.training_graph import TrainingGraph
from ort_offload import optimizers
from ort_offload.device import OffloadDevice
from ort_offload.errors import CheckpointError, InputMismatchError, OffloadError
from ort_offload.export import export_forward, export_training_step, initial_state
from ort_offload.report import REPORT_KEYS
from ort_offload.runtime import GraphRunner, Runtime

logger = logging.getLogger(__name__)

AVAILABLE_PASSES: tuple[str, ...] = ("recompute", "swap", "split")
# What "auto" uses: swap; split (TSPLIT) only where swap alone cannot plan the budget.
AUTO_PASSES: tuple[str, ...] = ("swap", "split")
PASS_CHOICES = ("auto", "none")
CHECKPOINT_FORMAT = "ort_offload.checkpoint.v1"


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


def _to_numpy(value) -> np.ndarray:
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
    ) -> None:
        """Place ``initial_state`` on the device and check the budget for ``example_batch``.

        Use :func:`create_ort_trainer` for a torch model; this constructor also serves graphs
        that come as ONNX files (no ``model``: ``eval()`` and ``copy_to()`` are unavailable).
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
        self.last_outputs: dict[str, np.ndarray] = {}
        self.runtime = Runtime(device)
        self.runner = GraphRunner(
            self.runtime, graph, fetches=graph.step_fetches, passes=self.passes
        )
        self._eval_runner: GraphRunner | None = None
        self._step_count = 0
        feeds = {**initial_state, **example_batch}
        prepared = self.runner.prepare(check_inputs(graph.model, feeds), probe_feeds=feeds)
        self.runtime.place_state(
            initial_state, prepared.program.state_inputs, self.runner.capacity_for(prepared),
            host=prepared.program.host_state,
        )

    # ---- properties -------------------------------------------------------------------------

    @property
    def batch_names(self) -> list[str]:
        return self.input_names + self.target_names

    @property
    def lr(self) -> float:
        return float(self.runtime.read(optimizers.LR_INPUT))

    @lr.setter
    def lr(self, value: float) -> None:
        self.runtime.write(optimizers.LR_INPUT, np.array(value, dtype=np.float32))

    @property
    def steps_done(self) -> int:
        return self._step_count

    # ---- training ---------------------------------------------------------------------------

    def _feeds(self, batch: Sequence[Any], names: Sequence[str]) -> dict[str, np.ndarray]:
        if len(batch) != len(names):
            raise InputMismatchError(f"step takes {len(names)} tensors ({', '.join(names)}), got {len(batch)}")
        return {n: _to_numpy(t) for n, t in zip(names, batch)}

    def _prepare(self, runner: GraphRunner, feeds: Mapping[str, np.ndarray]):
        """Check the batch against the graph (state as resident) and get the step's program."""
        runtime = self.runtime
        resident = {n: _Shaped(runtime.info(n)) for n in runner.graph.state_inputs}
        infos = check_inputs(runner.graph.model, {**resident, **feeds}, declared=runner.declared_inputs)
        # Real values for any shape probe: data-dependent shapes must see the actual batch.
        return runner.prepare(infos, probe_feeds=lambda: {**{n: runtime.view(n) for n in runner.graph.state_inputs}, **feeds})

    def step(self, *batch) -> float:
        """One training step on ``batch`` (model inputs, then targets); returns the loss."""
        feeds = self._feeds(batch, self.batch_names)
        prepared = self._prepare(self.runner, feeds)
        outputs = self.runner.run(feeds, prepared)
        self.last_outputs = outputs  # what the step fetched: the loss, and gradients a graph outputs
        self._step_count += 1
        if optimizers.STEP_INPUT in self.graph.state_inputs:  # the number of the next step (Adam's t)
            self.runtime.write(optimizers.STEP_INPUT, np.array(self._step_count + 1, dtype=np.float32))
        if self.graph.loss_name is None:
            return float("nan")
        loss = float(outputs[self.graph.loss_name])
        self.losses.append(loss)
        return loss

    def eval(self, *inputs) -> np.ndarray | tuple[np.ndarray, ...]:
        """The model's outputs (eval mode: BatchNorm running stats, no dropout) with the current weights."""
        if self.model is None:
            raise OffloadError("eval() needs the torch model; this trainer was built from an ONNX graph")
        if self._eval_runner is None:
            result = export_forward(
                self.model, example_inputs=[torch.from_numpy(a) for a in self._example_inputs], input_names=self.input_names,
                dynamic_axes=self.dynamic_axes, name=self.name, cache_dir=self._cache_dir,
            )
            self._eval_runner = GraphRunner(self.runtime, result.graph, passes=self.passes)
        feeds = self._feeds(inputs, self.input_names)
        runner = self._eval_runner
        prepared = self._prepare(runner, feeds)
        outputs = runner.run(feeds, prepared)
        values = [outputs[n] for n in runner.graph.output_names]
        return values[0] if len(values) == 1 else tuple(values)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of every persistent tensor: parameters, buffers, optimizer state."""
        return {n: self.runtime.read(n) for n in self.graph.state_inputs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the trainer's state; checks every name, dtype and shape before writing any."""
        arrays = {n: _to_numpy(v) for n, v in state.items()}
        expected = set(self.graph.state_inputs)
        missing = sorted(expected - set(arrays))
        unexpected = sorted(set(arrays) - expected)
        if missing or unexpected:
            raise CheckpointError(
                "state does not match this trainer: "
                + (f"missing {', '.join(missing[:3])}" if missing else "")
                + ("; " if missing and unexpected else "")
                + (f"unexpected {', '.join(unexpected[:3])}" if unexpected else "")
            )
        for name in self.graph.state_inputs:
            info = self.runtime.info(name)
            array = arrays[name]
            if array.dtype != info.dtype or tuple(array.shape) != info.shape:
                raise CheckpointError(
                    f"{name}: checkpoint has {array.dtype}{list(array.shape)}, trainer has {info}"
                )
        for name in self.graph.state_inputs:
            self.runtime.write(name, arrays[name])
        if optimizers.STEP_INPUT in arrays:  # it holds the number of the next step
            self._step_count = int(round(float(arrays[optimizers.STEP_INPUT]))) - 1

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint atomically (a temporary file renamed into place)."""
        path = Path(path)
        state = self.state_dict()
        meta = {"format": CHECKPOINT_FORMAT, "model": self.name, "steps": self._step_count, "losses": self.losses}
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, __meta__=np.array(json.dumps(meta)), **{f"state/{k}": v for k, v in state.items()})
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by :meth:`save`; the trainer is unchanged if it is bad."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["__meta__"]))
                state = {k[len("state/") :]: data[k] for k in data.files if k.startswith("state/")}
        except FileNotFoundError as e:
            raise CheckpointError(f"no checkpoint at {path}") from e
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is not an ort_offload checkpoint ({type(e).__name__})") from e
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} has checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        self.load_state_dict(state)
        self._step_count = int(meta.get("steps", self._step_count))
        self.losses = list(meta.get("losses", []))

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
        peak = stats.peak_device_bytes if train_times else None
        recompute = self.runner.recompute.summary()
        report = {
            "model": self.name,
            "device": self.device.kind,
            "budget_bytes": budget,
            "baseline_peak_bytes": self.runner.baseline_peak_bytes,
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
        }
        assert tuple(report) == REPORT_KEYS
        return report


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


def create_ort_trainer(
    device: OffloadDevice,
    model: torch.nn.Module,
    *,
    example_inputs: Sequence[torch.Tensor] | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    loss_fn: Callable | None = None,
    optimizer: str | optimizers.OptimizerConfig = "adamw",
    lr: float | None = None,
    input_names: Sequence[str] | None = None,
    target_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    passes: str | Sequence[str] = "auto",
    name: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    **optimizer_options,
) -> OrtTrainer:
    """A trainer for ``model`` on ``device``.

    ``example_inputs`` are the model's inputs and ``example_targets`` the extra arguments of
    ``loss_fn(outputs, *targets)``; without ``loss_fn`` the model's forward must return the
    loss. ``optimizer`` is "adamw", "sgd" or a config from :mod:`ort_offload.optimizers`;
    ``lr`` and other keyword options (``weight_decay``, ``betas``, ``momentum``) configure it.
    Raises :class:`BudgetTooSmallError` before any step if the budget cannot hold the step.

    A dynamic model (one with ``blocks()`` and ``path()``, DESIGN.md "Dynamic networks") gets a
    :class:`~ort_offload.dynamic_trainer.BlockwiseTrainer` instead: its Python control flow runs
    as written and its blocks run block-wise under the budget; ``example_inputs`` then only
    gives the number of inputs (default 1), and ``loss_fn`` defaults to the model's output.
    """
    if not isinstance(device, OffloadDevice):
        raise TypeError("device must come from ort_offload.set_offload_device(...)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from ort_offload.dynamic_trainer import BlockwiseTrainer, is_dynamic_model

    if is_dynamic_model(model):
        if not isinstance(optimizer, str) or optimizer_options:
            raise InputMismatchError("dynamic models train with optimizer 'adamw' or 'sgd' and lr only")
        return BlockwiseTrainer(
            model, loss_fn if loss_fn is not None else (lambda output, *targets: output), device=device,
            optimizer=optimizer, lr=lr if lr is not None else 1e-3,
            num_inputs=len(example_inputs) if example_inputs is not None else 1, name=name, cache_dir=cache_dir,
        )
    if example_inputs is None:
        raise InputMismatchError("create_ort_trainer needs example_inputs for a static model (the export traces them)")
    pass_list = resolve_passes(passes)
    config = optimizers.make_optimizer(optimizer, lr=lr, **optimizer_options)
    example_inputs = tuple(example_inputs)
    example_targets = tuple(example_targets)
    input_names = list(input_names or [f"input{i}" for i in range(len(example_inputs))])
    target_names = list(target_names or [f"target{i}" for i in range(len(example_targets))])
    name = name or type(model).__name__.lower()
    result = export_training_step(
        model, example_inputs=example_inputs, example_targets=example_targets, loss_fn=loss_fn,
        optimizer=config, input_names=input_names, target_names=target_names,
        dynamic_axes=dynamic_axes, name=name, cache_dir=cache_dir,
    )
    logger.info("training graph %s: %d nodes (cache %s)", name, len(result.graph.graph.node), "hit" if result.cache_hit else "miss")
    batch = {n: _to_numpy(t) for n, t in zip(input_names + target_names, example_inputs + example_targets)}
    return OrtTrainer(
        device,
        result.graph,
        initial_state=initial_state(result.graph, model, lr=config.lr, step=1),
        example_batch=batch,
        input_names=input_names,
        target_names=target_names,
        passes=pass_list,
        model=model,
        optimizer_config=config,
        dynamic_axes=dynamic_axes,
        cache_dir=cache_dir,
    )
