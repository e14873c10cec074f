"""The minimum budget `BudgetTooSmallError` states is exact (issue 23 item 6, issue 27 item 7): for
each tiny model and pass set, the stated budget trains within it, bitwise equal to the unplanned
run, and one alignment unit less (and 1% less) raises `BudgetTooSmallError` stating the same
minimum (never an error at run time). Before, `auto` stated 196,608 B for mlp/gpt/cnn/bert tiny (about 131 KiB trains) and
`recompute` about 3% too much for gpt and bert."""

from __future__ import annotations

import functools

import pytest

from graph_passes.ir.allocator import DEFAULT_ALIGNMENT
from helpers import train_ort
from ort_offload.errors import BudgetTooSmallError

STEPS = 2
FAST = [("mlp", "none"), ("mlp", "swap"), ("mlp", "recompute"), ("mlp", "split"), ("mlp", "auto")]
SLOW = [(name, passes) for name in ("gpt", "cnn", "bert") for passes in ("none", "swap", "recompute", "split", "auto")
        if (name, passes) not in FAST]


@functools.cache
def unplanned(name: str):
    run = train_ort(name, steps=STEPS)
    return run.losses, run.state


def stated_minimum(name: str, passes: str, budget: int) -> int:
    with pytest.raises(BudgetTooSmallError) as refused:
        train_ort(name, steps=1, budget=budget, passes=passes)
    assert refused.value.budget_bytes == budget
    assert "raise the budget to at least that" in str(refused.value)
    return refused.value.needed_bytes


def check_exact_minimum(name: str, passes: str) -> int:
    least = stated_minimum(name, passes, 1)
    run = train_ort(name, steps=STEPS, budget=least, passes=passes)
    report = run.trainer.report()
    assert report["budget_bytes"] == least
    assert report["peak_device_bytes"] <= least and report["within_budget"] is True
    losses, state = unplanned(name)
    assert run.losses == losses  # placement, swaps, recomputation and splits never change numbers
    for key, value in state.items():
        assert run.state[key].tobytes() == value.tobytes(), key
    # One alignment unit less (the grid every tensor is placed on) raises, stating the same.
    assert stated_minimum(name, passes, least - DEFAULT_ALIGNMENT) == least
    return least


@pytest.mark.parametrize("name, passes", FAST)
def test_the_stated_minimum_trains_and_one_percent_less_raises(name, passes):
    least = check_exact_minimum(name, passes)
    assert stated_minimum(name, passes, int(least * 0.99)) == least
    if passes == "auto":
        assert least < 196_608  # what swap alone needs: split plans need less


@pytest.mark.slow
@pytest.mark.parametrize("name, passes", SLOW)
def test_the_stated_minimum_is_exact_for_every_model_and_pass_set(name, passes):
    check_exact_minimum(name, passes)


@pytest.mark.slow
def test_every_budget_above_the_stated_minimum_trains():
    # Plans are not monotone in the budget: with the reference profile the planner alone refuses
    # bert's recompute at 0.5% above its least budget (and plans at 0.25% and 0.75%); such a
    # budget gets the least budget's plan, which fits.
    least = stated_minimum("bert", "recompute", 1)
    for k in range(5):
        budget = int(least * (1 + k / 400))
        report = train_ort("bert", steps=1, budget=budget, passes="recompute").trainer.report()
        assert report["peak_device_bytes"] <= budget and report["within_budget"], budget
