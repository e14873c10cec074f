"""Where the block runtime's tensors live, and how they move: the budget-capped device arena,
the host store, the two copy engines, and eviction by Belady's rule.

:class:`Residency` places tensors in the arena (evicting the one used furthest in the future
until a placement fits), copies them in from the host (torch parameters or host-store arrays),
writes saved activations back (at once, or asynchronously ahead of need: DeepUM's
pre-eviction) and keeps the peak the budget is checked against. When a tensor is next used is
the caller's knowledge (the predicted path and the step's position), given as ``next_use``; so
is the trace each move is recorded in. Arena names follow the block runtime's scheme:
``b<block>/<value>`` a block parameter (dropped on eviction: its host copy is current),
``i<invocation>/<value>`` an invocation's tensor (written back on eviction if used again),
``resident/...`` charged for the whole step (never evicted).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch

from graph_passes.ir.allocator import OutOfArenaMemory
from graph_passes.ir.shapes import TensorInfo
from ort_offload.errors import BudgetTooSmallError
from ort_offload.runtime.arena import DeviceArena, make_policy
from ort_offload.runtime.copy_engine import CopyEngine
from ort_offload.runtime.host_store import HostStore


@dataclasses.dataclass
class RuntimeStats:
    """Counters of one block runtime, over every step so far."""

    steps: int = 0
    invocations: int = 0
    faults: int = 0
    fault_bytes: int = 0
    prefetch_hits: int = 0
    prefetches: int = 0
    prefetch_bytes: int = 0
    swap_out_bytes: int = 0  # saved activations written back, gradients handed to the host
    swap_in_bytes: int = 0  # parameters and saved activations fetched (prefetch or fault)
    load_bytes: int = 0  # block inputs and incoming gradients copied in from torch
    stall_time_s: float = 0.0  # waiting for prefetches in flight and for faults
    evictions: int = 0
    mispredictions: int = 0  # batches whose true path differed from the prediction
    misprediction_cache_hits: int = 0
    exact_paths: int = 0  # batches whose predicted path was exactly the true one
    predicted_blocks_correct: int = 0  # per-position matches of predicted and true path
    true_blocks: int = 0  # invocations that ran (denominator of the per-block accuracy)
    inference_us: list = dataclasses.field(default_factory=list)
    mapping_us: list = dataclasses.field(default_factory=list)
    fault_log: list = dataclasses.field(default_factory=list)  # (step, phase, execution block, tensor)


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One event of a step, in program order, for replay on a device profile
    (:mod:`graph_passes.cost.trace_replay`): ``compute`` (a part ran; ``needs``: the parameters and
    saved tensors it read), ``prefetch`` (a copy in issued ahead), ``fault`` (a synchronous copy
    in), ``writeback`` (an eviction copied a saved activation out), ``gradient`` (a gradient
    handed to the host)."""

    kind: str
    name: str
    nbytes: int
    needs: tuple[str, ...] = ()
    part: Any = None


