"""Training under a device-memory budget with the swap pass: cost on this CPU and on simulated GPUs.

Run ``python -m benchmarks.swap [--quick] [--out DIR]``. Per model (full mode: GPT ``small`` and
CNN ``small``; ``--quick``: their ``tiny`` configs), in one process:

1. **Reference**: a trainer without a budget (``set_offload_device("cpu", budget=None)``, the
   unplanned program: the whole step in one block). Its first ``warmup + measured`` steps on a
   fixed list of batches give the reference losses and, after them, the reference state
   (parameters and optimizer state). Creating it exports the model once into a temporary cache
   directory that every later trainer of the model reuses (the export is timed).
2. **The minimum budget**: a trainer asked for a budget of 1 byte raises
   :class:`~ort_offload.errors.BudgetTooSmallError`, whose ``needed_bytes`` is the smallest
   budget any plan fits; that is the last row's budget.
3. **One row per budget**, 1.0x, 0.5x and 0.25x of ``baseline_peak_bytes`` and the minimum: a
   fresh trainer (planning is timed: ``plan_time_s`` from its report) runs the same batches as
   the reference. Its steps alternate with steps of the reference trainer, one step per turn
   with an idle pause after each (ONNX Runtime's threads go on spinning after a run), so load
   from other processes hits both alike; ``ratio`` = the row's median step time / the
   reference's median over the steps interleaved with it (1.0 = as fast, 2.0 = twice as slow).
   Per measured step: swap-out and swap-in bytes, stall time (waiting for copies, synchronous
   swap-outs, faults), faults. ``peak_device_bytes`` is the runtime's measured peak (must be
   ≤ the budget). Losses of every step and the state after the last one are compared bitwise
   with the reference's (the swap contract: identical numbers).
4. **Simulated GPUs**: the graph planned for the V100-16GB-PCIe3 and the H100 profile under the
   row's budget (the runtime's planning with ``planning_profile``, as ``ort-offload transform
   --device-profile`` does: block size and state placement chosen by simulated time on that
   profile), replayed by :func:`graph_passes.cost.simulator.simulate_time` (analytical roofline cost
   model; the row's budget as the arena cap), against :func:`graph_passes.cost.simulator.unlimited_time` of the unplanned program
   (the same graph with unlimited memory: compute only, no copies). ``pct_of_unlimited`` =
   100 × unlimited / simulated step time (100 = swapping costs nothing). Target: V100 at 0.5x
   ≥ 90%. Each profile is planned twice in the same run: by the grid alone (``plan_time`` 0)
   and with the genetic search after it (:mod:`graph_passes.planning.swap.ga`, within ``--plan-time``
   seconds of planning in all), each with its planning time (``plan_s``: the runner's
   ``prepare``, which ``stats.plan_time_s`` counts); ``pct_of_bound`` = 100 × the lower bound of
   :mod:`graph_passes.cost.step_bound` / simulated step time (100 = at the physical limit).
   A third plan per profile (``ga_recompute``) may also recompute (passes recompute and swap:
   the planner's recompute-or-swap candidates, the fastest refined by the GA, whose per-tensor
   genes then choose among keep, swap and recompute: ``plan_search.recomputed_tensors``); its
   bound is the compute alone, since recomputing trades link bytes for compute.

Nothing is capped or skipped: every row is planned and run in full; how long planning took is
reported per row (``plan_time_s``). A table is printed (rich) and the JSON goes to
``benchmarks/results/<YYYY-MM-DD>/swap.json`` or ``--out DIR/swap.json`` (written atomically).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks import common as bench

RESULT_FILE = "swap.json"
TABLE_WIDTH = 400  # 32 columns (three profiles x grid, GA, GA with recompute): headers unwrapped
PROFILES = ("V100-16GB-PCIe3", "H100")
FRACTIONS = ("1.0x", "0.5x", "0.25x")
MINIMUM = "min"
RECOMPUTE_AND_SWAP = ("recompute", "swap")  # the third simulated plan per profile
PROBE_BUDGET = 1  # bytes: no plan fits, so BudgetTooSmallError states the minimum
# Acceptance target: the simulated V100 step at 0.5x of the unplanned peak runs at >= 90% of
# the speed of the same graph with unlimited memory.
TARGET_PROFILE = "V100-16GB-PCIe3"
TARGET_BUDGET = "0.5x"
TARGET_PCT = 90.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures."""

    mode: str
    models: tuple[tuple[str, str], ...]  # (model, config)
    warmup_steps: int
    measured_steps: int
    settle_s: float  # idle pause after every step of the interleaved rows
    budgets: tuple[str, ...] = (*FRACTIONS, MINIMUM)
    plan_time: float = 30.0  # seconds per plan, the grid included; the GA gets the rest (graph_passes.planning.swap.ga)
    plan_evaluations: int | None = None  # a cap on the GA's evaluations (rows then depend on the seed alone)


