"""The CUDA device measured on a GPU: ours against one plain ORT CUDA session and torch eager.

Two phases, because the lent GPU machine has another torch and no network:

    python -m benchmarks.gpu_ort export --graphs .gpu-graphs            # here: export the steps
    python -m benchmarks.gpu_ort run --graphs .gpu-graphs --out DIR     # there: measure

``export`` writes each model's training step (``gpt``/``cnn``, config ``medium``) as an ONNX
file with its roles; parameters are graph inputs, so the files are small. ``run`` rebuilds the
torch model from the zoo (same seed, same initial values), and for each model measures, in one
process on one device:

- torch eager (fp32, TF32 off): step time and losses;
- one plain ORT CUDA session of the whole graph (deterministic kernels, graph optimizations
  off, as our blocks run): step time and first loss;
- ours at unlimited, 0.5x and 0.25x with swap, recompute and auto: step time, losses, the
  budget's accounting and the device counter, bitwise equality to our unplanned run, and the
  simulator's step time for the device's profile.

Rows go to a table and ``DIR/gpu_ort_<device>.json`` (one object per row, written after every
row, so a run cut short keeps what it measured). ``--time-limit`` skips rows once spent.
``--device cpu --config tiny`` runs the same script on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

MODELS = ("gpt", "cnn")
# Our rows per model, smallest budget first: ORT's shared CUDA arena keeps its high-water mark
# for the life of the process, so a row after a larger one would be charged that one's
# workspace. The unlimited row (last) is the bitwise reference.
# A row is "budget:passes[:keep]" (block sessions release their ORT workspace after each run,
# the CUDA device's default; "keep": they keep it, as ORT does by default). A second unlimited
# row checks that two runs of the same plan are bitwise equal.
ROWS = {
    "gpt": ("0.25x:swap", "0.5x:swap", "0.5x:recompute", "0.25x:auto", "unlimited:none", "unlimited:none"),
    "cnn": ("0.5x:swap", "unlimited:none", "unlimited:none"),
}
TIME_SHARE = {"gpt": 0.62, "cnn": 0.38}  # of --time-limit, per model process
LR = 1e-3


def export_graphs(directory: Path, config: str, models=MODELS, *, use_cache: bool = False) -> None:
    """Each model's training step as ``directory/<model>-<config>.onnx`` (``use_cache``: through
    the export cache, as the tests do; a GPU run's files are exported afresh)."""
    from models import get_model
    from ort_offload.export.training_step import export_training_step

    directory.mkdir(parents=True, exist_ok=True)
    for name in models:
        spec = get_model(name, config)
        inputs, targets = spec.make_batch()
        started = time.perf_counter()
        result = export_training_step(
            spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
            optimizer="adamw", input_names=spec.input_names, target_names=spec.target_names,
            dynamic_axes=spec.dynamic_axes, name=name, use_cache=use_cache,
        )
        path = result.graph.save(directory / f"{name}-{config}.onnx")
        print(f"{name} {config}: {len(result.graph.graph.node)} nodes, {path.stat().st_size} bytes, "
              f"{time.perf_counter() - started:.1f} s", flush=True)


@dataclasses.dataclass
class Case:
    """One model: its graph, initial state, batches and torch module."""

    name: str
    graph: object
    spec: object
    state: dict
    batches: list  # [(inputs tuple, targets tuple)]

    def feeds(self, step: int) -> dict:
        inputs, targets = self.batches[step]
        names = self.spec.input_names + self.spec.target_names
        return {n: t.numpy() for n, t in zip(names, inputs + targets)}


def load_case(directory: Path, name: str, config: str, steps: int) -> Case:
    import onnx

    from graph_passes.ir.training_graph import TrainingGraph
    from models import get_model
    from ort_offload.export.training_step import initial_state

    spec = get_model(name, config)
    graph = TrainingGraph.from_model(onnx.load(directory / f"{name}-{config}.onnx"), name=name)
    batches = [spec.make_batch(seed=step) for step in range(steps)]
    return Case(name, graph, spec, initial_state(graph, spec.model, lr=LR, step=1), batches)