class Residency:
    """The arena, host store and copy engines of one block runtime under ``budget_bytes`` (None:
    a growable arena). ``next_use(name)``: when a tensor is next needed (infinity: not this
    step); ``record``: where trace events go; ``keep_all``: never evict (the no-offload
    baseline)."""

    def __init__(self, *, budget_bytes: int | None, arena_policy: str, alignment: int, stats: RuntimeStats,
                 next_use: Callable[[str], float], record: Callable[[TraceEvent], None], keep_all: bool) -> None:
        self.budget = budget_bytes
        self.stats = stats
        self.next_use = next_use
        self.record = record
        self.keep_all = keep_all
        self.arena = DeviceArena(budget_bytes if budget_bytes is not None else 1 << 20, alignment=alignment,
                                 growable=budget_bytes is None)
        self.policy = make_policy(arena_policy, usable=budget_bytes, alignment=alignment)
        self.h2d = CopyEngine("h2d")
        self.d2h = CopyEngine("d2h")
        self.arena.before_move = self.settle_copies  # no copy may touch the buffer while bytes move
        self.writing: dict[str, np.ndarray] = {}  # asynchronous write-backs in flight: name -> host buffer
        self.host = HostStore()  # written-back saved activations
        self.prefetched: set[str] = set()  # arena names a prefetch brought in this step
        self.peak = 0

    # ---- placement -----------------------------------------------------------------------------

    def measure(self, workspace: int) -> None:
        self.peak = max(self.peak, self.arena.allocator.high_water_live() + workspace)

    def allocate(self, name: str, info: TensorInfo, *, protect: set[str], what: str,
                 region: tuple[int, int] | None = None, evict_after: float | None = None,
                 required: bool = True) -> bool:
        """Place ``name``, evicting by Belady's rule until it fits. ``evict_after``: evict only
        tensors next used after that time (a prefetch never displaces something needed sooner).
        Returns False (``required=False``) or raises :class:`BudgetTooSmallError` when nothing
        more can be evicted."""
        self.reap()
        while True:
            try:
                self.arena.allocate(name, info, region=region)
                self.measure(0)
                return True
            except OutOfArenaMemory:
                if self.writing and (evict_after is None or required):
                    self.wait_oldest_writeback()
                    continue
                if self.evict_one(protect, after=evict_after):
                    continue
                if not required:
                    return False
                needed = self.arena.in_use + info.nbytes
                raise BudgetTooSmallError(
                    f"{what} needs {info.nbytes} more bytes with {self.arena.in_use} in use and nothing left to evict "
                    f"(budget {self.budget}); raise the budget to at least {needed}",
                    needed_bytes=needed, budget_bytes=self.budget or 0,
                ) from None

    def cap(self, workspace_bytes: int, protect: set[str]) -> None:
        """Cap the arena at the budget less a part's workspace before its tensors are placed,
        evicting what no longer fits (``protect``: what must stay)."""
        if self.budget is None:
            return
        while True:
            try:
                self.arena.limit(self.budget - workspace_bytes)
                return
            except OutOfArenaMemory:
                if self.writing:
                    self.wait_oldest_writeback()
                    continue
                if not self.evict_one(protect):
                    raise BudgetTooSmallError(
                        f"nothing left to evict below {self.budget - workspace_bytes} bytes; raise the budget",
                        needed_bytes=self.arena.in_use + workspace_bytes, budget_bytes=self.budget) from None

    # ---- copies in -----------------------------------------------------------------------------

    def source_info(self, source) -> TensorInfo:
        """Dtype and shape of a source: a torch tensor or a host-store name."""
        if isinstance(source, torch.Tensor):
            return TensorInfo(np.dtype(str(source.dtype).removeprefix("torch.")), tuple(source.shape))
        array = self.host.get(source)
        return TensorInfo(array.dtype, tuple(array.shape))

    def copy_in(self, name: str, source) -> None:
        """Copy host → arena on the copy engine (``source``: a torch tensor or a host-store name)."""
        target = self.arena.view(name)
        array = source.detach().numpy() if isinstance(source, torch.Tensor) else self.host.get(source)
        self.stats.swap_in_bytes += array.nbytes

        def copy() -> None:
            np.copyto(target, array)

        self.h2d.submit(name, copy)

    def load(self, name: str, tensor: torch.Tensor, protect: set[str]) -> None:
        """Copy a torch tensor (a block argument, an incoming gradient) into the arena now."""
        array = tensor.detach().contiguous().numpy()
        self.allocate(name, TensorInfo(array.dtype, tuple(array.shape)), protect=protect, what="a block input")
        self.arena.view(name)[...] = array
        self.stats.load_bytes += array.nbytes
        protect.add(name)

    # ---- eviction and write-back ---------------------------------------------------------------

    def evict_one(self, protect: set[str], *, after: float | None = None) -> bool:
        """Evict the unprotected tensor used furthest in the future (parameters dropped,
        saved activations written back). False if there is none (or none past ``after``)."""
        candidates = [n for n in self.arena.names()
                      if not n.startswith("resident/") and n not in protect and n not in self.writing]
        if not candidates or self.keep_all:
            return False
        scored = sorted(((self.next_use(n), n.startswith("b"), n) for n in candidates), reverse=True)
        use, _, victim = scored[0]
        if after is not None and use <= after:
            return False
        if self.h2d.in_flight(victim):
            self.h2d.wait(victim)
        if victim.startswith("i") and use != float("inf"):
            array = self.arena.view(victim).copy()
            self.host.adopt(victim, array)
            self.record(TraceEvent("writeback", victim, array.nbytes))
            self.stats.swap_out_bytes += array.nbytes
        self.prefetched.discard(victim)
        self.arena.free(victim)
        self.stats.evictions += 1
        return True

    def write_back_until_free(self, wanted: int) -> None:
        """Start writing back saved activations (furthest next use first) until what is free,
        counting write-backs in flight, covers ``wanted`` bytes."""
        pending = sum(self.arena.info(n).nbytes for n in self.writing)
        free = self.budget - self.arena.in_use + pending
        if free >= wanted:
            return
        candidates = sorted(((self.next_use(n), n) for n in self.arena.names()
                             if n.startswith("i") and n not in self.writing), reverse=True)
        for _, name in candidates:
            if free >= wanted:
                break
            source = self.arena.view(name)
            buffer = np.empty_like(source)

            def copy(source=source, buffer=buffer) -> None:
                np.copyto(buffer, source)

            self.d2h.submit(name, copy)
            self.writing[name] = buffer
            self.record(TraceEvent("writeback_async", name, buffer.nbytes))
            self.stats.swap_out_bytes += buffer.nbytes
            self.stats.evictions += 1
            free += buffer.nbytes

    def wait_writeback(self, name: str) -> None:
        """A tensor being written back is needed again: wait, and keep the arena copy after all."""
        started = time.perf_counter()
        self.d2h.wait(name)
        self.stats.stall_time_s += time.perf_counter() - started
        self.record(TraceEvent("wait_writeback", name, 0))
        del self.writing[name]

    def reap(self) -> None:
        """Free the arena bytes of write-backs that have finished (their host copy is complete)."""
        for name in [n for n in self.writing if self.d2h.done(n)]:
            self.d2h.wait(name)
            self.host.adopt(name, self.writing.pop(name))
            self.arena.free(name)

    def wait_oldest_writeback(self) -> None:
        name = next(iter(self.writing))
        started = time.perf_counter()
        self.d2h.wait(name)
        self.stats.stall_time_s += time.perf_counter() - started
        self.record(TraceEvent("wait_writeback", name, 0))
        self.host.adopt(name, self.writing.pop(name))
        self.arena.free(name)

    # ---- step boundaries -----------------------------------------------------------------------

    def settle_copies(self) -> None:
        self.h2d.settle()
        self.d2h.settle()

    def finish_step(self) -> None:
        """Wait for every copy, then drop all but the step-long charges: parameters' host
        copies are about to change, and saved activations are spent."""
        self.h2d.drain()
        self.d2h.drain()
        self.reap()
        for name in list(self.arena.names()):
            if not name.startswith("resident/"):
                self.arena.free(name)
        self.host.clear()
        self.prefetched.clear()

    def close(self) -> None:
        self.d2h.close()
        self.h2d.close()
