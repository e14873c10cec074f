"""What ort_offload buys over the alternatives: its peers measured on one model, batch and machine, in one run.

Run ``python -m benchmarks.peers [--quick] [--out DIR]``. Model: GPT ``small`` (``--quick``: GPT
``tiny``) at its default batch, AdamW, the same batches for every method. One row per method:

- **unplanned ORT** (the reference for every ratio): an ort_offload trainer without a budget
  (``set_offload_device("cpu", budget=None)``), the whole step graph in the fewest blocks. Its
  first ``warmup + measured`` steps give the reference losses and state; it keeps stepping,
  interleaved with every other row.
- **PyTorch eager**: the same model (same initial weights), loss, AdamW settings and batches.
- **PyTorch checkpoint**: every transformer layer wrapped in
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
- **PyTorch selective checkpoint** (SAC): the same wrapping with
  ``create_selective_checkpoint_contexts`` and a policy that saves matmul outputs (``mm``,
  ``addmm``, ``bmm``, ``baddbmm`` and the CPU flash-attention op) and recomputes the rest; a row
  with the reason if this torch cannot run it on the CPU.
- **PyTorch save_on_cpu** (``torch.autograd.graph.save_on_cpu``): it moves saved activations from
  a CUDA device to host memory; on a CPU-only machine there is nothing to move, so the row says
  so instead of a number.
- **ours**: ``passes="swap"`` at budgets 1.0x, 0.5x, 0.25x of the unplanned peak and the minimum
  (a trainer asked for 1 byte raises ``BudgetTooSmallError`` naming it), ``passes="auto"`` at
  0.5x, and ``recompute``/``split`` at 0.5x; a pass ``ort_offload.trainer.resolve_passes``
  rejects says "not implemented yet (issues 4/5)" (none since split has its planner), one that
  cannot plan the budget says so with the minimum it states.

Metrics per row (``METRICS``; each is a number or a string saying why there is none):

- ``peak_device_bytes``, with the method in ``peak_method``. Ours: ``trainer.report()`` (arena
  high-water + the largest workspace of a block that ran; parameters, gradients, optimizer state
  and activations all live in the arena). Torch: the allocator high-water of one step measured
  with ``torch.profiler`` (``profile_memory=True``; events in start order, op events'
  ``self_cpu_memory_usage`` plus ``[memory]`` events' ``cpu_memory_usage``, running maximum:
  DESIGN.md's recipe), gradients set to ``None`` before it, plus the bytes resident at the step's
  start (parameters, buffers, AdamW state), so that it counts what our arena counts.
- ``rss_growth_bytes`` (torch rows): the cross-check. A child process with glibc's malloc set to
  return every block over 64 KiB to the kernel (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``) trains each torch variant; the kernel's peak-RSS counter is reset
  (``/proc/self/clear_refs``) before one step and ``VmHWM`` − ``VmRSS`` before it is the growth.
  It should be close to the profiler's high-water (``profiler_high_water_bytes``).
- ``budget_bytes``: ours, the row's budget; torch rows, the unplanned ORT peak at the base batch
  (the budget their largest batch is searched under).
- ``step_time_s_median`` of the measured steps (after warm-up), each step alternating with one
  step of the reference and an idle pause after each; ``ratio_to_unplanned`` = the row's median /
  the reference's median over the steps interleaved with it.
- ``largest_batch``: batch sizes base × 2^k tried upwards (downwards to 1 if the base does not
  fit) until one does not fit; a batch fits if a real step runs with peak ≤ the budget (ours: the
  trainer plans for that batch under the row's budget in bytes, ``BudgetTooSmallError`` = does
  not fit). ``largest_batch_capped`` says the search stopped at the list's end.
- ``swap_bytes_per_step`` (out + in), ``recomputed`` (ours: ``recomputed_nodes``; torch: aten
  ops run in backward beyond eager's count, from a ``TorchDispatchMode`` counter), ``faults``.
- ``other_cpu_share`` (per row, not a metric): the share of all CPUs other processes used while
  the row's steps ran (``/proc/stat`` busy time minus this process's own); above
  ``CONTENTION_SHARE`` the row's step time is marked ``*`` and a warning says it is unreliable.
- ``loss_max_rel_diff``: the largest relative loss difference to the reference over the same
  steps. Ours must be bitwise equal (``losses_bitwise_equal``, ``state_bitwise_equal``); torch
  within ``TORCH_LOSS_RTOL`` (AdamW in ONNX vs torch differs by ~5e-4 relative after a few
  steps).

CUDA: ``torch.cuda.is_available()`` and onnxruntime's providers are recorded; without them the
result says ``cuda: not available`` (every row here runs on the CPU either way: ort_offload's
CUDA device is not built yet).

Outputs in ``benchmarks/results/<YYYY-MM-DD>/`` or ``--out DIR``: ``peers.json`` (atomic),
``peers.md`` (the summary table), ``peers_step_time_vs_budget.png``, ``peers_largest_batch.png``
and ``peers_timeline_0.5x.png`` (device bytes over one step, unplanned vs the 0.5x plan).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence


from benchmarks import common as bench
from ort_offload.report import save_figure

RESULT_FILE = "peers.json"
MD_FILE = "peers.md"
PLOT_STEP_TIME = "peers_step_time_vs_budget.png"
PLOT_LARGEST_BATCH = "peers_largest_batch.png"
PLOT_TIMELINE = "peers_timeline_0.5x.png"
OUTPUT_FILES = (RESULT_FILE, MD_FILE, PLOT_STEP_TIME, PLOT_LARGEST_BATCH, PLOT_TIMELINE)
TABLE_WIDTH = 200
PROBE_BUDGET = 1  # bytes: no plan fits, so BudgetTooSmallError states the minimum
MINIMUM = "min"
TIMELINE_BUDGET = "0.5x"
TORCH_LOSS_RTOL = 2e-3  # torch vs the ONNX step: AdamW noise, ~5e-4 relative after a few steps
RSS_PROBE_TIMEOUT_S = 300
# glibc: blocks above 64 KiB come from mmap and go back to the kernel when freed, so RSS follows
# the live bytes of tensors (a fixed threshold also stops glibc from raising it dynamically).
RSS_PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}

METRICS = (
    "peak_device_bytes",
    "rss_growth_bytes",
    "budget_bytes",
    "step_time_s_median",
    "ratio_to_unplanned",
    "largest_batch",
    "swap_bytes_per_step",
    "recomputed",
    "faults",
    "loss_max_rel_diff",
)

NOT_IMPLEMENTED = "not implemented yet (issues 4/5)"
NEEDS_CUDA = "skipped: needs a CUDA device (torch.cuda.is_available() is False); save_on_cpu moves saved " \
             "activations from the GPU to host memory, on a CPU there is nothing to move"
CUDA_NOT_COMPARABLE = "skipped: ort_offload has no CUDA device yet, so a GPU number would not be comparable " \
                      "to the CPU rows"
TORCH_NO_SWAP = "not applicable: torch keeps every tensor where it is (no swapping)"
TORCH_NO_FAULTS = "not applicable: torch has no planned residency, so nothing can fault"
OURS_NO_RSS = "not measured: the arena is one preallocated buffer capped at the budget, RSS does not show its use"
REFERENCE_BUDGET = "unlimited (budget=None)"
CONTENTION_SHARE = 0.15  # other processes' share of all CPUs while a row's steps ran above which its times are suspect

# (method id, passes, budget label) of our rows, in table order
OURS_ROWS = (
    ("ours_swap_1.0x", "swap", "1.0x"),
    ("ours_swap_0.5x", "swap", "0.5x"),
    ("ours_swap_0.25x", "swap", "0.25x"),
    ("ours_swap_min", "swap", MINIMUM),
    ("ours_auto_0.5x", "auto", "0.5x"),
    ("ours_recompute_0.5x", "recompute", "0.5x"),
    ("ours_split_0.5x", "split", "0.5x"),
)
TORCH_ROWS = (
    ("torch_eager", "eager"),
    ("torch_checkpoint", "checkpoint"),
    ("torch_selective_checkpoint", "selective"),
)
SAVE_ON_CPU = "torch_save_on_cpu"
REFERENCE = "ort_unplanned"
# (method id, budget label) of the offloaded module's rows: the user's own loop, torch's AdamW
OWN_LOOP_ROWS = (("ours_offload_1.0x", "1.0x"), ("ours_offload_0.5x", "0.5x"))
OWN_LOOP_NO_BATCH_SEARCH = "not measured: the batch search runs for the in-graph rows only"
METHODS = (REFERENCE, *(m for m, _ in TORCH_ROWS), SAVE_ON_CPU, *(m for m, _, _ in OURS_ROWS),
           *(m for m, _ in OWN_LOOP_ROWS))
LABELS = {
    REFERENCE: "unplanned ORT (reference)",
    "torch_eager": "PyTorch eager",
    "torch_checkpoint": "PyTorch checkpoint (every layer)",
    "torch_selective_checkpoint": "PyTorch selective checkpoint (save matmuls)",
    SAVE_ON_CPU: "PyTorch save_on_cpu",
    **{m: f"ours passes={p} @ {b}" for m, p, b in OURS_ROWS},
    **{m: f"ours offloaded module + torch AdamW @ {b}" for m, b in OWN_LOOP_ROWS},
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures."""

    mode: str
    model: str
    config: str
    warmup_steps: int
    measured_steps: int
    settle_s: float  # idle pause after every step of the interleaved rows
    batch_doublings: int  # the largest-batch search tries base * 2**k for k = 0..batch_doublings
    torch_loss_rtol: float = TORCH_LOSS_RTOL
    torch_threads: int | None = None  # None: torch's default (torch.get_num_threads())


