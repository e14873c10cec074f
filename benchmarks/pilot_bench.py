"""Pilot benchmark: accuracy per family (held-out ones flagged), inference and mapping latency,
and the partition simulator against even splits.

Run ``python -m benchmarks.pilot_bench [--pilot PATH] [--samples N] [--calls N] [--out DIR]``.
:func:`measure_pilot` is the callable part (``benchmarks.dynn`` can call it). In one process:

1. **Accuracy**: for every dynamic family's ``tiny`` config, ``--samples`` batches (batch 1 and
   the family's default batch, seeds disjoint from training) through ``Pilot.predict``: exact
   path (predicted path == ``model.path``) and per execution block (the fraction of true
   execution blocks reproduced at the same position). Held-out families come from the pilot
   ONNX's metadata.
2. **Latency**: ``--calls`` calls per family of the ONNX Runtime session alone with features
   prebuilt (``Pilot.run``, one thread, IOBinding: ``inference_us``) and of the mapping alone
   (``PathMapper.map`` on that output: ``mapping_us``), medians and 90th percentiles; plus the
   feature building (the model's embedding and pooling) for reference.
3. **Partition**: for the test paths of each family's ``--partition-config`` (default
   ``small``: tiny blocks are too small for copies to matter), simulated time of the partition
   simulator's execution blocks against the best even split by op count, by time and by bytes
   (each with its best number of blocks that fits the migration half); ratios > 1 mean the
   even split is slower. Two regimes: block times as measured on this CPU (compute-bound: the
   tiny blocks' parameters cross a 12 GB/s link in microseconds) and the same times divided by
   ``ACCELERATOR_SPEEDUP`` (an accelerator's compute over the same link, where copies matter).

Targets (issue 8): inference median <= 30 us, mapping <= 15 us, held-out exact path >= 0.95.
Every number in the output is measured in the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks import common as bench

RESULT_FILE = "pilot.json"
TABLE_WIDTH = 150
FAMILIES = ("var-bert", "fixed-bert", "moe", "tree-lstm", "var-lstm", "fixed-lstm", "recycle-former")
DEFAULT_SAMPLES = 200
DEFAULT_CALLS = 3000
TEST_SEED = 7_000_001
INFERENCE_TARGET_US = 30.0
MAPPING_TARGET_US = 15.0
HELD_OUT_TARGET = 0.95
ACCELERATOR_SPEEDUP = 50.0
"""Compute-speed ratio of the simulated accelerator regime against this CPU (assumption)."""
REGIMES = {"cpu": 1.0, "accelerator": 1.0 / ACCELERATOR_SPEEDUP}


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _partition_comparison(family: str, config: str, samples: int) -> dict[str, Any]:
    """Partition simulator vs the best even splits on ``samples`` paths of ``family``/``config``
    (``tiny`` when ``config``'s path space is too large to enumerate), in both regimes."""
    from dataclasses import replace

    from models.dynamic import get_dynamic_model
    from ort_offload.dynamic.pilot_support import pilot_architecture
    from pilot.partition import EVEN_SPLIT_KINDS, best_even_split, partition, simulate
    from pilot.paths import PathSpaceTooLargeError

    try:
        spec = get_dynamic_model(family, config)
        arch = pilot_architecture(spec)
    except PathSpaceTooLargeError:
        config = "tiny"
        spec = get_dynamic_model(family, config)
        arch = pilot_architecture(spec)
    out: dict[str, Any] = {"config": config, "migration_half_bytes": arch.link.migration_half_bytes,
                           "bandwidth": arch.link.bandwidth, "block_overhead_s": arch.link.block_overhead_s}
    for regime, factor in REGIMES.items():
        ratios: dict[str, list[float]] = {k: [] for k in EVEN_SPLIT_KINDS}
        fits, optimal_blocks, optimal_times = True, [], []
        for i in range(samples):
            (ids,), _ = spec.make_batch(1, seed=TEST_SEED + i)
            costs = [replace(c, time_s=c.time_s * factor) for c in arch.costs(tuple(spec.model.path(ids)))]
            blocks = partition(costs, arch.link)
            optimum = simulate(costs, blocks, arch.link)
            fits &= optimum.fits
            optimal_blocks.append(len(blocks))
            optimal_times.append(optimum.time_s)
            for kind in EVEN_SPLIT_KINDS:
                even = best_even_split(costs, arch.link, kind)
                if even is not None:
                    ratios[kind].append(simulate(costs, even, arch.link).time_s / optimum.time_s)
        out[regime] = {
            "compute_time_factor": factor,
            "optimal_fits_half": fits,
            "optimal_blocks_mean": float(np.mean(optimal_blocks)),
            "optimal_time_us_mean": float(np.mean(optimal_times) * 1e6),
            **{f"even_{k}_over_optimal_mean": float(np.mean(v)) if v else None for k, v in ratios.items()},
            **{f"even_{k}_over_optimal_max": float(np.max(v)) if v else None for k, v in ratios.items()},
        }
    return out


def measure_pilot(*, pilot_path: str | Path | None = None, samples: int = DEFAULT_SAMPLES, calls: int = DEFAULT_CALLS,
                  families: Sequence[str] = FAMILIES, partition_config: str = "small",
                  log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Measure the pilot (see the module docstring); returns the result document."""
    from models.dynamic import get_dynamic_model
    from ort_offload.dynamic.pilot_support import pilot_architecture
    from pilot.inference import DEFAULT_PILOT_PATH, Pilot
    path = Path(pilot_path) if pilot_path else DEFAULT_PILOT_PATH
    pilot = Pilot(path)
    meta = pilot.session.get_modelmeta().custom_metadata_map
    training = json.loads(meta.get("ort_offload.pilot", "{}"))
    holdout = set(training.get("holdout", ()))
    result: dict[str, Any] = {"pilot": str(path), "pilot_training": training, "samples": samples, "calls": calls,
                              "families": {}}
    for family in families:
        log(f"pilot: {family}")
        spec = get_dynamic_model(family, "tiny")
        arch = pilot_architecture(spec)
        mapper = pilot.attach(spec.model, arch)
        row: dict[str, Any] = {"held_out": family in holdout, "candidates": len(arch.candidates),
                               "encoding_collisions": mapper.collisions,
                               "migration_half_bytes": arch.link.migration_half_bytes}
        for batch in sorted({1, spec.default_batch}):
            exact = right_blocks = total_blocks = 0
            for i in range(samples):
                (ids,), _ = spec.make_batch(batch, seed=TEST_SEED + i)
                truth = tuple(spec.model.path(ids))
                prediction = pilot.predict(spec.model, (ids,))
                exact += prediction.path == truth
                true_groups = [truth[s:e] for s, e in arch.execution_blocks(truth)]
                got = prediction.groups()
                total_blocks += len(true_groups)
                right_blocks += sum(1 for j, g in enumerate(true_groups) if j < len(got) and got[j] == g)
            row[f"batch{batch}"] = {"batch": batch, "exact_path": exact / samples,
                                    "per_block": right_blocks / max(total_blocks, 1)}
        # latency, features prebuilt
        (ids,), _ = spec.make_batch(1, seed=TEST_SEED)
        features = pilot.features(spec.model, (ids,))
        for _ in range(200):
            pilot.run(features, arch.one_hot)
        inference, mapping, building = [], [], []
        for _ in range(calls):
            start = time.perf_counter()
            raw = pilot.run(features, arch.one_hot)
            middle = time.perf_counter()
            mapper.map(raw)
            end = time.perf_counter()
            inference.append((middle - start) * 1e6)
            mapping.append((end - middle) * 1e6)
        for _ in range(min(calls, 500)):
            start = time.perf_counter()
            pilot.features(spec.model, (ids,))
            building.append((time.perf_counter() - start) * 1e6)
        row["inference_us"] = {"median": statistics.median(inference), "p90": _percentile(inference, 90)}
        row["mapping_us"] = {"median": statistics.median(mapping), "p90": _percentile(mapping, 90)}
        row["features_us"] = {"median": statistics.median(building), "p90": _percentile(building, 90)}
        result["families"][family] = row
    for family in families:
        log(f"partition: {family}")
        result["families"][family]["partition"] = _partition_comparison(family, partition_config, samples)
    rows = result["families"].values()
    held = [r["batch1"]["exact_path"] for r in rows if r["held_out"]]
    result["summary"] = {
        "inference_us_median_max": max(r["inference_us"]["median"] for r in rows),
        "mapping_us_median_max": max(r["mapping_us"]["median"] for r in rows),
        "held_out_exact_path_min": min(held) if held else None,
        "targets": {"inference_us": INFERENCE_TARGET_US, "mapping_us": MAPPING_TARGET_US,
                    "held_out_exact_path": HELD_OUT_TARGET},
    }
    s = result["summary"]
    s["inference_ok"] = s["inference_us_median_max"] <= INFERENCE_TARGET_US
    s["mapping_ok"] = s["mapping_us_median_max"] <= MAPPING_TARGET_US
    s["held_out_ok"] = held != [] and min(held) >= HELD_OUT_TARGET
    return result


def print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"pilot: {result['pilot']} (held out: {', '.join(result['pilot_training'].get('holdout', [])) or 'none'})")
    for column in ("family", "held out", "exact b=1", "block b=1", "exact b=B", "infer µs", "map µs", "feat µs",
                   "ops/opt cpu", "time/opt cpu", "bytes/opt cpu", "ops/opt acc", "time/opt acc", "bytes/opt acc"):
        table.add_column(column, justify="right" if column != "family" else "left")
    for family, r in result["families"].items():
        batched = [v for k, v in r.items() if k.startswith("batch") and v["batch"] != 1]
        b = batched[0] if batched else r["batch1"]
        def ratio(kind, regime):
            value = r["partition"][regime][f"even_{kind}_over_optimal_mean"]
            return "-" if value is None else f"{value:.3f}"

        table.add_row(family, "yes" if r["held_out"] else "no", f"{r['batch1']['exact_path']:.3f}",
                      f"{r['batch1']['per_block']:.3f}", f"{b['exact_path']:.3f} (B={b['batch']})",
                      f"{r['inference_us']['median']:.1f}", f"{r['mapping_us']['median']:.1f}",
                      f"{r['features_us']['median']:.0f}",
                      *(ratio(k, g) for g in ("cpu", "accelerator") for k in ("ops", "time", "bytes")))
    console.print(table)
    s = result["summary"]
    console.print(f"inference median max {s['inference_us_median_max']:.1f} µs (target {INFERENCE_TARGET_US}: "
                  f"{'ok' if s['inference_ok'] else 'MISSED'}); mapping median max {s['mapping_us_median_max']:.1f} µs "
                  f"(target {MAPPING_TARGET_US}: {'ok' if s['mapping_ok'] else 'MISSED'}); held-out exact path min "
                  f"{s['held_out_exact_path_min']} (target {HELD_OUT_TARGET}: "
                  f"{'n/a, nothing held out' if s['held_out_exact_path_min'] is None else 'ok' if s['held_out_ok'] else 'MISSED'})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pilot_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--pilot", default=None, help="pilot ONNX (default: the committed pilot/pilot.onnx)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="test batches per family and batch size")
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS, help="timed calls per family")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--partition-config", default="small",
                        help="config of the partition comparison (default small; tiny where small's paths are too many)")
    parser.add_argument("--result-file", default=RESULT_FILE, help=f"JSON file name (default {RESULT_FILE})")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results/<date>)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.calls < 1:
        raise SystemExit("--samples and --calls must be at least 1")
    args.families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    if args.pilot is not None and not Path(args.pilot).is_file():
        raise SystemExit(f"--pilot {args.pilot}: no such file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return bench.run_main(
        module="benchmarks.pilot_bench", result_file=args.result_file, argv=argv, out=args.out, table_width=TABLE_WIDTH,
        measure=lambda log: measure_pilot(pilot_path=args.pilot, samples=args.samples, calls=args.calls,
                                          families=args.families, partition_config=args.partition_config, log=log),
        print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