QUICK = Settings(mode="quick", models=(("gpt", "tiny"), ("cnn", "tiny")), warmup_steps=1, measured_steps=2, settle_s=0.02,
                 plan_time=8.0)  # the grid takes most of it on the tiny models
FULL = Settings(mode="full", models=(("gpt", "small"), ("cnn", "small")), warmup_steps=1, measured_steps=5, settle_s=0.1)


# ---- helpers ------------------------------------------------------------------------------------


def _timed_step(trainer, batch: tuple) -> tuple[float, float]:
    """(seconds, loss) of one ``trainer.step``."""
    start = time.perf_counter()
    loss = trainer.step(*batch)
    return time.perf_counter() - start, loss


def _stats_snapshot(trainer) -> dict[str, float]:
    s = trainer.runtime.stats
    return {"swap_out_bytes": s.swap_out_bytes, "swap_in_bytes": s.swap_in_bytes, "stall_s": s.swap_time_s,
            "faults": s.faults, "prefetch_hits": s.prefetch_hits, "swap_ins": s.swap_ins}


def plan_for_profile(trainer, batch, *, profile: str, budget_bytes: int, plan_time: float | None = 0.0,
                     runner_out: list | None = None, passes=None, plan_evaluations: int | None = None):
    """The trainer's graph planned for ``profile`` under ``budget_bytes`` (what
    ``ort-offload transform --device-profile`` writes): the runtime's planning, timed on that
    profile instead of this CPU."""
    import ort_offload
    from graph_passes.ir.shapes import check_inputs
    from ort_offload.runtime.runner import GraphRunner, Runtime

    device = ort_offload.set_offload_device("cpu", budget=budget_bytes, planning_profile=profile, plan_time=plan_time,
                                            plan_evaluations=plan_evaluations)
    runner = GraphRunner(Runtime(device), trainer.graph, fetches=trainer.runner.fetches,
                         passes=trainer.runner.passes if passes is None else passes)
    feeds = {**{n: np.array(trainer.runtime.view(n)) for n in trainer.graph.state_inputs},
             **dict(zip(trainer.batch_names, (np.asarray(t) for t in batch)))}
    if runner_out is not None:
        runner_out.append(runner)
    return runner.prepare(check_inputs(trainer.graph.model, feeds), probe_feeds=feeds)


def _schedule_of(program) -> list[int]:
    return [i for block in program.blocks for i in block.node_indices]


def _default_schedule(model) -> list[int]:
    from graph_passes.ir.program import order_dependent_last

    return order_dependent_last(model) or list(range(len(model.graph.node)))


