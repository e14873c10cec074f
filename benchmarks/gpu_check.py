"""Check the GPU device profiles and the time simulator against a real CUDA GPU.

The shipped GPU profiles (:mod:`graph_passes.cost.device_profiles`) are nominal datasheet numbers,
and the simulator (:mod:`graph_passes.cost.simulator`) assumes copies run beside compute at the
profile's link rates. This script measures both on a CUDA machine. It has two halves, because
the CUDA machine has PyTorch but not our environment:

``traces`` (here, in the project's venv): plans gpt ``small`` and cnn ``small`` under budgets
0.5x and 0.25x for the H100 profile (what ``ort-offload transform --device-profile H100``
writes), simulates each planned step on that profile, and writes the event traces to JSON::

    python -m benchmarks.gpu_check traces --out gpu_traces.json

``device`` (on the CUDA machine; imports only torch and the standard library)::

    python3 benchmarks/gpu_check.py device --traces gpu_traces.json --out gpu_check.json

1. **Profile**: fp32 matmul rate (TF32 off: the profiles hold fp32 without tensor cores),
   device-to-device copy bandwidth (bytes read + written), pinned host→device and device→host
   copy rates, both directions at once (total), kernel launch overhead (an empty-ish kernel,
   median over many). Printed next to the shipped H100 profile.
2. **Overlap**: a stream of matmuls alone, then with host↔device copies running on two other
   streams: the compute slowdown tests the simulator's premise that copies hide under compute.
3. **Replay** of each simulated trace: every compute event becomes a spin kernel of the
   simulated duration on a compute stream, every copy a real pinned copy of the simulated bytes
   on its own stream (one per direction). Orderings come from the trace: an event waits for
   every event of another stream that ended exactly when it started (what held it in the
   simulation: a block waiting on a swap-in, a swap-in waiting on memory a swap-out frees),
   and for the previous event of its own stream. The measured step time is compared with the
   simulated one: it checks the copy rates, the duplex model and the overlap, not the kernels
   (compute durations are the simulator's roofline, played back).

Results print as a table and go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

TRACE_MODELS = (("gpt", "small"), ("cnn", "small"))
TRACE_BUDGETS = ("0.5x", "0.25x")
TRACE_PROFILES = ("H100", "H200")  # nominal, and measured by this script on 2026-11-26
SAME_INSTANT_S = 1e-12  # two simulated times this close are the same instant


# ---- traces (this machine, the project's environment) -----------------------------------------


def make_traces(models=TRACE_MODELS, budgets=TRACE_BUDGETS, profile_names=TRACE_PROFILES) -> dict[str, Any]:
    """Plan each model under each budget for each profile and simulate it there."""
    import tempfile

    import numpy as np

    import ort_offload
    from benchmarks.swap import plan_for_profile
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.simulator import simulate_time, unlimited_time
    from models import get_model
    from ort_offload.export import optimizers
    from ort_offload.budget import parse_budget

    traces = []
    with tempfile.TemporaryDirectory(prefix="ort_offload_gpu_check_") as cache_dir:
        for name, config in models:
            spec = get_model(name, config)
            inputs, targets = spec.make_batch(seed=0)
            device = ort_offload.set_offload_device("cpu", budget=None)
            trainer = ort_offload.create_ort_trainer(
                device, spec.model, loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets,
                input_names=list(spec.input_names), target_names=list(spec.target_names),
                dynamic_axes=spec.dynamic_axes, optimizer=optimizers.make_optimizer("adamw"),
                name=f"{name}-{config}", cache_dir=cache_dir)
            batch = tuple(np.asarray(t) for t in (*inputs, *targets))
            trainer.step(*batch)
            unplanned = trainer.runner.last_prepared
            baseline = trainer.runner.baseline_peak_bytes
            model = trainer.runner.model
            for profile_name in profile_names:
                profile = get_profile(profile_name)
                unlimited_s = unlimited_time(unplanned.program, unplanned.infos, model=model, profile=profile)
                for budget_label in budgets:
                    budget = parse_budget(budget_label).resolve(baseline)
                    prepared = plan_for_profile(trainer, batch, profile=profile_name, budget_bytes=budget)
                    trace = simulate_time(prepared.program, prepared.infos, model=prepared.model or model,
                                          profile=profile, budget=budget)
                    traces.append({
                        "model": f"{name}-{config}", "budget": budget_label, "budget_bytes": budget,
                        "profile": profile_name, "simulated_step_s": trace.step_time_s,
                        "simulated_compute_s": trace.compute_time_s, "simulated_stall_s": trace.stall_time_s,
                        "unlimited_s": unlimited_s,
                        "events": [[e.stream, e.label, e.start_s, e.end_s, e.nbytes] for e in trace.events],
                    })
    return {"profiles": {n: get_profile(n).to_dict() for n in profile_names}, "traces": traces}


DYNAMIC_TRACE_PROFILES = ("H200",)


def make_dynamic_traces(profile_names=DYNAMIC_TRACE_PROFILES, budgets=TRACE_BUDGETS) -> list[dict[str, Any]]:
    """Block-wise training of var-BERT ``small`` (full depth) under each budget, once with the
    oracle's execution-block prefetch and pre-eviction and once on demand only; the last step's
    event trace replayed on each profile (:mod:`graph_passes.cost.trace_replay`)."""
    import ort_offload
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.trace_replay import replay as replay_trace
    from models import get_dynamic_model
    from ort_offload.dynamic.blockwise import BlockStepCache
    from ort_offload.dynamic.trainer import BlockwiseTrainer
    from pilot.prediction import NoPredictor, OraclePredictor

    cache = BlockStepCache()
    traces = []
    for budget_label in budgets:
        for mode in ("prefetch", "on_demand"):
            spec = get_dynamic_model("var-bert", "small", seed=0)
            options = (dict(predictor=OraclePredictor(), pre_evict=True) if mode == "prefetch"
                       else dict(predictor=NoPredictor(), prefetch=False))
            trainer = BlockwiseTrainer(spec.model, spec.loss_fn, cache=cache,
                                       device=ort_offload.set_offload_device("cpu", budget=budget_label), **options)
            for step in range(2):
                inputs, targets = spec.make_batch(8, seed=step, key=spec.config.segments)
                trainer.step(*inputs, *targets)
            trainer.close()
            for profile_name in profile_names:
                result = replay_trace(trainer.runtime.step_traces[-1], get_profile(profile_name))
                traces.append({
                    "model": f"var-bert-small {mode}", "budget": budget_label, "budget_bytes": trainer.budget_bytes,
                    "profile": profile_name, "simulated_step_s": result.step_s, "simulated_compute_s": result.compute_s,
                    "simulated_stall_s": result.stall_s, "unlimited_s": result.compute_s,
                    "events": [list(e) for e in result.events],
                })
    return traces


# ---- device (a CUDA machine: torch and the standard library only) ------------------------------


def _median_ms(fn, torch, *, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_profile(torch) -> dict[str, float]:
    """The numbers a DeviceProfile holds, measured on ``cuda:0``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    c = torch.empty(n, n, device=dev)
    matmul_ms = _median_ms(lambda: torch.matmul(a, b, out=c), torch, repeats=10)
    # a reference check that the product is real (fp32, no TF32): compare one row in float64
    row = (a[:1].double() @ b.double()).float()
    rel_err = float((c[:1] - row).norm() / row.norm())
    del a, b, c

    nbytes = 1 << 30
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    d2d_ms = _median_ms(lambda: dst.copy_(src), torch)
    host_src = torch.randn(nbytes // 4).pin_memory()
    host_dst = torch.empty(nbytes // 4).pin_memory()
    h2d_ms = _median_ms(lambda: dst.copy_(host_src, non_blocking=True), torch)
    d2h_ms = _median_ms(lambda: host_dst.copy_(src, non_blocking=True), torch)

    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    dst2 = torch.empty_like(src)

    def both() -> None:
        main = torch.cuda.current_stream()
        up.wait_stream(main)
        down.wait_stream(main)
        with torch.cuda.stream(up):
            dst2.copy_(host_src, non_blocking=True)
        with torch.cuda.stream(down):
            host_dst.copy_(src, non_blocking=True)
        main.wait_stream(up)
        main.wait_stream(down)

    duplex_ms = _median_ms(both, torch)
    tiny = torch.zeros(1, device=dev)
    launches = 1000

    def many() -> None:
        for _ in range(launches):
            tiny.add_(1.0)

    launch_ms = _median_ms(many, torch, repeats=5) / launches
    del src, dst, dst2, host_src, host_dst
    torch.cuda.empty_cache()
    return {
        "name": torch.cuda.get_device_name(0),
        "peak_flops": 2.0 * n**3 / (matmul_ms / 1e3),
        "matmul_rel_err_vs_fp64": rel_err,
        "memory_bandwidth": 2.0 * nbytes / (d2d_ms / 1e3),
        "h2d_bandwidth": nbytes / (h2d_ms / 1e3),
        "d2h_bandwidth": nbytes / (d2h_ms / 1e3),
        "duplex_bandwidth": 2.0 * nbytes / (duplex_ms / 1e3),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "kernel_launch_s": launch_ms / 1e3,
    }


def measure_overlap(torch) -> dict[str, float]:
    """Matmuls alone vs. with a host→device and a device→host copy stream busy throughout."""
    dev = torch.device("cuda")
    n = 4096
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    c = torch.empty(n, n, device=dev)
    reps = 40

    def compute() -> None:
        for _ in range(reps):
            torch.matmul(a, b, out=c)

    alone_ms = _median_ms(compute, torch, repeats=5)
    nbytes = 256 << 20
    host_src = torch.randn(nbytes // 4).pin_memory()
    host_dst = torch.empty(nbytes // 4).pin_memory()
    dev_src, dev_dst = torch.randn(nbytes // 4, device=dev), torch.empty(nbytes // 4, device=dev)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    # enough copies to outlast the compute: a rough 20 GB/s floor per direction
    copies = max(2, int(math.ceil(alone_ms / 1e3 * 20e9 / nbytes)) + 1)

    def with_copies() -> None:
        main = torch.cuda.current_stream()
        up.wait_stream(main)
        down.wait_stream(main)
        with torch.cuda.stream(up):
            for _ in range(copies):
                dev_dst.copy_(host_src, non_blocking=True)
        with torch.cuda.stream(down):
            for _ in range(copies):
                host_dst.copy_(dev_src, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compute()
        end.record()
        main.wait_stream(up)
        main.wait_stream(down)
        torch.cuda.synchronize()
        with_copies.last_ms = start.elapsed_time(end)

    times = []
    with_copies()
    for _ in range(5):
        with_copies()
        times.append(with_copies.last_ms)
    return {"compute_alone_ms": alone_ms, "compute_with_copies_ms": statistics.median(times),
            "slowdown": statistics.median(times) / alone_ms, "copy_bytes_each": nbytes, "copies_per_direction": copies}


def _spin_calibration(torch) -> float:
    """GPU clock cycles per second as ``torch.cuda._sleep`` counts them (after a warm-up that
    brings the clock up)."""
    for _ in range(3):
        torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    cycles = 50_000_000
    ms = _median_ms(lambda: torch.cuda._sleep(cycles), torch, repeats=5, warmup=1)
    return cycles / (ms / 1e3)


def _dependencies(events: list[list]) -> list[list[int]]:
    """For each event: the events of other streams that ended exactly when it started, and the
    previous event of its own stream."""
    import bisect

    by_end = sorted(range(len(events)), key=lambda i: events[i][3])
    end_times = [events[i][3] for i in by_end]
    deps: list[list[int]] = []
    last_on_stream: dict[str, int] = {}
    for i, (stream, _label, start, _end, _nbytes) in enumerate(events):
        lo = bisect.bisect_left(end_times, start - SAME_INSTANT_S)
        hi = bisect.bisect_right(end_times, start + SAME_INSTANT_S)
        mine = [j for j in by_end[lo:hi] if events[j][0] != stream and events[j][2] <= start]
        if stream in last_on_stream:
            mine.append(last_on_stream[stream])
        last_on_stream[stream] = i
        deps.append(mine)
    return deps


def _issue_order(events: list[list], deps: list[list[int]]) -> list[int]:
    """A topological order (dependencies first), by simulated start time among the ready ones:
    a CUDA stream can only wait on an event already recorded."""
    import heapq

    waiting = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in events]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready = [(events[i][2], i) for i in range(len(events)) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (events[u][2], u))
    if len(order) != len(events):
        raise ValueError("the trace's orderings have a cycle")
    return order


def critical_path_s(events: list[list], deps: list[list[int]], order: list[int], *, copies: bool = True) -> float:
    """The step time the trace's orderings give with its simulated durations (equal to the
    simulated step time), or with every copy taking no time (``copies=False``)."""
    finish: dict[int, float] = {}
    for i in order:
        stream, _label, start, end, _nbytes = events[i]
        duration = (end - start) if (copies or stream == "compute") else 0.0
        finish[i] = max([finish[j] for j in deps[i]] + [0.0]) + duration
    return max(finish.values(), default=0.0)


def replay(torch, trace: dict[str, Any], cycles_per_s: float, *, repeats: int = 5) -> dict[str, Any]:
    """Play one simulated trace back on the GPU, with its copies and without them (the control:
    what the spin kernels and the orderings alone take); returns measured vs simulated times."""
    events = [e for e in trace["events"] if e[0] != "drop"]
    deps = _dependencies(events)
    order = _issue_order(events, deps)
    player = _TracePlayer(torch, events, deps, order, cycles_per_s)
    measured = _timed_replay(torch, player, cycles_per_s, repeats, with_copies=True)
    control = _timed_replay(torch, player, cycles_per_s, repeats, with_copies=False)
    sim_no_copies = critical_path_s(events, deps, order, copies=False)
    copies = [e for e in events if e[0] in ("h2d", "d2h")]
    return {
        "model": trace["model"], "budget": trace["budget"], "profile": trace["profile"],
        "mode": measured.mode, "events": len(events), "copies": len(copies), "copy_bytes": sum(e[4] for e in copies),
        "simulated_step_s": trace["simulated_step_s"], "measured_step_s": measured.median_s,
        "measured_over_simulated": measured.median_s / trace["simulated_step_s"],
        "measured_without_copies_s": control.median_s, "simulated_without_copies_s": sim_no_copies,
        # what the copies add to the step (waits the compute cannot hide), real vs simulated
        "copy_cost_measured_s": measured.median_s - control.median_s,
        "copy_cost_simulated_s": trace["simulated_step_s"] - sim_no_copies,
        "unlimited_s": trace["unlimited_s"],
        "simulated_pct_of_unlimited": 100 * trace["unlimited_s"] / trace["simulated_step_s"],
        "replayed_pct_of_unlimited": 100 * trace["unlimited_s"] / measured.median_s,
    }


class _TracePlayer:
    """Enqueues a trace's events on three CUDA streams (spin kernels for compute, copies
    between pinned host and device buffers as large as the largest copy)."""

    def __init__(self, torch, events: list, deps: list, order: list[int], cycles_per_s: float) -> None:
        self.torch, self.events, self.deps, self.order, self.cycles_per_s = torch, events, deps, order, cycles_per_s
        dev = torch.device("cuda")
        largest = max([e[4] for e in events if e[0] in ("h2d", "d2h")] + [4])
        self.host_src = torch.empty(largest // 4 + 1).pin_memory()
        self.host_dst = torch.empty(largest // 4 + 1).pin_memory()
        self.dev_src = torch.empty(largest // 4 + 1, device=dev)
        self.dev_dst = torch.empty(largest // 4 + 1, device=dev)
        self.streams = {"compute": torch.cuda.Stream(), "h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream()}

    def issue(self, fork, with_copies: bool) -> None:
        """Enqueue the whole trace on the three streams, after ``fork``; join them back."""
        torch = self.torch
        done = [torch.cuda.Event() for _ in self.events]
        for s in self.streams.values():
            s.wait_event(fork)
        for i in self.order:
            stream_name, _label, start, end, nbytes = self.events[i]
            stream = self.streams[stream_name]
            for j in self.deps[i]:
                stream.wait_event(done[j])
            with torch.cuda.stream(stream):
                if stream_name == "compute":
                    torch.cuda._sleep(max(1, int((end - start) * self.cycles_per_s)))
                elif nbytes and with_copies:
                    count = (nbytes + 3) // 4
                    if stream_name == "h2d":
                        self.dev_dst[:count].copy_(self.host_src[:count], non_blocking=True)
                    else:
                        self.host_dst[:count].copy_(self.dev_src[:count], non_blocking=True)
                done[i].record(stream)
        main = torch.cuda.current_stream()
        for s in self.streams.values():
            main.wait_stream(s)


@dataclasses.dataclass(frozen=True)
class _ReplayTiming:
    median_s: float  # of the replays
    mode: str  # how the trace was issued: "cuda_graph" or "gate"


def _timed_replay(torch, player: _TracePlayer, cycles_per_s: float, repeats: int, *,
                  with_copies: bool) -> _ReplayTiming:
    """Median seconds of the replay, and how it was issued."""
    # Enqueueing a trace from Python takes longer than the GPU takes to run it, so the trace
    # is captured once as a CUDA graph (which keeps the cross-stream event edges) and replayed.
    try:
        once = _graph_replay(torch, player, with_copies)
        mode = "cuda_graph"
    except Exception as e:  # capture refused: hold the streams behind a long spin instead
        print(f"graph capture failed ({type(e).__name__}: {e}); replaying behind a gate kernel")
        mode = "gate"
        torch.cuda.synchronize()
        once = _gated_replay(torch, player, cycles_per_s, with_copies)
    once()
    return _ReplayTiming(statistics.median(once() for _ in range(repeats)), mode)


def _graph_replay(torch, player: _TracePlayer, with_copies: bool) -> Callable[[], float]:
    """Capture the trace as a CUDA graph; returns a timed replay of it."""
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        fork = torch.cuda.Event()
        fork.record(capture)
        player.issue(fork, with_copies)

    def once() -> float:
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        finish.record()
        finish.synchronize()
        return begin.elapsed_time(finish) / 1e3

    return once


def _gated_replay(torch, player: _TracePlayer, cycles_per_s: float, with_copies: bool) -> Callable[[], float]:
    """A timed replay that enqueues the trace behind a long spin kernel on a gate stream."""
    gate_stream = torch.cuda.Stream()

    def once() -> float:
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(int(0.5 * cycles_per_s))  # 0.5 s: the host enqueues meanwhile
            gate = torch.cuda.Event(enable_timing=True)
            gate.record(gate_stream)
        player.issue(gate, with_copies)
        finish = torch.cuda.Event(enable_timing=True)
        finish.record()
        finish.synchronize()
        return gate.elapsed_time(finish) / 1e3

    return once


def run_device(traces_path: str | None) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check device: no CUDA device (torch.cuda.is_available() is False)")
    started = time.perf_counter()
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    result["profile"] = measure_profile(torch)
    result["overlap"] = measure_overlap(torch)
    if traces_path:
        with open(traces_path, encoding="utf-8") as f:
            traces = json.load(f)
        result["shipped_profile"] = traces["profiles"]["H100"]
        cycles = _spin_calibration(torch)
        result["spin_cycles_per_s"] = cycles
        result["replays"] = [replay(torch, t, cycles) for t in traces["traces"]]
    result["wall_s"] = time.perf_counter() - started
    return result


def print_device_result(result: dict[str, Any]) -> None:
    p, shipped = result["profile"], result.get("shipped_profile", {})
    print(f"\n{result['device']} (torch {result['torch']})")
    print(f"{'quantity':<24}{'measured':>14}{'shipped ' + shipped.get('name', ''):>20}")
    for key, unit, scale in (("peak_flops", "TFLOP/s", 1e12), ("memory_bandwidth", "GB/s", 1e9),
                             ("h2d_bandwidth", "GB/s", 1e9), ("d2h_bandwidth", "GB/s", 1e9),
                             ("duplex_bandwidth", "GB/s", 1e9), ("kernel_launch_s", "us", 1e-6)):
        ship = f"{shipped[key] / scale:.1f}" if key in shipped else "-"
        print(f"{key + ' (' + unit + ')':<24}{p[key] / scale:>14.1f}{ship:>20}")
    o = result["overlap"]
    print(f"overlap: matmuls alone {o['compute_alone_ms']:.2f} ms, with copies both ways "
          f"{o['compute_with_copies_ms']:.2f} ms (x{o['slowdown']:.3f})")
    if result.get("replays"):
        print("\nreplays (ms): sim/real = whole step; 'no copies' = the same replay with copies skipped;"
              " copy cost = step - no copies")
        print(f"{'trace':<28}{'copies':>7}{'MiB':>7}{'sim':>8}{'real':>8}{'sim nc':>8}{'real nc':>8}"
              f"{'cost sim':>9}{'cost real':>10}{'sim %':>7}{'real %':>7}")
        for r in result["replays"]:
            print(f"{r['model'] + ' ' + r['budget'] + ' ' + r['profile']:<28}{r['copies']:>7}"
                  f"{r['copy_bytes'] / 2**20:>7.1f}{r['simulated_step_s'] * 1e3:>8.3f}"
                  f"{r['measured_step_s'] * 1e3:>8.3f}{r['simulated_without_copies_s'] * 1e3:>8.3f}"
                  f"{r['measured_without_copies_s'] * 1e3:>8.3f}{r['copy_cost_simulated_s'] * 1e3:>9.3f}"
                  f"{r['copy_cost_measured_s'] * 1e3:>10.3f}{r['simulated_pct_of_unlimited']:>7.1f}"
                  f"{r['replayed_pct_of_unlimited']:>7.1f}")


def get_profile_dict(name: str) -> dict:
    from graph_passes.cost.device_profiles import get_profile

    return get_profile(name).to_dict()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("traces", help="plan and simulate on this machine; write the traces")
    t.add_argument("--out", required=True)
    t.add_argument("--dynamic", action="store_true",
                   help="the block-wise runtime's traces instead (var-BERT small, prefetch vs on demand)")
    d = sub.add_parser("device", help="measure on a CUDA machine (torch only)")
    d.add_argument("--traces", default=None, help="traces JSON written by the traces command")
    d.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "traces":
        if args.dynamic:
            result = {"profiles": {n: get_profile_dict(n) for n in ("H100", *DYNAMIC_TRACE_PROFILES)},
                      "traces": make_dynamic_traces()}
        else:
            result = make_traces()
        for t in result["traces"]:
            print(f"{t['model']} {t['budget']} {t['profile']}: {len(t['events'])} events, simulated "
                  f"{t['simulated_step_s'] * 1e3:.3f} ms ({100 * t['unlimited_s'] / t['simulated_step_s']:.1f}% of unlimited)")
    else:
        result = run_device(args.traces)
        print_device_result(result)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
