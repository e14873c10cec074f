"""Mimose's epoch through our runtime on the CUDA device: input-aware vs static recompute vs no
plan, BERT on variable-length batches (the setting of ``benchmarks/mimose.py``).

Two phases, as ``benchmarks.gpu_ort`` (the lent GPU machine has another torch and no network):

    python -m benchmarks.gpu_ort_mimose export --graphs .gpu-graphs             # here: bert small
    python3 -m benchmarks.gpu_ort_mimose run --graphs .gpu-graphs --out $OUT    # there
    python -m benchmarks.gpu_ort_mimose run --graphs DIR --config tiny --device cpu --steps 6  # the CPU

``export`` writes bert's training step with the batch and sequence axes dynamic (the zoo's
``dynamic_axes``), so one file serves every length. ``run`` rebuilds the torch model from the
zoo for the initial values and trains one epoch of ``--steps`` batches, lengths drawn from
16..256 with the longest first (``benchmarks.mimose.lengths_for``; ``--epochs`` passes over the
same batches: from the second on every length is prepared, as in a long training run), once per
row, each row in its own process (the device counter is per process: another trainer's arenas
would be counted):

- **unplanned**: no budget (each new length gets its own unplanned program);
- **static**: ``recompute_policy="static"``: the plan made for the first (longest) batch serves
  every length;
- **input_aware**: ``recompute_policy="input_aware"`` (Mimose): a plan per size bucket.

The planned rows' budget is ``--budget-fraction`` (default: the CPU benchmark's full-mode
setting) of the unplanned peak at the longest length, resolved by the runtime as ``"0.33x"``
would be. Per row: epoch time (run plus preparation of new lengths), the steps by length range,
recomputed nodes run, block sessions held, the measured peak (the device counter on CUDA) against
the budget, and the losses and a digest of the final state compared bitwise with the unplanned
row and between the two policies; the same per pass over the batches. A row stops early at its share of ``--time-limit``; the
comparison then covers the steps every row ran. Table and ``OUT/gpu_ort_mimose_<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import gpu_ort, mimose

ROWS = mimose.ROWS  # unplanned, static, input_aware: the unplanned row first (the reference)
POLICIES = {"unplanned": None, "static": "static", "input_aware": "input_aware"}
# The CPU benchmark's budgets per config: a little above the least recompute alone reaches there.
BUDGET_FRACTIONS = {mimose.FULL.config: mimose.FULL.budget_fraction, mimose.QUICK.config: mimose.QUICK.budget_fraction}
TARGET_SPEEDUP = 1.15  # issue 22: what torch's version of the same plans reached at batch 128
RESULT_PREFIX = "gpu_ort_mimose"
# A guess until a GPU has run it: a step of ours for bert small ~50-100 ms on an H100 or H200
# (2,551 ORT nodes launched one by one, more where recomputed), plus ~0.1-0.3 s preparing each
# new length (CPU work: 0.2-0.5 s on this loaded 2-core machine), plus ~15 s of setup per row:
# 60 steps keep a row near 30 s.
DEFAULT_STEPS = 60


def export(directory: Path, config: str, *, use_cache: bool = False) -> None:
    """bert's training step, sequence axis dynamic (the zoo's ``dynamic_axes``)."""
    gpu_ort.export_graphs(directory, config, models=("bert",), use_cache=use_cache)


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One row's run: the graph, the device, the epoch and the budget."""

    graphs: Path
    config: str
    device: str
    steps: int
    seed: int
    budget_fraction: float
    time_limit_s: float
    batch: int | None = None
    epochs: int = 1  # passes over the same batches: from the second on, every length is prepared


def epoch_feeds(spec, epoch: Epoch) -> list[dict]:
    """The epoch's batches as feeds, the longest first."""
    names = spec.input_names + spec.target_names
    feeds = []
    for k, length in enumerate(mimose.lengths_for(epoch.steps, epoch.seed)):
        inputs, targets = spec.make_batch(epoch.batch, seq=length, seed=k)
        feeds.append({n: t.numpy() for n, t in zip(names, inputs + targets)})
    return feeds


