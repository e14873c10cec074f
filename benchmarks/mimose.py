"""Input-aware recompute (Mimose) vs a static worst-case plan vs no plan, over variable-length training.

Run ``python -m benchmarks.mimose [--quick] [--out DIR]``. Full mode: BERT ``small`` (4 layers,
d_model 256, batch 16), one epoch of 200 batches whose sequence lengths are drawn uniformly from
16..256 (the first batch is the longest, so the static plan is made for the
worst case, as Sublinear's would be). ``--quick``: BERT ``tiny``, fewer steps.

Three trainers train on the same batches, their steps interleaved (step k of each in turn, an
idle pause after each) so machine noise hits all alike:

- **unplanned**: no budget; each new length gets its own unplanned program;
- **static**: ``recompute_policy="static"``: the recompute plan made for the first (longest)
  batch serves every length (the Sublinear-style baseline Mimose compares against);
- **input-aware**: ``recompute_policy="input_aware"``: per length bucket, a plan for that size
  (``graph_passes.planning.recompute.signatures``; plans from the fitted estimator once it has its sizes),
  starting from the segments' cheap units (selective recomputation);
- with ``--whole-segments``, a fourth, **whole_segments**: input-aware with
  ``selective_recompute=False``, whole segments only, as Mimose's rule plans (what the
  selective units add, measured in the same run).

Both planned trainers get the same budget: ``budget_fraction`` of the unplanned peak at the
longest length. Per trainer: run time per step (median and total; the step without the
preparation of a new length), preparation time (shape inference, planning, lowering and checks
for new lengths; total), the epoch time (both), run time over the steps where neither planned
trainer made a new plan (a new plan's block sessions are created in its first run), measured peak, recomputed nodes run over the
epoch, plan counts and times, and losses and final state compared bitwise with the unplanned run.
Target: input-aware epoch ≥ 10% faster than static (``static / input_aware ≥ 1.10``).

Two more numbers put the CPU ratio in context. The **ceiling** is static over unplanned: no
recompute plan can run faster than the graph with nothing recomputed, so on a machine where that
ratio is below 1.10 the target cannot be met by any plan. **Simulated** epoch time: each step's
program, as each trainer ran it, replayed by the step-time simulator on GPU profiles
(:data:`SIMULATED_PROFILES`; roofline kernel estimates, no swaps), summed over the epoch: where
recomputation costs what its kernels cost on the accelerator Mimose targets, rather than what
they cost next to this CPU's per-block overheads. Plans are the ones made here (Mimose's plans
depend on bytes, not on the device).

Where the ratio comes from: the epoch **by sequence length** (:data:`LENGTH_RANGES` equal
ranges; per range each trainer's seconds, the ratio, the ceiling and the recomputed nodes per
step), and a **bound**: static over input-aware if input-aware cost nothing over unplanned on
every step where its plan recomputed fewer nodes than the static one, its other steps as run. No
better plan for the sizes that leave room reaches past it while the sizes that need the static
plan's recomputation cost what they do.

**Plan time at 12 layers**: BERT ``tiny12`` (12 layers, as BERT-base) trains :data:`FULL`
``plan_steps`` variable-length steps under a budget, so the estimator fits and later sizes are
planned from it; reported: the runtime's plan time per estimated plan (median), and the choosing
alone (estimator prediction + bucket rule) timed over 1,000 sizes with the fitted estimator.
Target: median < 1 ms. Estimator error per layer after its fit sizes: target < 1%.

JSON goes to ``benchmarks/results/<YYYY-MM-DD>/mimose.json`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks import common as bench

RESULT_FILE = "mimose.json"
TABLE_WIDTH = 170
MIN_LENGTH, MAX_LENGTH = 16, 256
TARGET_SPEEDUP = 1.10
TARGET_PLAN_S = 1e-3
TARGET_ESTIMATOR_ERROR = 0.01
ROWS = ("unplanned", "static", "input_aware")
WHOLE_SEGMENTS = "whole_segments"  # the optional row: input-aware without selective units
SIMULATED_PROFILES = ("V100-16GB-PCIe3", "H100")
LENGTH_RANGES = 4  # the per-range breakdown of the epoch


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str
    config: str
    steps: int
    plan_config: str
    plan_steps: int
    settle_s: float
    # The planned trainers' budget, as a fraction of the unplanned peak at the longest length:
    # a little above the least recompute alone reaches there (bert small ~0.29, tiny ~0.58).
    budget_fraction: float
    seed: int = 0


QUICK = Settings(mode="quick", config="tiny", steps=16, plan_config="tiny12", plan_steps=14, settle_s=0.01,
                 budget_fraction=0.62)
FULL = Settings(mode="full", config="small", steps=200, plan_config="tiny12", plan_steps=30, settle_s=0.05,
                budget_fraction=0.33)


def lengths_for(steps: int, seed: int) -> list[int]:
    """The epoch's sequence lengths: the longest first, then uniform draws from 16..256."""
    rng = random.Random(seed)
    return [MAX_LENGTH] + [rng.randint(MIN_LENGTH, MAX_LENGTH) for _ in range(steps - 1)]