def torch_eager(case: Case, device: str) -> dict:
    """Plain torch training of the same model on the device: losses and step times."""
    import torch

    from ort_offload.export import optimizers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = case.spec.model.to(device)
    model.train()
    optimizer = optimizers.make_optimizer("adamw", lr=LR).torch_optimizer(model.parameters())
    losses, times = [], []
    for inputs, targets in case.batches:
        inputs = [t.to(device) for t in inputs]
        targets = [t.to(device) for t in targets]
        _sync(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = case.spec.loss_fn(model(*inputs), *targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    model.to("cpu")
    return {"losses": losses, "step_time_s_median": statistics.median(times[1:] or times), "torch_peak_bytes": peak}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def plain_session(case: Case, device: str) -> dict:
    """The whole step as one ORT session (CUDA EP or CPU EP), inputs bound on the device."""
    import onnxruntime as ort

    from ort_offload.export import optimizers
    from ort_offload.runtime.block_session import default_session_options

    options = default_session_options(intra_op_threads=0, spinning=False)
    if device.startswith("cuda"):
        from ort_offload.runtime.device_backend import cuda_provider_options

        providers = [("CUDAExecutionProvider", cuda_provider_options(0, None)), "CPUExecutionProvider"]
        where = "cuda"
    else:
        providers, where = ["CPUExecutionProvider"], "cpu"
    session = ort.InferenceSession(case.graph.model.SerializeToString(), options, providers=providers)
    loss_name = case.graph.step_fetches[0]
    times, losses, bindings = [], [], []
    state = {n: ort.OrtValue.ortvalue_from_numpy(v, where, 0) for n, v in case.state.items()}
    for step in range(len(case.batches)):
        state[optimizers.STEP_INPUT] = ort.OrtValue.ortvalue_from_numpy(np.array(step + 1, np.float32), where, 0)
        binding = session.io_binding()
        bindings.append(binding)  # its outputs feed the next step: it must outlive it
        for n, v in state.items():
            binding.bind_ortvalue_input(n, v)
        for n, v in case.feeds(step).items():
            binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(v, where, 0))
        for output in session.get_outputs():
            binding.bind_output(output.name, where, 0)
        binding.synchronize_inputs()
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - started)
        outputs = dict(zip([o.name for o in session.get_outputs()], binding.get_outputs()))
        losses.append(float(outputs[loss_name].numpy()))
        for old, new in case.graph.state_pairs.items():  # updated state feeds the next step
            state[old] = outputs[new]
    return {"losses": losses, "step_time_s_median": statistics.median(times[1:] or times)}


@dataclasses.dataclass(frozen=True)
class Row:
    """One of our rows: a budget (None: unlimited), a pass set, and device options ("keep":
    block sessions keep their ORT workspace; "sync": every block run and copy waited for as
    issued, the diagnostic of ``ORT_OFFLOAD_CUDA_SYNC``)."""

    budget: str | None
    passes: str
    shrink: bool = True
    sync: bool = False

    @classmethod
    def parse(cls, text: str) -> "Row":
        budget, passes, *flags = text.split(":")
        if not set(flags) <= {"keep", "sync"}:
            raise ValueError(f"row {text!r}: use budget:passes[:keep][:sync]")
        return cls(None if budget == "unlimited" else budget, passes, "keep" not in flags, "sync" in flags)

    @property
    def label(self) -> str:
        return (f"ours {self.budget or 'unlimited'} {self.passes}" + ("" if self.shrink else " keep")
                + (" sync" if self.sync else ""))


def ours(case: Case, device_kind: str, row: Row, planning_profile: str | None,
         block_memory: bool = False) -> tuple[dict, dict]:
    """Our trainer on the device: its report with extra figures, and its final state."""
    import os

    import ort_offload
    from ort_offload.trainer import OrtTrainer, resolve_passes

    os.environ["ORT_OFFLOAD_CUDA_SYNC"] = "1" if row.sync else "0"

    budget, passes = row.budget, row.passes
    device = ort_offload.set_offload_device(device_kind, budget=budget, planning_profile=planning_profile,
                                            async_swap_outs=True, release_block_workspace=row.shrink)
    started = time.perf_counter()
    trainer = OrtTrainer(
        device, case.graph, initial_state=case.state, example_batch=case.feeds(0),
        input_names=case.spec.input_names, target_names=case.spec.target_names, passes=resolve_passes(passes),
    )
    setup_s = time.perf_counter() - started
    blocks = None
    for step in range(len(case.batches)):
        feeds = case.feeds(step)
        last = step == len(case.batches) - 1
        with BlockMemory(trainer) if last and block_memory else contextlib.nullcontext() as blocks:
            trainer.step(*(feeds[n] for n in trainer.batch_names))
    report = trainer.report()
    prepared = trainer.runner.prepared_steps()[0]
    model = prepared.model if prepared.model is not None else trainer.runner.model
    simulated = trainer.runner.planner.layouts.simulated_time(prepared.program, prepared.infos, model, trainer.runtime.budget_bytes)
    extra = {
        "setup_s": setup_s, "blocks": len(prepared.program.blocks), "simulated_step_s": simulated,
        "arena_reserved_bytes": trainer.runtime.arena.reserved_bytes,
        "planned_max_workspace_bytes": prepared.program.max_workspace_bytes,
        "step_times_s": list(trainer.runner.step_times_s),
    }
    if blocks is not None:
        extra["block_memory"] = blocks.rows(prepared.program)
    return {**report, **extra}, trainer.flat_state()


