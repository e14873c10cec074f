"""The model-zoo regression (``ort-offload zoo``): the quick subset end to end, the minimum
budget, baselines and regressions, bad input to ``transform`` (exit 2, no output file), and large
graphs saved with external data."""

from __future__ import annotations

import json

import onnx
import onnx.helper as oh
import pytest

from ort_offload import zoo
from ort_offload.cli import main
from ort_offload.errors import BudgetTooSmallError


def run_cli(*args):
    return main([str(a) for a in args])


@pytest.mark.slow  # the zoo harness end to end on two models at every budget (~1-2 min)
def test_one_light_graph_and_one_of_ours_pass_end_to_end(tmp_path, capsys):
    """The zoo end to end on a light zoo graph and one of our models at 0.5x (the whole quick
    subset below is `make test-all`'s; writing the baseline is tested in test_cli.py)."""
    out = tmp_path / "zoo.json"
    assert run_cli("zoo", "--quick", "--quiet", "--models", "squeezenet,mlp-tiny", "--json", out) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["models"]
    assert [(m["model"], m["family"]) for m in rows] == [("squeezenet", zoo.LIGHT_FAMILY), ("mlp-tiny", zoo.OURS_FAMILY)]
    _check_half_budget_rows(rows, table)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo.json"]



def _check_half_budget_rows(rows, table: str) -> None:
    """Each zoo row trained at 0.5x of its unplanned peak: passed, within budget, bitwise, in the table."""
    for row in rows:
        assert row["error"] == "" and row["min_budget_bytes"] < row["unplanned_peak_bytes"]
        (half,) = row["budgets"]
        assert half["status"] == "pass", row
        assert half["peak_bytes"] <= half["budget_bytes"] == int(0.5 * row["unplanned_peak_bytes"])
        assert half["max_abs_diff"] == 0.0
        assert f"| {row['model']} |" in table


@pytest.mark.slow  # `make zoo-quick` in full: 7 models, ~2.5-8 min here
def test_quick_zoo_passes_writes_table_json_and_baseline(tmp_path, capsys):
    """The CI subset: two light zoo graphs and our tiny zoo at 0.5x."""
    out, baseline = tmp_path / "zoo.json", tmp_path / "baseline.json"
    assert run_cli("zoo", "--quick", "--quiet", "--json", out, "--baseline", baseline) == 0
    table = capsys.readouterr().out
    payload = json.loads(out.read_text())
    names = [m["model"] for m in payload["models"]]
    assert names == [*zoo.QUICK_LIGHT_MODELS, *(f"{m}-tiny" for m in zoo.OUR_MODELS)]
    _check_half_budget_rows(payload["models"], table)
    assert json.loads(baseline.read_text())["models"] == payload["models"]
    assert "baseline updated" in table


@pytest.mark.slow  # a minimum search over a zoo model (~25 s)
def test_minimum_budget_is_the_smallest_that_plans():
    case = zoo.zoo_cases(only=["mlp-tiny"])[0]
    result = zoo.run_case(case, budgets=("min",))
    assert result.passed and result.budgets[0].status == "pass"
    prepared = case.build(1)
    with pytest.raises(BudgetTooSmallError):
        zoo._train(prepared, budget=result.min_budget_bytes - 1, passes=("swap",))


def _result(model, *statuses, budgets=("1.0x", "0.25x")):
    r = zoo.ModelResult(model, "ours", nodes=10, params=5, unplanned_peak_bytes=1000, min_budget_bytes=400)
    r.budgets = [zoo.BudgetResult(b, status=s, detail="why") for b, s in zip(budgets, statuses)]
    return r


def test_regressions_against_a_baseline():
    baseline = {"a": {"budgets": [{"budget": "1.0x", "status": "pass"}, {"budget": "0.25x", "status": "pass"}]}}
    assert zoo.regressions([_result("a", "pass", "pass")], baseline) == []
    # A budget below the minimum is fine on its own, a regression where the baseline met it.
    assert zoo.regressions([_result("b", "pass", "below_min")], baseline) == []
    (line,) = zoo.regressions([_result("a", "pass", "below_min")], baseline)
    assert "a at 0.25x" in line and "passed in the baseline" in line
    (line,) = zoo.regressions([_result("b", "fail", "pass")], {})
    assert line == "b at 1.0x: why"
    broken = zoo.ModelResult("c", "ours", error="ExportError: nope")
    assert zoo.regressions([broken], {}) == ["c: ExportError: nope"]


