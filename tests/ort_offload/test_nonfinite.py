"""Non-finite values and inputs out of range: NaN/inf steps are counted (``nonfinite_steps``)
or, with ``stop_on_nonfinite``, raise before the state changes; reports are strict JSON;
empty batches and token ids outside the vocabulary are InputMismatchErrors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ort_offload
from helpers import batches, train_ort
from models import get_model
from ort_offload.cli import main
from ort_offload.errors import InputMismatchError, NonFiniteError
from ort_offload.export.optimizers import SGD
from ort_offload.report import REPORT_KEYS, to_json


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity (what other JSON readers do)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def unchanged(before, after) -> bool:
    return all(before[k].tobytes() == after[k].tobytes() for k in before)


def test_a_nan_batch_is_counted_and_the_report_stays_strict_json():
    run = train_ort("mlp", steps=1, optimizer="adamw")
    ((x,), (y,)), = batches("mlp", 1)
    x = x.clone()
    x[0, 0] = float("nan")
    assert np.isnan(run.trainer.step(x, y))
    report = run.trainer.report()
    assert "nonfinite_steps" in REPORT_KEYS and report["nonfinite_steps"] == 1
    parsed = strict_json(to_json(report))
    assert parsed["losses"][-1] is None and parsed["losses"][0] is not None


def test_stop_on_nonfinite_raises_before_the_state_changes():
    run = train_ort("mlp", steps=1, optimizer="adamw", stop_on_nonfinite=True)
    before = run.trainer.flat_state()
    ((x,), (y,)), = batches("mlp", 1)
    bad = x.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(NonFiniteError, match="step 2 .*the loss"):
        run.trainer.step(bad, y)
    assert unchanged(before, run.trainer.flat_state())
    assert run.trainer.steps_done == 1 and len(run.trainer.losses) == 1
    assert np.isfinite(run.trainer.step(x, y)) and run.trainer.steps_done == 2  # it goes on training


def test_an_overflowing_update_is_caught_though_the_loss_is_finite():
    spec = get_model("mlp", "tiny")
    ((x,), (y,)), = batches("mlp", 1)
    trainer = ort_offload.create_ort_trainer(
        ort_offload.set_offload_device("cpu"), spec.model, loss_fn=spec.loss_fn, example_inputs=(x,),
        example_targets=(y,), optimizer=SGD(lr=3e38), stop_on_nonfinite=True)
    before = trainer.flat_state()
    with pytest.raises(NonFiniteError) as caught:
        trainer.step(x * 1000, y)
    assert "the loss" not in str(caught.value)  # an updated tensor, not the loss, was non-finite
    assert unchanged(before, trainer.flat_state()) and trainer.steps_done == 0


def test_empty_batches_are_refused():
    run = train_ort("mlp", steps=1)
    ((x,), (y,)), = batches("mlp", 1)
    with pytest.raises(InputMismatchError, match="no elements"):
        run.trainer.step(x[:0], y[:0])
    assert run.trainer.steps_done == 1


def test_token_ids_outside_the_vocabulary_are_input_mismatches_and_change_nothing():
    data = batches("gpt", 2)
    run = train_ort("gpt", data=data[:1], optimizer="adamw")
    before = run.trainer.flat_state()
    (ids,), (targets,) = data[1]
    for bad in (ids - ids - 1, ids + 10_000):  # -1 (ONNX Runtime would wrap it) and past the table
        with pytest.raises(InputMismatchError, match="vocabulary"):
            run.trainer.step(bad, targets)
    assert unchanged(before, run.trainer.flat_state())
    assert np.isfinite(run.trainer.step(ids, targets))


def test_cli_warns_about_nonfinite_steps_and_writes_null(tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code = main(["train", "--model", "mlp", "--lr", "1e38", "--steps", "3", "--json", str(report_path), "--quiet"])
    assert code == 0
    assert "warning" in capsys.readouterr().err
    report = strict_json(report_path.read_text())
    assert report["nonfinite_steps"] >= 1 and None in report["losses"]


def test_cli_stop_on_nonfinite_exits_2_with_one_line_and_no_report(tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code = main(["train", "--model", "mlp", "--lr", "1e38", "--steps", "3", "--stop-on-nonfinite",
                 "--json", str(report_path), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "non-finite" in err
    assert not report_path.exists()


def test_dynamic_trainer_stops_before_the_optimizer_on_a_nan_loss():
    from models import get_dynamic_model
    from ort_offload.dynamic.trainer import BlockwiseTrainer

    spec = get_dynamic_model("var-bert", "tiny")
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, stop_on_nonfinite=True)
    try:
        (ids,), (y,) = spec.make_batch(seed=0)
        before = {k: v.copy() for k, v in trainer.flat_state().items()}
        with pytest.raises(NonFiniteError):
            _nan_step(trainer, ids, y)
        assert unchanged(before, trainer.flat_state())
        assert trainer.report()["nonfinite_steps"] == 1
    finally:
        trainer.close()


def _nan_step(trainer, ids, y):
    """A step whose loss is NaN: the loss function scales it by NaN."""
    original = trainer.loss_fn
    trainer.loss_fn = lambda out, *targets: original(out, *targets) * float("nan")
    try:
        trainer.step(ids, y)
    finally:
        trainer.loss_fn = original


def test_an_empty_example_batch_is_refused_before_the_export():
    spec = get_model("mlp", "tiny")
    ((x,), (y,)), = batches("mlp", 1)
    with pytest.raises(InputMismatchError, match="no elements"):
        ort_offload.create_ort_trainer(ort_offload.set_offload_device("cpu"), spec.model, loss_fn=spec.loss_fn,
                                       example_inputs=(x[:0],), example_targets=(y[:0],))


def test_index_limits_follow_gathers_through_casts_into_states_and_initializers():
    import onnx
    import onnx.helper as oh

    from ort_offload.export.graph_inputs import gather_index_limits

    nodes = [oh.make_node("Cast", ["ids"], ["ids64"], to=onnx.TensorProto.INT64),
             oh.make_node("Gather", ["emb", "ids64"], ["e"]),
             oh.make_node("Gather", ["frozen", "tags"], ["f"], axis=1),
             oh.make_node("Gather", ["emb", "other"], ["g"])]  # "other" is not a batch input
    graph = oh.make_graph(nodes, "g", [], [], initializer=[oh.make_tensor("frozen", onnx.TensorProto.FLOAT, [2, 7],
                                                                          [0.0] * 14)])
    limits = gather_index_limits(oh.make_model(graph), {"emb": (50, 8)}, ["ids", "tags"])
    assert limits == {"ids": (50, "emb"), "tags": (7, "frozen")}


def test_the_state_check_follows_a_tensor_whose_dtype_changes():
    """Which state tensors are floating is kept per state version: a new placement that makes
    an integer tensor floating (and NaN) is checked."""
    from ort_offload.runtime.runner import Runtime

    runtime = Runtime(ort_offload.set_offload_device("cpu", budget=None))
    runtime.place_state({"w": np.ones(4, np.float32), "n": np.zeros(2, np.int64)}, ["w", "n"], 4096)
    assert runtime.first_nonfinite(["w", "n"]) is None
    runtime.place_state({"w": np.ones(4, np.float32), "n": np.array([np.nan, 1.0], np.float32)}, ["w", "n"], 4096)
    assert runtime.first_nonfinite(["w", "n"]) == "n"
    runtime.write("w", np.array([1.0, np.inf, 0.0, 0.0], np.float32))
    assert runtime.first_nonfinite(["w", "n"]) == "w"


def test_the_fused_finiteness_check_finds_one_bad_element_anywhere_and_survives_overflow(monkeypatch):
    from ort_offload.runtime import device_memory
    from ort_offload.runtime.device_memory import FiniteCheck

    monkeypatch.setattr(device_memory, "FUSED_FINITE_BYTES", 64)  # 16-float arrays and smaller are gathered
    arrays = [np.ones(n, dtype=np.float32) for n in (3, 16, 40)] + [np.ones(5, dtype=np.float16)]
    check = FiniteCheck(arrays)
    assert len(check.gathered) == 2 and len(check.large) == 1 and check()
    for array in arrays:
        for bad in (np.nan, np.inf, -np.inf):
            array[-1] = bad
            assert not check(), (array.dtype, array.size, bad)  # read in place: no new check needed
            array[-1] = 1
    assert check()
    huge = [np.full(16, np.finfo(np.float32).max, dtype=np.float32), np.full(40, np.finfo(np.float32).max, dtype=np.float32)]
    assert FiniteCheck(huge)()  # the sums overflow, each element is finite
