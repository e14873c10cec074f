"""Glue between the runtime side and :mod:`pilot`: block graphs, architectures, a ready pilot.

Owns :func:`block_graphs` (each block's forward graph via :func:`ort_offload.dynamic.block_export.
export_block_step` / :func:`~ort_offload.dynamic.block_export.split_step`), :func:`pilot_architecture`
(profiles + traces + candidate paths of a dynamic model spec) and :func:`make_pilot` (a
:class:`pilot.Pilot` with the spec's model attached). ``pilot`` never imports ``ort_offload``;
this module is where the two meet.

Blocks are exported at batch 1: the AFM describes the architecture per sample, and the batch
size changes no path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from pilot.architecture import PilotArchitecture, build_architecture
from pilot.features import BlockGraph
from pilot.inference import Pilot
from pilot.traces import median_block_times, record_trace

logger = logging.getLogger(__name__)

__all__ = ["block_graphs", "make_pilot", "pilot_architecture"]

DEFAULT_TRACE_SAMPLES = 12
MAX_ARG_PROBES = 64
"""Samples tried to see every block invoked once (for its example arguments)."""


def _block_args(spec) -> dict[int, tuple[torch.Tensor, ...]]:
    """Example arguments of every block, from forward pre-hooks over a few batch-1 samples; a
    block no sample invoked borrows those of an invoked block of the same class and parameter
    shapes (an unused expert borrows a used one's)."""
    model = spec.model
    blocks = list(model.blocks())
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, tuple(t.detach() for t in a)))
               for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for seed in range(MAX_ARG_PROBES):
                if len(seen) == len(blocks):
                    break
                (ids,), _ = spec.make_batch(1, seed=seed)
                model(ids)
    finally:
        for h in handles:
            h.remove()

    def shape_key(block):
        return type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters())

    for i, block in enumerate(blocks):
        if i not in seen:
            donor = next((j for j in sorted(seen) if shape_key(blocks[j]) == shape_key(block)), None)
            if donor is None:
                raise ValueError(f"{spec.name}: block {i} ({type(block).__name__}) never ran in {MAX_ARG_PROBES} samples "
                                 "and no block of the same structure did")
            seen[i] = seen[donor]
    return seen


def block_graphs(spec, *, cache_dir: str | os.PathLike | None = None) -> list[BlockGraph]:
    """One :class:`~pilot.features.BlockGraph` per ``spec.model.blocks()`` entry."""
    from ort_offload.dynamic.block_export import export_block_step, split_step

    args = _block_args(spec)
    graphs = []
    split_cache: dict[str, BlockGraph] = {}
    for i, block in enumerate(spec.model.blocks()):
        step = export_block_step(block, args[i], cache_dir=cache_dir)
        param_bytes = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
        if step.cache_key not in split_cache:
            split = split_step(step)
            split_cache[step.cache_key] = BlockGraph(split.forward, tuple(split.saved), param_bytes)
        graphs.append(split_cache[step.cache_key])
    return graphs


def pilot_architecture(spec, *, trace_samples: int = DEFAULT_TRACE_SAMPLES, seed: int = 0,
                       migration_half_bytes: int | None = None, cache_dir: str | os.PathLike | None = None) -> PilotArchitecture:
    """The pilot's view of a dynamic model spec: exported block graphs, ``trace_samples``
    traces (batch 1, after one warm-up run) for per-block times, candidate paths, link model."""
    from pilot.features import profile_block

    graphs = block_graphs(spec, cache_dir=cache_dir)
    profiles = [profile_block(g) for g in graphs]
    (ids,), _ = spec.make_batch(1, seed=seed)
    spec.model(ids)  # warm-up
    traces = []
    for k in range(trace_samples):
        (ids,), _ = spec.make_batch(1, seed=seed + k)
        traces.append(record_trace(spec.name, spec.model, (ids,), profiles))
    times = median_block_times(traces, profiles)
    name = f"{spec.name}/{spec.config_name}"
    return build_architecture(name, spec.model, spec.network_type, graphs, times,
                              migration_half_bytes=migration_half_bytes)


def make_pilot(spec, *, pilot_path: str | os.PathLike | None = None, architecture: PilotArchitecture | None = None,
               pilot: Pilot | None = None) -> Pilot:
    """A :class:`~pilot.Pilot` (the committed one unless ``pilot_path``/``pilot`` is given) with
    ``spec.model`` attached, ready for ``pilot.predict(spec.model, (ids,))``."""
    pilot = pilot or Pilot(pilot_path)
    pilot.attach(spec.model, architecture or pilot_architecture(spec))
    return pilot
