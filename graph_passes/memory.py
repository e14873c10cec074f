"""The device-memory accounting shared by analyses and the runtime.

:class:`BestFitAllocator` is the arena's bookkeeping without a buffer: aligned best-fit
placement in one address range, coalescing frees, a high-water mark of the highest address in
use. The runtime's ``DeviceArena`` places real tensors with it; :func:`simulate_program`
replays a lowered program through it, so the analysed ``baseline_peak_bytes`` and the
measured ``peak_device_bytes`` come from the same arithmetic.
"""

from __future__ import annotations

import bisect
import dataclasses

from ort_offload.errors import ArenaStateError

DEFAULT_ALIGNMENT = 64


def align_up(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes ``nbytes`` occupies in the arena (at least one alignment unit)."""
    return max(alignment, (int(nbytes) + alignment - 1) // alignment * alignment)


class OutOfArenaMemory(Exception):
    """No free range is large enough (internal: the runtime turns it into a budget error)."""

    def __init__(self, name: str, nbytes: int, in_use: int, capacity: int | None) -> None:
        super().__init__(f"cannot place {name!r} ({nbytes} bytes): {in_use} of {capacity} bytes in use")
        self.name, self.nbytes, self.in_use, self.capacity = name, nbytes, in_use, capacity


@dataclasses.dataclass(frozen=True)
class Placement:
    offset: int
    nbytes: int  # aligned size


class BestFitAllocator:
    """Aligned best-fit placement in ``[0, capacity)``; ``capacity=None`` means unbounded."""

    def __init__(self, capacity: int | None = None, *, alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self._free: list[tuple[int, int]] = []  # sorted (offset, size) holes below self._top
        self._top = 0  # end of the highest allocation ever extended to (current frontier)
        self._placements: dict[str, Placement] = {}
        self.in_use = 0
        self.high_water = 0  # highest address ever in use
        self.peak_in_use = 0

    def __contains__(self, name: str) -> bool:
        return name in self._placements

    def placement(self, name: str) -> Placement:
        return self._placed(name)

    def _placed(self, name: str) -> Placement:
        """``name``'s placement; a name never placed (or already freed) is an ArenaStateError."""
        try:
            return self._placements[name]
        except KeyError:
            raise ArenaStateError(
                f"the arena holds no tensor {name!r} ({len(self._placements)} placed); "
                "this is a runtime bug: report it with the model and budget"
            ) from None

    def names(self) -> list[str]:
        return list(self._placements)

    def allocate(self, name: str, nbytes: int, *, region: tuple[int, int] | None = None) -> Placement:
        """Place ``name``: best fit among the holes, else at the frontier. With ``region``
        (``[lo, hi)``), a place inside it is preferred (best fit among the holes and the
        frontier space there); only if none fits does the allocation go anywhere."""
        if name in self._placements:
            raise ValueError(f"{name!r} is already allocated")
        size = align_up(nbytes, self.alignment)
        if region is not None:
            offset = self._fit_in(size, *region)
            if offset is not None:
                return self._place(name, offset, size)
        best = None
        for i, (offset, hole) in enumerate(self._free):
            if hole >= size and (best is None or hole < self._free[best][1]):
                best = i
        if best is not None:
            offset, hole = self._free.pop(best)
            if hole > size:
                bisect.insort(self._free, (offset + size, hole - size))
        else:
            # Extend at the frontier, absorbing a trailing hole that touches it.
            offset = self._top
            if self._free and sum(self._free[-1]) == self._top:
                offset = self._free.pop()[0]
            if self.capacity is not None and offset + size > self.capacity:
                if offset != self._top:  # put the trailing hole back
                    bisect.insort(self._free, (offset, self._top - offset))
                raise OutOfArenaMemory(name, size, self.in_use, self.capacity)
            self._top = offset + size
        return self._record(name, offset, size)

    def _record(self, name: str, offset: int, size: int) -> Placement:
        placement = Placement(offset, size)
        self._placements[name] = placement
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.high_water = max(self.high_water, offset + size)
        return placement

    def _fit_in(self, size: int, lo: int, hi: int) -> int | None:
        """The offset of the tightest free span of at least ``size`` bytes inside
        ``[lo, hi)`` (holes, then the space above the frontier), or None."""
        lo = align_up(max(lo, 0), self.alignment)
        if self.capacity is not None:
            hi = min(hi, self.capacity)
        best = None  # (usable span, offset)
        for offset, hole in self._free:
            start, end = max(offset, lo), min(offset + hole, hi)
            if end - start >= size and (best is None or end - start < best[0]):
                best = (end - start, start)
        if best is None:
            start = max(self._top, lo)
            if start + size <= hi:
                best = (hi - start, start)
        return None if best is None else best[1]

    def _place(self, name: str, offset: int, size: int) -> Placement:
        """Take ``[offset, offset + size)``, free space found by :meth:`_fit_in`: inside a
        hole, or at/above the frontier."""
        end = offset + size
        if offset >= self._top:
            if offset > self._top:  # the gap below the tensor becomes (or extends) a hole
                if self._free and sum(self._free[-1]) == self._top:
                    start = self._free.pop()[0]
                else:
                    start = self._top
                self._free.append((start, offset - start))  # above every hole: stays sorted
            self._top = end
        else:  # inside a hole: split it around the tensor
            i = next(k for k, (o, h) in enumerate(self._free) if o <= offset and end <= o + h)
            o, h = self._free.pop(i)
            if offset > o:
                bisect.insort(self._free, (o, offset - o))
            if o + h > end:
                bisect.insort(self._free, (end, o + h - end))
        return self._record(name, offset, size)

    def free(self, name: str) -> None:
        placement = self._placed(name)
        del self._placements[name]
        self.in_use -= placement.nbytes
        start, end = placement.offset, placement.offset + placement.nbytes
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and sum(self._free[i - 1]) == start:  # merge with the hole before
            i -= 1
            start = self._free.pop(i)[0]
        if i < len(self._free) and self._free[i][0] == end:  # and the hole after
            end = sum(self._free.pop(i))
        if end == self._top:
            self._top = start  # the frontier retreats; no hole kept above it
        else:
            self._free.insert(i, (start, end - start))

    def partition(self, name: str, pieces) -> None:
        """``name``'s bytes become consecutive tensors ``pieces`` ((name, bytes) in order; every
        size but the last a multiple of the alignment), each freed on its own later (a split
        view). Nothing moves and no byte is added."""
        placement = self._placed(name)
        sizes = [align_up(nbytes, self.alignment) for _, nbytes in pieces]
        if sum(sizes) != placement.nbytes or any(nbytes % self.alignment for _, nbytes in pieces[:-1]):
            raise ValueError(f"pieces of {sum(sizes)} aligned bytes do not tile {name!r} ({placement.nbytes})")
        del self._placements[name]
        offset = placement.offset
        for (piece, _), size in zip(pieces, sizes):
            if piece in self._placements:
                raise ValueError(f"{piece!r} is already allocated")
            self._placements[piece] = Placement(offset, size)
            offset += size

    def rename(self, old: str, new: str) -> None:
        """The tensor at ``old`` is now known as ``new`` (state that became the next step's input)."""
        if new in self._placements:
            raise ValueError(f"{new!r} is already allocated")
        self._placements[new] = self._placed(old)
        del self._placements[old]

    def high_water_live(self) -> int:
        """End of the highest tensor live now (the frontier: frees at the top retreat it)."""
        return self._top

    def allocate_or_compact(
        self, name: str, nbytes: int, *, region: tuple[int, int] | None = None
    ) -> list[tuple[str, int, int]]:
        """Allocate (preferring ``region``); if only fragmentation is in the way, compact
        first. Returns the moves compaction made (empty if none) for whoever holds the bytes."""
        try:
            self.allocate(name, nbytes, region=region)
            return []
        except OutOfArenaMemory:
            if self.capacity is None or self.in_use + align_up(nbytes, self.alignment) > self.capacity:
                raise
        moves = self.compact()
        self.allocate(name, nbytes)
        return moves

    def limit(self, capacity: int | None) -> list[tuple[str, int, int]]:
        """Cap the range at ``capacity``, compacting if live tensors reach past it; returns the
        moves made. Raises OutOfArenaMemory if the live bytes alone exceed it."""
        moves = []
        if capacity is not None and self._top > capacity:
            if self.in_use > capacity:
                raise OutOfArenaMemory("<limit>", 0, self.in_use, capacity)
            moves = self.compact()
        self.capacity = capacity
        return moves

    def compact(self) -> list[tuple[str, int, int]]:
        """Slide every live tensor down to close all holes; returns (name, old, new) offsets in
        ascending order, which is a safe order to move the bytes in."""
        moves = []
        cursor = 0
        for name, placement in sorted(self._placements.items(), key=lambda item: item[1].offset):
            if placement.offset != cursor:
                moves.append((name, placement.offset, cursor))
                self._placements[name] = Placement(cursor, placement.nbytes)
            cursor += placement.nbytes
        self._free = []
        self._top = cursor
        return moves

    def layout(self) -> tuple[tuple[str, int, int], ...]:
        """Where every live tensor is; with the canonical free list this is the whole state."""
        return tuple(sorted((n, p.offset, p.nbytes) for n, p in self._placements.items()))

    def clone(self) -> "BestFitAllocator":
        other = BestFitAllocator(self.capacity, alignment=self.alignment)
        other._free = list(self._free)
        other._top = self._top
        other._placements = dict(self._placements)
        other.in_use, other.high_water, other.peak_in_use = self.in_use, self.high_water, self.peak_in_use
        return other

    def check_no_overlap(self) -> None:
        """Invariant: no two live tensors share a byte."""
        spans = sorted((p.offset, p.offset + p.nbytes, n) for n, p in self._placements.items())
        for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise AssertionError(f"{n0!r} [{s0}, {e0}) overlaps {n1!r} at {s1}")


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """Device memory at one program step: ``in_use`` arena bytes, ``extent`` (end of the
    highest live tensor: what the arena occupies), and the running block's ``workspace``."""

    label: str
    in_use: int
    workspace: int
    high_water: int
    extent: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryTrace:
    arena_high_water: int  # highest arena address used (fragmentation included)
    peak_in_use: int  # most arena bytes live at once (independent of placement)
    max_workspace: int
    timeline: tuple[MemoryPoint, ...]  # the last simulated step
    peak_device_bytes: int = 0  # max over steps of arena extent + running block's workspace
    min_budget_bytes: int = 0  # max over steps of live arena bytes + running block's workspace
    # (the arena compacts when fragmentation alone blocks an allocation, so placement never
    # raises the requirement above min_budget_bytes)


def simulate_program(
    program,
    infos,
    *,
    steps: int = 2,
    budget: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> MemoryTrace:
    """Replay ``program`` (a :class:`graph_passes.program.Program`) for ``steps`` steps through
    the arena's allocator, the state placed first in input order as the runtime places it.

    Several steps, because updated state lands wherever the allocator puts it and the next
    step starts from that layout. With a ``budget``, the arena is capped as the runtime caps
    it (the budget less the running block's workspace) and compacts when it must.
    """
    allocator = BestFitAllocator(alignment=alignment)
    for name in program.state_inputs:
        allocator.allocate(name, infos[name].nbytes)
    timeline: list[MemoryPoint] = []
    peak = need = 0
    for _ in range(steps):
        timeline = []
        _replay_one_step(allocator, program, infos, timeline, budget)
        peak = max([peak] + [p.extent + p.workspace for p in timeline])
        need = max([need] + [p.in_use + p.workspace for p in timeline])
    return MemoryTrace(
        allocator.high_water, allocator.peak_in_use, program.max_workspace_bytes, tuple(timeline), peak, need
    )


def allocation_units(program, allocates):
    """A block's allocations in order as (name, pieces): a split view's pieces are one
    allocation of the whole value (``pieces`` then names them), everything else alone (())."""
    first = {pieces[0]: (whole, pieces) for whole, pieces in getattr(program, "views", ())}
    units, taken = [], set()
    for name in allocates:
        if name in taken:
            continue
        if name in first and set(first[name][1]) <= set(allocates):
            units.append(first[name])
            taken.update(first[name][1])
        else:
            units.append((name, ()))
    return units


def _replay_one_step(allocator: BestFitAllocator, program, infos, timeline: list[MemoryPoint], budget=None) -> None:
    from graph_passes.program import Commit, Fetch, Load, RunBlock, SwapIn, SwapOut

    def cap(workspace: int) -> None:
        if budget is not None:
            allocator.limit(budget - workspace)

    for step in program.steps:
        if isinstance(step, Load):
            cap(0)
            allocator.allocate_or_compact(step.name, infos[step.name].nbytes)
            timeline.append(MemoryPoint(f"load {step.name}", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
        elif isinstance(step, RunBlock):
            workspace = program.blocks[step.block].workspace_bytes
            cap(workspace)
            for name, pieces in allocation_units(program, step.allocates):
                allocator.allocate_or_compact(name, infos[name].nbytes)
                if pieces:
                    allocator.partition(name, [(p, infos[p].nbytes) for p in pieces])
            timeline.append(MemoryPoint(f"block {step.block}", allocator.in_use, workspace, allocator.high_water, allocator.high_water_live()))
            for name in step.frees:
                allocator.free(name)
        elif isinstance(step, Fetch):
            if step.free:
                allocator.free(step.name)
        elif isinstance(step, SwapOut):
            allocator.free(step.name)
        elif isinstance(step, SwapIn):
            cap(0)
            allocator.allocate_or_compact(step.name, infos[step.name].nbytes)
            timeline.append(MemoryPoint(f"swap in {step.name}", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
        elif isinstance(step, Commit):
            for updated, state in step.renames:
                if state in allocator:
                    allocator.free(state)
                if updated in allocator:  # an update swapped out stays on the host
                    allocator.rename(updated, state)
            timeline.append(MemoryPoint("commit", allocator.in_use, 0, allocator.high_water, allocator.high_water_live()))
