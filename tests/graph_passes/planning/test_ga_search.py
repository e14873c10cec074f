"""The genetic swap search (graph_passes.planning.swap.ga) and the step-time lower bound
(graph_passes.cost.step_bound): never slower than the grid, deterministic per seed, within its time
limit, every genome topological and within budget, and its plans run bitwise equal to the
unplanned run on the CPU device."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import onnx.parser
import pytest

import ort_offload
from graph_passes.ir import shapes
from graph_passes.ir.training_graph import Role, TrainingGraph
from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.planning.swap.ga import GAConfig, GeneticSwapSearch, SearchSpace, _Operators, decode, seed_genome
from graph_passes.planning.swap.planner import EVICT_BELADY, EVICT_CLEAN_FIRST, EVICTION_ORDERS, SwapPlanner
from graph_passes.ir.allocator import align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import lower
from graph_passes.cost.simulator import simulate_time
from graph_passes.cost.step_bound import link_time, step_time_bound
from graph_passes.planning.swap.plan_search import refine_swap_plan
from graph_passes.planning.swap.search import SwapSearch
from helpers import batches
from models import get_model
from chain_helpers import chain_feeds, chain_graph

OPS = ["MatMul", "Relu", "MatMul", "Sigmoid", "Add", "MatMul", "Exp", "Concat", "Relu"]
SLOW_LINK = dataclasses.replace(V100_16GB_PCIE3, h2d_bandwidth=1e8, d2h_bandwidth=1e8, duplex_bandwidth=2e8)


def _chain_space(width=64, where=0.3):
    return _space(chain_graph(OPS, width=width), chain_feeds(width), where)


def _u_graph(depth=8, rows=64, width=32):
    """A forward and a backward-like chain: ``a_i = Tanh(a_{i-1} w)``, then ``g_{i-1} = g_i *
    a_{i-1}`` back down to ``x``, and ``w`` updated by ``x^T g_0``: every activation is made in
    the first half and read again, in reverse order, in the second (what a training step does)."""
    lines = [f"m{i} = MatMul(a{i - 1}, w)\n a{i} = Tanh(m{i})" for i in range(1, depth + 1)]
    lines += [f"g{i - 1} = Mul(g{i}, a{i - 1})" for i in range(depth, 0, -1)]
    text = (f"<ir_version: 9, opset_import: [\"\" : 20]>\n"
            f"u (float[{rows}, {width}] a0, float[{width}, {width}] w, float[1] t)"
            f" => (float loss, float[{width}, {width}] w_new, float[1] t_new) {{\n"
            + "\n".join(lines[:depth]) + f"\n loss = ReduceSum<keepdims = 0>(a{depth})\n g{depth} = Sigmoid(a{depth})\n"
            + "\n".join(lines[depth:]) + "\n xt = Transpose(a0)\n gw = MatMul(xt, g0)\n"
            # a step count and a rate made from it: what an optimizer computes without the batch
            + " t_new = Add(t, t)\n rate = Sigmoid(t)\n step = Mul(gw, rate)\n w_new = Sub(w, step)\n}")
    model = onnx.parser.parse_model(text)
    roles = {"a0": Role.INPUT, "w": Role.PARAM, "t": Role.PARAM, "loss": Role.LOSS, "w_new": Role.PARAM,
             "t_new": Role.PARAM}
    rng = np.random.default_rng(0)
    feeds = {"a0": rng.standard_normal((rows, width)).astype(np.float32),
             "w": rng.standard_normal((width, width)).astype(np.float32) * 0.1, "t": np.ones(1, np.float32)}
    return TrainingGraph(model, roles, {"w": "w_new", "t": "t_new"}, name="u"), feeds


def _space(graph, feeds, where):
    infos = shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, feeds))
    data = graph.data_inputs

    def lowered(schedule=None, cuts=(), block_nodes=None):
        return lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=data, fetches=["loss"],
                     max_block_nodes=block_nodes or len(graph.model.graph.node), schedule=schedule, extra_cuts=cuts)

    finest = lowered(block_nodes=1)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    from graph_passes.planning.swap.planner import required_bytes

    least, top = required_bytes(finest, sizes), simulate_program(finest, infos).min_budget_bytes
    budget = int(least + where * (top - least))

    def evaluate(program):
        return simulate_time(program, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=budget).step_time_s

    programs = [lowered(block_nodes=n) for n in (8, 4, 2, 1)]
    grid = SwapSearch(while_improving=True).search(programs, infos, budget=budget, evaluate=evaluate)
    space = SearchSpace(model=graph.model, infos=infos, budget=budget, evaluate=evaluate,
                        lower=lambda schedule, cuts: lowered(list(schedule), cuts))
    return graph, infos, finest, grid.best, space


@pytest.mark.parametrize("where", [0.1, 0.5])
def test_never_slower_than_the_grid_and_within_budget(where):
    _, infos, _, seed, space = _chain_space(where=where)
    result = GeneticSwapSearch(GAConfig(max_evaluations=40, time_limit_s=60)).search(seed, space)
    assert result.best.step_time_s <= seed.step_time_s
    assert result.evaluations <= 40 and result.history == tuple(sorted(result.history, reverse=True))
    assert simulate_program(result.best.program, infos, budget=space.budget).min_budget_bytes <= space.budget


def test_the_seed_genome_decodes_to_the_grid_plan():
    _, _, _, seed, space = _chain_space()
    genome = seed_genome(seed, space.model)
    assert space.lower(genome.schedule, sorted(genome.cuts)).blocks == seed.base_program.blocks


def test_deterministic_for_a_seed():
    _, _, _, seed, space = _chain_space(where=0.2)
    runs = [GeneticSwapSearch(GAConfig(max_evaluations=30, time_limit_s=60, seed=s)).search(seed, space)
            for s in (7, 7, 8)]
    assert runs[0].genome == runs[1].genome and runs[0].history == runs[1].history
    assert runs[0].best.program.steps == runs[1].best.program.steps


@pytest.mark.parametrize("workers", [1, 2])
def test_time_limit_returns_the_best_so_far(workers):
    _, _, _, seed, space = _chain_space()
    now = [0.0]

    def clock():  # each reading advances a second: the limit falls inside the first generations
        now[0] += 1.0
        return now[0]

    result = GeneticSwapSearch(GAConfig(time_limit_s=5.0, workers=workers), clock=clock).search(seed, space)
    # The clock is read before each batch of `workers` genomes; the search stops where the
    # longest stretch between two readings, and as much again for the replay after it, would
    # pass the limit.
    assert result.stopped == "time" and 0 < result.evaluations <= 5 * workers
    assert result.time_s <= 5.0 - 1.0  # ended within the limit, a stretch (1 s here) left for the replay
    assert result.best.step_time_s <= seed.step_time_s


def test_workers_time_the_same_genomes_to_the_same_plan():
    """Genomes timed in forked workers (only their times come back; the parent decodes the best
    again) give the search of one process: the same generations, plan and counts."""
    _, _, _, seed, space = _chain_space()
    runs = {w: GeneticSwapSearch(GAConfig(max_evaluations=40, time_limit_s=600, seed=3, workers=w)).search(seed, space)
            for w in (1, 2, 3)}
    one = runs[1]
    assert one.evaluations == 40 and one.improved
    for result in (runs[2], runs[3]):
        assert (result.genome, result.history, result.evaluations, result.feasible, result.stopped) == (
            one.genome, one.history, one.evaluations, one.feasible, one.stopped)
        assert result.best.step_time_s == one.best.step_time_s and result.best.program == one.best.program


def test_children_are_topological_and_keep_the_late_nodes_last():
    graph, infos, _, seed, _ = _chain_space()
    first = seed_genome(seed, graph.model)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    ops = _Operators(graph.model, first, seed.base_program, seed.base_program.state_inputs, random.Random(0),
                     GAConfig(schedule_p=0.5), sizes)
    genomes = [first]
    for _ in range(60):
        a, b = random.Random(len(genomes)).sample(genomes, 2) if len(genomes) > 1 else (first, first)
        genomes.append(ops.mutate(ops.crossover(a, b)))
    nodes = graph.model.graph.node
    for g in genomes:
        assert sorted(g.schedule) == list(range(len(nodes)))
        seen = {i.name for i in graph.model.graph.input} | {t.name for t in graph.model.graph.initializer}
        for index in g.schedule:
            assert all(not n or n in seen for n in nodes[index].input)
            seen.update(nodes[index].output)
        assert all(0 < c < len(nodes) for c in g.cuts)



# An embedding-gradient-like scatter-add (order-dependent) in the middle of a seed's schedule,
# with nodes after it that do not depend on it (as state updates follow it on gpt).
_SCATTER_IN_THE_MIDDLE = """
<ir_version: 9, opset_import: ["" : 20]>
g (float[8, 4] x, int64[8, 1] idx) => (float z, float y) {
    a = Relu(x)
    b = Sigmoid(x)
    s = ScatterND<reduction = "add">(a, idx, b)
    z = ReduceSum<keepdims = 0>(s)
    c = Tanh(b)
    y = ReduceSum<keepdims = 0>(c)
}
"""


def test_the_schedule_genes_reorder_what_runs_before_the_first_order_dependent_node():
    """The seed runs the scatter-add's closure between other nodes (not as a suffix): the
    schedule genes still reorder the nodes before it (here Relu and Sigmoid, either first) and
    keep the seed's order from the scatter on."""
    from graph_passes.planning.swap.ga import Genome

    model = onnx.parser.parse_model(_SCATTER_IN_THE_MIDDLE)
    inputs = {"x": shapes.TensorInfo(np.dtype(np.float32), (8, 4)), "idx": shapes.TensorInfo(np.dtype(np.int64), (8, 1))}
    infos = shapes.infer_tensor_infos(model, inputs)
    program = lower(model, infos, state_pairs={}, data_inputs=["x", "idx"], fetches=["z", "y"])
    seed = Genome((0, 1, 2, 3, 4, 5), frozenset(), frozenset(), (), EVICT_BELADY)
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    ops = _Operators(model, seed, program, (), random.Random(0), GAConfig(schedule_p=0.5), sizes)
    assert ops.movable == 2  # the scatter is the third node
    schedules = {seed.schedule}
    for _ in range(40):
        schedules.add(ops.mutate(seed).schedule)
        schedules.add(ops.crossover(seed, ops.mutate(seed)).schedule)
    assert {schedule[:2] for schedule in schedules} == {(0, 1), (1, 0)}
    assert all(schedule[2:] == seed.schedule[2:] for schedule in schedules)


