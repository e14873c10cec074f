"""Per-tensor recomputation (graph_passes.planning.recompute.tensors) and the GA's recompute genes:
any chosen set of saved values rewrites into a graph with the same numbers in stock ONNX Runtime,
mapped schedules stay topological, and GA plans that recompute run bitwise equal to the
unplanned run and within budget on the CPU device."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import onnxruntime as ort

from graph_passes.cost.device_profiles import V100_16GB_PCIE3
from graph_passes.ir.liveness import check_topological
from graph_passes.planning.recompute.graph_pass import RecomputePass, recreated_values
from graph_passes.planning.recompute.planner import forward_nodes
from graph_passes.planning.recompute.tensors import TensorRecompute
from graph_passes.planning.swap.ga import RECOMPUTE, GAConfig, Genome, _Operators, seed_genome
from helpers import step_graph_and_feeds
from ort_offload.runtime.block_session import default_session_options


def _outputs(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), default_session_options(intra_op_threads=1),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_any_choice_of_saved_values_rewrites_with_the_same_numbers_and_a_topological_schedule():
    graph, feeds, infos = step_graph_and_feeds("gpt")
    tensors = TensorRecompute(graph.model, infos, loss_name=graph.loss_name)
    assert len(tensors.candidates) > 10
    reference = _outputs(graph.model, feeds)
    rng = random.Random(0)
    nodes = len(graph.model.graph.node)
    forward = forward_nodes(graph.model, graph.loss_name)
    choices = [frozenset(tensors.candidates), *(frozenset(rng.sample(tensors.candidates, k)) for k in (1, 5, 20))]
    for chosen in choices:
        rewrite = tensors.rewrite(chosen)
        assert rewrite.clones > 0 and len(rewrite.model.graph.node) == nodes + rewrite.clones
        assert recreated_values(rewrite.model) == chosen  # exactly the chosen values are re-created
        for before, after in zip(reference, _outputs(rewrite.model, feeds)):
            np.testing.assert_array_equal(before, after)
        # A schedule of the graph given (its forward last-in-first, where order allows: here
        # the given order) with cuts maps to a topological order of every node of the rewrite.
        order, cuts = rewrite.schedule(list(range(nodes)), [nodes // 3, 2 * nodes // 3])
        assert sorted(order) == list(range(len(rewrite.model.graph.node)))
        graph_inputs = {i.name for i in rewrite.model.graph.input} | {t.name for t in rewrite.model.graph.initializer}
        check_topological([rewrite.model.graph.node[i] for i in order], graph_inputs)
        assert len(cuts) == 2 and all(order[c] in rewrite.original_index for c in cuts)
        # Clones isolated: the same order, the given cuts at their nodes, every clone in a block
        # of its own and the node after a run of clones starting one; nothing else starts one.
        isolated, isolated_cuts = rewrite.schedule(list(range(nodes)), [nodes // 3, 2 * nodes // 3],
                                                   isolate_clones=True)
        originals = set(rewrite.original_index)
        clone_edges = {k for k in range(1, len(order)) if order[k] not in originals or order[k - 1] not in originals}
        assert isolated == order and clone_edges and set(isolated_cuts) == set(cuts) | clone_edges
        # the originals of recomputed values are read by no backward node any more
        renamed = {n for n in chosen}
        for i, node in enumerate(rewrite.model.graph.node):
            if i in rewrite.original_index and rewrite.original_index.index(i) not in forward:
                assert not renamed & set(node.input)


def test_clones_get_blocks_of_their_own_where_their_readers_blocks_would_not_fit():
    """gpt tiny with every saved value recomputed, one node a block: each clone run inside its
    reader's block needs far more than the clones alone, so under a budget between the two the
    lowering isolates the clones, in the same order, and every block fits."""
    from graph_passes.ir.allocator import align_up
    from graph_passes.ir.program import lower
    from graph_passes.planning.driver import lower_recomputed
    from graph_passes.planning.swap.planner import blocks_over, required_bytes

    graph, _, infos = step_graph_and_feeds("gpt")
    tensors = TensorRecompute(graph.model, infos, loss_name=graph.loss_name)
    rewrite = tensors.rewrite(frozenset(tensors.candidates))
    nodes = len(graph.model.graph.node)
    sizes = {n: align_up(i.nbytes) for n, i in rewrite.infos.items()}

    def lower_with_cuts(schedule, cuts):
        return lower(rewrite.model, rewrite.infos, state_pairs=graph.state_pairs, data_inputs=graph.data_inputs,
                     fetches=[graph.loss_name], max_block_nodes=len(rewrite.model.graph.node), schedule=schedule,
                     extra_cuts=cuts)

    schedule, cuts = list(range(nodes)), list(range(1, nodes))
    in_readers = lower_with_cuts(*rewrite.schedule(schedule, cuts))
    isolated = lower_with_cuts(*rewrite.schedule(schedule, cuts, isolate_clones=True))
    budget = required_bytes(isolated, sizes)
    assert required_bytes(in_readers, sizes) > 2 * budget and blocks_over(in_readers, sizes, budget)
    program = lower_recomputed(lower_with_cuts, rewrite, sizes, budget, schedule, cuts)
    assert not blocks_over(program, sizes, budget) and len(program.blocks) > len(in_readers.blocks)
    order = [i for block in program.blocks for i in block.node_indices]
    assert order == [i for block in in_readers.blocks for i in block.node_indices]
    # Where the readers' blocks fit, they are kept.
    roomy = required_bytes(in_readers, sizes)
    assert lower_recomputed(lower_with_cuts, rewrite, sizes, roomy, schedule, cuts).blocks == in_readers.blocks


SLOW_LINK = dataclasses.replace(V100_16GB_PCIE3, h2d_bandwidth=2e8, d2h_bandwidth=2e8, duplex_bandwidth=3e8)


def _mlp_space():
    """The mlp step graph at a quarter of its unplanned peak, timed on a slow link (where
    recomputing cheap values beats copying them), with recompute genes; and the grid's best."""
    from graph_passes.cost.cost_model import AnalyticalCostModel
    from graph_passes.cost.simulator import simulate_time
    from graph_passes.ir.memory import simulate_program
    from graph_passes.ir.program import lower
    from graph_passes.planning.swap.ga import SearchSpace, Variant
    from graph_passes.planning.swap.search import SwapSearch

    graph, _, infos = step_graph_and_feeds("mlp")
    model = graph.model

    def lowered(m, m_infos, schedule=None, cuts=(), block_nodes=None):
        return lower(m, m_infos, state_pairs=graph.state_pairs, data_inputs=graph.data_inputs,
                     fetches=[graph.loss_name], max_block_nodes=block_nodes or len(m.graph.node), schedule=schedule,
                     extra_cuts=cuts)

    budget = simulate_program(lowered(model, infos), infos).min_budget_bytes // 4

    def timer(m, m_infos):
        return lambda p: simulate_time(p, m_infos, model=m, profile=SLOW_LINK, budget=budget).step_time_s

    tensors = TensorRecompute(model, infos, loss_name=graph.loss_name)

    def variant(chosen):
        rw = tensors.rewrite(chosen)
        return Variant(rw.model, rw.infos, rw.clones, RecomputePass(rw.plan, loss_name=graph.loss_name),
                       evaluate=timer(rw.model, rw.infos),
                       lower=lambda schedule, cuts: lowered(rw.model, rw.infos, *rw.schedule(schedule, cuts)))

    programs = [lowered(model, infos, block_nodes=n) for n in (16, 8, 4, 2, 1)]
    grid = SwapSearch(while_improving=True).search(programs, infos, budget=budget, evaluate=timer(model, infos))
    space = SearchSpace(model=model, infos=infos, budget=budget, evaluate=timer(model, infos),
                        lower=lambda schedule, cuts: lowered(model, infos, list(schedule), cuts), recompute=variant,
                        recompute_ratio=tensors.price(AnalyticalCostModel(SLOW_LINK), SLOW_LINK))
    return space, grid.best


