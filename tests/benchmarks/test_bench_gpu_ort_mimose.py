"""Mimose's epoch through our runtime (benchmarks/gpu_ort_mimose.py) runs end to end on the CPU:
bert exported with a dynamic sequence axis, each row in its own process, the policies compared
bitwise within budget; the lent GPU machine runs the same code on the CUDA device."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_ort_mimose, mimose

STEPS, EPOCHS = 4, 2


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    graphs, out = tmp_path_factory.mktemp("graphs"), tmp_path_factory.mktemp("out")
    gpu_ort_mimose.export(graphs, "tiny", use_cache=True)
    assert gpu_ort_mimose.main(["run", "--graphs", str(graphs), "--config", "tiny", "--device", "cpu",
                                "--steps", str(STEPS), "--epochs", str(EPOCHS), "--out", str(out)]) == 0
    return json.loads((out / "gpu_ort_mimose_cpu.json").read_text())


def test_the_policies_run_the_epoch_within_budget_and_bitwise(cpu_run):
    result = cpu_run
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["unplanned", "static", "input_aware"]
    assert result["complete"] and result["steps_compared"] == STEPS * EPOCHS
    assert result["lengths"][0] == max(result["lengths"]) == mimose.MAX_LENGTH
    assert result["settings"]["budget_fraction"] == mimose.QUICK.budget_fraction  # tiny: the CPU benchmark's
    budget = rows["static"]["budget_bytes"]
    assert budget == rows["input_aware"]["budget_bytes"] < rows["unplanned"]["peak_device_bytes"]
    for name in ("static", "input_aware"):
        row = rows[name]
        assert row["within_budget"] is True and row["peak_device_bytes"] <= budget
        assert row["losses_bitwise_equal"] is True and row["state_bitwise_equal"] is True
        assert [s["length"] for s in row["per_step"]] == result["lengths"] * EPOCHS
        assert row["recompute"]["policy"] == name
    assert result["policies_bitwise_equal"] is True and result["all_bitwise_equal"] is True
    assert result["all_within_budget"] is True
    # the static plan, made for the longest batch, recomputes the same nodes at every length
    static_nodes = {s["recomputed_nodes"] for s in rows["static"]["per_step"]}
    assert len(static_nodes) == 1 and static_nodes.pop() > 0
    assert rows["static"]["recompute"]["recompute_plans"] == 1
    assert rows["unplanned"]["recomputed_nodes_run"] == 0
    assert rows["input_aware"]["recomputed_nodes_run"] < rows["static"]["recomputed_nodes_run"]


def test_the_speed_up_and_the_epoch_by_length_add_up(cpu_run):
    result = cpu_run
    rows = {r["row"]: r for r in result["rows"]}
    for row in rows.values():
        assert row["epoch_s"] == pytest.approx(sum(s["wall_s"] for s in row["per_step"])) and row["epoch_s"] > 0
    assert isinstance(result["speedup_epoch"], float)
    assert result["speedup_epoch"] == pytest.approx(rows["static"]["epoch_s"] / rows["input_aware"]["epoch_s"])
    assert result["target_met"] == (result["speedup_epoch"] >= gpu_ort_mimose.TARGET_SPEEDUP)
    ranges = result["by_length"]
    assert sum(r["steps"] for r in ranges) == STEPS * EPOCHS
    for name, row in rows.items():
        assert sum(r["epoch_s"][name] for r in ranges) == pytest.approx(row["epoch_s"])
    passes = result["by_epoch"]
    assert [(p["epoch"], p["steps"]) for p in passes] == [(k, STEPS) for k in range(EPOCHS)]
    for name, row in rows.items():
        assert sum(p["epoch_s"][name] for p in passes) == pytest.approx(row["epoch_s"])
        assert passes[0]["prepare_s"][name] > 0  # new lengths prepared
        assert passes[1]["prepare_s"][name] == 0.0  # every length prepared in the first pass
    assert passes[1]["speedup_epoch"] == pytest.approx(passes[1]["epoch_s"]["static"] / passes[1]["epoch_s"]["input_aware"])


def _row(name: str, losses: list[float], *, epoch_steps: int | None = None) -> dict:
    """A row that ran ``len(losses)`` steps of an epoch of ``epoch_steps`` (default: all of them)."""
    per_step = [{"epoch": 0, "length": 16 + k, "wall_s": 1.0, "run_s": 1.0, "prepare_s": 0.0, "new_plan": False,
                 "recomputed_nodes": 0} for k in range(len(losses))]
    complete = len(losses) == (epoch_steps or len(losses))
    return {"row": name, "steps_done": len(losses), "complete": complete, "losses": losses,
            "per_step": per_step, "state_digest": "digest", "within_budget": True}


def test_rows_cut_short_are_compared_over_the_steps_all_ran():
    rows = [_row("unplanned", [1.0, 2.0, 3.0]), _row("static", [1.0, 2.0, 3.0]), _row("input_aware", [1.0, 2.0], epoch_steps=3)]
    result = gpu_ort_mimose.compare(rows)
    assert result["steps_compared"] == 2 and result["complete"] is False
    assert all(len(r["losses"]) == 2 for r in rows)
    assert all(r["state_bitwise_equal"] is None for r in rows)  # final states of different steps
    assert result["all_bitwise_equal"] is True and result["speedup_epoch"] == pytest.approx(1.0)


def test_a_loss_that_differs_and_a_failed_row_are_reported():
    rows = [_row("unplanned", [1.0, 2.0]), _row("static", [1.0, 2.5]), _row("input_aware", [1.0, 2.0])]
    result = gpu_ort_mimose.compare(rows)
    assert result["all_bitwise_equal"] is False and result["policies_bitwise_equal"] is False
    assert rows[1]["losses_bitwise_equal"] is False and rows[2]["state_bitwise_equal"] is True
    failed = gpu_ort_mimose.compare([_row("unplanned", [1.0]), {"row": "static", "error": "E"}, _row("input_aware", [1.0])])
    assert failed == {"complete": False, "failed_rows": ["static"]}


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--epochs", "0"], ["--budget-fraction", "1.5"], ["--config", "tiny12"],
                                  ["--time-limit", "0"]])
def test_bad_arguments_exit_with_one_line_before_running(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_ort_mimose.main(["run", "--graphs", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "o"), *argv])
    assert exited.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
    assert not (tmp_path / "o").exists()


def test_the_cuda_device_without_a_gpu_is_one_line_before_running(tmp_path, capsys):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    assert gpu_ort_mimose.main(["run", "--graphs", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
