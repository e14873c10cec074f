"""The device arena: one real buffer capped at the budget, with best-fit placement, and the
placement policies that steer where each tensor goes.

Tensors live at offsets of a single byte buffer; :class:`graph_passes.memory.BestFitAllocator`
decides where (the same arithmetic the analyses replay). Views of the buffer are handed to
ONNX Runtime through IOBinding, so block inputs are read from and outputs written into the arena
without copies.

Policies (:data:`ARENA_POLICIES`, chosen with ``set_offload_device(arena_policy=...)``):

- ``best_fit``: the tightest hole anywhere.
- ``double_buffer`` (DyNN-Offload §IV-E): the usable range is two equal halves. Tensors for
  execution block ``b`` (its outputs, and the swap-ins and batch loads it is the first to read)
  go into half ``b % 2``: while block ``b`` computes in its half (the work buffer), prefetches
  for block ``b + 1`` land in the other one (the migration buffer), and the two switch roles
  when the block ends. Tensors that outlive their block stay where they are, so a half can be
  full: the allocation then goes anywhere (counted as a fallback). A policy only chooses among
  free places, so what fits under the budget is the same as with best fit.
"""

from __future__ import annotations

import numpy as np

from graph_passes.memory import DEFAULT_ALIGNMENT, BestFitAllocator, OutOfArenaMemory, align_up
from graph_passes.shapes import TensorInfo

__all__ = ["ARENA_POLICIES", "BestFitPolicy", "DeviceArena", "DoubleBufferPolicy", "OutOfArenaMemory", "make_policy"]


class BestFitPolicy:
    """No preference: best fit over the whole arena."""

    name = "best_fit"

    def region(self, block: int | None) -> tuple[int, int] | None:
        return None


