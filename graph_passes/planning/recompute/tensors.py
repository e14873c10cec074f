"""Per-tensor recomputation: saved forward values chosen one by one, each dropped after its last
forward use and re-created before its backward use.

A segment plan (:mod:`graph_passes.planning.recompute.planner`) re-runs everything between two
cuts from the checkpoint. Here the unit is one **saved value** ``t`` (a forward value a backward
node reads, not a random op's output): recomputed, it is re-created by its **closure**, the
forward nodes it depends on, walking back until a value that is there anyway when the backward
needs ``t``: a graph input or state, a random op's output (kept, so the mask replays), or a saved
value that is not recomputed (kept on the device or swapped back in). A recomputed saved value
on the way is walked through (its clone is shared). So any set of saved values is a valid
choice, and the swap planner sees the rest as usual.

The rewrite is the recompute pass's (:func:`~graph_passes.planning.recompute.graph_pass.write_recompute_plan`)
with one segment, the union of the closures, saving the chosen values; its clones get a suffix
index no earlier rewrite of the graph used. :meth:`TensorRecompute.rewrite` also maps a schedule
and block cuts of the graph onto the rewritten one: each clone runs right before the first node
in that schedule that reads it (its clone readers first), inside that node's block or, where asked
(a block of clones and reader over the budget), in a block of its own.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

import onnx

from graph_passes.cost.cost_model import CostModel, transfer_time
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.ir.liveness import consumed_names, node_io
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.recompute.graph_pass import recomputed_infos, write_recompute_plan
from graph_passes.planning.recompute.planner import (RANDOM_OPS, TRIVIAL_BYTES, RecomputePlan, Segment,
                                                     forward_nodes, segment_closure)

_SUFFIX = re.compile(r"__rc(\d+)$")


@dataclasses.dataclass(frozen=True)
class TensorRewrite:
    """The graph with some saved values recomputed, and where its nodes come from."""

    model: onnx.ModelProto
    infos: Mapping[str, TensorInfo]
    clones: int
    original_index: tuple[int, ...]  # per node of the graph given: its index in ``model``
    clone_reads: Mapping[int, tuple[int, ...]]  # node of ``model`` -> the clones it reads
    plan: RecomputePlan  # what wrote ``model`` from the graph given

    def schedule(self, order: Sequence[int], cuts: Sequence[int], *,
                 isolate_clones: bool = False) -> tuple[list[int], list[int]]:
        """(schedule, cuts) of ``model`` from a schedule and block starts of the graph given:
        every clone right before the first node that reads it, in the block of that node or,
        with ``isolate_clones``, in a block of its own (that node then starts a block). A clone
        run inside its reader's block holds every value the run re-creates at once: under a
        tight budget more than the budget (gpt small at 12 MiB: blocks of 20 MiB), where blocks
        of their own let the swap planner evict between them."""
        out: list[int] = []
        emitted: set[int] = set()
        starts: list[int] = []
        originals = frozenset(self.original_index)

        def emit(node: int) -> None:
            stack = [(node, False)]
            while stack:
                current, ready = stack.pop()
                if current in emitted:
                    continue
                if ready:
                    if isolate_clones and (current not in originals or (out and out[-1] not in originals)):
                        starts.append(len(out))
                    emitted.add(current)
                    out.append(current)
                    continue
                stack.append((current, True))
                stack.extend((c, False) for c in reversed(self.clone_reads.get(current, ())) if c not in emitted)

        cut_set = set(cuts)
        for position, node in enumerate(order):
            if position in cut_set:
                starts.append(len(out))
            emit(self.original_index[node])
        return out, sorted({c for c in starts if 0 < c < len(out)})


class TensorRecompute:
    """The saved values of one graph that may be recomputed, their cost, and rewrites for a choice."""

    def __init__(self, model: onnx.ModelProto, infos: Mapping[str, TensorInfo], *, loss_name: str) -> None:
        self.model, self.infos, self.loss_name = model, infos, loss_name
        nodes = model.graph.node
        self.forward = forward_nodes(model, loss_name)
        self.producer = {o: i for i in sorted(self.forward) for o in nodes[i].output if o}
        read_by_backward = {n for i, node in enumerate(nodes) if i not in self.forward for n in consumed_names(node)}
        self.candidates = tuple(
            name for name, i in self.producer.items()
            if name in read_by_backward and nodes[i].op_type not in RANDOM_OPS
            and name in infos and infos[name].nbytes > TRIVIAL_BYTES)
        used = [int(m.group(1)) for node in nodes for o in node.output if o and (m := _SUFFIX.search(o))]
        self.index = max(used, default=-1) + 1  # the clones' suffix: unused by earlier rewrites

    def closure(self, name: str, chosen: frozenset[str]) -> set[int]:
        """The forward nodes that re-create ``name`` with ``chosen`` recomputed (module docstring):
        the walk stops at candidates not chosen (kept or swapped back in for the backward)."""
        stop = frozenset(self.candidates) - chosen
        members, _ = segment_closure(name, self.producer, self.model.graph.node, stop=stop)
        return members

    def price(self, cost_model: CostModel, profile: DeviceProfile) -> dict[str, float]:
        """Per candidate: its closure's compute with nothing else recomputed, over the time its
        bytes take out and back in at the link's rates (below 1: cheaper to recompute)."""
        nodes, out = self.model.graph.node, {}
        for name in self.candidates:
            seconds = sum(cost_model.node_time(nodes[i], self.infos) for i in self.closure(name, frozenset()))
            nbytes = self.infos[name].nbytes
            copy = transfer_time(nbytes, profile, "d2h") + transfer_time(nbytes, profile, "h2d")
            out[name] = seconds / copy if copy > 0 else float("inf")
        return out

    def rewrite(self, chosen: frozenset[str]) -> TensorRewrite:
        """The graph with ``chosen`` (candidates) recomputed."""
        chosen = frozenset(chosen) & frozenset(self.candidates)
        members = sorted(set().union(*(self.closure(n, chosen) for n in chosen)) if chosen else ())
        saved = tuple(sorted(chosen, key=lambda n: (self.producer[n], n)))
        segment = Segment(self.index, tuple(members), saved, sum(self.infos[n].nbytes for n in saved))
        model, clones = write_recompute_plan(self.model, RecomputePlan((segment,)), loss_name=self.loss_name)
        suffix = f"__rc{self.index}"
        new_nodes = model.graph.node
        mine = [any(o.endswith(suffix) for o in node.output if o) for node in new_nodes]
        original_index = tuple(i for i, is_clone in enumerate(mine) if not is_clone)
        made_by = {o: i for i, node in enumerate(new_nodes) if mine[i] for o in node.output if o}
        clone_reads = {}
        for i, entry in enumerate(node_io(new_nodes)):
            reads = sorted({made_by[n] for n in entry.reads if n in made_by})
            if reads:
                clone_reads[i] = tuple(reads)
        return TensorRewrite(model, recomputed_infos(self.infos, model), clones, original_index, clone_reads,
                             RecomputePlan((segment,)))


__all__ = ["TensorRecompute", "TensorRewrite"]
