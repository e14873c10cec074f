"""Shared pieces of the pilot tests: each tiny dynamic model and its pilot architecture, built
once per test process (block exports go to the session's export cache)."""

from __future__ import annotations

from functools import lru_cache

FAMILIES = ("var-bert", "fixed-bert", "moe", "tree-lstm", "var-lstm", "fixed-lstm", "recycle-former")


@lru_cache(maxsize=None)
def spec_and_architecture(family: str):
    from models.dynamic import get_dynamic_model
    from ort_offload.dynamic.pilot_support import pilot_architecture

    spec = get_dynamic_model(family, "tiny")
    return spec, pilot_architecture(spec, trace_samples=4)


@lru_cache(maxsize=None)
def block_graphs(family: str):
    from ort_offload.dynamic.pilot_support import block_graphs as export

    spec, _ = spec_and_architecture(family)
    return export(spec)
