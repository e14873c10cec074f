"""Device memory backends: the bytes behind a :class:`~ort_offload.runtime.arena.DeviceArena`.

The arena decides *where* tensors go (offsets in one buffer); a backend owns the buffer and
moves bytes in and out of it. Two backends share one interface:

- :class:`NumpyMemory` — the CPU device: the buffer is host RAM, tensors are numpy views.
- :class:`TorchMemory` — one ``torch`` allocation on a device (``cuda:N`` for the CUDA device;
  ``cpu`` runs the same code path on the CPU, which is how CI tests it). Host copies are pinned
  on CUDA so that copies issued with ``asynchronous=True`` run on a copy stream beside the
  kernels.

Asynchronous copies are issued on the caller's current stream (the copy engines select theirs);
synchronous ones (``write``, ``read``) return when the bytes have moved.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from graph_passes.ir.shapes import TensorInfo


class DeviceMemory(Protocol):
    """What an arena needs from the memory it places tensors in."""

    ort_device: str  # ONNX Runtime's name for where bound pointers live ("cpu" or "cuda")
    device_id: int

    def allocate(self, nbytes: int, alignment: int): ...
    def size(self, buffer) -> int: ...
    def pointer(self, buffer, offset: int) -> int: ...  # the buffer's address + offset
    def move(self, buffer, source: int, target: int, nbytes: int) -> None: ...
    def copy_prefix(self, source, target, nbytes: int) -> None: ...
    def write(self, buffer, offset: int, array: np.ndarray) -> None: ...
    def read(self, buffer, offset: int, info: TensorInfo) -> np.ndarray: ...
    def upload(self, buffer, offset: int, array: np.ndarray) -> None: ...
    def download(self, buffer, offset: int, target: np.ndarray) -> None: ...
    def host_empty(self, info: TensorInfo) -> np.ndarray: ...
    def release_cached(self) -> None: ...
    def finite(self, buffer, placed) -> list[bool]: ...


def all_finite(array: np.ndarray) -> bool:
    """A sum is non-finite whenever an element is; only when it overflows is each element read."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(array.sum()) or np.isfinite(array).all())


# Arrays up to this size are gathered into one buffer per dtype and summed in one call
# (a numpy call costs microseconds; a small parameter's sum is mostly that).
FUSED_FINITE_BYTES = 2**20


class FiniteCheck:
    """:func:`all_finite` of every one of some flat arrays, fused: the sum of their sums is
    non-finite whenever an element is, and only when it overflows is each array read again.
    Small arrays are copied into one scratch buffer per dtype and summed at once."""

    def __init__(self, arrays) -> None:
        self.arrays = list(arrays)
        small: dict[np.dtype, list[np.ndarray]] = {}
        self.large = []
        for array in self.arrays:
            (small.setdefault(array.dtype, []) if array.nbytes <= FUSED_FINITE_BYTES else self.large).append(array)
        self.gathered = [(views, np.empty(sum(v.size for v in views), dtype=dtype)) for dtype, views in small.items()]

    def __call__(self) -> bool:
        add, concatenate = np.add.reduce, np.concatenate
        with np.errstate(over="ignore", invalid="ignore"):
            sums = [add(concatenate(views, out=scratch)) for views, scratch in self.gathered]
            if math.isfinite(sum(sums + [add(a) for a in self.large])):
                return True
            return all(bool(np.isfinite(a).all()) for a in self.arrays)


def torch_dtype(dtype: np.dtype):
    """The torch dtype of a numpy one (floating types only are checked for finiteness)."""
    import torch

    return {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
            np.dtype(np.float16): torch.float16}[np.dtype(dtype)]


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes as a flat uint8 array (C-contiguous; a copy only if it was not)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class NumpyMemory:
    """Host RAM standing in for device memory (the CPU device)."""

    ort_device = "cpu"
    device_id = 0
    is_host = True

    def allocate(self, nbytes: int, alignment: int) -> np.ndarray:
        # Over-allocate by one alignment unit so offset 0 is aligned; np.empty does not touch
        # the pages, so an unused budget costs address space, not RAM.
        raw = np.empty(nbytes + alignment, dtype=np.uint8)
        shift = (-raw.ctypes.data) % alignment
        return raw[shift : shift + nbytes]

    def size(self, buffer: np.ndarray) -> int:
        return buffer.size

    def pointer(self, buffer: np.ndarray, offset: int) -> int:
        return buffer.ctypes.data + offset

    def view(self, buffer: np.ndarray, offset: int, info: TensorInfo) -> np.ndarray:
        return buffer[offset : offset + info.nbytes].view(info.dtype).reshape(info.shape)

    def move(self, buffer: np.ndarray, source: int, target: int, nbytes: int) -> None:
        buffer[target : target + nbytes] = buffer[source : source + nbytes]

    def copy_prefix(self, source: np.ndarray, target: np.ndarray, nbytes: int) -> None:
        target[:nbytes] = source[:nbytes]

    def write(self, buffer: np.ndarray, offset: int, array: np.ndarray) -> None:
        data = _bytes_of(array)
        buffer[offset : offset + data.size] = data

    def read(self, buffer: np.ndarray, offset: int, info: TensorInfo) -> np.ndarray:
        return self.view(buffer, offset, info).copy()

    upload = write  # RAM to RAM: the copy engine's worker thread is what makes it asynchronous

    def download(self, buffer: np.ndarray, offset: int, target: np.ndarray) -> None:
        target.reshape(-1).view(np.uint8)[...] = buffer[offset : offset + target.nbytes]

    def host_empty(self, info: TensorInfo) -> np.ndarray:
        return np.empty(info.shape, dtype=info.dtype)

    def release_cached(self) -> None:
        pass

    def finite(self, buffer: np.ndarray, placed) -> list[bool]:
        """Whether each tensor of ``placed`` ((offset, TensorInfo) pairs) holds only finite values."""
        finite = []
        add, isfinite = np.add.reduce, math.isfinite  # add.reduce: ndarray.sum without its Python layer
        with np.errstate(over="ignore", invalid="ignore"):  # all_finite's test, one errstate for all
            for offset, info in placed:
                flat = buffer[offset : offset + info.nbytes].view(info.dtype)
                finite.append(isfinite(add(flat)) or bool(np.isfinite(flat).all()))
        return finite


