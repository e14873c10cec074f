"""Training of dynamic networks block-wise, under a device budget: :class:`BlockwiseTrainer`.

The model's Python forward runs as written; its blocks (``model.blocks()``, or the children of
its ``nn.ModuleList``s) run their exported forward and backward parts in ONNX Runtime
(:mod:`ort_offload.dynamic.blockwise`). Where they run depends on the device:

- no device: on host arrays, nothing managed (:class:`~ort_offload.dynamic.blockwise.HostExecutor`):
  the unlimited-memory reference;
- an offload device: in :class:`~ort_offload.dynamic.runtime.BlockRuntime`, whose arena is capped
  at the device's budget, with execution-block prefetch guided by a path predictor (the pilot by
  default when one is given, else the true path, else none).

The stem and head (modules outside the blocks), the loss and the optimizer run in torch on the
host; the optimizer updates the host copies of the parameters, so every step starts from
parameters exactly as plain torch training would have them. A budget written as a fraction
(``"0.5x"``) is taken of the *baseline peak*: the same runtime with the whole model resident
(parameters, gradients, optimizer state, every saved activation) on the first batch.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ort_offload.dynamic.blockwise import BlockStepCache, HostExecutor, default_blocks, unwrap_blocks, wrap_blocks
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.dynamic.runtime import BlockRuntime
from ort_offload.budget_basis import FIRST_BATCH
from ort_offload.checkpoint import check_state
from ort_offload.errors import CheckpointError, InputMismatchError, NonFiniteError
from ort_offload.report import REPORT_KEYS
from ort_offload.validation import check_learning_rate
from pilot.prediction import NoPredictor, PathPredictor

logger = logging.getLogger(__name__)

__all__ = ["BlockwiseTrainer", "DYNAMIC_REPORT_KEYS", "is_dynamic_model"]

DYNAMIC_REPORT_KEYS = (
    "invocations",  # block invocations run (forward), over all steps
    "exact_path_accuracy",  # share of batches whose predicted path was exactly the true one
    "block_accuracy",  # share of invocations the prediction got right, position by position
    "mispredictions",  # batches whose true path differed from the prediction
    "misprediction_cache_hits",  # batches whose prediction came from the misprediction cache
    "pilot_inference_us_median",  # predictor's raw output, per batch
    "pilot_mapping_us_median",  # mapping the raw output back to blocks, per batch
    "prefetch_bytes",  # bytes copied in ahead of use by execution-block prefetch
    "fault_bytes",  # bytes fetched on demand by tensor faults
    "evictions",  # tensors dropped or written back to make room
)

_OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}


def is_dynamic_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` follows the dynamic-model protocol (``blocks()`` and ``path()``)."""
    return callable(getattr(model, "blocks", None)) and callable(getattr(model, "path", None))


