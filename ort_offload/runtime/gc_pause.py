"""Pausing Python's cyclic garbage collector while a new input signature is prepared.

Preparing a signature (shape inference, lowering, memory replays, recompute planning) makes
hundreds of thousands of short-lived objects. With the collector on, those alive at a young
collection are promoted, and once enough have been promoted CPython runs a full collection,
which walks every tracked object in the process: after a torch export that is over half a
million (torch's and onnxscript's caches), about 0.4 s a pass. Paused, the temporaries die by
reference count before any collection sees them; what the prepared step keeps is collected
as usual afterwards (measurements: docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Automatic garbage collection off inside the block (back on after it, if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


__all__ = ["collection_paused"]
