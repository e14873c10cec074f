"""Copy engines as streams with events: the CUDA device's replacement for the copy threads.

A :class:`StreamCopyEngine` has the interface of :class:`~ort_offload.runtime.copy_engine.CopyEngine`
(submit, in_flight, done, pending, settle, wait, drain, consume, close), so the runtime drives
either without knowing which. A copy submitted to it is ordered after everything already queued
on the compute stream (the bytes it reads may still be being written by a block; the bytes it
writes may still be read by one), runs on the engine's own stream, and records a completion
event. ``consume`` hands the ordering to the compute stream (the next kernels wait for the
event on the device, the host does not); ``wait`` blocks the host and is used only where the
host itself needs the bytes (a swap-out's host copy, bytes about to be reused).

The streams come from a :class:`Streams` provider: :class:`TorchCudaStreams` on a GPU;
:class:`ImmediateStreams` runs every copy when issued, so the same engine and runtime path are
exercised on the CPU (tests, CI).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Protocol


class Event(Protocol):
    def record(self, stream) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Streams(Protocol):
    """Streams and events of one device; ``compute`` is the stream blocks run on."""

    compute: object

    def new_stream(self): ...
    def new_event(self) -> Event: ...
    def using(self, stream) -> contextlib.AbstractContextManager: ...
    def wait_event(self, stream, event: Event) -> None: ...
    def synchronize(self) -> None: ...
    def pointer(self, stream) -> int | None: ...


class _DoneEvent:
    """An event whose work has always finished (copies on :class:`ImmediateStreams`)."""

    def record(self, stream) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ImmediateStreams:
    """Streams on which work runs as it is issued: the CPU stand-in for device streams."""

    compute = None

    def new_stream(self):
        return None

    def new_event(self) -> Event:
        return _DoneEvent()

    def using(self, stream):
        return contextlib.nullcontext()

    def wait_event(self, stream, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def pointer(self, stream) -> int | None:
        return None


class TorchCudaStreams:
    """CUDA streams and events through ``torch.cuda`` on one device."""

    def __init__(self, device_id: int = 0) -> None:
        import torch

        self._cuda = torch.cuda
        self.device = torch.device("cuda", device_id)
        self.compute = torch.cuda.Stream(device=self.device)

    def new_stream(self):
        return self._cuda.Stream(device=self.device)

    def new_event(self) -> Event:
        return self._cuda.Event()

    def using(self, stream):
        return self._cuda.stream(stream)

    def wait_event(self, stream, event: Event) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        self._cuda.synchronize(self.device)

    def pointer(self, stream) -> int | None:
        return stream.cuda_stream


class StreamCopyEngine:
    """A FIFO copy stream with a completion event per copy (one per direction)."""

    def __init__(self, direction: str, streams: Streams, *, serialize: bool = False) -> None:
        """``serialize``: the host waits for every copy as it is issued (a diagnostic: a run
        that differs only without it has a missing ordering between streams)."""
        self.direction = direction
        self.streams = streams
        self.serialize = serialize
        self.stream = streams.new_stream()
        self._pending: dict[str, Event] = {}
        # Copies the device may still be running, with what they read or write on the host:
        # a host array must outlive its copy (torch's pinned-memory cache cannot tell that a
        # numpy view of its block is in use, and would hand the block out again).
        self._in_flight: list[tuple[Event, Callable[[], None]]] = []

    def submit(self, name: str, copy: Callable[[], None]) -> None:
        """Queue ``copy`` (which issues device copies on the current stream) after the compute
        stream's work so far, on this engine's stream."""
        streams = self.streams
        ready = streams.new_event()
        ready.record(streams.compute)
        streams.wait_event(self.stream, ready)
        with streams.using(self.stream):
            copy()
        done = streams.new_event()
        done.record(self.stream)
        self._pending[name] = done
        self._in_flight = [(event, held) for event, held in self._in_flight if not event.query()]
        self._in_flight.append((done, copy))
        if self.serialize:
            done.synchronize()

    def in_flight(self, name: str) -> bool:
        return name in self._pending

    def done(self, name: str) -> bool:
        event = self._pending.get(name)
        return event is None or event.query()

    def pending(self) -> list[str]:
        return list(self._pending)

    def consume(self, name: str) -> tuple[float, bool]:
        """Order the compute stream after ``name``'s copy (no host wait); returns (0, whether
        it had already finished)."""
        event = self._pending.pop(name, None)
        if event is None:
            return 0.0, True
        finished = event.query()
        if not finished:
            self.streams.wait_event(self.streams.compute, event)
        return 0.0, finished

    def wait(self, name: str) -> tuple[float, bool]:
        """Block the host until ``name``'s copy is done; (seconds waited, finished before)."""
        event = self._pending.pop(name, None)
        if event is None:
            return 0.0, True
        finished = event.query()
        started = time.perf_counter()
        if not finished:
            event.synchronize()
        return time.perf_counter() - started, finished

    def settle(self) -> float:
        started = time.perf_counter()
        for event, _ in self._in_flight:
            event.synchronize()
        self._in_flight.clear()
        return time.perf_counter() - started

    def drain(self) -> float:
        waited = 0.0
        for name in list(self._pending):
            waited += self.wait(name)[0]
        return waited + self.settle()

    def close(self) -> None:
        self.settle()