def _simulated_row(trainer, batch, unplanned, *, name: str, budget_bytes: int, plan_time: float, bound: float,
                   passes=None, plan_evaluations: int | None = None) -> dict:
    """One profile, one search: the plan, replayed, against unlimited memory and the bound
    (seconds)."""
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.simulator import simulate_time, unlimited_time

    profile = get_profile(name)
    model = trainer.runner.model
    runners: list = []
    prepared = plan_for_profile(trainer, batch, profile=name, budget_bytes=budget_bytes, plan_time=plan_time,
                                runner_out=runners, passes=passes, plan_evaluations=plan_evaluations)
    plan_s = runners[0].runtime.stats.plan_time_s  # the planning (not the runner and feeds set up for it)
    unlimited = unlimited_time(unplanned.program, unplanned.infos, model=model, profile=profile)
    planned = prepared.model if prepared.model is not None else model  # rewritten by split or recompute
    (trace, sim_s) = bench.timed(lambda: simulate_time(prepared.program, prepared.infos, model=planned,
                                                   profile=profile, budget=budget_bytes))
    search = runners[0].last_plan_search
    return {
        "step_time_s": trace.step_time_s,
        "unlimited_s": unlimited,
        "pct_of_unlimited": 100.0 * unlimited / trace.step_time_s if trace.step_time_s > 0 else math.nan,
        "lower_bound_s": bound,
        "pct_of_bound": 100.0 * bound / trace.step_time_s if trace.step_time_s > 0 else math.nan,
        "passes": list(prepared.passes),
        "compute_time_s": trace.compute_time_s,
        "stall_time_s": trace.stall_time_s,
        "h2d_busy_s": trace.h2d_busy_s,
        "d2h_busy_s": trace.d2h_busy_s,
        "peak_bytes": trace.peak_bytes,
        "within_budget": trace.peak_bytes <= budget_bytes and prepared.trace.min_budget_bytes <= budget_bytes,
        "blocks": len(prepared.program.blocks),
        "host_state_tensors": len(prepared.program.host_state),
        # Whether the plan's schedule differs from the exported order (state updates early
        # or a GA schedule). None: a recompute rewrite, whose own order this does not know.
        "schedule_changed": (_schedule_of(prepared.program) != _default_schedule(model)
                             if prepared.model is None or prepared.model is model else None),
        "plan_search": search.to_json() if search is not None else None,
        "plan_s": plan_s,
        "simulate_wall_s": sim_s,
    }


def _recompute_row(row: dict, *, plan_time: float, bound: float, plan_evaluations: int | None = None) -> dict:
    """The GA row with recompute allowed beside the trainer's own passes (split stays where
    the minimum budget needs it); a budget they cannot plan is reported, not raised."""
    from ort_offload.errors import BudgetTooSmallError

    passes = tuple(dict.fromkeys((*row["trainer"].runner.passes, *RECOMPUTE_AND_SWAP)))
    try:
        return _simulated_row(**row, plan_time=plan_time, bound=bound, passes=passes, plan_evaluations=plan_evaluations)
    except BudgetTooSmallError as e:
        return {"status": "budget_too_small", "error": str(e), "passes": list(passes)}


def simulate(trainer, batch, unplanned, *, budget_bytes: int, plan_time: float,
             plan_evaluations: int | None = None) -> dict[str, dict[str, Any]]:
    """Per profile of :data:`PROFILES`: the graph planned for that profile and this budget by
    the grid and by the GA after it, replayed on it, vs the unplanned program's compute and
    the step-time lower bound."""
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.step_bound import step_time_bound

    runner = trainer.runner
    finest = runner.planner.layouts.lower_program(runner.model, unplanned.infos, runner.schedule, max_block_nodes=1)
    out = {}
    for name in PROFILES:
        bound, bound_s = bench.timed(lambda: step_time_bound(finest, unplanned.infos, model=runner.model,
                                                             profile=get_profile(name), budget=budget_bytes))
        row = dict(trainer=trainer, batch=batch, unplanned=unplanned, name=name, budget_bytes=budget_bytes)
        grid = _simulated_row(**row, plan_time=0.0, bound=bound.seconds)
        ga = _simulated_row(**row, plan_time=plan_time, bound=bound.seconds, plan_evaluations=plan_evaluations)
        # Recompute allowed too: the bound of swap plans does not hold, compute alone does.
        ga_rc = _recompute_row(row, plan_time=plan_time, bound=bound.compute_s, plan_evaluations=plan_evaluations)
        out[name] = {**grid, "ga": ga, "ga_recompute": ga_rc,
                     "bound": {**dataclasses.asdict(bound), "arithmetic": bound.describe(), "wall_s": bound_s}}
    return out


# ---- measurement --------------------------------------------------------------------------------