QUICK = Settings(mode="quick", model="gpt", config="tiny", warmup_steps=1, measured_steps=2, settle_s=0.02,
                 batch_doublings=2)
FULL = Settings(mode="full", model="gpt", config="small", warmup_steps=2, measured_steps=5, settle_s=0.1,
                batch_doublings=4)


# ---- helpers ------------------------------------------------------------------------------------


def _rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return float(max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)))


def _search_and_timing_fields(search: dict[str, Any], timing: dict[str, Any]) -> dict[str, Any]:
    """The row fields every measured method shares: the batch search and the interleaved timing."""
    return {
        "largest_batch_capped": search["largest_batch_capped"],
        "largest_batch_tried": search["tried"],
        "first_step_s": timing["first_step_s"],
        "step_times_s": timing["step_times_s"],
        "ref_step_times_s": timing["ref_step_times_s"],
        "ref_median_step_s": timing["ref_median"],
        "other_cpu_share": timing["other_cpu_share"],
        "losses": timing["losses"],
    }


def _timed(fn: Callable[..., Any], *args) -> tuple[float, Any]:
    """(seconds, value) of ``fn(*args)``."""
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


class CpuMeter:
    """CPU time of other processes while something runs: busy time of the whole machine
    (``/proc/stat``) minus this process's own (children included), as a share of all CPUs."""

    def __init__(self) -> None:
        self.start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / hz  # all but idle and iowait (guest is inside user)
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system

    def other_share(self) -> float | None:
        """Share (0..1) of all CPUs other processes used since this meter started; None if unknown."""
        end = self._snapshot()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        wall = end[0] - self.start[0]
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


class Interleaver:
    """Steps the reference trainer between the measured steps of another row."""

    def __init__(self, reference, batches: Sequence[tuple], settle_s: float) -> None:
        self.reference = reference
        self.batches = list(batches)
        self.settle_s = settle_s
        self.cursor = 0

    def run(self, step: Callable[[tuple], float], *, warmup: int) -> dict[str, Any]:
        """``step(batch) -> loss`` over every batch; after each measured step, one reference step."""
        times, losses, ref_times = [], [], []
        meter = CpuMeter()
        for i, batch in enumerate(self.batches):
            seconds, loss = _timed(step, batch)
            times.append(seconds)
            losses.append(float(loss))
            time.sleep(self.settle_s)
            if i >= warmup:
                ref_batch = self.batches[self.cursor % len(self.batches)]
                self.cursor += 1
                ref_seconds, _ = _timed(self.reference.step, *ref_batch)
                ref_times.append(ref_seconds)
                time.sleep(self.settle_s)
        measured = times[warmup:]
        median, ref_median = bench.median(measured), bench.median(ref_times)
        return {"first_step_s": times[0], "step_times_s": measured, "ref_step_times_s": ref_times,
                "median": median, "ref_median": ref_median, "ratio": median / ref_median, "losses": losses,
                "other_cpu_share": meter.other_share()}


def search_largest_batch(base: int, doublings: int, fits: Callable[[int], dict[str, Any]],
                         *, base_result: dict[str, Any] | None = None) -> dict[str, Any]:
    """Largest batch of base * 2**k (k <= doublings) that fits; below base, halving down to 1.

    ``fits(batch)`` returns ``{"fits": bool, ...}`` (a real step, or a plan that failed);
    ``base_result`` is the base batch's result when the row measured it already."""
    tried = []

    def attempt(batch: int) -> bool:
        outcome = base_result if (batch == base and base_result is not None) else fits(batch)
        tried.append({"batch": batch, **outcome})
        return bool(outcome["fits"])

    largest, capped = None, False
    if attempt(base):
        largest = base
        for k in range(1, doublings + 1):
            if not attempt(base * 2**k):
                break
            largest = base * 2**k
        else:
            capped = True
    else:
        batch = base // 2
        while batch >= 1:
            if attempt(batch):
                largest = batch
                break
            batch //= 2
    if largest is None:
        value: int | str = f"none: even batch {tried[-1]['batch']} does not fit ({tried[-1].get('why', '')})"
    else:
        value = largest
    return {"largest_batch": value, "largest_batch_capped": capped, "tried": tried,
            "batch_sizes": [base * 2**k for k in range(doublings + 1)]}


# ---- torch peers --------------------------------------------------------------------------------


def _layer_list(model):
    """The module list holding the model's repeated layers (transformer blocks)."""
    from torch import nn

    for name in ("layers", "blocks", "h"):
        layers = getattr(model, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            return child
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers to checkpoint")


def _matmul_ops() -> set:
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention"):
        packet = getattr(aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return ops


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_MATMUL_OPS: set = set()


def wrap_layers(model, variant: str):
    """Wrap every layer's forward in activation checkpointing (``variant``: "eager" leaves the
    model as it is, "checkpoint", "selective")."""
    if variant == "eager":
        return model
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if variant == "selective":
        _MATMUL_OPS.update(_matmul_ops())
        options = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy)}
    elif variant == "checkpoint":
        options = {}
    else:
        raise ValueError(f"unknown torch variant {variant!r}")
    for layer in _layer_list(model):
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **options, **kwargs)

        layer.forward = checkpointed
    return model


