"""Candidate paths of a dynamic model's static architecture (what the mapping enumerates).

Owns :func:`candidate_paths` and :class:`PathSpaceTooLargeError`. The paper's mapping walks the
static architecture and enumerates every branch at each control flow; our models keep their
control flow in Python, so each family's control structure is written down here once, from the
model's documented path rule (``models.*`` module docstrings):

- ``DepthBERT`` (var-bert / fixed-bert): early exit after every segment's layers:
  ``(0..d-1)`` for ``d = k * layers_per_segment``, ``k = 1..segments``;
- ``MoETransformer``: one branch per expert: ``(attn_l, expert_l_e)`` per layer, ``e`` shared;
- ``StepLSTM`` (var-lstm / fixed-lstm): a loop over time of all layers, ``S`` in
  ``[min_seq, seq]``;
- ``RecycleFormer``: the trunk ``(0..layers-1)`` repeated ``r`` times, ``r = 1..recycles``;
- ``TreeLSTM``: post-order leaf/compose sequences of every binary tree with
  ``min_leaves..max_leaves`` leaves (Catalan-many: bounded by ``limit``).

Enumeration is bounded (``limit``); a larger space raises :class:`PathSpaceTooLargeError`
(Tree-LSTM ``small``, 4..32 leaves, is such a space).
"""

from __future__ import annotations

from functools import lru_cache

from torch import nn

__all__ = ["DEFAULT_PATH_LIMIT", "PathSpaceTooLargeError", "candidate_paths"]

DEFAULT_PATH_LIMIT = 5000


class PathSpaceTooLargeError(ValueError):
    """The static architecture has more candidate paths than the enumeration bound."""


@lru_cache(maxsize=None)
def _trees(leaves: int) -> tuple[tuple[int, ...], ...]:
    """Post-order cell sequences (0 leaf, 1 compose) of every binary tree with ``leaves`` leaves."""
    if leaves == 1:
        return ((0,),)
    out = []
    for left in range(1, leaves):
        for a in _trees(left):
            for b in _trees(leaves - left):
                out.append(a + b + (1,))
    return tuple(out)


def _catalan(n: int) -> int:
    value = 1
    for k in range(n):
        value = value * 2 * (2 * k + 1) // (k + 2)
    return value


def candidate_paths(model: nn.Module, *, limit: int = DEFAULT_PATH_LIMIT) -> list[tuple[int, ...]]:
    """Every path the model's control flow can take, in a deterministic order."""
    from models.moe import MoETransformer
    from models.recycle_former import RecycleFormer
    from models.tree_lstm import TreeLSTM
    from models.var_bert import DepthBERT
    from models.var_lstm import StepLSTM

    config = getattr(model, "config", None)
    if isinstance(model, DepthBERT):
        per = config.layers_per_segment
        paths = [tuple(range(k * per)) for k in range(1, config.segments + 1)]
    elif isinstance(model, MoETransformer):
        stride = config.experts + 1
        paths = [
            tuple(i for layer in range(config.layers) for i in (layer * stride, layer * stride + 1 + e))
            for e in range(config.experts)
        ]
    elif isinstance(model, RecycleFormer):
        paths = [tuple(range(config.layers)) * r for r in range(1, config.recycles + 1)]
    elif isinstance(model, StepLSTM):
        paths = [tuple(range(config.layers)) * s for s in range(config.min_seq, config.seq + 1)]
    elif isinstance(model, TreeLSTM):
        total = sum(_catalan(n - 1) for n in range(config.min_leaves, config.max_leaves + 1))
        if total > limit:
            raise PathSpaceTooLargeError(
                f"TreeLSTM with {config.min_leaves}..{config.max_leaves} leaves has {total} candidate paths "
                f"(> limit {limit}); use a config with fewer leaves or raise the limit"
            )
        paths = [p for n in range(config.min_leaves, config.max_leaves + 1) for p in _trees(n)]
    else:
        raise TypeError(f"no path space is known for {type(model).__name__}; add its control structure to pilot.paths")
    if len(paths) > limit:
        raise PathSpaceTooLargeError(f"{type(model).__name__} has {len(paths)} candidate paths (> limit {limit})")
    return paths
