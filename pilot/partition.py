"""Partition simulator: groups a path's block invocations into execution blocks (the labels).

Owns :class:`InvocationCost`, :class:`LinkModel`, :func:`simulate`, :func:`partition` (the
optimal grouping under the model below), :func:`even_split` / :func:`best_even_split` (the
paper's three heuristics: equal op count, equal time, equal bytes), :func:`default_migration_half`
and :class:`InfeasiblePartitionError`. Pure functions over small records; nothing here runs a
model.

Model (double-buffered device memory, DyNN-Offload §IV-E; Sentinel's goal "maximize the overlap
between migration and computation without exceeding memory", which the paper does not spell
out). An execution block ``[s, e)`` of the path has compute time ``C`` (sum of its invocations'
times), inbound bytes ``P`` (parameters of the *distinct* blocks it invokes: a block invoked
twice in one execution block is fetched once) and outbound bytes ``A`` (saved activations its
invocations produce, evicted to the host). Its footprint ``P + A`` must fit the migration half
(it was fetched into that half and becomes the work half). While block ``i`` computes, the copy
engine first evicts ``A_i`` and then prefetches ``P_{i+1}`` (evict-then-prefetch, serialized on
one link, as the paper found parallel eviction and prefetch fragmenting); block ``i + 1`` starts
when both are done (the paper's per-block barrier), plus a fixed per-block overhead ``sigma``
(barrier, launch of the copies)::

    T = P_1 / bw + sum_i [ sigma + max(C_i, (A_i + P_{i+1}) / bw) ],   P_{m+1} = 0

Coupling is only between neighbours, so :func:`partition` is an exact dynamic program over
(last execution block, number of blocks) with at most ``max_blocks`` blocks. Paths longer than
``MAX_ATOMS`` invocations are first cut into ``MAX_ATOMS`` even runs ("atoms") that the program
then groups, so long paths stay cheap; below that the result is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_BLOCK_OVERHEAD_S",
    "MAX_ATOMS",
    "MAX_EXECUTION_BLOCKS",
    "EVEN_SPLIT_KINDS",
    "InfeasiblePartitionError",
    "InvocationCost",
    "LinkModel",
    "Simulation",
    "best_even_split",
    "default_migration_half",
    "even_split",
    "partition",
    "simulate",
]

DEFAULT_BANDWIDTH = 12e9
"""Bytes/s of the host link: PCIe 3.0 x16 as achieved in practice (~12 GB/s), the paper's link."""
DEFAULT_BLOCK_OVERHEAD_S = 10e-6
"""Per-execution-block cost of the barrier and the copy launches (s)."""
MAX_EXECUTION_BLOCKS = 8
"""Most execution blocks per path (the pilot's output slots). The paper reports O(10)."""
MAX_ATOMS = 64
EVEN_SPLIT_KINDS = ("ops", "time", "bytes")


class InfeasiblePartitionError(ValueError):
    """No grouping into at most ``max_blocks`` execution blocks fits the migration half."""