class TorchPeer:
    """A fresh copy of the model (same seed: same initial weights) trained in plain torch."""

    def __init__(self, settings: Settings, variant: str, n_inputs: int) -> None:
        from models import get_model
        from ort_offload.export import optimizers

        self.spec = get_model(settings.model, settings.config)
        self.model = wrap_layers(self.spec.model, variant)
        self.model.train()
        self.optimizer = optimizers.make_optimizer("adamw").torch_optimizer(self.model.parameters())
        self.n_inputs = n_inputs

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward_update(self, batch: tuple, *, backward_mode=None) -> float:
        inputs, targets = batch[:self.n_inputs], batch[self.n_inputs:]
        loss = self.spec.loss_fn(self.model(*inputs), *targets)
        with backward_mode if backward_mode is not None else contextlib.nullcontext():
            loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def step(self, batch: tuple) -> float:
        self.zero_grad()
        return self.forward_backward_update(batch)

    def resident_bytes(self) -> int:
        """Parameters, buffers and optimizer state: what is allocated when a step starts."""
        import torch

        seen, total = set(), 0
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


@contextlib.contextmanager
def _quiet_native_stderr():
    """Drop the profiler's native log lines (kineto's start/stop lines, the allocator's note on
    blocks allocated before profiling); anything else written to fd 2 is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            noise = re.compile(r"profiler_(start|stop)|Memory block of unknown size|^\s*$")
            for line in capture.read().decode(errors="replace").splitlines():
                if not noise.search(line):
                    print(line, file=sys.stderr)


def profiler_high_water(fn: Callable[[], Any]) -> int:
    """Allocator high-water of ``fn`` (bytes above what was allocated when it started):
    DESIGN.md's torch.profiler recipe."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, current)
    return int(peak)


def torch_peak(peer: TorchPeer, batch: tuple) -> dict[str, int]:
    peer.zero_grad()  # the previous gradients are freed before the profile: their frees are not its business
    resident = peer.resident_bytes()
    high_water = profiler_high_water(lambda: peer.forward_backward_update(batch))
    return {"peak_device_bytes": resident + high_water, "profiler_high_water_bytes": high_water,
            "resident_bytes": resident}


def backward_op_count(peer: TorchPeer, batch: tuple) -> int:
    """aten ops dispatched while ``loss.backward()`` runs (recomputation included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    peer.zero_grad()
    peer.forward_backward_update(batch, backward_mode=Counter())
    return Counter.count


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def rss_probe(model: str, config: str, batch: int, variants: Sequence[str], *, threads: int | None = None,
              warmup: int = 2) -> dict[str, Any]:
    """(Runs in a child process with :data:`RSS_PROBE_ENV`.) Per torch variant: RSS growth of
    one step at ``batch`` — the kernel's peak-RSS counter reset before the step."""
    import torch

    from models import get_model

    if threads is not None:
        torch.set_num_threads(threads)

    spec = get_model(model, config)
    inputs, targets = spec.make_batch(batch, seed=0)
    data = tuple(inputs) + tuple(targets)
    settings = dataclasses.replace(FULL, model=model, config=config)
    out: dict[str, Any] = {}
    for variant in variants:
        try:
            peer = TorchPeer(settings, variant, len(inputs))
            for _ in range(warmup):
                peer.step(data)
            peer.zero_grad()
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = _proc_status_bytes("VmRSS")
            peer.forward_backward_update(data)
            out[variant] = {"rss_growth_bytes": _proc_status_bytes("VmHWM") - before, "rss_before_bytes": before}
            del peer
            gc.collect()
        except Exception as e:  # noqa: BLE001 - reported per variant
            out[variant] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run_rss_probe(settings: Settings, batch: int, variants: Sequence[str]) -> dict[str, Any]:
    code = ("import json, sys; from benchmarks.peers import rss_probe; "
            f"print(json.dumps(rss_probe({settings.model!r}, {settings.config!r}, {batch}, {list(variants)!r}, "
            f"threads={settings.torch_threads!r})))")
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              timeout=RSS_PROBE_TIMEOUT_S, env={**os.environ, **RSS_PROBE_ENV})
    except (OSError, subprocess.SubprocessError) as e:
        return {v: {"error": f"RSS probe process failed: {type(e).__name__}: {e}"} for v in variants}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {v: {"error": f"RSS probe process exited {proc.returncode}: {tail[0]}"} for v in variants}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cuda_info() -> dict[str, Any]:
    import onnxruntime
    import torch

    torch_cuda = bool(torch.cuda.is_available())
    providers = list(onnxruntime.get_available_providers())
    ort_cuda = "CUDAExecutionProvider" in providers
    if not torch_cuda and not ort_cuda:
        status = "not available"
    else:
        status = (f"available (torch: {'yes' if torch_cuda else 'no'}, onnxruntime CUDA EP: "
                  f"{'yes' if ort_cuda else 'no'}); not used: ort_offload's CUDA device is not built yet, "
                  "every row runs on the CPU")
    return {"status": status, "torch_cuda_available": torch_cuda, "onnxruntime_providers": providers,
            "onnxruntime_cuda_provider": ort_cuda,
            "torch_cuda_version": torch.version.cuda}


# ---- measurement --------------------------------------------------------------------------------


def _empty_metrics(reason: str) -> dict[str, Any]:
    return {key: reason for key in METRICS}


def measure(settings: Settings, *, log: Callable[[str], None], artifacts: dict[str, Any]) -> dict[str, Any]:
    """Measure every row; returns the result document (without the command line). Objects the
    plots need (the 0.5x plan's memory traces) go into ``artifacts``."""
    import onnxruntime
    import torch

    onnxruntime.set_default_logger_severity(3)  # errors only
    started = time.perf_counter()
    run_meter = CpuMeter()
    ctx = _Bench(settings, lambda msg: log(f"[{time.perf_counter() - started:6.1f} s] {msg}"))
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    export = _export(ctx)
    # 1. the reference: no budget, the unplanned program
    reference = _run_reference(ctx, export)
    rows: list[dict[str, Any]] = [_reference_row(ctx, reference)]
    # 2. torch peers
    peers = _torch_rows(ctx, reference)
    rows += peers.rows
    cuda = cuda_info()
    rows.append(_save_on_cpu_row(cuda))
    # 3. the minimum budget of the swap pass
    minimum = _probe_minimum(ctx)
    # 4. ours
    for method, passes, budget_label in OURS_ROWS:
        rows.append(_ours_row(ctx, reference, method, passes, budget_label, minimum.bytes, peers.eager_losses,
                              artifacts))
    # 5. the offloaded module in a plain torch loop
    rows.extend(measure_own_loop(ctx.settings, ctx.spec, reference.interleave, reference.losses, ctx.optimizer,
                                 cache_dir=ctx.cache_dir, log=ctx.log))
    baseline_peak = reference.baseline_peak
    del reference
    gc.collect()
    # 6. the RSS cross-check of the torch peaks, in a child process with its own malloc settings
    probe_s = _rss_cross_check(ctx, rows)
    rows.sort(key=lambda r: METHODS.index(r["method"]))
    result = _peers_result(ctx, export, baseline_peak, minimum, rows, cuda, probe_s, run_meter)
    result["total_time_s"] = time.perf_counter() - started
    return result