def _trainer(spec, data, cache_dir: str, *, budget, policy: str = "input_aware", selective: bool = True):
    import ort_offload

    device = ort_offload.set_offload_device("cpu", budget=budget, recompute_policy=policy,
                                            selective_recompute=selective)
    return ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        input_names=list(spec.input_names), target_names=list(spec.target_names), dynamic_axes=spec.dynamic_axes,
        optimizer="adamw", name=f"bert-{spec.config_name}", cache_dir=cache_dir,
        passes="recompute",  # with no budget nothing is planned
    )


def measure_epoch(settings: Settings, *, log: Callable[[str], None], whole_segments: bool = False) -> dict[str, Any]:
    """The three trainers (four with ``whole_segments``) over one variable-length epoch."""
    row_names = (*ROWS, WHOLE_SEGMENTS) if whole_segments else ROWS
    from models import get_model

    spec = get_model("bert", settings.config)
    lengths = lengths_for(settings.steps, settings.seed)
    data = [spec.make_batch(seq=n, seed=k) for k, n in enumerate(lengths)]
    with tempfile.TemporaryDirectory(prefix="ort_offload_mimose_bench_") as cache_dir:
        log(f"bert {settings.config}: exporting; {settings.steps} steps, lengths {MIN_LENGTH}..{MAX_LENGTH}")
        setup = _create_trainers(spec, data, cache_dir, settings, whole_segments, log)
        epoch = _run_epoch(setup.trainers, data, lengths, row_names, settings, log)
        reference_state = setup.trainers["unplanned"][0].flat_state()
        rows = [_epoch_row(row, *setup.trainers[row], epoch.per_step[row], epoch.losses, reference_state)
                for row in row_names]
        longest_peak, budget = setup.longest_peak, setup.budget
        del setup
        gc.collect()
    return _epoch_result(spec, lengths, longest_peak, budget, rows, whole_segments, settings)


@dataclasses.dataclass(frozen=True)
class _Trainers:
    """The epoch's trainers (row -> (trainer, seconds to create it)) and the budget they plan for."""

    trainers: dict[str, tuple[Any, float]]
    longest_peak: int  # the unplanned trainer's peak at the longest batch
    budget: int


def _create_trainers(spec, data, cache_dir: str, settings: Settings, whole_segments: bool,
                     log: Callable[[str], None]) -> _Trainers:
    """The unplanned trainer, then the planned ones at a budget below its peak."""
    unplanned, create_s = bench.timed(lambda: _trainer(spec, data, cache_dir, budget=None))
    longest_peak = unplanned.runner.baseline_peak_bytes  # prepared at the first (longest) batch
    budget = int(settings.budget_fraction * longest_peak)
    log(f"unplanned peak at length {MAX_LENGTH}: {longest_peak / 2**20:.1f} MiB; budget {budget / 2**20:.1f} MiB")
    trainers = {"unplanned": (unplanned, create_s)}
    planned = [("static", "static", True), ("input_aware", "input_aware", True)]
    if whole_segments:
        planned.append((WHOLE_SEGMENTS, "input_aware", False))
    for row, policy, selective in planned:
        trainers[row] = bench.timed(lambda: _trainer(spec, data, cache_dir, budget=budget, policy=policy,
                                                     selective=selective))
    return _Trainers(trainers, longest_peak, budget)


