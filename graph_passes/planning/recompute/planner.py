"""Recompute planning (Mimose, checkpointing): which forward segments drop their saved
activations and re-create them for the backward.

A training-step graph's **forward** is the set of nodes the loss depends on; every other node
(gradients, optimizer) is **backward**. A forward value a backward node reads is *saved*: it
stays in memory from the forward until its backward use, which is what makes the peak.

**Segments** (:func:`forward_segments`). The exported joint graph has lost the torch module
scopes (its nodes are named after the re-exported joint graph), so layers are found from the
graph itself: walking the forward in graph order, a *cut* is a position where exactly one
non-trivial forward value is live (produced before, read by a forward node after): the residual
stream between two transformer layers, the feature map between two CNN stages. Values of at
most :data:`TRIVIAL_BYTES` (shapes, scalars) do not count, nor do values read over more than
:data:`LONG_LIVED_SHARE` of the forward (a causal mask every layer reads). The forward nodes between two cuts
form a segment; segments saving less than :data:`MIN_SEGMENT_SHARE` of all saved bytes are merged
into the next one.

**Plans** (:class:`RecomputePlanner`). Recomputing a segment means the backward reads clones
of its saved values, computed from what the segment read (its checkpoint: the cut value, the
parameters, random ops' outputs) right before the first backward node needs them; the originals
then die at their last forward use. Random ops (Dropout and the random generators) are never
cloned: their outputs are kept, so a recomputation replays the same mask. The greedy planner
(Mimose's bucket rule, :mod:`graph_passes.planning.recompute.mimose`) repeatedly picks the segment whose saving is
nearest above the remaining excess (among segments of similar size, the earliest), else the
largest, until the memory replay fits the budget. The plan is a
frozen :class:`RecomputePlan`; :mod:`graph_passes.planning.recompute.graph_pass` applies it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import onnx

from graph_passes.ir.liveness import ancestor_nodes, consumed_names
from graph_passes.planning.recompute.mimose import bucket_choice
from graph_passes.ir.shapes import TensorInfo

TRIVIAL_BYTES = 1024
LONG_LIVED_SHARE = 0.25  # of the forward's nodes: values read over a longer span never make a cut
MIN_SEGMENT_SHARE = 0.02
# Ops whose outputs are random draws: never cloned (a clone would draw a new mask).
RANDOM_OPS = frozenset({
    "Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli", "Multinomial",
})


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive forward nodes between two cuts."""

    index: int
    nodes: tuple[int, ...]  # node indices, graph order
    saved: tuple[str, ...]  # outputs of these nodes that backward nodes read (random outputs excluded)
    saved_bytes: int
    # A selective unit (graph_passes.planning.recompute.selective): some saved values of segment
    # ``within``, re-created from its other saved values; None for a segment.
    within: int | None = None


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """Segments whose saved values the backward recomputes."""

    segments: tuple[Segment, ...]

    @property
    def saved_bytes(self) -> int:
        return sum(s.saved_bytes for s in self.segments)


@dataclasses.dataclass(frozen=True)
class NoRecomputePlan:
    """Why recompute cannot meet the budget: even every segment recomputed needs ``needed_bytes``."""

    needed_bytes: int
    reason: str


def forward_nodes(model: onnx.ModelProto, loss_name: str) -> set[int]:
    """Indices of the nodes the loss depends on."""
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    if loss_name not in producer:
        raise ValueError(f"no node produces the loss {loss_name!r}")
    return ancestor_nodes(nodes, [loss_name], producer)


