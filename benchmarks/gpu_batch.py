"""Largest batch that trains at one fixed device budget: ours against torch eager, torch per-layer
checkpointing and torch's ``save_on_cpu`` (issue 22, item 7).

Two phases, as ``benchmarks.gpu_ort`` (the lent GPU machine has another torch and no network):

    python -m benchmarks.gpu_batch export --graphs .gpu-graphs             # here
    python3 -m benchmarks.gpu_batch run --graphs .gpu-graphs --budget 4GiB --out $OUT   # there

``export`` writes gpt (and cnn) ``medium``'s training step, the same files as ``gpu_ort
export``. Batch (and sequence) are dynamic axes of that graph, so one file serves every batch:
each try of ours plans the graph for its batch. ``run`` searches, per model and method, the
largest batch that trains ``--steps`` steps at ``--budget`` bytes, every try in its own process
(a fresh CUDA context, and ORT's CUDA arenas keep their high-water mark for a process's life):

- ``torch_eager``, ``torch_checkpoint`` (``torch.utils.checkpoint`` around every layer,
  non-reentrant) and ``torch_save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``
  around the forward): fp32, TF32 off, AdamW, the caching allocator capped with
  ``torch.cuda.set_per_process_memory_fraction(budget / total memory)``. A try fits when its steps
  run without running out of memory; its peak is ``torch.cuda.max_memory_reserved`` (what the cap
  limits; the CUDA context is outside it).
- ``ours_auto`` (``ours_swap``, ``ours_recompute``): ``set_offload_device(device, budget=BYTES)``
  and an ``OrtTrainer`` over the exported graph with those passes. A try fits when it plans (no
  ``BudgetTooSmallError``), trains the steps, and the report's ``peak_device_bytes`` (the device's
  own counter on CUDA, less the fixed overhead measured at device creation) is within the budget
  (``--ours-fit plan`` drops that last condition).

The search doubles from ``--start-batch`` (ours: from twice torch checkpointing's largest batch,
the acceptance target, when that row found one) up to ``--max-batch``, halves down to 1 if the
start does not fit, then bisects until the gap is at most ``--resolution`` of the batch found,
within ``--max-tries`` tries per method and a share of ``--time-limit``. Rows (one per model and
method: largest batch, step time and peak bytes at it, every try) go to a table and to
``OUT/gpu_batch_<device>.json``, written after every row.

``--device cpu`` runs the same code path on the CPU (use ``--config tiny``): it checks the code
only. torch's cap cannot be enforced there (no per-process limit for the CPU allocator), so
torch's rows "fit" up to the largest batch tried and carry no peak; ours is capped by its arena.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt",)
TORCH_METHODS = {"torch_eager": "eager", "torch_checkpoint": "checkpoint", "torch_save_on_cpu": "save_on_cpu"}
OURS_METHODS = {"ours_auto": "auto", "ours_swap": "swap", "ours_recompute": "recompute"}
METHODS = tuple(TORCH_METHODS) + tuple(OURS_METHODS)
# torch checkpointing first: it is the reference of the acceptance (ours >= 2x its largest batch),
# and ours starts its search from twice it. swap and recompute alone: on request (time).
DEFAULT_METHODS = ("torch_checkpoint", "ours_auto", "torch_eager", "torch_save_on_cpu")
# Shares of the time limit: a try of ours takes longer (plan, block sessions) than torch's.
METHOD_WEIGHT = {**{m: 2.0 for m in OURS_METHODS}, **{m: 1.0 for m in TORCH_METHODS}}
REFERENCE_METHOD = "torch_checkpoint"
TARGET_RATIO = 2.0
LR = 1e-3
RESULT_PREFIX = "RESULT "


# ---- the search (pure) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SearchLimits:
    start: int
    limit: int
    max_tries: int
    resolution: float  # bisection stops when first failing - largest fitting <= resolution * largest


def search_largest(fits: Callable[[int], bool | None], limits: SearchLimits,
                   may_try: Callable[[], bool] = lambda: True) -> dict:
    """Largest batch in [1, limit] for which ``fits`` holds, assuming fitting is monotone: doubling
    from ``start`` (the limit itself when a doubling would pass it), halving down to 1 when the
    start does not fit, then bisection. ``may_try()`` false (time spent) or ``fits`` returning
    None (a try cut short) stops it early."""
    tried: list[int] = []

    def attempt(batch: int) -> bool | None:
        if len(tried) >= limits.max_tries or not may_try():
            return None
        tried.append(batch)
        return fits(batch)  # None: the try was cut short, the search stops

    good, bad, stopped = 0, None, False
    batch = min(max(1, limits.start), limits.limit)
    while True:  # doubling (or halving while nothing fitted)
        ok = attempt(batch)
        if ok is None:
            stopped = True
            break
        if ok:
            good = batch
            if batch >= limits.limit:
                break
            batch = min(batch * 2, limits.limit)
            if bad is not None and batch >= bad:
                break
        else:
            bad = batch
            if good or batch == 1:
                break
            batch //= 2
    while not stopped and good and bad is not None and bad - good > max(1, int(limits.resolution * good)):
        mid = (good + bad) // 2
        ok = attempt(mid)
        if ok is None:
            stopped = True
        elif ok:
            good = mid
        else:
            bad = mid
    return {"largest_batch": good or None, "first_failing_batch": bad, "capped": good >= limits.limit,
            "search_complete": not stopped, "batches_tried": tried}


# ---- one try, in its own process ---------------------------------------------------------------


def _oom_types():
    import torch

    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                 if t is not None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _causes(error: BaseException) -> str:
    lines = []
    while error is not None and len(lines) < 4:
        lines.append(_first_line(error))
        error = error.__cause__ or error.__context__
    return " <- ".join(lines)


def _device_facts(device: str) -> dict:
    if device != "cuda":
        return {"device_name": "cpu", "device_total_bytes": None}
    import torch

    return {"device_name": torch.cuda.get_device_name(0),
            "device_total_bytes": torch.cuda.get_device_properties(0).total_memory}


def _sdpa_context(attention: str):
    if attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def torch_try(args) -> dict:
    """torch trains ``args.steps`` steps of the model at ``args.batch`` under the capped allocator."""
    import torch

    from benchmarks.peers import wrap_layers
    from models import get_model
    from ort_offload.export import optimizers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    variant = TORCH_METHODS[args.method]
    cuda = args.device == "cuda"
    facts = _device_facts(args.device)
    if cuda:
        fraction = min(1.0, args.budget / facts["device_total_bytes"])
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    spec = get_model(args.model, args.config)
    batches = [spec.make_batch(args.batch, seed=k) for k in range(args.steps)]
    device = "cuda" if cuda else "cpu"
    try:
        model = wrap_layers(spec.model, "checkpoint" if variant == "checkpoint" else "eager").to(device)
        model.train()
        optimizer = optimizers.make_optimizer("adamw", lr=LR).torch_optimizer(model.parameters())
        times, losses = [], []
        for inputs, targets in batches:
            inputs, targets = [t.to(device) for t in inputs], [t.to(device) for t in targets]
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            saving = (torch.autograd.graph.save_on_cpu(pin_memory=cuda) if variant == "save_on_cpu"
                      else contextlib.nullcontext())
            with _sdpa_context(args.torch_attention):
                with saving:
                    loss = spec.loss_fn(model(*inputs), *targets)
                loss.backward()
            optimizer.step()
            losses.append(float(loss.item()))  # waits for the step
            times.append(time.perf_counter() - started)
    except _oom_types() as e:
        return {**facts, "fits": False, "why": "out of memory: " + _first_line(e)}
    except RuntimeError as e:  # cuBLAS/cuDNN failing to allocate inside the cap is out of memory too
        text = str(e)
        if "out of memory" in text.lower() or "ALLOC_FAILED" in text:
            return {**facts, "fits": False, "why": "out of memory: " + _first_line(e)}
        raise
    peak = torch.cuda.max_memory_reserved(0) if cuda else None
    return {**facts, "fits": True, "losses": losses, "step_time_s_median": statistics.median(times[1:] or times),
            "peak_bytes": peak, "peak_allocated_bytes": torch.cuda.max_memory_allocated(0) if cuda else None,
            "within_budget": None if peak is None else peak <= args.budget}


def ours_try(args) -> dict:
    """Our trainer plans the exported graph for ``args.batch`` under the budget and trains."""
    import onnx

    import ort_offload
    from graph_passes.ir.training_graph import TrainingGraph
    from models import get_model
    from ort_offload.errors import BudgetTooSmallError
    from ort_offload.export.training_step import initial_state
    from ort_offload.trainer import OrtTrainer, resolve_passes

    spec = get_model(args.model, args.config)
    graph = TrainingGraph.from_model(onnx.load(args.graphs / f"{args.model}-{args.config}.onnx"), name=args.model)
    state = initial_state(graph, spec.model, lr=LR, step=1)
    names = spec.input_names + spec.target_names
    feeds = []
    for k in range(args.steps):
        inputs, targets = spec.make_batch(args.batch, seed=k)
        feeds.append({n: t.numpy() for n, t in zip(names, inputs + targets)})
    facts = _device_facts(args.device)
    device = ort_offload.set_offload_device(args.device, budget=args.budget, async_swap_outs=True)
    try:
        trainer = OrtTrainer(device, graph, initial_state=state, example_batch=feeds[0],
                             input_names=spec.input_names, target_names=spec.target_names,
                             passes=resolve_passes(OURS_METHODS[args.method]))
    except BudgetTooSmallError as e:
        return {**facts, "fits": False, "why": "does not plan: " + _first_line(e)}
    try:
        for feed in feeds:
            trainer.step(*(feed[n] for n in trainer.batch_names))
    except Exception as e:  # out of device memory, or anything else: it does not train
        return {**facts, "fits": False, "why": "failed while training: " + _causes(e)}
    report = trainer.report()
    times = list(trainer.runner.step_times_s)
    within = report["within_budget"] is True
    return {**facts, "fits": within or args.ours_fit == "plan", "losses": report["losses"],
            "why": None if within else "trained, but the device counter passed the budget",
            "step_time_s_median": statistics.median(times[1:] or times), "peak_bytes": report["peak_device_bytes"],
            "within_budget": report["within_budget"], "passes": report["passes"],
            "swap_in_bytes": report["swap_in_bytes"], "recomputed_nodes": report["recomputed_nodes"],
            "device_overhead_bytes": report.get("device_overhead_bytes")}


def run_try(args) -> int:
    """The ``try`` command: one result line (``RESULT {json}``) on stdout."""
    started = time.perf_counter()
    try:
        result = (torch_try if args.method in TORCH_METHODS else ours_try)(args)
    except Exception as e:  # a try that breaks is a result too
        result = {"fits": False, "why": "error: " + _causes(e), "error": True}
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0


# ---- the search over processes -----------------------------------------------------------------


def spawn_try(args, model: str, method: str, batch: int, timeout_s: float) -> dict:
    """One try in a fresh process: its result, or why there is none."""
    command = [sys.executable, "-m", "benchmarks.gpu_batch", "try", "--method", method, "--models", model,
               "--batch", str(batch), "--budget", str(args.budget), "--device", args.device, "--config", args.config,
               "--steps", str(args.steps), "--graphs", str(args.graphs.resolve()), "--torch-attention", args.torch_attention,
               "--ours-fit", args.ours_fit]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return {"batch": batch, "fits": False, "why": f"timeout: stopped after {timeout_s:.0f} s", "timeout": True,
                "seconds": round(time.perf_counter() - started, 2)}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:  # the process died (killed for memory, a crash in native code)
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"batch": batch, "fits": False, "why": f"the try's process exited {done.returncode}: {tail}",
                "error": True, "seconds": round(time.perf_counter() - started, 2)}
    return {"batch": batch, **json.loads(lines[-1][len(RESULT_PREFIX):])}


def search_method(args, model: str, method: str, start: int, deadline: float, log) -> dict:
    """The largest batch of one method: tries in their own processes until the deadline."""
    tries: list[dict] = []

    def fits(batch: int) -> bool | None:
        left = min(args.try_timeout, args.ends - time.perf_counter())
        tries.append(spawn_try(args, model, method, batch, left))
        t = tries[-1]
        verdict = "stopped" if t.get("timeout") else "fits" if t["fits"] else "no"
        log(f"  {model} {method} batch {batch}: {verdict} ({t.get('seconds')} s)" + (f" {t['why']}" if t.get("why") else ""))
        return None if t.get("timeout") else bool(t["fits"])  # a try cut short says nothing

    limits = SearchLimits(start=start, limit=args.max_batch, max_tries=args.max_tries, resolution=args.resolution)
    found = search_largest(fits, limits, may_try=lambda: time.perf_counter() < deadline)
    best = next((t for t in tries if t["batch"] == found["largest_batch"] and t["fits"]), {})
    trained = [t["batch"] for t in tries if "losses" in t]
    return {"model": model, "config": args.config, "method": method, "budget_bytes": args.budget,
            "device": args.device_name or args.device, "start_batch": start,
            "largest_batch": found["largest_batch"], "step_time_s_median": best.get("step_time_s_median"),
            "peak_bytes": best.get("peak_bytes"), "within_budget": best.get("within_budget"),
            "largest_trained_batch": max(trained, default=None) if method in OURS_METHODS else None,
            "first_failing_batch": found["first_failing_batch"], "capped": found["capped"],
            "search_complete": found["search_complete"], "steps": args.steps,
            "torch_attention": args.torch_attention if method in TORCH_METHODS else None,
            "tries": tries}


def run_model(args, model: str, rows: list, out_path: Path, log) -> None:
    """Every method of one model, each with its share (``METHOD_WEIGHT``) of the time left."""
    methods = list(args.methods)
    for k, method in enumerate(methods):
        now = time.perf_counter()
        if now >= args.ends:
            _emit(rows, out_path, {"model": model, "config": args.config, "method": method, "budget_bytes": args.budget,
                                   "largest_batch": None, "skipped": "time limit", "tries": []}, log)
            continue
        weights = [METHOD_WEIGHT.get(m, 1.0) for m in methods[k:]]
        share = (args.ends - now) * weights[0] / sum(weights) / args.models_left
        start = args.start_batch
        reference = next((r for r in rows if r["model"] == model and r["method"] == REFERENCE_METHOD), None)
        if method in OURS_METHODS and reference and reference.get("largest_batch"):
            start = min(int(TARGET_RATIO * reference["largest_batch"]), args.max_batch)
        row = search_method(args, model, method, start, now + share, log)
        if args.device_name is None:
            args.device_name = next((t.get("device_name") for t in row["tries"] if t.get("device_name")), None)
            row["device"] = args.device_name or args.device
        _emit(rows, out_path, row, log)
    _compare(rows, model)
    out_path.write_text(json.dumps(rows, indent=1, default=str) + "\n")


def _compare(rows: list, model: str) -> None:
    """Each row's largest batch over torch checkpointing's (the acceptance: ours >= 2x)."""
    mine = [r for r in rows if r["model"] == model]
    reference = next((r for r in mine if r["method"] == REFERENCE_METHOD), None)
    base = reference.get("largest_batch") if reference else None
    for row in mine:
        ratio = row["largest_batch"] / base if base and row.get("largest_batch") else None
        row["vs_torch_checkpoint"] = ratio
        if row["method"] in OURS_METHODS:
            row["target_vs_torch_checkpoint"] = TARGET_RATIO
            row["target_met"] = None if ratio is None else ratio >= TARGET_RATIO


def _emit(rows: list, out_path: Path, row: dict, log) -> None:
    rows.append(row)
    out_path.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    log(_line(row))


def _line(row: dict) -> str:
    def num(value, scale=1.0, digits=4):
        return "-" if value is None else f"{value / scale:.{digits}g}"

    largest = row.get("largest_batch")
    shown = f"{'>=' if row.get('capped') else ''}{largest}" if largest else (row.get("skipped") or "none")
    return (f"{row['model']:4} {row['method']:18} largest {shown:>8}  step {num(row.get('step_time_s_median'), 1e-3)} ms"
            f"  peak {num(row.get('peak_bytes'), 2**30)} GiB  x ckpt {num(row.get('vs_torch_checkpoint'), 1, 3)}"
            f"  tries {len(row.get('tries', []))}{'' if row.get('search_complete', True) else ' (cut short)'}")


def run(args, log=print) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    args.started = time.perf_counter()
    args.ends = args.started + args.time_limit
    args.device_name = None
    rows: list = []
    partial = args.out / "gpu_batch_partial.json"
    models = args.models.split(",")
    for k, model in enumerate(models):
        args.models_left = len(models) - k
        run_model(args, model, rows, partial, log)
    name = (args.device_name or args.device).replace(" ", "_")
    out_path = args.out / f"gpu_batch_{name}.json"
    out_path.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    partial.unlink(missing_ok=True)
    log(f"budget {args.budget} bytes ({args.budget / 2**30:.3g} GiB), {args.steps} steps a try, "
        f"{time.perf_counter() - args.started:.0f} s")
    for row in rows:
        log(_line(row))
    log(f"wrote {out_path}")
    return 0


# ---- command line ------------------------------------------------------------------------------


def _budget_bytes(text: str) -> int:
    from ort_offload.budget import parse_budget

    budget = parse_budget(text)
    if budget is None or budget.is_fraction:
        raise argparse.ArgumentTypeError("the budget is bytes or a size (4GiB), not a fraction: the methods share it")
    return budget.nbytes


def _methods(text: str) -> tuple[str, ...]:
    names = METHODS if text == "all" else tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)} or all")
    return names


def _common(parser) -> None:
    parser.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
    parser.add_argument("--config", default="medium")
    parser.add_argument("--models", default=",".join(MODELS), help="gpt, cnn or gpt,cnn (try: one)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--budget", type=_budget_bytes, default=4 * 2**30, help="bytes or a size (default 4GiB)")
    parser.add_argument("--steps", type=int, default=3, help="steps a try trains (the first one is not timed)")
    parser.add_argument("--torch-attention", default="default", choices=("default", "math"),
                        help="torch's SDPA kernels: its own choice, or the math kernel our graphs were exported with")
    parser.add_argument("--ours-fit", default="counter", choices=("counter", "plan"),
                        help="ours fits when the device counter stays within the budget, or when it plans and trains")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_batch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export the training steps (here)")
    export.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
    export.add_argument("--config", default="medium")
    export.add_argument("--models", default=",".join(MODELS))
    run_parser = sub.add_parser("run", help="search the largest batch of every method")
    _common(run_parser)
    run_parser.add_argument("--methods", type=_methods, default=DEFAULT_METHODS, help="comma list, or all")
    run_parser.add_argument("--start-batch", type=int, default=8)
    run_parser.add_argument("--max-batch", type=int, default=1024)
    run_parser.add_argument("--max-tries", type=int, default=7, help="per method")
    run_parser.add_argument("--resolution", type=float, default=0.125)
    run_parser.add_argument("--time-limit", type=float, default=220.0, help="seconds for the whole run")
    run_parser.add_argument("--try-timeout", type=float, default=90.0, help="seconds for one try's process")
    run_parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / time.strftime("%Y-%m-%d"))
    one = sub.add_parser("try", help="one try, in this process (run starts these)")
    _common(one)
    one.add_argument("--method", required=True, choices=METHODS)
    one.add_argument("--batch", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "try":
        args.model = args.models
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "export":
        from benchmarks.gpu_ort import export_graphs

        export_graphs(args.graphs, args.config, models=tuple(args.models.split(",")))
        return 0
    if args.command == "try":
        return run_try(args)
    return run(args, log=lambda text: print(text, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
