"""The best-fit allocator shared by the runtime's arena and the analyses.

:class:`BestFitAllocator` is the arena's bookkeeping without a buffer: aligned best-fit
placement in one address range, coalescing frees, a high-water mark of the highest address in
use. The runtime's ``DeviceArena`` places real tensors with it and
:func:`graph_passes.ir.memory.simulate_program` replays programs through it, so the analysed and
the measured peaks come from the same arithmetic.
"""

from __future__ import annotations

import bisect
import typing

from graph_passes.errors import ArenaStateError

DEFAULT_ALIGNMENT = 64


def align_up(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes ``nbytes`` occupies in the arena (at least one alignment unit)."""
    return max(alignment, (int(nbytes) + alignment - 1) // alignment * alignment)


class OutOfArenaMemory(Exception):
    """No free range is large enough (internal: the runtime turns it into a budget error)."""

    def __init__(self, name: str, nbytes: int, in_use: int, capacity: int | None) -> None:
        super().__init__(f"cannot place {name!r} ({nbytes} bytes): {in_use} of {capacity} bytes in use")
        self.name, self.nbytes, self.in_use, self.capacity = name, nbytes, in_use, capacity


class Placement(typing.NamedTuple):
    """Where a tensor is (immutable; a named tuple: a step makes a hundred of them)."""

    offset: int
    nbytes: int  # aligned size


_new_tuple = tuple.__new__


class BestFitAllocator:
    """Aligned best-fit placement in ``[0, capacity)``; ``capacity=None`` means unbounded."""

    def __init__(self, capacity: int | None = None, *, alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.capacity = capacity
        self.alignment = alignment
        # The holes below self._top, sorted by offset: their offsets and sizes (two lists, so
        # that best fit searches the sizes in C: the runtime allocates hundreds of tensors a step).
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._top = 0  # end of the highest allocation ever extended to (current frontier)
        self._placements: dict[str, Placement] = {}
        # The three structures above are another allocator's too (restore): copied before a change.
        self._shared = False
        self.in_use = 0
        self.high_water = 0  # highest address ever in use
        self.peak_in_use = 0

    def __contains__(self, name: str) -> bool:
        return name in self._placements

    @property
    def _free(self) -> list[tuple[int, int]]:
        """The holes as sorted (offset, size) pairs."""
        return list(zip(self._starts, self._sizes))

    def _own(self) -> None:
        """Copy the holes and placements :meth:`restore` took from another allocator, before
        this one changes them."""
        self._starts, self._sizes, self._placements = list(self._starts), list(self._sizes), dict(self._placements)
        self._shared = False

    def _add_hole(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)

    def _pop_hole(self, i: int) -> tuple[int, int]:
        return self._starts.pop(i), self._sizes.pop(i)

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

    def addresses(self, names, base: int) -> tuple[int, ...]:
        """``base`` + the offset of each of ``names`` (the pointers a block binds)."""
        placements = self._placements
        try:
            return tuple([base + placements[name][0] for name in names])
        except KeyError:
            missing = next(n for n in names if n not in placements)
            self._placed(missing)  # raises, naming it
            raise

    def allocate(self, name: str, nbytes: int, *, region: tuple[int, int] | None = None) -> Placement:
        """Place ``name``: best fit among the holes, else at the frontier. With ``region``
        (``[lo, hi)``), a place inside it is preferred (best fit among the holes and the
        frontier space there); only if none fits does the allocation go anywhere."""
        if name in self._placements:
            raise ValueError(f"{name!r} is already allocated")
        if self._shared:
            self._own()
        alignment = self.alignment
        size = max(alignment, (int(nbytes) + alignment - 1) // alignment * alignment)  # align_up, inlined
        if region is not None:
            offset = self._fit_in(size, *region)
            if offset is not None:
                return self._place(name, offset, size)
        starts, sizes = self._starts, self._sizes
        # Best fit: the smallest hole that fits (holes are never empty), the lowest offset
        # among equal ones (list.index finds the first).
        best_hole = min(filter(size.__le__, sizes), default=0)
        if best_hole:
            best = sizes.index(best_hole)
            offset = starts.pop(best)
            del sizes[best]
            if best_hole > size:
                self._add_hole(offset + size, best_hole - size)
        else:
            # Extend at the frontier, absorbing a trailing hole that touches it.
            top = offset = self._top
            if starts and starts[-1] + sizes[-1] == top:
                offset = starts.pop()
                sizes.pop()
            if self.capacity is not None and offset + size > self.capacity:
                if offset != top:  # put the trailing hole back
                    self._add_hole(offset, top - offset)
                raise OutOfArenaMemory(name, size, self.in_use, self.capacity)
            self._top = offset + size
        return self._record(name, offset, size)

    def _record(self, name: str, offset: int, size: int) -> Placement:
        placement = _new_tuple(Placement, (offset, size))  # Placement(offset, size), without its Python __new__
        self._placements[name] = placement
        self.in_use += size
        if self.in_use > self.peak_in_use:
            self.peak_in_use = self.in_use
        if offset + size > self.high_water:
            self.high_water = offset + size
        return placement

    def _fit_in(self, size: int, lo: int, hi: int) -> int | None:
        """The offset of the tightest free span of at least ``size`` bytes inside
        ``[lo, hi)`` (holes, then the space above the frontier), or None."""
        lo = align_up(max(lo, 0), self.alignment)
        if self.capacity is not None:
            hi = min(hi, self.capacity)
        best = None  # (usable span, offset)
        for offset, hole in zip(self._starts, self._sizes):
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
                if self._starts and self._starts[-1] + self._sizes[-1] == self._top:
                    start = self._pop_hole(-1)[0]
                else:
                    start = self._top
                self._add_hole(start, offset - start)  # above every hole: stays sorted
            self._top = end
        else:  # inside a hole: split it around the tensor
            i = next(k for k, (o, h) in enumerate(self._free) if o <= offset and end <= o + h)
            o, h = self._pop_hole(i)
            if offset > o:
                self._add_hole(o, offset - o)
            if o + h > end:
                self._add_hole(end, o + h - end)
        return self._record(name, offset, size)

    def place_at(self, name: str, nbytes: int, offset: int) -> Placement:
        """Place ``name`` at ``offset`` (aligned), which must be free: inside a hole, at or above
        the frontier, or a trailing hole and the space above it. Raises ValueError if it is not."""
        if name in self._placements:
            raise ValueError(f"{name!r} is already allocated")
        if self._shared:
            self._own()
        size = align_up(nbytes, self.alignment)
        end = offset + size
        if offset % self.alignment or offset < 0 or (self.capacity is not None and end > self.capacity):
            raise ValueError(f"{name!r}: offset {offset} is not an aligned place inside the arena")
        if offset >= self._top:
            return self._place(name, offset, size)
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0 or starts[i] + sizes[i] < min(end, self._top) or (end > self._top and starts[i] + sizes[i] != self._top):
            raise ValueError(f"{name!r}: [{offset}, {end}) is not free")
        hole, hole_size = self._pop_hole(i)
        if offset > hole:
            self._add_hole(hole, offset - hole)
        if hole + hole_size > end:
            self._add_hole(end, hole + hole_size - end)
        self._top = max(self._top, end)
        return self._record(name, offset, size)

    def fit_avoiding(self, nbytes: int, avoid) -> int:
        """The offset best fit would choose for ``nbytes`` if the spans of ``avoid`` ((offset,
        bytes) pairs) were taken too: the smallest free fragment that fits (lowest offset among
        equal ones), else the frontier, moved above any span it would overlap."""
        size = align_up(nbytes, self.alignment)
        spans = sorted((offset, offset + span) for offset, span in avoid)
        best = None  # (fragment size, offset)
        for hole, hole_size in zip(self._starts, self._sizes):
            cursor, hole_end = hole, hole + hole_size
            for lo, hi in spans + [(hole_end, hole_end)]:
                if hi <= cursor or lo > hole_end:
                    continue
                piece = min(lo, hole_end) - cursor
                if piece >= size and (best is None or piece < best[0]):
                    best = (piece, cursor)
                cursor = max(cursor, hi)
                if cursor >= hole_end:
                    break
        if best is not None:
            return best[1]
        offset = self._top
        if self._starts and self._starts[-1] + self._sizes[-1] == offset:
            offset = self._starts[-1]
        moved = True
        while moved:
            moved = False
            for lo, hi in spans:
                if lo < offset + size and offset < hi:
                    offset, moved = hi, True
        return offset

    def restore(self, other: "BestFitAllocator") -> None:
        """Take ``other``'s placements, holes and frontier (not its capacity); the high-water
        marks keep the larger of both (``other`` is a replay of this allocator's next step).
        They are shared, not copied: whichever of the two changes them first copies them then
        (a placed step's end state is taken every other step and seldom changed; a copy of its
        hundred placements would touch every one of them, out of cache after the step's kernels)."""
        self._starts, self._sizes, self._placements = other._starts, other._sizes, other._placements
        self._shared = other._shared = True
        self._top = other._top
        self.in_use = other.in_use
        self.high_water = max(self.high_water, other.high_water)
        self.peak_in_use = max(self.peak_in_use, other.peak_in_use)

    def free(self, name: str) -> None:
        if self._shared:
            self._own()
        placement = self._placements.pop(name, None)
        if placement is None:
            self._placed(name)  # raises, naming it
        start, nbytes = placement
        self.in_use -= nbytes
        end = start + nbytes
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_left(starts, start)
        if i > 0 and starts[i - 1] + sizes[i - 1] == start:  # merge with the hole before
            i -= 1
            start = starts.pop(i)
            del sizes[i]
        if i < len(starts) and starts[i] == end:  # and the hole after
            del starts[i]
            end += sizes.pop(i)
        if end == self._top:
            self._top = start  # the frontier retreats; no hole kept above it
        else:
            starts.insert(i, start)
            sizes.insert(i, end - start)

    def partition(self, name: str, pieces) -> None:
        """``name``'s bytes become consecutive tensors ``pieces`` ((name, bytes) in order; every
        size but the last a multiple of the alignment), each freed on its own later (a split
        view). Nothing moves and no byte is added."""
        if self._shared:
            self._own()
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
        if self._shared:
            self._own()
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
        if self._shared:
            self._own()
        moves = []
        cursor = 0
        for name, placement in sorted(self._placements.items(), key=lambda item: item[1].offset):
            if placement.offset != cursor:
                moves.append((name, placement.offset, cursor))
                self._placements[name] = Placement(cursor, placement.nbytes)
            cursor += placement.nbytes
        self._starts, self._sizes = [], []
        self._top = cursor
        return moves

    def layout(self) -> tuple[tuple[str, int, int], ...]:
        """Where every live tensor is; with the canonical free list this is the whole state."""
        return tuple(sorted((n, p.offset, p.nbytes) for n, p in self._placements.items()))

    def clone(self) -> "BestFitAllocator":
        other = BestFitAllocator(self.capacity, alignment=self.alignment)
        other._starts, other._sizes = list(self._starts), list(self._sizes)
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
