"""The largest-batch benchmark (benchmarks/gpu_batch.py) on the CPU: its search, and its whole
path — a graph exported once, every try in its own process, rows in JSON. The CPU run checks
the code only (torch's memory cap needs CUDA); the lent GPU machine runs the same code."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_batch


@pytest.mark.parametrize("largest,start,limit", [(37, 8, 1024), (5, 8, 1024), (0, 8, 64), (64, 8, 64), (200, 400, 1024)])
def test_the_search_finds_the_largest_fitting_batch(largest, start, limit):
    limits = gpu_batch.SearchLimits(start=start, limit=limit, max_tries=30, resolution=0.0)
    found = gpu_batch.search_largest(lambda batch: batch <= largest, limits)
    assert found["largest_batch"] == (min(largest, limit) or None)
    assert found["search_complete"] and found["capped"] == (largest >= limit)


def test_the_search_stops_at_its_bounds():
    limits = gpu_batch.SearchLimits(start=8, limit=1024, max_tries=3, resolution=0.125)
    found = gpu_batch.search_largest(lambda batch: batch <= 100, limits)
    assert found["batches_tried"] == [8, 16, 32] and found["largest_batch"] == 32 and not found["search_complete"]
    cut = gpu_batch.search_largest(lambda batch: None if batch > 16 else True, limits)  # a try cut short
    assert cut["largest_batch"] == 16 and not cut["search_complete"]
    coarse = gpu_batch.SearchLimits(start=8, limit=1024, max_tries=30, resolution=0.125)
    found = gpu_batch.search_largest(lambda batch: batch <= 100, coarse)
    assert 88 <= found["largest_batch"] <= 100 and found["first_failing_batch"] - found["largest_batch"] <= 12


def test_a_cpu_run_writes_one_row_per_method(tmp_path):
    graphs, out = tmp_path / "graphs", tmp_path / "out"
    assert gpu_batch.main(["export", "--graphs", str(graphs), "--config", "tiny"]) == 0
    methods = ("torch_checkpoint", "torch_save_on_cpu", "ours_auto")
    assert gpu_batch.main(["run", "--graphs", str(graphs), "--config", "tiny", "--device", "cpu", "--budget", "1MiB",
                           "--methods", ",".join(methods), "--start-batch", "2", "--max-batch", "4", "--steps", "2",
                           "--time-limit", "600", "--out", str(out)]) == 0
    rows = json.loads((out / "gpu_batch_cpu.json").read_text())
    assert [r["method"] for r in rows] == list(methods)
    for row in rows:
        assert row["largest_batch"] in (2, 4) and row["budget_bytes"] == 2**20 and row["search_complete"]
        assert {t["batch"] for t in row["tries"]} <= {2, 4} and row["step_time_s_median"] > 0
    torch_row, ours = rows[0], rows[-1]
    assert torch_row["peak_bytes"] is None  # no cap on the CPU: torch's rows check the code path only
    assert ours["start_batch"] == 4 and ours["tries"][0]["batch"] == 4  # twice checkpointing's, within the limit
    assert ours["within_budget"] and 0 < ours["peak_bytes"] <= 2**20 and ours["vs_torch_checkpoint"] is not None
