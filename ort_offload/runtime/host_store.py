"""Host memory for tensors that are not on the device: uploads, downloads, checkpoints.

On the CPU device this is ordinary RAM; on CUDA it is pinned memory (the device backend's
``host_empty``), so copies to and from the GPU run asynchronously. Swap passes park evicted
tensors here.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from graph_passes.ir.shapes import TensorInfo


class HostStore:
    """Named host copies of tensors; ``empty`` allocates their buffers (pinned on CUDA)."""

    def __init__(self, empty: Callable[[TensorInfo], np.ndarray] | None = None) -> None:
        self._tensors: dict[str, np.ndarray] = {}
        self._empty = empty

    def put(self, name: str, array: np.ndarray) -> None:
        """Store a copy of ``array`` (the caller's buffer may be reused right after)."""
        if self._empty is None:
            self._tensors[name] = np.array(array, copy=True, order="C")
            return
        target = self._empty(TensorInfo(np.dtype(array.dtype), tuple(np.shape(array))))
        target[...] = array
        self._tensors[name] = target

    def adopt(self, name: str, array: np.ndarray) -> None:
        """Store ``array`` itself (a buffer a finished swap-out filled; nobody else holds it)."""
        self._tensors[name] = array

    def get(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def pop(self, name: str) -> np.ndarray:
        return self._tensors.pop(name)

    def discard(self, name: str) -> None:
        self._tensors.pop(name, None)

    def discard_all(self, names) -> None:
        """:meth:`discard` each of ``names`` (nothing to do, and no loop, while the store is empty)."""
        tensors = self._tensors
        if tensors:
            for name in names:
                tensors.pop(name, None)

    def rename(self, old: str, new: str) -> None:
        self._tensors[new] = self._tensors.pop(old)

    def holds_nothing(self) -> bool:
        return not self._tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def clear(self) -> None:
        self._tensors.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._tensors.values())
