"""Model-zoo regression (``ort-offload zoo``): every zoo graph still trains, within budget, with
the same numbers.

Cases are the nine light model-zoo graphs that ship inside ``onnx`` (turned into training steps
by :mod:`models.onnx_zoo` and our exporter) and our own ``models/`` zoo. For each case the run

1. trains it unplanned for a few steps (the reference: losses, final state, peak, step time);
2. finds the smallest budget the planner can meet (a plan for 1 byte raises
   :class:`BudgetTooSmallError` naming it);
3. for each budget (``1.0x``, ``0.5x``, ``0.25x``, ``min``): transforms the graph (the rewritten
   graph must pass the ONNX checker and give stock ONNX Runtime's outputs of the original graph,
   bitwise), trains the same steps under the budget, and checks losses and state bitwise against
   the reference and the measured peak against the budget.

A budget below the minimum is recorded as ``below_min``, not as a failure. Results compare with a
baseline file (the last passing run): a budget that passed there and does not now is a regression.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from ort_offload.budget import format_bytes
from ort_offload.errors import BudgetTooSmallError, OffloadError
from graph_passes.ort_logging import ort_log_severity
from ort_offload.report import atomic_write_text, json_safe

logger = logging.getLogger(__name__)

ZOO_BUDGETS = ("1.0x", "0.5x", "0.25x", "min")
QUICK_BUDGETS = ("0.5x",)
LIGHT_FAMILY = "onnx-light"
OURS_FAMILY = "ours"
OUR_MODELS = ("mlp", "gpt", "cnn", "bert", "lstm")
QUICK_LIGHT_MODELS = ("squeezenet", "shufflenet")
DEFAULT_STEPS = 2
PASS, BELOW_MIN, FAIL = "pass", "below_min", "fail"
SMALLEST_BUDGET = 1  # bytes: no plan fits, so planning names the minimum


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """One model of the regression and how to build its training step."""

    name: str
    family: str
    build: Callable[[int], "PreparedCase"]  # steps -> graph, state and batches


@dataclasses.dataclass(frozen=True)
class PreparedCase:
    graph: Any  # TrainingGraph
    state: dict[str, np.ndarray]
    batches: list[dict[str, np.ndarray]]
    params: int


@dataclasses.dataclass
class BudgetResult:
    budget: str  # the label: 1.0x, 0.5x, 0.25x, min
    budget_bytes: int | None = None
    status: str = FAIL
    peak_bytes: int | None = None
    time_ratio: float | None = None
    max_abs_diff: float | None = None
    detail: str = ""


@dataclasses.dataclass
class ModelResult:
    model: str
    family: str
    nodes: int | None = None
    params: int | None = None
    unplanned_peak_bytes: int | None = None
    min_budget_bytes: int | None = None
    unplanned_step_time_s: float | None = None
    wall_s: float | None = None  # the whole case: export, reference, minimum and every budget
    budgets: list[BudgetResult] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and all(b.status != FAIL for b in self.budgets)


# ---- cases ------------------------------------------------------------------------------------


def _numpy_feeds(names: Sequence[str], tensors: Iterable) -> dict[str, np.ndarray]:
    return {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)}


def _prepared(module, *, loss_fn, make_batch: Callable[[int], tuple], input_names, target_names,
              dynamic_axes=None, name: str, steps: int) -> PreparedCase:
    """Export ``module``'s training step (AdamW) and draw ``steps`` batches (seeds 0, 1, ...)."""
    from ort_offload.export import optimizers
    from ort_offload.export.training_step import export_training_step, initial_state

    optimizer = optimizers.make_optimizer("adamw")
    inputs, targets = make_batch(0)
    graph = export_training_step(
        module, example_inputs=inputs, example_targets=targets, loss_fn=loss_fn, optimizer=optimizer,
        input_names=input_names, target_names=target_names, dynamic_axes=dynamic_axes, name=name,
    ).graph
    names = (*input_names, *target_names)
    batches = []
    for step in range(steps):
        inputs, targets = make_batch(step)
        batches.append(_numpy_feeds(names, (*inputs, *targets)))
    params = sum(p.numel() for p in module.parameters())
    return PreparedCase(graph, initial_state(graph, module, lr=optimizer.lr), batches, params)


def _light_case(name: str) -> Callable[[int], PreparedCase]:
    def build(steps: int) -> PreparedCase:
        from models.onnx_zoo import build_light_model, check_reference
        from models.registry import classification_loss

        check_reference(name)
        light = build_light_model(name)
        return _prepared(light.module, loss_fn=classification_loss, make_batch=lambda seed: light.make_batch(seed=seed),
                         input_names=light.input_names, target_names=light.target_names, name=name, steps=steps)

    return build