def test_the_victim_order_is_a_gene_the_first_generation_tries():
    """The seed carries the grid plan's victim order (Belady here: the grid of ``_chain_space``
    tries Belady only); mutation flips it, and the first genome evaluated is the seed with the
    other order, which the planner then plans clean first."""
    graph, infos, _, seed, space = _chain_space()
    first = seed_genome(seed, graph.model)
    assert first.eviction == seed.plan.eviction == EVICT_BELADY
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    ops = _Operators(graph.model, first, seed.base_program, seed.base_program.state_inputs, random.Random(0),
                     GAConfig(), sizes)
    assert {ops.mutate(first).eviction for _ in range(80)} == set(EVICTION_ORDERS)
    other = ops.other_eviction(first)
    assert other == dataclasses.replace(first, eviction=EVICT_CLEAN_FIRST)
    assert decode(other, space).plan.eviction == EVICT_CLEAN_FIRST

    class Recording(SwapPlanner):
        orders: list = []

        def plan(self, *args, **kwargs):
            self.orders.append(kwargs["eviction"])
            return super().plan(*args, **kwargs)

    GeneticSwapSearch(GAConfig(max_evaluations=3, time_limit_s=60, workers=1),  # records in this process
                      planner=Recording()).search(seed, space)
    assert Recording.orders[0] == EVICT_CLEAN_FIRST