def test_table_shows_the_minimum_budget_change_against_the_baseline():
    result = _result("a", "pass", "below_min")
    result.budgets[0] = zoo.BudgetResult("1.0x", 1000, "pass", 990, 1.25, 0.0)
    table = zoo.render_markdown([result], ("1.0x", "0.25x"), {"a": {"min_budget_bytes": 500}})
    assert "(-20.0%)" in table and "ok 0.0 MiB, 1.25x" in table and "below min" in table


def test_zoo_bad_arguments_exit_2(tmp_path, capsys):
    assert run_cli("zoo", "--models", "nonesuch", "--baseline", tmp_path / "b.json") == 2
    assert "unknown zoo model 'nonesuch'" in capsys.readouterr().err
    assert run_cli("zoo", "--budgets", "half") == 2
    assert run_cli("zoo", "--passes", "none") == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_cli("zoo", "--models", "mlp-tiny", "--baseline", bad) == 2
    assert "not a zoo result file" in capsys.readouterr().err


def _expect_transform_error(capsys, tmp_path, source, message):
    out = tmp_path / "out.onnx"
    assert run_cli("transform", source, "-o", out, "--budget", "0.5x") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.onnx*"))


def test_transform_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys):
    junk = tmp_path / "junk.onnx"
    junk.write_text("this is not onnx")
    _expect_transform_error(capsys, tmp_path, junk, "not an ONNX model")

    graph = tmp_path / "mlp.onnx"
    assert run_cli("export", "--model", "mlp", "--batch", "4", "-o", graph) == 0
    capsys.readouterr()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    _expect_transform_error(capsys, tmp_path, truncated, "not an ONNX model")

    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    loss = oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])
    custom = oh.make_model(oh.make_graph([oh.make_node("Frobnicate", ["x"], ["loss"], domain="com.example")], "g", [x], [loss]),
                           opset_imports=[oh.make_opsetid("", 20), oh.make_opsetid("com.example", 1)])
    unsupported = tmp_path / "custom.onnx"
    onnx.save(custom, unsupported)
    _expect_transform_error(capsys, tmp_path, unsupported, "com.example::Frobnicate")

    from models.onnx_zoo import light_model_path, materialize

    inference = tmp_path / "squeezenet.onnx"
    onnx.save(materialize(onnx.load(light_model_path("squeezenet"))), inference)
    _expect_transform_error(capsys, tmp_path, inference, "no parameters or gradients")

    too_small = tmp_path / "small.onnx"  # budget too small: the error names what swapping needs
    assert run_cli("transform", graph, "-o", too_small, "--budget", "100", "--input", "x=4x32",
                   "--input", "y=4", "--report", tmp_path / "r.json") == 2
    assert "needs with swapping" in capsys.readouterr().err
    assert not too_small.exists() and not (tmp_path / "r.json").exists()


def test_large_graphs_are_saved_with_external_data_atomically(tmp_path):
    import numpy as np
    from onnx import numpy_helper

    from graph_passes.ir.training_graph import TrainingGraph
    from graph_passes.ir.validate import load_model

    weight = np.arange(4096, dtype=np.float32).reshape(64, 64)
    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])],
                          initializer=[numpy_helper.from_array(weight, "w")])
    path = tmp_path / "big.onnx"
    TrainingGraph.from_model(oh.make_model(graph)).save(path, external_data_bytes=1000)
    assert (tmp_path / "big.onnx.data").stat().st_size == weight.nbytes
    assert path.stat().st_size < weight.nbytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]  # no temporaries left
    np.testing.assert_array_equal(numpy_helper.to_array(load_model(path).graph.initializer[0]), weight)
    small = tmp_path / "small.onnx"  # below the threshold: one self-contained file
    TrainingGraph.from_model(oh.make_model(graph)).save(small)
    assert not (tmp_path / "small.onnx.data").exists()