class _Bench:
    """What every row shares: the model, its batches, the export cache, and trainers made from it."""

    def __init__(self, settings: Settings, log: Callable[[str], None]) -> None:
        from models import get_model
        from ort_offload.export import optimizers
        from ort_offload.export.training_step import default_cache_dir

        self.settings, self.log = settings, log
        self.spec = spec = get_model(settings.model, settings.config)
        self.base_batch = spec.default_batch
        self.steps = settings.warmup_steps + settings.measured_steps
        pairs = [spec.make_batch(seed=i) for i in range(self.steps)]
        self.batches = [tuple(i) + tuple(t) for i, t in pairs]
        self.inputs, self.targets = spec.make_batch(seed=0)
        self.n_inputs = len(self.inputs)
        self.optimizer = optimizers.make_optimizer("adamw")
        self.label = f"{settings.model}-{settings.config}"
        self.common = dict(
            loss_fn=spec.loss_fn, input_names=list(spec.input_names), target_names=list(spec.target_names),
            dynamic_axes=spec.dynamic_axes, optimizer=self.optimizer, name=self.label,
        )
        self.cache_dir = default_cache_dir()  # the export is not what is compared: reuse it across runs

    def batch_at(self, size: int) -> tuple:
        i, t = self.spec.make_batch(size, seed=0)
        return tuple(i) + tuple(t)

    def trainer_for(self, budget, passes="auto", batch: tuple | None = None):
        import ort_offload

        device = ort_offload.set_offload_device("cpu", budget=budget)
        example = self.batches[0] if batch is None else batch
        return ort_offload.create_ort_trainer(
            device, self.spec.model, example_inputs=example[:self.n_inputs], example_targets=example[self.n_inputs:],
            passes=passes, cache_dir=self.cache_dir, **self.common)

    def ours_fits(self, budget_bytes: int | None, passes: str, limit: int) -> Callable[[int], dict[str, Any]]:
        """A fresh trainer for the batch under ``budget_bytes`` (None: unlimited), one real step;
        fits if it plans and its peak is <= ``limit``."""
        from ort_offload.errors import BudgetTooSmallError

        def fits(size: int) -> dict[str, Any]:
            data = self.batch_at(size)
            try:
                trainer = self.trainer_for(budget_bytes, passes, data)
            except BudgetTooSmallError as e:
                return {"fits": False, "needed_bytes": int(e.needed_bytes), "why": "BudgetTooSmallError"}
            seconds, _ = _timed(trainer.step, *data)
            peak = int(trainer.report()["peak_device_bytes"])
            del trainer
            gc.collect()
            return {"fits": peak <= limit, "peak_device_bytes": peak, "step_s": seconds,
                    "why": "" if peak <= limit else f"peak {peak} > {limit}"}
        return fits


@dataclasses.dataclass(frozen=True)
class _Export:
    result: Any  # ExportResult
    seconds: float


def _export(ctx: _Bench) -> _Export:
    """The export, into the shared cache; checks that the cache hits afterwards."""
    from ort_offload.export.training_step import export_training_step

    ctx.log(f"{ctx.label}: exporting (cache {ctx.cache_dir})")
    export_s, export = _timed(lambda: export_training_step(
        ctx.spec.model, example_inputs=ctx.inputs, example_targets=ctx.targets, cache_dir=ctx.cache_dir,
        **ctx.common))
    again = export_training_step(ctx.spec.model, example_inputs=ctx.inputs, example_targets=ctx.targets,
                                 cache_dir=ctx.cache_dir, **ctx.common)
    if not again.cache_hit:
        raise RuntimeError(f"the export cache in {ctx.cache_dir} does not hit: every trainer would export again")
    return _Export(export, export_s)


@dataclasses.dataclass(frozen=True)
class _ReferenceRun:
    """The unplanned trainer's run over the batches, and the interleaver that steps it next to
    every other row's measured steps."""

    trainer: Any
    setup_s: float
    baseline_peak: int
    times: list[float]
    losses: list[float]
    other_share: float
    state: dict[str, Any]
    report: dict[str, Any]
    interleave: Interleaver

    @property
    def peak(self) -> int:
        return int(self.report["peak_device_bytes"])


def _run_reference(ctx: _Bench, export: _Export) -> _ReferenceRun:
    reference, ref_setup_s = bench.timed(lambda: ctx.trainer_for(None))
    baseline_peak = int(reference.runner.baseline_peak_bytes)
    ctx.log(f"{ctx.label}: {len(export.result.graph.graph.node)} nodes, batch {ctx.base_batch}, unplanned peak "
            f"{baseline_peak} bytes; reference: {ctx.steps} steps")
    ref_times, ref_losses = [], []
    meter = CpuMeter()
    for batch in ctx.batches:
        seconds, loss = _timed(reference.step, *batch)
        ref_times.append(seconds)
        ref_losses.append(loss)
    ref_other_share = meter.other_share()
    return _ReferenceRun(
        trainer=reference, setup_s=ref_setup_s, baseline_peak=baseline_peak, times=ref_times, losses=ref_losses,
        other_share=ref_other_share, state=reference.flat_state(), report=reference.report(),
        interleave=Interleaver(reference, ctx.batches, ctx.settings.settle_s),
    )


def _reference_row(ctx: _Bench, ref: _ReferenceRun) -> dict[str, Any]:
    """The reference's row, with the largest batch its unplanned peak holds."""
    settings, ref_peak, ref_report = ctx.settings, ref.peak, ref.report
    ctx.log(f"{ctx.label}: reference largest batch (unplanned peak <= {ref_peak} bytes)")
    ref_search = search_largest_batch(
        ctx.base_batch, settings.batch_doublings, ctx.ours_fits(None, "none", ref_peak),
        base_result={"fits": True, "peak_device_bytes": ref_peak})
    return {
        "method": REFERENCE, "label": LABELS[REFERENCE], "kind": "reference", "status": "ok", "reason": None,
        "metrics": {
            "peak_device_bytes": ref_peak,
            "rss_growth_bytes": OURS_NO_RSS,
            "budget_bytes": REFERENCE_BUDGET,
            "step_time_s_median": bench.median(ref.times[settings.warmup_steps:]),
            "ratio_to_unplanned": 1.0,
            "largest_batch": ref_search["largest_batch"],
            "swap_bytes_per_step": (ref_report["swap_out_bytes"] + ref_report["swap_in_bytes"]) / ctx.steps,
            "recomputed": ref_report["recomputed_nodes"],
            "faults": ref_report["faults"],
            "loss_max_rel_diff": 0.0,
        },
        "peak_method": "runtime: arena high-water + largest block workspace (trainer.report())",
        "batch_search_budget_bytes": ref_peak,
        "largest_batch_capped": ref_search["largest_batch_capped"],
        "largest_batch_tried": ref_search["tried"],
        "blocks": len(ref.trainer.runner.last_prepared.program.blocks),
        "setup_s": ref.setup_s,
        "first_step_s": ref.times[0],
        "step_times_s": ref.times[settings.warmup_steps:],
        "other_cpu_share": ref.other_share,
        "losses": ref.losses,
        "losses_bitwise_equal": True,
        "state_bitwise_equal": True,
    }


@dataclasses.dataclass(frozen=True)
class _TorchRows:
    rows: list[dict[str, Any]]
    eager_losses: list[float]  # torch eager's, what ours are also compared with


