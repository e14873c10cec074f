"""Overlap-aware swap planning: early swap-outs (graph_passes.planning.swap.eviction), forced host-resident
state (SwapPlanner.plan(host_state=...)), and the search over block size × state placement
(graph_passes.planning.swap.search), checked by invariants and by running the chosen plans bitwise
equal in the runtime (issue: swap, item 4)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from graph_passes.ir import shapes
from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.planning.swap.eviction import issue_swap_outs_early
from graph_passes.ir.allocator import align_up
from graph_passes.ir.memory import least_budget_bytes, simulate_program
from graph_passes.planning.swap.prefetch import hoist_swap_ins
from graph_passes.ir.program import Block, Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut, lower
from graph_passes.cost.simulator import simulate_time
from graph_passes.planning.swap.planner import EVICTION_ORDERS, Infeasible, SwapPlanner, apply_swap_plan
from graph_passes.planning.swap.search import STATE_ALL, STATE_NONE, SwapSearch, state_first_read_after_peak
from chain_helpers import chain_feeds, chain_graph, planned_chain, run_chain

OPS = ["MatMul", "Relu", "MatMul", "Sigmoid", "Add", "MatMul", "Exp", "Concat", "Relu"]


def _touches(program, step, name):
    if isinstance(step, (Load, SwapIn, SwapOut)):
        return step.name == name
    if isinstance(step, RunBlock):
        return name in program.blocks[step.block].inputs or name in step.allocates or name in step.frees
    return isinstance(step, Commit)


@pytest.mark.parametrize("width", [16, 256])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.6])
def test_early_swap_outs_follow_the_last_touch_and_never_raise_memory(width, where):
    graph, infos, _, planned, budget = planned_chain(width, where)
    early = issue_swap_outs_early(planned)
    assert Counter(early.steps) == Counter(planned.steps)
    assert [s for s in early.steps if not isinstance(s, SwapOut)] == [s for s in planned.steps if not isinstance(s, SwapOut)]
    assert early.steps != planned.steps or not any(isinstance(s, SwapOut) for s in planned.steps)
    for position, step in enumerate(early.steps):
        if isinstance(step, SwapOut) and position > 0:
            # Directly after a step that touches the tensor, or after other swap-outs that do not.
            k = position - 1
            while k > 0 and isinstance(early.steps[k], SwapOut) and early.steps[k].name != step.name:
                k -= 1
            assert _touches(early, early.steps[k], step.name) or isinstance(early.steps[k], SwapOut)
    before = simulate_program(planned, infos, budget=budget)
    after = simulate_program(early, infos, budget=budget)
    assert after.min_budget_bytes <= before.min_budget_bytes <= budget
    assert max(p.in_use for p in after.timeline) <= max(p.in_use for p in before.timeline)


def _swap_outs_moved_one_step_at_a_time(program):
    """The placement by its definition: each swap-out, in program order, moved up one step at
    a time while the step above does not touch its tensor and is not a Commit."""
    steps = list(program.steps)
    for position in range(len(steps)):
        step = steps[position]
        if not isinstance(step, SwapOut):
            continue
        target = position
        while target > 0:
            above = steps[target - 1]
            if isinstance(above, (Load, SwapIn, SwapOut, Fetch)) and above.name == step.name:
                break
            if isinstance(above, RunBlock) and _touches(program, above, step.name) or isinstance(above, Commit):
                break
            target -= 1
        steps.insert(target, steps.pop(position))
    return tuple(steps)


@pytest.mark.parametrize("seed", range(40))
def test_early_swap_outs_in_one_pass_are_the_step_by_step_moves(seed):
    """Random step sequences over a few tensors (swap-outs of the same tensor twice, behind the
    same step, at the start, across Commits and Fetches): the one pass places every swap-out
    where moving it one step at a time does."""
    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(5)]
    blocks, steps = [], []
    for _ in range(int(rng.integers(5, 40))):
        kind = rng.choice(["block", "out", "out", "in", "fetch", "commit", "load"], p=[0.3, 0.2, 0.2, 0.1, 0.08, 0.05, 0.07])
        name = str(rng.choice(names))
        if kind == "block":
            reads = tuple(str(n) for n in rng.choice(names, size=int(rng.integers(0, 3)), replace=False))
            made = (f"m{len(blocks)}",) if rng.random() < 0.5 else ()
            blocks.append(Block(len(blocks), (len(blocks),), reads, made, 0))
            steps.append(RunBlock(len(blocks) - 1, made, (name,) if rng.random() < 0.2 else ()))
        elif kind == "out":
            steps.append(SwapOut(name, copy=bool(rng.random() < 0.7)))
        elif kind == "in":
            steps.append(SwapIn(name))
        elif kind == "fetch":
            steps.append(Fetch(name, free=False))
        elif kind == "commit":
            steps.append(Commit(((f"{name}_new", name),)))
        else:
            steps.append(Load(name))
    program = Program(tuple(blocks), tuple(steps), (), (), ())
    assert issue_swap_outs_early(program).steps == _swap_outs_moved_one_step_at_a_time(program)


@pytest.mark.parametrize("width", [16, 256])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.6, 1.0])
def test_the_least_budget_in_one_step_is_the_full_replays(width, where):
    """What the GA checks each genome with: the two-step arena replay's need, from one step where
    the step ends holding what it started with (every planned program here: a steady state)."""
    graph, infos, program, planned, budget = planned_chain(width, where)
    host = SwapPlanner().plan(program, {n: align_up(i.nbytes) for n, i in infos.items()}, budget,
                              host_state=[n for n in program.state_inputs][:2])
    for candidate in (program, planned, issue_swap_outs_early(planned), apply_swap_plan(program, host)):
        for cap in (None, budget) if candidate is not program else (None,):
            assert least_budget_bytes(candidate, infos, budget=cap) == simulate_program(candidate, infos, budget=cap).min_budget_bytes


def test_early_swap_outs_and_host_state_run_bitwise_equal_in_the_runtime():
    width = 64
    graph, infos, program, _, budget = planned_chain(width, 0.3)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    plan = SwapPlanner().plan(program, sizes, budget, host_state=program.state_inputs)
    assert not isinstance(plan, Infeasible)
    assert set(plan.host_state) == set(program.state_inputs)
    placed = hoist_swap_ins(issue_swap_outs_early(apply_swap_plan(program, plan)), infos, budget=budget)
    assert simulate_program(placed, infos, budget=budget).min_budget_bytes <= budget
    assert placed.host_state == tuple(program.state_inputs) and placed.state_inputs == ()

    # The runtime's own choice (the search) against the unplanned run.
    feeds = chain_feeds(width)
    ref_losses, ref_state, _, _ = run_chain(graph, feeds, None, steps=3)
    losses, state, runtime, prepared = run_chain(graph, feeds, budget, steps=3)
    assert prepared.swap_plan is not None
    assert losses == ref_losses
    assert all(state[k].tobytes() == ref_state[k].tobytes() for k in ref_state)
    assert runtime.stats.peak_device_bytes <= budget and runtime.stats.faults == 0


def test_forced_host_state_ends_every_step_on_the_host():
    graph, infos, program, _, budget = planned_chain(64, 1.0)  # the budget needs no swaps at all
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    plan = SwapPlanner().plan(program, sizes, budget, host_state=["w"])
    assert plan.host_state == ("w",)
    placed = apply_swap_plan(program, plan)
    ins = [s for s in placed.steps if isinstance(s, SwapIn)]
    outs = [s for s in placed.steps if isinstance(s, SwapOut)]
    assert [s.name for s in ins] == ["w"]  # comes in for its first use
    assert graph.state_pairs["w"] in [o.name for o in outs]  # its update goes back before the step ends
    with pytest.raises(ValueError, match="not state inputs"):
        SwapPlanner().plan(program, sizes, budget, host_state=["x"])


def _search(width, where, evaluate=None):
    graph, infos, _, _, budget = planned_chain(width, where)
    programs = [lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"],
                      max_block_nodes=n) for n in (8, 4, 2, 1)]

    def step_time(p):
        return simulate_time(p, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget).step_time_s

    return graph, infos, budget, SwapSearch().search(programs, infos, budget=budget, evaluate=evaluate or step_time)


@pytest.mark.parametrize("where", [0.0, 0.4])
def test_search_picks_the_fastest_candidate_within_the_budget(where):
    graph, infos, budget, result = _search(256, where)
    assert result is not None
    timed = [s for _, _, s in result.considered if s is not None]
    assert result.best.step_time_s == min(timed)
    assert result.best.trace.min_budget_bytes <= budget
    assert simulate_program(result.best.program, infos, budget=budget).min_budget_bytes <= budget
    assert {label for _, label, _ in result.considered} >= {STATE_NONE, STATE_ALL}


def test_search_follows_the_evaluator():
    # An evaluator that prefers many blocks and all state on the host must get exactly that.
    def prefer_small_blocks_and_host_state(p):
        return 1.0 / len(p.blocks) - 1e-3 * len(p.host_state)

    _, _, _, result = _search(256, 0.4, evaluate=prefer_small_blocks_and_host_state)
    assert result.best.state_placement == STATE_ALL
    assert len(result.best.base_program.blocks) == max(b for b, _, s in result.considered if s is not None)


def test_search_returns_none_when_no_program_plans():
    graph, infos, _, _, _ = planned_chain(64, 0.0)
    programs = [lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"],
                      max_block_nodes=1)]
    assert SwapSearch().search(programs, infos, budget=1, evaluate=lambda p: 0.0) is None
    with pytest.raises(ValueError, match="unknown state placements"):
        SwapSearch(state_placements=["somewhere"])


def test_state_read_only_after_the_peak_is_the_optimizer_tail():
    graph = chain_graph(OPS, width=64)
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, chain_feeds(64)))
    program = lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"],
                    max_block_nodes=1)
    late = state_first_read_after_peak(program, infos, alignment=256)
    assert late <= set(program.state_inputs)
    # The weights are read in the forward, before the peak.
    assert "w" not in late and "w2" not in late


# ---- memory-aware partition (graph_passes.planning.partition) --------------------------------------------

@pytest.mark.parametrize("where", [0.3, 0.7])
def test_memory_aware_partition_fits_with_no_more_blocks_than_a_uniform_one(where):
    from graph_passes.planning.partition import fit_blocks

    graph = chain_graph(OPS * 3, width=64)
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, chain_feeds(64)))

    def lowered(**options):
        return lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=["x"], fetches=["loss"], **options)

    whole = lowered(max_block_nodes=10_000)
    finest = simulate_program(lowered(max_block_nodes=1), infos).min_budget_bytes
    top = simulate_program(whole, infos).min_budget_bytes
    budget = int(finest + where * (top - finest))
    uniform = next(p for n in (64, 32, 16, 8, 4, 2, 1)
                   if simulate_program(p := lowered(max_block_nodes=n), infos).min_budget_bytes <= budget)
    count = len(graph.model.graph.node)
    found = fit_blocks(lambda cuts: lowered(max_block_nodes=count, extra_cuts=cuts), infos, budget=budget,
                       position_of={i: i for i in range(count)})
    assert found is not None
    program, trace = found
    assert trace.min_budget_bytes <= budget
    assert sorted(i for b in program.blocks for i in b.node_indices) == list(range(count))
    assert len(program.blocks) <= len(uniform.blocks)
    assert fit_blocks(lambda cuts: lowered(max_block_nodes=count, extra_cuts=cuts), infos, budget=finest - 1,
                      position_of={i: i for i in range(count)}) is None
    # A block limit: the same partition where it allows as many blocks, none where it allows fewer
    # (the refinement only adds cuts), found in no more rounds than without the limit.
    calls = []

    def counted(cuts):
        calls.append(cuts)
        return lowered(max_block_nodes=count, extra_cuts=cuts)

    within = fit_blocks(counted, infos, budget=budget, position_of={i: i for i in range(count)},
                        max_blocks=len(program.blocks))
    assert within is not None and [b.node_indices for b in within[0].blocks] == [b.node_indices for b in program.blocks]
    rounds = len(calls)
    if len(program.blocks) > 1:
        calls.clear()
        assert fit_blocks(counted, infos, budget=budget, position_of={i: i for i in range(count)},
                          max_blocks=len(program.blocks) - 1) is None
        assert len(calls) <= rounds


def _clean_or_dirty_program():
    """State ``s`` (on the host between steps, so clean once in) and an activation ``a`` (dirty)
    are both resident when block 1 allocates ``b`` over the budget; ``s`` is read again sooner."""
    f32 = np.dtype("float32")
    infos = {n: shapes.TensorInfo(f32, (k,)) for n, k in (("s", 256), ("a", 256), ("b", 256), ("c", 32), ("loss", 1))}
    blocks = (Block(0, (0,), ("s",), ("a",), 0), Block(1, (1,), (), ("b",), 0),
              Block(2, (2,), ("s", "b"), ("c",), 0), Block(3, (3,), ("a", "c"), ("loss",), 0))
    steps = (RunBlock(0, ("a",), ()), RunBlock(1, ("b",), ()), RunBlock(2, ("c",), ("b",)),
             RunBlock(3, ("loss",), ("a", "c")), Fetch("loss", True))
    program = Program(blocks, steps, state_inputs=("s",), data_inputs=(), fetches=("loss",))
    return program, infos, {n: align_up(i.nbytes) for n, i in infos.items()}


@pytest.mark.parametrize("eviction, victim, copied", [("belady", "a", True), ("clean_first", "s", False)])
def test_the_victim_order_is_belady_by_default_or_clean_first(eviction, victim, copied):
    """Belady evicts the tensor used furthest ahead (the dirty activation, a copy out); clean
    first drops the state the host already holds (no copy), Belady within each class."""
    program, infos, sizes = _clean_or_dirty_program()
    budget = 2 * sizes["s"] + sizes["c"] + sizes["loss"]
    planner = SwapPlanner()
    plan = planner.plan(program, sizes, budget, host_state=["s"], eviction=eviction)
    assert not isinstance(plan, Infeasible) and plan.eviction == eviction
    first_out = next(swap for _, swaps in plan.before for swap in swaps if isinstance(swap, SwapOut))
    assert (first_out.name, first_out.copy) == (victim, copied)
    trace = simulate_program(apply_swap_plan(program, plan), infos, budget=budget)
    assert trace.min_budget_bytes <= budget
    if eviction == "belady":
        assert planner.plan(program, sizes, budget, host_state=["s"]) == plan  # the default
    with pytest.raises(ValueError, match="eviction order"):
        planner.plan(program, sizes, budget, eviction="lru")


def test_the_grid_tries_both_victim_orders_and_follows_the_evaluator():
    """With both orders, each placement is planned with each (labels "+clean_first"); an
    evaluator that prefers dropped swap-outs (no copy) gets the clean-first plan."""
    program, infos, sizes = _clean_or_dirty_program()
    budget = 2 * sizes["s"] + sizes["c"] + sizes["loss"]

    def fewer_copies(p):
        return sum(1 if s.copy else -1 for s in p.steps if isinstance(s, SwapOut))

    result = SwapSearch(eviction_orders=EVICTION_ORDERS).search([program], infos, budget=budget, evaluate=fewer_copies)
    labels = {label for _, label, _ in result.considered}
    assert {STATE_ALL, f"{STATE_ALL}+clean_first"} <= labels
    assert result.best.plan.eviction == "clean_first" and result.best.state_placement == STATE_ALL
    assert result.best.step_time_s == min(s for _, _, s in result.considered if s is not None)
    belady_only = SwapSearch().search([program], infos, budget=budget, evaluate=fewer_copies)
    assert belady_only.best.plan.eviction == "belady" and belady_only.best.step_time_s > result.best.step_time_s
    with pytest.raises(ValueError, match="eviction orders"):
        SwapSearch(eviction_orders=["lru"])


def test_copies_to_the_device_go_in_the_order_the_blocks_read_them():
    """The lowering loads the batch first; where the first block reads only state kept on the
    host, that state's swap-in goes ahead of the batch on the FIFO host→device stream. The
    steps are the same, and so is the memory at every block."""
    from graph_passes.planning.swap.prefetch import in_order_of_need

    f32 = np.dtype(np.float32)
    infos = {n: shapes.TensorInfo(f32, (256, 256)) for n in ("x", "w", "a", "y")}
    blocks = (Block(0, (0,), ("w",), ("a",), 0), Block(1, (1,), ("x", "a"), ("y",), 0))
    steps = (Load("x"), SwapIn("w"), RunBlock(0, ("a",), ("w",)), RunBlock(1, ("y",), ("x", "a")), Fetch("y", True))
    program = Program(blocks, steps, (), ("x",), ("y",), host_state=("w",))
    ordered = in_order_of_need(program)
    assert ordered.steps[:2] == (SwapIn("w"), Load("x")) and ordered.steps[2:] == steps[2:]
    assert in_order_of_need(ordered) == ordered
    assert simulate_program(ordered, infos).min_budget_bytes == simulate_program(program, infos).min_budget_bytes


@pytest.mark.parametrize("where", [0.0, 0.3])
def test_hoisted_programs_keep_their_copies_in_the_order_of_need(where):
    graph, infos, program, _, budget = planned_chain(64, where)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    plan = SwapPlanner().plan(program, sizes, budget, host_state=program.state_inputs)
    placed = hoist_swap_ins(issue_swap_outs_early(apply_swap_plan(program, plan)), infos, budget=budget)
    assert Counter(placed.steps) == Counter(apply_swap_plan(program, plan).steps)
    copies = [k for k, s in enumerate(placed.steps) if isinstance(s, (Load, SwapIn))]
    for k, nxt in zip(copies, copies[1:]):
        if nxt == k + 1:  # consecutive copies: the one read first goes first
            def need(position):
                name = placed.steps[position].name
                return next((j for j in range(position, len(placed.steps)) if isinstance(placed.steps[j], RunBlock)
                             and name in placed.blocks[placed.steps[j].block].inputs), len(placed.steps))
            assert need(k) <= need(nxt)
    assert simulate_program(placed, infos, budget=budget).min_budget_bytes <= budget