@dataclasses.dataclass(frozen=True)
class _Epoch:
    """Per row: each step's record, and the losses."""

    per_step: dict[str, list[dict]]
    losses: dict[str, list[float]]


def _run_epoch(trainers: dict[str, tuple[Any, float]], data, lengths: Sequence[int], row_names: Sequence[str],
               settings: Settings, log: Callable[[str], None]) -> _Epoch:
    """Every batch through every trainer in turn, timing each step."""
    simulate = _StepSimulator()
    per_step: dict[str, list[dict]] = {row: [] for row in row_names}
    losses: dict[str, list[float]] = {row: [] for row in row_names}
    for k, (inputs, targets) in enumerate(data):
        for row in row_names:
            trainer = trainers[row][0]
            before = trainer.runtime.stats.plan_time_s
            plans_before = trainer.runner.recompute.stats.plans
            start = time.perf_counter()
            losses[row].append(trainer.step(*inputs, *targets))
            wall = time.perf_counter() - start
            prepare = trainer.runtime.stats.plan_time_s - before
            per_step[row].append({"length": lengths[k], "wall_s": wall, "prepare_s": prepare,
                                  "run_s": wall - prepare,
                                  # a plan made this step: its graph's block sessions are created in this run
                                  "new_plan": trainer.runner.recompute.stats.plans > plans_before,
                                  "recomputed_nodes": trainer.runner.last_prepared.recomputed_nodes,
                                  "simulated_s": simulate(row, trainer)})
            time.sleep(settings.settle_s)
        if k % 10 == 9:
            log(f"step {k + 1}/{settings.steps}")
    return _Epoch(per_step, losses)


def _epoch_row(row: str, trainer, create_s: float, steps: list[dict], losses: dict[str, list[float]],
               reference_state) -> dict[str, Any]:
    """One trainer's row: its report, its epoch totals, and whether it matched the unplanned one."""
    report = trainer.report()
    summary = trainer.runner.recompute.summary()
    mismatches = bench.state_mismatches(trainer.flat_state(), reference_state)
    return {
        "row": row,
        "budget_bytes": report["budget_bytes"],
        "peak_device_bytes": report["peak_device_bytes"],
        "within_budget": report["within_budget"],
        "create_s": create_s,
        "run_s_median": bench.median([s["run_s"] for s in steps]),
        "run_s_total": sum(s["run_s"] for s in steps),
        "run_s_total_existing_plans": sum(s["run_s"] for s in steps if not s["new_plan"]),
        "prepare_s_total": sum(s["prepare_s"] for s in steps),
        "epoch_s": sum(s["wall_s"] for s in steps),
        "recomputed_nodes_run": sum(s["recomputed_nodes"] for s in steps),
        "steps_recomputing": sum(1 for s in steps if s["recomputed_nodes"]),
        "signatures_prepared": report["plans_made"],
        "recompute": summary,
        "losses_bitwise_equal": bench.bitwise_equal(losses[row], losses["unplanned"]),
        "state_bitwise_equal": not mismatches,
        "per_step": steps,
    }


