"""Replay of a block-wise runtime's event trace on a device profile: what the same step, with
the same prefetches, faults and write-backs, would take on a GPU whose copy engines run beside
its compute.

The block-wise runtime (``ort_offload.dynamic.runtime``) records each step as events in program
order (duck-typed: ``kind``, ``name``, ``nbytes``, ``needs``, ``part``). :func:`replay` plays
them on one compute stream and one copy stream per direction:

- ``compute``: starts when the previous compute ended and every tensor in ``needs`` has arrived;
  takes the roofline time of the part's nodes (:class:`~graph_passes.cost.cost_model.AnalyticalCostModel`)
  plus the profile's block overhead. Waiting for a copy is stall.
- ``prefetch``: a host→device copy issued at the current program point (when the previous
  compute ended, before the next one starts), queued on the h2d stream; the tensor is ready when
  it ends.
- ``fault``: a host→device copy the program waits for (stall).
- ``writeback``: an eviction's device→host copy the program waits for (the runtime frees the
  bytes only after it), queued on the d2h stream.
- ``gradient``: a gradient copied device→host for the host optimizer, asynchronous on the d2h
  stream (the step ends when the streams drain).
- ``writeback_async``: a pre-eviction's device→host copy, queued on the d2h stream without
  waiting; ``wait_writeback``: the program waits for that copy to end (it needed the bytes).

Simplifications: each direction copies at its one-way rate (no duplex sharing); block inputs
and outputs handed between blocks are not link traffic (on a GPU they stay on the device; on
this CPU they cross from torch tensors only because torch runs the model's Python on the host).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from graph_passes.cost.cost_model import AnalyticalCostModel, transfer_time
from graph_passes.cost.device_profiles import DeviceProfile

__all__ = ["ReplayResult", "compute_time", "replay"]


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """Simulated times (seconds) of one step."""

    step_s: float
    compute_s: float  # the step with unlimited memory: compute alone, no copies
    stall_s: float  # compute-stream time spent waiting for copies
    h2d_bytes: int
    d2h_bytes: int
    # (stream, label, start_s, end_s, nbytes) per compute or copy, the format of
    # graph_passes.cost.simulator's traces (benchmarks/gpu_check.py replays them on a real GPU)
    events: tuple = ()

    @property
    def efficiency(self) -> float:
        """Unlimited-memory time over this step's time (1.0: every copy hidden)."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0


def compute_time(part, profile: DeviceProfile) -> float:
    """Roofline seconds of a part (``part.model``: its ONNX graph, ``part.infos``: static
    shapes of its values) on ``profile``, plus one block overhead."""
    model = AnalyticalCostModel(profile)
    nodes = part.model.graph.node
    return sum(model.node_time(node, part.infos) for node in nodes) + profile.block_overhead_s


def replay(events: Iterable, profile: DeviceProfile) -> ReplayResult:
    """Play one step's ``events`` on ``profile`` (see the module docstring)."""
    durations: dict[int, float] = {}
    now = 0.0  # the program point: when the last compute ended (or the program last waited)
    h2d_free = d2h_free = 0.0
    ready: dict[str, float] = {}
    written: dict[str, float] = {}  # when each asynchronous write-back ends
    compute_s = stall_s = 0.0
    h2d_bytes = d2h_bytes = 0
    timeline: list[list] = []
    for event in events:
        kind = event.kind
        if kind == "compute":
            key = id(event.part)
            if key not in durations:
                durations[key] = compute_time(event.part, profile)
            start = max([now] + [ready.get(name, 0.0) for name in event.needs])
            stall_s += start - now
            compute_s += durations[key]
            now = start + durations[key]
            timeline.append(["compute", event.name, start, now, 0])
        elif kind in ("prefetch", "fault"):
            start = max(now, h2d_free)
            h2d_free = start + transfer_time(event.nbytes, profile, "h2d")
            ready[event.name] = h2d_free
            timeline.append(["h2d", f"{kind} {event.name}", start, h2d_free, event.nbytes])
            h2d_bytes += event.nbytes
            if kind == "fault":
                stall_s += h2d_free - now
                now = h2d_free
        elif kind == "writeback_async":
            start = max(now, d2h_free)
            d2h_free = start + transfer_time(event.nbytes, profile, "d2h")
            written[event.name] = d2h_free
            d2h_bytes += event.nbytes
            timeline.append(["d2h", f"{kind} {event.name}", start, d2h_free, event.nbytes])
        elif kind == "wait_writeback":
            end = max(now, written.get(event.name, 0.0))
            stall_s += end - now
            now = end
        elif kind in ("writeback", "gradient"):
            start = max(now, d2h_free)
            d2h_free = start + transfer_time(event.nbytes, profile, "d2h")
            d2h_bytes += event.nbytes
            timeline.append(["d2h", f"{kind} {event.name}", start, d2h_free, event.nbytes])
            if kind == "writeback":
                stall_s += d2h_free - now
                now = d2h_free
        else:
            raise ValueError(f"unknown trace event kind {kind!r}")
    end = max(now, h2d_free, d2h_free)
    stall_s += end - now
    return ReplayResult(step_s=end, compute_s=compute_s, stall_s=stall_s, h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes,
                        events=tuple(timeline))