class BlockMemory:
    """The device counter per block during one step (a diagnostic of where device memory goes
    beside what plans count): a thread samples it; each block's start is marked by the
    runner's ``before_block`` hook. Rows: (block, planned workspace, arena bytes in use at its
    start, counter at its start, counter's peak until the next block starts), counter figures
    less the device's fixed overhead."""

    def __init__(self, trainer, interval_s: float = 0.0002) -> None:
        self.trainer, self.interval_s = trainer, interval_s
        self.samples: list = []
        self.starts: list = []

    def __enter__(self):
        import threading

        read = self.trainer.runtime.backend.used_bytes or (lambda: 0)
        self._read, self._stop = read, threading.Event()

        def poll():
            while not self._stop.wait(self.interval_s):
                self.samples.append((time.perf_counter(), read()))

        def mark(execution, block):
            self.starts.append((time.perf_counter(), block, execution.arena.in_use, read()))

        self.trainer.runner.before_block = mark
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.trainer.runner.before_block = None
        self.starts.append((time.perf_counter(), None, 0, self._read()))

    def rows(self, program) -> list:
        out = []
        for (start, block, in_use, at_start), (end, *_rest) in zip(self.starts, self.starts[1:]):
            peak = max([at_start] + [v for t, v in self.samples if start <= t < end])
            out.append([block, program.blocks[block].workspace_bytes, in_use, at_start, peak])
        return out


def state_differences(state: dict, reference: dict, top: int = 6) -> list:
    """The tensors of ``state`` not bitwise equal to ``reference``'s, largest difference first
    (name, max |difference|), at most ``top``; the count of all of them last."""
    differing = []
    for name, value in reference.items():
        if not np.array_equal(state[name], value):
            diff = np.abs(state[name].astype(np.float64) - value.astype(np.float64))
            differing.append((name, float(np.nanmax(diff)) if diff.size else 0.0))
    differing.sort(key=lambda item: -item[1])
    return differing[:top] + [len(differing)]


def run_model(case: Case, args, out_path: Path) -> None:
    """Our rows, then the plain session and torch eager (they leave memory behind), in this
    process; bitwise equality against the unlimited row is filled in at the end."""
    rows: list = []
    digests = {}  # our rows' final states
    if args.device == "cuda":  # the CUDA context and shared arena before anything is measured
        from ort_offload.runtime.device_backend import cuda_backend, cuda_facts

        try:
            cuda_backend(0)
            _emit(rows, out_path, {"model": case.name, "row": "cuda backend", **cuda_facts(0)})
        except Exception as e:  # our rows will say why; the references still run
            _emit(rows, out_path, {"model": case.name, "row": "cuda backend", "error": f"{type(e).__name__}: {e}"})
    for row in (Row.parse(text) for text in (args.rows.split(",") if args.rows else ROWS[case.name])):
        label = row.label
        while label in digests or any(r["row"] == label for r in rows):  # a rerun
            label += " again"
        if time.perf_counter() - args.started > args.time_limit:
            print(f"time limit reached: skipping {case.name} {label}", flush=True)
            continue
        try:
            report, digests[label] = ours(case, args.device, row, args.planning_profile, args.block_memory)
        except Exception as e:  # a row that cannot run is a result too
            _emit(rows, out_path, {"model": case.name, "row": label, "error": _causes(e)})
            continue
        finally:
            _release_device_memory(args.device)
        _emit(rows, out_path, {"model": case.name, "row": label, "budget": row.budget, "passes_asked": row.passes,
                               "release_block_workspace": row.shrink, **report})
    plain = plain_session(case, args.device)
    _release_device_memory(args.device)
    _emit(rows, out_path, {"model": case.name, "row": "plain ORT session", **plain})
    eager = torch_eager(case, "cuda" if args.device == "cuda" else "cpu")
    _emit(rows, out_path, {"model": case.name, "row": "torch eager", **eager})
    _compare(rows, digests, plain, eager)
    out_path.write_text(json.dumps(rows, indent=1, default=_json_default) + "\n")


def _causes(error: BaseException) -> str:
    """The error and what it was raised from, one line each, innermost last."""
    lines = []
    while error is not None and len(lines) < 4:
        text = str(error).strip().splitlines()
        lines.append(f"{type(error).__name__}: {text[0] if text else ''}")
        error = error.__cause__ or error.__context__
    return " <- ".join(lines)


