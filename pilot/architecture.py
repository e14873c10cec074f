"""What the pilot knows about one dynamic model: :class:`PilotArchitecture`.

Owns :class:`PilotArchitecture` and :func:`build_architecture`: the block profiles (from the
block graphs the caller exported), the fixed-size AFM summary and network-type one-hot, the
per-block invocation costs (median times from traces), the link model of the partition
simulator and the candidate paths of the static architecture. Everything the mapping, the
labels and the features need, computed once per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from pilot.features import (
    BlockGraph,
    BlockProfile,
    afm_summary,
    network_type_one_hot,
    profile_block,
)
from pilot.partition import InvocationCost, LinkModel, default_migration_half, partition
from pilot.paths import DEFAULT_PATH_LIMIT, candidate_paths

__all__ = ["PilotArchitecture", "build_architecture"]


@dataclass(frozen=True, eq=False)
class PilotArchitecture:
    """One model's static architecture as the pilot sees it.

    ``block_times``: median seconds per invocation of each block (traces); ``link``: the
    partition simulator's device model; ``candidates``: every path the control flow can take.
    """

    name: str
    network_type: str
    profiles: tuple[BlockProfile, ...]
    block_times: tuple[float, ...]
    link: LinkModel
    candidates: tuple[tuple[int, ...], ...]
    summary: np.ndarray = field(repr=False)
    one_hot: np.ndarray = field(repr=False)
    _labels: dict = field(default_factory=dict, repr=False)

    def costs(self, path: Sequence[int]) -> list[InvocationCost]:
        """Per-invocation costs of ``path`` for the partition simulator."""
        return [
            InvocationCost(
                block=b,
                ops=len(self.profiles[b].op_types),
                time_s=self.block_times[b],
                param_bytes=self.profiles[b].param_bytes,
                saved_bytes=self.profiles[b].saved_bytes,
            )
            for b in path
        ]

    def execution_blocks(self, path: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The partition simulator's execution blocks of ``path`` (the label; cached)."""
        path = tuple(path)
        if path not in self._labels:
            self._labels[path] = partition(self.costs(path), self.link)
        return self._labels[path]


def build_architecture(
    name: str,
    model: nn.Module,
    network_type: str,
    graphs: Sequence[BlockGraph],
    block_times: Sequence[float],
    *,
    migration_half_bytes: int | None = None,
    link: LinkModel | None = None,
    path_limit: int = DEFAULT_PATH_LIMIT,
) -> PilotArchitecture:
    """Profile ``graphs`` (one per ``model.blocks()`` entry), enumerate the candidate paths and
    fix the link model (``migration_half_bytes`` defaults to :func:`default_migration_half`
    over every candidate path)."""
    blocks = list(model.blocks())
    if len(graphs) != len(blocks) or len(block_times) != len(blocks):
        raise ValueError(f"{name}: need one graph and one time per block ({len(blocks)} blocks), got "
                         f"{len(graphs)} graphs and {len(block_times)} times")
    profiles = tuple(profile_block(g) for g in graphs)
    candidates = tuple(candidate_paths(model, limit=path_limit))
    arch = PilotArchitecture(
        name=name,
        network_type=network_type,
        profiles=profiles,
        block_times=tuple(float(t) for t in block_times),
        link=link or LinkModel(migration_half_bytes=1),
        candidates=candidates,
        summary=np.zeros(0),
        one_hot=network_type_one_hot(network_type),
    )
    if link is None:
        half = migration_half_bytes or default_migration_half([arch.costs(p) for p in candidates])
        object.__setattr__(arch, "link", LinkModel(migration_half_bytes=half))
    object.__setattr__(arch, "summary", afm_summary(profiles, arch.link.migration_half_bytes))
    return arch