def make_trainer(row: str, epoch: Epoch, feeds: list[dict]):
    """The row's trainer over the exported step, prepared for the first (longest) batch."""
    import onnx

    import ort_offload
    from graph_passes.ir.training_graph import TrainingGraph
    from models import get_model
    from ort_offload.budget import Budget
    from ort_offload.export.training_step import initial_state
    from ort_offload.trainer import OrtTrainer, resolve_passes

    spec = get_model("bert", epoch.config)
    graph = TrainingGraph.from_model(onnx.load(epoch.graphs / f"bert-{epoch.config}.onnx"), name="bert")
    policy = POLICIES[row]
    device = ort_offload.set_offload_device(
        epoch.device, budget=None if policy is None else Budget(fraction=epoch.budget_fraction),
        recompute_policy=policy or "input_aware", async_swap_outs=True)
    return OrtTrainer(device, graph, initial_state=initial_state(graph, spec.model, lr=gpu_ort.LR, step=1),
                      example_batch=feeds[0], input_names=spec.input_names, target_names=spec.target_names,
                      passes=resolve_passes("recompute"))  # with no budget nothing is planned


def train_row(row: str, epoch: Epoch) -> dict:
    """One row's epoch in this process: per step its time, preparation and recomputation; the
    report's peak and budget; the losses and a digest of the final state."""
    from models import get_model

    started = time.perf_counter()
    feeds = epoch_feeds(get_model("bert", epoch.config), epoch)
    trainer = make_trainer(row, epoch, feeds)
    setup_s = time.perf_counter() - started
    steps = []
    for index, feed in ((e, f) for e in range(epoch.epochs) for f in feeds):
        if time.perf_counter() - started > epoch.time_limit_s:
            break
        steps.append({"epoch": index, **_step(trainer, feed)})
    report = trainer.report()
    return {
        "row": row, "policy": POLICIES[row], "setup_s": setup_s, "steps_done": len(steps),
        "complete": len(steps) == len(feeds) * epoch.epochs, "budget_bytes": report["budget_bytes"],
        "peak_device_bytes": report["peak_device_bytes"], "within_budget": report["within_budget"],
        "device_overhead_bytes": report.get("device_overhead_bytes"), "block_sessions": trainer.runner.session_count,
        "recompute": trainer.runner.recompute.summary(), "losses": [s.pop("loss") for s in steps],
        "state_digest": state_digest(trainer.flat_state()), "per_step": steps,
    }


def _step(trainer, feed: dict) -> dict:
    """One step, timed; ``prepare_s`` is the planning of a new length, ``new_plan`` whether a
    recompute plan was made for it (its block sessions are then created in this run)."""
    runner = trainer.runner
    before, plans_before = trainer.runtime.stats.plan_time_s, runner.recompute.stats.plans
    start = time.perf_counter()
    loss = trainer.step(*(feed[n] for n in trainer.batch_names))
    wall = time.perf_counter() - start
    prepare = trainer.runtime.stats.plan_time_s - before
    return {"length": int(feed[trainer.input_names[0]].shape[1]), "wall_s": wall, "prepare_s": prepare,
            "run_s": wall - prepare, "new_plan": runner.recompute.stats.plans > plans_before,
            "recomputed_nodes": runner.last_prepared.recomputed_nodes, "sessions": runner.session_count,
            "loss": loss}


