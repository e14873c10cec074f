"""benchmarks/dynn.py's quick mode runs end to end and writes consistent JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # the quick run takes well under a minute; the bound only stops a hung run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynn")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dynn", "--quick", "--predictor", "oracle",
         "--sections", "capacity,time,mispredictions", "--samples", "6", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc, json.loads((out / "dynn.json").read_text())


def test_writes_the_result_file_and_a_table(quick_run):
    out, proc, result = quick_run
    assert sorted(os.listdir(out)) == ["dynn.json"]
    assert "capacity" in proc.stdout and "dynn.json" in proc.stdout
    assert "benchmarks.dynn" in result["command"]


def test_capacity_rows_are_consistent(quick_run):
    _, _, result = quick_run
    capacity = result["capacity"]
    budget = capacity["budget_bytes"]
    assert capacity["without"][0]["trains"] and capacity["without"][0]["peak_bytes"] == budget
    for row in capacity["without"] + capacity["with"]:
        if row["trains"]:
            assert row["peak_bytes"] <= budget
    assert capacity["deepest_with"] >= capacity["deepest_without"] > 0
    assert capacity["ratio"] == capacity["deepest_with"] / capacity["deepest_without"]


def test_step_time_rows_are_bitwise_and_within_budget(quick_run):
    _, _, result = quick_run
    for row in result["step_time"]["rows"]:
        assert row["unlimited"]["bitwise"]
        for mode in ("prefetch", "on_demand"):
            r = row[mode]
            assert r["bitwise"], (row["budget"], mode)
            assert r["peak_bytes"] <= r["budget_bytes"]
            assert r["ratio_to_unlimited"] == pytest.approx(r["step_s_median"] / row["unlimited"]["step_s_median"])
            for sim in r["simulated"].values():
                assert 0 < sim["percent_of_unlimited"] <= 100
        assert row["on_demand"]["faults"] > 0 and row["on_demand"]["prefetch_hits"] == 0


def test_misprediction_counts(quick_run):
    _, _, result = quick_run
    for row in result["mispredictions"]["rows"]:
        assert row["samples"] == 6
        for key in ("without_cache", "with_cache"):
            assert 0 <= row[key]["mispredictions"] <= 6
        assert row["with_cache"]["mispredictions"] <= row["without_cache"]["mispredictions"]
