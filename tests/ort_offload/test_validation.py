"""One validation layer for the CLI and the API: bad budgets, counts, learning rates and output
paths are one-line errors (exit code 2) before any work, and no input is ever overwritten."""

from __future__ import annotations

import hashlib

import pytest

import ort_offload
from ort_offload.cli import main
from ort_offload.errors import BudgetParseError, InvalidArgumentError, OutputPathError


def run_cli(*args):
    return main([str(a) for a in args])


def expect_refused(capsys, *args, message: str) -> str:
    """The command exits 2 with one line on stderr that holds ``message``."""
    try:
        code = run_cli(*args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert message in err, err
    return err


def snapshot(directory) -> dict[str, str]:
    """Name -> content hash of every file under ``directory`` (to prove nothing changed)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def graph_file(tmp_path):
    """A file standing for an input graph (outputs are checked before any input is read)."""
    path = tmp_path / "g.onnx"
    path.write_bytes(b"graph bytes")
    return path


@pytest.mark.parametrize("budget", ["1e400", "inf", "nan", "-1", "0", "1e30", "0x", "9" * 400 + "x", "infx"])
def test_budgets_that_are_not_finite_positive_sizes_are_one_line_errors(capsys, budget):
    expect_refused(capsys, "train", "--model", "mlp", "--budget", budget, message="budget")


@pytest.mark.parametrize("budget", ["1e400", float("inf"), float("nan"), -1, 10**30, "1e400x"])
def test_the_api_refuses_the_same_budgets(budget):
    with pytest.raises(BudgetParseError):
        ort_offload.set_offload_device("cpu", budget=budget)


@pytest.mark.parametrize("value", ["-1", "0"])
def test_block_nodes_below_one_is_refused_not_unlimited(capsys, value):
    expect_refused(capsys, "train", "--model", "mlp", "--block-nodes", value, message="--block-nodes must be at least 1")
    with pytest.raises(InvalidArgumentError):
        ort_offload.set_offload_device("cpu", max_block_nodes=int(value))


@pytest.mark.parametrize("args", [
    ("train", "--model", "mlp", "--steps", "0"),
    ("train", "--model", "mlp", "--steps", "10000000000000000000000"),
    ("train", "--model", "mlp", "--batch", "0"),
    ("train", "--model", "gpt", "--seq", "-3"),
    ("train", "--model", "mlp", "--seed", "-1"),
    ("train", "--model", "mlp", "--lr", "nan"),
    ("train", "--model", "mlp", "--lr", "-0.1"),
    ("train", "--model", "mlp", "--lr", "inf"),
    ("zoo", "--steps", "0"),
    ("train", "--model", "mlp", "--steps", "many"),
])
def test_counts_seeds_and_learning_rates_out_of_range(capsys, args):
    expect_refused(capsys, *args, message="--")


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0])
def test_the_api_refuses_learning_rates_that_are_not_finite_and_non_negative(lr):
    from ort_offload.export.optimizers import AdamW, SGD, make_optimizer

    for make in (lambda: make_optimizer("adamw", lr=lr), lambda: SGD(lr=lr), lambda: AdamW(lr=lr)):
        with pytest.raises(InvalidArgumentError):
            make()


def test_zoo_budget_labels_are_checked_before_the_zoo_runs(capsys, tmp_path):
    expect_refused(capsys, "zoo", "--budgets", "infx", "--baseline", tmp_path / "b.json", message="--budgets 'infx'")
    expect_refused(capsys, "zoo", "--budgets", "0.5x,nanx", "--baseline", tmp_path / "b.json", message="nanx")
    assert list(tmp_path.iterdir()) == []


def _output_cases(directory, graph):
    d = str(directory)
    return [
        ("train", "--model", "mlp", "--json", d),
        ("train", "--model", "mlp", "--plot", d),
        ("train", "--model", "var-bert", "--misprediction-log", d),
        ("export", "--model", "mlp", "-o", d),
        ("transform", graph, "-o", d, "--budget", "0.5x"),
        ("transform", graph, "-o", directory / "t.onnx", "--budget", "0.5x", "--report", d),
        ("inspect", graph, "--json", d),
        ("run", graph, "--json", d),
        ("run", graph, "--plot", d),
        ("zoo", "--json", d, "--baseline", directory / "b.json"),
        ("zoo", "--markdown", d, "--baseline", directory / "b.json"),
    ]


def test_an_output_that_is_a_directory_is_refused_by_every_command(capsys, tmp_path, graph_file):
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(tmp_path)
    for args in _output_cases(out, graph_file):
        expect_refused(capsys, *args, message="is a directory")
    assert snapshot(tmp_path) == before


def test_an_output_in_a_missing_or_non_directory_parent_is_refused(capsys, tmp_path, graph_file):
    expect_refused(capsys, "run", graph_file, "--json", tmp_path / "nodir" / "r.json", message="does not exist")
    expect_refused(capsys, "run", graph_file, "--json", graph_file / "r.json", message="is not a directory")
    expect_refused(capsys, "run", graph_file, "--json", "/dev/null", message="not a regular file")
    expect_refused(capsys, "run", graph_file, "--json", tmp_path / ("x" * 250), message="too long")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx"]


def test_export_cache_dir_naming_a_file_is_refused(capsys, graph_file):
    out = graph_file.with_name("m.onnx")
    expect_refused(capsys, "export", "--model", "mlp", "-o", out, "--cache-dir", graph_file, message="--cache-dir")
    expect_refused(capsys, "train", "--model", "mlp", "--cache-dir", graph_file / "sub", message="--cache-dir")
    assert not out.exists()


def test_an_output_never_overwrites_an_input_of_the_same_command(capsys, tmp_path, graph_file):
    link = tmp_path / "link.onnx"
    link.symlink_to(graph_file)
    before = snapshot(tmp_path)
    for args in [
        ("run", graph_file, "--json", graph_file),
        ("run", graph_file, "--plot", tmp_path / "." / "g.onnx"),
        ("run", graph_file, "--json", link),
        ("transform", graph_file, "-o", graph_file, "--budget", "0.5x"),
        ("transform", graph_file, "-o", tmp_path / "t.onnx", "--report", graph_file, "--budget", "0.5x"),
        ("inspect", graph_file, "--json", graph_file),
    ]:
        expect_refused(capsys, *args, message="would overwrite the input")
    assert snapshot(tmp_path) == before


def test_two_outputs_naming_one_file_are_refused(capsys, tmp_path):
    expect_refused(capsys, "train", "--model", "mlp", "--json", tmp_path / "r", "--plot", tmp_path / "r",
                   message="both name")
    baseline = tmp_path / "b.json"
    expect_refused(capsys, "zoo", "--json", baseline, "--baseline", baseline, message="both name")
    assert list(tmp_path.iterdir()) == []


def test_check_output_paths_api(tmp_path):
    from ort_offload.validation import check_output_paths

    check_output_paths({"--json": tmp_path / "r.json", "--plot": None}, inputs=[tmp_path / "absent.onnx"])
    with pytest.raises(OutputPathError):
        check_output_paths({"out": tmp_path})
    with pytest.raises(OutputPathError):
        check_output_paths({"out": ""})


def test_input_shapes_that_are_empty_or_too_large_are_refused(capsys, tmp_path):
    import onnx
    import onnx.helper as oh

    nodes = [oh.make_node("Mul", ["x", "w"], ["xw"]), oh.make_node("ReduceSum", ["xw"], ["loss"], keepdims=0),
             oh.make_node("Mul", ["w", "w"], ["w.updated"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [4]),
                                       oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
                          [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []),
                           oh.make_tensor_value_info("w.updated", onnx.TensorProto.FLOAT, [4])])
    path = tmp_path / "g.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=10), path)
    expect_refused(capsys, "run", path, "--input", "x=99999999999x4", message="elements")
    expect_refused(capsys, "inspect", path, "--input", "x=99999999999x4", message="elements")
    expect_refused(capsys, "run", path, "--input", "x=0x4", message="at least 1")
    assert run_cli("run", path, "--input", "x=2x4", "--steps", "1", "--quiet") == 0


def test_an_unwritable_directory_is_refused(tmp_path, monkeypatch):
    import os

    from ort_offload.validation import check_directory, check_output_path

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a user without write permission sees it
    with pytest.raises(OutputPathError, match="not writable"):
        check_output_path(tmp_path / "r.json", name="--json")
    with pytest.raises(OutputPathError, match="not writable"):
        check_directory(tmp_path / "cache", name="--cache-dir")


def test_reports_are_strict_json_for_any_value():
    import json
    import math

    import numpy as np
    import torch

    from ort_offload.report import to_json

    text = to_json({"a": math.nan, "b": [1.0, math.inf], "c": np.float32("nan"), "d": np.int64(3),
                    "e": torch.tensor(2.5), "f": object})
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert parsed["a"] is None and parsed["b"] == [1.0, None] and parsed["c"] is None and parsed["d"] == 3
    assert parsed["e"] == 2.5 and isinstance(parsed["f"], str)