class BlockwiseTrainer:
    """Trains a dynamic model block-wise: blocks in ONNX Runtime, the rest in torch.

    ``step(*inputs, *targets) -> loss`` runs the model's Python forward, ``loss_fn(outputs,
    *targets)``, the backward (each block's backward part) and one update of a torch optimizer
    (``"adamw"`` or ``"sgd"``). With ``device`` (from :func:`ort_offload.set_offload_device`) the
    blocks run under its budget in a :class:`BlockRuntime`; ``predictor`` guesses each batch's
    path for prefetching (default: the model's true path when the model can say it, i.e. an
    oracle; pass a :class:`pilot.Pilot` for the learned pilot, :class:`NoPredictor` for
    on-demand fetching only; with ``prefetch=False`` nothing is prefetched at all, the
    unified-memory-like baseline). ``residency="resident"`` keeps the whole model on the device
    (parameters, gradients, optimizer state, every saved activation): the no-offload baseline
    under the same accounting. ``pre_evict``: write saved activations back asynchronously ahead
    of need (DeepUM's pre-eviction; default: where the device's swap-outs are asynchronous, i.e.
    not on the CPU, whose copies take the cores the blocks compute on).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        *,
        device: OffloadDevice | None = None,
        predictor: PathPredictor | None = None,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        num_inputs: int = 1,
        blocks: Sequence[torch.nn.Module] | None = None,
        cache: BlockStepCache | None = None,
        cache_dir: str | os.PathLike | None = None,
        name: str | None = None,
        misprediction_log: str | os.PathLike | None = None,
        misprediction_cache: bool = True,
        prefetch: bool = True,
        pre_evict: bool | None = None,
        measure_baseline: bool = True,
        arena_policy: str = "double_buffer",
        residency: str = "offload",
        stop_on_nonfinite: bool = False,
    ) -> None:
        check_learning_rate(lr, name="lr")
        if optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        elif optimizer == "sgd":
            self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        else:
            raise InputMismatchError(f"unknown optimizer {optimizer!r}: choose from adamw, sgd")
        if num_inputs < 1:
            raise InputMismatchError(f"num_inputs must be >= 1, got {num_inputs}")
        if device is not None and not isinstance(device, OffloadDevice):
            raise TypeError("device must come from ort_offload.set_offload_device(...)")
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.device = device
        self.name = name or type(model).__name__.lower()
        self.optimizer_name = optimizer
        self.blocks = default_blocks(model) if blocks is None else list(blocks)
        if predictor is None:
            predictor = _default_predictor(model)
        self.predictor = predictor
        if pre_evict is None:  # write back asynchronously where copies run beside compute (not on the CPU)
            pre_evict = device is not None and device.swap_outs_are_async
        self._runtime_options = dict(misprediction_log=misprediction_log, misprediction_cache=misprediction_cache,
                                     prefetch=prefetch, pre_evict=pre_evict)
        self.measure_baseline = measure_baseline
        self.arena_policy = arena_policy  # DyNN-Offload's work and migration halves by default
        self.residency = residency  # "resident": the no-offload baseline under the same accounting
        self.cache = cache if cache is not None else BlockStepCache(cache_dir=cache_dir)
        self.runtime: BlockRuntime | None = None
        self.baseline_peak_bytes: int | None = None
        self._first_shapes: dict[str, list[int]] = {}  # batch shapes the baseline was measured at
        self.budget_bytes: int | None = None
        self.losses: list[float] = []
        self.steps_done = 0  # optimizer updates (resumed ones included)
        self.step_times: list[float] = []
        self.stop_on_nonfinite = bool(stop_on_nonfinite)
        self.nonfinite_steps: list[int] = []  # numbers (1-based) of steps with a non-finite loss or gradient
        if device is None:
            wrap_blocks(model, self.blocks, cache=self.cache, executor=HostExecutor())
        # With a device the blocks are wrapped at the first step, once the budget is resolved.

    # ---- setup -----------------------------------------------------------------------------

    def _stem_and_head(self) -> list[torch.Tensor]:
        in_blocks = {id(p) for b in self.blocks for p in b.parameters()}
        return [p for p in self.model.parameters() if id(p) not in in_blocks]

    def _make_runtime(self, budget_bytes: int | None, residency: str, predictor: PathPredictor) -> BlockRuntime:
        return BlockRuntime(
            self.blocks, budget_bytes=budget_bytes, predictor=predictor, resident_params=self._stem_and_head(),
            residency=residency, arena_policy=self.arena_policy,
            optimizer_states=_OPTIMIZER_STATES[self.optimizer_name], alignment=self.device.alignment,
            **(self._runtime_options if residency == "offload" else {}),
        )

    def _measure_baseline(self, inputs, targets) -> int:
        """Peak of one forward and backward with the whole model resident (no optimizer step;
        gradients are cleared afterwards, so training is unaffected)."""
        runtime = self._make_runtime(None, "resident", NoPredictor())
        wrap_blocks(self.model, self.blocks, cache=self.cache, executor=runtime)
        try:
            runtime.begin_step(self.model, inputs)
            loss = self.loss_fn(self.model(*inputs), *targets)
            loss.backward()
            runtime.end_step()
            return runtime.peak
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            unwrap_blocks(self.model)
            runtime.close()

    def _resolved_against(self) -> dict | None:
        """A fraction budget's basis: the no-offload peak of the first batch."""
        budget = None if self.device is None else self.device.budget
        if budget is None or not budget.is_fraction or self.baseline_peak_bytes is None:
            return None
        return {"source": FIRST_BATCH, "shapes": dict(self._first_shapes), "peak_bytes": self.baseline_peak_bytes}

    def _ensure_runtime(self, inputs, targets) -> None:
        if self.device is None or self.runtime is not None:
            return
        budget = self.device.budget
        if self.measure_baseline or (budget is not None and budget.is_fraction):
            self.baseline_peak_bytes = self._measure_baseline(inputs, targets)
            self._first_shapes = {f"input{i}": list(getattr(t, "shape", ())) for i, t in enumerate((*inputs, *targets))}
        self.budget_bytes = None if budget is None else budget.resolve(self.baseline_peak_bytes or 0)
        self.runtime = self._make_runtime(self.budget_bytes, self.residency, self.predictor)
        wrap_blocks(self.model, self.blocks, cache=self.cache, executor=self.runtime)

    # ---- training --------------------------------------------------------------------------

    def step(self, *batch: torch.Tensor) -> float:
        """One training step on ``(*inputs, *targets)``; returns the loss. If the budget cannot
        hold a block invocation, :class:`BudgetTooSmallError` is raised before the optimizer
        runs: parameters and optimizer state are as they were before the step."""
        if len(batch) <= self.num_inputs:
            raise InputMismatchError(
                f"step takes {self.num_inputs} input(s) and at least one target, got {len(batch)} tensors"
            )
        inputs, targets = batch[: self.num_inputs], batch[self.num_inputs :]
        self._ensure_runtime(inputs, targets)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        runtime = self.runtime
        try:
            if runtime is not None:
                runtime.begin_step(self.model, inputs)
            loss = self.loss_fn(self.model(*inputs), *targets)
            loss.backward()
            if runtime is not None:
                runtime.end_step()
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # a failed step leaves no partial gradients
            if runtime is not None:
                runtime.end_step()
            raise
        self._check_finite(float(loss.detach()))
        self.optimizer.step()
        self.steps_done += 1
        self.step_times.append(time.perf_counter() - started)
        value = float(loss.detach())
        self.losses.append(value)
        return value

    def _check_finite(self, loss: float) -> None:
        """Count a step whose loss or gradients are not finite; with ``stop_on_nonfinite``
        raise :class:`NonFiniteError` before the optimizer changes any parameter."""
        where = "the loss" if not math.isfinite(loss) else next(
            (n for n, p in self.model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())),
            None)
        if where is None:
            return
        self.nonfinite_steps.append(len(self.losses) + 1)
        if self.stop_on_nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"step {len(self.losses) + 1} gave non-finite values in {where} (gradient); "
                                 "parameters are as before the step: lower the learning rate or check the batch")
        if len(self.nonfinite_steps) == 1:
            logger.warning("step %d of %s gave non-finite values in %s; later ones are counted in "
                           "report()['nonfinite_steps']", len(self.losses) + 1, self.name, where)

    def flat_state(self) -> dict[str, np.ndarray]:
        """The model's parameters and buffers as numpy arrays (copies)."""
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """``{"model": module state_dict, "optimizer": torch.optim state_dict, "step": updates
        done}``, as :meth:`OrtTrainer.state_dict <ort_offload.trainer.OrtTrainer.state_dict>`."""
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {"model": model, "optimizer": self.optimizer.state_dict(), "step": self.steps_done}

    def load_state_dict(self, state: Any) -> None:
        """Resume from :meth:`state_dict`'s layout (from this trainer or plain torch); everything
        is checked (:class:`CheckpointError`) before anything changes."""
        if not isinstance(state, Mapping) or sorted(map(str, state)) != ["model", "optimizer", "step"]:
            raise CheckpointError("a torch-format state has keys model, optimizer, step")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a whole number at least 0, got {step!r}")
        own = self.model.state_dict()
        check_state(state["model"], {k: (v.detach().numpy().dtype, tuple(v.shape)) for k, v in own.items()})
        _check_optimizer_state(self.optimizer, state["optimizer"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = step

    def report(self) -> dict[str, Any]:
        """The run report: :data:`~ort_offload.report.REPORT_KEYS`, then :data:`DYNAMIC_REPORT_KEYS`."""
        runtime = self.runtime
        stats = runtime.stats if runtime is not None else None
        peak = runtime.peak if runtime is not None else None

        def median(values) -> float | None:
            return float(statistics.median(values)) if values else None

        report: dict[str, Any] = {
            "model": self.name,
            "device": self.device.describe() if self.device is not None else "host (no budget)",
            "budget_bytes": self.budget_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "peak_device_bytes": peak,
            "within_budget": None if peak is None else (self.budget_bytes is None or peak <= self.budget_bytes),
            "steps": self.steps_done,
            "losses": list(self.losses),
            "swap_out_bytes": stats.swap_out_bytes if stats else 0,
            "swap_in_bytes": stats.swap_in_bytes if stats else 0,
            "recomputed_nodes": 0,
            "split_nodes": 0,
            "faults": stats.faults if stats else 0,
            "prefetch_hits": stats.prefetch_hits if stats else 0,
            "step_time_s_median": median(self.step_times),
            "plan_time_s": 0.0,
            "passes": ["blockwise", "prefetch"] if runtime is not None else ["blockwise"],
            "stall_time_s": stats.stall_time_s if stats else 0.0,
            "plans_made": self.cache.compiled,
            "plan_cache_hits": self.cache.memory_hits,
            "recompute_plans": 0,
            "recompute_plan_reuses": 0,
            "recompute_plan_time_s_median": None,
            "nonfinite_steps": len(self.nonfinite_steps),
            "accounted_peak_bytes": peak,
            "device_overhead_bytes": None,
            "budget_resolved_against": self._resolved_against(),
            "split_exact": None,
        }
        assert tuple(report) == REPORT_KEYS
        steps = stats.steps if stats else 0
        report.update({
            "invocations": stats.invocations if stats else None,
            "exact_path_accuracy": stats.exact_paths / steps if steps else None,
            "block_accuracy": stats.predicted_blocks_correct / stats.true_blocks if stats and stats.true_blocks else None,
            "mispredictions": stats.mispredictions if stats else None,
            "misprediction_cache_hits": stats.misprediction_cache_hits if stats else None,
            "pilot_inference_us_median": median(stats.inference_us) if stats else None,
            "pilot_mapping_us_median": median(stats.mapping_us) if stats else None,
            "prefetch_bytes": stats.prefetch_bytes if stats else 0,
            "fault_bytes": stats.fault_bytes if stats else 0,
            "evictions": stats.evictions if stats else 0,
        })
        return report

    def close(self) -> None:
        """Restore the model's original block forwards and stop the runtime's copy engine."""
        unwrap_blocks(self.model)
        if self.runtime is not None:
            self.runtime.close()


def _check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any) -> None:
    """:class:`CheckpointError` unless ``state`` loads into ``optimizer`` (tried on a scratch
    copy over stand-in parameters) with per-parameter tensors of their parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    stand_ins = [torch.zeros_like(p, device="meta", requires_grad=True) for p in params]  # no memory
    try:
        type(optimizer)(stand_ins, **options).load_state_dict(state)
    except Exception as e:  # torch raises ValueError, KeyError or TypeError for a misfit
        raise CheckpointError(f"optimizer state does not fit this optimizer ({type(e).__name__}: {e})") from e
    for index, values in state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(values, Mapping):
            raise CheckpointError(f"optimizer state {index!r} is not the state of one of its {len(params)} parameters")
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape != params[index].shape:
                raise CheckpointError(f"optimizer state {index}.{key} has shape {list(value.shape)}, "
                                      f"its parameter {list(params[index].shape)}")
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CheckpointError(f"optimizer state {index}.{key} has non-finite values")


def _default_predictor(model: torch.nn.Module) -> PathPredictor:
    """The true path when the model can compute it (an oracle), else no prediction."""
    from pilot.prediction import OraclePredictor

    return OraclePredictor() if callable(getattr(model, "path", None)) else NoPredictor()
