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
    # A block also costs its launch (``profile.block_overhead_s``: binding and session call).
    block_times = [cost_model.block_time(model, block, infos) + profile.block_overhead_s for block in program.blocks]
    duplex: frozenset[int] = frozenset()
    seen = {duplex}
    for _ in range(MAX_DUPLEX_ROUNDS):
        trace, overlapping = _replay(program, infos, block_times, profile, budget, alignment, duplex)
        if overlapping in seen:
            break
        seen.add(overlapping)
        duplex = overlapping
    if not profile.copies_overlap_compute:
        # The copies take the compute's own cores: nothing hides, every copy adds its time.
        copies = trace.h2d_busy_s + trace.d2h_busy_s
        trace = dataclasses.replace(trace, step_time_s=trace.compute_time_s + copies, stall_time_s=copies)
    return trace


def _replay(program, infos, block_times, profile, budget, alignment, duplex: frozenset[int]):
    """One replay with the copies of the steps in ``duplex`` at the duplex rate; returns the
    trace and the steps whose copies overlap a copy in the other direction."""

    def size(name: str) -> int:
        return align_up(infos[name].nbytes, alignment)

    resident = set(program.state_inputs)
    arena = _Arena(sum(size(n) for n in resident), budget)
    streams = {name: _Stream(name) for name in (COMPUTE, H2D, D2H)}
    compute, h2d, d2h = streams[COMPUTE], streams[H2D], streams[D2H]
    events: list[Event] = []
    copies: dict[str, list[tuple[float, float, int]]] = {H2D: [], D2H: []}  # (start, end, step)
    ready_at: dict[str, float] = {}  # device bytes valid (load, swap-in, producing block done)
    last_use_end: dict[str, float] = {}  # the last block that read or produced it has finished
    on_host_at: dict[str, float] = {}  # the host copy exists (state kept on the host: from 0)
    cursor = 0.0  # the host's issue time
    stall = 0.0
    end_of_all = 0.0

    def copy(stream: _Stream, direction: str, earliest: float, nbytes: int, label: str) -> float:
        start = max(earliest, stream.free_at)
        end = stream.add(start, transfer_time(nbytes, profile, direction, concurrent=index in duplex))
        events.append(Event(stream.name, label, start, end, nbytes))
        if end > start:
            copies[stream.name].append((start, end, index))
        return end

    def settled(name: str) -> float:
        return max(ready_at.get(name, 0.0), last_use_end.get(name, 0.0))

    for index, step in enumerate(program.steps):
        if isinstance(step, Load):
            cursor = arena.allocate(cursor, size(step.name))
            end = copy(h2d, "h2d", cursor, infos[step.name].nbytes, f"load {step.name}")
            ready_at[step.name] = last_use_end[step.name] = end
            resident.add(step.name)
        elif isinstance(step, RunBlock):
            block = program.blocks[step.block]
            missing = [n for n in block.inputs if n not in resident]
            if missing:
                raise ValueError(f"block {step.block} reads {missing[0]!r}, which the program has not made resident")
            earliest = max([cursor, compute.free_at] + [ready_at.get(n, 0.0) for n in block.inputs])
            start = arena.allocate(earliest, sum(size(n) for n in step.allocates) + block.workspace_bytes)
            stall += start - compute.free_at
            cursor = start
            end = compute.add(start, block_times[step.block])
            events.append(Event(COMPUTE, f"block {step.block}", start, end))
            for name in block.inputs:
                last_use_end[name] = end
            for name in step.allocates:
                ready_at[name] = last_use_end[name] = end
                resident.add(name)
            arena.release(end, block.workspace_bytes + sum(size(n) for n in step.frees))
            resident.difference_update(step.frees)
        elif isinstance(step, SwapOut):
            if step.name not in resident:
                raise ValueError(f"swap-out of {step.name!r}, which is not resident")
            ready = max(cursor, settled(step.name))
            if step.copy:
                end = copy(d2h, "d2h", ready, infos[step.name].nbytes, f"swap out {step.name}")
                on_host_at[step.name] = end
            else:
                end = ready
                events.append(Event(DROP, f"drop {step.name}", end, end))
                on_host_at.setdefault(step.name, 0.0)
            arena.release(end, size(step.name))
            resident.discard(step.name)
        elif isinstance(step, SwapIn):
            if step.name in resident:
                raise ValueError(f"swap-in of {step.name!r}, which is resident already")
            cursor = arena.allocate(cursor, size(step.name))
            earliest = max(cursor, on_host_at.get(step.name, 0.0))
            end = copy(h2d, "h2d", earliest, infos[step.name].nbytes, f"swap in {step.name}")
            ready_at[step.name] = end
            resident.add(step.name)
        elif isinstance(step, Fetch):
            end = copy(d2h, "d2h", max(cursor, settled(step.name)), infos[step.name].nbytes, f"fetch {step.name}")
            if step.free:
                arena.release(end, size(step.name))
                resident.discard(step.name)
        elif isinstance(step, Commit):
            for updated, state in step.renames:
                if state in resident:
                    when = max(cursor, settled(state))
                    arena.release(when, size(state))
                    end_of_all = max(end_of_all, when)
                    resident.discard(state)
                if updated in resident:
                    resident.discard(updated)
                    resident.add(state)
        else:
            raise TypeError(f"unknown program step {step!r}")

    compute_time = math.fsum(block_times[s.block] for s in program.steps if isinstance(s, RunBlock))
    end_of_all = max([end_of_all, cursor] + [s.free_at for s in streams.values()] + [e.end_s for e in events])
    events.sort(key=lambda e: (e.start_s, e.end_s))
    trace = TimeTrace(
        step_time_s=end_of_all,
        compute_time_s=compute_time,
        stall_time_s=stall,
        d2h_busy_s=d2h.busy_s,
        h2d_busy_s=h2d.busy_s,
        peak_bytes=int(arena.peak),
        events=tuple(events),
        budget_bytes=budget,
    )
    return trace, _overlapping(copies[H2D], copies[D2H])


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
