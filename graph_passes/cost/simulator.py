"""Time simulator: replays a lowered (and possibly swap-planned) program on a device profile.

SwapAdvisor (§3, §4.1) evaluates a plan by simulating one compute stream and two copy streams
(host→device, device→host) with the orderings the plan implies. This module does the same for a
:class:`graph_passes.ir.program.Program`:

- **compute** runs ``RunBlock`` steps, one after another, each taking
  ``cost_model.block_time(model, block, infos)`` plus the profile's ``block_overhead_s``;
- **h2d** runs ``Load`` (the batch tensor) and ``SwapIn`` copies, FIFO in program order;
- **d2h** runs ``SwapOut(copy=True)`` and ``Fetch`` copies, FIFO in program order. A drop
  (``SwapOut(copy=False)``) moves nothing: it takes no time and is logged on the ``drop`` stream.

Copies take :func:`graph_passes.cost.cost_model.transfer_time`, at the duplex rate
(``concurrent=True``) when a copy in the other direction overlaps it. Which copies overlap
depends on their rates, so the replay is repeated with the overlapping copies of the previous
replay charged the duplex rate (first replay: none) until that set is stable (at most
:data:`MAX_DUPLEX_ROUNDS` replays). An approximation: a copy is charged one rate throughout,
and both copies of an overlapping pair pay the duplex rate.

Orderings. The runtime walks the program in order (the *host cursor*); a step is issued when the
cursor reaches it, and a ``RunBlock`` holds the cursor until the block starts, so the steps after
a block are issued while it computes.

- A ``RunBlock`` starts when the previous block has finished, every input is resident (its
  load / swap-in / producing block complete), and its outputs plus workspace fit in the arena.
- A ``SwapIn``/``Load`` allocates when issued, as soon as its bytes fit; its copy then starts
  after earlier h2d copies and, for a ``SwapIn``, after the host copy exists (the tensor's
  ``SwapOut`` finished). The allocation holds the cursor (allocations happen in program order).
- A ``SwapOut`` starts when issued, after the last block that read or produced the tensor has
  finished, and after earlier d2h copies; its arena bytes are released when it completes.
  ``Fetch`` is the same (a small d2h copy); a fetched tensor that is freed goes when it is copied.
- Values a block frees, and its workspace, are released when the block ends.

Memory. Arena bytes follow :mod:`graph_passes.ir.memory`'s accounting (sizes aligned with
:func:`~graph_passes.ir.memory.align_up`; a block's workspace counted while it runs), over time
instead of over program steps, and ``peak_bytes`` is the most live bytes (plus the running
block's workspace) at any instant. An allocation waits until enough earlier releases have
happened to fit ``budget``; without a ``budget`` the cap is the program's own least budget,
:func:`graph_passes.ir.memory.simulate_program`'s ``min_budget_bytes`` (the tightest cap the
program runs under), so with instantaneous copies ``peak_bytes`` equals it. ``budget=math.inf``
lifts the cap (copies and blocks never wait for memory).

``stall_time_s`` is the time the compute stream sits idle before its last block ends (waiting
for loads, swap-ins, or memory); ``step_time_s`` is when the last event of any stream ends. On a
profile whose copies do not overlap compute (``copies_overlap_compute=False``: the CPU device,
where a swap is a memcpy on the same cores), the step is the compute time plus every copy's
time, and the stall is the copies' time; the event trace still shows the replay.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Mapping

import onnx

from graph_passes.cost.cost_model import AnalyticalCostModel, CostModel, transfer_time
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut
from graph_passes.ir.shapes import TensorInfo

COMPUTE, H2D, D2H, DROP = "compute", "h2d", "d2h", "drop"
MAX_DUPLEX_ROUNDS = 6
STREAMS = (COMPUTE, H2D, D2H, DROP)


@dataclasses.dataclass(frozen=True)
class Event:
    """One interval on one stream: a block run, a copy, or a (zero-time) drop."""

    stream: str
    label: str
    start_s: float
    end_s: float
    nbytes: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclasses.dataclass(frozen=True)
class TimeTrace:
    """What one simulated training step takes on a profile."""

    step_time_s: float  # when the last event of any stream ends
    compute_time_s: float  # sum of block times
    stall_time_s: float  # compute idle before its last block ends (waiting on copies or memory)
    d2h_busy_s: float
    h2d_busy_s: float
    peak_bytes: int  # most live arena bytes + running block's workspace at any instant
    events: tuple[Event, ...]  # sorted by start time
    budget_bytes: float = math.inf  # the arena cap simulated

    def stream(self, name: str) -> tuple[Event, ...]:
        """The events of one stream, in time order."""
        return tuple(e for e in self.events if e.stream == name)


class _Arena:
    """Live bytes over time: allocations happen in non-decreasing time order, releases are
    scheduled at any time not before the latest allocation."""

    def __init__(self, live: int, budget: float) -> None:
        self.live = live
        self.budget = budget
        self.peak = live
        self._releases: list[tuple[float, int, int]] = []  # heap of (time, seq, bytes)
        self._seq = 0

    def release(self, time: float, nbytes: int) -> None:
        if nbytes:
            heapq.heappush(self._releases, (time, self._seq, nbytes))
            self._seq += 1

    def _advance(self, time: float) -> None:
        while self._releases and self._releases[0][0] <= time:
            self.live -= heapq.heappop(self._releases)[2]

    def allocate(self, earliest: float, nbytes: int) -> float:
        """Allocate ``nbytes`` at the first time >= ``earliest`` it fits; returns that time.
        If it never fits (the program needs more than the budget), it goes in after every
        scheduled release and the peak shows the excess."""
        time = earliest
        self._advance(time)
        while self.live + nbytes > self.budget and self._releases:
            time = self._releases[0][0]
            self._advance(time)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return time


class _Stream:
    """A FIFO resource: events start no earlier than the previous one ended."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0
        self.busy_s = 0.0

    def add(self, start: float, duration: float) -> float:
        end = start + duration
        self.free_at = max(self.free_at, end)
        self.busy_s += duration
        return end


