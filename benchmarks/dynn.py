"""Dynamic networks with the pilot (DyNN-Offload): capacity, step time, mispredictions.

Run ``python -m benchmarks.dynn [--quick] [--out DIR] [--predictor pilot|oracle]``.

0. **Pilot** (:mod:`benchmarks.pilot_bench`): the pilot trained with var-LSTM and var-BERT held
   out (``pilot/pilot-holdout.onnx``): exact-path and per-block accuracy per family, inference
   and mapping microseconds, partition simulator vs even splits. The runtime's predictor in
   sections 2 and 3 is the all-family pilot (``pilot/pilot.onnx``) unless ``--predictor oracle``.
1. **Capacity** (var-BERT ``deep``: d_model 128, 4 heads, sequences of 64, batch 8; every batch
   takes the full depth): the budget is fixed at the no-offload peak of the
   ``base_layers``-layer model. "Without ort_offload" is the same runtime with the whole model
   resident (parameters, gradients, AdamW state, every saved activation: what a framework that
   keeps the model on the device holds; same arena, same accounting): the deepest model whose
   step fits. "With ort_offload": block-wise training under the same budget, depth doubling
   from ``base_layers`` until a step fails or ``max_layers`` (a cap on run time, reported as
   such). Each depth is a real training step, peak checked against the budget.
   Target: ≥ 8× deeper.
2. **Step time** (var-BERT ``small``, variable depth): at budgets 0.5x and 0.25x of the
   no-offload peak (measured on the first, deepest batch), median step time of: the
   unlimited-memory run (blocks on host arrays, no copies), prefetch guided by the predictor
   (with asynchronous pre-eviction of saved activations), and on-demand fetching only (no
   prediction, no prefetch, eviction when room is needed: every tensor arrives by tensor fault,
   the unified-memory-like baseline). The
   trainers' steps are interleaved on the same batches, so machine noise hits all alike; losses
   and parameters are compared bitwise with the unlimited run. The CPU has no copy engine
   (a copy is a memcpy on the cores the blocks compute on), so each budgeted step's event trace
   is also replayed on the V100 and H100 profiles (:mod:`graph_passes.cost.trace_replay`): simulated
   step time as % of the same step with unlimited memory.
3. **Mispredictions** over ``samples`` single-sample batches of every dynamic family: training
   steps with the predictor, with and without the misprediction cache (a batch whose raw pilot
   output equals an earlier mispredicted one's gets that batch's true path).

JSON goes to ``benchmarks/results/<YYYY-MM-DD>/dynn.json`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from typing import Any, Callable, Sequence


from benchmarks import common as bench

RESULT_FILE = "dynn.json"
TABLE_WIDTH = 150


@dataclasses.dataclass(frozen=True)
class Settings:
    capacity_config: str = "deep"
    capacity_batch: int = 8
    base_layers: int = 8
    max_layers: int = 128
    time_model: str = "var-bert"
    time_config: str = "small"
    time_batch: int = 8
    budgets: tuple[str, ...] = ("0.5x", "0.25x")
    time_steps: int = 8  # measured, after one warm-up step
    time_first_key: int | None = 4  # the warm-up batch takes the deepest path: budgets are fractions of its peak
    misprediction_families: tuple[str, ...] = ("var-bert", "fixed-bert", "moe", "tree-lstm", "var-lstm", "fixed-lstm",
                                               "recycle-former")
    samples: int = 1000
    pilot_samples: int = 200
    pilot_calls: int = 3000


FULL = Settings()
QUICK = Settings(capacity_config="deep", base_layers=8, max_layers=16, time_model="moe", time_config="tiny",
                 time_steps=3, time_first_key=None,
                 misprediction_families=("var-bert", "moe"), samples=40, pilot_samples=20, pilot_calls=300)


def make_predictor(kind: str) -> Callable[[Any], Any]:
    """A factory ``spec -> predictor`` for ``kind`` ("oracle" or "pilot")."""
    from pilot.prediction import OraclePredictor

    if kind == "oracle":
        return lambda spec: OraclePredictor()
    if kind == "pilot":
        from ort_offload.dynamic.pilot_support import make_pilot
        from pilot.inference import Pilot

        shared = Pilot()  # the committed all-family pilot; one session serves every model
        return lambda spec: make_pilot(spec, pilot=shared)
    raise SystemExit(f"unknown predictor {kind!r}: use pilot or oracle")


# ---- 1. capacity ------------------------------------------------------------------------------


def _deep_spec(settings: Settings, layers: int):
    from models import get_dynamic_model

    # Segments of 8 layers as in the deep config; every batch takes all of them (key = segments).
    return get_dynamic_model("var-bert", settings.capacity_config, seed=0, layers=layers, segments=max(1, layers // 8))


def _capacity_step(settings: Settings, layers: int, budget: int | None, residency: str, cache) -> dict:
    """One training step of the ``layers``-deep model; the peak, or the error that stopped it."""
    import ort_offload
    from ort_offload.dynamic.trainer import BlockwiseTrainer
    from ort_offload.errors import BudgetTooSmallError

    spec = _deep_spec(settings, layers)
    inputs, targets = spec.make_batch(settings.capacity_batch, seed=0, key=spec.config.segments)
    device = ort_offload.set_offload_device("cpu", budget=budget)
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, device=device, cache=cache, measure_baseline=False,
                               residency=residency)
    started = time.perf_counter()
    try:
        trainer.step(*inputs, *targets)
        peak = trainer.runtime.peak
        return {"layers": layers, "trains": budget is None or peak <= budget, "peak_bytes": peak,
                "step_s": time.perf_counter() - started, "params": sum(p.numel() for p in spec.model.parameters())}
    except BudgetTooSmallError as e:
        return {"layers": layers, "trains": False, "needed_bytes": e.needed_bytes, "error": str(e)}
    finally:
        trainer.close()
        del trainer, spec
        gc.collect()


def run_capacity(settings: Settings, log) -> dict:
    from ort_offload.dynamic.blockwise import BlockStepCache

    cache = BlockStepCache()
    base = _capacity_step(settings, settings.base_layers, None, "resident", cache)
    budget = base["peak_bytes"]
    log(f"capacity: budget = no-offload peak of {settings.base_layers} layers = {budget} bytes")
    without, with_offload = [], []
    layers = settings.base_layers
    while True:  # without offload: grow by one segment (8 layers) until the step no longer fits
        row = _capacity_step(settings, layers, budget, "resident", cache)
        without.append(row)
        log(f"  without offload, {layers} layers: {'fits' if row['trains'] else 'does not fit'}")
        if not row["trains"] or layers >= settings.max_layers:
            break
        layers += 8
    layers = settings.base_layers
    while layers <= settings.max_layers:
        row = _capacity_step(settings, layers, budget, "offload", cache)
        with_offload.append(row)
        log(f"  with ort_offload, {layers} layers: {'trains' if row['trains'] else 'fails'} ({row.get('step_s', 0):.1f} s)")
        if not row["trains"]:
            break
        layers *= 2
    deepest_without = max((r["layers"] for r in without if r["trains"]), default=0)
    deepest_with = max((r["layers"] for r in with_offload if r["trains"]), default=0)
    capped = bool(with_offload) and with_offload[-1]["trains"] and with_offload[-1]["layers"] >= settings.max_layers
    return {
        "budget_bytes": budget, "base_layers": settings.base_layers, "without": without, "with": with_offload,
        "deepest_without": deepest_without, "deepest_with": deepest_with, "with_capped_by_max_layers": capped,
        "ratio": deepest_with / deepest_without if deepest_without else None,
    }


# ---- 2. step time -----------------------------------------------------------------------------


def run_step_time(settings: Settings, predictor_factory, log) -> dict:
    from models import get_dynamic_model
    from ort_offload.dynamic.blockwise import BlockStepCache
    from ort_offload.dynamic.trainer import BlockwiseTrainer
    from pilot.prediction import NoPredictor
    import ort_offload

    cache = BlockStepCache()
    steps = settings.time_steps + 1
    batches = []
    probe = get_dynamic_model(settings.time_model, settings.time_config, seed=0)
    for step in range(steps):
        key = settings.time_first_key if step == 0 else None
        batches.append(probe.make_batch(settings.time_batch, seed=1000 + step, key=key))
    rows = []
    for budget in settings.budgets:
        def trainer_for(kind: str):
            spec = get_dynamic_model(settings.time_model, settings.time_config, seed=0)
            if kind == "unlimited":
                return BlockwiseTrainer(spec.model, spec.loss_fn, cache=cache)
            device = ort_offload.set_offload_device("cpu", budget=budget)
            if kind == "prefetch":
                return BlockwiseTrainer(spec.model, spec.loss_fn, device=device, cache=cache,
                                        predictor=predictor_factory(spec), pre_evict=True)
            return BlockwiseTrainer(spec.model, spec.loss_fn, device=device, cache=cache, predictor=NoPredictor(),
                                    prefetch=False)

        kinds = ("unlimited", "prefetch", "on_demand")
        trainers = {k: trainer_for(k) for k in kinds}
        times = {k: [] for k in kinds}
        for step, (inputs, targets) in enumerate(batches):
            for kind in kinds:
                started = time.perf_counter()
                trainers[kind].step(*inputs, *targets)
                if step > 0:
                    times[kind].append(time.perf_counter() - started)
                time.sleep(0.05)
        reference = trainers["unlimited"]
        ref_state = reference.flat_state()
        simulated = {kind: _simulate(trainers[kind].runtime.step_traces[-settings.time_steps:])
                     for kind in ("prefetch", "on_demand")}
        row: dict[str, Any] = {"budget": budget}
        for kind in kinds:
            trainer = trainers[kind]
            report = trainer.report()
            row[kind] = {
                "step_s_median": bench.median(times[kind]),
                "bitwise": bench.bitwise_equal(trainer.losses, reference.losses)
                and not bench.state_mismatches(trainer.flat_state(), ref_state),
                "peak_bytes": report["peak_device_bytes"], "budget_bytes": report["budget_bytes"],
                "baseline_peak_bytes": report["baseline_peak_bytes"],
                "faults": report["faults"], "prefetch_hits": report["prefetch_hits"],
                "stall_s": report["stall_time_s"], "swap_in_bytes": report["swap_in_bytes"],
                "swap_out_bytes": report["swap_out_bytes"], "exact_path_accuracy": report["exact_path_accuracy"],
                "simulated": simulated.get(kind),
            }
            trainer.close()
        unlimited = row["unlimited"]["step_s_median"]
        for kind in ("prefetch", "on_demand"):
            row[kind]["ratio_to_unlimited"] = row[kind]["step_s_median"] / unlimited
        log(f"  step time at {budget}: prefetch {row['prefetch']['ratio_to_unlimited']:.2f}x, "
            f"on-demand {row['on_demand']['ratio_to_unlimited']:.2f}x of unlimited")
        rows.append(row)
    return {"model": f"{settings.time_model} {settings.time_config}", "batch": settings.time_batch,
            "measured_steps": settings.time_steps, "rows": rows}


SIMULATED_PROFILES = ("V100-16GB-PCIe3", "H100")


def _simulate(traces) -> dict:
    """Median over the measured steps of each trace replayed on the GPU profiles: simulated
    step time as % of the same step with unlimited memory (compute alone)."""
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.trace_replay import replay

    out = {}
    for name in SIMULATED_PROFILES:
        profile = get_profile(name)
        results = [replay(trace, profile) for trace in traces]
        out[name] = {
            "percent_of_unlimited": 100 * bench.median([r.efficiency for r in results]),
            "step_ms_median": 1e3 * bench.median([r.step_s for r in results]),
            "unlimited_ms_median": 1e3 * bench.median([r.compute_s for r in results]),
            "stall_ms_median": 1e3 * bench.median([r.stall_s for r in results]),
        }
    return out


# ---- 3. mispredictions ----------------------------------------------------------------------------


def run_mispredictions(settings: Settings, predictor_factory, log) -> dict:
    from models import get_dynamic_model
    from ort_offload.dynamic.blockwise import BlockStepCache
    from ort_offload.dynamic.trainer import BlockwiseTrainer
    import ort_offload

    rows = []
    for family in settings.misprediction_families:
        cache = BlockStepCache()
        row: dict[str, Any] = {"family": family, "samples": settings.samples}
        for use_cache in (False, True):
            spec = get_dynamic_model(family, "tiny", seed=0)
            trainer = BlockwiseTrainer(spec.model, spec.loss_fn, device=ort_offload.set_offload_device("cpu"),
                                       cache=cache, predictor=predictor_factory(spec), misprediction_cache=use_cache,
                                       measure_baseline=False)
            started = time.perf_counter()
            for sample in range(settings.samples):
                inputs, targets = spec.make_batch(1, seed=50_000 + sample)
                trainer.step(*inputs, *targets)
            report = trainer.report()
            trainer.close()
            key = "with_cache" if use_cache else "without_cache"
            row[key] = {"mispredictions": report["mispredictions"], "cache_hits": report["misprediction_cache_hits"],
                        "faults": report["faults"], "exact_path_accuracy": report["exact_path_accuracy"],
                        "block_accuracy": report["block_accuracy"], "seconds": time.perf_counter() - started}
        log(f"  {family}: mispredictions {row['without_cache']['mispredictions']} without the cache, "
            f"{row['with_cache']['mispredictions']} with it")
        rows.append(row)
    return {"rows": rows}


# ---- frame ----------------------------------------------------------------------------------------


def run(settings: Settings, predictor: str, sections: Sequence[str], log) -> dict:
    factory = make_predictor(predictor)
    result: dict[str, Any] = {"benchmark": "dynn", "settings": dataclasses.asdict(settings), "predictor": predictor}
    if "pilot" in sections:
        from benchmarks.pilot_bench import measure_pilot
        from pilot.inference import DEFAULT_PILOT_PATH

        log("pilot: accuracy (held-out families), inference and mapping time, partitions")
        result["pilot"] = measure_pilot(pilot_path=DEFAULT_PILOT_PATH.with_name("pilot-holdout.onnx"),
                                        samples=settings.pilot_samples, calls=settings.pilot_calls, log=log)
    if "capacity" in sections:
        log("capacity (var-BERT deep)")
        result["capacity"] = run_capacity(settings, log)
    if "time" in sections:
        log("step time")
        result["step_time"] = run_step_time(settings, factory, log)
    if "mispredictions" in sections:
        log("mispredictions")
        result["mispredictions"] = run_mispredictions(settings, factory, log)
    result["targets"] = _targets(result)
    return result


def _targets(result: dict) -> dict:
    targets: dict[str, Any] = {}
    capacity = result.get("capacity")
    if capacity and capacity["ratio"] is not None:
        targets["capacity_ratio_ge_8"] = capacity["ratio"] >= 8
    pilot = result.get("pilot")
    if pilot:
        summary = pilot["summary"]
        targets.update({"pilot_inference_us_le_30": summary["inference_ok"], "pilot_mapping_us_le_15": summary["mapping_ok"],
                        "held_out_exact_path_ge_0.95": summary["held_out_ok"]})
    return targets


def print_table(result: dict, console) -> None:
    from rich.table import Table

    from ort_offload.budget import format_bytes

    if result.get("pilot"):
        from benchmarks.pilot_bench import print_table as print_pilot_table

        print_pilot_table(result["pilot"], console)
    capacity = result.get("capacity")
    if capacity:
        table = Table(title=f"capacity: var-BERT deep at budget {format_bytes(capacity['budget_bytes'])} "
                            f"(no-offload peak of {capacity['base_layers']} layers)")
        for column in ("mode", "layers", "parameters", "trains", "peak", "step s"):
            table.add_column(column)
        for mode in ("without", "with"):
            for row in capacity[mode]:
                table.add_row(mode, str(row["layers"]), f"{row.get('params', 0):,}" if "params" in row else "-",
                              "yes" if row["trains"] else "no",
                              format_bytes(row["peak_bytes"]) if "peak_bytes" in row else f"needs {format_bytes(row['needed_bytes'])}",
                              f"{row['step_s']:.2f}" if "step_s" in row else "-")
        console.print(table)
        capped = " (capped by max_layers)" if capacity["with_capped_by_max_layers"] else ""
        console.print(f"deepest without: {capacity['deepest_without']}, with: {capacity['deepest_with']}{capped}, "
                      f"ratio {capacity['ratio']}")
    step_time = result.get("step_time")
    if step_time:
        table = Table(title=f"step time: {step_time['model']}, batch {step_time['batch']}, "
                            f"median of {step_time['measured_steps']} interleaved steps")
        for column in ("budget", "mode", "step s", "x unlimited", "peak", "faults", "prefetch hits", "stall s",
                       *(f"{p} % (sim)" for p in SIMULATED_PROFILES), "bitwise"):
            table.add_column(column)
        for row in step_time["rows"]:
            for mode in ("unlimited", "prefetch", "on_demand"):
                r = row[mode]
                table.add_row(row["budget"] if mode == "unlimited" else "", mode, f"{r['step_s_median']:.4f}",
                              f"{r.get('ratio_to_unlimited', 1.0):.2f}",
                              format_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
                              str(r["faults"]), str(r["prefetch_hits"]), f"{r['stall_s']:.3f}",
                              *((f"{r['simulated'][p]['percent_of_unlimited']:.1f}" if r.get("simulated") else "100")
                                for p in SIMULATED_PROFILES),
                              "yes" if r["bitwise"] else "NO")
        console.print(table)
    mispredictions = result.get("mispredictions")
    if mispredictions:
        table = Table(title=f"mispredictions ({result['predictor']} predictor)")
        for column in ("family", "samples", "without cache", "with cache", "cache hits", "exact path", "per block"):
            table.add_column(column)
        for row in mispredictions["rows"]:
            w = row["with_cache"]
            table.add_row(row["family"], str(row["samples"]), str(row["without_cache"]["mispredictions"]),
                          str(w["mispredictions"]), str(w["cache_hits"]),
                          f"{row['without_cache']['exact_path_accuracy']:.3f}", f"{row['without_cache']['block_accuracy']:.3f}")
        console.print(table)
    console.print(f"targets: {result['targets']}")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynn", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings (a minute)")
    parser.add_argument("--predictor", default="pilot", choices=["pilot", "oracle"],
                        help="who predicts paths for prefetching (default: the trained pilot)")
    parser.add_argument("--sections", default="pilot,capacity,time,mispredictions",
                        help="comma list of pilot, capacity, time, mispredictions")
    parser.add_argument("--samples", type=int, default=None, help="samples per family for the misprediction count")
    parser.add_argument("--out", default=None, help="directory for dynn.json (default: benchmarks/results/<date>)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.samples is not None:
        if args.samples < 1:
            raise SystemExit("--samples must be at least 1")
        settings = dataclasses.replace(settings, samples=args.samples)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"pilot", "capacity", "time", "mispredictions"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: use pilot, capacity, time, mispredictions")
    return bench.run_main(
        module="benchmarks.dynn", result_file=RESULT_FILE, argv=argv, out=args.out, table_width=TABLE_WIDTH,
        measure=lambda log: run(settings, args.predictor, sections, log), print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
