"""Mimose's epoch on a real accelerator: input-aware recompute vs a static worst-case plan vs no
plan, BERT trained in torch on variable-length batches (issue 4; the CPU benchmark is
``benchmarks/mimose.py``).

The CPU benchmark measures our runtime's plans on a 2-core CPU, where recomputation costs little
next to the per-block overheads. This one asks the question of Mimose's paper on the hardware it
targets: with per-layer recompute chosen per input size by Mimose's rule, is an epoch faster than
with the plan made once for the longest size? It imports only torch, numpy, ``models/`` (pure
torch) and :mod:`graph_passes.planning.recompute.mimose` (the estimator, bucket rule and plan cache the runtime
uses; numpy only), so it runs on the CUDA machine as it is::

    python3 benchmarks/gpu_mimose.py --out gpu_mimose.json                      # CUDA
    python -m benchmarks.gpu_mimose --device cpu --config tiny --steps 12 --out x.json  # a smoke run

A *layer* is one encoder layer of the model (``model.layers``), recomputed by wrapping its
forward in ``torch.utils.checkpoint`` (non-reentrant). Three trainers run the same batches (one
epoch of ``--steps`` batches, lengths drawn uniformly from 16..256, the longest first) from the
same weights, step k of each in turn on an otherwise idle device:

- **unplanned**: nothing recomputed (its peak is what the budget is cut from);
- **static**: the layers Mimose's rule picks at the longest length recomputed at every length
  (the Sublinear-style plan Mimose compares against);
- **input_aware**: Mimose. The first ``FIT_SIZES`` distinct sizes run *sheltered* (every layer
  recomputed, so within any budget the static plan fits), each with the collector: one extra
  forward under ``saved_tensors_hooks`` that measures each layer's saved bytes (its time counts
  in the epoch, as the paper's collector). Then per size bucket (:class:`PlanCache`, 10%), the
  bucket rule on the estimator's predictions for the bucket's largest size (no replay checks a
  plan here, so it is made for every size it will serve); plan time measured.

Memory. The budget is ``--budget-margin`` above the peak of the static plan's step at the
longest length (as the CPU benchmark: a little above the least that recomputation reaches). The
estimator's need without recompute at a size is the sheltered step's peak plus every layer's
saved bytes (an over-estimate: a recomputed layer still keeps its input), fitted as a quadratic.
Every step's peak (``torch.cuda.max_memory_allocated`` during the step, less what was allocated
before it beyond the trainer's own parameters and optimizer state) is checked against the budget
and reported. On the CPU (smoke runs) no peak is measured; the sheltered peak is then the
parameter, gradient and optimizer-state bytes, which keeps the planning path exercised.

Deterministic algorithms are on while it measures (``CUBLAS_WORKSPACE_CONFIG`` is set before
CUDA starts; torch's global settings are restored afterwards), so
the three trainers' losses are compared bitwise; attention runs on the math backend
(``--attention math``, the default), whose backward is deterministic.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # models/, graph_passes/ as a script

from benchmarks.gpu_recompute import SwitchableRecompute  # noqa: E402 (after the path, as a script)

MIN_LENGTH, MAX_LENGTH = 16, 256
ROWS = ("unplanned", "static", "input_aware")
TARGET_SPEEDUP = 1.10


def lengths_for(steps: int, seed: int) -> list[int]:
    """The longest first, then uniform draws from 16..256 (as ``benchmarks/mimose.py``)."""
    rng = random.Random(seed)
    return [MAX_LENGTH] + [rng.randint(MIN_LENGTH, MAX_LENGTH) for _ in range(steps - 1)]


def layer_saved_bytes(torch, trainer: "Trainer", ids) -> list[int]:
    """Bytes each encoder layer saves for the backward at this input, recomputing nothing (one
    forward under ``saved_tensors_hooks``, no backward; storages counted once, parameters not
    at all)."""
    model = trainer.model
    trainer.switch.recomputed = frozenset()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [dict() for _ in model.layers]
    current = [None]

    def pack(tensor):
        if current[0] is not None:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    handles = []
    for k, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda _m, _a, k=k: current.__setitem__(0, k)))
        handles.append(layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return [sum(s.values()) for s in saved]


class Trainer:
    """One of the three rows: a model copy, AdamW, its recompute switch and its per-step log."""

    def __init__(self, torch, spec, device) -> None:
        torch.manual_seed(0)
        self.torch = torch
        self.device = device
        self.model = copy.deepcopy(spec.model).to(device)
        self.switch = SwitchableRecompute(torch, self.model)
        self.loss_fn = spec.loss_fn
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.steps: list[dict[str, Any]] = []
        self.losses: list[float] = []

    def own_bytes(self) -> int:
        """Parameters and optimizer state (gradients are freed between steps)."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if self.torch.is_tensor(t)]
        return sum(t.untyped_storage().nbytes() for t in list(self.model.parameters()) + state)

    def step(self, ids, y, recomputed: frozenset[int], extra_s: float = 0.0, plan_s: float | None = None) -> dict:
        torch, cuda = self.torch, self.device.type == "cuda"
        self.switch.recomputed = recomputed
        if cuda:
            torch.cuda.synchronize()
            others = torch.cuda.memory_allocated(self.device) - self.own_bytes()
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(ids), y)
        loss.backward()
        self.optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(self.device) - others if cuda else None
        self.losses.append(float(loss.detach()))
        record = {"length": int(ids.shape[1]), "step_s": seconds, "collect_s": extra_s, "plan_s": plan_s,
                  "recomputed_layers": len(recomputed), "peak_bytes": peak}
        self.steps.append(record)
        return record


