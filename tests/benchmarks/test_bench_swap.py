"""The swap benchmark's quick mode runs end to end and writes consistent JSON (issue: swap,
acceptance bullet on ``benchmarks/swap.py``)."""

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
TIMEOUT_S = 900  # the quick run takes ~60 s on 2 cores (several under load); the bound only stops a hung run
MODELS = {("gpt", "tiny"), ("cnn", "tiny")}
BUDGETS = ["1.0x", "0.5x", "0.25x", "min"]
PROFILES = ("V100-16GB-PCIe3", "H100")
EVALUATIONS = 40  # the quick run's cap on each GA plan's evaluations


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("swap")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.swap", "--quick", "--plan-evaluations", str(EVALUATIONS), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc, json.loads((out / "swap.json").read_text())


def test_writes_only_the_result_file_and_prints_the_table(quick_run):
    out, proc, _ = quick_run
    assert sorted(os.listdir(out)) == ["swap.json"]  # no temporary file left behind
    assert "swap.json" in proc.stdout and "% unl." in proc.stdout
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout


def test_keys_and_machine_info(quick_run):
    _, _, result = quick_run
    for key in ("benchmark", "mode", "command", "machine", "settings", "models", "rows", "targets", "targets_met",
                "timestamp", "total_time_s"):
        assert key in result, key
    assert result["benchmark"] == "swap" and result["mode"] == "quick"
    assert "benchmarks.swap" in result["command"] and "--quick" in result["command"]
    for key in ("cpu_count", "platform", "python", "onnxruntime", "torch"):
        assert result["machine"][key], key


def test_a_row_for_every_model_and_budget(quick_run):
    _, _, result = quick_run
    seen = {(r["model"], r["config"], r["budget"]) for r in result["rows"]}
    assert seen == {(m, c, b) for m, c in MODELS for b in BUDGETS}
    assert len(result["rows"]) == len(seen)
    assert all(r["status"] == "ok" for r in result["rows"]), [r.get("error") for r in result["rows"]]
    for model in result["models"]:
        assert [r["budget"] for r in model["rows"]] == BUDGETS
        assert 0 < model["min_budget_bytes"] < model["baseline_peak_bytes"]
        assert model["graph_nodes"] > 0 and model["export_s"] > 0


def test_budgets_peaks_and_bitwise_equality(quick_run):
    _, _, result = quick_run
    steps = result["settings"]["warmup_steps"] + result["settings"]["measured_steps"]
    for model in result["models"]:
        ref = model["reference"]
        assert len(ref["losses"]) == steps and all(math.isfinite(x) for x in ref["losses"])
        base = model["baseline_peak_bytes"]
        rows = {r["budget"]: r for r in model["rows"]}
        for fraction in (1.0, 0.5, 0.25):
            assert rows[f"{fraction}x"]["budget_bytes"] == pytest.approx(fraction * base, abs=1)
        assert rows["min"]["budget_bytes"] == model["min_budget_bytes"]
        for row in model["rows"]:
            assert 0 < row["peak_device_bytes"] <= row["budget_bytes"], row["budget"]
            assert row["within_budget"] is True
            assert row["losses_bitwise_equal"] is True and row["state_bitwise_equal"] is True, row["budget"]
            assert row["losses"] == ref["losses"]
            assert row["blocks"] >= 1 and row["plan_time_s"] >= 0
            assert row["split_exact"] is (True if "split" in row["passes"] else None), row["budget"]
        # Below the unplanned peak the swap pass moves bytes both ways; at 1.0x nothing moves.
        assert rows["1.0x"]["swap_out_bytes_per_step"] == 0 and rows["1.0x"]["swap_in_bytes_per_step"] == 0
        for budget in ("0.5x", "0.25x", "min"):
            # The stated minimum is the least budget any allowed pass set reaches: there it may
            # take split beside swap (graph_passes/planning/minimum.py).
            assert rows[budget]["passes"] == ["swap"] or (budget == "min" and "swap" in rows[budget]["passes"])
            assert rows[budget]["swap_out_bytes_per_step"] > 0 and rows[budget]["swap_in_bytes_per_step"] > 0
            assert rows[budget]["faults"] == 0  # static graph, plan intact


def test_step_times_ratios_and_simulated_percentages(quick_run):
    _, _, result = quick_run
    measured = result["settings"]["measured_steps"]
    for row in result["rows"]:
        assert len(row["step_times_s"]) == measured and all(t > 0 for t in row["step_times_s"])
        assert row["median_step_s"] == pytest.approx(statistics.median(row["step_times_s"]))
        assert len(row["ref_step_times_s"]) == measured
        assert row["ref_median_step_s"] == pytest.approx(statistics.median(row["ref_step_times_s"]))
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["median_step_s"] / row["ref_median_step_s"])
        assert row["stall_s_per_step"] >= 0
        for profile in PROFILES:
            sim = row["simulated"][profile]
            assert 0 < sim["pct_of_unlimited"] <= 100.5, (row["model"], row["budget"], profile)
            assert sim["pct_of_unlimited"] == pytest.approx(100 * sim["unlimited_s"] / sim["step_time_s"])
            assert sim["peak_bytes"] <= row["budget_bytes"]
            # The GA (swap only) is never slower than the grid, and no swap plan beats the bound;
            # with recompute allowed, its bound is the compute.
            ga, rc, bound = sim["ga"], sim["ga_recompute"], sim["bound"]
            assert ga["step_time_s"] <= sim["step_time_s"] * (1 + 1e-9)
            assert bound["seconds"] <= min(sim["step_time_s"], ga["step_time_s"]) * (1 + 1e-9)
            if rc.get("status") == "budget_too_small":  # recompute and swap cannot plan this budget
                continue
            assert rc["lower_bound_s"] == bound["compute_s"] <= rc["step_time_s"] * (1 + 1e-9)
            assert ga["plan_search"] is None or ga["plan_search"]["evaluations"] <= EVALUATIONS
            if rc["plan_search"] is not None:  # None where the budget needs no pass
                assert rc["plan_search"]["step_time_s"] <= rc["plan_search"]["grid_step_time_s"] * (1 + 1e-9)
    assert result["settings"]["plan_evaluations"] == EVALUATIONS
    assert {t["model"] for t in result["targets"]} == {m for m, _ in MODELS}
    for target in result["targets"]:
        assert target["met"] == (target["value_pct"] >= target["target_pct"])
    assert result["targets_met"] == all(t["met"] for t in result["targets"])
