"""Provenance metadata on the nodes the passes insert: which pass wrote a node and why.

The keys are the op set's (:mod:`custom_ops.swap`); the IR reads them back, e.g. the lowering
turns the split pass's ``Split`` nodes into views.
"""

from __future__ import annotations

from custom_ops.swap import PASS_KEY, REASON_KEY

SWAP_PASS = "swap"
RECOMPUTE_PASS = "recompute"
SPLIT_PASS = "split"
RECOMPUTE_SOURCE_KEY = "ort_offload.recomputes"  # on a re-run node: the node it re-creates
SPLIT_SOURCE_KEY = "ort_offload.splits"  # on a micro-op: the node it is a piece of

__all__ = ["PASS_KEY", "REASON_KEY", "RECOMPUTE_PASS", "RECOMPUTE_SOURCE_KEY", "SPLIT_PASS", "SPLIT_SOURCE_KEY", "SWAP_PASS"]
