"""Mapping the pilot's output back to block invocations: round trips over every candidate."""

from __future__ import annotations

import numpy as np
import pytest

from pilot.mapping import PathMapper, encode
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