def _our_case(model: str, config: str) -> Callable[[int], PreparedCase]:
    def build(steps: int) -> PreparedCase:
        from models import get_model

        spec = get_model(model, config)
        return _prepared(spec.model, loss_fn=spec.loss_fn, make_batch=lambda seed: spec.make_batch(seed=seed),
                         input_names=spec.input_names, target_names=spec.target_names,
                         dynamic_axes=spec.dynamic_axes, name=f"{model}-{config}", steps=steps)

    return build


def zoo_cases(*, quick: bool = False, only: Sequence[str] | None = None) -> list[ZooCase]:
    """The regression's cases: light zoo graphs, then ours (``tiny``; ``small`` too unless quick)."""
    from models.onnx_zoo import LIGHT_MODELS

    light = QUICK_LIGHT_MODELS if quick else tuple(LIGHT_MODELS)
    configs = ("tiny",) if quick else ("tiny", "small")
    cases = [ZooCase(name, LIGHT_FAMILY, _light_case(name)) for name in light]
    cases += [ZooCase(f"{m}-{c}", OURS_FAMILY, _our_case(m, c)) for c in configs for m in OUR_MODELS]
    if only:
        known = {c.name: c for c in zoo_cases(quick=False)}
        missing = [n for n in only if n not in known]
        if missing:
            raise OffloadError(f"unknown zoo model {missing[0]!r}: use one of {', '.join(known)}")
        cases = [known[n] for n in only]
    return cases


# ---- running ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    losses: list[float]
    state: dict[str, np.ndarray]
    report: dict[str, Any]


def _train(case: PreparedCase, *, budget, passes: Sequence[str]) -> _Run:
    import ort_offload
    from ort_offload.trainer import OrtTrainer

    device = ort_offload.set_offload_device("cpu", budget=budget)
    names = list(case.graph.data_inputs)
    try:
        trainer = OrtTrainer(device, case.graph, initial_state=case.state, example_batch=case.batches[0],
                             input_names=names, target_names=[], passes=passes)
        losses = [trainer.step(*(batch[n] for n in names)) for batch in case.batches]
        return _Run(losses, trainer.flat_state(), trainer.report())
    finally:
        trainer = None
        _release()


def _release() -> None:
    """Collect now: a trainer's runtime holds reference cycles, and its arena (as large as the
    budget: 5.3 GiB for VGG-19 unplanned) would otherwise stay alive into the next run."""
    gc.collect()


def _smallest_budget(case: PreparedCase, passes: Sequence[str]) -> int:
    try:
        _train(dataclasses.replace(case, batches=case.batches[:1]), budget=SMALLEST_BUDGET, passes=passes)
    except BudgetTooSmallError as e:
        return e.needed_bytes
    raise AssertionError("a plan fitted a 1-byte budget")


def _max_abs_diff(run: _Run, reference: _Run) -> tuple[bool, float]:
    """Whether losses and every state tensor are bitwise equal, and the largest difference."""
    equal = run.losses == reference.losses
    worst = max((abs(a - b) for a, b in zip(run.losses, reference.losses)), default=0.0)
    for name, value in reference.state.items():
        other = run.state[name]
        equal = equal and np.array_equal(other, value)
        if value.size:
            worst = max(worst, float(np.max(np.abs(other.astype(np.float64) - value.astype(np.float64)))))
    return equal, worst


def _stock_outputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Stock kernels, reproducible: one thread. With two, the embedding gradient's scatter-add
    # sums in varying order even with use_deterministic_compute (bert small: two runs of one
    # graph differ by 2e-3).
    options.intra_op_num_threads = 1
    options.use_deterministic_compute = True
    options.log_severity_level = ort_log_severity()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def _check_transform(case: PreparedCase, budget_bytes: int, passes: Sequence[str],
                     stock_reference: Mapping[str, np.ndarray]) -> str:
    """Transform for ``budget_bytes``; '' when the rewritten graph is valid and stock ONNX Runtime
    gives the original graph's outputs bitwise, else what went wrong."""
    import ort_offload
    from ort_offload.transform import transform

    device = ort_offload.set_offload_device("cpu", budget=budget_bytes)
    shapes = {n: case.batches[0][n].shape for n in case.graph.data_inputs}
    rewritten = transform(case.graph, device, shapes, tuple(passes)).graph.model
    _release()
    onnx.checker.check_model(rewritten)
    outputs = _stock_outputs(rewritten, {**case.state, **case.batches[0]})
    for name, expected in stock_reference.items():
        if not np.array_equal(outputs[name], expected):
            return f"transformed graph: output {name} differs from the original graph in stock ONNX Runtime"
    return ""


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def run_case(case: ZooCase, *, budgets: Sequence[str] = ZOO_BUDGETS, steps: int = DEFAULT_STEPS,
             passes: Sequence[str] = ("swap",), on_budget: Callable[[str], None] | None = None) -> ModelResult:
    """Run one case at every budget; errors are recorded in the result, never raised."""
    result = ModelResult(case.name, case.family)
    start = time.perf_counter()
    try:
        prepared = case.build(steps)
        result.nodes, result.params = len(prepared.graph.graph.node), prepared.params
        reference = _train(prepared, budget=None, passes=())
        result.unplanned_peak_bytes = reference.report["baseline_peak_bytes"]
        result.unplanned_step_time_s = reference.report["step_time_s_median"]
        result.min_budget_bytes = _smallest_budget(prepared, passes)
        stock_reference = _stock_outputs(prepared.graph.model, {**prepared.state, **prepared.batches[0]})
    except Exception as e:  # noqa: BLE001 - a broken case is a regression to report, not a crash
        logger.debug("zoo case %s failed", case.name, exc_info=True)
        result.error = _one_line(e)
        return result
    finally:
        result.wall_s = time.perf_counter() - start
    for label in budgets:
        if on_budget:
            on_budget(label)
        result.budgets.append(_run_budget(prepared, result, label, reference, stock_reference, passes))
    result.wall_s = time.perf_counter() - start
    return result