def test_the_bound_is_below_every_plan_and_counts_the_link():
    graph, infos, finest, seed, space = _chain_space(where=0.0)
    bound = step_time_bound(finest, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=space.budget)
    assert bound.compute_s <= bound.seconds <= seed.step_time_s
    result = GeneticSwapSearch(GAConfig(max_evaluations=20)).search(seed, space)
    assert bound.seconds <= result.best.step_time_s
    assert bound.link_s == pytest.approx(link_time(bound.h2d_bytes, bound.d2h_bytes, V100_16GB_PCIE3))
    # With no room at all, everything read later crosses the link.
    tiny = step_time_bound(finest, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=0)
    assert tiny.h2d_bytes == tiny.necessary_live_bytes > 0 and tiny.link_s > 0
    assert step_time_bound(finest, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=10**12).link_s == 0


@pytest.mark.parametrize("width", [16, 64])
def test_the_link_bound_finds_the_largest_cut_of_any_node(width):
    """The link bound's cut nodes (chosen by scores) find the largest minimum cut over every
    node of the step, and the program-order prefix score is the bytes live across each node
    in that order (counted value by value)."""
    from graph_passes.cost import step_bound

    graph, infos, finest, _, space = _chain_space(width=width, where=0.0)
    bound = step_time_bound(finest, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=space.budget)
    cost = step_bound.AnalyticalCostModel(V100_16GB_PCIE3)
    times = np.array([cost.block_time(graph.model, b, infos) for b in finest.blocks])
    g = step_bound._graph(finest, infos, times)
    cuts = []
    for k in range(len(finest.blocks)):
        before = set(np.flatnonzero(g.ancestors[k])) | {k}
        after = set(np.flatnonzero(g.ancestors[:, k]))
        cuts.append(step_bound._min_cut(g, dict(g.sizes), to_end=(), before=before, after=after))
    assert bound.necessary_live_bytes == max(cuts) > 0
    proxies = step_bound._Proxies(g)
    position = {b: p for p, b in enumerate(g.order)}
    for k in range(len(finest.blocks)):
        live = sum(size for name, size in g.sizes.items() if g.readers.get(name)
                   and (name in g.inputs or position[g.producer[name]] <= position[k])
                   and max(position[r] for r in g.readers[name]) > position[k])
        assert proxies.prefix_in[k] == live
        assert proxies.forced_in[k] <= cuts[k] <= min(proxies.into[k], proxies.prefix_in[k])


