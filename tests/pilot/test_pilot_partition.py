"""Partition simulator: the cap holds, the program is optimal, even splits are never better."""

from __future__ import annotations

import itertools
import random

import pytest

from pilot.partition import (
    EVEN_SPLIT_KINDS, InfeasiblePartitionError, InvocationCost, LinkModel, best_even_split,
    default_migration_half, even_split, partition, simulate,
)
from pilot_helpers import FAMILIES, spec_and_architecture


def _random_costs(rng: random.Random, n: int) -> list[InvocationCost]:
    kinds = [(rng.randint(1, 80), rng.uniform(5e-6, 200e-6), rng.randint(1_000, 400_000), rng.randint(0, 300_000))
             for _ in range(rng.randint(1, 4))]
    out = []
    for _ in range(n):
        b = rng.randrange(len(kinds))
        ops, t, p, a = kinds[b]
        out.append(InvocationCost(b, ops, t * rng.uniform(0.8, 1.2), p, a))
    return out


def _all_groupings(n: int, max_blocks: int):
    for k in range(1, min(n, max_blocks) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            yield tuple(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_optimal_fits_and_beats_even_splits(seed):
    rng = random.Random(seed)
    costs = _random_costs(rng, rng.randint(1, 9))
    link = LinkModel(migration_half_bytes=default_migration_half([costs], 4), bandwidth=rng.choice([1e9, 12e9]),
                     max_blocks=4)
    blocks = partition(costs, link)
    result = simulate(costs, blocks, link)
    assert result.fits and max(result.footprints) <= link.migration_half_bytes
    assert 1 <= len(blocks) <= link.max_blocks
    brute = min(simulate(costs, g, link).time_s for g in _all_groupings(len(costs), 4)
                if simulate(costs, g, link).fits)
    assert result.time_s == pytest.approx(brute, rel=1e-12)
    for kind in EVEN_SPLIT_KINDS:
        even = best_even_split(costs, link, kind)
        if even is not None:
            assert result.time_s <= simulate(costs, even, link).time_s + 1e-15


def test_infeasible_cap_raises_and_even_split_tiles():
    costs = [InvocationCost(0, 10, 1e-5, 1000, 1000)] * 5
    with pytest.raises(InfeasiblePartitionError, match="migration half"):
        partition(costs, LinkModel(migration_half_bytes=1500))
    for kind in EVEN_SPLIT_KINDS:
        blocks = even_split(costs, 3, kind)
        assert blocks[0][0] == 0 and blocks[-1][1] == 5 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_labels_fit_the_half(family):
    _, arch = spec_and_architecture(family)
    for path in arch.candidates[:40]:
        blocks = arch.execution_blocks(path)
        result = simulate(arch.costs(path), blocks, arch.link)
        assert result.fits, (family, path, result.footprints, arch.link.migration_half_bytes)
        assert len(blocks) <= arch.link.max_blocks