def measure_model(name: str, config: str, settings: Settings, *, log: Callable[[str], None]) -> dict[str, Any]:
    from models import get_model
    from ort_offload.export import optimizers
    from ort_offload.export.training_step import export_training_step

    started = time.perf_counter()
    spec = get_model(name, config)
    steps = settings.warmup_steps + settings.measured_steps
    batches = [spec.make_batch(seed=i) for i in range(steps)]
    batches = [tuple(inputs) + tuple(targets) for inputs, targets in batches]
    inputs, targets = spec.make_batch(seed=0)
    optimizer = optimizers.make_optimizer("adamw")
    label = f"{name}-{config}"
    common = dict(
        loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets, input_names=list(spec.input_names),
        target_names=list(spec.target_names), dynamic_axes=spec.dynamic_axes, optimizer=optimizer, name=label,
    )

    with tempfile.TemporaryDirectory(prefix="ort_offload_swap_bench_") as cache_dir:
        log(f"{label}: exporting (fresh cache: a real export)")
        export, export_s = bench.timed(lambda: export_training_step(
            spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn, optimizer=optimizer,
            input_names=list(spec.input_names), target_names=list(spec.target_names),
            dynamic_axes=spec.dynamic_axes, name=label, cache_dir=cache_dir))
        trainers = _CachedTrainers(spec, cache_dir, common)
        # 1. the reference: no budget, the unplanned program
        reference = _Reference(trainers, batches)
        log(f"{label}: {len(export.graph.graph.node)} nodes, unplanned peak {reference.baseline_peak} bytes; "
            f"reference: {steps} steps")
        reference.train()
        # 2. the minimum budget
        minimum = _probe_minimum(trainers, label, log)
        gc.collect()
        # 3. one row per budget
        rows = [_budget_row(trainers, reference, batches, name, config, budget_label, minimum.bytes, settings, log)
                for budget_label in settings.budgets]
        result = _model_result(name, config, spec, batches, export, export_s, reference, minimum, rows, settings)
        result["total_time_s"] = time.perf_counter() - started
        del reference
        gc.collect()
    return result


class _CachedTrainers:
    """Trainers of one model at any budget, all from the export cache the benchmark filled."""

    def __init__(self, spec, cache_dir: str, common: dict[str, Any]) -> None:
        self.spec, self.cache_dir, self.common = spec, cache_dir, common
        self.cached_files = sorted(os.listdir(cache_dir))

    def __call__(self, budget):
        import ort_offload

        device = ort_offload.set_offload_device("cpu", budget=budget)
        trainer = ort_offload.create_ort_trainer(device, self.spec.model, cache_dir=self.cache_dir, **self.common)
        if sorted(os.listdir(self.cache_dir)) != self.cached_files:
            raise RuntimeError("create_ort_trainer exported again instead of hitting the export cache")
        return trainer


class _Reference:
    """The unplanned trainer: its run over the batches (the losses and state every row is
    compared with), then turns next to the rows' measured steps (timing only)."""

    def __init__(self, trainers: _CachedTrainers, batches: list[tuple]) -> None:
        self.trainer, self.setup_s = bench.timed(lambda: trainers(None))
        self.unplanned = self.trainer.runner.last_prepared
        self.baseline_peak = self.trainer.runner.baseline_peak_bytes
        self.batches = batches
        self.times: list[float] = []
        self.losses: list[float] = []
        self.cursor = 0  # the reference keeps training on the same batches, cycled (timing only)
        self.state: dict[str, Any] = {}  # after train()
        self.report: dict[str, Any] = {}

    def train(self) -> None:
        for batch in self.batches:
            seconds, loss = _timed_step(self.trainer, batch)
            self.times.append(seconds)
            self.losses.append(loss)
        self.state = self.trainer.flat_state()
        self.report = self.trainer.report()

    def turn(self) -> float:
        """Seconds of one more step, on the next batch."""
        seconds, _ = _timed_step(self.trainer, self.batches[self.cursor % len(self.batches)])
        self.cursor += 1
        return seconds


@dataclasses.dataclass(frozen=True)
class _Minimum:
    bytes: int  # the least budget any plan fits
    probe_s: float