def _budget_bytes(label: str, result: ModelResult) -> int:
    if label == "min":
        return result.min_budget_bytes
    return int(float(label.rstrip("x")) * result.unplanned_peak_bytes)


def _run_budget(prepared: PreparedCase, result: ModelResult, label: str, reference: _Run,
                stock_reference: Mapping[str, np.ndarray], passes: Sequence[str]) -> BudgetResult:
    outcome = BudgetResult(label)
    try:
        outcome.budget_bytes = _budget_bytes(label, result)
        if outcome.budget_bytes < result.min_budget_bytes:
            outcome.status = BELOW_MIN
            outcome.detail = f"below the minimum budget {format_bytes(result.min_budget_bytes)}"
            return outcome
        problem = _check_transform(prepared, outcome.budget_bytes, passes, stock_reference)
        run = _train(prepared, budget=outcome.budget_bytes, passes=passes)
        outcome.peak_bytes = run.report["peak_device_bytes"]
        outcome.time_ratio = run.report["step_time_s_median"] / reference.report["step_time_s_median"]
        equal, outcome.max_abs_diff = _max_abs_diff(run, reference)
        if not problem and not equal:
            problem = f"losses or state differ from the unplanned run (max abs diff {outcome.max_abs_diff:.3g})"
        if not problem and outcome.peak_bytes > outcome.budget_bytes:
            problem = f"peak {outcome.peak_bytes} bytes over the budget {outcome.budget_bytes}"
        outcome.status, outcome.detail = (FAIL, problem) if problem else (PASS, "")
    except Exception as e:  # noqa: BLE001
        logger.debug("zoo case %s at %s failed:\n%s", result.model, label, traceback.format_exc())
        outcome.status, outcome.detail = FAIL, _one_line(e)
    return outcome


def _case_worker(name: str, budgets: Sequence[str], steps: int, passes: Sequence[str], events) -> None:
    """Child-process body: run case ``name``, report each budget and then the result on ``events``
    (no export spinner: the parent draws the progress bar)."""
    from ort_offload.export.progress import spinners_off

    (case,) = zoo_cases(only=[name])
    with spinners_off():
        result = run_case(case, budgets=budgets, steps=steps, passes=passes,
                          on_budget=lambda label: events.put(("budget", label)))
    events.put(("result", dataclasses.asdict(result)))


def _result_from_row(row: Mapping[str, Any]) -> ModelResult:
    budgets = [BudgetResult(**b) for b in row["budgets"]]
    return ModelResult(**{**row, "budgets": budgets})