def simulate_time(
    program: Program,
    infos: Mapping[str, TensorInfo],
    *,
    model: onnx.ModelProto,
    cost_model: CostModel | None = None,
    profile: DeviceProfile,
    budget: float | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> TimeTrace:
    """Replay one step of ``program`` on a compute stream and two copy streams (see the module
    docstring for the orderings). ``cost_model`` defaults to the analytical model of
    ``profile``; ``budget`` defaults to the program's least budget (``math.inf``: no cap)."""
    if cost_model is None:
        cost_model = AnalyticalCostModel(profile)
    if budget is None:
        budget = simulate_program(program, infos, alignment=alignment).min_budget_bytes
    costs = _StepCosts.of(program, infos, model, cost_model, profile, alignment)
    duplex: frozenset[int] = frozenset()
    seen = {duplex}
    for _ in range(MAX_DUPLEX_ROUNDS):
        replay = _replay(program, costs, profile, budget, duplex)
        overlapping = _overlapping(replay.copies[H2D], replay.copies[D2H])
        if overlapping in seen:
            break
        seen.add(overlapping)
        duplex = overlapping
    trace = replay.trace()
    if not profile.copies_overlap_compute:
        # The copies take the compute's own cores: nothing hides, every copy adds its time.
        copies = trace.h2d_busy_s + trace.d2h_busy_s
        trace = dataclasses.replace(trace, step_time_s=trace.compute_time_s + copies, stall_time_s=copies)
    return trace


@dataclasses.dataclass(frozen=True)
class _StepCosts:
    """What every replay of one program reads, worked out once for all the duplex rounds:
    per block its time (its launch included), per step the arena bytes it takes and gives back."""

    infos: Mapping[str, TensorInfo]
    alignment: int
    block_times: list[float]  # per block: the cost model's time plus profile.block_overhead_s
    takes: list[int]  # per step: a RunBlock's outputs and workspace, a Load's or SwapIn's value
    gives: list[int]  # per step: a RunBlock's frees and workspace, a SwapOut's or Fetch's value
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # aligned arena bytes, as asked for

    def size(self, name: str) -> int:
        found = self.sizes.get(name)
        if found is None:
            found = self.sizes[name] = align_up(self.infos[name].nbytes, self.alignment)
        return found

    @staticmethod
    def of(program: Program, infos, model, cost_model: CostModel, profile: DeviceProfile, alignment: int) -> "_StepCosts":
        # A block also costs its launch (``profile.block_overhead_s``: binding and session call).
        block_times = [cost_model.block_time(model, block, infos) + profile.block_overhead_s for block in program.blocks]
        takes, gives = [0] * len(program.steps), [0] * len(program.steps)
        costs = _StepCosts(infos, alignment, block_times, takes, gives)
        size = costs.size
        for index, step in enumerate(program.steps):
            if isinstance(step, RunBlock):
                workspace = program.blocks[step.block].workspace_bytes
                takes[index] = sum(size(n) for n in step.allocates) + workspace
                gives[index] = workspace + sum(size(n) for n in step.frees)
            elif isinstance(step, (Load, SwapIn, SwapOut, Fetch)):
                takes[index] = gives[index] = size(step.name)
        return costs


def _replay(program, costs: _StepCosts, profile, budget, duplex: frozenset[int]) -> "_Replay":
    """One replay with the copies of the steps in ``duplex`` at the duplex rate (its
    :meth:`_Replay.trace` made only for the last round)."""
    replay = _Replay(program, costs, profile, budget, duplex)
    handlers = {
        Load: replay.load, RunBlock: replay.run_block, SwapOut: replay.swap_out,
        SwapIn: replay.swap_in, Fetch: replay.fetch, Commit: replay.commit,
    }
    for index, step in enumerate(program.steps):
        handler = handlers.get(type(step)) or next((run for kind, run in handlers.items() if isinstance(step, kind)), None)
        if handler is None:
            raise TypeError(f"unknown program step {step!r}")
        replay.index = index
        handler(step)
    return replay


class _Replay:
    """The state of one replay: the arena, the three streams, when each value is ready, last
    used and on the host, and the host's issue cursor; one method per program step kind.
    Events are kept as tuples (stream, label, start, end, bytes) until :meth:`trace`."""

    def __init__(self, program, costs: _StepCosts, profile, budget, duplex: frozenset[int]) -> None:
        self.program, self.costs, self.infos = program, costs, costs.infos
        self.profile, self.budget, self.duplex = profile, budget, duplex
        self.resident = set(program.state_inputs)
        self.arena = _Arena(sum(costs.size(n) for n in self.resident), budget)
        self.streams = {name: _Stream(name) for name in (COMPUTE, H2D, D2H)}
        self.compute, self.h2d, self.d2h = self.streams[COMPUTE], self.streams[H2D], self.streams[D2H]
        self.events: list[tuple[str, str, float, float, int]] = []
        self.copies: dict[str, list[tuple[float, float, int]]] = {H2D: [], D2H: []}  # (start, end, step)
        self.ready_at: dict[str, float] = {}  # device bytes valid (load, swap-in, producing block done)
        self.last_use_end: dict[str, float] = {}  # the last block that read or produced it has finished
        self.on_host_at: dict[str, float] = {}  # the host copy exists (state kept on the host: from 0)
        self.cursor = 0.0  # the host's issue time
        self.stall = 0.0
        self.end_of_all = 0.0
        self.index = 0  # the step being replayed

    def copy(self, stream: _Stream, direction: str, earliest: float, nbytes: int, label: str) -> float:
        start = max(earliest, stream.free_at)
        end = stream.add(start, transfer_time(nbytes, self.profile, direction, concurrent=self.index in self.duplex))
        self.events.append((stream.name, label, start, end, nbytes))
        if end > start:
            self.copies[stream.name].append((start, end, self.index))
        return end

    def settled(self, name: str) -> float:
        return max(self.ready_at.get(name, 0.0), self.last_use_end.get(name, 0.0))

    def load(self, step: Load) -> None:
        self.cursor = self.arena.allocate(self.cursor, self.costs.takes[self.index])
        end = self.copy(self.h2d, "h2d", self.cursor, self.infos[step.name].nbytes, f"load {step.name}")
        self.ready_at[step.name] = self.last_use_end[step.name] = end
        self.resident.add(step.name)

    def run_block(self, step: RunBlock) -> None:
        block = self.program.blocks[step.block]
        inputs, resident, ready_at, compute = block.inputs, self.resident, self.ready_at, self.compute
        earliest = max(self.cursor, compute.free_at)
        for name in inputs:
            if name not in resident:
                raise ValueError(f"block {step.block} reads {name!r}, which the program has not made resident")
            ready = ready_at.get(name, 0.0)
            if ready > earliest:
                earliest = ready
        start = self.arena.allocate(earliest, self.costs.takes[self.index])
        self.stall += start - compute.free_at
        self.cursor = start
        end = compute.add(start, self.costs.block_times[step.block])
        self.events.append((COMPUTE, f"block {step.block}", start, end, 0))
        last_use_end = self.last_use_end
        for name in inputs:
            last_use_end[name] = end
        for name in step.allocates:
            ready_at[name] = last_use_end[name] = end
            resident.add(name)
        self.arena.release(end, self.costs.gives[self.index])
        resident.difference_update(step.frees)

    def swap_out(self, step: SwapOut) -> None:
        if step.name not in self.resident:
            raise ValueError(f"swap-out of {step.name!r}, which is not resident")
        ready = max(self.cursor, self.settled(step.name))
        if step.copy:
            end = self.copy(self.d2h, "d2h", ready, self.infos[step.name].nbytes, f"swap out {step.name}")
            self.on_host_at[step.name] = end
        else:
            end = ready
            self.events.append((DROP, f"drop {step.name}", end, end, 0))
            self.on_host_at.setdefault(step.name, 0.0)
        self.arena.release(end, self.costs.gives[self.index])
        self.resident.discard(step.name)

    def swap_in(self, step: SwapIn) -> None:
        if step.name in self.resident:
            raise ValueError(f"swap-in of {step.name!r}, which is resident already")
        self.cursor = self.arena.allocate(self.cursor, self.costs.takes[self.index])
        earliest = max(self.cursor, self.on_host_at.get(step.name, 0.0))
        end = self.copy(self.h2d, "h2d", earliest, self.infos[step.name].nbytes, f"swap in {step.name}")
        self.ready_at[step.name] = end
        self.resident.add(step.name)

    def fetch(self, step: Fetch) -> None:
        earliest = max(self.cursor, self.settled(step.name))
        end = self.copy(self.d2h, "d2h", earliest, self.infos[step.name].nbytes, f"fetch {step.name}")
        if step.free:
            self.arena.release(end, self.costs.gives[self.index])
            self.resident.discard(step.name)

    def commit(self, step: Commit) -> None:
        for updated, state in step.renames:
            if state in self.resident:
                when = max(self.cursor, self.settled(state))
                self.arena.release(when, self.costs.size(state))
                self.end_of_all = max(self.end_of_all, when)
                self.resident.discard(state)
            if updated in self.resident:
                self.resident.discard(updated)
                self.resident.add(state)

    def trace(self) -> TimeTrace:
        """The trace of the steps replayed so far."""
        steps = self.program.steps
        block_times = self.costs.block_times
        compute_time = math.fsum(block_times[s.block] for s in steps if isinstance(s, RunBlock))
        end_of_all = max([self.end_of_all, self.cursor] + [s.free_at for s in self.streams.values()]
                         + [e[3] for e in self.events])
        self.events.sort(key=lambda e: (e[2], e[3]))
        return TimeTrace(
            step_time_s=end_of_all,
            compute_time_s=compute_time,
            stall_time_s=self.stall,
            d2h_busy_s=self.d2h.busy_s,
            h2d_busy_s=self.h2d.busy_s,
            peak_bytes=int(self.arena.peak),
            events=tuple(Event(*e) for e in self.events),
            budget_bytes=self.budget,
        )


def _overlapping(a: list[tuple[float, float, int]], b: list[tuple[float, float, int]]) -> frozenset[int]:
    """Steps whose copy interval overlaps one of the other list (each list sorted, disjoint)."""
    found = set()
    i = j = 0
    while i < len(a) and j < len(b):
        (s0, e0, k0), (s1, e1, k1) = a[i], b[j]
        if s0 < e1 and s1 < e0:
            found.update((k0, k1))
        if e0 <= e1:
            i += 1
        else:
            j += 1
    return frozenset(found)


def unlimited_time(
    program: Program,
    infos: Mapping[str, TensorInfo],
    *,
    model: onnx.ModelProto,
    cost_model: CostModel | None = None,
    profile: DeviceProfile | None = None,
) -> float:
    """Seconds of the program's blocks run back to back with unlimited memory: compute time
    alone, no copies (the same graph lowered without swaps). Pass the unplanned lowering to
    compare against the largest blocks. With a ``profile``, each block also costs its
    ``block_overhead_s``, as in :func:`simulate_time`."""
    if cost_model is None:
        if profile is None:
            raise ValueError("unlimited_time needs a cost_model or a profile")
        cost_model = AnalyticalCostModel(profile)
    overhead = profile.block_overhead_s if profile is not None else 0.0
    return math.fsum(cost_model.block_time(model, block, infos) + overhead for block in program.blocks)


__all__ = ["COMPUTE", "D2H", "DROP", "Event", "H2D", "STREAMS", "TimeTrace", "simulate_time", "unlimited_time"]
