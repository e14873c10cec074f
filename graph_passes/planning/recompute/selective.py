"""Selective recomputation: the saved values of a segment that are cheap to re-create from the
segment's other saved values.

Recomputing a whole segment (:mod:`graph_passes.planning.recompute.planner`) re-runs every node from its
checkpoint, its matrix products included. Some saved values cost far less per byte to
re-create on their own: a transformer layer's GELU output (from the saved pre-activation by one
elementwise op), its layer-norm outputs, the copies a Reshape makes. Korthikanti et al.
("Reducing Activation Recomputation in Large Transformer Models", 2022) apply the same idea to
the attention probabilities, chosen by hand for the GPU; here candidates are found from the
graph and kept by their cost on the planning profile (on the CPU profile the attention
probabilities, with their product and masking, cost about what the whole layer does per byte,
and are not kept):

- the **closure** of a saved value: the segment's nodes it depends on, walking back until a
  value the segment does not produce, another saved value of the segment (kept in memory
  anyway), or a random op's output (kept, so a recomputation replays the same mask);
- a value is a **candidate** if its closure costs (on the planning profile's cost model) at
  most :data:`MAX_COST_SHARE` per byte of what recomputing its whole segment costs per byte;
- candidates whose closures read one another's values join one **unit** (else the clone
  would read an original that the other unit frees; it would stay alive instead). A unit is
  a :class:`~graph_passes.planning.recompute.planner.Segment` with ``within`` set to its segment: the recompute
  pass writes it like any segment, and a plan that recomputes the whole segment drops it.

The units are found once per graph, at the first size that needs a plan; which values are
cheap relative to their segment changes little with the input size (the attention's
length² values only get cheaper relative to the layer as the length falls).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import onnx

from graph_passes.cost.cost_model import CostModel
from graph_passes.planning.recompute.planner import TRIVIAL_BYTES, Segment, segment_closure
from graph_passes.ir.shapes import TensorInfo

# A value is worth recomputing on its own where that costs at most this share, per byte
# freed, of recomputing its whole segment. On BERT (CPU profile) the values that pass are the
# GELU output, the layer-norm outputs and the copies a Reshape or a weight Transpose makes
# (shares 0.13-0.28); the attention probabilities, with their product and masking, cost about
# what the segment does per byte (1.25) and do not.
MAX_COST_SHARE = 1 / 3


def selective_units(
    segments: Sequence[Segment], model: onnx.ModelProto, infos: Mapping[str, TensorInfo], *,
    cost_model: CostModel, first_index: int,
) -> list[Segment]:
    """The cheap units of every segment (see the module docstring), numbered from
    ``first_index`` on (after the segments, so a plan's segment indices stay unique)."""
    nodes = model.graph.node
    units: list[Segment] = []
    for segment in segments:
        for values, members in _segment_units(segment, nodes, infos, cost_model):
            nbytes = sum(infos[v].nbytes for v in values)
            units.append(Segment(first_index + len(units), members, values, nbytes, within=segment.index))
    return units


def _segment_units(segment: Segment, nodes, infos, cost_model) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(values, node indices in graph order) of each unit of one segment."""
    if segment.saved_bytes <= 0:
        return []
    producer = {o: i for i in segment.nodes for o in nodes[i].output if o}
    saved = set(segment.saved)
    time_of = {i: cost_model.node_time(nodes[i], infos) for i in segment.nodes}
    per_byte = sum(time_of.values()) / segment.saved_bytes
    closures: dict[str, tuple[set[int], set[str]]] = {}  # candidate -> (nodes, saved values read)
    for value in segment.saved:
        info = infos.get(value)
        if info is None or info.nbytes <= TRIVIAL_BYTES:
            continue
        members, reads = segment_closure(value, producer, nodes, stop=saved - {value})
        if sum(time_of[i] for i in members) <= MAX_COST_SHARE * per_byte * info.nbytes:
            closures[value] = (members, reads)
    if not closures:
        return []
    # Join candidates whose closures read one another's values (union-find over candidates).
    parent = {v: v for v in closures}

    def root(v: str) -> str:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for value, (_, reads) in closures.items():
        for other in reads:
            if other in closures:
                parent[root(other)] = root(value)
    groups: dict[str, list[str]] = {}
    for value in segment.saved:  # saved order: deterministic units
        if value in closures:
            groups.setdefault(root(value), []).append(value)
    substantial = {v for v in segment.saved if infos.get(v) is not None and infos[v].nbytes > TRIVIAL_BYTES}
    units = []
    for values in groups.values():
        if set(values) >= substantial:
            continue  # all the segment saves: that is the segment's own recomputation
        members = sorted(set().union(*(closures[v][0] for v in values)))
        units.append((tuple(values), tuple(members)))
    return units


__all__ = ["MAX_COST_SHARE", "selective_units"]