@dataclasses.dataclass(frozen=True)
class _TorchRun:
    """One torch variant measured: its steps next to the reference's, its peak, its backward's
    op count and its largest batch under the reference's peak."""

    peer: Any
    timing: dict[str, Any]
    peak: dict[str, Any]
    backward_ops: int
    search: dict[str, Any]


def _torch_rows(ctx: _Bench, ref: _ReferenceRun) -> _TorchRows:
    """One row per torch variant; a variant that cannot run here is a row with the reason
    (except eager, which every other row is compared with)."""
    import torch

    rows = []
    eager_losses = None
    eager_backward_ops = None
    for method, variant in TORCH_ROWS:
        ctx.log(f"{ctx.label}: {method}")
        row: dict[str, Any] = {"method": method, "label": LABELS[method], "kind": "torch", "variant": variant}
        try:
            run = _run_torch_peer(ctx, ref, variant)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row with the reason
            if variant == "eager":
                raise
            reason = f"cannot run on the CPU with torch {torch.__version__}: {type(e).__name__}: {e}"
            row.update(status="error", reason=reason, metrics=_empty_metrics(reason))
            rows.append(row)
            continue
        if variant == "eager":
            eager_losses, eager_backward_ops = run.timing["losses"], run.backward_ops
        row.update(_torch_row_fields(ctx, ref, run, eager_losses, eager_backward_ops))
        rows.append(row)
        del run
        gc.collect()
    return _TorchRows(rows, eager_losses)


def _run_torch_peer(ctx: _Bench, ref: _ReferenceRun, variant: str) -> _TorchRun:
    settings, ref_peak = ctx.settings, ref.peak
    peer = TorchPeer(settings, variant, ctx.n_inputs)
    timing = ref.interleave.run(peer.step, warmup=settings.warmup_steps)
    peak = torch_peak(peer, ctx.batches[0])
    backward_ops = backward_op_count(peer, ctx.batches[0])

    def torch_fits(size: int, _peer=peer) -> dict[str, Any]:
        measured = torch_peak(_peer, ctx.batch_at(size))
        ok = measured["peak_device_bytes"] <= ref_peak
        return {"fits": ok, **measured,
                "why": "" if ok else f"peak {measured['peak_device_bytes']} > {ref_peak}"}

    search = search_largest_batch(
        ctx.base_batch, settings.batch_doublings, torch_fits,
        base_result={"fits": peak["peak_device_bytes"] <= ref_peak, **peak,
                     "why": "" if peak["peak_device_bytes"] <= ref_peak
                     else f"peak {peak['peak_device_bytes']} > {ref_peak}"})
    return _TorchRun(peer, timing, peak, backward_ops, search)


def _torch_row_fields(ctx: _Bench, ref: _ReferenceRun, run: _TorchRun, eager_losses: list[float],
                      eager_backward_ops: int) -> dict[str, Any]:
    timing, peak = run.timing, run.peak
    loss_diff = _rel_diff(timing["losses"], ref.losses)
    return dict(
        status="ok", reason=None,
        metrics={
            "peak_device_bytes": peak["peak_device_bytes"],
            "rss_growth_bytes": "pending",  # filled by the RSS probe below
            "budget_bytes": ref.peak,
            "step_time_s_median": timing["median"],
            "ratio_to_unplanned": timing["ratio"],
            "largest_batch": run.search["largest_batch"],
            "swap_bytes_per_step": TORCH_NO_SWAP,
            "recomputed": run.backward_ops - eager_backward_ops,
            "faults": TORCH_NO_FAULTS,
            "loss_max_rel_diff": loss_diff,
        },
        peak_method="torch.profiler allocator high-water of one step + parameters, buffers and AdamW "
                    "state resident at its start",
        profiler_high_water_bytes=peak["profiler_high_water_bytes"],
        resident_bytes=peak["resident_bytes"],
        recomputed_unit="aten ops dispatched in backward beyond torch eager's count",
        backward_ops=run.backward_ops,
        batch_search_budget_bytes=ref.peak,
        **_search_and_timing_fields(run.search, timing),
        losses_within_tolerance=loss_diff <= ctx.settings.torch_loss_rtol,
        losses_bitwise_equal_torch_eager=bench.bitwise_equal(timing["losses"], eager_losses),
    )


def _save_on_cpu_row(cuda: dict[str, Any]) -> dict[str, Any]:
    """torch's save_on_cpu offloads to the host from a CUDA device: skipped, with why."""
    reason = CUDA_NOT_COMPARABLE if cuda["torch_cuda_available"] else NEEDS_CUDA
    return {"method": SAVE_ON_CPU, "label": LABELS[SAVE_ON_CPU], "kind": "torch", "status": "skipped",
            "reason": reason, "metrics": _empty_metrics(reason)}


@dataclasses.dataclass(frozen=True)
class _Minimum:
    bytes: int  # the least budget the swap pass plans for
    probe_s: float


def _probe_minimum(ctx: _Bench) -> _Minimum:
    """The swap pass's minimum budget, from the error a one-byte budget raises."""
    from ort_offload.errors import BudgetTooSmallError

    ctx.log(f"{ctx.label}: probing the minimum budget (budget {PROBE_BUDGET} byte)")
    min_probe_s = time.perf_counter()
    try:
        ctx.trainer_for(PROBE_BUDGET, "swap")
    except BudgetTooSmallError as e:
        minimum = int(e.needed_bytes)
    else:
        raise RuntimeError(f"a budget of {PROBE_BUDGET} byte planned; expected BudgetTooSmallError")
    return _Minimum(minimum, time.perf_counter() - min_probe_s)


def _ours_row(ctx: _Bench, ref: _ReferenceRun, method: str, passes: str, budget_label, minimum: int,
              eager_losses: list[float], artifacts: dict[str, Any]) -> dict[str, Any]:
    """One of our rows: passes not built yet and budgets too small are rows with the reason."""
    from ort_offload.errors import BudgetTooSmallError, OffloadError
    from ort_offload.trainer import resolve_passes

    row = {"method": method, "label": LABELS[method], "kind": "ours", "passes_requested": passes,
           "budget": budget_label}
    try:
        resolve_passes(passes)
    except OffloadError as e:
        reason = NOT_IMPLEMENTED
        row.update(status="not_implemented", reason=reason, error=str(e), metrics=_empty_metrics(reason))
        return row
    budget = minimum if budget_label == MINIMUM else budget_label
    ctx.log(f"{ctx.label}: {method}: planning")
    try:
        trainer, setup_s = bench.timed(lambda: ctx.trainer_for(budget, passes))
    except BudgetTooSmallError as e:
        reason = f"BudgetTooSmallError: {e}"
        row.update(status="budget_too_small", reason=reason, metrics=_empty_metrics(reason))
        return row
    run = _run_ours(ctx, ref, trainer, passes, budget_label, artifacts)
    del trainer
    gc.collect()
    ctx.log(f"{ctx.label}: {method}: largest batch under {run.budget_bytes} bytes")
    search = search_largest_batch(
        ctx.base_batch, ctx.settings.batch_doublings, ctx.ours_fits(run.budget_bytes, passes, run.budget_bytes),
        base_result={"fits": run.peak <= run.budget_bytes, "peak_device_bytes": run.peak,
                     "why": "" if run.peak <= run.budget_bytes else f"peak {run.peak} > {run.budget_bytes}"})
    row.update(_ours_row_fields(ctx, ref, run, search, setup_s, eager_losses))
    return row