@pytest.mark.parametrize("where", [0.0, 0.15, 0.4, 0.8])
def test_the_bound_is_below_every_grid_and_ga_plan(where):
    """Property: at several budgets, no plan the grid considered or the GA decoded beats the
    bound (every block size, state placement, schedule, cut and keep/swap choice tried), and
    the bound is at least the compute."""
    graph, infos, finest, seed, space = _chain_space(where=where)
    bound = step_time_bound(finest, infos, model=graph.model, profile=V100_16GB_PCIE3, budget=space.budget)
    assert bound.seconds >= bound.compute_s and bound.seconds >= bound.split_s and bound.seconds >= bound.link_s
    times = []

    def evaluate(program):
        times.append(space.evaluate(program))
        return times[-1]

    probe = dataclasses.replace(space, evaluate=evaluate)
    # workers=1: the probe records the times this process sees.
    GeneticSwapSearch(GAConfig(max_evaluations=25, seed=3, workers=1)).search(seed, probe)
    assert len(times) > 5 and min(times) >= bound.seconds * (1 - 1e-9)
    assert seed.step_time_s >= bound.seconds * (1 - 1e-9)


def test_the_split_bound_sees_evictions_the_compute_cannot_hide():
    """A chain whose early values must leave while little compute runs: the split bound is
    above the compute and the whole-step link bound, and still below the plans."""
    graph, infos, finest, seed, space = _chain_space(width=256, where=0.0)
    bound = step_time_bound(finest, infos, model=graph.model, profile=SLOW_LINK, budget=space.budget)
    assert bound.split_s > max(bound.compute_s, bound.link_s) and bound.split
    program = seed.program
    assert simulate_time(program, infos, model=graph.model, profile=SLOW_LINK,
                         budget=space.budget).step_time_s >= bound.seconds


def _train(name, budget, *, plan_time, seed=0, steps=3, passes="auto", evaluations=None, workers=None):
    spec = get_model(name, "tiny")
    data = batches(name, steps)
    device = ort_offload.set_offload_device("cpu", budget=budget, planning_profile="V100-16GB-PCIe3",
                                            plan_time=plan_time, plan_seed=seed, plan_evaluations=evaluations,
                                            plan_workers=workers)
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
        optimizer="adamw", name=name, passes=passes)
    losses = [trainer.step(*inputs, *targets) for inputs, targets in data]
    return trainer, losses, trainer.flat_state()


@pytest.mark.parametrize("name", ["gpt"])  # cnn passes too, but takes ~5 min here
def test_ga_plans_run_bitwise_equal_and_within_budget_on_the_cpu(name):
    reference, ref_losses, ref_state = _train(name, None, plan_time=0)
    trainer, losses, state = _train(name, "0.25x", plan_time=12.0)  # the grid takes ~6 s of it here
    search = trainer.runner.last_plan_search
    assert search is not None and search.method == "ga" and search.time_s < 12.0
    assert trainer.report()["plan_time_s"] < 12.0 + 2.0  # the grid's time and the GA's together
    assert search.step_time_s <= search.grid_step_time_s
    assert losses == ref_losses
    assert all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    report = trainer.report()
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"]


