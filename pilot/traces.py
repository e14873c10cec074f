"""Execution-trace generator: runs a dynamic model on a sample and records its block invocations.

Owns :class:`Invocation`, :class:`Trace` (JSON round trip), :func:`record_trace` and
:func:`median_block_times`. A trace is the paper's offline input to the partition simulator
(§IV-B): the block invocations in call order, each with its op count, measured wall time,
parameter bytes and saved-activation bytes (the last three from the block profiles the caller
built from the exported block graphs; time from forward hooks around each block call).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from pilot.features import BlockProfile

__all__ = ["Invocation", "Trace", "median_block_times", "record_trace"]


@dataclass(frozen=True)
class Invocation:
    """One block call: its index in ``model.blocks()``, ops of its forward graph, wall time
    (s), parameter bytes, saved-activation bytes."""

    block: int
    ops: int
    time_s: float
    param_bytes: int
    saved_bytes: int


@dataclass(frozen=True)
class Trace:
    """Block invocations of one forward, in call order, and the path they form."""

    model: str
    invocations: tuple[Invocation, ...]

    @property
    def path(self) -> tuple[int, ...]:
        return tuple(i.block for i in self.invocations)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "invocations": [asdict(i) for i in self.invocations]})

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        data = json.loads(text)
        return cls(data["model"], tuple(Invocation(**i) for i in data["invocations"]))


def record_trace(name: str, model: nn.Module, inputs: Sequence[torch.Tensor], profiles: Sequence[BlockProfile]) -> Trace:
    """Run ``model(*inputs)`` (training mode, autograd on, as in a training step) and record
    every block call. Raises ``ValueError`` when the recorded calls differ from
    ``model.path(*inputs)`` (a block called outside the declared path)."""
    blocks = list(model.blocks())
    if len(profiles) != len(blocks):
        raise ValueError(f"{name}: {len(profiles)} profiles for {len(blocks)} blocks")
    records: list[Invocation] = []
    starts: list[float] = []

    def before(index):
        def hook(module, args):
            starts.append(time.perf_counter())
        return hook

    def after(index):
        def hook(module, args, output):
            elapsed = time.perf_counter() - starts.pop()
            p = profiles[index]
            records.append(Invocation(index, len(p.op_types), elapsed, p.param_bytes, p.saved_bytes))
        return hook

    handles = []
    try:
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(before(index)))
            handles.append(block.register_forward_hook(after(index)))
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    trace = Trace(name, tuple(records))
    expected = tuple(int(i) for i in model.path(*inputs))
    if trace.path != expected:
        raise ValueError(f"{name}: recorded calls {trace.path} differ from model.path {expected}")
    return trace


def median_block_times(traces: Sequence[Trace], profiles: Sequence[BlockProfile], *, quantile: float = 0.0) -> list[float]:
    """Per-block time per invocation over ``traces``: the ``quantile`` of its invocation times
    (default 0, the least: on a shared CPU, contention only ever adds time, and the labels should
    not move with the load). A block never invoked gets the value of a block with the same
    structure, else the overall time per op times its op count."""
    per_block: dict[int, list[float]] = {}
    for trace in traces:
        for inv in trace.invocations:
            per_block.setdefault(inv.block, []).append(inv.time_s)
    medians = {b: float(np.quantile(ts, quantile)) for b, ts in per_block.items()}
    if not medians:
        raise ValueError("no invocations in the traces")
    by_structure = {}
    for b, t in sorted(medians.items()):
        by_structure.setdefault(profiles[b].structure, t)
    per_op = statistics.median(t / max(len(profiles[b].op_types), 1) for b, t in medians.items())
    out = []
    for b, p in enumerate(profiles):
        if b in medians:
            out.append(medians[b])
        elif p.structure in by_structure:
            out.append(by_structure[p.structure])
        else:
            out.append(per_op * len(p.op_types))
    return out
