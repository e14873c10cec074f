"""Time simulator (three FIFO streams, arena over time) and swap-in hoisting (prefetch placement):
stream orderings, agreement with the memory-only replay, hoisting within the budget and never
slower, and hoisted programs running bitwise equal in the runtime (issue: swap, items 3-4)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from graph_passes.ir import shapes
from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.ir.memory import simulate_program
from graph_passes.planning.swap.prefetch import hoist_swap_ins
from graph_passes.ir.program import Fetch, Load, RunBlock, SwapIn, SwapOut
from graph_passes.cost.simulator import COMPUTE, D2H, H2D, simulate_time, unlimited_time
from graph_passes.planning.swap.planner import apply_swap_plan
from ort_offload.device import set_offload_device
from ort_offload.runtime.runner import GraphRunner, Runtime
from chain_helpers import chain_feeds, planned_chain

INSTANT = dataclasses.replace(
    V100_16GB_PCIE3, name="instant-link", h2d_bandwidth=1e30, d2h_bandwidth=1e30, duplex_bandwidth=2e30
)


def copies_in_program_order(program, stream):
    labels = []
    for step in program.steps:
        if stream == H2D and isinstance(step, Load):
            labels.append(f"load {step.name}")
        elif stream == H2D and isinstance(step, SwapIn):
            labels.append(f"swap in {step.name}")
        elif stream == D2H and isinstance(step, SwapOut) and step.copy:
            labels.append(f"swap out {step.name}")
        elif stream == D2H and isinstance(step, Fetch):
            labels.append(f"fetch {step.name}")
        elif stream == COMPUTE and isinstance(step, RunBlock):
            labels.append(f"block {step.block}")
    return labels


@pytest.mark.parametrize("where", [0.0, 0.5])
def test_streams_are_fifo_and_blocks_wait_for_their_swap_ins(where):
    graph, infos, _, planned, budget = planned_chain(256, where)
    assert any(isinstance(s, SwapIn) for s in planned.steps)
    trace = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    for stream in (COMPUTE, H2D, D2H):
        events = trace.stream(stream)
        # FIFO: the stream runs its steps in program order, one at a time.
        assert [e.label for e in events] == copies_in_program_order(planned, stream)
        for a, b in zip(events, events[1:]):
            assert a.end_s <= b.start_s
    by_label = {e.label: e for e in trace.events}
    last_block_end: dict[str, float] = {}
    for step in planned.steps:
        if isinstance(step, RunBlock):
            block = by_label[f"block {step.block}"]
            for name in planned.blocks[step.block].inputs:
                arrival = by_label.get(f"swap in {name}") or by_label.get(f"load {name}")
                if arrival is not None and arrival.start_s <= block.start_s:
                    assert arrival.end_s <= block.start_s, (name, step.block)
            for name in planned.blocks[step.block].inputs + step.allocates:
                last_block_end[name] = block.end_s
        elif isinstance(step, SwapOut) and step.copy:
            assert by_label[f"swap out {step.name}"].start_s >= last_block_end.get(step.name, 0.0)
    compute = trace.stream(COMPUTE)
    assert trace.compute_time_s == pytest.approx(sum(e.duration_s for e in compute))
    assert compute[-1].end_s == pytest.approx(trace.compute_time_s + trace.stall_time_s)
    assert trace.h2d_busy_s == pytest.approx(sum(e.duration_s for e in trace.stream(H2D)))
    assert trace.d2h_busy_s == pytest.approx(sum(e.duration_s for e in trace.stream(D2H)))
    assert trace.step_time_s >= max(e.end_s for e in trace.events)
    assert trace.peak_bytes <= budget


@pytest.mark.parametrize("width,where", [(16, 0.0), (16, 0.5), (256, 0.0), (256, 0.5), (256, 1.0)])
def test_instantaneous_copies_give_the_memory_replays_peak_and_pure_compute_time(width, where):
    graph, infos, program, planned, _ = planned_chain(width, where)
    for p in (program, planned):
        trace = simulate_time(p, infos, model=graph.model, profile=INSTANT)
        assert trace.peak_bytes == simulate_program(p, infos).min_budget_bytes
        compute = unlimited_time(p, infos, model=graph.model, profile=INSTANT)
        assert trace.compute_time_s == pytest.approx(compute, rel=1e-12)
        assert trace.step_time_s == pytest.approx(compute, rel=1e-9)
        assert trace.stall_time_s == pytest.approx(0.0, abs=1e-12)


def test_copies_on_a_slow_link_stall_compute_and_an_unlimited_budget_never_waits_for_memory():
    graph, infos, program, planned, budget = planned_chain(256, 0.5)
    unlimited = unlimited_time(program, infos, model=graph.model, profile=V100_16GB_PCIE3)
    trace = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    assert trace.stall_time_s > 0 and trace.step_time_s > unlimited
    free = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=math.inf)
    assert free.step_time_s <= trace.step_time_s and free.peak_bytes >= trace.peak_bytes


def _same_steps_but_swap_ins(a, b):
    assert Counter(a.steps) == Counter(b.steps)
    assert [s for s in a.steps if not isinstance(s, SwapIn)] == [s for s in b.steps if not isinstance(s, SwapIn)]
    assert [s for s in a.steps if isinstance(s, SwapIn)] == [s for s in b.steps if isinstance(s, SwapIn)]


@pytest.mark.parametrize("width", [16, 256, 1024])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.6])
def test_hoisting_stays_within_the_budget_and_is_never_slower(width, where):
    graph, infos, _, planned, budget = planned_chain(width, where)
    hoisted = hoist_swap_ins(planned, infos, budget=budget)
    _same_steps_but_swap_ins(planned, hoisted)
    assert simulate_program(hoisted, infos, budget=budget).min_budget_bytes <= budget
    before = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    after = simulate_time(hoisted, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    assert after.peak_bytes <= budget
    assert after.step_time_s <= before.step_time_s + 1e-12
    assert after.stall_time_s <= before.stall_time_s + 1e-12
    bounded = hoist_swap_ins(planned, infos, budget=budget, lookahead_blocks=1)
    _same_steps_but_swap_ins(planned, bounded)
    assert simulate_program(bounded, infos, budget=budget).min_budget_bytes <= budget


def test_hoisting_hides_a_just_in_time_swap_in_under_compute():
    graph, infos, program, planned, budget = planned_chain(256, 0.6)
    hoisted = hoist_swap_ins(planned, infos, budget=budget)
    assert hoisted.steps != planned.steps
    before = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    after = simulate_time(hoisted, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    assert after.stall_time_s < 0.5 * before.stall_time_s
    assert after.step_time_s < before.step_time_s
    unlimited = unlimited_time(program, infos, model=graph.model, profile=V100_16GB_PCIE3)
    assert unlimited / after.step_time_s > unlimited / before.step_time_s
    # No room to move: a budget with no slack anywhere leaves the program as it is.
    assert hoist_swap_ins(planned, infos, budget=0).steps == planned.steps


def test_guarded_hoisting_keeps_only_moves_that_do_not_slow_the_step():
    graph, infos, _, planned, budget = planned_chain(1024, 0.0)
    calls = []

    def step_time(p):
        calls.append(p)
        return simulate_time(p, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget).step_time_s

    guarded = hoist_swap_ins(planned, infos, budget=budget, evaluate=step_time)
    _same_steps_but_swap_ins(planned, guarded)
    assert calls and step_time(guarded) <= step_time(planned)
    assert simulate_program(guarded, infos, budget=budget).min_budget_bytes <= budget


def _run(graph, feeds, budget, *, hoist, steps=3):
    runtime = Runtime(set_offload_device("cpu", budget=budget, max_block_nodes=1))
    runner = GraphRunner(runtime, graph, fetches=["loss"], passes=("swap",))
    prepared = runner.prepare(shapes.check_inputs(graph.model, feeds))
    if prepared.swap_plan is not None:
        just_in_time = apply_swap_plan(prepared.base_program, prepared.swap_plan)
        if hoist:  # the runtime issues swap-outs early and hoists swap-ins itself
            assert prepared.program.steps != just_in_time.steps
            assert Counter(just_in_time.steps) == Counter(prepared.program.steps)
            moved = (SwapIn, SwapOut)
            assert ([s for s in just_in_time.steps if not isinstance(s, moved)]
                    == [s for s in prepared.program.steps if not isinstance(s, moved)])
        else:
            prepared = dataclasses.replace(prepared, program=just_in_time)
    else:
        assert not hoist
    runtime.place_state(feeds, prepared.program.state_inputs, runner.capacity_for(prepared),
                        host=prepared.program.host_state)
    losses = [float(runner.run({"x": feeds["x"]}, prepared)["loss"]) for _ in range(steps)]
    return losses, {n: runtime.read(n) for n in ("w", "w2")}, runtime


@pytest.mark.parametrize("where", [0.1, 0.6])
def test_hoisted_programs_run_bitwise_equal_in_the_runtime(where):
    width = 64
    graph, _, _, _, budget = planned_chain(width, where)
    feeds = chain_feeds(width)
    ref_losses, ref_state, _ = _run(graph, feeds, None, hoist=False)
    losses, state, runtime = _run(graph, feeds, budget, hoist=True)
    assert runtime.stats.swap_in_bytes > 0 and runtime.stats.faults == 0
    assert runtime.stats.peak_device_bytes <= budget
    assert losses == ref_losses
    assert all(state[k].tobytes() == ref_state[k].tobytes() for k in ref_state)


def test_copies_that_share_the_compute_cores_add_their_whole_time():
    graph, infos, _, planned, budget = planned_chain(256, 0.4)
    shared = dataclasses.replace(V100_16GB_PCIE3, name="cpu-like", copies_overlap_compute=False)
    overlapped = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    serial = simulate_time(planned, infos, model=graph.model, profile=shared, budget=budget)
    copies = serial.h2d_busy_s + serial.d2h_busy_s
    assert copies > 0
    assert serial.step_time_s == pytest.approx(serial.compute_time_s + copies)
    assert serial.step_time_s >= overlapped.step_time_s


def test_gpu_replay_orderings_reproduce_the_simulated_step():
    """benchmarks/gpu_check.py replays a simulated trace on a GPU from orderings it reads off the
    trace (an event waits for what ended when it started): with the simulated durations, those
    orderings must give back the simulated step time exactly, and without copies, no more."""
    from benchmarks.gpu_check import _dependencies, _issue_order, critical_path_s

    graph, infos, _program, planned, budget = planned_chain(8, 0.3)
    trace = simulate_time(planned, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget)
    events = [[e.stream, e.label, e.start_s, e.end_s, e.nbytes] for e in trace.events if e.stream != "drop"]
    assert any(e[0] == H2D for e in events) and any(e[0] == D2H for e in events)
    deps = _dependencies(events)
    order = _issue_order(events, deps)
    assert sorted(order) == list(range(len(events)))
    assert all(order.index(j) < order.index(i) for i, d in enumerate(deps) for j in d)
    assert critical_path_s(events, deps, order) == pytest.approx(trace.step_time_s, rel=1e-12)
    without = critical_path_s(events, deps, order, copies=False)
    assert without == pytest.approx(trace.compute_time_s, rel=1e-9) and without <= trace.step_time_s


def _hoisted_step_by_step(program, infos, budget, lookahead_blocks=None):
    """The reference for hoisting: each swap-in walked up one step at a time, the barrier and
    the memory at each step worked out afresh (the arena's bytes from a new profile per move)."""
    from graph_passes.ir.allocator import align_up
    from graph_passes.ir.program import Commit
    from graph_passes.planning.swap.prefetch import _profile

    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    steps, position = list(program.steps), 0

    def barrier(step, name):
        if isinstance(step, (SwapIn, Load, Commit)):
            return True
        if isinstance(step, (SwapOut, Fetch)):
            return step.name == name
        blocks = program.blocks[step.block]
        return name in blocks.inputs or name in step.allocates or name in step.frees

    for position, step in enumerate(list(steps)):
        if not isinstance(step, SwapIn):
            continue
        before, point = _profile(program, steps, sizes)
        target, crossed = position, 0
        while target > 0 and not barrier(steps[target - 1], step.name):
            is_block = isinstance(steps[target - 1], RunBlock)
            if is_block and lookahead_blocks is not None and crossed >= lookahead_blocks:
                break
            if max(point[target - 1], before[target - 1]) + sizes[step.name] > budget:
                break
            crossed, target = crossed + is_block, target - 1
        while target < position and isinstance(steps[target], (SwapOut, Fetch)):
            target += 1
        steps.insert(target, steps.pop(position))
    return steps


@pytest.mark.parametrize("width", [16, 256])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.6])
@pytest.mark.parametrize("order", ["belady", "clean_first"])
def test_hoisting_places_every_swap_in_where_the_step_by_step_walk_does(width, where, order):
    """The hoisting pass (barriers and memory points computed once per call) against the
    reference walk, on plans as the grid makes them (swap-outs early, state on the host) and
    as the planner makes them, with and without a lookahead bound."""
    from graph_passes.ir.allocator import align_up
    from graph_passes.planning.swap.eviction import issue_swap_outs_early
    from graph_passes.planning.swap.planner import SwapPlanner

    _, infos, program, _, budget = planned_chain(width, where)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    for host_state in (None, program.state_inputs):
        plan = SwapPlanner().plan(program, sizes, budget, host_state=host_state, eviction=order)
        applied = apply_swap_plan(program, plan)
        for planned in (applied, issue_swap_outs_early(applied)):
            for lookahead in (None, 0, 2):
                hoisted = hoist_swap_ins(planned, infos, budget=budget, lookahead_blocks=lookahead)
                assert list(hoisted.steps) == _hoisted_step_by_step(planned, infos, budget, lookahead)
