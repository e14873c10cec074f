"""The arena's accounting: best-fit placement, coalescing, compaction, high-water marks.

Invariant checks over random alloc/free sequences (hypothesis) rather than expected layouts.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graph_passes.ir.allocator import BestFitAllocator, OutOfArenaMemory, align_up
from graph_passes.ir.shapes import TensorInfo
from ort_offload.runtime.arena import DeviceArena


def test_best_fit_reuses_the_smallest_hole_that_fits():
    a = BestFitAllocator(alignment=64)
    for name, size in [("a", 256), ("b", 64), ("c", 128), ("d", 64), ("e", 64)]:
        a.allocate(name, size)
    a.free("a")  # hole of 256 at 0
    a.free("c")  # hole of 128 at 320
    placed = a.allocate("f", 100)
    assert placed.offset == 320 and placed.nbytes == 128
    assert a.high_water == 576


def test_best_fit_takes_the_lowest_of_equal_holes():
    a = BestFitAllocator(alignment=64)
    for name in "abcde":
        a.allocate(name, 128)
    a.free("d")  # holes of 128 at 384 and 128 (freed second)
    a.free("b")
    assert a.allocate("f", 64).offset == 128
    assert a._free == [(192, 64), (384, 128)]


def test_a_name_the_allocator_does_not_hold_is_an_offload_error_not_a_key_error():
    from ort_offload.errors import ArenaStateError, OffloadError

    a = BestFitAllocator(alignment=64)
    a.allocate("x", 64)
    a.free("x")
    for call in (lambda: a.free("x"), lambda: a.free("ids"), lambda: a.rename("ids", "y"),
                 lambda: a.partition("ids", [("p", 64)])):
        with pytest.raises(ArenaStateError, match="holds no tensor") as caught:
            call()
        assert isinstance(caught.value, OffloadError) and not isinstance(caught.value, KeyError)
    assert a.in_use == 0 and a.names() == []


def test_frees_coalesce_and_the_frontier_retreats():
    a = BestFitAllocator(alignment=64)
    for name in "abc":
        a.allocate(name, 64)
    a.free("b")
    a.free("a")
    a.free("c")
    assert a.in_use == 0
    assert a.allocate("big", 192).offset == 0


def test_capacity_is_enforced():
    a = BestFitAllocator(128, alignment=64)
    a.allocate("a", 64)
    a.allocate("b", 64)
    with pytest.raises(OutOfArenaMemory):
        a.allocate("c", 1)
    a.free("a")
    assert a.allocate("c", 1).offset == 0


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 2000)), min_size=1, max_size=60)


def _free_some(allocator, live, pick):
    """Free the live tensor ``pick`` selects (deterministically, from the drawn integer)."""
    victim = sorted(live)[pick % len(live)]
    allocator.free(victim)
    del live[victim]


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_never_overlap_and_account_exactly(sequence):
    a = BestFitAllocator(alignment=64)
    live = {}
    for i, (do_alloc, size) in enumerate(sequence):
        if do_alloc or not live:
            a.allocate(f"t{i}", size)
            live[f"t{i}"] = align_up(size)
        else:
            _free_some(a, live, size)
        a.check_no_overlap()
        assert a.in_use == sum(live.values())
        assert a.high_water >= a.high_water_live()
        assert a.peak_in_use <= a.high_water


def _run_ops(allocator, sequence, prefix: str) -> None:
    """Allocate or free as ``sequence`` says (frees pick among the live tensors)."""
    live = {n: allocator.placement(n).nbytes for n in allocator.names()}
    for i, (do_alloc, size) in enumerate(sequence):
        if do_alloc or not live:
            allocator.allocate(f"{prefix}{i}", size)
            live[f"{prefix}{i}"] = align_up(size)
        else:
            _free_some(allocator, live, size)


def _state(allocator):
    return allocator.layout(), allocator._free, allocator.high_water_live(), allocator.in_use


@settings(max_examples=60, deadline=None)
@given(ops, ops, st.booleans())
def test_a_restored_allocator_and_the_one_it_took_from_change_independently(first, then, change_source):
    """restore shares the other allocator's holes and placements: whichever changes, the other
    stays as it was, and the changed one ends as a copy changed the same way would."""
    source = BestFitAllocator(alignment=64)
    _run_ops(source, first, "s")
    target = BestFitAllocator(alignment=64)
    target.restore(source)
    changed, unchanged = (source, target) if change_source else (target, source)
    expected_unchanged, reference = _state(unchanged), unchanged.clone()
    _run_ops(changed, then, "u")
    _run_ops(reference, then, "u")
    assert _state(unchanged) == expected_unchanged
    assert _state(changed) == _state(reference)
    changed.check_no_overlap()


def test_every_change_to_a_restored_allocator_leaves_its_source_alone():
    source = BestFitAllocator(alignment=64)
    for name in "abcd":
        source.allocate(name, 100)
    source.free("b")
    before = _state(source)
    for change in (lambda a: a.allocate("e", 10), lambda a: a.place_at("e", 64, 128), lambda a: a.free("a"),
                   lambda a: a.rename("a", "z"), lambda a: a.partition("a", [("a0", 64), ("a1", 64)]),
                   lambda a: a.compact(), lambda a: a.limit(3 * 128)):
        target = BestFitAllocator(alignment=64)
        target.restore(source)
        change(target)
        assert _state(target) != before
        assert _state(source) == before


@settings(max_examples=60, deadline=None)
@given(ops)
def test_arena_compaction_keeps_every_tensor_intact(sequence):
    capacity = 64 * 1024
    arena = DeviceArena(capacity, alignment=64)
    expected = {}
    rng = np.random.default_rng(0)
    for i, (do_alloc, size) in enumerate(sequence):
        size = size // 4 + 1
        if do_alloc or not expected:
            data = rng.standard_normal(size).astype(np.float32)
            if arena.in_use + align_up(data.nbytes) > capacity:
                continue
            arena.store(f"t{i}", data)
            expected[f"t{i}"] = data
        else:
            victim = sorted(expected)[size % len(expected)]
            arena.free(victim)
            del expected[victim]
        if i % 7 == 3:
            arena.compact()
            assert arena.allocator.high_water_live() == arena.in_use  # no holes left
    for name, data in expected.items():
        np.testing.assert_array_equal(arena.view(name), data)
    assert arena.allocator.high_water <= capacity


def test_arena_compacts_when_fragmentation_alone_blocks_an_allocation():
    arena = DeviceArena(256, alignment=64)
    for name in "abcd":
        arena.store(name, np.full(16, ord(name), dtype=np.float32))
    arena.free("a")
    arena.free("c")
    arena.store("e", np.arange(32, dtype=np.float32))  # 128 bytes: only fits after compaction
    assert arena.compactions == 1
    np.testing.assert_array_equal(arena.view("b"), np.full(16, ord("b"), dtype=np.float32))
    np.testing.assert_array_equal(arena.view("d"), np.full(16, ord("d"), dtype=np.float32))
    np.testing.assert_array_equal(arena.view("e"), np.arange(32, dtype=np.float32))
    with pytest.raises(OutOfArenaMemory):
        arena.store("f", np.zeros(1, dtype=np.float32))


def test_arena_views_are_aligned_and_share_memory():
    arena = DeviceArena(4096, alignment=64)
    arena.allocate("x", TensorInfo(np.dtype(np.float32), (4, 8)))
    view = arena.view("x")
    assert arena.pointer("x") % 64 == 0
    view[...] = 3.0
    assert arena.view("x").sum() == 96.0


def test_growable_arena_keeps_tensors_when_it_grows():
    arena = DeviceArena(128, alignment=64, growable=True)
    arena.store("a", np.arange(16, dtype=np.float32))
    arena.store("b", np.arange(64, dtype=np.float32))
    assert arena.capacity >= 320
    np.testing.assert_array_equal(arena.view("a"), np.arange(16, dtype=np.float32))


# ---- region preference (the double-buffered arena's halves) -----------------------------------

def test_region_allocation_lands_inside_the_region_and_leaves_a_hole_below():
    a = BestFitAllocator(1024, alignment=64)
    a.allocate("low", 64)
    upper = a.allocate("up", 100, region=(512, 1024))
    assert upper.offset == 512 and upper.nbytes == 128
    assert a.high_water_live() == 640
    assert a.allocate("fill", 448).offset == 64  # the gap below the region is a usable hole
    a.check_no_overlap()


def test_region_falls_back_anywhere_when_full():
    a = BestFitAllocator(1024, alignment=64)
    a.allocate("u1", 512, region=(512, 1024))
    placed = a.allocate("u2", 64, region=(512, 1024))  # the upper half is full
    assert placed.offset < 512
    with pytest.raises(OutOfArenaMemory):
        a.allocate("big", 512, region=(512, 1024))


regioned_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 700), st.sampled_from([None, 0, 1])),
                        min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(regioned_ops)
def test_random_regioned_sequences_never_overlap_and_account_exactly(sequence):
    capacity = 4096
    halves = [(0, capacity // 2), (capacity // 2, capacity)]
    a = BestFitAllocator(capacity, alignment=64)
    live = {}
    for i, (do_alloc, size, half) in enumerate(sequence):
        if do_alloc or not live:
            region = None if half is None else halves[half]
            inside = None if region is None else a._fit_in(align_up(size), *region)
            try:
                placed = a.allocate(f"t{i}", size, region=region)
            except OutOfArenaMemory:
                assert a.in_use + align_up(size) > capacity or a.high_water_live() + align_up(size) > capacity
                continue
            live[f"t{i}"] = align_up(size)
            assert placed.offset + placed.nbytes <= capacity
            if inside is not None:  # a free span in the region: it went there
                assert placed.offset == inside
                assert region[0] <= placed.offset and placed.offset + placed.nbytes <= region[1]
        else:
            _free_some(a, live, size)
        a.check_no_overlap()
        assert a.in_use == sum(live.values())
        assert a._free == sorted(a._free) and all(o + h <= a.high_water_live() for o, h in a._free)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from(["capped", "growable"]))
def test_allocating_a_block_at_once_places_as_one_allocation_after_another(sequence, kind):
    """``allocate_all`` (a block's outputs in one call) gives the layout, the compactions and
    the growth that ``allocate`` of each in turn gives, and the same refusal."""
    def arena():
        return DeviceArena(1024 if kind == "growable" else 16 * 1024, alignment=64, growable=kind == "growable")

    one, many = arena(), arena()
    batch = []
    for i, (do_alloc, size) in enumerate(sequence + [(False, 0)]):
        if do_alloc:
            batch.append((f"t{i}", TensorInfo(np.dtype(np.uint8), (size + 1,))))
            continue
        results = []
        for target, call in ((one, lambda: [one.allocate(n, info) for n, info in batch]),
                             (many, lambda: many.allocate_all(batch))):
            try:
                call()
                results.append(None)
            except OutOfArenaMemory as e:
                results.append(e.name)
        assert results[0] == results[1]
        assert one.allocator.layout() == many.allocator.layout() and one.names() == many.names()
        assert (one.compactions, one.capacity, one.allocator.high_water) == (many.compactions, many.capacity,
                                                                            many.allocator.high_water)
        batch = []
        live = one.names()
        if live:
            victims = live[size % len(live)::3]
            for target in (one, many):
                target.free_all(victims)
