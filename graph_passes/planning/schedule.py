"""Alternative schedules of a training step: state updates as soon as their inputs exist.

An exported training step runs forward, backward, then the optimizer: every state update
(parameters, optimizer moments, running statistics) comes after the whole backward. Under a
swap plan on a device whose copies overlap compute, that puts all the update compute at the
end, where the host link has nothing left to hide, while the backward, where every swapped-out
activation comes back in, has only its own compute to hide the swap-ins under. Running each
update right after the gradient it reads is ready (what "optimizer in backward" and
ZeRO-Offload's overlapped updates do) spreads the update compute over the backward, and frees
each gradient as soon as its update has read it.

:func:`updates_early` gives that schedule: a topological order that keeps the given order of
every node the non-state outputs (the loss, fetched values) and the gradients depend on, and
places each of the other nodes (those that only lead to updated state: the optimizer, running
statistics) right after the last of those nodes it depends on. Only the order changes, not what any node computes, so results are identical;
whether it is faster is for the simulator to say (:mod:`graph_passes.planning.swap.search`'s callers
plan both schedules and keep the faster).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import onnx

from graph_passes.ir.liveness import NodeIO, ancestor_nodes, consumed_names, node_io
from graph_passes.ir.program import is_order_dependent, order_dependent_closure


def updates_early(
    model: onnx.ModelProto, spine: Iterable[str], schedule: Sequence[int] | None = None
) -> list[int] | None:
    """``schedule`` (default: node order) with every node that no value of ``spine`` depends
    on moved up to right after the nodes it depends on (see the module docstring); ``None`` if
    that is the same order. ``spine``: the values whose computation keeps its order, for a
    training step its loss, fetched outputs and gradients (:func:`training_spine`): what is
    left are the state updates.

    A moved node's ancestors among the moved nodes come with it, in their original relative
    order; moved nodes that depend on nothing but state and constants stay where they were
    unless a moved node pulls them. Order-dependent nodes (and what reads them) never move."""
    nodes = list(model.graph.node)
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    producer = {name: index for index, node in enumerate(nodes) for name in node.output if name}
    targets = list(spine)
    # Nodes the spine depends on keep their order, and so do pinned nodes (the movable nodes
    # a pinned one reads go right before it, at the latest).
    keep = ancestor_nodes(nodes, targets, producer) | _pinned(nodes, order, producer)
    movable = [index for index in order if index not in keep]
    if not movable:
        return None
    result = _interleave(nodes, order, keep, movable, producer)
    return result if result != order else None


def _pinned(nodes: Sequence[onnx.NodeProto], order: Sequence[int], producer: Mapping[str, int]) -> set[int]:
    """Order-dependent nodes and their dependents: they stay where the schedule puts them."""
    pinned: set[int] = set()
    for index in order:
        node = nodes[index]
        if is_order_dependent(node) or any(producer.get(n) in pinned for n in consumed_names(node)):
            pinned.add(index)
    return pinned


def _kept_frontier(nodes: Sequence[onnx.NodeProto], movable: Sequence[int], keep: set[int],
                   producer: Mapping[str, int]) -> dict[int, frozenset[int]]:
    """For each movable node: the kept nodes it waits for, directly or through movable ones."""
    frontier: dict[int, frozenset[int]] = {}
    for index in movable:  # `order` is topological, so inputs come first
        waits: set[int] = set()
        for name in consumed_names(nodes[index]):
            p = producer.get(name)
            if p is None:
                continue
            if p in keep:
                waits.add(p)
            else:
                waits |= frontier[p]
        frontier[index] = frozenset(waits)
    return frontier


def _interleave(nodes: Sequence[onnx.NodeProto], order: Sequence[int], keep: set[int], movable: Sequence[int],
                producer: Mapping[str, int]) -> list[int]:
    """The kept nodes in ``order``, each movable node placed right after the last kept node it
    waits for (with its movable ancestors), the rest at the end."""
    frontier = _kept_frontier(nodes, movable, keep, producer)
    waiting_on: dict[int, list[int]] = {}
    remaining: dict[int, int] = {}
    for index in movable:
        remaining[index] = len(frontier[index])
        for p in frontier[index]:
            waiting_on.setdefault(p, []).append(index)
    placer = _Placer(nodes, order, keep, producer)
    for index in order:
        if index not in keep:
            continue
        for name in consumed_names(nodes[index]):
            p = producer.get(name)
            if p is not None and p not in keep and p not in placer.placed:
                placer.place_with_ancestors(p)  # only a pinned node reads a movable one
        placer.result.append(index)
        ready = [k for k in waiting_on.get(index, ()) if _done(remaining, k)]
        for k in sorted(ready, key=placer.rank.__getitem__):
            if k not in placer.placed:
                placer.place_with_ancestors(k)
    for index in movable:  # what waits on nothing: at its own place relative to the end
        if index not in placer.placed:
            placer.place_with_ancestors(index)
    return placer.result


class _Placer:
    """The schedule being built: a movable node goes in with its unplaced movable ancestors,
    in their original relative order."""

    def __init__(self, nodes: Sequence[onnx.NodeProto], order: Sequence[int], keep: set[int],
                 producer: Mapping[str, int]) -> None:
        self.nodes, self.keep, self.producer = nodes, keep, producer
        self.rank = {node: position for position, node in enumerate(order)}
        self.result: list[int] = []
        self.placed: set[int] = set()

    def place_with_ancestors(self, index: int) -> None:
        group, stack = [], [index]
        while stack:
            k = stack.pop()
            if k in self.placed or k in group:
                continue
            group.append(k)
            stack.extend(p for n in consumed_names(self.nodes[k])
                         if (p := self.producer.get(n)) is not None and p not in self.keep)
        group.sort(key=self.rank.__getitem__)
        self.result.extend(group)
        self.placed.update(group)


def updates_start(
    model: onnx.ModelProto, spine: Iterable[str], updated: Iterable[str], schedule: Sequence[int] | None = None,
    io: Sequence[NodeIO] | None = None,
) -> int | None:
    """The position in ``schedule`` (default: node order) where the state updates begin, if they
    trail the backward: no value of ``spine`` (:func:`training_spine`) depends on a node from
    there on, and every ``updated`` value is made there. Order-dependent nodes (and what reads
    them), which :func:`~graph_passes.ir.program.order_dependent_last` puts at the end, do not
    count. ``None`` where the updates are interleaved with the backward (an
    :func:`updates_early` schedule) or nothing trails it.

    A block cut there keeps the new state out of the backward's block: a block's outputs are
    allocated when it starts, so in one block holding both, the updated parameters and moments
    take arena room while every activation of the step is live (see the runtime's
    ``lower_updates_apart``). ``io``: the nodes' :func:`~graph_passes.ir.liveness.node_io`, when
    the caller has it."""
    nodes = list(model.graph.node)
    if io is None:
        io = node_io(nodes)
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    producer = {name: index for index, entry in enumerate(io) for name in entry.outputs}
    keep = ancestor_nodes(nodes, list(spine), producer, io)
    late = order_dependent_closure(nodes, io, order)
    tail = next((p for p, index in enumerate(order) if index in late), len(order))  # where the tail starts
    start = 1 + max((p for p in range(tail) if order[p] in keep), default=-1)
    if start >= tail:
        return None
    updated = set(updated)
    if any(name in updated for p in range(start) for name in io[order[p]].outputs):
        return None
    return start


def training_spine(roles: Mapping[str, object], state_pairs: Mapping[str, str], outputs: Iterable[str]) -> list[str] | None:
    """The values a training step's order is built around: every graph output that is not
    updated state (the loss, fetches) and every gradient (values with role ``grad``); ``None``
    for a graph without gradient roles (a foreign graph), where the backward cannot be told
    from the updates."""
    from graph_passes.ir.training_graph import Role

    grads = [n for n, r in roles.items() if r == Role.GRAD]
    if not grads:
        return None
    updated = set(state_pairs.values())
    return [o for o in outputs if o not in updated] + grads


def state_derived_late(model: onnx.ModelProto, state_inputs: Iterable[str],
                       schedule: Sequence[int] | None = None) -> list[int] | None:
    """``schedule`` (default: node order) with every node computed from the state alone (its
    reads are state inputs, initializers or what other such nodes make: a weight's transpose,
    an optimizer's bias correction) moved down to right before the first node that reads it;
    ``None`` if that is the same order.

    Under a tight budget such a node, run where its inputs happen to be on the device (a
    weight's transpose for the backward, next to the weight's forward use), makes a value that
    must go out and come back for a reader far away (gpt small at its least budget: 12.5 MiB
    of weight transposes a step). Run right before its reader, it reads state the host already
    holds: nothing goes out. A node whose output is a graph output stays where it was, at the
    latest. Order-dependent nodes (and what reads them) never move."""
    nodes = list(model.graph.node)
    io = node_io(nodes)
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    fixed = order_dependent_closure(nodes, io, order)
    constant = set(state_inputs) | {t.name for t in model.graph.initializer}
    derived: set[int] = set()
    for index in order:  # topological: a derived node's derived inputs are seen first
        if index not in fixed and all(name in constant for name in io[index].reads):
            derived.add(index)
            constant.update(io[index].outputs)
    if not derived:
        return None
    position = {node: k for k, node in enumerate(order)}
    readers: dict[str, list[int]] = {}
    for index in order:
        for name in set(io[index].reads):
            readers.setdefault(name, []).append(index)
    outputs = {o.name for o in model.graph.output}
    anchor: dict[int, int] = {}  # derived node -> the position it goes right before
    for index in reversed(order):
        if index in derived:
            firsts = [anchor.get(r, position[r]) for name in io[index].outputs for r in readers.get(name, ())]
            if not firsts or any(name in outputs for name in io[index].outputs):
                firsts.append(position[index])
            anchor[index] = min(firsts)
    before: dict[int, list[int]] = {}
    for index in order:
        if index in derived:
            before.setdefault(anchor[index], []).append(index)
    result = []
    for k, index in enumerate(order):
        result.extend(before.get(k, ()))
        if index not in derived:
            result.append(index)
    return result if result != order else None


def _done(remaining: dict[int, int], index: int) -> bool:
    remaining[index] -= 1
    return remaining[index] == 0


__all__ = ["state_derived_late", "training_spine", "updates_early", "updates_start"]
