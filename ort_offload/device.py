"""Offload devices: where a trainer's tensors live and under which budget.

``set_offload_device("cpu", budget="64MiB")`` returns an :class:`OffloadDevice`. The CPU device
is a real, budget-capped :class:`~ort_offload.runtime.arena.DeviceArena` plus a
:class:`~ort_offload.runtime.host_store.HostStore`; blocks run on ONNX Runtime's CPU execution provider.
``set_offload_device("cuda", device_id=0)`` (or ``"cuda:1"``) puts the arena in GPU memory and
runs blocks on ONNX Runtime's CUDA execution provider (:mod:`ort_offload.runtime.device_backend`).
"""

from __future__ import annotations

from graph_passes.cost.device_profiles import profile_names
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT
from ort_offload.runtime.arena import ARENA_POLICIES
from ort_offload.budget import Budget, parse_budget
from ort_offload.errors import InvalidArgumentError, UnknownDeviceError
from ort_offload.runtime.offload_device import (
    CUDA_ALIGNMENT,
    RECOMPUTE_POLICIES,
    SUPPORTED_DEVICES,
    OffloadDevice,
)
from ort_offload.validation import check_count

__all__ = ["OffloadDevice", "set_offload_device"]


def set_offload_device(
    kind: str = "cpu",
    *,
    budget: str | int | Budget | None = None,
    device_id: int | None = None,
    max_block_nodes: int | None = None,
    intra_op_threads: int = 0,
    drop_prefetches: bool = False,
    planning_profile: str | None = None,
    arena_policy: str = "best_fit",
    async_swap_outs: bool | None = None,
    recompute_policy: str = "input_aware",
    selective_recompute: bool = True,
    alignment: int | None = None,
    release_block_workspace: bool | None = None,
    plan_time: float | None = None,
    plan_seed: int = 0,
    plan_evaluations: int | None = None,
    plan_workers: int | None = None,
) -> OffloadDevice:
    """The device to train on, capped at ``budget`` (bytes, "64MiB", or "0.5x" of the unplanned peak).

    ``kind`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (``device_id`` picks the GPU too). A CUDA
    device needs onnxruntime-gpu and a GPU; without them this raises UnknownDeviceError."""
    name = str(kind).strip().lower()
    index = 0
    if name.startswith("cuda"):
        from ort_offload.runtime.device_backend import check_cuda, parse_cuda_kind

        index = parse_cuda_kind(name, device_id)
        check_cuda(index)
        name = "cuda"
    elif device_id not in (None, 0):
        raise UnknownDeviceError(f"device_id={device_id} needs a CUDA device: use kind 'cuda'")
    if name not in SUPPORTED_DEVICES:
        raise UnknownDeviceError(f"unknown device {kind!r}: use one of {', '.join(SUPPORTED_DEVICES)}")
    if max_block_nodes is not None:  # None: the runtime picks the largest blocks that fit
        check_count(max_block_nodes, name="max_block_nodes", minimum=1)
    check_count(intra_op_threads, name="intra_op_threads", minimum=0)
    if arena_policy not in ARENA_POLICIES:
        raise InvalidArgumentError(f"unknown arena policy {arena_policy!r}: use one of {', '.join(ARENA_POLICIES)}")
    if recompute_policy not in RECOMPUTE_POLICIES:
        raise InvalidArgumentError(f"unknown recompute policy {recompute_policy!r}: use one of {', '.join(RECOMPUTE_POLICIES)}")
    if planning_profile is not None and planning_profile not in profile_names():
        raise UnknownDeviceError(
            f"unknown device profile {planning_profile!r}: use one of {', '.join(profile_names())}"
        )
    if plan_time is not None and not plan_time >= 0:
        raise InvalidArgumentError(f"plan_time must be a number of seconds >= 0 (0: grid search only), got {plan_time!r}")
    if plan_evaluations is not None:
        check_count(plan_evaluations, name="plan_evaluations", minimum=1)
    if plan_workers is not None:
        check_count(plan_workers, name="plan_workers", minimum=1)
    if name == "cuda" and alignment is None:
        alignment = CUDA_ALIGNMENT
    return OffloadDevice(
        kind=name, device_id=index, alignment=alignment if alignment is not None else DEFAULT_ALIGNMENT,
        budget=parse_budget(budget), max_block_nodes=max_block_nodes, intra_op_threads=intra_op_threads,
        drop_prefetches=drop_prefetches, planning_profile=planning_profile, arena_policy=arena_policy,
        async_swap_outs=async_swap_outs, recompute_policy=recompute_policy,
        selective_recompute=selective_recompute, release_block_workspace=release_block_workspace,
        plan_time=0.0 if plan_time is None else float(plan_time), plan_seed=int(plan_seed),
        plan_evaluations=plan_evaluations, plan_workers=plan_workers,
    )
