"""The device's own memory counter, sampled while a step runs.

A GPU has no peak counter for everything a process holds (torch's counts its own allocator
only, and ONNX Runtime's CUDA arenas are not torch's). The driver's current figure
(``cudaMemGetInfo``) is exact at the moment it is read, so :class:`PeakSampler` reads it on a
thread every ``interval_s`` while a step runs and keeps the maximum. Block sessions hold their
workspace while their kernels run (ORT's arena shrinkage frees it with ``cudaFree``, which
waits for the device), i.e. for the whole of a block's time on the device, so a sampling
interval well under a block's time sees every block's workspace.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class PeakSampler:
    """The largest value ``read()`` returned while :meth:`sampling` was active (and at its
    start and end, so a step shorter than one interval is still measured)."""

    def __init__(self, read: Callable[[], int], interval_s: float = 0.001) -> None:
        self._read = read
        self._interval_s = interval_s
        self.peak = 0  # over every sampling so far
        self.samples = 0

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        stop = threading.Event()
        peaks = [self._read()]

        def poll() -> None:
            while not stop.wait(self._interval_s):
                peaks[0] = max(peaks[0], self._read())
                self.samples += 1

        thread = threading.Thread(target=poll, name="device-counter", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.peak = max(self.peak, peaks[0], self._read())