def test_ga_searches_a_split_plan_and_it_runs_bitwise_equal_and_within_budget():
    """Below the least budget swap alone plans, the GA refines the split graph's swap plan:
    its genomes lower (the split views' Split nodes are in their schedules) and fit, and the
    plan runs bitwise equal and within budget."""
    from graph_passes.errors import BudgetTooSmallError

    with pytest.raises(BudgetTooSmallError) as refused:
        _train("gpt", 1, plan_time=0, steps=1, passes=("swap",))
    budget = refused.value.needed_bytes * 4 // 5
    _, ref_losses, ref_state = _train("gpt", None, plan_time=0)
    trainer, losses, state = _train("gpt", budget, plan_time=60.0, evaluations=12)
    search = trainer.runner.last_plan_search
    assert "split" in trainer.report()["passes"] and trainer.runner.last_prepared.program.views
    assert search.method == "ga" and search.evaluations == 12 and search.feasible_evaluations > 0
    assert search.step_time_s <= search.grid_step_time_s
    assert losses == ref_losses and all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    report = trainer.report()
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"] == budget


@pytest.mark.slow
def test_ga_refines_a_recompute_and_swap_plan_bitwise_equal_and_within_budget(monkeypatch):
    """With recompute and swap both allowed, on a profile whose link is slow enough that
    recomputing wins, the chosen recompute-and-swap candidate is the one the GA refines; its
    plan runs bitwise equal and within budget."""
    from graph_passes.cost import device_profiles

    slow = dataclasses.replace(V100_16GB_PCIE3, h2d_bandwidth=2e8, d2h_bandwidth=2e8, duplex_bandwidth=3e8)
    monkeypatch.setitem(device_profiles.SHIPPED_PROFILES, V100_16GB_PCIE3.name, slow)
    _, ref_losses, ref_state = _train("gpt", None, plan_time=0)
    # The candidates' grid plans take ~20 s here; the GA gets the rest, at most 30 evaluations.
    trainer, losses, state = _train("gpt", "0.25x", plan_time=60.0, passes=("recompute", "swap"), evaluations=30)
    search = trainer.runner.last_plan_search
    assert "recompute" in trainer.report()["passes"] and "swap" in trainer.report()["passes"]
    assert search.method == "ga" and search.evaluations > 0 and search.step_time_s <= search.grid_step_time_s
    assert trainer.report()["plan_time_s"] < 60.0 + 2.0
    assert losses == ref_losses and all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    report = trainer.report()
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"]


def test_the_recompute_and_swap_winner_is_refined_with_its_other_schedules(monkeypatch):
    """The recompute-and-swap strategy hands the GA the winner's other schedules' best plans,
    as the swap strategy does: the search gets them, and they are plans of the winner's graph."""
    from graph_passes.planning import driver

    calls = []

    def recording(layouts, choice, seconds, infos, budget, model, **kwargs):
        calls.append((choice, model, kwargs.get("others", ())))
        return refine_swap_plan(layouts, choice, seconds, infos, budget, model, **kwargs)

    monkeypatch.setattr(driver, "refine_swap_plan", recording)
    trainer, _, _ = _train("gpt", "0.25x", plan_time=60.0, steps=1, passes=("recompute", "swap"), evaluations=2)
    assert trainer.runner.last_plan_search.method == "ga" and len(calls) == 1
    choice, model, others = calls[0]
    assert others and all(o.program is not choice.program for o in others)
    for other in others:  # each runs every node of the winner's graph once
        assert sorted(i for b in other.program.blocks for i in b.node_indices) == list(range(len(model.graph.node)))


def test_the_plan_time_counts_the_grid_and_the_search_gets_what_is_left(monkeypatch):
    """``plan_time`` bounds planning as a whole: the GA is handed what shape inference, the
    grid and the other schedules have left of it, and where they used it all, the grid's plan
    stands, its search stopped on time."""
    from graph_passes.planning import driver

    handed = []

    def recording(*args, **kwargs):
        handed.append(kwargs["time_left_s"])
        return refine_swap_plan(*args, **kwargs)

    monkeypatch.setattr(driver, "refine_swap_plan", recording)
    started = time.perf_counter()
    trainer, _, _ = _train("gpt", "0.25x", plan_time=60.0, steps=1, passes=("swap",), evaluations=2)
    assert len(handed) == 1 and 0 < handed[0] < 60.0
    assert handed[0] > 60.0 - (time.perf_counter() - started)  # what came before the GA was not counted twice
    trainer, _, _ = _train("gpt", "0.25x", plan_time=1e-9, steps=1, passes=("swap",))
    search = trainer.runner.last_plan_search
    assert handed[-1] == 0.0 and search.method == "grid" and search.stopped == "time"
    assert search.step_time_s == search.grid_step_time_s and search.evaluations == 0