def test_ga_with_recompute_genes_is_never_worse_deterministic_and_within_budget():
    from graph_passes.ir.memory import simulate_program
    from graph_passes.planning.swap.ga import GeneticSwapSearch

    space, seed = _mlp_space()
    runs = [GeneticSwapSearch(GAConfig(max_evaluations=20, time_limit_s=120, seed=s)).search(seed, space)
            for s in (5, 5)]
    best = runs[0]
    assert best.best.step_time_s <= seed.step_time_s
    assert runs[0].genome == runs[1].genome and runs[0].history == runs[1].history
    assert best.genome is not None and best.genome.recomputed  # on a slow link, recomputing pays
    assert best.variant is not None and best.variant.added_nodes > 0
    trace = simulate_program(best.best.program, best.variant.infos, budget=space.budget)
    assert trace.min_budget_bytes <= space.budget and trace.peak_device_bytes <= space.budget


def test_operators_give_recompute_genes_only_to_recomputable_tensors():
    import random as _random

    from graph_passes.ir.allocator import align_up

    space, seed = _mlp_space()
    first = seed_genome(seed, space.model)
    sizes = {n: align_up(i.nbytes) for n, i in space.infos.items()}
    ops = _Operators(space.model, first, seed.base_program, seed.base_program.state_inputs, _random.Random(0),
                     GAConfig(), sizes, space.recompute_ratio)
    genomes: list[Genome] = [first, ops.recompute_cheaper(first, 1.0)]
    for k in range(60):
        a, b = _random.Random(k).sample(genomes, 2)
        genomes.append(ops.mutate(ops.crossover(a, b)))
    assert any(g.recomputed for g in genomes)
    assert all(g.recomputed <= set(space.recompute_ratio) for g in genomes)
    assert all(c != RECOMPUTE or t in space.recompute_ratio for g in genomes for t, c in g.choices)


