"""The overhead benchmark's quick mode runs end to end and writes consistent JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # the quick run takes ~20 s; the bound only stops a hung run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc, json.loads((out / "overhead.json").read_text())


def test_writes_only_the_result_file(quick_run):
    out, proc, _ = quick_run
    assert sorted(os.listdir(out)) == ["overhead.json"]  # no temporary file left behind
    assert "ratio" in proc.stdout and "overhead.json" in proc.stdout


def test_keys_and_machine_info(quick_run):
    _, _, result = quick_run
    for key in ("benchmark", "mode", "command", "machine", "model", "settings", "export", "baseline",
                "ours", "target_ratio", "ratio", "meets_target", "timestamp", "total_time_s"):
        assert key in result, key
    assert result["mode"] == "quick"
    assert "benchmarks.overhead" in result["command"] and "--quick" in result["command"]
    for key in ("cpu_count", "platform", "python", "onnxruntime", "torch"):
        assert result["machine"][key], key
    model = result["model"]
    assert model["name"] == "gpt" and model["batch"] == 8 and model["graph_nodes"] > 0


def test_ratio_is_consistent_with_the_medians(quick_run):
    _, _, result = quick_run
    settings = result["settings"]
    baseline = result["baseline"]
    medians = {label: row["median_step_s"] for label, row in baseline["variants"].items()}
    assert set(medians) == {"ort.run", "ort.iobinding"}
    assert baseline["chosen"] == min(medians, key=medians.get)
    assert baseline["median_step_s"] == min(medians.values())
    for row in baseline["variants"].values():
        assert len(row["step_times_s"]) == settings["measured_steps"]
        assert row["median_step_s"] == pytest.approx(statistics.median(row["step_times_s"]))

    rows = result["ours"]
    assert [str(r["label"]) for r in rows] and len(rows) >= 2
    assert sum(r["is_default"] for r in rows) == 1
    for row in rows:
        times = row["step_times_s"]
        assert len(times) == settings["measured_steps"] and all(t > 0 for t in times)
        assert row["median_step_s"] == pytest.approx(statistics.median(times))
        assert row["median_run_s"] <= row["median_step_s"]  # run() is part of step()
        assert isinstance(row["ratio"], float) and math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert len(row["baseline_step_times_s"]) == settings["measured_steps"]
        assert row["baseline_median_step_s"] == pytest.approx(statistics.median(row["baseline_step_times_s"]))
        assert row["ratio"] == pytest.approx(row["baseline_median_step_s"] / row["median_step_s"])
        assert row["meets_target"] == (row["ratio"] >= result["target_ratio"])
        assert math.isfinite(row["paired_ratio_median"]) and row["paired_ratio_median"] > 0
        assert row["baseline_slowdown"] == pytest.approx(row["baseline_median_step_s"] / baseline["median_step_s"])
        assert row["ratio_vs_baseline_alone"] == pytest.approx(baseline["median_step_s"] / row["median_step_s"])
        assert row["peak_over_baseline_peak"] == pytest.approx(row["peak_device_bytes"] / row["baseline_peak_bytes"])
        # every runner did the same training steps (float32: fusions may reorder sums)
        assert row["max_loss_abs_diff"] <= 1e-5 * max(1.0, max(abs(x) for x in result["losses"]["baseline"]))
    fixed = sorted((r for r in rows if r["max_block_nodes"] is not None), key=lambda r: r["max_block_nodes"])
    assert [r["blocks"] for r in fixed] == sorted((r["blocks"] for r in fixed), reverse=True)
    # The whole-graph setting has the fewest blocks (order-dependent scatters still get their own).
    assert fixed[-1]["blocks"] == min(r["blocks"] for r in rows)

    default = next(r for r in rows if r["is_default"])
    assert default["max_block_nodes"] is None  # the runtime chooses
    assert default["blocks"] == fixed[-1]["blocks"]  # without a budget: the largest blocks
    assert isinstance(result["ratio"], float) and result["ratio"] > 0
    assert result["ratio"] == default["ratio"] and result["meets_target"] == default["meets_target"]


def test_overhead_per_step_and_per_block_follow_from_the_rows(quick_run):
    _, proc, result = quick_run
    from benchmarks.overhead import TARGET_BLOCK_OVERHEAD_S, TARGET_STEP_OVERHEAD_S, fit_per_block

    rows, overhead = result["ours"], result["overhead"]
    for row in rows:
        assert row["overhead_s"] == pytest.approx(row["median_step_s"] - row["baseline_median_step_s"])
        assert row["outside_ort_s"] > 0 and row["in_ort_s"] > 0 and row["outside_ort_cpu_s"] > 0
    default = next(r for r in rows if r["is_default"])
    assert overhead["default_allowance_s"] == pytest.approx(TARGET_STEP_OVERHEAD_S + TARGET_BLOCK_OVERHEAD_S * default["blocks"])
    for name, key in (("vs_plain_session", "overhead_s"), ("outside_ort", "outside_ort_s"),
                      ("outside_ort_cpu", "outside_ort_cpu_s")):
        fit = overhead[name]
        assert fit["default_s"] == default[key]
        expected = fit_per_block(rows, key)
        assert fit["per_step_s"] == pytest.approx(expected["per_step_s"])
        assert fit["per_block_s"] == pytest.approx(expected["per_block_s"])
    assert "per block" in proc.stdout


def test_the_per_block_fit_recovers_a_line():
    from benchmarks.overhead import fit_per_block

    rows = [{"blocks": b, "t": 0.4e-3 + 25e-6 * b} for b in (4, 9, 26, 4)]
    fit = fit_per_block(rows, "t")
    assert fit["per_step_s"] == pytest.approx(0.4e-3) and fit["per_block_s"] == pytest.approx(25e-6)
    assert fit_per_block(rows[:1], "t")["per_block_s"] is None


def test_the_ort_timer_wraps_a_session_that_blocks_share_once():
    """Blocks with the same content share one session: its runs are timed once, and the
    timer comes off cleanly."""
    import types

    from benchmarks.overhead import _OrtTimer

    class Session:
        def run_with_iobinding(self, binding, *args):
            return binding

    shared = types.SimpleNamespace(session=Session())
    trainer = types.SimpleNamespace(runner=types.SimpleNamespace(_sessions={(0, (1,)): shared, (0, (2,)): shared}))
    timer = _OrtTimer(trainer)
    with timer:
        assert shared.session.run_with_iobinding("b") == "b"
    assert len(timer.sessions) == 1 and timer.total_s > 0
    assert "run_with_iobinding" not in vars(shared.session)


def test_export_times(quick_run):
    _, _, result = quick_run
    export = result["export"]
    assert export["cache_hit"] == [False, True]
    assert export["export_time_s"] > 0 and export["export_wall_s"] >= export["export_time_s"]
    assert 0 < export["cache_hit_wall_s"] < export["export_wall_s"]


def test_an_out_path_that_is_a_file_is_refused_before_measuring(tmp_path, capsys):
    from benchmarks.common import run_main

    taken = tmp_path / "results.json"
    taken.write_text("{}")
    measured = []
    code = run_main(module="benchmarks.x", result_file="x.json", argv=[], out=taken, table_width=80,
                    measure=lambda log: measured.append(1) or {}, print_table=lambda result, console: None)
    assert code == 2 and not measured and taken.read_text() == "{}"
    assert "is a file" in capsys.readouterr().err
