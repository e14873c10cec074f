"""The device arena: one real buffer capped at the budget, with best-fit placement, and the
placement policies that steer where each tensor goes.

Tensors live at offsets of a single byte buffer; :class:`graph_passes.ir.memory.BestFitAllocator`
decides where (the same arithmetic the analyses replay). Pointers into the buffer are handed to
ONNX Runtime through IOBinding, so block inputs are read from and outputs written into the arena
without copies. The buffer's memory (host RAM, or GPU memory) is a backend's
(:mod:`ort_offload.runtime.device_memory`).

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

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, BestFitAllocator, OutOfArenaMemory, align_up
from graph_passes.ir.shapes import TensorInfo
from ort_offload.runtime.device_memory import DeviceMemory, FiniteCheck, NumpyMemory

# Arena states remembered by state_token (each a tuple of every placement).
MAX_STATE_TOKENS = 64

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
    """A budget-capped buffer holding named tensors, in the memory of ``memory``
    (:mod:`ort_offload.runtime.device_memory`: host RAM for the CPU device, a torch allocation for
    CUDA).

    Host memory is reserved at the cap up front (its pages are touched only when used). Device
    memory is reserved as far as the tensors reach (at least ``reserve`` bytes, the planned
    extent), so what the device counter sees is what the plan placed, not the whole budget.
    """

    def __init__(self, capacity: int, *, alignment: int = DEFAULT_ALIGNMENT, growable: bool = False,
                 memory: DeviceMemory | None = None) -> None:
        self.alignment = alignment
        self.growable = growable
        self.memory = memory if memory is not None else NumpyMemory()
        self.eager = getattr(self.memory, "is_host", True)
        self.before_move = None  # called before bytes move (compaction, growth): copies must finish first
        self.allocator = BestFitAllocator(capacity, alignment=alignment)
        self.buffer = self.memory.allocate(0, alignment)
        self._base = self.memory.pointer(self.buffer, 0)  # the buffer's address (pointer() adds offsets)
        self._infos: dict[str, TensorInfo] = {}
        self._infos_shared = False  # _infos is a placed step's too (adopt): copied before a change
        # The object standing for the placements now (state_token), None until asked for or
        # after they change; equal placements get the same object (the placed steps' keys).
        self._token: object | None = None
        self._tokens: dict[tuple, object] = {}
        self._finite_views: dict[tuple, tuple] = {}  # all_finite's, per list of names and state token
        self.compactions = 0
        self.regrowths = 0
        self._reserve(capacity if self.eager else 0)

    # ---- capacity ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def reserved_bytes(self) -> int:
        """Bytes the buffer holds now (device memory taken, on CUDA)."""
        return self.memory.size(self.buffer)

    def set_capacity(self, capacity: int) -> None:
        """Change the cap (a new program reserves a different workspace); grows a host buffer,
        keeping every tensor at its offset."""
        if capacity < self.allocator.high_water_live():
            raise OutOfArenaMemory("<resize>", capacity, self.allocator.in_use, capacity)
        if self.eager and capacity > self.reserved_bytes:
            self._reserve(capacity)
        if self.growable and self.eager:
            capacity = self.reserved_bytes  # never cap a growable arena below what it already has
        self.allocator.capacity = capacity

    def reserve(self, nbytes: int) -> None:
        """Back at least ``nbytes`` (at most the cap) with memory now, so the tensors of a
        planned extent do not grow the buffer step by step."""
        cap = self.allocator.capacity
        nbytes = nbytes if cap is None else min(nbytes, cap)
        if nbytes > self.reserved_bytes:
            self._reserve(nbytes)

    def limit(self, capacity: int) -> None:
        """Cap the arena at ``capacity`` bytes from now on (the budget less the workspace of
        the block about to run), compacting if live tensors reach past it. A growable arena
        has no cap."""
        if self.growable:
            return
        if self.eager and capacity > self.reserved_bytes:
            self._reserve(capacity)
        self._move(self.allocator.limit(capacity))

    def _reserve(self, capacity: int) -> None:
        if self.before_move is not None and self.allocator.in_use:
            self.before_move()  # the buffer is about to be replaced: no copy may be writing into it
        buffer = self.memory.allocate(capacity, self.alignment)
        live_end = min(self.allocator.high_water_live(), self.reserved_bytes)  # a new tensor has no bytes yet
        if live_end:
            self.memory.copy_prefix(self.buffer, buffer, live_end)
            self.regrowths += 1
        self.buffer = buffer
        self._base = self.memory.pointer(buffer, 0)
        self.memory.release_cached()

    def _back(self) -> None:
        """Grow a device buffer to cover the highest live tensor (by a quarter at least, so
        drift costs few copies)."""
        end = self.allocator.high_water_live()
        if end > self.reserved_bytes:
            target = max(end, self.reserved_bytes + self.reserved_bytes // 4)
            cap = self.allocator.capacity
            self._reserve(target if cap is None or self.growable else max(end, min(target, cap)))

    # ---- tensors -------------------------------------------------------------------------

    def allocate(self, name: str, info: TensorInfo, *, region: tuple[int, int] | None = None) -> None:
        """Place ``name`` (inside ``region`` if a free span there fits, else anywhere)."""
        if self.growable:
            try:
                self.allocator.allocate(name, info.nbytes)
            except OutOfArenaMemory:
                # Grow geometrically from the buffer (not the cap) so drift costs few copies.
                size = align_up(info.nbytes, self.alignment)
                grown = max(self.reserved_bytes + self.reserved_bytes // 4, self.allocator.high_water_live() + size)
                if self.eager:
                    self.set_capacity(grown)
                else:
                    self.allocator.capacity = grown
                self.allocator.allocate(name, info.nbytes)
        else:
            self._move(self.allocator.allocate_or_compact(name, info.nbytes, region=region))
        self._own_infos()[name] = info
        self._token = None
        if not self.eager:
            self._back()

    def allocate_all(self, tensors) -> None:
        """Place each of ``tensors`` ((name, TensorInfo) pairs), in order, as :meth:`allocate`
        with no region would (a block's outputs: one call)."""
        if not self.eager:
            for name, info in tensors:
                self.allocate(name, info)
            return
        allocate, infos = self.allocator.allocate, self._own_infos()
        self._token = None
        for name, info in tensors:
            try:
                allocate(name, info.nbytes)
            except OutOfArenaMemory:  # nothing changed: grow or compact as allocate() does
                self.allocate(name, info)
                continue
            infos[name] = info

    def allocate_view(self, name: str, info: TensorInfo, pieces, *, region: tuple[int, int] | None = None) -> None:
        """Place ``name`` and divide it into ``pieces`` ((name, TensorInfo) in order, back to
        back): a split view, written whole, read and freed piece by piece."""
        self.allocate(name, info, region=region)
        self.allocator.partition(name, [(piece, piece_info.nbytes) for piece, piece_info in pieces])
        self._token = None
        infos = self._own_infos()
        del infos[name]
        infos.update(pieces)

    def compact(self) -> None:
        """Close the holes by moving tensors down. Pointers change; block sessions rebind on
        the next run."""
        self._move(self.allocator.compact())

    def _move(self, moves) -> None:
        """Apply compaction moves (ascending, so no move clobbers a tensor not yet moved)."""
        if moves and self.before_move is not None:
            self.before_move()
        for name, old, new in moves:
            self.memory.move(self.buffer, old, new, self.allocator.placement(name).nbytes)
        if moves:
            self._token = None
            self.compactions += 1
            self.memory.release_cached()

    def free(self, name: str) -> None:
        self.allocator.free(name)
        del self._own_infos()[name]
        self._token = None

    def free_all(self, names) -> None:
        """:meth:`free` each of ``names``, in order."""
        free, infos = self.allocator.free, self._own_infos()
        self._token = None
        for name in names:
            free(name)
            del infos[name]

    def rename(self, old: str, new: str) -> None:
        self.allocator.rename(old, new)
        infos = self._own_infos()
        infos[new] = infos.pop(old)
        self._token = None

    # ---- placed steps (ort_offload.runtime.placed_steps) ----------------------------------

    def state_token(self) -> object:
        """An object standing for where every tensor is now: the same object whenever the
        placements are the same (placed steps are looked up by it)."""
        if self._token is None:
            self._token = self.token_of(self.allocator)
        return self._token

    def token_of(self, allocator) -> object:
        """:meth:`state_token` of the state ``allocator`` (a BestFitAllocator) holds."""
        key = (allocator.layout(), allocator.high_water_live())
        if len(self._tokens) >= MAX_STATE_TOKENS and key not in self._tokens:
            self._tokens.clear()  # states seen long ago: their steps are placed again if they recur
        return self._tokens.setdefault(key, object())

    def infos(self) -> dict[str, TensorInfo]:
        """What the arena holds: name -> TensorInfo (do not change it)."""
        return self._infos

    def adopt(self, placed, infos: dict[str, TensorInfo], token: object, *, capacity: int | None) -> None:
        """Take the placements a replay of a step ended in (``placed``, a BestFitAllocator
        whose start was this arena's state), the tensors' ``infos`` and the ``token`` of that
        state; ``capacity``: the cap the step left (None: keep this one). Both are shared with
        the caller, who keeps them unchanged, and copied here before the arena changes them
        (a copy would touch every tensor's entry each step, out of cache after the kernels)."""
        self.allocator.restore(placed)
        if capacity is not None:
            self.allocator.capacity = capacity
        self._infos = infos
        self._infos_shared = True
        self._token = token

    def _own_infos(self) -> dict[str, TensorInfo]:
        """:attr:`_infos`, to change: first a copy of it where :meth:`adopt` shares it."""
        if self._infos_shared:
            self._infos = dict(self._infos)
            self._infos_shared = False
        return self._infos

    def cover(self, extent: int) -> None:
        """Back and allow ``extent`` bytes before a placed step reaches that far (what
        allocations past the end do in a growable arena, all at once)."""
        if self.growable and (self.allocator.capacity or 0) < extent:
            if self.eager:
                self.set_capacity(extent)
                return
            self.allocator.capacity = extent
        if extent > self.reserved_bytes:
            if self.eager:
                self._reserve(extent)
            else:
                self._reserve(max(extent, self.reserved_bytes + self.reserved_bytes // 4))

    @property
    def base(self) -> int:
        """The buffer's address (a tensor's pointer is this plus its offset)."""
        return self._base

    def write_at(self, offset: int, info: TensorInfo, array: np.ndarray) -> None:
        """:meth:`write` to a tensor at ``offset`` (a placed step's, not registered yet)."""
        self.memory.write(self.buffer, offset, np.asarray(array, dtype=info.dtype))

    def read_at(self, offset: int, info: TensorInfo) -> np.ndarray:
        """:meth:`read` of a tensor at ``offset`` (a placed step's)."""
        return self.memory.read(self.buffer, offset, info)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def holds_all(self, names: frozenset[str]) -> bool:
        """Whether every one of ``names`` is placed here (one set comparison)."""
        return self._infos.keys() >= names

    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def offset(self, name: str) -> int:
        return self.allocator.placement(name).offset

    def view(self, name: str) -> np.ndarray:
        """The tensor as a numpy array over arena memory (no copy; host memory only)."""
        if not self.eager:
            raise TypeError("device memory has no numpy view: use read() or write()")
        return self.memory.view(self.buffer, self.offset(name), self._infos[name])

    def pointer(self, name: str) -> int:
        return self._base + self.offset(name)

    def pointers(self, names) -> tuple[int, ...]:
        """The address of each of ``names``, in order (what a block binds)."""
        return self.allocator.addresses(names, self._base)

    def read(self, name: str) -> np.ndarray:
        """A host copy of the tensor."""
        return self.memory.read(self.buffer, self.offset(name), self._infos[name])

    def write(self, name: str, array: np.ndarray) -> None:
        """Overwrite the tensor with ``array`` (its dtype and shape)."""
        self.memory.write(self.buffer, self.offset(name), np.asarray(array, dtype=self._infos[name].dtype))

    def uploader(self, name: str, array: np.ndarray):
        """A copy of host ``array`` into the tensor, to run later (on a copy engine): its place
        is taken now (bytes move only after copies drain)."""
        memory, buffer, offset = self.memory, self.buffer, self.offset(name)
        return lambda: memory.upload(buffer, offset, array)

    def downloader(self, name: str, target: np.ndarray):
        """A copy of the tensor into host ``target``, to run later (on a copy engine)."""
        memory, buffer, offset = self.memory, self.buffer, self.offset(name)
        return lambda: memory.download(buffer, offset, target)

    def store(self, name: str, array: np.ndarray) -> None:
        """Allocate ``name`` and copy ``array`` into it."""
        self.allocate(name, TensorInfo(np.dtype(array.dtype), tuple(array.shape)))
        self.write(name, array)

    def all_finite(self, names: tuple[str, ...]) -> bool:
        """Whether every one of ``names`` (all placed here) holds only finite values, in one
        fused check; in host memory over views kept while the placements and buffer stay."""
        if not self.eager:
            return all(self.finite(names))
        key = (names, self._token)
        cached = self._finite_views.get(key) if self._token is not None else None
        if cached is None or cached[0] is not self.buffer:
            check = FiniteCheck(self.memory.view(self.buffer, self.offset(n), self._infos[n]).reshape(-1) for n in names)
            if len(self._finite_views) >= MAX_STATE_TOKENS:
                self._finite_views.clear()
            cached = self._finite_views[key] = (self.buffer, check)
        return cached[1]()

    def finite(self, names) -> list[bool]:
        """Whether each tensor of ``names`` holds only finite values (read where it lives)."""
        return self.memory.finite(self.buffer, [(self.offset(n), self._infos[n]) for n in names])

    @property
    def in_use(self) -> int:
        return self.allocator.in_use

    @property
    def high_water(self) -> int:
        return self.allocator.high_water

    def reset_high_water(self) -> None:
        self.allocator.high_water = self.allocator.high_water_live()
