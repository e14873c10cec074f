"""The least-budget search (graph_passes.planning.minimum) on planners made up for it: monotone,
with needs off the alignment grid, a first estimate that is refused, and plans that are not
monotone in the budget."""

from __future__ import annotations

from graph_passes.planning.minimum import least_budget


def threshold(least: int):
    """A planner that accepts every budget from ``least`` on, with a plan needing ``least``."""
    return lambda budget: least if budget >= least else None


def test_a_monotone_planner_gets_its_exact_least_budget():
    found, search = least_budget(threshold(131_136), refused=1, estimate=196_608, ceiling=227_648, alignment=64)
    assert found == 131_136
    assert search.probes[found] is not None
    assert search.refused_below(found) >= found - 64  # one alignment unit less was refused
    assert len(search.probes) <= 20


def test_a_need_off_the_alignment_grid_is_found_exactly():
    found, search = least_budget(threshold(100_003), refused=4096, estimate=150_000, ceiling=200_000, alignment=64)
    assert found == 100_003
    assert search.probes[100_002 // 64 * 64] is None or search.refused_below(found) >= found - 64


def test_a_refused_estimate_is_raised_until_accepted():
    found, _ = least_budget(threshold(120_000), refused=1, estimate=100_000, ceiling=200_000, alignment=64)
    assert found == 120_000


def test_nothing_accepted_up_to_the_ceiling_is_none():
    found, search = least_budget(lambda budget: None, refused=1, estimate=1000, ceiling=2000, alignment=64)
    assert found is None
    assert max(search.probes) == 2000


def test_plans_not_monotone_within_one_percent_are_searched_below():
    # Accepted from 2000 on and in a hole [1975, 1990] just below: the budget 1% under 2000 is in
    # it, so the search goes on down to the hole's bottom.
    def accepts(budget):
        return budget if budget >= 2000 or 1975 <= budget <= 1990 else None

    found, search = least_budget(accepts, refused=1, estimate=3000, ceiling=4000, alignment=1)
    assert found == 1975
    assert accepts(int(found * 0.99)) is None
    assert all(need is None for budget, need in search.probes.items() if budget < found)
