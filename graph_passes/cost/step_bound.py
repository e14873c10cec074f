"""A lower bound on the step time of any swap plan of a training step at a budget: the
physical limit that the searched plans are measured against.

Notation: ``C`` is the compute of every node (the cost model's node times), ``B`` the budget,
``r_in``/``r_out`` the link's one-way rates. For a set ``W`` of nodes closed under their inputs
(what has run by some moment), ``in(W)`` is the bytes of the values made in ``W`` (or step
inputs) that a node outside ``W`` reads, and ``out(W)`` the bytes of the values *made by nodes*
in ``W`` that a node outside ``W`` reads or that outlive the step (updated state, fetches).

Five bounds; the step is at least the largest (:class:`StepTimeBound`):

- **Compute**: ``C`` (plus one block's launch cost).
- **Link, whole step** (``link_s``): at a node ``n``, whatever the schedule, the values live
  across it weigh at least the minimum cut between what must run before ``n`` (its ancestors
  and itself) and what must run after it (its descendants). Where that exceeds ``B``, the excess
  is on the host then: it must come back (host→device), and what is not a clean input must have
  gone out (device→host; updated state included, since in the steady state it ends where it
  started). The most of either over the cut nodes, at the link's rates.
- **Split at a node** (``split_s``). Take any plan, a node ``k`` and its block ``b``; let ``W``
  be the blocks before ``b`` and ``b``'s nodes up to ``k`` (a prefix of the plan's order, so
  closed, holding ``k``'s ancestors and none of its descendants). Every value ``out(W)`` or
  ``in(W)`` counts is, while ``b`` runs, on the host, in the arena, or among ``b``'s values born
  and dead inside it (its workspace, the peak of those in its order), and the device holds at
  most ``B`` of them. When ``b`` starts, only the blocks before it have run (compute at most
  ``C(W)``), and what is on the host of ``out(W)`` was copied there: at least ``out(W) - B``
  bytes, so ``T >= C + (out(W) - B)/r_out - C(W)`` (the forward's evictions that its compute
  cannot hide). When ``b`` ends, at least ``C(W)`` has run, and at least ``in(W) - B`` bytes are
  still to come in: ``T >= C(W) + (in(W) - B)/r_in``. The plan is unknown, so each is minimised
  over closed sets between ``k``'s ancestors and its descendants: a minimum cut where values
  cost their bytes over the rate and nodes their compute on the side the bound counts it. At
  the :data:`CUT_POINTS` nodes whose ancestor sets score highest.

- **Round trip at a node** (``round_trip_s``). Same plan, node ``k``, block ``b`` and ``W``;
  look at the moment ``b`` ends. Of the values ``W`` leaves live, all but at most ``B`` bytes
  are not on the device then (those ``b`` reads are); each of those was copied out before that
  moment (a value a node made: its room is free only when its copy out ends) and is copied back
  in after it (a later block reads it, and a copy in holds its room from its start). So the
  two directions of the link cannot overlap on them:
  ``T >= (out(W) - B)/r_out + (in(W) - B)/r_in``, where the whole-step link bound lets
  them share the link's duplex rate. Minimised over the same closed sets by one minimum cut
  (a value costs ``bytes/r_in``, plus ``bytes/r_out`` if a node made it), at the nodes whose
  ``W0`` weighs most by that measure.

- **Room to copy** (``capacity_s``). While a block runs, its inputs, its outputs and the values
  born and dead inside it are on the device, so for every node ``k`` in it at least ``M_k``
  bytes (``k``'s inputs and outputs): what comes in (or goes out) while the block computes has
  at most ``B - M_k`` bytes of room (a copy in is allocated before it starts; a copy out is of
  a value on the device when the block starts, not one of its own). Over a block that is at most
  ``min(r * t_b, B - max M_k)``, which is at most the sum over its nodes of
  ``min(r * t_k, B - M_k)``: the most any blocking can copy under compute. The rest of the
  bytes the link bound says must come in (go out) moves while nothing computes:
  ``T >= C + (in - Σ_k min(r_in * t_k, max(0, B - M_k))) / r_in``, and the same out. It bites
  where the budget is barely above the largest nodes.

The link bound's cut nodes: per direction, the :data:`CUT_POINTS` nodes whose ancestors (with
themselves) weigh most, those whose prefix in the program's order weighs most (both at least
the cut), and those with the most forced crossings (values made before them and read after
them in every schedule: at most the cut). Any node gives a valid bound; these find the large cuts.

The bounds hold for plans that swap (and choose schedules, blocks and host placement), whose
compute is the graph's own. A plan that recomputes trades link bytes for compute and is not
bounded by them. Workspace is ignored (it only adds to what must fit), so they stay valid, if
looser, where blocks have one. Bytes are unaligned (the arena's alignment only adds) and cut
capacities in the split bound are picoseconds rounded down, so rounding only loosens. Minimum cuts: ``networkx`` max-flow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import networkx as nx
import numpy as np
import onnx

from graph_passes.cost.cost_model import CostModel, AnalyticalCostModel
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.program import Commit, Program, RunBlock
from graph_passes.ir.shapes import TensorInfo

CUT_POINTS = 3  # nodes per bound the cuts are computed at (the best-scoring ones; a max-flow each)
_PS = 1e12  # the split bound's capacities: picoseconds, rounded down


@dataclasses.dataclass(frozen=True)
class StepTimeBound:
    """The bound and its arithmetic."""

    seconds: float  # max(compute_s, link_s, split_s, capacity_s, round_trip_s)
    compute_s: float
    link_s: float
    budget_bytes: int
    necessary_live_bytes: int  # most bytes live at a cut node and read later, in every schedule
    h2d_bytes: int  # at least this many bytes come back in
    d2h_bytes: int  # at least this many bytes go out
    split_s: float = 0.0  # the split bound (module docstring)
    split: str = ""  # its arithmetic
    capacity_s: float = 0.0  # the room-to-copy bound (module docstring)
    under_compute_bytes: tuple[int, int] = (0, 0)  # (in, out): the most any plan copies while computing
    round_trip_s: float = 0.0  # the round-trip bound (module docstring)
    round_trip: str = ""  # its arithmetic

    def describe(self) -> str:
        """One line of the arithmetic (for reports and the benchmark's README)."""
        text = (f"max(compute {self.compute_s * 1e3:.3f} ms, link {self.link_s * 1e3:.3f} ms: "
                f"{self.h2d_bytes / 2**20:.1f} MiB in, {self.d2h_bytes / 2**20:.1f} MiB out; "
                f"{self.necessary_live_bytes / 2**20:.1f} MiB necessarily live vs a "
                f"{self.budget_bytes / 2**20:.1f} MiB budget")
        text += f"; split {self.split_s * 1e3:.3f} ms: {self.split}" if self.split else ""
        text += f"; round trip {self.round_trip_s * 1e3:.3f} ms: {self.round_trip}" if self.round_trip else ""
        if self.capacity_s > self.compute_s:
            text += (f"; room to copy {self.capacity_s * 1e3:.3f} ms: at most {self.under_compute_bytes[0] / 2**20:.1f}"
                     f" MiB in, {self.under_compute_bytes[1] / 2**20:.1f} MiB out under compute")
        return text + ")"


def link_time(h2d_bytes: float, d2h_bytes: float, profile: DeviceProfile) -> float:
    """Least seconds to move these bytes over the link: each direction at its one-way rate,
    both together at most at the link's combined rate."""
    both = min(profile.h2d_bandwidth, profile.duplex_bandwidth / 2) + min(profile.d2h_bandwidth, profile.duplex_bandwidth / 2)
    combined = max(both, profile.h2d_bandwidth, profile.d2h_bandwidth)
    return max(h2d_bytes / profile.h2d_bandwidth, d2h_bytes / profile.d2h_bandwidth, (h2d_bytes + d2h_bytes) / combined)


@dataclasses.dataclass(frozen=True)
class _Graph:
    """The finest program as a dependence graph, with per-node compute and value weights."""

    program: Program
    order: list[int]
    producer: dict[str, int]
    readers: dict[str, list[int]]
    ancestors: np.ndarray  # [i, j]: block j must run before block i
    sizes: dict[str, int]  # bytes of every value
    inputs: frozenset[str]
    clean: frozenset[str]  # inputs no commit replaces (the batch, unchanged state)
    to_end: frozenset[str]  # values that outlive the step (fetches, updated state)
    times: np.ndarray  # compute seconds per block


def _graph(program: Program, infos, times: np.ndarray) -> _Graph:
    blocks = program.blocks
    n = len(blocks)
    order = [step.block for step in program.steps if isinstance(step, RunBlock)]
    producer = {name: b.index for b in blocks for name in b.outputs}
    readers: dict[str, list[int]] = {}
    ancestors = np.zeros((n, n), dtype=bool)
    for i in order:
        for name in blocks[i].inputs:
            readers.setdefault(name, []).append(i)
            p = producer.get(name)
            if p is not None:
                ancestors[i] |= ancestors[p]
                ancestors[i, p] = True
    updated = {new for step in program.steps if isinstance(step, Commit) for new, _ in step.renames}
    renamed = {old for step in program.steps if isinstance(step, Commit) for _, old in step.renames}
    inputs = frozenset(program.state_inputs) | frozenset(program.host_state) | frozenset(program.data_inputs)
    sizes = {name: infos[name].nbytes for name in set(producer) | inputs}
    return _Graph(program, order, producer, readers, ancestors, sizes, inputs,
                  frozenset(n for n in inputs if n not in renamed), frozenset(program.fetches) | frozenset(updated),
                  times)


def step_time_bound(
    finest: Program,
    infos: Mapping[str, TensorInfo],
    *,
    model: onnx.ModelProto,
    profile: DeviceProfile,
    budget: int,
    cost_model: CostModel | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    cut_points: int = CUT_POINTS,
) -> StepTimeBound:
    """The bound (module docstring) for ``finest``: the step lowered one node per block, in
    any topological order (ancestry does not depend on it)."""
    if any(len(b.node_indices) != 1 for b in finest.blocks):
        raise ValueError("step_time_bound needs the step lowered with one node per block (max_block_nodes=1)")
    cost_model = cost_model or AnalyticalCostModel(profile)
    times = np.array([cost_model.block_time(model, b, infos) for b in finest.blocks], dtype=float)
    compute = math.fsum(times) + profile.block_overhead_s
    graph = _graph(finest, infos, times)
    proxies = _Proxies(graph)
    h2d, d2h, live = _link_bytes(graph, proxies, budget, cut_points)
    link = link_time(h2d, d2h, profile)
    split, how = _split_bound(graph, proxies, profile, budget, cut_points)
    capacity, under = _capacity_bound(graph, profile, budget, compute, h2d, d2h)
    round_trip, trip = _round_trip_bound(graph, proxies, profile, budget, cut_points)
    return StepTimeBound(max(compute, link, split, capacity, round_trip), compute, link, budget, live, h2d, d2h,
                         split, how, capacity, under, round_trip, trip)


def _capacity_bound(g: _Graph, profile: DeviceProfile, budget: int, compute: float, h2d: int,
                    d2h: int) -> tuple[float, tuple[int, int]]:
    """The room-to-copy bound (module docstring) and the most bytes (in, out) any plan copies
    while computing."""
    room = np.array([max(0, budget - sum(g.sizes.get(n, 0) for n in set(b.inputs) | set(b.outputs)))
                     for b in g.program.blocks], dtype=float)
    busy = g.times + profile.block_overhead_s  # a block's launch too, at most once per node
    under_in = float(np.sum(np.minimum(busy * profile.h2d_bandwidth, room)))
    under_out = float(np.sum(np.minimum(busy * profile.d2h_bandwidth, room)))
    seconds = compute + max(max(0.0, h2d - under_in) / profile.h2d_bandwidth,
                            max(0.0, d2h - under_out) / profile.d2h_bandwidth)
    return seconds, (int(under_in), int(under_out))


class _Proxies:
    """Per node ``k``, scores of which nodes' cuts are worth computing: the weights of the
    closed set of ``k`` and its ancestors (``W0(k)``; a minimum cut is at most its ``W0``
    value), of the program's prefix up to ``k`` (a closed set between the same ends, so also
    at least the cut), and the forced crossings (values made in ``W0(k)`` and read by a
    descendant of ``k``: in every cut, so at most the cut)."""

    def __init__(self, g: _Graph) -> None:
        n = len(g.program.blocks)
        inside = g.ancestors | np.eye(n, dtype=bool)  # [k, j]: j in W0(k)
        names = sorted(g.sizes)
        made = np.ones((len(names), n), dtype=bool)
        crossing = np.zeros((len(names), n), dtype=bool)
        for row, name in enumerate(names):
            p = g.producer.get(name)
            if p is not None:
                made[row] = inside[:, p]
            readers = g.readers.get(name, [])
            crossing[row] = ~inside[:, readers].all(axis=1) if readers else False
        lasting = np.array([name in g.to_end for name in names])[:, None]
        size = np.array([g.sizes[name] for name in names], dtype=float)
        dirty = np.array([name not in g.clean for name in names], dtype=float)
        self.into = size @ (made & crossing)  # in(W0(k))
        made_here = np.array([name not in g.inputs for name in names], dtype=float)
        self.steady_out = (size * dirty) @ (made & (crossing | lasting))  # what the link bound's out cut weighs
        self.out = (size * made_here) @ (made & (crossing | lasting))  # out(W0(k))
        self.compute = inside.astype(float) @ g.times  # C(W0(k))
        after = np.zeros((len(names), n), dtype=bool)  # [v, k]: a descendant of k reads v
        for row, name in enumerate(names):
            readers = g.readers.get(name, [])
            if readers:
                after[row] = g.ancestors[readers].any(axis=0)
        self.forced_in = size @ (made & after)
        self.forced_out = (size * dirty) @ (made & (after | lasting))
        self.prefix_in, self.prefix_out = _prefix_live(g, names, size * dirty, lasting[:, 0])

    @staticmethod
    def top(scores: np.ndarray, count: int) -> list[int]:
        """The ``count`` nodes with the highest scores (ties to the lower index)."""
        return [int(k) for k in np.argsort(-scores, kind="stable")[:count]]


def _prefix_live(g: _Graph, names: list[str], dirty_size: np.ndarray,
                 lasting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the bytes live across it in the program's own order (made at or before it, or
    a step input, and read after it; for the out weights also values that outlive the step):
    ``in`` and ``out`` (dirty bytes) of the prefix ending at it."""
    n = len(g.program.blocks)
    position = np.empty(n, dtype=int)
    position[g.order] = np.arange(n)
    live_in, live_out = np.zeros(n + 1), np.zeros(n + 1)
    for row, name in enumerate(names):
        made = position[g.producer[name]] if name in g.producer else 0
        readers = g.readers.get(name, [])
        last = int(position[readers].max()) if readers else -1
        if last > made:  # live from its maker's position to the one before its last reader's
            live_in[made] += g.sizes[name]
            live_in[last] -= g.sizes[name]
        end = n if lasting[row] else last
        if end > made:
            live_out[made] += dirty_size[row]
            live_out[end] -= dirty_size[row]
    by_position_in, by_position_out = np.cumsum(live_in)[:n], np.cumsum(live_out)[:n]
    return by_position_in[position], by_position_out[position]


def _link_bytes(g: _Graph, proxies: _Proxies, budget: int, points: int) -> tuple[int, int, int]:
    """(bytes that must come in, bytes that must go out, most bytes live) over the cut nodes
    (the whole-step link bound)."""
    h2d = d2h = live = 0
    units = {name: size for name, size in g.sizes.items()}
    dirty = {name: size for name, size in units.items() if name not in g.clean}
    scores = (proxies.into, proxies.steady_out, proxies.forced_in, proxies.forced_out, proxies.prefix_in,
              proxies.prefix_out)
    chosen = {k for score in scores for k in _Proxies.top(score, points)}
    for k in sorted(chosen):
        before = set(np.flatnonzero(g.ancestors[k])) | {k}
        after = set(np.flatnonzero(g.ancestors[:, k]))
        into = _min_cut(g, units, to_end=(), before=before, after=after)
        out = _min_cut(g, dirty, to_end=g.to_end, before=before, after=after)
        h2d, d2h, live = max(h2d, into - budget), max(d2h, out - budget), max(live, into)
    return max(0, h2d), max(0, d2h), live


def _split_bound(g: _Graph, proxies: _Proxies, profile: DeviceProfile, budget: int, points: int) -> tuple[float, str]:
    """The split bound (module docstring) at the best-scoring nodes, and its arithmetic."""
    r_in, r_out, total = profile.h2d_bandwidth, profile.d2h_bandwidth, float(np.sum(g.times))
    made = {name: size for name, size in g.sizes.items() if name not in g.inputs}
    node_cost = [int(t * _PS) for t in g.times]
    best, how = 0.0, ""
    kinds = (  # label, score of W0(k), values weighed, rate, to_end, node costs
        ("evictions before", proxies.out / r_out - proxies.compute, made, r_out, g.to_end, dict(cost_out=node_cost)),
        ("returns after", proxies.into / r_in + proxies.compute, g.sizes, r_in, (), dict(cost_in=node_cost)),
    )
    for label, scores, values, rate, to_end, costs in kinds:
        weights = {name: int(size / rate * _PS) for name, size in values.items()}
        for k in _Proxies.top(scores, points):
            before = set(np.flatnonzero(g.ancestors[k])) | {k}
            after = set(np.flatnonzero(g.ancestors[:, k]))
            cut = _min_cut(g, weights, to_end=to_end, before=before, after=after, **costs) / _PS
            if "cost_in" in costs:  # T >= C(W) + (in(W) - B) / r_in; the forced nodes' compute is not in the cut
                seconds = cut + float(np.sum(g.times[sorted(before)])) - budget / r_in
            else:  # T >= C(rest) + (out(W) - B) / r_out; the descendants' compute is not in the cut
                seconds = cut + float(np.sum(g.times[sorted(after)])) - budget / r_out
            if seconds > best:
                best, how = seconds, f"{label} node {k}"
    return best, how


def _round_trip_bound(g: _Graph, proxies: _Proxies, profile: DeviceProfile, budget: int,
                      points: int) -> tuple[float, str]:
    """The round-trip bound (module docstring) at the best-scoring nodes, and its arithmetic."""
    r_in, r_out = profile.h2d_bandwidth, profile.d2h_bandwidth
    weights = {name: int((size / r_in + (0.0 if name in g.inputs else size / r_out)) * _PS)
               for name, size in g.sizes.items()}
    scores = (proxies.into / r_in + proxies.out / r_out, proxies.forced_in / r_in + proxies.forced_out / r_out,
              proxies.prefix_in / r_in + proxies.prefix_out / r_out)
    best, how = 0.0, ""
    for k in sorted({k for score in scores for k in _Proxies.top(score, points)}):
        before = set(np.flatnonzero(g.ancestors[k])) | {k}
        after = set(np.flatnonzero(g.ancestors[:, k]))
        seconds = _min_cut(g, weights, to_end=(), before=before, after=after) / _PS - budget / r_in - budget / r_out
        if seconds > best:
            best, how = seconds, f"out then back in across node {k}"
    return best, how


def _min_cut(g: _Graph, weights: Mapping[str, int], *, to_end, before, after, cost_in=None, cost_out=None) -> int:
    """Least total weight of a set ``W`` of nodes closed under inputs, holding ``before`` and
    none of ``after``: a value in ``weights`` costs its weight when made in ``W`` (or a step
    input) and read outside it (or in ``to_end``); node ``i`` costs ``cost_in[i]`` in ``W``,
    ``cost_out[i]`` outside it."""
    net = nx.DiGraph()
    source, sink = ("source",), ("sink",)
    blocks = g.program.blocks
    for b in blocks:
        for name in b.inputs:
            if weights.get(name):
                net.add_edge(("v", name), ("n", b.index))  # no capacity: infinite
            p = g.producer.get(name)
            if p is not None:
                net.add_edge(("n", b.index), ("n", p))  # W holds its nodes' inputs' makers
    for name, weight in weights.items():
        if weight:
            net.add_edge(source if name in g.inputs else ("n", g.producer[name]), ("v", name), capacity=weight)
            if name in to_end:
                net.add_edge(("v", name), sink)
    for i in before:
        net.add_edge(source, ("n", i))
    for i in after:
        net.add_edge(("n", i), sink)
    for costs, edge in ((cost_in, lambda i: (("n", i), sink)), (cost_out, lambda i: (source, ("n", i)))):
        for i, cost in enumerate(costs or ()):
            if cost > 0 and i not in before and i not in after:  # forced nodes' costs are fixed
                net.add_edge(*edge(i), capacity=cost)
    if sink not in net or source not in net:
        return 0
    from networkx.algorithms.flow import boykov_kolmogorov

    return int(nx.maximum_flow_value(net, source, sink, flow_func=boykov_kolmogorov))


__all__ = ["StepTimeBound", "link_time", "step_time_bound"]