def state_digest(state: dict) -> str:
    """One digest of every tensor's name, dtype, shape and bytes (bitwise equality across processes)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        digest.update(f"{name}|{value.dtype}|{value.shape}|".encode() + value.tobytes())
    return digest.hexdigest()


# ---- the rows in their own processes, and the comparison --------------------------------------


def spawn_row(row: str, epoch: Epoch, out: Path, log) -> dict:
    """One row in a fresh process (a fresh device): its result, or why there is none."""
    part = out / f"row_{row}.json"
    command = [sys.executable, "-m", "benchmarks.gpu_ort_mimose", "row", "--row", row, "--graphs", str(epoch.graphs),
               "--config", epoch.config, "--device", epoch.device, "--steps", str(epoch.steps),
               "--seed", str(epoch.seed), "--budget-fraction", str(epoch.budget_fraction),
               "--time-limit", str(epoch.time_limit_s), "--epochs", str(epoch.epochs), "--out", str(part)]
    if epoch.batch is not None:
        command += ["--batch", str(epoch.batch)]
    grace = 120.0  # the process's start, the device's, and the row's first length
    try:
        subprocess.run(command, timeout=epoch.time_limit_s + grace, check=False)
    except subprocess.TimeoutExpired:
        log(f"{row}: the row's process ran past {epoch.time_limit_s + grace:.0f} s and was stopped")
    if not part.exists():
        return {"row": row, "error": "the row's process wrote no result"}
    result = json.loads(part.read_text())
    part.unlink()
    return result


def run_row(args) -> int:
    """The ``row`` command: one row, its result to ``--out`` (a row that breaks is a result too)."""
    epoch = _epoch(args)
    try:
        result = train_row(args.row, epoch)
    except Exception as e:
        result = {"row": args.row, "error": gpu_ort._causes(e)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=gpu_ort._json_default) + "\n")
    tmp.replace(args.out)
    return 0


def compare(rows: list[dict]) -> dict:
    """The rows over the steps every one of them ran: epoch times and their ratios, the steps by
    length range, bitwise equality of losses (and of the final state where every row finished)."""
    by_row = {r["row"]: r for r in rows}
    failed = [r["row"] for r in rows if "error" in r]
    if failed:
        return {"complete": False, "failed_rows": failed}
    common = min(r["steps_done"] for r in rows)
    for r in rows:  # the compared prefix (mimose's helpers read these keys)
        r["per_step"], r["losses"] = r["per_step"][:common], r["losses"][:common]
        r["epoch_s"] = sum(s["wall_s"] for s in r["per_step"])
        r["run_s_total"] = sum(s["run_s"] for s in r["per_step"])
        r["prepare_s_total"] = sum(s["prepare_s"] for s in r["per_step"])
        r["recomputed_nodes_run"] = sum(s["recomputed_nodes"] for s in r["per_step"])
    same_state = all(r["complete"] for r in rows)
    reference = by_row["unplanned"]
    for r in rows:
        r["losses_bitwise_equal"] = r["losses"] == reference["losses"]
        r["state_bitwise_equal"] = r["state_digest"] == reference["state_digest"] if same_state else None
    static, aware = by_row["static"], by_row["input_aware"]
    speedup = static["epoch_s"] / aware["epoch_s"] if common else None
    return {
        "complete": same_state, "steps_compared": common,
        "speedup_epoch": speedup,
        "speedup_run": static["run_s_total"] / aware["run_s_total"] if common else None,
        # over the steps where neither planned row made a new plan (no session creation)
        "speedup_run_existing_plans": _ratio(mimose._sum_where_neither_planned(by_row, "static"),
                                             mimose._sum_where_neither_planned(by_row, "input_aware")),
        "speedup_ceiling_epoch": static["epoch_s"] / reference["epoch_s"] if common else None,
        "policies_bitwise_equal": static["losses"] == aware["losses"] and (
            static["state_digest"] == aware["state_digest"] if same_state else True),
        "all_bitwise_equal": all(r["losses_bitwise_equal"] and r["state_bitwise_equal"] is not False for r in rows),
        "all_within_budget": all(r["within_budget"] is True for r in (static, aware)),
        "by_length": mimose._by_length(by_row) if common else [],
        "by_epoch": _by_epoch(by_row),
        "target_speedup": TARGET_SPEEDUP,
        "target_met": speedup is not None and speedup >= TARGET_SPEEDUP,
    }


def _by_epoch(by_row: dict) -> list[dict]:
    """Per pass over the batches (within the compared steps): each row's seconds and preparation,
    and static over input-aware. From the second pass on every length is prepared: what is left
    is the plans' run time, as over a long training run."""
    passes = sorted({s["epoch"] for s in by_row["unplanned"]["per_step"]})
    result = []
    for index in passes:
        steps = {row: [s for s in r["per_step"] if s["epoch"] == index] for row, r in by_row.items()}
        epoch_s = {row: sum(s["wall_s"] for s in v) for row, v in steps.items()}
        result.append({"epoch": index, "steps": len(steps["unplanned"]), "epoch_s": epoch_s,
                       "prepare_s": {row: sum(s["prepare_s"] for s in v) for row, v in steps.items()},
                       "speedup_epoch": _ratio(epoch_s["static"], epoch_s["input_aware"]),
                       "speedup_ceiling_epoch": _ratio(epoch_s["static"], epoch_s["unplanned"])})
    return result


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run(args, log=print) -> int:
    """Every row in its own process, the unplanned one first; then the comparison, a table and
    ``OUT/gpu_ort_mimose_<device>.json``."""
    share = dataclasses.replace(_epoch(args), time_limit_s=args.time_limit / len(ROWS))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in ROWS:
        log(f"{row}: bert {share.config}, {share.steps} steps, up to {share.time_limit_s:.0f} s")
        rows.append(spawn_row(row, share, args.out, log))
    result = {"benchmark": RESULT_PREFIX, "model": f"bert-{share.config}", "device": args.device,
              "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(share).items()},
                           "lengths": f"{mimose.MIN_LENGTH}..{mimose.MAX_LENGTH}, first step the longest",
                           "epoch_s": "sum of step wall times (run + preparation of new lengths)"},
              "lengths": mimose.lengths_for(share.steps, share.seed)}
    result.update(compare(rows))
    result["rows"] = rows
    out_path = args.out / f"{RESULT_PREFIX}_{gpu_ort._device_name(args.device)}.json"
    out_path.write_text(json.dumps(result, indent=1, default=gpu_ort._json_default) + "\n")
    for line in table(result):
        log(line)
    log(f"wrote {out_path}")
    return 0