def _epoch_result(spec, lengths: list[int], longest_peak: int, budget: int, rows: list[dict],
                  whole_segments: bool, settings: Settings) -> dict[str, Any]:
    """The epoch's result: its rows and the speedups between them."""
    by_row = {r["row"]: r for r in rows}
    whole = {}
    if whole_segments:
        whole = {
            "speedup_epoch_whole_segments": by_row["static"]["epoch_s"] / by_row[WHOLE_SEGMENTS]["epoch_s"],
            # what the selective units gain over whole segments alone, epoch and run time
            "selective_speedup_epoch": by_row[WHOLE_SEGMENTS]["epoch_s"] / by_row["input_aware"]["epoch_s"],
            "selective_speedup_run": by_row[WHOLE_SEGMENTS]["run_s_total"] / by_row["input_aware"]["run_s_total"],
        }
    return {
        "model": f"bert-{settings.config}", "batch": spec.default_batch, "lengths": lengths,
        "longest_unplanned_peak_bytes": longest_peak, "budget_bytes": budget, "rows": rows,
        "speedup_epoch": by_row["static"]["epoch_s"] / by_row["input_aware"]["epoch_s"],
        # what a plan recomputing nothing would reach: no recompute plan runs faster than that
        "speedup_ceiling_epoch": by_row["static"]["epoch_s"] / by_row["unplanned"]["epoch_s"],
        "simulated": _simulated_epochs(by_row),
        "speedup_run": by_row["static"]["run_s_total"] / by_row["input_aware"]["run_s_total"],
        "by_length": _by_length(by_row),
        "speedup_epoch_bound_free_where_fewer": _bound_free_where_fewer(by_row),
        # over the steps where neither planned trainer made a new plan (no session creation)
        "speedup_run_existing_plans": _sum_where_neither_planned(by_row, "static") /
        _sum_where_neither_planned(by_row, "input_aware"),
        **whole,
    }