def _probe_minimum(trainers: _CachedTrainers, label: str, log: Callable[[str], None]) -> _Minimum:
    """The minimum budget, from the error a one-byte budget raises."""
    from ort_offload.errors import BudgetTooSmallError

    log(f"{label}: probing the minimum budget (budget {PROBE_BUDGET} byte)")
    probe_start = time.perf_counter()
    try:
        trainers(PROBE_BUDGET)
    except BudgetTooSmallError as e:
        minimum = int(e.needed_bytes)
    else:
        raise RuntimeError(f"a budget of {PROBE_BUDGET} byte planned; expected BudgetTooSmallError")
    return _Minimum(minimum, time.perf_counter() - probe_start)


def _budget_row(trainers: _CachedTrainers, reference: _Reference, batches: list[tuple], name: str, config: str,
                budget_label, minimum: int, settings: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """One budget's row: plan, then the steps interleaved with the reference's turns."""
    from ort_offload.errors import BudgetTooSmallError

    label = f"{name}-{config}"
    budget = minimum if budget_label == MINIMUM else budget_label
    log(f"{label} @ {budget_label}: planning")
    row: dict[str, Any] = {"model": name, "config": config, "budget": budget_label}
    try:
        trainer, setup_s = bench.timed(lambda: trainers(budget))
    except BudgetTooSmallError as e:  # reported, not hidden: the row shows why
        row.update(status="budget_too_small", error=str(e), needed_bytes=e.needed_bytes)
        return row
    prepared = trainer.runner.last_prepared
    report0 = trainer.report()
    log(f"{label} @ {budget_label}: {len(prepared.program.blocks)} blocks, planned in "
        f"{report0['plan_time_s']:.2f} s; {len(batches)} steps interleaved with the reference")
    steps = _interleaved_steps(trainer, reference, batches, settings)
    row.update(_row_fields(trainer, prepared, reference, steps, batches, report0, setup_s, settings))
    del trainer, prepared
    gc.collect()
    return row


@dataclasses.dataclass(frozen=True)
class _InterleavedSteps:
    times: list[float]  # every step's seconds, warm-up included
    losses: list[float]
    ref_turn_times: list[float]  # the reference's turn next to each measured step
    before: dict[str, float]  # runtime stats when the measured steps start
    after: dict[str, float]


def _interleaved_steps(trainer, reference: _Reference, batches: list[tuple], settings: Settings) -> _InterleavedSteps:
    times, losses, ref_turn_times = [], [], []
    before = None
    for i, batch in enumerate(batches):
        if i == settings.warmup_steps:
            before = _stats_snapshot(trainer)
        seconds, loss = _timed_step(trainer, batch)
        times.append(seconds)
        losses.append(loss)
        time.sleep(settings.settle_s)
        if i >= settings.warmup_steps:  # the reference's turn next to each measured step
            ref_turn_times.append(reference.turn())
            time.sleep(settings.settle_s)
    return _InterleavedSteps(times, losses, ref_turn_times, before, _stats_snapshot(trainer))


def _row_fields(trainer, prepared, reference: _Reference, steps: _InterleavedSteps, batches: list[tuple],
                report0: dict[str, Any], setup_s: float, settings: Settings) -> dict[str, Any]:
    """An ``ok`` row: the plan, the measured steps against the reference's, the runtime's
    swap counters, equality with the reference, and the simulated GPU rows."""
    plan = prepared.swap_plan
    budget_bytes = int(trainer.runtime.budget_bytes)
    report = trainer.report()
    state_bad = bench.state_mismatches(trainer.flat_state(), reference.state)
    measured = steps.times[settings.warmup_steps:]
    n = settings.measured_steps
    before, after = steps.before, steps.after
    median, ref_median = bench.median(measured), bench.median(steps.ref_turn_times)
    sim = simulate(trainer, batches[0], reference.unplanned, budget_bytes=budget_bytes, plan_time=settings.plan_time,
                   plan_evaluations=settings.plan_evaluations)
    peak = report["peak_device_bytes"]
    baseline_peak = reference.baseline_peak
    return dict(
        status="ok",
        budget_bytes=budget_bytes,
        budget_over_baseline_peak=budget_bytes / baseline_peak,
        baseline_peak_bytes=baseline_peak,
        peak_device_bytes=peak,
        within_budget=peak <= budget_bytes,
        simulated_peak_bytes=prepared.trace.peak_device_bytes,  # graph_passes.ir.memory's replay
        blocks=len(prepared.program.blocks),
        base_blocks=len(prepared.base_program.blocks) if prepared.base_program is not None else None,
        passes=report["passes"],
        # False: a split sums partial results (no exact split fitted), so bitwise is not expected.
        split_exact=prepared.split_plan.exact if prepared.split_plan is not None else None,
        swaps_planned=plan.swap_count if plan is not None else 0,
        host_state_tensors=len(plan.host_state) if plan is not None else 0,
        setup_s=setup_s,
        plan_time_s=report0["plan_time_s"],
        first_step_s=steps.times[0],  # includes creating the block sessions
        median_step_s=median,
        step_times_s=measured,
        ref_median_step_s=ref_median,
        ref_step_times_s=steps.ref_turn_times,
        ratio=median / ref_median,  # > 1: slower than the unplanned trainer
        swap_out_bytes_per_step=(after["swap_out_bytes"] - before["swap_out_bytes"]) / n,
        swap_in_bytes_per_step=(after["swap_in_bytes"] - before["swap_in_bytes"]) / n,
        stall_s_per_step=(after["stall_s"] - before["stall_s"]) / n,
        faults=report["faults"],  # over every step, warm-up included
        faults_measured=after["faults"] - before["faults"],
        prefetch_hits_per_step=(after["prefetch_hits"] - before["prefetch_hits"]) / n,
        swap_ins_per_step=(after["swap_ins"] - before["swap_ins"]) / n,
        losses=steps.losses,
        losses_bitwise_equal=bench.bitwise_equal(steps.losses, reference.losses),
        max_loss_abs_diff=float(np.max(np.abs(np.subtract(steps.losses, reference.losses)))),
        state_bitwise_equal=not state_bad,
        state_mismatches=state_bad[:10],
        simulated=sim,
    )


def _model_result(name: str, config: str, spec, batches: list[tuple], export, export_s: float,
                  reference: _Reference, minimum: _Minimum, rows: list[dict], settings: Settings) -> dict[str, Any]:
    """The model's result document, without its total time."""
    cfg = spec.config
    control = next((r for r in rows if r["budget"] == "1.0x" and r["status"] == "ok"), None)
    return {
        "name": name,
        "config": config,
        "config_fields": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg),
        "batch": int(batches[0][0].shape[0]),
        "seq": spec.default_seq,
        "parameters": int(sum(p.numel() for p in spec.model.parameters())),
        "graph_nodes": len(export.graph.graph.node),
        "export_s": export_s,
        "baseline_peak_bytes": reference.baseline_peak,
        "min_budget_bytes": minimum.bytes,
        "min_probe_s": minimum.probe_s,
        "reference": {
            "setup_s": reference.setup_s,
            "blocks": len(reference.unplanned.program.blocks),
            "peak_device_bytes": reference.report["peak_device_bytes"],
            "first_step_s": reference.times[0],
            "median_step_s": bench.median(reference.times[settings.warmup_steps:]),
            "step_times_s": reference.times[settings.warmup_steps:],
            "losses": reference.losses,
        },
        "rows": rows,
        # The 1.0x row runs the same unplanned program as the reference: if it is not bitwise
        # equal, the unplanned run itself is not run-to-run deterministic on this machine and
        # the other rows' bitwise flags cannot tell a swap error from that noise.
        "unplanned_deterministic": None if control is None
        else bool(control["losses_bitwise_equal"] and control["state_bitwise_equal"]),
    }


