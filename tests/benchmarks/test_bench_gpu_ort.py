"""The CUDA device's benchmark (benchmarks/gpu_ort.py) runs end to end on the CPU: it exports a
step, runs our rows beside one plain ORT session and torch eager, and writes rows that compare
them; the lent GPU machine runs the same code."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_ort


def test_a_cpu_run_writes_comparable_rows(tmp_path):
    graphs, out = tmp_path / "graphs", tmp_path / "out"
    gpu_ort.export_graphs(graphs, "tiny", models=("gpt",))
    assert gpu_ort.main(["model", "--graphs", str(graphs), "--config", "tiny", "--device", "cpu", "--models", "gpt",
                         "--steps", "2", "--rows", "0.5x:swap,0.5x:swap:sync,unlimited:none", "--block-memory",
                         "--out", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads((out / "rows_gpt.json").read_text())}
    assert set(rows) == {"ours 0.5x swap", "ours 0.5x swap sync", "ours unlimited none", "plain ORT session",
                         "torch eager"}
    for label in ("ours 0.5x swap", "ours 0.5x swap sync"):
        row = rows[label]
        assert row["bitwise_vs_unplanned"] and row["state_differences_vs_unplanned"] == [0]
        assert row["measured_within_budget"] and row["swap_in_bytes"] > 0
        assert [b[0] for b in row["block_memory"]] == list(range(row["blocks"]))
    assert rows["ours unlimited none"]["max_rel_loss_diff_vs_torch"] < 1e-5


@pytest.mark.parametrize("text", ["0.5x", "0.5x:swap:fast", "0.5x:swap:keep:nope"])
def test_a_bad_row_is_refused(text):
    with pytest.raises(ValueError):
        gpu_ort.Row.parse(text)
