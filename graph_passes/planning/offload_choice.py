"""Recompute or swap: which forward segments are cheaper to re-run than to copy out and back.

Where both passes may be used (``passes="recompute,swap"``), a saved activation can leave the
device two ways: recomputed from its segment's checkpoint (costs the segment's forward time
again) or swapped out and back in (costs the copies, unless they hide under compute). Mimose
(§7) argues against swapping because copies of large activations outlast their recomputation;
SwapAdvisor swaps everything. This module prices each segment both ways on a device profile:

- ``recompute_s``: the roofline time of the segment's nodes (an upper bound: the clones re-run
  only the nodes its saved values depend on);
- ``swap_s``: the copy time of its saved bytes, out and back in, at the one-way link rates:
  what swapping costs when nothing hides it.

:func:`recompute_first` gives the segments cheaper to recompute (by a margin, optionally). The
runtime then plans whole candidates (recompute only; swap only; those segments recomputed and the
rest swapped, for margins :data:`RATIOS`) and the simulator, which knows what the copies hide
under, picks the fastest (see
:meth:`ort_offload.runtime.runner.GraphRunner.prepare`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import onnx

from graph_passes.cost.cost_model import CostModel, transfer_time
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.planning.recompute.planner import Segment
from graph_passes.ir.shapes import TensorInfo


# Margins for the mixed candidates: segments cheaper to recompute than to copy, and those ten
# times cheaper (when most copies hide under compute, only nearly free recomputation pays).
RATIOS = (1.0, 0.1)


@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """One segment priced both ways (seconds)."""

    index: int
    saved_bytes: int
    recompute_s: float
    swap_s: float

    @property
    def cheaper(self) -> str:
        return "recompute" if self.recompute_s < self.swap_s else "swap"


def segment_costs(
    segments: Sequence[Segment], model: onnx.ModelProto, infos: Mapping[str, TensorInfo], *,
    cost_model: CostModel, profile: DeviceProfile,
) -> list[SegmentCost]:
    """Recompute and swap time of every segment on ``profile``."""
    nodes = model.graph.node
    out = []
    for segment in segments:
        recompute = sum(cost_model.node_time(nodes[i], infos) for i in segment.nodes)
        swap = (transfer_time(segment.saved_bytes, profile, "d2h")
                + transfer_time(segment.saved_bytes, profile, "h2d"))
        out.append(SegmentCost(segment.index, segment.saved_bytes, recompute, swap))
    return out


def recompute_first(costs: Sequence[SegmentCost], ratio: float = 1.0) -> tuple[int, ...]:
    """Indices of the segments (saving something) whose recomputation costs less than ``ratio``
    times their copies (``ratio=1``: cheaper to recompute; smaller: by that margin, for when
    part of the copies would hide under compute)."""
    return tuple(c.index for c in costs if c.saved_bytes > 0 and c.recompute_s < ratio * c.swap_s)


__all__ = ["RATIOS", "SegmentCost", "recompute_first", "segment_costs"]
