"""The ``ort-offload`` command line: train/export/run, reports, and bad input (exit code 2,
one line, no partial files)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest

from ort_offload.cli import main
from ort_offload.report import REPORT_KEYS

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args):
    return main([str(a) for a in args])


def test_train_writes_report_json_and_plot(tmp_path, capsys):
    report_path, plot_path = tmp_path / "r.json", tmp_path / "p.png"
    code = run_cli("train", "--model", "mlp", "--budget", "1.0x", "--steps", "3", "--verify",
                   "--json", report_path, "--plot", plot_path)
    assert code == 0
    report = json.loads(report_path.read_text())
    assert set(REPORT_KEYS) <= set(report)
    assert report["within_budget"] is True and report["steps"] == 3
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    assert report["verify"]["max_loss_rel_diff"] < 1e-5
    assert report["verify"]["max_param_rel_diff"] < 1e-5
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak_device_bytes" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.json"]


def test_export_then_run_the_file(tmp_path):
    graph = tmp_path / "gpt.onnx"
    assert run_cli("export", "--model", "gpt", "-o", graph) == 0
    onnx.checker.check_model(onnx.load(graph))
    report_path = tmp_path / "run.json"
    code = run_cli("run", graph, "--budget", "1.0x", "--steps", "2", "--input", "ids=4x16",
                   "--input", "targets=4x16", "--json", report_path, "--quiet")
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["steps"] == 2 and report["within_budget"] is True
    assert len(report["losses"]) == 2


def _expect_error(capsys, *args, message):
    code = run_cli(*args)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert message in err
    return err


def test_unknown_model_and_config(capsys, tmp_path):
    _expect_error(capsys, "train", "--model", "resnet9000", message="valid models")
    _expect_error(capsys, "train", "--model", "mlp", "--config", "huge", message="huge")


def test_unknown_device(capsys):
    _expect_error(capsys, "train", "--model", "mlp", "--device", "tpu", message="unknown device")


def test_unparsable_budget(capsys):
    _expect_error(capsys, "train", "--model", "mlp", "--budget", "lots", message="cannot parse budget")


def test_budget_too_small_names_the_bytes_needed(capsys, tmp_path):
    report_path = tmp_path / "r.json"
    err = _expect_error(capsys, "train", "--model", "mlp", "--budget", "0.5x", "--passes", "none",
                        "--json", report_path, message="needs without offload passes")
    assert any(ch.isdigit() for ch in err)
    assert not report_path.exists()
    err = _expect_error(capsys, "train", "--model", "mlp", "--budget", "1KiB", "--json", report_path,
                        message="needs with swapping")
    assert not report_path.exists()


def test_swap_makes_half_the_budget_work(tmp_path):
    report_path = tmp_path / "r.json"
    assert run_cli("train", "--model", "mlp", "--budget", "0.5x", "--steps", "2", "--json", report_path,
                   "--quiet") == 0
    report = json.loads(report_path.read_text())
    assert report["passes"] == ["swap"] and report["within_budget"] is True
    assert report["peak_device_bytes"] <= report["budget_bytes"] < report["baseline_peak_bytes"]
    assert report["swap_out_bytes"] > 0 and report["swap_in_bytes"] > 0


def test_malformed_and_missing_files(capsys, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_text("this is not onnx")
    _expect_error(capsys, "run", junk, message="not an ONNX model")
    _expect_error(capsys, "run", tmp_path / "absent.onnx", message="no such file")
    # Valid protobuf, invalid graph (a node reads an undefined value).
    bad = oh.make_model(oh.make_graph([oh.make_node("Relu", ["nowhere"], ["y"])], "g", [],
                                      [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]))
    invalid = tmp_path / "invalid.onnx"
    onnx.save(bad, invalid)
    _expect_error(capsys, "run", invalid, message="not valid ONNX")


def test_unsupported_op(capsys, tmp_path):
    node = oh.make_node("Frobnicate", ["x"], ["loss"], domain="com.example")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20), oh.make_opsetid("com.example", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, path)
    _expect_error(capsys, "run", path, message="com.example::Frobnicate")


def test_input_shapes_that_do_not_match(capsys, tmp_path):
    graph = tmp_path / "mlp.onnx"
    assert run_cli("export", "--model", "mlp", "-o", graph) == 0
    capsys.readouterr()
    _expect_error(capsys, "run", graph, "--input", "x=4x31", "--input", "y=4", message="does not match")
    _expect_error(capsys, "run", graph, message="symbolic shape")
    _expect_error(capsys, "run", graph, "--input", "x=4x32", "--input", "y=5", message="dimension")
    _expect_error(capsys, "run", graph, "--input", "bogus", message="cannot parse --input")
    _expect_error(capsys, "train", "--model", "gpt", "--seq", "1000", message="seq")


def test_no_partial_output_when_the_directory_is_missing(capsys, tmp_path):
    _expect_error(capsys, "export", "--model", "mlp", "-o", tmp_path / "nodir" / "m.onnx", message="does not exist")
    assert not (tmp_path / "nodir").exists()


def test_python_dash_m_and_console_script(tmp_path):
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "ort_offload", "train", "--model", "nope"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "valid models" in result.stderr
    script = shutil.which("ort-offload", path=os.path.dirname(sys.executable))
    assert script is not None, "the ort-offload console script is not installed"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "train" in result.stdout


def test_transform_writes_a_graph_stock_onnxruntime_runs_identically(tmp_path, capsys):
    import numpy as np
    import onnxruntime as ort

    from graph_passes.ir.training_graph import TrainingGraph
    from ort_offload.export.graph_inputs import random_batch, random_state

    source, rewritten, report_path = tmp_path / "gpt.onnx", tmp_path / "gpt_swap.onnx", tmp_path / "t.json"
    assert run_cli("export", "--model", "gpt", "-o", source) == 0
    code = run_cli("transform", source, "-o", rewritten, "--budget", "0.3x", "--input", "ids=8x16",
                   "--input", "targets=8x16", "--report", report_path)
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["passes"] == ["swap"] and report["swaps"]
    assert report["planned_peak_bytes"] <= report["budget_bytes"] < report["baseline_peak_bytes"]
    assert {s["op"] for s in report["swaps"]} == {"swap_out", "swap_in"}
    model = onnx.load(rewritten)
    onnx.checker.check_model(model)
    graph = TrainingGraph.from_model(onnx.load(source))
    assert TrainingGraph.from_model(model).state_pairs == graph.state_pairs
    feeds = {**random_state(graph), **random_batch(graph, {"ids": (8, 16), "targets": (8, 16)})}

    def outputs(m):
        return ort.InferenceSession(m.SerializeToString()).run(None, feeds)

    for before, after in zip(outputs(graph.model), outputs(model)):
        np.testing.assert_array_equal(before, after)
    assert "swaps" in capsys.readouterr().out


def test_inspect_summarises_roles_sizes_and_peak(tmp_path, capsys):
    source = tmp_path / "mlp.onnx"
    assert run_cli("export", "--model", "mlp", "-o", source) == 0
    capsys.readouterr()
    assert run_cli("inspect", source, "--input", "x=8x32", "--input", "y=8") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["roles"]["param"] > 0 and summary["baseline_peak_bytes"] > 0
    assert summary["state_bytes"]["param"] > 0 and summary["largest_ops"]
    assert run_cli("inspect", source) == 0  # symbolic shapes: roles and ops, with a note
    assert "note" in json.loads(capsys.readouterr().out)


def test_transform_plans_for_a_named_device_profile_and_train_takes_an_arena_policy(tmp_path, capsys):
    source, out, report_path = tmp_path / "mlp.onnx", tmp_path / "mlp_v100.onnx", tmp_path / "t.json"
    assert run_cli("export", "--model", "mlp", "-o", source) == 0
    assert run_cli("transform", source, "-o", out, "--budget", "0.5x", "--input", "x=8x32", "--input", "y=8",
                   "--device-profile", "V100-16GB-PCIe3", "--report", report_path) == 0
    report = json.loads(report_path.read_text())
    assert report["planning_profile"] == "V100-16GB-PCIe3" and report["swaps"]
    assert report["planned_peak_bytes"] <= report["budget_bytes"]
    with pytest.raises(SystemExit):  # argparse: not a profile name
        run_cli("transform", source, "-o", out, "--budget", "0.5x", "--device-profile", "TPU")
    json_path = tmp_path / "r.json"
    assert run_cli("train", "--model", "mlp", "--budget", "0.5x", "--steps", "2", "--arena-policy", "double_buffer",
                   "--json", json_path, "--quiet") == 0
    trained = json.loads(json_path.read_text())
    assert trained["within_budget"] and trained["passes"] == ["swap"]


def test_transform_with_recompute_writes_clones_that_stock_onnxruntime_runs_identically(tmp_path):
    import numpy as np
    import onnxruntime as ort

    from graph_passes.ir.training_graph import TrainingGraph
    from ort_offload.export.graph_inputs import random_batch, random_state

    source, out, report_path = tmp_path / "gpt.onnx", tmp_path / "gpt_rc.onnx", tmp_path / "t.json"
    assert run_cli("export", "--model", "gpt", "-o", source) == 0
    assert run_cli("transform", source, "-o", out, "--budget", "0.75x", "--passes", "recompute",
                   "--input", "ids=8x16", "--input", "targets=8x16", "--report", report_path) == 0
    report = json.loads(report_path.read_text())
    assert report["passes"] == ["recompute"] and report["recomputed_nodes"] > 0 and not report["swaps"]
    assert report["nodes_after"] == report["nodes_before"] + report["recomputed_nodes"]
    model = onnx.load(out)
    onnx.checker.check_model(model)
    graph = TrainingGraph.from_model(onnx.load(source))
    feeds = {**random_state(graph), **random_batch(graph, {"ids": (8, 16), "targets": (8, 16)})}

    def outputs(m):
        return ort.InferenceSession(m.SerializeToString()).run(None, feeds)

    for before, after in zip(outputs(graph.model), outputs(model)):
        np.testing.assert_array_equal(before, after)


def test_train_with_variable_sequence_lengths_plans_each_new_length(tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code = run_cli("train", "--model", "bert", "--seq-range", "16:200", "--steps", "6", "--budget", "14MB",
                   "--passes", "recompute", "--json", report_path, "--quiet")
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["within_budget"] is True and report["steps"] == 6
    assert report["plans_made"] >= 2  # the first (longest) length and at least one other
    assert report["recompute_plans"] >= 1 and report["recomputed_nodes"] > 0
    capsys.readouterr()  # the export's warnings
    _expect_error(capsys, "train", "--model", "bert", "--seq-range", "64:16", message="--seq-range")
    _expect_error(capsys, "train", "--model", "bert", "--seq-range", "16", message="MIN:MAX")
    _expect_error(capsys, "train", "--model", "bert", "--seq", "16", "--seq-range", "16:32", message="exclude")
    _expect_error(capsys, "train", "--model", "bert", "--seq-range", "16:300", message="max_seq")


# ---- conventions: --version, -v, files only where told ----------------------------------------


def test_version_flag_prints_the_package_version(capsys):
    import tomllib

    import ort_offload

    with pytest.raises(SystemExit) as exit_info:
        run_cli("--version")
    assert exit_info.value.code == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert ort_offload.__version__ == project["version"]
    assert capsys.readouterr().out == f"ort-offload {project['version']}\n"


@pytest.fixture
def restore_log_levels():
    from ort_offload.cli import OUR_LOGGERS

    names = (*OUR_LOGGERS, "onnxscript", "onnx_ir", "torch", "")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_verbose_turns_up_our_loggers_only(restore_log_levels):
    from ort_offload.cli import _configure_logging

    ours = ("ort_offload.export.training_step", "graph_passes.planning.driver", "pilot.train", "models.registry",
            "onnxruntime")
    libraries = ("onnxscript.optimizer._constant_folding", "onnx_ir.passes", "torch.export")
    for verbose, our_level in ((1, logging.INFO), (2, logging.DEBUG)):
        _configure_logging(verbose)
        for name in ours:
            assert logging.getLogger(name).getEffectiveLevel() == our_level, (verbose, name)
        for name in libraries:
            assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, (verbose, name)
    _configure_logging(3)  # torch sets its loggers' levels itself (TORCH_LOGS)
    for name in libraries[:2]:
        assert logging.getLogger(name).getEffectiveLevel() == logging.DEBUG


@pytest.mark.slow  # a fresh export in a subprocess (~20 s); -v's levels are checked fast above
def test_verbose_export_logs_ours_not_the_exporters(tmp_path):
    """A fresh export at -v: onnxscript and onnx_ir log dozens of INFO lines, none of which show."""
    result = subprocess.run(
        [sys.executable, "-m", "ort_offload", "-v", "export", "--model", "mlp", "-o", tmp_path / "mlp.onnx",
         "--cache-dir", tmp_path / "cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [line.split(":")[0].split() for line in result.stderr.splitlines()
               if line.split(" ", 1)[0] in ("DEBUG", "INFO", "WARNING", "ERROR")]
    assert ["INFO", "ort_offload.export.training_step"] in records
    assert all(name.split(".")[0] in ("ort_offload", "graph_passes", "pilot", "models") for _, name in records), records


def _passing_zoo_run(cases, **_):
    from ort_offload import zoo

    return [zoo.ModelResult(c.name, c.family, nodes=1, params=1, unplanned_peak_bytes=8, min_budget_bytes=4,
                            budgets=[zoo.BudgetResult("0.5x", 4, zoo.PASS, 4, 1.0, 0.0)]) for c in cases]


def test_zoo_writes_no_file_it_was_not_told_to(tmp_path, monkeypatch, capsys):
    """A complete passing run writes its baseline only to --baseline; without it, nothing."""
    from ort_offload import zoo

    monkeypatch.setattr(zoo, "run_zoo", _passing_zoo_run)
    monkeypatch.chdir(tmp_path)
    assert run_cli("zoo", "--quick", "--quiet") == 0
    assert list(tmp_path.iterdir()) == []
    assert "baseline updated" not in capsys.readouterr().out
    baseline = tmp_path / "kept" / "baseline.json"
    baseline.parent.mkdir()
    assert run_cli("zoo", "--quick", "--quiet", "--baseline", baseline) == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["baseline.json", "kept"]
    assert f"baseline updated: {baseline}" in capsys.readouterr().out


@pytest.fixture(scope="module")
def planned_mlp(tmp_path_factory):
    """mlp's step exported, and transformed for 0.5x of its peak: (original, planned, transform report)."""
    folder = tmp_path_factory.mktemp("planned")
    source, planned, report_path = folder / "mlp.onnx", folder / "mlp_planned.onnx", folder / "t.json"
    assert run_cli("export", "--model", "mlp", "-o", source) == 0
    assert run_cli("transform", source, "-o", planned, "--budget", "0.5x", "--input", "x=8x32", "--input", "y=8",
                   "--report", report_path) == 0
    return source, planned, json.loads(report_path.read_text())