def run_case_isolated(case: ZooCase, *, budgets: Sequence[str], steps: int, passes: Sequence[str],
                      on_budget: Callable[[str], None] | None = None) -> ModelResult:
    """:func:`run_case` in a child process of its own, so that one model's memory (VGG-19 with
    AdamW holds 2.3 GB of state, in several copies) is returned before the next starts, and a
    case that dies (out of memory) is a failed row instead of the end of the run."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    worker = context.Process(target=_case_worker, args=(case.name, tuple(budgets), steps, tuple(passes), events),
                             name=f"zoo-{case.name}")
    worker.start()
    try:
        while True:
            try:
                kind, payload = events.get(timeout=1.0)
            except queue.Empty:
                if not worker.is_alive():
                    worker.join()
                    cause = " (killed: out of memory?)" if worker.exitcode == -9 else ""
                    return ModelResult(case.name, case.family,
                                       error=f"the worker process died with exit code {worker.exitcode}{cause}")
                continue
            if kind == "budget":
                if on_budget:
                    on_budget(payload)
            else:
                worker.join()
                return _result_from_row(payload)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


def run_zoo(cases: Sequence[ZooCase], *, budgets: Sequence[str] = ZOO_BUDGETS, steps: int = DEFAULT_STEPS,
            passes: Sequence[str] = ("swap",), progress: bool = True) -> list[ModelResult]:
    """Run every case, each in its own process; a progress bar (one tick per model and budget)
    unless ``progress`` is false."""
    options = {"budgets": budgets, "steps": steps, "passes": passes}
    if not progress:
        return [run_case_isolated(c, **options) for c in cases]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]zoo"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[what]}"),
               TimeElapsedColumn())
    results = []
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("zoo", total=len(cases) * (len(budgets) + 1), what="")
        for case in cases:
            bar.update(task, what=f"{case.name}: export and unplanned run")
            done_before = bar.tasks[0].completed

            def on_budget(label: str, name=case.name) -> None:
                bar.update(task, advance=1, what=f"{name} at {label}")

            results.append(run_case_isolated(case, on_budget=on_budget, **options))
            bar.update(task, completed=done_before + len(budgets) + 1)
    return results


# ---- baseline, regressions, output ------------------------------------------------------------


def result_rows(results: Sequence[ModelResult]) -> list[dict[str, Any]]:
    """The JSON form of ``results``."""
    return [dataclasses.asdict(r) for r in results]


def load_baseline(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The baseline's models by name ({} when there is no baseline file yet)."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())["models"]
        baseline = {row["model"]: row for row in rows}
        if not all(isinstance(row.get("budgets", []), list) and all(isinstance(b, dict) for b in row.get("budgets", []))
                   for row in baseline.values()):
            raise ValueError("a model's budgets are not a list of results")
        return baseline
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise OffloadError(f"baseline {path} is not a zoo result file ({type(e).__name__}); "
                           "delete it or pass another --baseline") from e


def regressions(results: Sequence[ModelResult], baseline: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per regression: a failure, or a budget that passed in the baseline and does not now."""
    found = []
    for result in results:
        if result.error:
            found.append(f"{result.model}: {result.error}")
            continue
        before = {b["budget"]: b["status"] for b in baseline.get(result.model, {}).get("budgets", [])}
        for b in result.budgets:
            if b.status == FAIL:
                found.append(f"{result.model} at {b.budget}: {b.detail}")
            elif before.get(b.budget) == PASS and b.status != PASS:
                found.append(f"{result.model} at {b.budget}: passed in the baseline, now {b.status} ({b.detail})")
    return found


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _cell(b: BudgetResult) -> str:
    if b.status == BELOW_MIN:
        return "below min"
    if b.status == FAIL:
        return "**FAIL**"
    return f"ok {_mib(b.peak_bytes)} MiB, {b.time_ratio:.2f}x, diff {b.max_abs_diff:.0g}"


def render_markdown(results: Sequence[ModelResult], budgets: Sequence[str],
                    baseline: Mapping[str, Mapping[str, Any]]) -> str:
    """The results table; the minimum budget shows its change against the baseline."""
    head = ["model", "family", "nodes", "params", "unplanned peak MiB", "min budget MiB (Δ vs baseline)", *budgets, "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"| {r.model} | {r.family} | **ERROR**: {r.error} |" + " |" * (len(head) - 3))
            continue
        minimum = _mib(r.min_budget_bytes)
        old = baseline.get(r.model, {}).get("min_budget_bytes")
        if old and r.min_budget_bytes is not None:
            minimum += f" ({(r.min_budget_bytes - old) / old:+.1%})"
        cells = {b.budget: _cell(b) for b in r.budgets}
        lines.append(f"| {r.model} | {r.family} | {r.nodes} | {r.params:,} | {_mib(r.unplanned_peak_bytes)} | {minimum} | "
                     + " | ".join(cells.get(b, "-") for b in budgets) + f" | {r.wall_s or 0:.0f} |")
    details = [f"- {r.model} at {b.budget}: {b.detail}" for r in results for b in r.budgets if b.status == FAIL]
    return "\n".join(lines + ([""] + details if details else []))


def write_results(path: str | os.PathLike, results: Sequence[ModelResult], *, budgets: Sequence[str],
                  steps: int, passes: Sequence[str]) -> Path:
    """Write the run as JSON atomically (temporary file, then rename)."""
    payload = {"budgets": list(budgets), "steps": steps, "passes": list(passes),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "models": result_rows(results)}
    return atomic_write_text(path, json.dumps(json_safe(payload), indent=2, allow_nan=False))