class DoubleBufferPolicy:
    """Half ``block % 2`` of ``[0, usable)`` for the tensors of execution block ``block``.

    ``usable`` is the budget less the program's largest block workspace: the arena never
    extends past it, so capping it for a block never forces a compaction."""

    name = "double_buffer"

    def __init__(self, usable: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.half = align_up(max(usable, 0) // 2, alignment)
        self.usable = usable

    def region(self, block: int | None) -> tuple[int, int] | None:
        if block is None or self.half <= 0:
            return None
        return (0, self.half) if block % 2 == 0 else (self.half, self.usable)


ARENA_POLICIES = (BestFitPolicy.name, DoubleBufferPolicy.name)


def make_policy(name: str, *, usable: int | None, alignment: int = DEFAULT_ALIGNMENT):
    """The policy called ``name`` for an arena whose usable range is ``usable`` bytes (None: no
    budget, where halves mean nothing and best fit is used)."""
    if name not in ARENA_POLICIES:
        raise ValueError(f"unknown arena policy {name!r}: use one of {', '.join(ARENA_POLICIES)}")
    if name == DoubleBufferPolicy.name and usable is not None:
        return DoubleBufferPolicy(usable, alignment)
    return BestFitPolicy()


class DeviceArena:
    """A budget-capped byte buffer holding named tensors."""

    def __init__(self, capacity: int, *, alignment: int = DEFAULT_ALIGNMENT, growable: bool = False) -> None:
        self.alignment = alignment
        self.growable = growable
        self.before_move = None  # called before bytes move (compaction, growth): copies must finish first
        self.allocator = BestFitAllocator(capacity, alignment=alignment)
        self._raw = np.empty(0, dtype=np.uint8)
        self.buffer = self._raw
        self._infos: dict[str, TensorInfo] = {}
        self.compactions = 0
        self._reserve(capacity)

    # ---- capacity ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def set_capacity(self, capacity: int) -> None:
        """Change the cap (a new program reserves a different workspace); grows the buffer,
        keeping every tensor at its offset."""
        if capacity < self.allocator.high_water_live():
            raise OutOfArenaMemory("<resize>", capacity, self.allocator.in_use, capacity)
        if capacity > self.buffer.size:
            self._reserve(capacity)
        if self.growable:
            capacity = self.buffer.size  # never cap a growable arena below what it already has
        self.allocator.capacity = capacity

    def limit(self, capacity: int) -> None:
        """Cap the arena at ``capacity`` bytes from now on (the budget less the workspace of
        the block about to run), compacting if live tensors reach past it. A growable arena
        has no cap."""
        if self.growable:
            return
        if capacity > self.buffer.size:
            self._reserve(capacity)
        self._move(self.allocator.limit(capacity))

    def _reserve(self, capacity: int) -> None:
        # Over-allocate by one alignment unit so offset 0 is aligned; np.empty does not touch
        # the pages, so an unused budget costs address space, not RAM.
        if self.before_move is not None and self.allocator.in_use:
            self.before_move()  # the buffer is about to be replaced: no copy may be writing into it
        raw = np.empty(capacity + self.alignment, dtype=np.uint8)
        shift = (-raw.ctypes.data) % self.alignment
        buffer = raw[shift : shift + capacity]
        live_end = self.allocator.high_water_live()
        if live_end:
            buffer[:live_end] = self.buffer[:live_end]
        self._raw, self.buffer = raw, buffer

    # ---- tensors -------------------------------------------------------------------------

    def allocate(self, name: str, info: TensorInfo, *, region: tuple[int, int] | None = None) -> None:
        """Place ``name`` (inside ``region`` if a free span there fits, else anywhere)."""
        if self.growable:
            try:
                self.allocator.allocate(name, info.nbytes)
            except OutOfArenaMemory:
                # Grow geometrically from the buffer (not the cap) so drift costs few copies.
                size = align_up(info.nbytes, self.alignment)
                self.set_capacity(max(self.buffer.size + self.buffer.size // 4, self.allocator.high_water_live() + size))
                self.allocator.allocate(name, info.nbytes)
        else:
            self._move(self.allocator.allocate_or_compact(name, info.nbytes, region=region))
        self._infos[name] = info

    def allocate_view(self, name: str, info: TensorInfo, pieces, *, region: tuple[int, int] | None = None) -> None:
        """Place ``name`` and divide it into ``pieces`` ((name, TensorInfo) in order, back to
        back): a split view, written whole, read and freed piece by piece."""
        self.allocate(name, info, region=region)
        self.allocator.partition(name, [(piece, piece_info.nbytes) for piece, piece_info in pieces])
        del self._infos[name]
        self._infos.update(pieces)

    def compact(self) -> None:
        """Close the holes by moving tensors down. Pointers change; block sessions rebind on
        the next run."""
        self._move(self.allocator.compact())

    def _move(self, moves) -> None:
        """Apply compaction moves (ascending, so no move clobbers a tensor not yet moved)."""
        if moves and self.before_move is not None:
            self.before_move()
        for name, old, new in moves:
            nbytes = self.allocator.placement(name).nbytes
            self.buffer[new : new + nbytes] = self.buffer[old : old + nbytes]
        if moves:
            self.compactions += 1

    def free(self, name: str) -> None:
        self.allocator.free(name)
        del self._infos[name]

    def rename(self, old: str, new: str) -> None:
        self.allocator.rename(old, new)
        self._infos[new] = self._infos.pop(old)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def view(self, name: str) -> np.ndarray:
        """The tensor as a numpy array over arena memory (no copy)."""
        info = self._infos[name]
        offset = self.allocator.placement(name).offset
        flat = self.buffer[offset : offset + info.nbytes].view(info.dtype)
        return flat.reshape(info.shape)

    def pointer(self, name: str) -> int:
        return self.buffer.ctypes.data + self.allocator.placement(name).offset

    def store(self, name: str, array: np.ndarray) -> None:
        """Allocate ``name`` and copy ``array`` into it."""
        self.allocate(name, TensorInfo(np.dtype(array.dtype), tuple(array.shape)))
        self.view(name)[...] = array

    @property
    def in_use(self) -> int:
        return self.allocator.in_use

    @property
    def high_water(self) -> int:
        return self.allocator.high_water

    def reset_high_water(self) -> None:
        self.allocator.high_water = self.allocator.high_water_live()
