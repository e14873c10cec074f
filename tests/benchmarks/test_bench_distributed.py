"""benchmarks/distributed.py: its batch search, and its quick mode end to end (1 rank against 2
ranks, with and without sharded optimizer state)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import distributed

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1200  # 5-10 minutes here (four runs of spawned ranks); the bound only stops a hung run


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 7, 8, 9, 31, 40])
def test_the_search_finds_the_largest_batch(largest):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= largest

    found, capped = distributed._largest(fits, 4, 32)
    assert (found, capped) == (min(largest, 32), largest >= 32)
    assert len(tried) <= 12


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    done = subprocess.run([sys.executable, "-m", "benchmarks.distributed", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((out / "distributed.json").read_text()), done.stdout


def test_sharded_ranks_hold_half_the_optimizer_state_and_train_the_same(quick_run):
    result, table = quick_run
    rows = {row["setting"]: row for row in result["runs"]}
    one, two, sharded = (rows[name] for name in distributed.SETTINGS)
    bucketed = rows[distributed.BUCKETED[0]]
    assert all(row["loss_max_rel_diff"] <= 1e-6 for row in result["runs"])
    assert sharded["optimizer_state_bytes"] <= 0.55 * two["optimizer_state_bytes"]
    assert two["optimizer_state_bytes"] == one["optimizer_state_bytes"]
    assert sharded["peak_device_bytes"] < two["peak_device_bytes"] < one["peak_device_bytes"]
    assert sharded["comm_bytes_per_step"] == 2 * two["comm_bytes_per_step"]  # gradients in, parameters out
    assert all(0.0 <= row["comm_overlap_fraction"] <= 1.0 for row in result["runs"])
    assert bucketed["comm_overlap_fraction"] > 0  # buckets reduced while later blocks run
    assert "largest global batch" in table


def test_two_sharded_ranks_fit_at_least_twice_one_ranks_batch(quick_run):
    capacity = quick_run[0]["capacity"]
    one, two, sharded = capacity["rows"]
    assert one["largest_global_batch"] >= 1 and not one["capped"]
    assert two["largest_global_batch"] == 2 * one["largest_global_batch"]  # each rank: one process's graph
    assert sharded["largest_global_batch"] >= 2 * one["largest_global_batch"] and capacity["target_met"]
    assert all(row["peak_at_largest_bytes"] <= capacity["budget_bytes"] for row in capacity["rows"])
