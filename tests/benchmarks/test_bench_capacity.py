"""benchmarks/capacity.py's search: doubling then bisection to the largest batch that trains,
refusals and failed runs counted as not training, the cap reported."""

from __future__ import annotations

import pytest

from benchmarks import capacity
from ort_offload.errors import BudgetTooSmallError, ExecutionError


class _Fake:
    def __init__(self, batch, largest, budget, fail_at=()):
        if batch > largest:
            raise BudgetTooSmallError("too small", needed_bytes=budget + 1, budget_bytes=budget)
        self.batch, self.budget, self.fail_at = batch, budget, fail_at

    def step(self, *args):
        if self.batch in self.fail_at:
            raise ExecutionError("boom")
        return 0.0

    def report(self):
        return {"within_budget": True, "peak_device_bytes": self.budget - self.batch, "split_nodes": self.batch,
                "passes": ["swap"]}


@pytest.mark.parametrize("largest", [4, 5, 37, 64, 100, 128])
def test_the_search_finds_the_largest_batch(monkeypatch, largest):
    budget = 1000
    monkeypatch.setattr(capacity, "_trainer", lambda spec, name, batch, *a: _Fake(batch, largest, budget))
    monkeypatch.setattr(capacity, "_step", lambda trainer, spec, batch, seed: trainer.step())
    settings = capacity.Settings(max_factor=32)
    result = capacity._largest_batch(None, "m", (), settings, budget, "", lambda msg: None)
    assert result["largest_batch"] == min(largest, 128)
    assert result["capped"] == (largest >= 128)
    assert result["split_nodes"] == min(largest, 128)  # from the largest batch's own plan
    tried = [p["batch"] for p in result["probes"]]
    assert len(tried) <= 2 * 6 + 2


def test_a_failed_run_does_not_train_and_is_recorded(monkeypatch):
    monkeypatch.setattr(capacity, "_trainer", lambda spec, name, batch, *a: _Fake(batch, 50, 1000, fail_at=(32,)))
    monkeypatch.setattr(capacity, "_step", lambda trainer, spec, batch, seed: trainer.step())
    result = capacity._largest_batch(None, "m", (), capacity.Settings(), 1000, "", lambda msg: None)
    assert result["largest_batch"] == 31
    assert any(p.get("error", "").startswith("ExecutionError") for p in result["probes"])
