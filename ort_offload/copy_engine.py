"""The copy engine: host→device copies on a worker thread, with completion events.

A swap-in reserves its arena bytes when it is issued and copies in the background while blocks
compute (numpy and ONNX Runtime both release the GIL, so the copy and the kernels overlap).
Whoever needs the tensor waits on its event; a tensor still in flight costs a wait, never a
fault. On CUDA this becomes a copy stream with events.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable


class CopyEngine:
    """One worker thread running copies in issue order (a FIFO copy stream)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort_offload-copy")
        self._pending: dict[str, concurrent.futures.Future] = {}

    def submit(self, name: str, copy: Callable[[], None]) -> None:
        self._pending[name] = self._pool.submit(copy)

    def in_flight(self, name: str) -> bool:
        return name in self._pending

    def wait(self, name: str) -> tuple[float, bool]:
        """Wait for ``name``'s copy; returns (seconds waited, whether it had already finished)."""
        future = self._pending.pop(name, None)
        if future is None:
            return 0.0, True
        done = future.done()
        started = time.perf_counter()
        future.result()  # re-raises a failed copy
        return time.perf_counter() - started, done

    def drain(self) -> float:
        """Wait for every copy in flight (before bytes move or the step ends); seconds waited."""
        waited = 0.0
        for name in list(self._pending):
            waited += self.wait(name)[0]
        return waited

    def close(self) -> None:
        self._pool.shutdown(wait=True)
