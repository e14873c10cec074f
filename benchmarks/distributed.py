"""Data-parallel training on the CPU device: one rank against two, with and without sharded optimizer state.

Run ``python -m benchmarks.distributed [--quick] [--out DIR]``. Two parts (gpt with AdamW, whose
moments are two thirds of its state; a short sequence, so state outweighs activations):

1. **Runs** (real processes, gloo, as torchrun starts them; one thread per rank): the same
   global batch and steps on 1 rank, on 2 ranks, and on 2 ranks with
   ``shard_optimizer_state=True``. Per rank: the peak device bytes of the step (the report's
   ``peak_device_bytes``), its optimizer-state bytes, the bytes it communicated per step
   (gradients reduced + parameters gathered), the seconds in collectives per step, the share of
   them hidden under compute (``comm_overlap_fraction``) and the median step time (2 CPU cores
   shared: not the point). The losses of the runs are compared. A fourth run repeats the
   sharded one with the backward cut into 64-node blocks: gradient buckets are then reduced
   while later blocks compute, which the overlap fraction measures (unbudgeted, the backward is
   nearly one block and its gradients are reduced at the cut).
2. **Largest global batch under a per-rank budget** (planned, not run: each probe lowers the
   rank's step graph for that batch and replays it through the allocator, which is what the
   runtime's arena accounts): the budget is one rank's unplanned peak at the base batch; the
   largest batch whose unplanned step (no offload passes) fits it on every rank, by doubling
   then bisection. Target: 2 sharded ranks fit at least twice one rank's batch.

The table is printed and the JSON goes to ``benchmarks/results/<YYYY-MM-DD>/distributed.json``
(or ``--out DIR``). ``--quick``: gpt tiny, fewer steps, a smaller search (for tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.common import median, run_main

ROOT = Path(__file__).resolve().parents[1]
TARGET_FACTOR = 2.0  # 2 sharded ranks' largest global batch over one rank's
RUN_TIMEOUT_S = 900
# name -> (world size, sharded): the settings compared
SETTINGS = {"1 rank": (1, False), "2 ranks": (2, False), "2 ranks, sharded": (2, True)}
# One more run: the backward in blocks of this many nodes, so gradient buckets overlap the blocks after them
BUCKETED = ("2 ranks, sharded, 64-node blocks", 64)


@dataclasses.dataclass(frozen=True)
class Settings:
    config: str = "small"
    seq: int = 16
    batch: int = 8  # global batch of the runs, and the base batch of the search
    steps: int = 4
    max_factor: int = 16  # largest batch searched: batch * max_factor


FULL = Settings()
QUICK = Settings(config="tiny", steps=2, max_factor=8)


# ---- one rank (a process started by _run_ranks) ---------------------------------------------


def _worker(args) -> int:
    """Train ``args.steps`` global batches as one rank; write ``rank<R>.json``."""
    import datetime

    import torch.distributed as dist

    import ort_offload
    from models import get_model

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
    spec = get_model("gpt", args.config)
    batches = [spec.make_batch(args.batch, args.seq, seed=step) for step in range(args.steps)]
    device = ort_offload.set_offload_device("cpu", intra_op_threads=1, max_block_nodes=args.block_nodes)
    inputs, targets = batches[0]
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets,
        input_names=spec.input_names, target_names=spec.target_names, name=spec.name, passes="none",
        cache_dir=args.cache_dir, shard_optimizer_state=args.shard,
    )
    for inputs, targets in batches:
        trainer.step(*inputs, *targets)
    report = trainer.report()
    Path(args.worker_out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(settings: Settings, world: int, shard: bool, out: Path, cache_dir: str,
               block_nodes: int | None = None) -> list[dict]:
    """Start ``world`` ranks of :func:`_worker`; their reports, rank by rank."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
    command = [sys.executable, "-m", "benchmarks.distributed", "--worker-out", str(out), "--config", settings.config,
               "--seq", str(settings.seq), "--batch", str(settings.batch), "--steps", str(settings.steps),
               "--cache-dir", cache_dir] + (["--shard"] if shard else []) + (
                   ["--block-nodes", str(block_nodes)] if block_nodes else [])
    procs = [subprocess.Popen(command, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} of {world} failed ({proc.returncode}): {logs[rank][-1500:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _run_row(name: str, reports: list[dict], steps: int) -> dict:
    """One row of the runs table: per-rank numbers (the worst rank's where they differ)."""
    per_step = [(r["allreduce_bytes"] + r["allgather_bytes"]) / steps for r in reports]
    return {
        "setting": name,
        "world_size": len(reports),
        "shard_optimizer_state": reports[0]["shard_optimizer_state"],
        "peak_device_bytes": max(r["peak_device_bytes"] for r in reports),
        "optimizer_state_bytes": max(r["optimizer_state_bytes"] for r in reports),
        "optimizer_state_bytes_per_rank": [r["optimizer_state_bytes"] for r in reports],
        "comm_bytes_per_step": max(per_step),
        "comm_time_s_per_step": max(r["comm_time_s"] for r in reports) / steps,
        "comm_overlap_fraction": min(r["comm_overlap_fraction"] for r in reports),
        "step_time_s_median": max(r["step_time_s_median"] for r in reports),
        "losses": reports[0]["losses"],
    }


def measure_runs(settings: Settings, cache_dir: str, log) -> list[dict]:
    rows = []
    runs = [(name, world, shard, None) for name, (world, shard) in SETTINGS.items()]
    runs.append((BUCKETED[0], 2, True, BUCKETED[1]))
    with tempfile.TemporaryDirectory(prefix="dist-bench-") as tmp:
        for number, (name, world, shard, block_nodes) in enumerate(runs):
            log(f"run: {name} (global batch {settings.batch}, {settings.steps} steps)")
            reports = _run_ranks(settings, world, shard, Path(tmp) / f"run{number}", cache_dir, block_nodes)
            rows.append(_run_row(name, reports, settings.steps))
    reference = rows[0]["losses"]
    for row in rows:
        row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference))
    return rows


# ---- the largest batch under a per-rank budget (planned) ------------------------------------


class RankPeaks:
    """The unplanned peak of each rank's step graph at a per-rank batch, as a data-parallel
    rank plans it (gradients first), computed without a process group."""

    def __init__(self, settings: Settings, cache_dir: str) -> None:
        import ort_offload
        from models import get_model
        from ort_offload.export.training_step import export_training_step, initial_state
        from ort_offload.export.optimizers import make_optimizer

        self.spec, self.settings = get_model("gpt", settings.config), settings
        inputs, targets = self.spec.make_batch(2, settings.seq, seed=0)
        result = export_training_step(
            self.spec.model, example_inputs=inputs, example_targets=targets, loss_fn=self.spec.loss_fn,
            optimizer=make_optimizer("adamw"), input_names=self.spec.input_names,
            target_names=self.spec.target_names, dynamic_axes=self.spec.dynamic_axes, name=self.spec.name,
            cache_dir=cache_dir)
        self.graph = result.graph
        self.state = initial_state(self.graph, self.spec.model, lr=1e-3, step=1)
        self.device = ort_offload.set_offload_device("cpu")
        self._peaks: dict[tuple, int] = {}

    def graphs(self, world: int, shard: bool) -> list:
        """Each rank's step graph."""
        from ort_offload.sharding import partition_parameters, rank_graph

        if not shard:
            return [self.graph]  # every rank runs the same graph
        shards = partition_parameters(self.graph, {n: a.nbytes for n, a in self.state.items()}, world)
        return [rank_graph(self.graph, shards, rank) for rank in range(world)]

    def peak(self, graph, batch: int) -> int:
        """``graph``'s unplanned peak at per-rank ``batch`` (cached)."""
        key = (id(graph), batch)
        if key not in self._peaks:
            from graph_passes.ir.shapes import check_inputs
            from ort_offload.distributed import data_parallel_planner
            from ort_offload.runtime.runner import Runtime

            inputs, targets = self.spec.make_batch(batch, self.settings.seq, seed=0)
            names = self.spec.input_names + self.spec.target_names
            feeds = {**{n: self.state[n] for n in graph.state_inputs},
                     **{n: t.numpy() for n, t in zip(names, (*inputs, *targets))}}
            planner = data_parallel_planner(Runtime(self.device), graph, fetches=graph.step_fetches, passes=())
            plan = planner.plan(check_inputs(graph.model, feeds), probe_feeds=feeds, resolve_budget=lambda peak: None)
            self._peaks[key] = plan.choice.trace.peak_device_bytes
        return self._peaks[key]


def _largest(fits, start: int, cap: int) -> tuple[int, bool]:
    """The largest per-rank batch in 1..cap that ``fits`` (doubling from ``start``, then
    bisection), and whether the cap stopped the search."""
    if not fits(1):
        return 0, False
    low, high = 1, None
    batch = max(start, 2)
    while high is None:
        if batch > cap:
            if fits(cap):
                return cap, True
            high = cap
        elif fits(batch):
            low, batch = batch, batch * 2
        else:
            high = batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, False


def measure_capacity(settings: Settings, cache_dir: str, log) -> dict:
    peaks = RankPeaks(settings, cache_dir)
    budget = peaks.peak(peaks.graph, settings.batch)
    log(f"per-rank budget: one rank's unplanned peak at batch {settings.batch}, {budget} bytes")
    rows = []
    for name, (world, shard) in SETTINGS.items():
        graphs = peaks.graphs(world, shard)
        per_rank, capped = _largest(lambda b: all(peaks.peak(g, b) <= budget for g in graphs),
                                    settings.batch // world, settings.batch * settings.max_factor // world)
        rows.append({"setting": name, "world_size": world, "shard_optimizer_state": shard,
                     "largest_global_batch": per_rank * world, "capped": capped,
                     "peak_at_largest_bytes": max(peaks.peak(g, per_rank) for g in graphs) if per_rank else None})
        log(f"{name}: largest global batch {per_rank * world}")
    one = rows[0]["largest_global_batch"]
    sharded = rows[-1]["largest_global_batch"]
    return {"budget_bytes": budget, "rows": rows, "sharded_over_one_rank": sharded / one if one else None,
            "target_factor": TARGET_FACTOR, "target_met": bool(one) and sharded >= TARGET_FACTOR * one}


def measure(settings: Settings, log) -> dict:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dist-bench-cache-") as cache_dir:
        capacity = measure_capacity(settings, cache_dir, log)
        runs = measure_runs(settings, cache_dir, log)
    return {"settings": dataclasses.asdict(settings), "model": f"gpt {settings.config}", "runs": runs,
            "capacity": capacity, "wall_time_s": time.perf_counter() - started}


def print_table(result: dict, console) -> None:
    from rich.table import Table

    from ort_offload.budget import format_bytes

    settings = result["settings"]
    table = Table(title=f"{result['model']}, seq {settings['seq']}, global batch {settings['batch']}: per rank")
    for column in ("setting", "peak", "optimizer state", "comm/step", "comm s/step", "overlap", "step s",
                   "loss rel diff"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in result["runs"]:
        table.add_row(row["setting"], format_bytes(row["peak_device_bytes"]), format_bytes(row["optimizer_state_bytes"]),
                      format_bytes(int(row["comm_bytes_per_step"])), f"{row['comm_time_s_per_step']:.3f}",
                      f"{row['comm_overlap_fraction']:.2f}", f"{row['step_time_s_median']:.3f}",
                      f"{row['loss_max_rel_diff']:.1e}")
    console.print(table)
    capacity = result["capacity"]
    table = Table(title=f"largest global batch, per-rank budget {format_bytes(capacity['budget_bytes'])} (no offload)")
    for column in ("setting", "largest global batch", "peak there"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in capacity["rows"]:
        peak = row["peak_at_largest_bytes"]
        table.add_row(row["setting"], f"{'>=' if row['capped'] else ''}{row['largest_global_batch']}",
                      "-" if peak is None else format_bytes(peak))
    console.print(table)
    console.print(f"target (2 sharded ranks >= {TARGET_FACTOR:g}x one rank's batch): {capacity['target_met']} "
                  f"({capacity['sharded_over_one_rank']})")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt tiny, 2 steps, a smaller search (for tests)")
    parser.add_argument("--out", default=None, help="directory for distributed.json (default: benchmarks/results/<date>)")
    # One rank of a run (started by the benchmark itself)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    for flag, kind in (("--config", str), ("--seq", int), ("--batch", int), ("--steps", int), ("--cache-dir", str),
                       ("--block-nodes", int)):
        parser.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_out is not None:
        return _worker(args)
    settings = QUICK if args.quick else FULL
    return run_main(module="benchmarks.distributed", result_file="distributed.json", argv=argv,
                    out=Path(args.out) if args.out else None, table_width=110,
                    measure=lambda log: measure(settings, log), print_table=print_table)


if __name__ == "__main__":
    raise SystemExit(main())
