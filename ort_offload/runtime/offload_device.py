"""The device a runtime runs on: its kind, its budget and the runtime knobs every trainer on it
uses. :func:`ort_offload.device.set_offload_device` validates user input and builds one."""

from __future__ import annotations

import dataclasses

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT
from graph_passes.planning.recompute.signatures import RECOMPUTE_POLICIES
from ort_offload.budget import Budget

SUPPORTED_DEVICES = ("cpu", "cuda")
# cudaMalloc's alignment: every tensor starts where a fresh allocation would, so cuBLAS and
# cuDNN choose the same kernels in any block as in the unplanned run.
CUDA_ALIGNMENT = 256


@dataclasses.dataclass(frozen=True)
class OffloadDevice:
    """A device kind plus the budget and runtime knobs every trainer on it uses.

    ``budget=None`` means unlimited. ``max_block_nodes`` fixes how many nodes one execution
    block (one ONNX Runtime session) holds; ``None`` lets the runtime pick the largest blocks
    that fit the budget (whole graph first: fastest; smaller blocks free memory sooner).
    """

    kind: str = "cpu"
    device_id: int = 0  # which GPU, for kind "cuda"
    budget: Budget | None = None
    max_block_nodes: int | None = None
    alignment: int = DEFAULT_ALIGNMENT
    intra_op_threads: int = 0
    # Test mode: skip planned swap-ins so the fault handler must fetch every one of them.
    drop_prefetches: bool = False
    # Device profile swap plans are timed on (graph_passes.cost.device_profiles); None: this device.
    # Naming another device plans for it, e.g. `ort-offload transform --device-profile V100-16GB-PCIe3`.
    planning_profile: str | None = None
    # Where the arena places tensors: "best_fit" or "double_buffer" (ort_offload.runtime.arena).
    arena_policy: str = "best_fit"
    # Swap-outs copy on a background engine and free their bytes when done (True), or copy
    # before the program goes on (False). None: asynchronous except on the CPU device, where
    # the copy thread would take the cores the blocks compute on.
    async_swap_outs: bool | None = None
    # How recompute plans follow the input size (graph_passes.planning.recompute.signatures): "input_aware"
    # (Mimose: a plan per size bucket) or "static" (the first plan serves every size it fits).
    recompute_policy: str = "input_aware"
    # Recompute plans start from each segment's cheap saved values (GELU and layer-norm
    # outputs, copies) before whole segments (graph_passes.planning.recompute.selective); False: whole
    # segments only, as Mimose plans.
    selective_recompute: bool = True
    # CUDA: every block session gives its ORT arena's free memory back to the device after
    # each run (ORT's arena shrinkage), so the device holds the running block's workspace
    # rather than every cached session's high-water mark; each block then pays cudaFree and
    # cudaMalloc for its workspace. None: on under a budget (which holds on the device's
    # counter only so), off when unlimited.
    release_block_workspace: bool | None = None
    # Seconds the genetic swap search (graph_passes.planning.swap.ga) may spend improving the
    # grid's plan where copies overlap compute (GPU profiles); 0: the grid only (the default:
    # the search gains a few points of simulated speed for tens of seconds of planning).
    plan_time: float = 0.0
    plan_seed: int = 0  # the genetic search's random seed
    # A cap on the genetic search's plan evaluations (None: the time limit alone). With a cap
    # and a generous plan_time, the plan found depends on the seed only, not on the machine's speed.
    plan_evaluations: int | None = None
    # Processes the genetic search times its genomes in (None: the usable cores, at most 4;
    # graph_passes.planning.swap.evaluation). The plan for a seed and evaluation count is the same
    # with any number; a time limit buys more evaluations with more.
    plan_workers: int | None = None

    @property
    def swap_outs_are_async(self) -> bool:
        return self.async_swap_outs if self.async_swap_outs is not None else self.kind != "cpu"

    @property
    def name(self) -> str:
        """``cpu`` or ``cuda:N``."""
        return f"cuda:{self.device_id}" if self.kind == "cuda" else self.kind

    def describe(self) -> str:
        return f"{self.name} (budget {self.budget if self.budget is not None else 'unlimited'})"