@dataclass(frozen=True)
class InvocationCost:
    """One block invocation of a path: which block, its ops, compute time (s), the block's
    parameter bytes, and the saved-activation bytes this invocation produces."""

    block: int
    ops: int
    time_s: float
    param_bytes: int
    saved_bytes: int


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Device and link: bytes of the migration half, link bandwidth (bytes/s), per-block
    overhead (s), most execution blocks."""

    migration_half_bytes: int
    bandwidth: float = DEFAULT_BANDWIDTH
    block_overhead_s: float = DEFAULT_BLOCK_OVERHEAD_S
    max_blocks: int = MAX_EXECUTION_BLOCKS

    def __post_init__(self) -> None:
        if self.migration_half_bytes <= 0 or self.bandwidth <= 0 or self.block_overhead_s < 0 or self.max_blocks < 1:
            raise ValueError(f"invalid link model {self}")


@dataclass(frozen=True)
class Simulation:
    """Simulated time of one grouping, the footprint of each execution block and whether all fit."""

    time_s: float
    footprints: tuple[int, ...]
    fits: bool


def _block_stats(costs: Sequence[InvocationCost], start: int, end: int) -> tuple[float, int, int]:
    chunk = costs[start:end]
    params = {c.block: c.param_bytes for c in chunk}
    return sum(c.time_s for c in chunk), sum(params.values()), sum(c.saved_bytes for c in chunk)


def simulate(costs: Sequence[InvocationCost], blocks: Sequence[tuple[int, int]], link: LinkModel) -> Simulation:
    """Replay ``blocks`` (half-open ranges tiling ``costs``) under the model of the module docstring."""
    if not blocks:
        return Simulation(0.0, (), True)
    stats = [_block_stats(costs, s, e) for s, e in blocks]
    footprints = tuple(p + a for _, p, a in stats)
    time_s = stats[0][1] / link.bandwidth
    for i, (compute, _, saved) in enumerate(stats):
        prefetch = stats[i + 1][1] if i + 1 < len(stats) else 0
        time_s += link.block_overhead_s + max(compute, (saved + prefetch) / link.bandwidth)
    return Simulation(time_s, footprints, all(f <= link.migration_half_bytes for f in footprints))


def _atoms(n: int) -> list[int]:
    """Boundaries of at most MAX_ATOMS even runs over ``n`` invocations (0 and n included)."""
    if n <= MAX_ATOMS:
        return list(range(n + 1))
    return sorted({round(i * n / MAX_ATOMS) for i in range(MAX_ATOMS + 1)})


def partition(costs: Sequence[InvocationCost], link: LinkModel) -> tuple[tuple[int, int], ...]:
    """Execution blocks of least simulated time with every footprint within the migration half
    and at most ``link.max_blocks`` blocks (ties: fewer blocks, then earlier cuts). Raises
    :class:`InfeasiblePartitionError` when no grouping fits."""
    n = len(costs)
    if n == 0:
        return ()
    cuts = _atoms(n)
    m = len(cuts) - 1
    bw, sigma, cap = link.bandwidth, link.block_overhead_s, link.migration_half_bytes
    C = np.full((m + 1, m + 1), np.inf)
    P = np.full((m + 1, m + 1), np.inf)
    A = np.full((m + 1, m + 1), np.inf)
    for s in range(m):
        for e in range(s + 1, m + 1):
            c, p, a = _block_stats(costs, cuts[s], cuts[e])
            if p + a <= cap:
                C[s, e], P[s, e], A[s, e] = c, p, a
    inf = np.inf
    # dp[s, e]: least time of [0, cuts[e]) as k blocks, the last [s, e), counting every block but
    # the last, plus the first prefetch. back[k][s, e]: start of the block before [s, e).
    dp = np.full((m + 1, m + 1), inf)
    dp[0, 1:] = P[0, 1:] / bw
    best_time, best = inf, None
    backs: list[np.ndarray] = []
    for k in range(1, link.max_blocks + 1):
        final = dp[:m, m] + sigma + np.maximum(C[:m, m], A[:m, m] / bw)
        s_best = int(np.argmin(final))
        if final[s_best] < best_time - 1e-15:
            best_time, best = float(final[s_best]), (k, s_best)
        if k == link.max_blocks:
            break
        nxt = np.full((m + 1, m + 1), inf)
        back = np.zeros((m + 1, m + 1), dtype=np.int64)
        for s in range(1, m):
            prev = dp[:s, s]  # over s' < s
            if not np.isfinite(prev).any():
                continue
            step = prev[:, None] + sigma + np.maximum(C[:s, s][:, None], (A[:s, s][:, None] + P[s, s + 1 :][None, :]) / bw)
            arg = np.argmin(step, axis=0)
            nxt[s, s + 1 :] = step[arg, np.arange(m - s)]
            back[s, s + 1 :] = arg
        backs.append(back)
        dp = nxt
    if best is None or not np.isfinite(best_time):
        raise InfeasiblePartitionError(
            f"no grouping of {n} invocations into <= {link.max_blocks} execution blocks fits a migration half of "
            f"{link.migration_half_bytes} bytes; give a larger half (see default_migration_half)"
        )
    k, s = best
    bounds = [m]
    e = m
    while k > 1:
        prev_s = int(backs[k - 2][s, e])
        bounds.append(s)
        e, s, k = s, prev_s, k - 1
    bounds.append(0)
    bounds = bounds[::-1]
    return tuple((cuts[a], cuts[b]) for a, b in zip(bounds, bounds[1:]))


def even_split(costs: Sequence[InvocationCost], parts: int, by: str) -> tuple[tuple[int, int], ...]:
    """``parts`` execution blocks of about equal ``by`` (``ops``, ``time`` or ``bytes``: the
    invocation's parameter plus saved bytes); fewer when the path is shorter."""
    if by not in EVEN_SPLIT_KINDS:
        raise ValueError(f"even split by {by!r}: expected one of {', '.join(EVEN_SPLIT_KINDS)}")
    n = len(costs)
    if n == 0:
        return ()
    weight = {
        "ops": lambda c: float(c.ops),
        "time": lambda c: c.time_s,
        "bytes": lambda c: float(c.param_bytes + c.saved_bytes),
    }[by]
    cumulative = np.cumsum([weight(c) for c in costs])
    total = cumulative[-1]
    bounds = [0]
    for t in range(1, parts):
        cut = int(np.searchsorted(cumulative, total * t / parts - 1e-12 * total)) + 1
        if bounds[-1] < cut < n:
            bounds.append(cut)
    bounds.append(n)
    return tuple(zip(bounds, bounds[1:]))


def best_even_split(costs: Sequence[InvocationCost], link: LinkModel, by: str) -> tuple[tuple[int, int], ...] | None:
    """The even split by ``by`` with the number of parts (1..max_blocks) of least simulated time
    among those that fit; None when none fits."""
    best, best_time = None, np.inf
    for parts in range(1, link.max_blocks + 1):
        blocks = even_split(costs, parts, by)
        result = simulate(costs, blocks, link)
        if result.fits and result.time_s < best_time - 1e-15:
            best, best_time = blocks, result.time_s
    return best


HALF_IN_INVOCATIONS = 4
"""The default migration half holds this many of the model's largest block invocations."""


def _greedy_blocks(costs: Sequence[InvocationCost], cap: int) -> int | None:
    """Blocks greedy packing needs under ``cap`` (None if one invocation alone exceeds it)."""
    blocks, start = 0, 0
    while start < len(costs):
        end = start
        while end < len(costs):
            _, p, a = _block_stats(costs, start, end + 1)
            if p + a > cap:
                break
            end += 1
        if end == start:
            return None
        blocks, start = blocks + 1, end
    return blocks


def default_migration_half(paths_costs: Sequence[Sequence[InvocationCost]], max_blocks: int = MAX_EXECUTION_BLOCKS) -> int:
    """The device's migration half for a model: :data:`HALF_IN_INVOCATIONS` times its largest
    invocation footprint, doubled until every given path fits ``max_blocks`` blocks (greedy
    packing). It depends on the blocks, not on which paths the family allows, so two models
    made of the same blocks (fixed- and var-LSTM) get the same half and the same labels for
    the same path."""
    largest = max((c.param_bytes + c.saved_bytes for costs in paths_costs for c in costs), default=1)
    half = HALF_IN_INVOCATIONS * max(largest, 1)
    while any((_greedy_blocks(costs, half) or max_blocks + 1) > max_blocks for costs in paths_costs):
        half *= 2
    return int(half)