def _release_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _compare(rows: list, digests: dict, plain: dict, eager: dict) -> None:
    """Ratios and equalities between our rows and the references, in place."""
    ours_rows = [r for r in rows if r["row"].startswith("ours") and "error" not in r]
    unlimited = next((r for r in ours_rows if r["budget"] is None), None)
    for row in ours_rows:
        step = row["step_time_s_median"]
        if unlimited is not None:
            differences = state_differences(digests[row["row"]], digests[unlimited["row"]])
            row["bitwise_vs_unplanned"] = row["losses"] == unlimited["losses"] and differences == [0]
            row["state_differences_vs_unplanned"] = differences
            row["speed_vs_unlimited"] = unlimited["step_time_s_median"] / step
        row["max_rel_loss_diff_vs_torch"] = max(abs(a - b) / max(abs(b), 1e-12)
                                                for a, b in zip(row["losses"], eager["losses"]))
        plain_first = plain["losses"][0]
        row["first_loss_rel_diff_vs_plain"] = abs(row["losses"][0] - plain_first) / max(abs(plain_first), 1e-12)
        row["plain_over_ours"] = plain["step_time_s_median"] / step
        row["eager_over_ours"] = eager["step_time_s_median"] / step
        row["simulated_over_measured"] = row["simulated_step_s"] / step
        if row["budget_bytes"] is not None and row["peak_device_bytes"] is not None:
            row["measured_within_budget"] = row["peak_device_bytes"] <= row["budget_bytes"]


def _emit(rows: list, out_path: Path, row: dict) -> None:
    rows.append(row)
    out_path.write_text(json.dumps(rows, indent=1, default=_json_default) + "\n")
    print(_line(row), flush=True)


TABLE_KEYS = ("device_overhead_bytes", "shared_cuda_arena", "ep_devices", "step_time_s_median", "peak_device_bytes", "accounted_peak_bytes", "budget_bytes", "blocks",
              "block_sessions", "device_session_bytes", "measured_within_budget",
              "bitwise_vs_unplanned", "max_rel_loss_diff_vs_torch", "speed_vs_unlimited", "plain_over_ours",
              "eager_over_ours", "simulated_over_measured", "setup_s", "error")


def _line(row: dict) -> str:
    shown = " ".join(f"{k}={_short(row[k])}" for k in TABLE_KEYS if k in row)
    return f"{row['model']:4} {row['row']:24} {shown}"


def _short(value):
    return f"{value:.4g}" if isinstance(value, float) else value


def _json_default(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_ort", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export the training steps (here)")
    export.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
    export.add_argument("--config", default="medium")
    for command in ("run", "model"):
        run = sub.add_parser(command, help="measure every model, one process each" if command == "run"
                             else "measure one model in this process")
        run.add_argument("--graphs", type=Path, default=Path(".gpu-graphs"))
        run.add_argument("--config", default="medium")
        run.add_argument("--models", default=",".join(MODELS))
        run.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        run.add_argument("--steps", type=int, default=6)
        run.add_argument("--time-limit", type=float, default=400.0, help="seconds; later rows are skipped")
        run.add_argument("--planning-profile", default=None, help="plan on this profile (default: the device's)")
        run.add_argument("--rows", default=None, help="our rows, e.g. 0.5x:swap,unlimited:none (default: ROWS)")
        run.add_argument("--block-memory", action="store_true", help="the device counter per block of the last step")
        run.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("%Y-%m-%d"))
    args = parser.parse_args(argv)
    if args.command == "export":
        export_graphs(args.graphs, args.config)
        return 0
    args.started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "model":
        case = load_case(args.graphs, args.models, args.config, args.steps)
        run_model(case, args, args.out / f"rows_{args.models}.json")
        return 0
    return run_all(args)


def run_all(args) -> int:
    """One process per model (each starts with a fresh device), then one JSON and a table."""
    import subprocess
    import sys

    rows = []
    for name in args.models.split(","):
        limit = args.time_limit * TIME_SHARE.get(name, 0.5)
        command = [sys.executable, "-m", "benchmarks.gpu_ort", "model", "--models", name, "--graphs", str(args.graphs),
                   "--config", args.config, "--device", args.device, "--steps", str(args.steps),
                   "--time-limit", str(limit), "--out", str(args.out)]
        if args.planning_profile:
            command += ["--planning-profile", args.planning_profile]
        if args.rows:
            command += ["--rows", args.rows]
        if args.block_memory:
            command += ["--block-memory"]
        try:
            subprocess.run(command, timeout=limit + 120, check=False)
        except subprocess.TimeoutExpired:
            print(f"{name}: the model's process ran past {limit + 120:.0f} s and was stopped", flush=True)
        part = args.out / f"rows_{name}.json"
        if part.exists():
            rows += json.loads(part.read_text())
            part.unlink()
    out_path = args.out / f"gpu_ort_{_device_name(args.device)}.json"
    out_path.write_text(json.dumps(rows, indent=1, default=_json_default) + "\n")
    print("\n".join(_line(row) for row in rows))
    print(f"wrote {out_path}")
    return 0


def _device_name(kind: str) -> str:
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(0).replace(" ", "_")
    return "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
