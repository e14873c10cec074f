"""Mapping the pilot's output back to block invocations: round trips over every candidate."""

from __future__ import annotations

import numpy as np
import pytest

from pilot.mapping import RESOLUTION_FLOOR, SLOT_COLUMNS, PathMapper, encode
from pilot.prediction import PathPrediction
from pilot_helpers import FAMILIES, spec_and_architecture


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_of_every_candidate(family):
    _, arch = spec_and_architecture(family)
    mapper = PathMapper(arch)
    for path in arch.candidates:
        index, exact, key = mapper.map(mapper.target(path))
        assert exact
        got = mapper.paths[index]
        if mapper.collisions == 0:
            assert got == path
        else:  # an encoding shared by several candidates maps to the first of them
            assert encode(arch, got, mapper.blocks[index]).tobytes() == key
        # the execution blocks tile the path (PathPrediction checks it)
        PathPrediction(path=got, execution_blocks=mapper.blocks[index])


# Tree-LSTM's 625 candidates differ by single units of the order moments (1/30 of a block unit),
# so it gets no noise: its encodings are that close, which is why the pilot misses trees.
@pytest.mark.parametrize("family, noise", [("var-bert", 0.01), ("moe", 0.01), ("var-lstm", 0.01), ("tree-lstm", 0.0)])
def test_true_path_of_samples_maps_back_even_with_noise(family, noise):
    spec, arch = spec_and_architecture(family)
    mapper = PathMapper(arch)
    rng = np.random.default_rng(0)
    for seed in range(20):
        (ids,), _ = spec.make_batch(1, seed=seed)
        path = tuple(spec.model.path(ids))
        target = mapper.target(path)
        index, _, _ = mapper.map(target + rng.normal(0, noise, target.shape).astype(np.float32))
        assert encode(arch, mapper.paths[index], mapper.blocks[index]).tobytes() == \
            encode(arch, path, arch.execution_blocks(path)).tobytes()


def test_identical_experts_are_told_apart():
    _, arch = spec_and_architecture("moe")
    mapper = PathMapper(arch)
    assert len(mapper.paths) == len(arch.candidates) == spec_and_architecture("moe")[0].config.experts
    assert mapper.collisions == 0


def test_nearest_candidate_when_no_exact_match():
    _, arch = spec_and_architecture("var-lstm")
    mapper = PathMapper(arch)
    path = arch.candidates[3]
    raw = mapper.target(path) * 1.02  # off by 2%: no exact match, nearest by running op totals
    index, exact, _ = mapper.map(raw)
    assert not exact and mapper.paths[index] == path


def test_loss_weight_is_the_inverse_square_gap_between_the_candidates_a_column_tells_apart():
    # MoE's experts share op counts (one group) and differ by fractions of a block unit in the
    # index and moment columns: those columns get weight 1 / gap**2, the op counts weight 1.
    _, arch = spec_and_architecture("moe")
    mapper = PathMapper(arch)
    units = np.stack([mapper.target(p) for p in mapper.paths]).astype(np.float64)
    weight = mapper.loss_weight
    assert weight.shape == units[0].shape and weight.dtype == np.float32
    assert np.all(weight[::SLOT_COLUMNS] == 1.0)  # equal op counts: the op column picks nothing
    deciding = np.flatnonzero(units.max(axis=0) > units.min(axis=0))
    assert deciding.size and np.all(deciding % SLOT_COLUMNS != 0)
    for column in deciding:
        gap = np.diff(np.unique(np.round(units[:, column], 9))).min()
        assert weight[column] == pytest.approx(1 / max(gap, RESOLUTION_FLOOR) ** 2, rel=1e-5)
        assert weight[column] > 1.0
    idle = np.setdiff1d(np.arange(weight.size), deciding)
    assert np.all(weight[idle] == 1.0)


def test_loss_weight_of_other_columns_counts_only_gaps_inside_a_group():
    # var-BERT's depths differ in op counts (every candidate its own group): the op column of the
    # first slot gets 1 / gap**2 of the depths, and no other column decides anything.
    _, arch = spec_and_architecture("var-bert")
    mapper = PathMapper(arch)
    units = np.stack([mapper.target(p) for p in mapper.paths]).astype(np.float64)
    gap = np.diff(np.unique(np.round(units[:, 0], 9))).min()
    assert mapper.loss_weight[0] == pytest.approx(max(1.0, 1 / max(gap, RESOLUTION_FLOOR) ** 2), rel=1e-5)
    others = np.ones(mapper.loss_weight.size, dtype=bool)
    others[::SLOT_COLUMNS] = False
    assert np.all(mapper.loss_weight[others] == 1.0)
    # Tree-LSTM's moment gaps are far below the floor: capped at 1 / floor**2.
    _, tree = spec_and_architecture("tree-lstm")
    assert PathMapper(tree).loss_weight.max() == pytest.approx(1 / RESOLUTION_FLOOR**2)