def test_ga_plans_that_recompute_run_bitwise_equal_and_within_budget_on_the_cpu(monkeypatch):
    import ort_offload
    from graph_passes.cost import device_profiles
    from helpers import batches
    from models import get_model

    # Half SLOW_LINK's rate: there a plan that swaps only (the first generation holds the other
    # schedules' grid plans too) came out ahead of every recomputing one within 100 evaluations.
    slower = dataclasses.replace(SLOW_LINK, h2d_bandwidth=1e8, d2h_bandwidth=1e8, duplex_bandwidth=1.5e8)
    monkeypatch.setitem(device_profiles.SHIPPED_PROFILES, V100_16GB_PCIE3.name, slower)
    spec, data = get_model("mlp", "tiny"), batches("mlp", 2)

    def train(budget, plan_time):
        # An evaluation cap, not the time limit, ends the search: 2 s gave 65 evaluations on a
        # loaded CI machine (no recompute found yet) and ~175 on a quiet one; 100 find one.
        device = ort_offload.set_offload_device("cpu", budget=budget, planning_profile=V100_16GB_PCIE3.name,
                                                plan_time=plan_time, plan_seed=0, plan_evaluations=100)
        trainer = ort_offload.create_ort_trainer(
            device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
            input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
            optimizer="adamw", name="mlp", passes=("recompute", "swap"))
        return trainer, [trainer.step(*inputs, *targets) for inputs, targets in data], trainer.flat_state()

    _, ref_losses, ref_state = train(None, 0)
    trainer, losses, state = train("0.25x", 600.0)
    search, report = trainer.runner.last_plan_search, trainer.report()
    assert search.stopped == "evaluations" and search.evaluations == 100
    assert search.method == "ga" and search.recomputed_tensors > 0 and report["recomputed_nodes"] > 0
    assert search.step_time_s <= search.grid_step_time_s and "recompute" in report["passes"]
    assert losses == ref_losses and all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    assert report["within_budget"] and report["peak_device_bytes"] <= report["budget_bytes"]