@dataclasses.dataclass(frozen=True)
class _OursRun:
    """Our trainer's steps next to the reference's, and what its runtime reported."""

    timing: dict[str, Any]
    before: Any  # runtime stats when the measured steps start
    after: Any
    report0: dict[str, Any]  # right after planning
    report: dict[str, Any]
    state_bad: list[str]  # state tensors that differ from the reference's
    prepared: Any
    budget_bytes: int

    @property
    def peak(self) -> int:
        return int(self.report["peak_device_bytes"])


def _run_ours(ctx: _Bench, ref: _ReferenceRun, trainer, passes: str, budget_label,
              artifacts: dict[str, Any]) -> _OursRun:
    """Interleave ``trainer``'s steps with the reference's; the swap plan at the timeline
    budget leaves its memory traces in ``artifacts``."""
    settings = ctx.settings
    budget_bytes = int(trainer.runtime.budget_bytes)
    report0 = trainer.report()
    stats_at: dict[str, Any] = {}

    def ours_step(batch, _trainer=trainer):
        if len(_trainer.losses) == settings.warmup_steps:
            stats_at["before"] = dataclasses.replace(_trainer.runtime.stats, fault_log=[])
        return _trainer.step(*batch)

    timing = ref.interleave.run(ours_step, warmup=settings.warmup_steps)
    before = stats_at["before"]
    after = trainer.runtime.stats
    report = trainer.report()
    state_bad = bench.state_mismatches(trainer.flat_state(), ref.state)
    prepared = trainer.runner.last_prepared
    if passes == "swap" and budget_label == TIMELINE_BUDGET:
        artifacts["timeline"] = {"baseline": trainer.runner.baseline_trace, "planned": trainer.runner.last_trace,
                                 "budget_bytes": budget_bytes, "title": f"{ctx.label} batch {ctx.base_batch}: device "
                                 f"bytes over one step, passes=swap @ {TIMELINE_BUDGET}"}
    return _OursRun(timing, before, after, report0, report, state_bad, prepared, budget_bytes)


def _ours_row_fields(ctx: _Bench, ref: _ReferenceRun, run: _OursRun, search: dict[str, Any], setup_s: float,
                     eager_losses: list[float]) -> dict[str, Any]:
    timing, before, after, report, budget_bytes, peak = (run.timing, run.before, run.after, run.report,
                                                         run.budget_bytes, run.peak)
    n = ctx.settings.measured_steps
    return dict(
        status="ok", reason=None,
        metrics={
            "peak_device_bytes": peak,
            "rss_growth_bytes": OURS_NO_RSS,
            "budget_bytes": budget_bytes,
            "step_time_s_median": timing["median"],
            "ratio_to_unplanned": timing["ratio"],
            "largest_batch": search["largest_batch"],
            "swap_bytes_per_step": (after.swap_out_bytes - before.swap_out_bytes
                                    + after.swap_in_bytes - before.swap_in_bytes) / n,
            "recomputed": report["recomputed_nodes"],
            "faults": report["faults"],
            "loss_max_rel_diff": _rel_diff(timing["losses"], ref.losses),
        },
        peak_method="runtime: arena high-water + largest block workspace (trainer.report())",
        within_budget=peak <= budget_bytes,
        budget_over_baseline_peak=budget_bytes / ref.baseline_peak,
        passes=report["passes"],
        blocks=len(run.prepared.program.blocks),
        plan_time_s=run.report0["plan_time_s"],
        setup_s=setup_s,
        swap_out_bytes_per_step=(after.swap_out_bytes - before.swap_out_bytes) / n,
        swap_in_bytes_per_step=(after.swap_in_bytes - before.swap_in_bytes) / n,
        recomputed_unit="nodes added by the recompute pass (trainer.report()['recomputed_nodes'])",
        split_nodes=report["split_nodes"],
        faults_measured=after.faults - before.faults,
        batch_search_budget_bytes=budget_bytes,
        **_search_and_timing_fields(search, timing),
        losses_bitwise_equal=bench.bitwise_equal(timing["losses"], ref.losses),
        loss_max_rel_diff_vs_torch_eager=_rel_diff(timing["losses"], eager_losses),
        state_bitwise_equal=not run.state_bad,
        state_mismatches=run.state_bad[:10],
    )


def _rss_cross_check(ctx: _Bench, rows: list[dict[str, Any]]) -> float:
    """Fill the torch rows' RSS growth from a child process; returns the probe's seconds."""
    torch_ok = [r for r in rows if r["kind"] == "torch" and r["status"] == "ok"]
    ctx.log(f"{ctx.label}: RSS cross-check of {len(torch_ok)} torch rows (child process)")
    probe, probe_s = bench.timed(lambda: run_rss_probe(ctx.settings, ctx.base_batch, [r["variant"] for r in torch_ok]))
    for row in torch_ok:
        got = probe.get(row["variant"], {"error": "missing from the probe's output"})
        if "error" in got:
            row["metrics"]["rss_growth_bytes"] = f"not measured: {got['error']}"
        else:
            row["metrics"]["rss_growth_bytes"] = int(got["rss_growth_bytes"])
            row["rss_over_profiler"] = got["rss_growth_bytes"] / max(row["profiler_high_water_bytes"], 1)
    return probe_s


def _peers_result(ctx: _Bench, export: _Export, baseline_peak: int, minimum: _Minimum, rows: list[dict[str, Any]],
                  cuda: dict[str, Any], probe_s: float, run_meter: CpuMeter) -> dict[str, Any]:
    """The result document, without its total time."""
    import torch

    settings, spec, base_batch, optimizer = ctx.settings, ctx.spec, ctx.base_batch, ctx.optimizer
    cfg = spec.config
    ours_ok = [r for r in rows if r["kind"] == "ours" and r["status"] == "ok"]
    return {
        "benchmark": "peers",
        "mode": settings.mode,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "model": settings.model,
            "config": settings.config,
            "warmup_steps": settings.warmup_steps,
            "measured_steps": settings.measured_steps,
            "settle_s": settings.settle_s,
            "batch_sizes": [base_batch * 2**k for k in range(settings.batch_doublings + 1)],
            "optimizer": dataclasses.asdict(optimizer) | {"type": type(optimizer).__name__},
            "torch_loss_rtol": settings.torch_loss_rtol,
            "torch_threads": torch.get_num_threads(),
            "device": "cpu",
            "ratio": "row median step / median of the reference (unplanned ORT) steps interleaved with the row's",
            "sac_policy": "MUST_SAVE for " + ", ".join(sorted(str(op) for op in _matmul_ops()))
                          + "; PREFER_RECOMPUTE otherwise",
            "rss_probe_env": RSS_PROBE_ENV,
        },
        "cuda": cuda,
        "model": {
            "name": settings.model,
            "config": settings.config,
            "config_fields": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg),
            "batch": base_batch,
            "seq": spec.default_seq,
            "parameters": int(sum(p.numel() for p in spec.model.parameters())),
            "graph_nodes": len(export.result.graph.graph.node),
            "export_s": export.seconds,
            "export_cache_hit": bool(export.result.cache_hit),
            "baseline_peak_bytes": baseline_peak,
            "min_budget_bytes": minimum.bytes,
            "min_probe_s": minimum.probe_s,
        },
        "metrics": list(METRICS),
        "methods": list(METHODS),
        "rows": rows,
        "rss_probe_s": probe_s,
        "other_cpu_share": run_meter.other_share(),
        "contention_share": CONTENTION_SHARE,
        "all_ours_within_budget": all(r["within_budget"] for r in ours_ok),
        "all_ours_bitwise_equal": all(r["losses_bitwise_equal"] and r["state_bitwise_equal"] for r in ours_ok),
    }


