"""Capacity under a fixed budget (issue 5, TSPLIT Table IV): the largest batch that trains.

For each model (gpt ``small`` and cnn ``small``; ``--quick``: their ``tiny`` configs) the
budget is the unplanned peak at batch 4, measured on one real step (parameters, gradients,
optimizer state and activations). Then, for each pass set — no plan, swap only, recompute only,
swap+recompute, swap+recompute+split — the largest batch that trains: a real AdamW step under
that budget (the runtime's arena is capped at it, so a step that runs has peak ≤ budget),
found by doubling from 4 up to ``max_factor`` × 4 and bisecting between the last batch that
trained and the first that did not; every probe is a fresh trainer planned for that batch.
A batch the planner refuses (``BudgetTooSmallError``) does not train. Last, the step time of each pass set at the unplanned run's largest batch
(under the budget), relative to the unplanned step at that batch without a budget.

One table plus ``benchmarks/results/<date>/capacity.json``. Target: swap+recompute+split trains
≥ 10× the unplanned largest batch of gpt small (TSPLIT reports 11.8× for a Transformer).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.common import median, run_main

PASS_SETS = (
    ("none", ()),
    ("swap", ("swap",)),
    ("recompute", ("recompute",)),
    ("swap+recompute", ("recompute", "swap")),
    ("swap+recompute+split", ("recompute", "swap", "split")),
)
TARGET_RATIO = 10.0


@dataclasses.dataclass(frozen=True)
class Settings:
    models: tuple[tuple[str, str], ...] = (("gpt", "small"), ("cnn", "small"))
    base_batch: int = 4
    max_factor: int = 32  # largest batch probed: base_batch * max_factor
    time_steps: int = 3  # measured steps (after one warm-up) for the step-time column
    optimizer: str = "adamw"


FULL = Settings()
QUICK = Settings(models=(("gpt", "tiny"), ("cnn", "tiny")), max_factor=32, time_steps=3)


def _trainer(spec, name: str, batch: int, budget: int | None, passes, cache_dir: str, optimizer: str):
    import ort_offload

    inputs, targets = spec.make_batch(batch, seed=0)
    device = ort_offload.set_offload_device("cpu", budget=budget)
    return ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets,
        input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
        optimizer=optimizer, name=name, passes=list(passes), cache_dir=cache_dir,
    )


def _step(trainer, spec, batch: int, seed: int) -> float:
    inputs, targets = spec.make_batch(batch, seed=seed)
    return trainer.step(*inputs, *targets)


def _largest_batch(spec, name: str, passes, settings: Settings, budget: int, cache_dir: str, log) -> dict:
    """Doubling, then bisection; each probe a fresh trainer for that batch (planned for its one
    input signature) and a real step under the budget."""
    from ort_offload.errors import BudgetTooSmallError, OffloadError

    probes = []
    used = {"split_nodes": 0, "passes": []}

    def trains(batch: int) -> bool:
        started = time.perf_counter()
        error = None
        try:
            trainer = _trainer(spec, name, batch, budget, passes, cache_dir, settings.optimizer)
            _step(trainer, spec, batch, seed=batch)
            report = trainer.report()
            ok = report["within_budget"] is True and report["peak_device_bytes"] <= budget
            if ok:
                used.update(split_nodes=report["split_nodes"], passes=report["passes"], peak=report["peak_device_bytes"])
        except BudgetTooSmallError:
            ok = False
        except OffloadError as e:  # a plan that failed while running: recorded, counted as not training
            ok, error = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        probes.append({"batch": batch, "trains": ok, "seconds": round(time.perf_counter() - started, 3),
                       **({"error": error} if error else {})})
        log(f"    batch {batch}: {'trains' if ok else 'does not train'} ({probes[-1]['seconds']} s){' ' + error if error else ''}")
        return ok

    limit = settings.base_batch * settings.max_factor
    good, bad = 0, None
    batch = settings.base_batch
    while batch <= limit:
        if not trains(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    if bad is None and good < limit:  # the last doubling overshot the limit: probe the limit
        if trains(limit):
            good = limit
        else:
            bad = limit
    if bad is not None and good:
        while bad - good > 1:
            mid = (good + bad) // 2
            if trains(mid):
                good = mid
            else:
                bad = mid
    if good:  # what the largest batch's plan used
        trains(good)
    return {"largest_batch": good, "capped": bad is None, "probes": probes, "peak_bytes": used.get("peak"),
            "split_nodes": used["split_nodes"], "passes_used": used["passes"]}


def _median_step(trainer, spec, batch: int, steps: int) -> float:
    _step(trainer, spec, batch, seed=10_000)  # warm-up: sessions
    times = trainer.runner.step_times_s
    start = len(times)
    for k in range(steps):
        _step(trainer, spec, batch, seed=10_001 + k)
    return median(times[start:])


def measure_model(name: str, config: str, settings: Settings, cache_dir: str, log) -> dict:
    from models import get_model

    spec = get_model(name, config)
    log(f"{name} {config}: unplanned peak at batch {settings.base_batch}")
    unplanned = _trainer(spec, name, settings.base_batch, None, (), cache_dir, settings.optimizer)
    _step(unplanned, spec, settings.base_batch, seed=0)
    budget = unplanned.report()["peak_device_bytes"]
    rows = []
    for label, passes in PASS_SETS:
        log(f"  {label} (budget {budget} bytes)")
        started = time.perf_counter()
        row = {"passes": label, **_largest_batch(spec, name, passes, settings, budget, cache_dir, log)}
        row["search_s"] = round(time.perf_counter() - started, 2)
        rows.append(row)
    base_batch = rows[0]["largest_batch"]
    reference = _trainer(spec, name, base_batch, None, (), cache_dir, settings.optimizer)
    reference_s = _median_step(reference, spec, base_batch, settings.time_steps)
    for row, (_, passes) in zip(rows, PASS_SETS):
        row["ratio_to_unplanned"] = (row["largest_batch"] / base_batch) if base_batch else None
        row["step_s_at_unplanned_largest"] = row["step_time_vs_unplanned"] = None
        if row["largest_batch"] >= base_batch > 0:
            trainer = _trainer(spec, name, base_batch, budget, passes, cache_dir, settings.optimizer)
            seconds = _median_step(trainer, spec, base_batch, settings.time_steps)
            row["step_s_at_unplanned_largest"] = seconds
            row["step_time_vs_unplanned"] = seconds / reference_s
    return {"model": name, "config": config, "budget_bytes": budget, "base_batch": settings.base_batch,
            "unplanned_largest_batch": base_batch, "unplanned_step_s": reference_s, "rows": rows}


def measure(settings: Settings, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="capacity-export-") as cache_dir:
        models = [measure_model(name, config, settings, cache_dir, log) for name, config in settings.models]
    gpt = next((m for m in models if m["model"] == "gpt"), None)
    best = gpt["rows"][-1]["ratio_to_unplanned"] if gpt else None
    return {"settings": dataclasses.asdict(settings), "models": models,
            "target": {"gpt_split_ratio": best, "goal": TARGET_RATIO, "met": bool(best is not None and best >= TARGET_RATIO)}}


def print_table(result: dict, console) -> None:
    from rich.table import Table

    from ort_offload.budget import format_bytes

    table = Table(title="largest batch under the unplanned batch-4 peak (a real step each)")
    for column in ("model", "budget", "passes", "largest batch", "x unplanned", "step time x (at unplanned largest)",
                   "split nodes"):
        table.add_column(column)
    for model in result["models"]:
        for k, row in enumerate(model["rows"]):
            ratio = row["ratio_to_unplanned"]
            step = row["step_time_vs_unplanned"]
            table.add_row(f"{model['model']} {model['config']}" if k == 0 else "",
                          format_bytes(model["budget_bytes"]) if k == 0 else "", row["passes"],
                          f"{'>=' if row['capped'] else ''}{row['largest_batch']}",
                          "-" if ratio is None else f"{ratio:.2f}", "-" if step is None else f"{step:.2f}",
                          str(row["split_nodes"]))
    console.print(table)
    console.print(f"target (gpt, swap+recompute+split >= {TARGET_RATIO}x unplanned): {result['target']}")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configs, batches up to 32x (about 15 minutes here)")
    parser.add_argument("--max-factor", type=int, default=None, help="largest batch probed, as a multiple of 4")
    parser.add_argument("--models", default=None, help="comma list of name:config (default gpt:small,cnn:small)")
    parser.add_argument("--out", default=None, help="directory for capacity.json (default: benchmarks/results/<date>)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.max_factor is not None:
        if args.max_factor < 1:
            raise SystemExit("--max-factor must be at least 1")
        settings = dataclasses.replace(settings, max_factor=args.max_factor)
    if args.models:
        settings = dataclasses.replace(settings, models=tuple(tuple(m.split(":", 1)) for m in args.models.split(",")))
    return run_main(module="benchmarks.capacity", result_file="capacity.json", argv=argv,
                    out=Path(args.out) if args.out else None, table_width=120,
                    measure=lambda log: measure(settings, log), print_table=print_table)


if __name__ == "__main__":
    raise SystemExit(main())
