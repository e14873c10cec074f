"""A lower bound on the step time of any swap plan of a training step at a budget: the
physical limit that the searched plans are measured against.

Two things no swap plan avoids:

- **Compute.** Every node runs once: the sum of the nodes' times on the cost model (plus one
  block's launch cost).
- **Link traffic.** At a node ``n``, whatever the schedule, the values made so far and read
  later weigh at least the minimum cut between what must run before ``n`` (its ancestors and
  itself, and the step's inputs) and what must run after it (its descendants, and the step's
  outputs): a value costs its bytes when its producer is before the cut and a reader after it,
  and the nodes before the cut are closed under their inputs (a max-flow, ``networkx``).
  Computed at :data:`CUT_POINTS` nodes spread over the schedule. Where those bytes exceed the
  budget, the excess is on the host at that moment. Each such byte a later node reads must come back
  (host→device); each such byte that is not a clean input (an unchanged state input or the
  batch) must have gone out (device→host) — updated state included, since in the steady
  state it ends where it started. The most of either over all nodes, at the link's rates
  (``graph_passes.cost.cost_model.transfer_time``'s one-way and duplex rates), is a time no plan
  beats.

The bound is ``max(compute, link)``: a plan reaching it hides every copy under compute.
It holds for plans that swap (and choose schedules, blocks and host placement); a plan that
recomputes trades link bytes for compute and is not bounded by it. Workspace is ignored
(it only adds to what must fit), so the bound stays valid, if looser, where blocks have one.
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

CUT_POINTS = 8  # nodes the cut is computed at (each costs two max-flows)


@dataclasses.dataclass(frozen=True)
class StepTimeBound:
    """The bound and its arithmetic."""

    seconds: float  # max(compute_s, link_s)
    compute_s: float
    link_s: float
    budget_bytes: int
    necessary_live_bytes: int  # most bytes live at a cut node and read later, in every schedule
    h2d_bytes: int  # at least this many bytes come back in
    d2h_bytes: int  # at least this many bytes go out

    def describe(self) -> str:
        """One line of the arithmetic (for reports and the benchmark's README)."""
        return (f"max(compute {self.compute_s * 1e3:.3f} ms, link {self.link_s * 1e3:.3f} ms: "
                f"{self.h2d_bytes / 2**20:.1f} MiB in, {self.d2h_bytes / 2**20:.1f} MiB out; "
                f"{self.necessary_live_bytes / 2**20:.1f} MiB necessarily live vs a "
                f"{self.budget_bytes / 2**20:.1f} MiB budget)")


def link_time(h2d_bytes: float, d2h_bytes: float, profile: DeviceProfile) -> float:
    """Least seconds to move these bytes over the link: each direction at its one-way rate,
    both together at most at the link's combined rate."""
    both = min(profile.h2d_bandwidth, profile.duplex_bandwidth / 2) + min(profile.d2h_bandwidth, profile.duplex_bandwidth / 2)
    combined = max(both, profile.h2d_bandwidth, profile.d2h_bandwidth)
    return max(h2d_bytes / profile.h2d_bandwidth, d2h_bytes / profile.d2h_bandwidth, (h2d_bytes + d2h_bytes) / combined)


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
    compute = math.fsum(cost_model.block_time(model, b, infos) for b in finest.blocks) + profile.block_overhead_s
    h2d, d2h, live = _cut_bytes(finest, infos, alignment, budget, cut_points)
    link = link_time(h2d, d2h, profile)
    return StepTimeBound(max(compute, link), compute, link, budget, live, h2d, d2h)


def _cut_bytes(program: Program, infos, alignment: int, budget: int, points: int) -> tuple[int, int, int]:
    """(bytes that must come in, bytes that must go out, most bytes live) over the cut nodes."""
    blocks = program.blocks
    n = len(blocks)
    order = [step.block for step in program.steps if isinstance(step, RunBlock)]
    producer = {name: b.index for b in blocks for name in b.outputs}
    ancestors = np.zeros((n, n), dtype=bool)  # ancestors[i, j]: block j must run before block i
    for i in order:
        for name in blocks[i].inputs:
            p = producer.get(name)
            if p is not None:
                ancestors[i] |= ancestors[p]
                ancestors[i, p] = True
    updated = {new for step in program.steps if isinstance(step, Commit) for new, _ in step.renames}
    renamed = {old for step in program.steps if isinstance(step, Commit) for _, old in step.renames}
    inputs = set(program.state_inputs) | set(program.host_state) | set(program.data_inputs)
    clean = {name for name in inputs if name not in renamed}
    to_end = set(program.fetches) | updated
    sizes = {name: align_up(infos[name].nbytes, alignment) // alignment for name in set(producer) | inputs}
    h2d = d2h = live = 0
    for k in sorted({order[round(j * (n - 1) / max(1, points - 1))] for j in range(points)} if n else ()):
        before = set(np.flatnonzero(ancestors[k])) | {k}
        after = set(np.flatnonzero(ancestors[:, k]))
        into = _min_cut(blocks, producer, sizes, inputs, to_end=set(), free=set(), before=before, after=after)
        out = _min_cut(blocks, producer, sizes, inputs, to_end=to_end, free=clean, before=before, after=after)
        h2d = max(h2d, into * alignment - budget)
        d2h = max(d2h, out * alignment - budget)
        live = max(live, into * alignment)
    return max(0, h2d), max(0, d2h), live


def _min_cut(blocks, producer, sizes, inputs, *, to_end, free, before, after) -> int:
    """Least weight (alignment units) of the values made before and read after a cut that
    puts ``before`` first and ``after`` last (module docstring); ``free`` values weigh
    nothing, ``to_end`` values are read after everything."""
    g = nx.DiGraph()
    source, sink = ("source",), ("sink",)
    for b in blocks:
        for name in b.inputs:
            if name in sizes and name not in free:
                g.add_edge(("v", name), ("n", b.index))  # no capacity: infinite
            p = producer.get(name)
            if p is not None:
                g.add_edge(("n", b.index), ("n", p))  # a node before the cut has its inputs' makers before it
    for name, units in sizes.items():
        if name in free:
            continue
        g.add_edge(source if name in inputs else ("n", producer[name]), ("v", name), capacity=units)
        if name in to_end:
            g.add_edge(("v", name), sink)
    for i in before:
        g.add_edge(source, ("n", i))
    for i in after:
        g.add_edge(("n", i), sink)
    if sink not in g or source not in g:
        return 0
    from networkx.algorithms.flow import boykov_kolmogorov

    return int(nx.maximum_flow_value(g, source, sink, flow_func=boykov_kolmogorov))


__all__ = ["StepTimeBound", "link_time", "step_time_bound"]