class _StepSimulator:
    """Simulated step seconds per GPU profile of the program a trainer just ran, once per
    (trainer, input signature): a signature's prepared program does not change."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, tuple], dict[str, float]] = {}

    def __call__(self, row: str, trainer) -> dict[str, float]:
        from graph_passes.cost.cost_model import AnalyticalCostModel
        from graph_passes.cost.device_profiles import get_profile
        from graph_passes.cost.simulator import simulate_time

        prepared = trainer.runner.last_prepared
        key = (row, prepared.signature)
        if key not in self._seen:
            model = prepared.model if prepared.model is not None else trainer.runner.model
            self._seen[key] = {
                name: simulate_time(prepared.program, prepared.infos, model=model,
                                    cost_model=AnalyticalCostModel(profile), profile=profile).step_time_s
                for name, profile in ((n, get_profile(n)) for n in SIMULATED_PROFILES)}
        return self._seen[key]


def _simulated_epochs(by_row: dict) -> dict[str, dict[str, float]]:
    """Per profile: each trainer's simulated epoch seconds, and static over input-aware and over
    unplanned (the ceiling)."""
    result = {}
    for name in SIMULATED_PROFILES:
        totals = {row: sum(step["simulated_s"][name] for step in by_row[row]["per_step"]) for row in by_row}
        result[name] = {"epoch_s": totals, "speedup_epoch": totals["static"] / totals["input_aware"],
                        "speedup_ceiling_epoch": totals["static"] / totals["unplanned"]}
    return result


def _by_length(by_row: dict, ranges: int = LENGTH_RANGES) -> list[dict[str, Any]]:
    """The epoch split into equal ranges of sequence length: per range, the steps, each trainer's
    epoch seconds, static over input-aware and over unplanned, and the recomputed nodes per step
    of the two planned trainers. Where the ratio sits across lengths says where the input-aware
    plans gain on the static one (short inputs) and where they cannot (the longest, which need
    the static plan's recomputation too)."""
    width = (MAX_LENGTH - MIN_LENGTH + 1) / ranges
    result = []
    for k in range(ranges):
        low, high = MIN_LENGTH + round(k * width), MIN_LENGTH + round((k + 1) * width) - 1
        steps = [i for i, step in enumerate(by_row["unplanned"]["per_step"]) if low <= step["length"] <= high]
        epoch = {row: sum(by_row[row]["per_step"][i]["wall_s"] for i in steps) for row in by_row}
        nodes = {row: [by_row[row]["per_step"][i]["recomputed_nodes"] for i in steps] for row in ("static", "input_aware")}
        result.append({
            "lengths": [low, high], "steps": len(steps), "epoch_s": epoch,
            "speedup_epoch": epoch["static"] / epoch["input_aware"] if steps else None,
            "speedup_ceiling_epoch": epoch["static"] / epoch["unplanned"] if steps else None,
            "recomputed_nodes_per_step": {row: [min(v), max(v)] if v else None for row, v in nodes.items()},
        })
    return result


def _bound_free_where_fewer(by_row: dict) -> float:
    """Static over input-aware if input-aware cost nothing over unplanned on every step where its
    plan recomputed fewer nodes than the static one, its other steps as measured: what better
    input-aware plans for the sizes that leave it room could reach at most, while the sizes its
    planner found no smaller plan for (at least the static plan's nodes) cost what they cost."""
    unplanned, static, aware = (by_row[r]["per_step"] for r in ("unplanned", "static", "input_aware"))
    forced = sum(max(0.0, a["wall_s"] - u["wall_s"]) for u, s, a in zip(unplanned, static, aware)
                 if a["recomputed_nodes"] >= s["recomputed_nodes"])
    return by_row["static"]["epoch_s"] / (by_row["unplanned"]["epoch_s"] + forced)


def _sum_where_neither_planned(by_row: dict, row: str) -> float:
    static, aware = by_row["static"]["per_step"], by_row["input_aware"]["per_step"]
    return sum(step["run_s"] for step, a, b in zip(by_row[row]["per_step"], static, aware)
               if not a["new_plan"] and not b["new_plan"])


def measure_plan_time(settings: Settings, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Plan time with a 12-layer model: the runtime's estimated plans, and the choosing alone."""
    from graph_passes.planning.recompute.mimose import plan_from_estimates
    from models import get_model

    spec = get_model("bert", settings.plan_config)
    lengths = lengths_for(settings.plan_steps, settings.seed + 1)
    data = [spec.make_batch(seq=n, seed=k) for k, n in enumerate(lengths)]
    with tempfile.TemporaryDirectory(prefix="ort_offload_mimose_plan_") as cache_dir:
        log(f"bert {settings.plan_config}: {settings.plan_steps} variable-length steps for plan times")
        probe = _trainer(spec, data, cache_dir, budget=None)
        budget = int(settings.budget_fraction * probe.runner.baseline_peak_bytes)  # tiny width, like tiny
        del probe
        trainer = _trainer(spec, data, cache_dir, budget=budget)
        for inputs, targets in data:
            trainer.step(*inputs, *targets)
        summary = trainer.runner.recompute.summary()
        estimator = trainer.runner.recompute.estimator
        layers = estimator.layers
        choose_s = []
        if estimator.ready:
            rng = random.Random(3)
            batch = spec.default_batch
            for _ in range(1000):
                size = batch * rng.randint(MIN_LENGTH, MAX_LENGTH)
                start = time.perf_counter()
                plan_from_estimates(estimator.predict_layers(size), estimator.predict_need(size) - budget)
                choose_s.append(time.perf_counter() - start)
        report = trainer.report()
    return {
        "model": f"bert-{settings.plan_config}", "layers_in_model": spec.config.layers, "segments": layers,
        "steps": settings.plan_steps, "budget_bytes": budget, "peak_device_bytes": report["peak_device_bytes"],
        "within_budget": report["within_budget"], "recompute": summary,
        "choose_s_median": statistics.median(choose_s) if choose_s else None,
        "choose_s_p99": float(np.percentile(choose_s, 99)) if choose_s else None,
    }


def run(settings: Settings, *, log: Callable[[str], None], whole_segments: bool = False) -> dict[str, Any]:
    import onnxruntime
    import torch

    onnxruntime.set_default_logger_severity(3)
    started = time.perf_counter()
    epoch = measure_epoch(settings, log=log, whole_segments=whole_segments)
    plan = measure_plan_time(settings, log=log)
    aware = next(r for r in epoch["rows"] if r["row"] == "input_aware")
    errors = [e["max"] for e in aware["recompute"]["estimator_error_per_layer"]] + \
        [e["max"] for e in plan["recompute"]["estimator_error_per_layer"]]
    estimated = plan["recompute"]["estimated_plan_time_s_median"]
    targets = [
        {"what": f"input-aware epoch >= {TARGET_SPEEDUP:.2f}x faster than the static worst-case plan",
         "value": epoch["speedup_epoch"], "met": epoch["speedup_epoch"] >= TARGET_SPEEDUP},
        {"what": f"plan time per estimated plan, 12 layers, median < {TARGET_PLAN_S * 1e3:.0f} ms",
         "value": estimated, "met": estimated is not None and estimated < TARGET_PLAN_S},
        {"what": f"estimator error per layer after its fit < {TARGET_ESTIMATOR_ERROR:.0%}",
         "value": max(errors) if errors else None, "met": bool(errors) and max(errors) < TARGET_ESTIMATOR_ERROR},
    ]
    planned = [r for r in epoch["rows"] if r["row"] != "unplanned"]
    return {
        "benchmark": "mimose",
        "mode": settings.mode,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {**dataclasses.asdict(settings),
                     "lengths": f"{MIN_LENGTH}..{MAX_LENGTH}, first step the longest", "optimizer": "adamw",
                     "device": "cpu", "torch_threads": torch.get_num_threads(),
                     "run_s": "step wall time minus the preparation of a new input signature",
                     "epoch_s": "sum of step wall times (run + preparation)"},
        "epoch": epoch,
        "plan_time": plan,
        "targets": targets,
        "targets_met": all(t["met"] for t in targets),
        "all_within_budget": all(r["within_budget"] for r in planned) and plan["within_budget"],
        "all_bitwise_equal": all(r["losses_bitwise_equal"] and r["state_bitwise_equal"] for r in planned),
        "total_time_s": time.perf_counter() - started,
    }


def print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    epoch = result["epoch"]
    table = Table(title=f"Variable-length training, {epoch['model']} batch {epoch['batch']}, "
                        f"{len(epoch['lengths'])} steps, lengths {MIN_LENGTH}..{MAX_LENGTH} "
                        f"({result['mode']} mode), budget {epoch['budget_bytes'] / 2**20:.1f} MiB")
    for column in ("plan", "peak MiB", "run ms median", "run s total", "prepare s total", "epoch s",
                   "recomputed nodes run", "steps recomputing", "plans / reuses", "bitwise"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for r in epoch["rows"]:
        rc = r["recompute"]
        planned = r["row"] != "unplanned"
        bitwise = "ref" if not planned else ("yes" if r["losses_bitwise_equal"] and r["state_bitwise_equal"] else "[red]NO[/]")
        table.add_row(r["row"], f"{r['peak_device_bytes'] / 2**20:.1f}", f"{r['run_s_median'] * 1e3:.0f}",
                      f"{r['run_s_total']:.1f}", f"{r['prepare_s_total']:.1f}", f"{r['epoch_s']:.1f}",
                      str(r["recomputed_nodes_run"]), str(r["steps_recomputing"]),
                      f"{rc['recompute_plans']} / {rc['recompute_plan_reuses']}" if planned else "-", bitwise)
    console.print(table)
    console.print(f"static / input-aware: epoch {epoch['speedup_epoch']:.2f}x, run only {epoch['speedup_run']:.2f}x, "
                  f"run on steps where neither made a new plan {epoch['speedup_run_existing_plans']:.2f}x; "
                  f"ceiling (static / unplanned, nothing recomputed) {epoch['speedup_ceiling_epoch']:.2f}x")
    console.print(f"bound: static / input-aware if input-aware cost nothing where it recomputed fewer nodes "
                  f"than static (its other steps as run): {epoch['speedup_epoch_bound_free_where_fewer']:.2f}x")
    ranges = Table(title="by sequence length")
    for column in ("lengths", "steps", "epoch s: unplanned / static / input-aware", "static / input-aware",
                   "ceiling", "recomputed nodes per step: static / input-aware"):
        ranges.add_column(column, justify="right")
    for r in epoch["by_length"]:
        if not r["steps"]:
            continue
        e, n = r["epoch_s"], r["recomputed_nodes_per_step"]
        ranges.add_row(f"{r['lengths'][0]}-{r['lengths'][1]}", str(r["steps"]),
                       f"{e['unplanned']:.1f} / {e['static']:.1f} / {e['input_aware']:.1f}",
                       f"{r['speedup_epoch']:.2f}x", f"{r['speedup_ceiling_epoch']:.2f}x",
                       " / ".join("-".join(dict.fromkeys(map(str, n[row]))) for row in ("static", "input_aware")))
    console.print(ranges)
    if "selective_speedup_epoch" in epoch:
        console.print(f"whole segments only (Mimose's rule) / input-aware: epoch {epoch['selective_speedup_epoch']:.2f}x, "
                      f"run {epoch['selective_speedup_run']:.2f}x; static / whole segments: epoch "
                      f"{epoch['speedup_epoch_whole_segments']:.2f}x")
    for name, sim in epoch["simulated"].items():
        console.print(f"simulated on {name} (the same programs, roofline kernels): epoch static "
                      f"{sim['epoch_s']['static']:.2f} s, input-aware {sim['epoch_s']['input_aware']:.2f} s, "
                      f"unplanned {sim['epoch_s']['unplanned']:.2f} s; static / input-aware "
                      f"{sim['speedup_epoch']:.2f}x, ceiling {sim['speedup_ceiling_epoch']:.2f}x")
    plan = result["plan_time"]
    rc = plan["recompute"]
    est = rc["estimated_plan_time_s_median"]
    console.print(f"{plan['model']} ({plan['layers_in_model']} layers, {plan['segments']} segments): "
                  f"{rc['recompute_plans']} plans ({rc['estimated_plans']} from the estimator, "
                  f"{rc['estimate_fell_short']} continued after the check), {rc['recompute_plan_reuses']} reuses; "
                  f"estimated plan median {est * 1e3:.3f} ms" if est is not None else "no estimated plan")
    if plan["choose_s_median"] is not None:
        console.print(f"choosing alone (prediction + bucket rule), 1,000 sizes: median "
                      f"{plan['choose_s_median'] * 1e6:.0f} µs, p99 {plan['choose_s_p99'] * 1e6:.0f} µs")
    for row in (*[r for r in epoch["rows"] if r["row"] == "input_aware"], plan):
        errs = row["recompute"]["estimator_error_per_layer"]
        if errs:
            console.print(f"estimator error per layer ({row.get('model', epoch['model'])}): "
                          + ", ".join(f"{e['max']:.1e}" for e in errs) + f" (max over {errs[0]['sizes']} sizes)")
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        console.print(f"{'[green]PASS[/]' if t['met'] else '[red]FAIL[/]'} {t['what']}: {value}")
    console.print(f"peak <= budget: {result['all_within_budget']}; bitwise equal to unplanned: "
                  f"{result['all_bitwise_equal']}; total {result['total_time_s']:.0f} s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mimose", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bert tiny, 16 steps (for tests)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for mimose.json (default: benchmarks/results/<YYYY-MM-DD>)")
    parser.add_argument("--steps", type=int, default=None, help="steps in the epoch")
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="the planned trainers' budget as a fraction of the unplanned peak at the longest "
                             f"length (default {FULL.budget_fraction}, {QUICK.budget_fraction} with --quick)")
    parser.add_argument("--whole-segments", action="store_true",
                        help="a fourth trainer: input-aware with whole segments only (no selective units)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.steps is not None:
        if args.steps < 2:
            raise SystemExit("--steps must be at least 2")
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.budget_fraction is not None:
        if not 0 < args.budget_fraction < 1:
            raise SystemExit(f"--budget-fraction must be between 0 and 1, got {args.budget_fraction}")
        settings = dataclasses.replace(settings, budget_fraction=args.budget_fraction)
    return bench.run_main(
        module="benchmarks.mimose", result_file=RESULT_FILE, argv=argv, out=args.out, table_width=TABLE_WIDTH,
        measure=lambda log: run(settings, log=log, whole_segments=args.whole_segments), print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