def test_run_of_a_planned_graph_resolves_a_fraction_against_the_original_peak(planned_mlp, tmp_path):
    _, planned, transformed = planned_mlp
    assert transformed["swaps"] and transformed["budget_bytes"] == transformed["baseline_peak_bytes"] // 2
    report_path = tmp_path / "r.json"
    assert run_cli("run", planned, "--budget", "0.5x", "--steps", "2", "--input", "x=8x32", "--input", "y=8",
                   "--json", report_path, "--quiet") == 0
    report = json.loads(report_path.read_text())
    assert report["budget_bytes"] == transformed["budget_bytes"]  # the same bytes the transform planned for
    assert report["baseline_peak_bytes"] == transformed["baseline_peak_bytes"]  # the original step's
    assert report["budget_resolved_against"] == {"source": "recorded by transform", "shapes": {"x": [8, 32], "y": [8]},
                                                 "peak_bytes": transformed["baseline_peak_bytes"]}
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"]


def test_a_planned_graph_below_its_own_plan_names_a_remedy_that_works(planned_mlp, tmp_path, capsys):
    source, planned, _ = planned_mlp
    args = ("--budget", "0.3x", "--input", "x=8x32", "--input", "y=8")
    err = _expect_error(capsys, "run", planned, "--steps", "1", *args, message="transform the original graph again")
    assert "--passes" not in err  # passes are forced to none on a graph that carries swap nodes
    for passes in ("auto", "none"):  # what --passes asks for does not change it
        assert _expect_error(capsys, "run", planned, "--steps", "1", "--passes", passes, *args,
                             message="transform the original graph again") == err
    # The remedy: transforming again (the planned file or the original) plans 0.3x of the original peak.
    again, fresh = tmp_path / "again.json", tmp_path / "fresh.json"
    assert run_cli("transform", planned, "-o", tmp_path / "again.onnx", *args, "--report", again) == 0
    assert run_cli("transform", source, "-o", tmp_path / "fresh.onnx", *args, "--report", fresh) == 0
    again, fresh = json.loads(again.read_text()), json.loads(fresh.read_text())
    assert again["budget_bytes"] == fresh["budget_bytes"] and again["baseline_peak_bytes"] == fresh["baseline_peak_bytes"]
    assert again["planned_peak_bytes"] <= again["budget_bytes"] and again["swaps"]
    assert run_cli("run", tmp_path / "again.onnx", "--steps", "1", *args, "--quiet") == 0


def test_a_fraction_for_other_shapes_than_a_graph_was_planned_for_is_refused(planned_mlp, capsys):
    _, planned, _ = planned_mlp
    _expect_error(capsys, "run", planned, "--budget", "0.5x", "--steps", "1", "--input", "x=4x32", "--input", "y=4",
                  message="planned by ort-offload transform for x=8x32 y=8")
    assert run_cli("run", planned, "--budget", "10MiB", "--steps", "1", "--input", "x=4x32", "--input", "y=4",
                   "--quiet") == 0  # bytes mean the same at any shape
