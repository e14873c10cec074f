"""The least-budget search (graph_passes.planning.minimum) on planners made up for it: monotone,
with needs off the alignment grid, a first estimate that is refused, and plans that are not
monotone in the budget."""

from __future__ import annotations

import dataclasses

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


def test_an_estimate_far_below_still_finds_the_least_budget_under_the_ceiling():
    # 64 probes climbing by 1/16 from 1,000 bytes reach ~50 KB: short of the 10 MB ceiling.
    found, search = least_budget(threshold(5_000_000), refused=1, estimate=1000, ceiling=10_000_000, alignment=64)
    assert found == 5_000_000
    assert search.refused_below(found) >= found - 64


def _stated_minimum(message: str) -> int | None:
    import re

    match = re.search(r"\((\d+) bytes\)", message)
    return int(match.group(1)) if match else None


def test_an_infeasible_message_never_states_a_minimum_at_or_below_the_budget():
    from graph_passes.planning.choice import Infeasible
    from graph_passes.planning.driver import describe_infeasible

    # The H200 run's case: a least need the planner found no plan for, below the budget.
    below = Infeasible(402_653_184, 977_079_719, ("swap", "split"), " (splitting stops at a load or fetch)")
    message = describe_infeasible(below, "cnn")
    assert "is below" not in message and _stated_minimum(message) is None
    assert message.startswith("no plan of cnn with swapping and splitting fits the budget 931.82 MiB")
    above = Infeasible(1_000_000, 500_000, ("swap",))
    assert _stated_minimum(describe_infeasible(above, "cnn")) == 1_000_000 > above.budget_bytes
    for infeasible in (below, above):  # one line, and no pass to try where the graph runs its own plan
        fixed = describe_infeasible(dataclasses.replace(infeasible, passes=()), "g", fixed_plan=True)
        assert "--passes" not in fixed and "transform the original graph again" in fixed and "\n" not in fixed
