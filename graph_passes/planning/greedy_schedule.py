"""A memory-greedy schedule: among the nodes whose inputs exist, run the one that frees the most
bytes net of what it makes.

Under a tight budget a swap plan has to bring back what the backward reads, and when two
nodes that read the same saved value run far apart, the value is evicted between them and
fetched twice (a conv net's ReLU output is read by the weight gradient and, a few nodes later,
by the ReLU's own mask). Picking, at every point, the ready node that frees the most (the last
reader of a value runs as soon as it can) keeps the values brought back short-lived, as
list schedulers that minimise peak memory do. Ties keep the given order. Only the order changes,
not what any node computes, so results are identical; the swap search plans this schedule
beside the others and keeps whichever the simulator finds faster.

Order-dependent nodes and what reads them (:func:`~graph_passes.ir.program.order_dependent_closure`)
run after the rest, in the given order, as :func:`~graph_passes.ir.program.order_dependent_last`
places them.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence

import onnx

from graph_passes.ir.liveness import node_io
from graph_passes.ir.program import order_dependent_closure
from graph_passes.ir.shapes import TensorInfo


def memory_greedy(model: onnx.ModelProto, infos: Mapping[str, TensorInfo],
                  schedule: Sequence[int] | None = None) -> list[int] | None:
    """``schedule`` (default: node order) reordered by the greedy rule of the module docstring;
    ``None`` if that is the same order. Graph inputs, initializers and graph outputs are never
    counted as freed (they outlive the step); every output counts as made."""
    nodes = list(model.graph.node)
    io = node_io(nodes)
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    late = order_dependent_closure(nodes, io, order)
    free = [i for i in order if i not in late]
    result = _GreedyWalk(model, io, infos, free).run() + [i for i in order if i in late]
    return result if result != order else None


class _GreedyWalk:
    """The list scheduler over ``order``'s nodes: a heap of ready nodes keyed by (bytes freed
    less bytes made, position in ``order``), updated as each value's last reader changes."""

    def __init__(self, model: onnx.ModelProto, io, infos: Mapping[str, TensorInfo], order: Sequence[int]) -> None:
        self.io, self.order = io, list(order)
        self.position = {node: k for k, node in enumerate(self.order)}
        kept = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
        kept |= {o.name for o in model.graph.output}
        self.nbytes = {name: info.nbytes for name, info in infos.items()}
        self.size = {name: n for name, n in self.nbytes.items() if name not in kept}  # what can be freed
        producer = {name: index for index in self.order for name in io[index].outputs}
        self.readers: dict[str, list[int]] = {}
        self.waiting: dict[int, int] = {}
        self.users: dict[int, list[int]] = {}
        for index in self.order:
            reads = set(io[index].reads)
            for name in reads:
                self.readers.setdefault(name, []).append(index)
            parents = {producer[n] for n in reads if n in producer}
            self.waiting[index] = len(parents)
            for p in parents:
                self.users.setdefault(p, []).append(index)
        self.left = {name: len(readers) for name, readers in self.readers.items()}
        self.score = {index: self._initial_score(index) for index in self.order}

    def _initial_score(self, index: int) -> int:
        freed = sum(self.size.get(n, 0) for n in set(self.io[index].reads) if self.left[n] == 1)
        return freed - sum(self.nbytes.get(n, 0) for n in self.io[index].outputs)

    def run(self) -> list[int]:
        heap = [(-self.score[i], self.position[i], i) for i in self.order if self.waiting[i] == 0]
        heapq.heapify(heap)
        done: set[int] = set()
        result: list[int] = []
        while heap:
            negative, _, index = heapq.heappop(heap)
            if index in done or -negative != self.score[index]:
                continue  # a stale entry: the node was pushed again with its new score
            done.add(index)
            result.append(index)
            for name in set(self.io[index].reads):
                self._read(name, done, heap)
            for user in self.users.get(index, ()):
                self.waiting[user] -= 1
                if self.waiting[user] == 0:
                    heapq.heappush(heap, (-self.score[user], self.position[user], user))
        return result

    def _read(self, name: str, done: set[int], heap: list) -> None:
        """One reader of ``name`` ran: if one is left, running it now frees the value."""
        self.left[name] -= 1
        if self.left[name] != 1 or name not in self.size:
            return
        last = next(r for r in self.readers[name] if r not in done)
        self.score[last] += self.size[name]
        if self.waiting[last] == 0:
            heapq.heappush(heap, (-self.score[last], self.position[last], last))


__all__ = ["memory_greedy"]