# The most a compaction move stages at once (TorchMemory.move).
MOVE_STAGING_BYTES = 32 * 2**20


class TorchMemory:
    """One ``torch`` uint8 allocation on ``device`` holding the arena.

    Allocated through torch's caching allocator once per arena size, so the device counter sees
    one block. Host buffers are pinned where the device is CUDA (asynchronous copies)."""

    is_host = False

    def __init__(self, device: str = "cuda:0") -> None:
        import torch  # imported here: the CPU device never needs it for memory

        self._torch = torch
        self.device = torch.device(device)
        self.ort_device = "cuda" if self.device.type == "cuda" else "cpu"
        self.device_id = self.device.index or 0
        self.pinned = self.device.type == "cuda"

    def allocate(self, nbytes: int, alignment: int):
        torch = self._torch
        raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device=self.device)
        shift = (-raw.data_ptr()) % alignment
        return raw[shift : shift + nbytes]

    def size(self, buffer) -> int:
        return buffer.numel()

    def pointer(self, buffer, offset: int) -> int:
        return buffer.data_ptr() + offset

    def _host_bytes(self, array: np.ndarray):
        return self._torch.from_numpy(_bytes_of(array))

    def move(self, buffer, source: int, target: int, nbytes: int) -> None:
        """Move bytes down (compaction). A device copy between overlapping ranges is undefined,
        so an overlapping move goes through a staging buffer of at most MOVE_STAGING_BYTES,
        piece by piece from the front: a piece's target can only overlap source bytes already
        staged. (A whole-tensor temporary took 1.1 GB beside gpt medium's blocks on an H200,
        memory no plan counts.)"""
        if abs(source - target) >= nbytes:
            buffer[target : target + nbytes].copy_(buffer[source : source + nbytes])
            return
        if target > source:
            raise ValueError("compaction moves tensors down only")
        piece = min(nbytes, MOVE_STAGING_BYTES)
        staging = self._torch.empty(piece, dtype=self._torch.uint8, device=self.device)
        for start in range(0, nbytes, piece):
            size = min(piece, nbytes - start)
            staging[:size].copy_(buffer[source + start : source + start + size])
            buffer[target + start : target + start + size].copy_(staging[:size])

    def copy_prefix(self, source, target, nbytes: int) -> None:
        target[:nbytes].copy_(source[:nbytes])

    def write(self, buffer, offset: int, array: np.ndarray) -> None:
        data = self._host_bytes(array)
        if self.pinned and data.numel():
            # Staged through pinned memory so the copy is queued, not waited for; torch keeps
            # the staging buffer until the copy's stream has passed it.
            buffer[offset : offset + data.numel()].copy_(data.pin_memory(), non_blocking=True)
        else:
            buffer[offset : offset + data.numel()].copy_(data)

    def read(self, buffer, offset: int, info: TensorInfo) -> np.ndarray:
        out = np.empty(info.shape, dtype=info.dtype)
        if out.nbytes:
            self._host_bytes(out).copy_(buffer[offset : offset + out.nbytes])  # waits for the copy
        return out

    def upload(self, buffer, offset: int, array: np.ndarray) -> None:
        data = self._host_bytes(array)
        buffer[offset : offset + data.numel()].copy_(data, non_blocking=self.pinned)

    def download(self, buffer, offset: int, target: np.ndarray) -> None:
        self._host_bytes(target).copy_(buffer[offset : offset + target.nbytes], non_blocking=self.pinned)

    def release_cached(self) -> None:
        """Give memory torch's caching allocator kept (a replaced buffer, a compaction's
        temporary) back to the device, so the device counter sees only the arena."""
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()

    def finite(self, buffer, placed) -> list[bool]:
        """Whether each tensor of ``placed`` ((offset, TensorInfo) pairs) holds only finite
        values: checked where the bytes are, one copy of the answers to the host."""
        torch = self._torch
        if not placed:
            return []
        flags = [torch.isfinite(self._tensor(buffer, offset, info)).all() for offset, info in placed]
        return torch.stack(flags).cpu().tolist()

    def _tensor(self, buffer, offset: int, info: TensorInfo):
        dtype = torch_dtype(info.dtype)
        return buffer[offset : offset + info.nbytes].view(dtype).reshape(info.shape)

    def host_empty(self, info: TensorInfo) -> np.ndarray:
        """An uninitialised host array, page-locked on CUDA (the array keeps its tensor alive)."""
        torch = self._torch
        if not self.pinned:
            return np.empty(info.shape, dtype=info.dtype)
        raw = torch.empty(max(info.nbytes, 1), dtype=torch.uint8, pin_memory=True).numpy()
        return raw[: info.nbytes].view(info.dtype).reshape(info.shape)
