"""Steps placed ahead: a placed best-fit step is the arena replay's step; a leaving and a
returning step alternate with no two live tensors sharing a byte."""

import pytest

from graph_passes.ir.allocator import BestFitAllocator, align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Commit, RunBlock, lower
from graph_passes.ir.step_placement import place_step
from helpers import step_graph_and_feeds


def _program(block_nodes):
    graph, _, infos = step_graph_and_feeds("gpt")
    program = lower(graph.model, infos, state_pairs=graph.state_pairs, data_inputs=graph.data_inputs,
                    max_block_nodes=block_nodes)
    return program, infos


def _start(program, infos) -> BestFitAllocator:
    allocator = BestFitAllocator()
    for name in program.state_inputs:  # as simulate_program and the runtime place the state
        allocator.allocate(name, infos[name].nbytes)
    return allocator


def _assert_no_overlap(offsets, infos):
    spans = sorted((offset, offset + align_up(infos[name].nbytes), name) for name, offset in offsets.items())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        assert start >= end, f"{first} overlaps {second}"


@pytest.mark.parametrize("block_nodes", [64, 100_000])
def test_a_placed_best_fit_step_is_the_replays_step(block_nodes):
    program, infos = _program(block_nodes)
    first = place_step(program, infos, _start(program, infos))
    second = place_step(program, infos, first.end)
    assert first.peak_bytes == simulate_program(program, infos, steps=1).peak_device_bytes
    assert max(first.peak_bytes, second.peak_bytes) == simulate_program(program, infos, steps=2).peak_device_bytes
    # Under a budget the replay caps the arena per block as the runtime does: the same peak.
    budget = simulate_program(program, infos, steps=1).peak_device_bytes
    capped = place_step(program, infos, _start(program, infos), budget=budget)
    assert capped is not None and capped.peak_bytes == first.peak_bytes <= budget


@pytest.mark.parametrize("block_nodes", [64, 256, 100_000])
def test_a_leaving_and_a_returning_step_alternate_without_overlaps(block_nodes):
    program, infos = _program(block_nodes)
    start = _start(program, infos)
    before = start.layout()
    leaving = place_step(program, infos, start, leave=True)
    returning = place_step(program, infos, leaving.end, home=start)
    assert leaving is not None and returning is not None
    assert start.layout() == before  # the start is not changed
    assert returning.end.layout() == start.layout() and leaving.end.layout() != start.layout()
    again = place_step(program, infos, returning.end, leave=True)
    assert again.offsets == leaving.offsets and again.end.layout() == leaving.end.layout()
    blocks = 0
    for placed in (leaving, returning):
        for step, offsets in zip(program.steps, placed.offsets):
            if offsets is not None:
                _assert_no_overlap(offsets, infos)
            if isinstance(step, RunBlock):
                blocks += 1
                block = program.blocks[step.block]
                assert set(block.inputs) <= offsets.keys()
        assert placed.peak_bytes >= simulate_program(program, infos, steps=1).min_budget_bytes
    assert blocks == 2 * len(program.blocks)
    # Updates land where their state was in the other step's start.
    commit = next(s for s in program.steps if isinstance(s, Commit))
    for updated, state in commit.renames:
        assert returning.end.placement(state) == start.placement(state)


def test_the_allocator_places_at_a_free_offset_and_fits_around_spans():
    a = BestFitAllocator(alignment=64)
    for name in "abcd":
        a.allocate(name, 128)
    a.free("b")  # hole [128, 256)
    a.free("d")  # the frontier retreats to 384
    with pytest.raises(ValueError, match="not free"):
        a.place_at("x", 64, 64)  # inside a
    a.place_at("x", 64, 192)  # the upper half of the hole
    assert a._free == [(128, 64)] and a.high_water_live() == 384
    with pytest.raises(ValueError, match="not free"):
        a.place_at("y", 128, 320)  # over c, [256, 384)
    a.place_at("y", 128, 448)  # above the frontier: the gap below becomes a hole
    assert a._free == [(128, 64), (384, 64)] and a.high_water_live() == 576
    assert a.fit_avoiding(64, []) == 128  # best fit: the lowest of equal holes
    assert a.fit_avoiding(64, [(128, 64)]) == 384
    assert a.fit_avoiding(128, [(576, 64)]) == 640  # the frontier, moved above the span
    a.check_no_overlap()