def table(result: dict) -> list[str]:
    """The rows, the ratios and the epoch by length range, as text lines."""
    lines = [f"{result['model']} on {result['device']}: {result.get('steps_compared', 0)} steps compared, "
             f"lengths {mimose.MIN_LENGTH}..{mimose.MAX_LENGTH}, budget fraction {result['settings']['budget_fraction']}",
             f"{'row':<12} {'epoch s':>8} {'run s':>8} {'prep s':>7} {'recomputed':>10} {'sessions':>8} "
             f"{'peak MiB':>9} {'budget MiB':>10} {'within':>6} {'bitwise':>7}"]
    for r in result["rows"]:
        if "error" in r or "epoch_s" not in r:
            lines.append(f"{r['row']:<12} " + (f"error: {r['error']}" if "error" in r else
                                                f"{r['steps_done']} steps, not compared"))
            continue
        budget = f"{r['budget_bytes'] / 2**20:.1f}" if r["budget_bytes"] is not None else "-"
        peak = f"{r['peak_device_bytes'] / 2**20:.1f}" if r["peak_device_bytes"] is not None else "-"
        lines.append(f"{r['row']:<12} {r['epoch_s']:>8.2f} {r['run_s_total']:>8.2f} {r['prepare_s_total']:>7.2f} "
                     f"{r['recomputed_nodes_run']:>10} {r['block_sessions']:>8} {peak:>9} {budget:>10} "
                     f"{str(r['within_budget']):>6} {str(r['losses_bitwise_equal']):>7}")
    if result.get("speedup_epoch") is None:
        return lines + ["no comparison: " + (", ".join(result.get("failed_rows", [])) or "no step ran") + " failed"]
    lines.append(f"static / input-aware: epoch {result['speedup_epoch']:.3f}x (target >= {TARGET_SPEEDUP}: "
                 f"{'met' if result['target_met'] else 'NOT met'}), run {result['speedup_run']:.3f}x, run where "
                 f"neither made a new plan {_num(result['speedup_run_existing_plans'])}x; ceiling (static / unplanned) "
                 f"{result['speedup_ceiling_epoch']:.3f}x; policies bitwise equal {result['policies_bitwise_equal']}")
    for r in result["by_epoch"]:
        e = r["epoch_s"]
        lines.append(f"  pass {r['epoch'] + 1} over the batches: {r['steps']} steps, epoch s unplanned / static / "
                     f"input-aware {e['unplanned']:.2f} / {e['static']:.2f} / {e['input_aware']:.2f}, "
                     f"{_num(r['speedup_epoch'])}x (preparation {r['prepare_s']['input_aware']:.2f} s input-aware)")
    for r in result["by_length"]:
        if r["steps"]:
            e, n = r["epoch_s"], r["recomputed_nodes_per_step"]
            lines.append(f"  lengths {r['lengths'][0]}-{r['lengths'][1]}: {r['steps']} steps, epoch s unplanned / "
                         f"static / input-aware {e['unplanned']:.2f} / {e['static']:.2f} / {e['input_aware']:.2f}, "
                         f"{r['speedup_epoch']:.2f}x; recomputed nodes per step {n['static']} / {n['input_aware']}")
    return lines


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _epoch(args) -> Epoch:
    return Epoch(graphs=args.graphs, config=args.config, device=args.device, steps=args.steps, seed=args.seed,
                 budget_fraction=args.budget_fraction, time_limit_s=args.time_limit, batch=args.batch,
                 epochs=args.epochs)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_ort_mimose", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export_parser = sub.add_parser("export", help="export bert's step, sequence axis dynamic (here)")
    export_parser.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
    export_parser.add_argument("--config", default="small")
    for command in ("run", "row"):
        p = sub.add_parser(command, help="every row, one process each" if command == "run" else "one row, this process")
        p.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
        p.add_argument("--config", default="small")
        p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"batches in the epoch (default {DEFAULT_STEPS})")
        p.add_argument("--batch", type=int, default=None, help="batch size (default: the config's)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--epochs", type=int, default=1,
                       help="passes over the same batches (default 1; the second on runs every length prepared)")
        p.add_argument("--budget-fraction", type=float, default=None,
                       help="of the unplanned peak at the longest length (default: the CPU benchmark's, "
                            + ", ".join(f"{c} {f}" for c, f in BUDGET_FRACTIONS.items()) + ")")
        p.add_argument("--time-limit", type=float, default=240.0,
                       help="seconds, shared by the rows (run) or this row's; a row stops its epoch there")
        if command == "row":
            p.add_argument("--row", required=True, choices=ROWS)
            p.add_argument("--out", type=Path, required=True, help="the row's JSON file")
        else:
            p.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("%Y-%m-%d"))
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser, args) -> None:
    """One line (exit 2) for an argument that cannot run."""
    if args.command == "export":
        return
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.budget_fraction is None:
        if args.config not in BUDGET_FRACTIONS:
            parser.error(f"--budget-fraction is needed for config {args.config!r} (known: {', '.join(BUDGET_FRACTIONS)})")
        args.budget_fraction = BUDGET_FRACTIONS[args.config]
    if not 0 < args.budget_fraction < 1:
        parser.error(f"--budget-fraction must be between 0 and 1, got {args.budget_fraction}")
    if not args.time_limit > 0:
        parser.error(f"--time-limit must be positive, got {args.time_limit}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "run" and args.device == "cuda":
        from ort_offload.errors import UnknownDeviceError
        from ort_offload.runtime.device_backend import check_cuda

        try:
            check_cuda(0)
        except UnknownDeviceError as e:
            print(f"gpu_ort_mimose: {e}", file=sys.stderr)
            return 2
    if args.command == "export":
        export(args.graphs, args.config)
        return 0
    if args.command == "row":
        return run_row(args)
    return run(args, log=lambda text: print(text, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