class MimosePlanner:
    """The input-aware row's planning: collection while the estimator fits, then the bucket rule
    per plan-cache bucket, planned for the bucket's largest size."""

    def __init__(self, layers: int, budget: int, batch: int, fit_sizes: int) -> None:
        from graph_passes.planning.recompute.mimose import LayerMemoryEstimator, PlanCache

        self.estimator = LayerMemoryEstimator(layers, fit_sizes=fit_sizes)
        self.cache = PlanCache()
        self.budget = budget
        self.batch = batch
        self.plan_times_s: list[float] = []

    def bucket_top(self, size: int) -> int:
        """The largest input size (a multiple of the batch, at most the longest) in ``size``'s bucket."""
        key = self.cache.key(size)
        top = size
        while top + self.batch <= self.batch * MAX_LENGTH and self.cache.key(top + self.batch) == key:
            top += self.batch
        return top

    def plan(self, size: int) -> frozenset[int]:
        from graph_passes.planning.recompute.mimose import plan_from_estimates

        cached = self.cache.get(size)
        if cached is not None:
            return cached
        start = time.perf_counter()
        top = self.bucket_top(size)
        chosen = frozenset(plan_from_estimates(self.estimator.predict_layers(top),
                                               self.estimator.predict_need(top) - self.budget))
        self.plan_times_s.append(time.perf_counter() - start)
        self.cache.put(size, chosen)
        return chosen


def _static_bytes(trainer: Trainer) -> int:
    """CPU stand-in for the sheltered peak: parameters, their gradients and AdamW's two moments."""
    return 4 * sum(p.numel() * p.element_size() for p in trainer.model.parameters())


