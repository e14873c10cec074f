"""The pilot's output encoding and its mapping back to block invocations (DyNN-Offload §IV-B).

Owns :data:`SLOT_COLUMNS`, :data:`RESOLUTION_FLOOR`, :func:`output_size`, :func:`encode` (path +
execution blocks → the output vector), :func:`output_scale` and :class:`PathMapper` (output
vector → path and execution blocks, and the per-column loss weights of its architecture).

Encoding. ``MAX_EXECUTION_BLOCKS`` slots, one per execution block (unused slots zero), each the
paper's 10-vector summed over the block invocations of that execution block: op count, the six
idiom sums, the three dimension sums (the per-block 10-vector of :mod:`pilot.features`), plus one
columns of ours: the sum of the invoked blocks' indices in ``model.blocks()`` and two order
moments (position-weighted sums of block indices). The paper's 10 numbers cannot tell apart two
branches with identical blocks (MoE's experts), the index column can; nor two orders of the
same blocks inside one execution block (two Tree-LSTM trees), which the moments mostly can. The MLP predicts the encoding in *block units*: each column divided by the architecture's
mean block value of that column (:func:`output_scale`), so the op-count column reads "how many
block invocations", which means the same for a 2-layer and a 12-layer model.

Mapping. Every candidate path of the static architecture (:mod:`pilot.paths`) is grouped by the
partition simulator and encoded once, when the mapper is built, into a lookup table (the paper's
walk with running totals, done ahead of time so a lookup is a dict probe). At inference the
de-normalized output is rounded to integers: an exact match in the table wins; otherwise the
candidate closest in op counts: L1 over the running op-count totals at the end of each slot (the
paper's walk with running totals; the running form weighs the path's total length most, since
the grouping follows from the path), ties broken by the L1 distance over all columns in block
units. Candidates with identical encodings (Tree-LSTM trees that differ only inside an
execution block) are indistinguishable: the first is returned and :attr:`PathMapper.collisions`
counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pilot.architecture import PilotArchitecture
from pilot.features import BLOCK_VECTOR_SIZE
from pilot.partition import MAX_EXECUTION_BLOCKS

__all__ = ["RESOLUTION_FLOOR", "SLOT_COLUMNS", "PathMapper", "block_unit_key", "encode", "output_scale", "output_size"]

ORDER_MOMENTS = 2
SLOT_COLUMNS = BLOCK_VECTOR_SIZE + 1 + ORDER_MOMENTS
"""Per execution block: op count, six idiom sums, three dim sums, sum of block indices, and
the order moments ``sum_j (j + 1)**k * (b_j + 1)`` for ``k = 1, 2`` over its invocations ``j``
(position in the path) of block ``b_j``."""
RESOLUTION_FLOOR = 0.1
"""Smallest column resolution (block units) the loss weights honour: weights are at most 100."""


def output_size() -> int:
    return MAX_EXECUTION_BLOCKS * SLOT_COLUMNS


def block_unit_key(raw: np.ndarray) -> bytes:
    """``raw`` (the pilot's output, block units) rounded to whole block units, as bytes: what the
    misprediction cache keys on beside the predicted path (``ort_offload.dynamic.misprediction_cache``)."""
    return np.rint(raw).astype(np.int32).tobytes()


def _invocation_vectors(arch: PilotArchitecture) -> np.ndarray:
    """[blocks, BLOCK_VECTOR_SIZE + 1]: each block's 10-vector and its index."""
    return np.stack([np.concatenate([p.vector, [i]]) for i, p in enumerate(arch.profiles)])


def output_scale(arch: PilotArchitecture) -> np.ndarray:
    """[output_size()] divisors to block units: the mean block value of each static column, the
    largest block index for the index column, and the largest order moment over the candidate
    paths for the moment columns (1 where 0)."""
    vectors = _invocation_vectors(arch)
    scale = np.ones(SLOT_COLUMNS)
    scale[: vectors.shape[1]] = vectors.mean(axis=0)
    scale[vectors.shape[1] - 1] = max(len(arch.profiles) - 1, 1)
    longest = max((len(p) for p in arch.candidates), default=1)
    for k in range(1, ORDER_MOMENTS + 1):
        scale[vectors.shape[1] + k - 1] = longest**k * len(arch.profiles)
    scale[scale == 0] = 1.0
    return np.tile(scale, MAX_EXECUTION_BLOCKS)


def encode(arch: PilotArchitecture, path: Sequence[int], blocks: Sequence[tuple[int, int]]) -> np.ndarray:
    """Integer encoding [output_size()] of ``path`` grouped into execution ``blocks``."""
    if len(blocks) > MAX_EXECUTION_BLOCKS:
        raise ValueError(f"{len(blocks)} execution blocks exceed the {MAX_EXECUTION_BLOCKS} output slots")
    vectors = _invocation_vectors(arch)
    static = vectors.shape[1]
    out = np.zeros((MAX_EXECUTION_BLOCKS, SLOT_COLUMNS))
    for slot, (start, end) in enumerate(blocks):
        members = list(path[start:end])
        out[slot, :static] = vectors[members].sum(axis=0)
        position = np.arange(start + 1, end + 1, dtype=np.float64)
        weight = np.asarray(members, dtype=np.float64) + 1
        for k in range(1, ORDER_MOMENTS + 1):
            out[slot, static + k - 1] = (position**k * weight).sum()
    return np.rint(out).astype(np.int64).reshape(-1)


def _smallest_gap(values: np.ndarray) -> float:
    """Smallest difference between distinct entries of ``values`` (inf with fewer than two)."""
    distinct = np.unique(np.round(values, 9))
    return float(np.diff(distinct).min()) if distinct.size > 1 else np.inf


def _loss_weight(units: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """Per-column ``1 / resolution**2`` of the candidate encodings ``units`` (block units, one
    row per distinct candidate), given the groups of equal running op totals (module docstring)."""
    resolution = np.full(units.shape[1], np.inf)
    for column in range(units.shape[1]):
        if column % SLOT_COLUMNS == 0:  # op count: decides the group among all candidates
            resolution[column] = _smallest_gap(units[:, column])
        else:  # the other columns only break ties inside a group
            for members in groups:
                if len(members) > 1:
                    resolution[column] = min(resolution[column], _smallest_gap(units[list(members), column]))
    weight = np.ones(units.shape[1])
    finite = np.isfinite(resolution)
    weight[finite] = np.maximum(1.0, 1.0 / np.maximum(resolution[finite], RESOLUTION_FLOOR) ** 2)
    return weight.astype(np.float32)


class PathMapper:
    """Lookup from the pilot's raw output (block units) to a candidate path and its execution
    blocks, built once per architecture."""

    def __init__(self, arch: PilotArchitecture) -> None:
        self.arch = arch
        self.scale = output_scale(arch)
        self.paths: list[tuple[int, ...]] = []
        self.blocks: list[tuple[tuple[int, int], ...]] = []
        encodings = []
        self.exact: dict[bytes, int] = {}
        self.collisions = 0
        for path in arch.candidates:
            blocks = arch.execution_blocks(path)
            code = encode(arch, path, blocks)
            key = code.tobytes()
            if key in self.exact:
                self.collisions += 1
                continue
            self.exact[key] = len(self.paths)
            self.paths.append(path)
            self.blocks.append(blocks)
            encodings.append(code)
        table = np.stack(encodings).astype(np.float64)
        # Running op totals at the end of each slot = code @ cumulative, one product per call.
        cumulative = np.zeros((output_size(), MAX_EXECUTION_BLOCKS))
        for slot in range(MAX_EXECUTION_BLOCKS):
            cumulative[[k * SLOT_COLUMNS for k in range(slot + 1)], slot] = 1.0
        running = table @ cumulative
        # float32 throughout the hot path: the pilot's output is float32, and a mixed-type
        # product pays a conversion per call.
        self._scale32 = self.scale.astype(np.float32)
        self._scaled_cumulative = (self.scale[:, None] * cumulative).astype(np.float32)  # block units -> running op totals
        # Candidates with equal running op totals form a group; within it the full encoding decides.
        groups: dict[bytes, list[int]] = {}
        for index, row in enumerate(running):
            groups.setdefault(row.tobytes(), []).append(index)
        self._group_running = np.stack([running[members[0]] for members in groups.values()]).astype(np.float32)
        self._group_members = [np.asarray(members) for members in groups.values()]
        # Within a group only the columns that differ between its members matter.
        self._group_columns, self._group_units, self._group_ones = [], [], []
        for members in groups.values():
            units = table[members] / self.scale
            columns = np.flatnonzero(units.max(axis=0) > units.min(axis=0))
            self._group_columns.append(columns)
            self._group_units.append(np.ascontiguousarray(units[:, columns], dtype=np.float32))
            self._group_ones.append(np.ones(columns.size, dtype=np.float32))
        self._ones_slots = np.ones(MAX_EXECUTION_BLOCKS, dtype=np.float32)
        self.loss_weight = _loss_weight(table / self.scale, list(groups.values()))
        """[output_size()] float32 per-column weights of the squared error (module docstring)."""

    def target(self, path: Sequence[int]) -> np.ndarray:
        """The training target of ``path``: its encoding in block units (float32)."""
        path = tuple(path)
        return (encode(self.arch, path, self.arch.execution_blocks(path)) / self.scale).astype(np.float32)

    def map(self, raw: np.ndarray) -> tuple[int, bool, bytes]:
        """Index into :attr:`paths` / :attr:`blocks` of the candidate for ``raw`` (block units,
        [output_size()]), whether it matched exactly, and the exact-match table's key (the output de-normalized and rounded)."""
        key = np.rint(raw * self._scale32).astype(np.int64).tobytes()
        hit = self.exact.get(key)
        if hit is not None:
            return hit, True, key
        if len(self._group_members) == 1:
            group = 0
        else:
            distance = np.abs(self._group_running - raw @ self._scaled_cumulative) @ self._ones_slots
            group = int(distance.argmin())
        members = self._group_members[group]
        if members.shape[0] == 1:
            return int(members[0]), False, key
        closest = int((np.abs(self._group_units[group] - raw[self._group_columns[group]]) @ self._group_ones[group]).argmin())
        return int(members[closest]), False, key
