"""Copy engines: copies on a worker thread each, with completion events — one engine per
direction, like the host→device and device→host streams of the simulator.

A swap-in reserves its arena bytes when it is issued and copies in the background while blocks
compute (numpy and ONNX Runtime both release the GIL, so the copy and the kernels overlap).
Whoever needs the tensor waits on its event; a tensor still in flight costs a wait, never a
fault. A swap-out copies into a host buffer in the background and gives its arena bytes back
when done. On CUDA an engine becomes a copy stream with events.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable


class CopyEngine:
    """One worker thread running copies in issue order (a FIFO copy stream)."""

    def __init__(self, direction: str = "h2d") -> None:
        self.direction = direction
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ort_offload-{direction}")
        self._pending: dict[str, concurrent.futures.Future] = {}

    def submit(self, name: str, copy: Callable[[], None]) -> None:
        self._pending[name] = self._pool.submit(copy)

    def in_flight(self, name: str) -> bool:
        return name in self._pending

    def done(self, name: str) -> bool:
        """Whether ``name``'s copy has finished (it stays pending until someone waits on it)."""
        future = self._pending.get(name)
        return future is None or future.done()

    def pending(self) -> list[str]:
        """Names with a copy not yet waited on, in issue order."""
        return list(self._pending)

    def settle(self) -> float:
        """Wait until every copy issued so far has finished, without consuming their events
        (whoever owns each copy still waits on it); seconds waited."""
        if not self._pending:
            return 0.0
        started = time.perf_counter()
        concurrent.futures.wait(list(self._pending.values()))
        return time.perf_counter() - started

    def wait(self, name: str) -> tuple[float, bool]:
        """Wait for ``name``'s copy; returns (seconds waited, whether it had already finished)."""
        future = self._pending.pop(name, None)
        if future is None:
            return 0.0, True
        done = future.done()
        started = time.perf_counter()
        future.result()  # re-raises a failed copy
        return time.perf_counter() - started, done

    def consume(self, name: str) -> tuple[float, bool]:
        """Make ``name``'s copy visible to the next block: here, wait for it (a device's
        stream engine only orders the compute stream after it)."""
        return self.wait(name)

    def drain(self) -> float:
        """Wait for every copy in flight (before bytes move or the step ends); seconds waited."""
        waited = 0.0
        for name in list(self._pending):
            waited += self.wait(name)[0]
        return waited

    def close(self) -> None:
        self._pool.shutdown(wait=True)