def forward_segments(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], *, loss_name: str) -> list[Segment]:
    """The forward cut into segments at single-live-value points (see the module docstring)."""
    nodes = list(model.graph.node)
    forward = forward_nodes(model, loss_name)
    order = [i for i in range(len(nodes)) if i in forward]
    produced_by = {o: i for i in order for o in nodes[i].output if o}
    last_forward_read: dict[str, int] = {}
    for position, index in enumerate(order):
        for name in consumed_names(nodes[index]):
            if name in produced_by:
                last_forward_read[name] = position
    read_by_backward: set[str] = set()
    for index, node in enumerate(nodes):
        if index not in forward:
            read_by_backward.update(n for n in consumed_names(node) if n in produced_by)

    def nbytes(name: str) -> int:
        info = infos.get(name)
        return info.nbytes if info is not None else 0

    # Live non-trivial forward values between positions, by a sweep over births and deaths.
    # Values read across much of the forward (attention masks, position tables) are like
    # parameters here: every layer reads them, so they never make a cut.
    span = LONG_LIVED_SHARE * len(order)
    cuts = []
    live: set[str] = set()
    for position, index in enumerate(order):
        if position > 0 and len(live) == 1:
            cuts.append(position)
        for name in nodes[index].output:
            last = last_forward_read.get(name, -1)
            if name and last > position and nbytes(name) > TRIVIAL_BYTES and last - position <= span:
                live.add(name)
        live = {n for n in live if last_forward_read[n] > position}
    bounds = [0] + cuts + [len(order)]
    raw = []
    for start, end in zip(bounds, bounds[1:]):
        members = tuple(order[start:end])
        saved = tuple(o for i in members if nodes[i].op_type not in RANDOM_OPS
                      for o in nodes[i].output if o in read_by_backward)
        raw.append((members, saved))
    total = sum(nbytes(n) for _, saved in raw for n in saved) or 1
    merged: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
    carry: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
    for members, saved in raw:
        carry = (carry[0] + members, carry[1] + saved)
        if sum(nbytes(n) for n in carry[1]) >= MIN_SEGMENT_SHARE * total:
            merged.append(carry)
            carry = ((), ())
    if carry[0]:
        if merged:
            merged[-1] = (merged[-1][0] + carry[0], merged[-1][1] + carry[1])
        else:
            merged.append(carry)
    return [Segment(k, members, saved, sum(nbytes(n) for n in saved)) for k, (members, saved) in enumerate(merged)]


def segment_closure(name: str, produced_here: Mapping[str, int], nodes, *, stop=frozenset(),
                    reads: Callable[[Any], list[str]] = consumed_names) -> tuple[set[int], set[str]]:
    """(node indices, values it stopped at): the nodes ``produced_here`` (a segment's values
    -> their producers) that ``name`` depends on, walking back until a value the segment does
    not produce, a random op's output (kept, so a recomputation replays the same mask) or a
    value in ``stop``. ``reads``: the value names a node reads (``nodes`` are protos by
    default; the recompute pass gives its ``onnx_ir`` nodes' reader)."""
    members: set[int] = set()
    stopped: set[str] = set()
    stack = [produced_here[name]]
    while stack:
        index = stack.pop()
        if index in members:
            continue
        members.add(index)
        for value in reads(nodes[index]):
            source = produced_here.get(value)
            if source is None or nodes[source].op_type in RANDOM_OPS:
                continue
            if value in stop:
                stopped.add(value)
                continue
            stack.append(source)
    return members, stopped


class RecomputePlanner:
    """Greedy segment choice under a budget (Mimose's bucket rule,
    :func:`graph_passes.planning.recompute.mimose.bucket_choice`), checked by ``needed_bytes``: a function from a
    plan to the least budget the rewritten graph runs in (the caller lowers the rewritten graph
    and replays it through the arena). Each round the excess is measured, not estimated.
    ``start``: segments already chosen (a plan from estimates that fell short)."""

    def plan(
        self, segments: Sequence[Segment], budget: int, needed_bytes: Callable[[RecomputePlan], int],
        *, start: Sequence[Segment] = (),
    ) -> RecomputePlan | NoRecomputePlan:
        chosen = list(start)
        taken = {s.index for s in chosen}
        remaining = {s.index: s for s in segments if s.saved_bytes > 0 and s.index not in taken}

        def as_plan() -> RecomputePlan:
            return RecomputePlan(tuple(sorted(chosen, key=lambda s: s.index)))

        need = needed_bytes(as_plan())
        while need > budget:
            if not remaining:
                return NoRecomputePlan(need, "recomputing every forward segment still does not fit the budget")
            pick = bucket_choice({k: s.saved_bytes for k, s in remaining.items()}, need - budget)
            chosen.append(remaining.pop(pick))
            need = needed_bytes(as_plan())
        return as_plan()


__all__ = [
    "NoRecomputePlan", "RANDOM_OPS", "RecomputePlan", "RecomputePlanner", "Segment", "forward_nodes",
    "forward_segments", "segment_closure",
]
