"""The planning registry (graph_passes.planning.strategies): which strategy plans which pass set,
and a strategy registered from outside planning a real training run."""

from __future__ import annotations

import dataclasses

import pytest

from graph_passes.planning import strategies
from graph_passes.planning.strategies import PASSES, Strategy, register, strategy_for
from helpers import train_ort


@pytest.fixture
def registry():
    """The registry as it was, restored after the test."""
    saved = strategies.strategies()
    yield
    strategies._STRATEGIES[:] = saved


@pytest.mark.parametrize("passes, has_loss, chosen", [
    (("swap",), True, "swap"),
    (("swap", "split"), True, "swap"),
    (("recompute",), True, "recompute"),
    (("recompute", "swap"), True, "recompute or swap"),
    (("recompute", "swap", "split"), True, "recompute or swap"),
    (("recompute", "swap"), False, "swap"),  # no loss: nothing to recompute toward
    (("recompute",), False, None),
    (("split",), True, None),  # split is the driver's last resort, not a strategy
    ((), True, None),
])
def test_the_strategy_needing_most_of_the_allowed_passes_is_chosen(passes, has_loss, chosen):
    strategy = strategy_for(passes, has_loss=has_loss)
    assert (strategy.name if strategy else None) == chosen


def test_pass_names_come_from_the_registry():
    from ort_offload.trainer import AVAILABLE_PASSES, resolve_passes

    assert AVAILABLE_PASSES == tuple(PASSES) == ("recompute", "swap", "split")
    with pytest.raises(Exception, match="choose from auto, none, recompute, swap, split"):
        resolve_passes("swapp")


def test_a_strategy_needing_an_unknown_pass_is_refused(registry):
    with pytest.raises(ValueError, match="unknown passes"):
        register(Strategy("teleport", frozenset({"teleport"}), lambda planner, request: None))


def test_a_registered_strategy_plans_the_passes_it_needs(registry, unplanned_mlp):
    calls = []
    swap = next(s for s in strategies.strategies() if s.name == "swap")

    def counted_swap(planner, request):
        calls.append(request.budget)
        proposal = swap.propose(planner, request)
        return dataclasses.replace(proposal, candidates=(("counted swap", 0.0),))

    register(Strategy("counted swap", frozenset({"swap", "split"}), counted_swap))
    run = train_ort("mlp", steps=3, budget="0.5x", passes="auto")
    assert calls and all(b == run.trainer.report()["budget_bytes"] for b in calls)
    assert run.trainer.runner.last_choice == [("counted swap", 0.0)]
    assert run.losses == unplanned_mlp.losses
    assert run.trainer.report()["peak_device_bytes"] <= run.trainer.report()["budget_bytes"]


@pytest.fixture(scope="module")
def unplanned_mlp():
    return train_ort("mlp", steps=3)
