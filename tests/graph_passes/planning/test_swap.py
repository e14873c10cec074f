"""Swap: the planner's invariants, and training under budgets below the unplanned peak with
results bitwise equal to the unplanned run (issue: swap)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graph_passes.ir import shapes
from graph_passes.ir.allocator import align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Commit, Fetch, Load, RunBlock, SwapIn, SwapOut, lower
from graph_passes.planning.swap.planner import Infeasible, SwapPlanner, apply_swap_plan, required_bytes
from chain_helpers import chain_feeds, chain_graph, run_chain
from helpers import train_ort
from ort_offload.device import set_offload_device
from ort_offload.errors import BudgetTooSmallError


@pytest.fixture(scope="module")
def unplanned():
    return {name: train_ort(name, optimizer="adamw", steps=5) for name in ("mlp", "gpt", "cnn")}


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
@pytest.mark.parametrize("fraction", ["0.5x", "0.25x"])
def test_training_under_a_fraction_of_the_peak_is_bitwise_unplanned(unplanned, name, fraction):
    reference = unplanned[name]
    run = train_ort(name, optimizer="adamw", steps=5, budget=fraction)
    report = run.trainer.report()
    assert report["passes"] == ["swap"]
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    assert report["swap_out_bytes"] > 0 and report["swap_in_bytes"] > 0
    assert report["faults"] == 0
    assert 0 <= report["prefetch_hits"] <= run.trainer.runtime.stats.swap_ins  # hits depend on timing
    simulated = run.trainer.runner.last_trace.peak_device_bytes
    assert abs(simulated - report["peak_device_bytes"]) <= 0.05 * report["peak_device_bytes"]
    assert run.losses == reference.losses
    for key, value in reference.state.items():
        assert run.state[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30], ids=["copy-thread", "at-issue"])
def test_swap_ins_copied_at_issue_or_on_the_copy_thread_give_identical_results(unplanned, monkeypatch, inline_bytes):
    """The CPU device copies small swap-ins when they are issued (a copy thread's hand-off costs
    more); every one copied there and every one on the thread train alike, and copies made at
    issue count as prefetch hits where a block reads them."""
    from ort_offload.runtime import device_backend

    monkeypatch.setattr(device_backend, "CPU_INLINE_COPY_BYTES", inline_bytes)
    reference = unplanned["gpt"]
    run = train_ort("gpt", optimizer="adamw", steps=5, budget="0.5x")
    report, stats = run.trainer.report(), run.trainer.runtime.stats
    assert run.trainer.runtime.backend.inline_copy_bytes == inline_bytes
    assert report["peak_device_bytes"] <= report["budget_bytes"] and report["faults"] == 0
    assert stats.swap_ins > 0 and 0 <= report["prefetch_hits"] <= stats.swap_ins
    if inline_bytes:
        assert report["prefetch_hits"] > 0
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_async_swap_outs_and_a_gpu_plan_give_identical_results_within_the_budget(unplanned, name):
    """Swap-outs on the background engine, with the plan made for the V100 profile (early
    swap-outs; state on the host between steps where the search found it faster), run on the
    CPU device."""
    reference = unplanned[name]
    run = train_ort(name, optimizer="adamw", steps=5, budget="0.5x", async_swap_outs=True,
                    planning_profile="V100-16GB-PCIe3")
    report = run.trainer.report()
    assert report["peak_device_bytes"] <= report["budget_bytes"] and report["faults"] == 0
    assert report["swap_out_bytes"] > 0
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_double_buffered_arena_gives_identical_results_within_the_budget(unplanned, name):
    reference = unplanned[name]
    run = train_ort(name, optimizer="adamw", steps=5, budget="0.5x", arena_policy="double_buffer",
                    async_swap_outs=True)
    report = run.trainer.report()
    assert report["peak_device_bytes"] <= report["budget_bytes"] and report["faults"] == 0
    program = run.trainer.runner.last_prepared.program
    usable = report["budget_bytes"] - program.max_workspace_bytes
    # Both halves were used, and most tensors went to their block's half.
    stats = run.trainer.runtime.stats
    assert run.trainer.runtime.arena.high_water > usable // 2
    assert stats.region_placements > 0 and stats.region_fallbacks < stats.region_placements / 2
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())


def test_unknown_arena_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown arena policy"):
        set_offload_device("cpu", budget="1MiB", arena_policy="buddy")


def test_dropped_prefetches_become_faults_with_identical_results(unplanned):
    reference = unplanned["gpt"]
    run = train_ort("gpt", optimizer="adamw", steps=5, budget="0.5x", drop_prefetches=True)
    report = run.trainer.report()
    assert report["faults"] > 0 and report["prefetch_hits"] == 0
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    assert run.trainer.runtime.stats.fault_log[0][0].startswith(("block", "fetch"))
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())


def test_checkpoints_hold_state_that_lives_on_the_host(tmp_path, unplanned):
    run = train_ort("mlp", optimizer="adamw", steps=5, budget="0.25x")
    assert run.trainer.runner.last_prepared.program.host_state  # some state starts on the host
    path = run.trainer.save(tmp_path / "c.npz")
    other = train_ort("mlp", optimizer="adamw", steps=1)
    other.trainer.load(path)
    assert all(other.trainer.flat_state()[k].tobytes() == v.tobytes() for k, v in unplanned["mlp"].state.items())


# ---- the planner on hand-built graphs ---------------------------------------------------------

def test_the_plan_keeps_every_step_within_the_budget():
    graph = chain_graph(["MatMul", "Relu", "MatMul", "Sigmoid", "Add", "MatMul", "Exp"])
    feeds = chain_feeds()
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, feeds))
    program = lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"],
                    max_block_nodes=1)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    unplanned = simulate_program(program, infos).min_budget_bytes
    least = required_bytes(program, sizes)
    assert least < unplanned
    plan = SwapPlanner().plan(program, sizes, least)
    assert not isinstance(plan, Infeasible)
    planned = apply_swap_plan(program, plan)
    trace = simulate_program(planned, infos, budget=least)
    assert trace.min_budget_bytes <= least and trace.peak_device_bytes <= least
    # Every swapped-out tensor is back before its next use; nothing is swapped in twice.
    resident = set(planned.state_inputs)
    for step in planned.steps:
        if isinstance(step, SwapOut):
            assert step.name in resident
            resident.discard(step.name)
        elif isinstance(step, SwapIn):
            assert step.name not in resident
            resident.add(step.name)
        elif isinstance(step, Load):
            resident.add(step.name)
        elif isinstance(step, Fetch):
            assert step.name in resident
            if step.free:
                resident.discard(step.name)
        elif isinstance(step, RunBlock):
            assert set(planned.blocks[step.block].inputs) <= resident
            resident |= set(step.allocates)
            resident -= set(step.frees)
        elif isinstance(step, Commit):
            for updated, state in step.renames:
                resident.discard(state)
                if updated in resident:
                    resident.discard(updated)
                    resident.add(state)
    assert isinstance(SwapPlanner().plan(program, sizes, least - 64), Infeasible)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["Relu", "Sigmoid", "Neg", "Exp", "MatMul", "Add", "Mul", "Concat"]),
                min_size=1, max_size=10),
       st.floats(0.0, 1.0))
def test_random_graphs_and_budgets_are_exact_or_refused_with_a_minimum_that_plans(ops, position):
    graph = chain_graph(ops)
    feeds = chain_feeds()
    expected_losses, expected_state, unplanned_runtime, prepared = run_chain(graph, feeds, None)
    top = prepared.trace.peak_device_bytes
    budget = max(4096, int(position * top))
    try:
        losses, state, runtime, _ = run_chain(graph, feeds, budget)
    except BudgetTooSmallError as e:
        losses, state, runtime, _ = run_chain(graph, feeds, e.needed_bytes)
        budget = e.needed_bytes
    # Bytes, not ==: overflowing chains (Exp of Exp) give NaN, which must match too.
    assert np.array(losses).tobytes() == np.array(expected_losses).tobytes()
    assert all(state[k].tobytes() == expected_state[k].tobytes() for k in state)
    assert runtime.stats.peak_device_bytes <= budget
    reference = ort.InferenceSession(graph.model.SerializeToString()).run(["loss"], feeds)[0]
    assert np.float32(expected_losses[0]).tobytes() == np.asarray(reference, dtype=np.float32).tobytes()

