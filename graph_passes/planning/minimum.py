"""The least budget a planner accepts: searched with the planner itself, not estimated.

A planner that finds no plan for a budget knows only the least need of the plans it tried
there; with passes that is not the least budget a plan exists for (split plans need a budget
to aim at, swap and recompute plans made for a tiny budget are not the ones a larger budget
gets). :func:`least_budget` asks the planner: from the estimate (the least need the refusing
planner saw), one alignment unit below it (where the estimate was exact, the search ends there),
then bisection of byte budgets between one the planner refused and one it accepts, on the
allocator's alignment grid; last the accepted plan's own need. The answer is a budget the
planner accepted, and one alignment unit less was refused. Plans need not be monotone in the budget (a plan found for a larger budget is not
always found for a smaller one, and the reverse): the search then checks the budget 1% below
the answer, and where that is accepted too, goes on below it. The answer is always a budget
that was accepted; every budget the search tried below it was refused.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

logger = logging.getLogger(__name__)

# Below the answer, the budgets checked against non-monotone plans (the promise: 1% less fails).
CHECK_BELOW = (0.99,)


@dataclasses.dataclass
class BudgetSearch:
    """The probes of one search: budget -> the accepted plan's own need, or None where refused."""

    accepts: Callable[[int], int | None]
    probes: dict[int, int | None] = dataclasses.field(default_factory=dict)

    def __call__(self, budget: int) -> int | None:
        if budget not in self.probes:
            self.probes[budget] = self.accepts(budget)
        return self.probes[budget]

    def refused_below(self, budget: int) -> int:
        """The largest budget tried below ``budget`` that was refused (0 if none)."""
        return max((b for b, need in self.probes.items() if need is None and b < budget), default=0)


def least_budget(accepts: Callable[[int], int | None], *, refused: int, estimate: int, ceiling: int,
                 alignment: int = 64, max_probes: int = 64) -> tuple[int | None, BudgetSearch]:
    """The least budget ``accepts`` takes, found by probing, and the probes made.

    ``accepts(budget)``: the need (at most ``budget``) of the plan made for ``budget``, or None
    where there is none. ``refused``: a budget known refused; ``estimate``: where to start
    (the least need the refusing planner saw); ``ceiling``: a budget accepted by construction
    (the unplanned graph's own need), above which the search does not go. (None, probes) when
    no budget up to the ceiling was accepted within ``max_probes``."""
    search = BudgetSearch(accepts)
    search.probes[refused] = None
    alignment = max(1, alignment)
    high = _first_accepted(search, max(estimate, refused + 1), ceiling, alignment, max_probes)
    if high is None and ceiling not in search.probes and ceiling > refused and search(ceiling) is not None:
        # The probes ran out on the way up (an estimate far below) and the ceiling plans: bisect below it.
        high, max_probes = ceiling, len(search.probes) + 48
    if high is None:
        return None, search
    if high - alignment > search.refused_below(high):
        search(high - alignment)  # where the estimate was exact, this ends the bisection at once
    while len(search.probes) < max_probes:
        high = _bisect(search, search.refused_below(high), high, alignment, max_probes)
        high = _own_need(search, high)
        lower = next((b for b in (int(high * f) for f in CHECK_BELOW) if 0 < b < high and search(b) is not None), None)
        if lower is None:
            return high, search
        logger.info("the planner accepts %d bytes, 1%% below the least budget found (%d): searching below", lower, high)
        high = lower
    return high, search


def _first_accepted(search: BudgetSearch, start: int, ceiling: int, alignment: int, max_probes: int) -> int | None:
    """The first budget accepted going up from ``start`` in steps of 1/16 (the ceiling last)."""
    budget = start
    while len(search.probes) < max_probes:
        if search(budget) is not None:
            return budget
        if budget >= ceiling:
            return None
        budget = min(ceiling, max(budget + alignment, budget + budget // 16))
    return None


def _bisect(search: BudgetSearch, low: int, high: int, alignment: int, max_probes: int) -> int:
    """Bisect between a refused ``low`` and an accepted ``high`` down to one alignment unit
    (probes on the alignment grid); the least accepted budget found."""
    while high - low > alignment and len(search.probes) < max_probes:
        middle = (low + high) // 2 // alignment * alignment
        if middle <= low:
            middle = (low + high) // 2
        if search(middle) is None:
            low = middle
        else:
            high = middle
    return high


def _own_need(search: BudgetSearch, high: int) -> int:
    """``high``, or the need of the plan accepted there where that is accepted as a budget too
    (needs are not on the alignment grid: a block's workspace is any number of bytes)."""
    while True:
        need = search(high)
        if need is None or need >= high or need <= search.refused_below(high) or search(need) is None:
            return high
        high = need
