"""The Mimose benchmark's quick mode runs end to end and writes consistent JSON (issue 4,
acceptance bullet on ``benchmarks/mimose.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1200  # the quick run takes ~2 min on 2 cores (13 under heavy load); the bound only stops a hung run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mimose")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.mimose", "--quick", "--whole-segments", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc, json.loads((out / "mimose.json").read_text())


def test_writes_the_result_and_prints_the_table(quick_run):
    out, proc, result = quick_run
    assert sorted(os.listdir(out)) == ["mimose.json"]
    assert "static / input-aware" in proc.stdout and ("PASS" in proc.stdout or "FAIL" in proc.stdout)
    assert "by sequence length" in proc.stdout
    assert result["benchmark"] == "mimose" and result["mode"] == "quick"
    assert "benchmarks.mimose" in result["command"]


def test_the_plans_run_the_same_epoch_within_budget_and_bitwise(quick_run):
    _, _, result = quick_run
    epoch = result["epoch"]
    rows = {r["row"]: r for r in epoch["rows"]}
    assert list(rows) == ["unplanned", "static", "input_aware", "whole_segments"]
    lengths = epoch["lengths"]
    assert lengths[0] == max(lengths) == 256 and min(lengths) >= 16
    for name in ("static", "input_aware", "whole_segments"):
        row = rows[name]
        assert row["budget_bytes"] == epoch["budget_bytes"] < epoch["longest_unplanned_peak_bytes"]
        assert row["within_budget"] and row["peak_device_bytes"] <= row["budget_bytes"]
        assert row["losses_bitwise_equal"] and row["state_bitwise_equal"]
        assert [s["length"] for s in row["per_step"]] == lengths
        assert row["recomputed_nodes_run"] > 0
        assert row["epoch_s"] == pytest.approx(sum(s["wall_s"] for s in row["per_step"]))
        # the first plan is made when the trainer is created (for the first, longest batch)
        assert sum(s["new_plan"] for s in row["per_step"]) == row["recompute"]["recompute_plans"] - 1
    assert rows["unplanned"]["recomputed_nodes_run"] == 0
    # the static plan is made once, for the longest batch, and then only reused
    assert rows["static"]["recompute"]["recompute_plans"] == 1
    assert rows["static"]["recompute"]["policy"] == "static"
    assert epoch["speedup_epoch"] == pytest.approx(rows["static"]["epoch_s"] / rows["input_aware"]["epoch_s"])
    assert epoch["speedup_run_existing_plans"] > 0
    # the epoch by length range: every step in exactly one range, the ranges' seconds add up
    ranges = epoch["by_length"]
    assert ranges[0]["lengths"][0] == 16 and ranges[-1]["lengths"][1] == 256
    assert all(a["lengths"][1] + 1 == b["lengths"][0] for a, b in zip(ranges, ranges[1:]))
    assert sum(r["steps"] for r in ranges) == len(lengths)
    for name, row in rows.items():
        assert sum(r["epoch_s"][name] for r in ranges) == pytest.approx(row["epoch_s"])
    for r in ranges:
        if r["steps"]:
            assert r["speedup_epoch"] == pytest.approx(r["epoch_s"]["static"] / r["epoch_s"]["input_aware"])
            assert r["recomputed_nodes_per_step"]["static"][0] == rows["static"]["per_step"][0]["recomputed_nodes"]
    forced = sum(max(0.0, a["wall_s"] - u["wall_s"]) for u, s, a in zip(
        rows["unplanned"]["per_step"], rows["static"]["per_step"], rows["input_aware"]["per_step"])
        if a["recomputed_nodes"] >= s["recomputed_nodes"])
    assert epoch["speedup_epoch_bound_free_where_fewer"] == pytest.approx(
        rows["static"]["epoch_s"] / (rows["unplanned"]["epoch_s"] + forced))
    assert epoch["speedup_ceiling_epoch"] == pytest.approx(rows["static"]["epoch_s"] / rows["unplanned"]["epoch_s"])
    # --whole-segments: the same input-aware rule without the selective units
    assert rows["whole_segments"]["recompute"]["policy"] == "input_aware"
    assert epoch["selective_speedup_epoch"] == pytest.approx(
        rows["whole_segments"]["epoch_s"] / rows["input_aware"]["epoch_s"])
    assert epoch["speedup_epoch_whole_segments"] == pytest.approx(
        rows["static"]["epoch_s"] / rows["whole_segments"]["epoch_s"])


def test_simulated_epochs_replay_each_trainers_programs(quick_run):
    _, proc, result = quick_run
    epoch = result["epoch"]
    rows = {r["row"]: r for r in epoch["rows"]}
    for name, sim in epoch["simulated"].items():
        totals = sim["epoch_s"]
        for row, steps in ((r, rows[r]["per_step"]) for r in totals):
            assert totals[row] == pytest.approx(sum(s["simulated_s"][name] for s in steps))
        # Recompute only adds kernels: the planned programs never simulate faster than unplanned,
        # and a length the input-aware trainer runs unplanned simulates as the unplanned one does.
        assert totals["unplanned"] <= min(totals["static"], totals["input_aware"])
        for plain, aware in zip(rows["unplanned"]["per_step"], rows["input_aware"]["per_step"]):
            if aware["recomputed_nodes"] == 0:
                assert aware["simulated_s"][name] == pytest.approx(plain["simulated_s"][name])
        assert sim["speedup_epoch"] == pytest.approx(totals["static"] / totals["input_aware"])
        assert f"simulated on {name}" in proc.stdout


def test_plan_time_and_estimator_error_are_measured(quick_run):
    _, _, result = quick_run
    plan = result["plan_time"]
    assert plan["layers_in_model"] == 12 and plan["within_budget"]
    assert plan["recompute"]["estimator_fitted"] and plan["recompute"]["estimated_plans"] >= 1
    assert 0 < plan["choose_s_median"] < plan["choose_s_p99"] * 1.0001
    errors = plan["recompute"]["estimator_error_per_layer"]
    assert len(errors) == plan["segments"] and all(e["sizes"] >= 1 for e in errors)
    assert {t["what"].split(" ")[0] for t in result["targets"]} == {"input-aware", "plan", "estimator"}


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--budget-fraction", "0"], ["--budget-fraction", "1.5"]])
def test_bad_arguments_exit_with_one_line_before_running(tmp_path, argv):
    from benchmarks import mimose

    with pytest.raises(SystemExit) as exited:
        mimose.main(["--out", str(tmp_path), *argv])
    assert isinstance(exited.value.code, str) and "\n" not in exited.value.code
    assert not any(tmp_path.iterdir())
