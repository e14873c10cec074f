"""The GPU Mimose epoch (benchmarks/gpu_mimose.py): its collector, its planner and an end-to-end
run on the CPU (on the CUDA machine it runs the same code, with measured peaks)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_mimose
from models import get_model


def _trainer():
    return gpu_mimose.Trainer(torch, get_model("bert", "tiny"), torch.device("cpu"))


def test_collector_measures_each_layer_whatever_the_recompute_switch():
    trainer = _trainer()
    (short,), _ = get_model("bert", "tiny").make_batch(4, seq=32, seed=0)
    (long,), _ = get_model("bert", "tiny").make_batch(4, seq=64, seed=0)
    plain = gpu_mimose.layer_saved_bytes(torch, trainer, short)
    trainer.switch.recomputed = frozenset(range(trainer.switch.layers))
    assert gpu_mimose.layer_saved_bytes(torch, trainer, short) == plain  # measured with nothing recomputed
    longer = gpu_mimose.layer_saved_bytes(torch, trainer, long)
    assert len(plain) == trainer.switch.layers == 2
    assert all(0 < a < b for a, b in zip(plain, longer))
    assert all(b >= 2 * a for a, b in zip(plain, longer))  # activations at least in proportion to the length


def test_switched_layers_recompute_and_give_the_same_gradients():
    spec = get_model("bert", "tiny")
    (ids,), (y,) = spec.make_batch(4, seq=24, seed=1)
    grads = []
    for recomputed in (frozenset(), frozenset({0, 1})):
        trainer = _trainer()
        calls = []
        inner = trainer.model.layers[0].layer  # counted in forward itself: hooks do not fire in the recomputation

        def counted(x, forward=inner.forward):
            calls.append(1)
            return forward(x)

        inner.forward = counted
        trainer.switch.recomputed = recomputed
        spec.loss_fn(trainer.model(ids), y).backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
        assert len(calls) == (2 if recomputed else 1)  # the forward again in the backward
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_planner_recomputes_less_for_smaller_inputs_and_plans_each_bucket_for_its_largest_size():
    batch, layers = 8, 4
    planner = gpu_mimose.MimosePlanner(layers, budget=650_000, batch=batch, fit_sizes=3)
    for length in (64, 128, 256):
        size = batch * length
        layer_bytes = [size * size // 200 + 1000 * (k + 1) for k in range(layers)]
        planner.estimator.observe(size, layer_bytes, 600_000 + sum(layer_bytes))
    assert planner.estimator.ready
    small, large = planner.plan(batch * 40), planner.plan(batch * 256)
    assert len(small) < len(large) and large
    top = planner.bucket_top(batch * 200)
    assert top >= batch * 200 and planner.cache.key(top) == planner.cache.key(batch * 200)
    assert planner.cache.key(top + batch) != planner.cache.key(top) or top == batch * gpu_mimose.MAX_LENGTH
    made = len(planner.plan_times_s)
    assert planner.plan(batch * 200) == planner.plan(top)  # one plan serves the bucket
    assert len(planner.plan_times_s) == made + 1


def test_a_cpu_run_writes_three_rows_with_equal_losses(tmp_path, capsys):
    out = tmp_path / "gpu_mimose.json"
    deterministic = torch.are_deterministic_algorithms_enabled()
    assert gpu_mimose.main(["--device", "cpu", "--config", "tiny", "--steps", "8", "--batch", "2",
                            "--fit-sizes", "3", "--out", str(out)]) == 0
    # Deterministic mode is the run's alone (left on, it changes how later exports decompose ops).
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"unplanned", "static", "input_aware"}
    for row in result["rows"].values():
        assert len(row["steps"]) == 8 and row["losses_bitwise_equal"] and row["epoch_s"] > 0
    aware = result["rows"]["input_aware"]
    assert aware["collect_s_total"] > 0 and aware["plans_made"] >= 1
    collected = [s for s in aware["steps"] if s["collect_s"] > 0]
    assert collected and all(s["plan_s"] is None and s["recomputed_layers"] == 2 for s in collected)  # sheltered
    assert all(s["plan_s"] is not None for s in aware["steps"][len(collected):])
    assert result["speedup_epoch"] == pytest.approx(result["rows"]["static"]["epoch_s"] / aware["epoch_s"])
    assert "static / input-aware epoch" in capsys.readouterr().out