def measure(config: str, device_name: str, steps: int, seed: int, budget_margin: float,
            batch: int | None, fit_sizes: int, overrides: dict[str, int], attention: str = "math") -> dict[str, Any]:
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_mimose: no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    # Process-wide settings, restored afterwards (a caller in the same process, e.g. the test
    # suite, would otherwise export and train under them).
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32, as the shipped profiles
    torch.use_deterministic_algorithms(True, warn_only=True)  # warns where an op has no deterministic kernel
    # The math attention backend: its backward is deterministic (the memory-efficient kernel's
    # is not), and it keeps the attention scores, as the BERTs Mimose measured did.
    backend = sdpa_kernel([SDPBackend.MATH]) if attention == "math" else contextlib.nullcontext()
    try:
        with backend:
            return _measure(torch, config, device, steps, seed, budget_margin, batch, fit_sizes, overrides, attention)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _measure(torch, config, device, steps, seed, budget_margin, batch, fit_sizes, overrides, attention):
    from graph_passes.planning.recompute.mimose import plan_from_estimates
    from models import get_model

    spec = get_model("bert", config, **overrides)
    batch = int(batch or spec.default_batch)
    lengths = lengths_for(steps, seed)
    data = []
    for k, n in enumerate(lengths):
        (ids,), (y,) = spec.make_batch(batch, seq=n, seed=k)
        data.append((ids.to(device), y.to(device)))
    cuda = device.type == "cuda"

    # The budget: the static plan (every layer) at the longest length, plus the margin.
    probe = Trainer(torch, spec, device)
    every = frozenset(range(probe.switch.layers))
    records = [probe.step(*data[0], every) for _ in range(2)]  # the first allocates AdamW's state
    longest = layer_saved_bytes(torch, probe, data[0][0])
    sheltered_longest = max(r["peak_bytes"] for r in records) if cuda else _static_bytes(probe)
    budget = int(sheltered_longest * (1 + budget_margin))
    unplanned_record = probe.step(*data[0], frozenset())
    unplanned_longest = unplanned_record["peak_bytes"] if cuda else sheltered_longest + sum(longest)
    del probe
    static_plan = frozenset(plan_from_estimates(longest, sheltered_longest + sum(longest) - budget))

    # Step k of each trainer in turn (first-use costs of each length hit all three alike).
    trainers = {row: Trainer(torch, spec, device) for row in ROWS}
    planner = MimosePlanner(trainers["input_aware"].switch.layers, budget, batch, fit_sizes)
    for ids, y in data:
        trainers["unplanned"].step(ids, y, frozenset())
        trainers["static"].step(ids, y, static_plan)
        trainer = trainers["input_aware"]
        if not planner.estimator.ready:  # sheltered, with the collector
            collect_start = time.perf_counter()
            layer_bytes = layer_saved_bytes(torch, trainer, ids)
            if cuda:
                torch.cuda.synchronize()
            record = trainer.step(ids, y, every, extra_s=time.perf_counter() - collect_start)
            sheltered = record["peak_bytes"] if cuda else _static_bytes(trainer)
            planner.estimator.observe(ids.numel(), layer_bytes, sheltered + sum(layer_bytes))
        else:
            plan_start = time.perf_counter()
            chosen = planner.plan(ids.numel())
            trainer.step(ids, y, chosen, plan_s=time.perf_counter() - plan_start)
    results = {}
    for row, trainer in trainers.items():
        aware = row == "input_aware"
        peaks = [s["peak_bytes"] for s in trainer.steps if s["peak_bytes"] is not None]
        results[row] = {
            "epoch_s": sum(s["step_s"] + s["collect_s"] + (s["plan_s"] or 0.0) for s in trainer.steps),
            "collect_s_total": sum(s["collect_s"] for s in trainer.steps),
            "plan_s_median": statistics.median(planner.plan_times_s) if aware and planner.plan_times_s else None,
            "plans_made": len(planner.plan_times_s) if aware else None,
            "recomputed_layer_steps": sum(s["recomputed_layers"] for s in trainer.steps),
            "peak_bytes": max(peaks) if peaks else None,
            "steps_over_budget": sum(p > budget for p in peaks) if row != "unplanned" and peaks else None,
            "losses": trainer.losses,
            "steps": trainer.steps,
        }
    reference = results["unplanned"]["losses"]
    for row in ROWS:
        results[row]["losses_bitwise_equal"] = results[row]["losses"] == reference
        results[row]["losses_max_rel_diff"] = max(abs(a - b) / abs(b) if b else abs(a)
                                                  for a, b in zip(results[row]["losses"], reference))
    speedup = results["static"]["epoch_s"] / results["input_aware"]["epoch_s"]
    return {
        "benchmark": "gpu_mimose", "model": f"bert-{config}", "overrides": overrides, "batch": batch,
        "layers": len(spec.model.layers), "steps": steps, "seed": seed, "attention": attention,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "budget_bytes": budget, "budget_margin": budget_margin,
        "budget_over_unplanned_peak_at_longest": budget / unplanned_longest,
        "static_plan_layers": sorted(static_plan), "rows": results,
        "speedup_epoch": speedup,
        "ceiling_epoch": results["static"]["epoch_s"] / results["unplanned"]["epoch_s"],
        "target_speedup": TARGET_SPEEDUP, "target_met": speedup >= TARGET_SPEEDUP,
    }