def test_plan_time_is_checked():
    with pytest.raises(ort_offload.errors.InvalidArgumentError):
        ort_offload.set_offload_device("cpu", budget="0.5x", plan_time=-1)
    with pytest.raises(ort_offload.errors.InvalidArgumentError):
        ort_offload.set_offload_device("cpu", budget="0.5x", plan_time=5, plan_evaluations=0)
    with pytest.raises(ort_offload.errors.InvalidArgumentError):
        ort_offload.set_offload_device("cpu", budget="0.5x", plan_time=5, plan_workers=0)


@pytest.mark.parametrize("workers", [1, 3])
def test_plan_workers_reach_the_search(monkeypatch, workers):
    from graph_passes.planning.swap import plan_search

    seen = []

    class Recording(plan_search.GeneticSwapSearch):
        def __init__(self, config=None, **kwargs):
            seen.append(config.workers)
            super().__init__(config, **kwargs)

    monkeypatch.setattr(plan_search, "GeneticSwapSearch", Recording)
    trainer, _, _ = _train("mlp", "0.25x", plan_time=60.0, steps=1, passes=("swap",), evaluations=4, workers=workers)
    assert seen == [workers] and trainer.runner.last_plan_search.evaluations == 4


def test_transform_reports_what_it_expects_of_the_plan(tmp_path):
    import json

    from ort_offload.cli import main as run_cli

    source, out, report_path = tmp_path / "mlp.onnx", tmp_path / "mlp_v100.onnx", tmp_path / "t.json"
    assert run_cli(["export", "--model", "mlp", "-o", str(source)]) == 0
    assert run_cli(["transform", str(source), "-o", str(out), "--budget", "0.5x", "--input", "x=8x32", "--input",
                    "y=8", "--device-profile", "V100-16GB-PCIe3", "--plan-time", "5", "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    search = report["plan_search"]
    assert search["method"] == "ga" and search["time_s"] < 5.0
    assert search["step_time_s"] <= search["grid_step_time_s"]
    assert report["step_time_lower_bound_s"] <= report["simulated_step_time_s"] * (1 + 1e-9)
    assert report["simulated_unlimited_step_time_s"] <= report["simulated_step_time_s"] * (1 + 1e-9)
    assert report["simulated_step_time_s"] == pytest.approx(search["step_time_s"])


def _slow_link_plan_times(graph, infos, seed, space) -> list[float]:
    """Simulated step times on :data:`SLOW_LINK` of every plan the grid (from the seed's
    schedule and cuts) and then a 25-evaluation GA consider."""
    times = []

    def evaluate(program):
        times.append(simulate_time(program, infos, model=graph.model, profile=SLOW_LINK,
                                   budget=space.budget).step_time_s)
        return times[-1]

    first = seed_genome(seed, space.model)
    grid = SwapSearch(while_improving=True).search(
        [space.lower(first.schedule, sorted(first.cuts))], infos, budget=space.budget, evaluate=evaluate)
    probe = dataclasses.replace(space, evaluate=evaluate)
    GeneticSwapSearch(GAConfig(max_evaluations=25, seed=1, workers=1)).search(grid.best, probe)  # times seen here
    return times


@pytest.mark.parametrize("width", [128, 256])
def test_the_room_to_copy_bound_sees_a_budget_barely_above_the_largest_nodes(width):
    """Near the least budget, the largest nodes leave little room for copies under their
    compute: on a slow link the room-to-copy bound is above the compute and the link bounds,
    and still below the grid's plan and every GA plan."""
    graph, infos, finest, seed, space = _chain_space(width=width, where=0.0)
    bound = step_time_bound(finest, infos, model=graph.model, profile=SLOW_LINK, budget=space.budget)
    assert bound.capacity_s > max(bound.compute_s, bound.link_s) and "room to copy" in bound.describe()
    assert bound.under_compute_bytes[0] < bound.h2d_bytes  # not all that must come in fits under compute
    times = _slow_link_plan_times(graph, infos, seed, space)
    assert len(times) > 5 and min(times) >= bound.seconds * (1 - 1e-9)


@pytest.mark.parametrize("where", [0.0, 0.2])
def test_the_round_trip_bound_sees_what_leaves_and_comes_back(where):
    """A forward-and-backward chain on a slow link: every activation goes out in the first half
    and back in the second, one direction after the other, so the round-trip bound is above
    every other term, and still below the grid's plan and every GA plan."""
    graph, infos, finest, seed, space = _space(*_u_graph(rows=256), where)
    bound = step_time_bound(finest, infos, model=graph.model, profile=SLOW_LINK, budget=space.budget)
    others = (bound.compute_s, bound.link_s, bound.split_s, bound.capacity_s)
    assert bound.round_trip_s > max(others) and bound.seconds == bound.round_trip_s
    assert "round trip" in bound.describe()
    times = _slow_link_plan_times(graph, infos, seed, space)
    assert len(times) > 5 and min(times) >= bound.seconds * (1 - 1e-9)


def test_the_lead_pulls_batch_independent_nodes_to_the_start():
    """``lead_more`` moves the first batch-independent nodes reading no state kept on the host
    (with their producers) to the start of the schedule, as many more as asked each time,
    keeping the schedule one the graph can run in; with that state on the host there is
    nothing to move."""
    import random as _random

    graph, infos, _, seed, space = _space(*_u_graph(), 0.3)
    first = dataclasses.replace(seed_genome(seed, space.model), host_state=frozenset())
    sizes = {n: align_up(i.nbytes) for n, i in infos.items()}
    ops = _Operators(space.model, first, seed.base_program, seed.base_program.state_inputs, _random.Random(0),
                     GAConfig(), sizes)
    nodes = space.model.graph.node
    independent = {i for i, n in enumerate(nodes) if n.output[0] in ("t_new", "rate")}
    one = ops.lead_more(first)
    two = ops.lead_more(one)
    assert {one.schedule[0]} < independent and set(two.schedule[:2]) == independent
    assert ops.lead_more(two) == two and ops.lead_more(first, count=2) == two
    for genome in (one, two):
        assert sorted(genome.schedule) == sorted(first.schedule)
        space.lower(genome.schedule, sorted(genome.cuts))  # raises if not an order the graph runs in
    on_host = dataclasses.replace(first, host_state=frozenset({"t"}))
    assert ops.lead_more(on_host) == on_host


def test_a_converged_search_restarts_from_its_best():
    """Restarts only add generations after convergence: the same seed's search without them
    is the restarted one's prefix, so the restarted best is at least as fast, and it searched
    on where the other stopped."""
    _, infos, _, seed, space = _chain_space(where=0.3)
    plain = GeneticSwapSearch(GAConfig(max_evaluations=200, time_limit_s=120, restarts=0, seed=2)).search(seed, space)
    again = GeneticSwapSearch(GAConfig(max_evaluations=200, time_limit_s=120, restarts=2, seed=2)).search(seed, space)
    assert plain.stopped == "converged" and plain.evaluations < 200
    assert again.history[: len(plain.history)] == plain.history
    assert again.generations > plain.generations and again.evaluations > plain.evaluations
    assert again.best.step_time_s <= plain.best.step_time_s
    assert simulate_program(again.best.program, infos, budget=space.budget).min_budget_bytes <= space.budget


def test_the_first_generation_evaluates_the_other_grid_plans_first():
    """Seeded with a plan of one-node blocks and handed the grid's best as another plan, a
    one-evaluation search returns the grid's best; without it, the search stays slower."""
    graph, infos, _, best, space = _chain_space(where=0.3)
    order = list(range(len(graph.model.graph.node)))
    fine = space.lower(order, tuple(range(1, len(order))))
    coarse = SwapSearch().search([fine], infos, budget=space.budget, evaluate=space.evaluate).best
    assert coarse.step_time_s > best.step_time_s
    config = GAConfig(max_evaluations=1, time_limit_s=60, seed=0)
    alone = GeneticSwapSearch(config).search(coarse, space)
    helped = GeneticSwapSearch(config).search(coarse, space, [best])
    assert alone.best.step_time_s > best.step_time_s
    assert helped.evaluations == 1 and helped.best.step_time_s <= best.step_time_s
    assert simulate_program(helped.best.program, infos, budget=space.budget).min_budget_bytes <= space.budget