def measure_own_loop(settings: Settings, spec, interleave: Interleaver, ref_losses: Sequence[float], optimizer,
                     *, cache_dir, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The offloaded module's rows: ``ort_offload.offload`` of a copy of the model, stepped by a
    plain torch loop with ``torch.optim.AdamW`` (the reference's hyper-parameters), interleaved
    with the reference like every row. Its budget resolves against its own program (forward and
    backward: the optimizer state lives in torch, outside the budget)."""
    import copy

    import ort_offload

    rows = []
    n_inputs = len(spec.input_names)
    for method, budget_label in OWN_LOOP_ROWS:
        log(f"{method}: planning")
        model = copy.deepcopy(spec.model)
        example = interleave.batches[0]
        device = ort_offload.set_offload_device("cpu", budget=budget_label)
        module, setup_s = bench.timed(lambda _model=model, _device=device: ort_offload.offload(
            _model, _device, example_inputs=example[:n_inputs], example_targets=example[n_inputs:],
            loss_fn=spec.loss_fn, input_names=list(spec.input_names), target_names=list(spec.target_names),
            dynamic_axes=spec.dynamic_axes, name=f"{settings.model}-{settings.config}", cache_dir=cache_dir))
        torch_optimizer = optimizer.torch_optimizer(module.parameters())

        def own_step(batch, _module=module, _optimizer=torch_optimizer):
            loss = _module(*batch)
            loss.backward()
            _optimizer.step()
            _optimizer.zero_grad(set_to_none=True)
            return loss.item()

        timing = interleave.run(own_step, warmup=settings.warmup_steps)
        report = module.report()
        peak, budget_bytes = int(report["peak_device_bytes"]), int(report["budget_bytes"])
        steps = max(report["steps"], 1)
        rows.append({
            "method": method, "label": LABELS[method], "kind": "own_loop", "budget": budget_label,
            "status": "ok", "reason": None,
            "metrics": {
                "peak_device_bytes": peak,
                "rss_growth_bytes": OURS_NO_RSS,
                "budget_bytes": budget_bytes,
                "step_time_s_median": timing["median"],
                "ratio_to_unplanned": timing["ratio"],
                "largest_batch": OWN_LOOP_NO_BATCH_SEARCH,
                "swap_bytes_per_step": (report["swap_out_bytes"] + report["swap_in_bytes"]) / steps,
                "recomputed": report["recomputed_nodes"],
                "faults": report["faults"],
                "loss_max_rel_diff": _rel_diff(timing["losses"], ref_losses),
            },
            "peak_method": "runtime: arena high-water + largest block workspace of the forward/backward program "
                           "(module.report()); torch's AdamW state is outside it",
            "within_budget": peak <= budget_bytes,
            "baseline_peak_bytes": report["baseline_peak_bytes"],
            "passes": report["passes"],
            "setup_s": setup_s,
            "first_step_s": timing["first_step_s"],
            "step_times_s": timing["step_times_s"],
            "ref_step_times_s": timing["ref_step_times_s"],
            "ref_median_step_s": timing["ref_median"],
            "other_cpu_share": timing["other_cpu_share"],
            "losses": timing["losses"],
            "losses_within_tolerance": _rel_diff(timing["losses"], ref_losses) <= settings.torch_loss_rtol,
        })
        del module, torch_optimizer, model
        gc.collect()
    return rows


# ---- output -------------------------------------------------------------------------------------


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _contended(row: dict[str, Any]) -> bool:
    share = row.get("other_cpu_share")
    return share is not None and share > CONTENTION_SHARE


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def table_cells(row: dict[str, Any]) -> list[str]:
    """The summary columns of one row (:data:`COLUMNS`); a metric without a number shows "n/a"
    (its reason is in the notes and the JSON)."""
    m = row["metrics"]

    def cell(key: str, fmt: Callable[[Any], str]) -> str:
        value = m[key]
        return fmt(value) if _is_number(value) else "n/a"

    if row["status"] != "ok":
        return [row["label"], *("-" for _ in COLUMNS[1:-1]), row["reason"]]
    largest = cell("largest_batch", lambda v: f"{'≥' if row.get('largest_batch_capped') else ''}{v}")
    if row["kind"] == "ours":
        losses = "bitwise = ref" if row["losses_bitwise_equal"] and row["state_bitwise_equal"] else "DIFFERS"
        losses += f"; vs eager {row['loss_max_rel_diff_vs_torch_eager']:.1e}"
    elif row["kind"] in ("torch", "own_loop"):
        ok = "ok" if row["losses_within_tolerance"] else "OUT OF TOL."
        losses = f"rel {m['loss_max_rel_diff']:.1e} ({ok})"
    else:
        losses = "reference"
    budget = m["budget_bytes"]
    return [
        row["label"],
        cell("peak_device_bytes", _mib),
        {"ours": "runtime arena", "reference": "runtime arena", "torch": "torch.profiler",
         "own_loop": "runtime arena (fwd+bwd)"}[row["kind"]],
        cell("rss_growth_bytes", _mib),
        _mib(budget) if _is_number(budget) else "none",
        cell("step_time_s_median", lambda v: f"{v * 1e3:.1f}{'*' if _contended(row) else ''}"),
        cell("ratio_to_unplanned", lambda v: f"{v:.2f}"),
        largest,
        cell("swap_bytes_per_step", _mib),
        cell("recomputed", lambda v: str(int(v))),
        cell("faults", lambda v: str(int(v))),
        losses,
    ]


COLUMNS = ("method", "peak MiB", "peak measured by", "RSS growth MiB", "budget MiB", "step ms", "ratio",
           "largest batch", "swap MiB/step", "recomputed", "faults", "losses vs unplanned / note")


def notes(result: dict[str, Any]) -> list[str]:
    lines = [f"cuda: {result['cuda']['status']}"]
    contended = [r for r in result["rows"] if _contended(r)]
    if contended:
        threads = result["settings"]["torch_threads"]
        share = ", ".join(f"{r['label']} {100 * r['other_cpu_share']:.0f}%" for r in contended)
        lines.append(f"WARNING (* on step ms): other processes used more than {100 * CONTENTION_SHARE:.0f}% of the "
                     f"CPUs while these rows' steps ran ({share}; {100 * (result['other_cpu_share'] or 0):.0f}% over "
                     "the whole run): their step times and ratios are unreliable (interleaving with the reference "
                     f"evens out steady load, not bursts). torch's OpenMP threads ({threads}) suffer most: each "
                     "parallel region waits for its slowest thread. Rerun on an idle machine.")
    model = result["model"]
    lines.append(f"model: {model['name']} {model['config']}, batch {model['batch']}, seq {model['seq']}, "
                 f"{model['parameters']:,} parameters, {model['graph_nodes']} ONNX nodes (export "
                 f"{model['export_s']:.1f} s{', cache hit' if model['export_cache_hit'] else ''}); unplanned peak {_mib(model['baseline_peak_bytes'])} MiB, swap minimum "
                 f"{_mib(model['min_budget_bytes'])} MiB ({model['min_budget_bytes'] / model['baseline_peak_bytes']:.3f}x)")
    lines.append("largest batch: tried " + ", ".join(map(str, result["settings"]["batch_sizes"]))
                 + "; torch rows and the reference under the unplanned ORT peak at the base batch, ours under "
                 "the row's budget; ≥ = the largest size tried fits")
    lines.append("RSS growth: torch rows re-run in a child process with malloc returning freed blocks to the "
                 "kernel, peak RSS of one step minus RSS before it (a cross-check of the profiler's high-water, "
                 "which excludes the resident parameters and AdamW state that 'peak' includes; the kernel batches RSS "
                 "counters per thread, so differences of a few hundred KiB are noise)")
    lines.append("recomputed: ours = nodes added by the recompute pass; torch = aten ops run in backward "
                 "beyond eager's count")
    for row in result["rows"]:
        for key in METRICS:
            value = row["metrics"][key]
            if isinstance(value, str) and row["status"] == "ok":
                lines.append(f"{row['label']}: {key}: {value}")
    return lines


def print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    s = result["settings"]
    table = Table(title=f"ort_offload and its peers: {result['model']['name']} {result['model']['config']}, batch "
                        f"{result['model']['batch']}, CPU ({result['mode']} mode; {s['warmup_steps']} warm-up + "
                        f"{s['measured_steps']} measured steps per row; cuda: {result['cuda']['status']})")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("method", "peak measured by", COLUMNS[-1]) else "right")
    for row in result["rows"]:
        cells = table_cells(row)
        if row["kind"] == "ours" and row["status"] == "ok" and not row["within_budget"]:
            cells[1] = f"[red]{cells[1]}[/]"
        table.add_row(*cells)
    console.print(table)
    for line in notes(result):
        console.print(f"[dim]{line}[/]")
    console.print(f"ours: peak <= budget in every row: {result['all_ours_within_budget']}; losses and state bitwise "
                  f"equal to unplanned ORT in every row: {result['all_ours_bitwise_equal']}; total "
                  f"{result['total_time_s']:.0f} s")


def markdown(result: dict[str, Any]) -> str:
    machine = result.get("machine", {})
    s = result["settings"]
    lines = [
        f"# ort_offload and its peers ({result['model']['name']} {result['model']['config']}, "
        f"batch {result['model']['batch']}, {result['mode']} mode)",
        "",
        f"Measured {result['timestamp']} on {machine.get('cpu_count', '?')} CPUs ({machine.get('processor', '?')}), "
        f"onnxruntime {machine.get('onnxruntime', '?')}, torch {machine.get('torch', '?')}; "
        f"{s['warmup_steps']} warm-up + {s['measured_steps']} measured steps per row, each interleaved with a step "
        f"of the unplanned ORT reference (ratio = row median / reference median). cuda: {result['cuda']['status']}.",
        f"Command: `{result.get('command', 'python -m benchmarks.peers')}`",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in result["rows"]:
        cells = [c.replace("|", "\\|") for c in table_cells(row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Notes:", ""]
    lines += [f"- {line}" for line in notes(result)]
    lines.append("")
    return "\n".join(lines)


def plot_step_time(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["method"]: r for r in result["rows"]}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    swap = [r for r in result["rows"] if r["kind"] == "ours" and r["status"] == "ok"
            and r.get("passes_requested") == "swap"]
    swap.sort(key=lambda r: r["metrics"]["budget_bytes"])
    if swap:
        xs = [r["metrics"]["budget_bytes"] / 2**20 for r in swap]
        ys = [r["metrics"]["step_time_s_median"] * 1e3 for r in swap]
        ax.plot(xs, ys, "o-", label="ours passes=swap")
        for r, x, y in zip(swap, xs, ys):
            ax.annotate(r["budget"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for method, marker in (("ours_auto_0.5x", "s"), ("ours_recompute_0.5x", "D"), ("ours_split_0.5x", "v")):
        row = rows.get(method)
        if row is not None and row["status"] == "ok":
            ax.plot([row["metrics"]["budget_bytes"] / 2**20], [row["metrics"]["step_time_s_median"] * 1e3], marker,
                    label=row["label"])
    styles = iter(["-", "--", "-.", ":"])
    for method in (REFERENCE, *(m for m, _ in TORCH_ROWS)):
        row = rows.get(method)
        if row is None or row["status"] != "ok":
            continue
        m = row["metrics"]
        ax.axhline(m["step_time_s_median"] * 1e3, linestyle=next(styles), linewidth=1, color="gray",
                   label=f"{row['label']} (peak {_mib(m['peak_device_bytes'])} MiB)")
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{result['model']['name']} {result['model']['config']} batch {result['model']['batch']}: "
                 "step time vs device budget (CPU)")
    ax.legend(loc="best", fontsize=7)
    return save_figure(fig, path)


def plot_largest_batch(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok" and _is_number(r["metrics"]["largest_batch"])]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["label"].replace(" (", "\n(") for r in rows]
    values = [r["metrics"]["largest_batch"] for r in rows]
    colors = ["tab:blue" if r["kind"] == "ours" else "tab:gray" if r["kind"] == "reference" else "tab:orange"
              for r in rows]
    bars = ax.bar(range(len(rows)), values, color=colors)
    for bar, row in zip(bars, rows):
        budget = row["batch_search_budget_bytes"]
        text = f"{'≥' if row['largest_batch_capped'] else ''}{row['metrics']['largest_batch']}\n@{_mib(budget)} MiB"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log", base=2)
    if values:
        ax.set_ylim(min(values) / 1.5, max(values) * 2.5)  # room for the labels
    ax.set_ylabel("largest batch that fits (log2)")
    ax.set_title("largest batch within the budget (torch rows: the unplanned ORT peak at the base batch)")
    return save_figure(fig, path)


def write_outputs(result: dict[str, Any], out_dir: Path, *, artifacts: dict[str, Any]) -> list[Path]:
    """peers.md and the plots (each written atomically)."""
    from ort_offload.report import atomic_write_text, plot_timeline

    written = [atomic_write_text(out_dir / MD_FILE, markdown(result)),
               plot_step_time(result, out_dir / PLOT_STEP_TIME),
               plot_largest_batch(result, out_dir / PLOT_LARGEST_BATCH)]
    timeline = artifacts.get("timeline")
    if timeline is not None:
        written.append(plot_timeline(out_dir / PLOT_TIMELINE, baseline=timeline["baseline"],
                                     planned=timeline["planned"], budget_bytes=timeline["budget_bytes"],
                                     title=timeline["title"]))
    return written


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt tiny, 1 warm-up + 2 measured steps (for tests)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for peers.json, peers.md and the plots (default: benchmarks/results/<YYYY-MM-DD>)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per row")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per row")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own default)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    bench.step_counts(args, changes)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise SystemExit("--torch-threads must be at least 1")
        changes["torch_threads"] = args.torch_threads
    return dataclasses.replace(settings, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    artifacts: dict[str, Any] = {}
    return bench.run_main(
        module="benchmarks.peers", result_file=RESULT_FILE, argv=argv, out=args.out, table_width=TABLE_WIDTH,
        measure=lambda log: measure(settings, log=log, artifacts=artifacts), print_table=print_table,
        extra_outputs=lambda result, out_dir: write_outputs(result, out_dir, artifacts=artifacts),
    )


if __name__ == "__main__":
    sys.exit(main())