def print_result(result: dict[str, Any]) -> None:
    print(f"gpu_mimose: {result['model']} {result['overrides'] or ''} batch {result['batch']}, {result['steps']} steps, "
          f"lengths {MIN_LENGTH}..{MAX_LENGTH}, on {result['device']} (torch {result['torch']}); budget "
          f"{result['budget_bytes'] / 2**20:.1f} MiB ({result['budget_over_unplanned_peak_at_longest']:.2f} of the "
          f"unplanned peak at {MAX_LENGTH}); static plan recomputes layers {result['static_plan_layers']}")
    print(f"{'row':<12} {'epoch s':>9} {'collect s':>9} {'plans':>6} {'plan µs':>8} {'recomputed':>10} "
          f"{'peak MiB':>9} {'over budget':>11} {'bitwise':>7}")
    for row, r in result["rows"].items():
        plan_us = f"{r['plan_s_median'] * 1e6:.0f}" if r["plan_s_median"] is not None else "-"
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else "-"
        over = r["steps_over_budget"] if r["steps_over_budget"] is not None else "-"
        print(f"{row:<12} {r['epoch_s']:>9.3f} {r['collect_s_total']:>9.3f} {r['plans_made'] or '-':>6} {plan_us:>8} "
              f"{r['recomputed_layer_steps']:>10} {peak:>9} {over:>11} {str(r['losses_bitwise_equal']):>7}")
    print(f"static / input-aware epoch: {result['speedup_epoch']:.3f}x (target >= {TARGET_SPEEDUP}); "
          f"ceiling (static / unplanned): {result['ceiling_epoch']:.3f}x")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_mimose", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", help="bert config (default small, as benchmarks/mimose.py)")
    parser.add_argument("--layers", type=int, default=None, help="override the config's encoder layers")
    parser.add_argument("--d-model", type=int, default=None, help="override the config's width")
    parser.add_argument("--heads", type=int, default=None, help="override the config's attention heads")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--steps", type=int, default=200, help="batches in the epoch (default 200)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-margin", type=float, default=0.05,
                        help="budget above the static plan's peak at the longest length (default 0.05)")
    parser.add_argument("--attention", choices=("math", "default"), default="math",
                        help="scaled-dot-product attention backend (default math: deterministic)")
    parser.add_argument("--fit-sizes", type=int, default=10, help="sizes the estimator is fitted from (default 10)")
    parser.add_argument("--out", required=True, help="JSON result file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    # Deterministic cuBLAS needs this before CUDA starts (torch is imported lazily, in measure).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args = parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 2), ("--batch", args.batch, 1), ("--fit-sizes", args.fit_sizes, 1)):
        if value is not None and value < least:
            raise SystemExit(f"gpu_mimose: {flag} must be at least {least}, got {value}")
    if not args.budget_margin >= 0:
        raise SystemExit(f"gpu_mimose: --budget-margin must be >= 0, got {args.budget_margin}")
    overrides = {k: v for k, v in (("layers", args.layers), ("d_model", args.d_model), ("heads", args.heads))
                 if v is not None}
    result = measure(args.config, args.device, args.steps, args.seed, args.budget_margin, args.batch,
                     args.fit_sizes, overrides, args.attention)
    print_result(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