def run(settings: Settings, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure everything; returns the result document (without the command line)."""
    import onnxruntime
    import torch

    onnxruntime.set_default_logger_severity(3)  # errors only
    started = time.perf_counter()
    models = [measure_model(name, config, settings, log=log) for name, config in settings.models]
    rows = [row for m in models for row in m["rows"]]
    targets = []
    for row in rows:
        if row["budget"] == TARGET_BUDGET:
            pct = row["simulated"][TARGET_PROFILE]["pct_of_unlimited"] if row["status"] == "ok" else None
            targets.append({
                "what": f"{row['model']} {row['config']}: simulated {TARGET_PROFILE} step at {TARGET_BUDGET} "
                        f">= {TARGET_PCT:.0f}% of unlimited",
                "model": row["model"], "value_pct": pct, "target_pct": TARGET_PCT,
                "met": pct is not None and pct >= TARGET_PCT,
            })
    ok_rows = [r for r in rows if r["status"] == "ok"]
    return {
        "benchmark": "swap",
        "mode": settings.mode,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "models": [f"{m}-{c}" for m, c in settings.models],
            "budgets": list(settings.budgets),
            "warmup_steps": settings.warmup_steps,
            "measured_steps": settings.measured_steps,
            "settle_s": settings.settle_s,
            "plan_time_s": settings.plan_time,
            "plan_evaluations": settings.plan_evaluations,
            "optimizer": "adamw",
            "device": "cpu",
            "profiles": list(PROFILES),
            "cost_model": "analytical roofline (graph_passes.cost.cost_model.AnalyticalCostModel)",
            "ratio": "row median step / median of the reference (budget None) steps interleaved with the row's",
            "pct_of_unlimited": "100 * unlimited_time(unplanned program) / simulate_time(planned program, budget).step_time_s",
            "torch_threads": torch.get_num_threads(),
            "caps": "none: every (model, budget) row is planned and run in full",
        },
        "models": models,
        "rows": rows,
        "targets": targets,
        "targets_met": all(t["met"] for t in targets),
        "all_within_budget": all(r["within_budget"] for r in ok_rows),
        "all_bitwise_equal": all(r["losses_bitwise_equal"] and r["state_bitwise_equal"] for r in ok_rows),
        "all_rows_ok": len(ok_rows) == len(rows),
        "total_time_s": time.perf_counter() - started,
    }


# ---- output -------------------------------------------------------------------------------------


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"Swap under a device budget: CPU measured, GPUs simulated ({result['mode']} mode; "
                        f"{result['settings']['warmup_steps']} warm-up + {result['settings']['measured_steps']} "
                        "measured steps per row)")
    columns = ("model", "budget", "budget MiB", "peak MiB", "blocks", "plan s", "step ms", "unplanned ms", "ratio",
               "out MiB/step", "in MiB/step", "stall ms/step", "faults",
               *(f"{p} {k}" for p in PROFILES
                 for k in ("grid % unl.", "GA % unl.", "GA % bound", "GA plan s", "GA+rc % unl.", "GA+rc plan s")),
               "bitwise")
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "budget") else "right")
    for model in result["models"]:
        ref = model["reference"]
        table.add_row(f"{model['name']} {model['config']}", "none", "-", _mib(ref["peak_device_bytes"]),
                      str(ref["blocks"]), "-", f"{ref['median_step_s'] * 1e3:.1f}", "-", "1.00", "0", "0", "0", "0",
                      *("-" for _ in PROFILES for _ in range(6)), "ref")
        for row in model["rows"]:
            if row["status"] != "ok":
                table.add_row("", row["budget"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                              *("-" for _ in PROFILES for _ in range(6)), f"[red]{row['status']}[/]")
                continue
            peak = _mib(row["peak_device_bytes"])
            peak = peak if row["within_budget"] else f"[red]{peak}[/]"
            sims = []
            for p in PROFILES:
                pct = row["simulated"][p]["pct_of_unlimited"]
                text = f"{pct:.1f}"
                if p == TARGET_PROFILE and row["budget"] == TARGET_BUDGET:
                    text = f"[green]{text}[/]" if pct >= TARGET_PCT else f"[red]{text}[/]"
                sims.append(text)
                ga = row["simulated"][p]["ga"]
                sims += [f"{ga['pct_of_unlimited']:.1f}", f"{ga['pct_of_bound']:.1f}", f"{ga['plan_s']:.1f}"]
                rc = row["simulated"][p]["ga_recompute"]
                sims += [f"{rc['pct_of_unlimited']:.1f}", f"{rc['plan_s']:.1f}"] if "status" not in rc else ["-", "-"]
            bitwise = row["losses_bitwise_equal"] and row["state_bitwise_equal"]
            table.add_row(
                "", row["budget"] + ("" if row["budget"] != MINIMUM else f" ({row['budget_over_baseline_peak']:.3f}x)"),
                _mib(row["budget_bytes"]), peak, str(row["blocks"]), f"{row['plan_time_s']:.2f}",
                f"{row['median_step_s'] * 1e3:.1f}", f"{row['ref_median_step_s'] * 1e3:.1f}", f"{row['ratio']:.2f}",
                _mib(row["swap_out_bytes_per_step"]), _mib(row["swap_in_bytes_per_step"]),
                f"{row['stall_s_per_step'] * 1e3:.1f}", str(row["faults"]), *sims,
                "[green]yes[/]" if bitwise else "[red]NO[/]",
            )
    console.print(table)
    for model in result["models"]:
        console.print(f"{model['name']} {model['config']}: {model['graph_nodes']} nodes, batch {model['batch']}, "
                      f"unplanned peak {_mib(model['baseline_peak_bytes'])} MiB, minimum budget "
                      f"{_mib(model['min_budget_bytes'])} MiB (probe {model['min_probe_s']:.1f} s), export "
                      f"{model['export_s']:.1f} s")
    for model in result["models"]:
        if model["unplanned_deterministic"] is False:
            console.print(f"[yellow]note[/]: {model['name']} {model['config']}: the 1.0x row (the same unplanned "
                          "program as the reference) is not bitwise equal to it: the unplanned run is not "
                          "run-to-run deterministic here, so this model's bitwise flags are inconclusive")
    for target in result["targets"]:
        value = "n/a" if target["value_pct"] is None else f"{target['value_pct']:.1f}%"
        verdict = "[green]PASS[/]" if target["met"] else "[red]FAIL[/]"
        console.print(f"{verdict} {target['what']}: {value}")
    console.print(f"peak <= budget in every row: {result['all_within_budget']}; losses and state bitwise equal "
                  f"to the unplanned run in every row: {result['all_bitwise_equal']}; "
                  f"total {result['total_time_s']:.0f} s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swap", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt/cnn tiny, 1 warm-up + 2 measured steps (for tests)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for swap.json (default: benchmarks/results/<YYYY-MM-DD>)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per row")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per row")
    parser.add_argument("--models", default=None, help="comma-separated model:config pairs (default: gpt and cnn)")
    parser.add_argument("--budgets", default=None, help="comma-separated budgets among 1.0x, 0.5x, 0.25x, min")
    parser.add_argument("--plan-time", type=float, default=None, help="seconds of planning per GA plan, the grid included (the GA gets what it leaves)")
    parser.add_argument("--plan-evaluations", type=int, default=None,
                        help="cap on each GA plan's evaluations (with a generous --plan-time: rows independent of load)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    bench.step_counts(args, changes)
    if args.models is not None:
        pairs = []
        for item in args.models.split(","):
            model, _, config = item.strip().partition(":")
            if not model or not config:
                raise SystemExit(f"--models: {item!r} is not model:config")
            pairs.append((model, config))
        changes["models"] = tuple(pairs)
    if args.budgets is not None:
        budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
        unknown = [b for b in budgets if b not in (*FRACTIONS, MINIMUM)]
        if unknown or not budgets:
            raise SystemExit(f"--budgets: choose from {', '.join((*FRACTIONS, MINIMUM))}")
        changes["budgets"] = budgets
    if args.plan_time is not None:
        if args.plan_time < 0:
            raise SystemExit("--plan-time must be >= 0")
        changes["plan_time"] = args.plan_time
    if args.plan_evaluations is not None:
        if args.plan_evaluations < 1:
            raise SystemExit("--plan-evaluations must be >= 1")
        changes["plan_evaluations"] = args.plan_evaluations
    return dataclasses.replace(settings, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    return bench.run_main(
        module="benchmarks.swap", result_file=RESULT_FILE, argv=argv, out=args.out, table_width=TABLE_WIDTH,
        measure=lambda log: run(settings, log=log), print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
